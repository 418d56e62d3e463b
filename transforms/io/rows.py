"""THE row reader: rows out of JSONL / JSON / Parquet files, local or remote, with one error policy.

:func:`iter_rows` yields ``(row, record, None)`` for each good row and ``(row, None, reason)``
for each bad one; every pipeline (prep, decon, generate) reads its inputs through it.

Formats: ``.jsonl`` / ``.jsonl.gz`` / ``.jsonl.zst`` are read a block of lines at a time
(:func:`line_blocks`: a read of up to :data:`READ_BYTES`, split at ``\n``; an uncompressed
``.jsonl`` also by byte range, so that several units can share one big file) and parsed a
block at a time (:func:`parse_json_lines`; :func:`iter_row_blocks` gives the blocks, and
:func:`iter_rows` their rows one by one); ``.json``
(optionally ``.gz``/``.zst``) holds an array of objects, streamed one element at a time;
``.parquet`` is read in record batches of :data:`PARQUET_BATCH_ROWS` rows, optionally only
a range of row groups and only some columns; ``.arrow`` (Arrow IPC, as Hugging Face
``datasets``' ``save_to_disk`` writes it) one record batch at a time.

Bounds (hostile or huge input): decompression is bounded per read (:func:`storage.open_read`);
no row larger than ``max_row_bytes`` (default :data:`DEFAULT_MAX_ROW_BYTES`, prep's
``--max-row-bytes``) is kept. A longer JSONL line or ``.json`` array element is read to
its end in pieces of :data:`READ_BYTES` without being held (beyond the block it lies in), and a parquet/arrow row whose
values are larger is never turned into Python objects; either becomes the bad row ``row
too large: more than N bytes`` and the rows after it are read as usual. So a reader holds
about one row (at most the cap) plus one piece or one record batch; parquet and arrow
still decode a whole page or record batch of the file, however large its writer made it.

Error policy (the same for every reader):

- A row that is not a JSON object (malformed JSON, invalid UTF-8, a blank line, an array...),
  that is too large, or whose values cannot be held (a number of more than 4,300 digits,
  arrays/objects nested more than :data:`MAX_DEPTH` deep) is a bad row with its reason;
  reading goes on with the next row.
- A file whose content cannot be read to the end (a truncated gzip, a zstd stream cut
  mid-frame, a corrupt parquet file, a JSON array cut short, malformed or not an array)
  yields one final ``corrupt file after N rows: ...`` row: nothing vanishes silently.
- A file that cannot be *accessed* (gone, no permission, network down:
  :data:`ACCESS_ERRORS`) raises: the unit fails and is retried by the next run, instead of
  recording a permanent rejection.

JSON lines are parsed with orjson; a line orjson refuses goes through the standard library
parser, which decides (and words the reason), so both give the same rows. So does a row in
which orjson rounded an integer beyond 64 bits to a float: integers are read exactly, and
``str(record["id"])`` is the id's decimal string.
"""
from __future__ import annotations

import gzip
import json
import re
import zlib
from io import BufferedIOBase, BufferedReader, RawIOBase
from typing import IO, Any, Callable, Iterator, Literal, NamedTuple, cast, overload

import orjson

from refinery.transforms.io import storage


class SourceRow(NamedTuple):
    """A row with its provenance, as :func:`iter_rows` reads it: ``path`` the file, ``row``
    its 0-based number there, ``record`` the parsed object, ``relpath`` the file's path
    relative to the folder the user named (it spells a fallback document id). prep's
    ``ReadRows`` yields these, and decon's transforms take them to report where a row came from."""

    path: str
    row: int
    record: dict[str, Any]
    relpath: str = ""

Row = tuple[int, "dict[str, Any] | None", "str | None"]  # (0-based row, record or None, error or None)

CORRUPT = "corrupt file"  # how the reason of a file's last row begins when the file is corrupt or cut short
DEFAULT_MAX_ROW_BYTES = 64 << 20  # admits the 50 MB documents the tests use
READ_BYTES = 1 << 20  # the piece a line over the cap, or a .json array, is read in
PARQUET_BATCH_ROWS = 128  # rows decoded at a time

# Errors that say a file could not be *accessed*, not that its content is bad.
ACCESS_ERRORS = (FileNotFoundError, PermissionError, ConnectionError, TimeoutError)
# Errors that say a compressed or structured file's content is damaged.
CONTENT_ERRORS = (EOFError, OSError, zlib.error, gzip.BadGzipFile, ValueError, storage.paths.ZstdError)


class Unusable(Exception):
    """Valid JSON whose values cannot be held (a number too long, nesting too deep); the
    message is the reason of the bad row."""


MAX_DEPTH = 256  # arrays/objects nested in a row, the row itself included
TOO_DEEP = f"row nested too deep: more than {MAX_DEPTH} levels of arrays and objects"
_INT64 = float(1 << 63)


def _check(value: object) -> bool:
    """Raise :class:`Unusable` when ``value`` nests more than :data:`MAX_DEPTH` arrays and
    objects (deeper rows break recursive code downstream); True when it holds a float
    outside the int64 range, which is how orjson reads an integer beyond 64 bits."""
    if type(value) is not dict and type(value) is not list:
        return False
    rounded = False
    stack: list[tuple[Any, int]] = [(value, 1)]  # iterative: a deep row must not exhaust the Python stack here
    while stack:
        obj, depth = stack.pop()
        for v in obj.values() if type(obj) is dict else obj:
            t = type(v)
            if t is float:
                rounded = rounded or not -_INT64 < v < _INT64
            elif t is dict or t is list:
                if depth >= MAX_DEPTH:
                    raise Unusable(TOO_DEEP)
                stack.append((v, depth + 1))
    return rounded


def _stdlib_loads(text: str) -> Any:
    """``json.loads``, its integers exact; :class:`Unusable` for a number it cannot convert
    (more than ``sys.get_int_max_str_digits()`` digits) or a row nested too deep. Malformed
    JSON raises ``json.JSONDecodeError``."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise Unusable(TOO_DEEP) from None
    except json.JSONDecodeError:
        raise
    except ValueError as e:  # "Exceeds the limit (4300 digits) for integer string conversion: ..."
        raise Unusable(f"number out of range: {str(e).split(';')[0]}") from None
    _check(value)
    return value


def _exact(data: bytes, value: Any) -> Any:
    """orjson's ``value`` of ``data``, or the standard library's where orjson rounded an
    integer beyond 64 bits to a float (so ``str(record["id"])`` is its exact decimal)."""
    return _stdlib_loads(data.decode("utf-8")) if _check(value) else value


def _as_row(value: object) -> tuple[dict[str, Any] | None, str | None]:
    if isinstance(value, dict):
        return value, None
    return None, f"row is a JSON {type(value).__name__}, not an object"


def _json_fallback(line: bytes) -> tuple[dict[str, Any] | None, str | None]:
    try:
        text = line.decode("utf-8")  # strict UTF-8 (json.loads(bytes) would sniff UTF-16)
    except UnicodeDecodeError as e:
        return None, f"invalid UTF-8 at byte {e.start}"
    try:
        return _as_row(_stdlib_loads(text))
    except json.JSONDecodeError as e:
        if not line.strip():
            return None, "blank line"
        # some of json's messages end in "at" ("Unterminated string starting at"): one "at" only
        return None, f"malformed JSON: {e.msg.removesuffix(' at')} at column {e.colno}"
    except Unusable as e:
        return None, str(e)


def parse_json_line(line: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """(record, None) or (None, reason) for one JSONL line (a trailing ``\\n``/``\\r\\n`` is ignored)."""
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError:
        if line.endswith(b"\n"):
            line = line[:-1]
        if line.endswith(b"\r"):
            line = line[:-1]
        return _json_fallback(line)
    try:
        return _as_row(_exact(line, value))
    except Unusable as e:
        return None, str(e)


def parse_json_element(element: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """(record, None) or (None, reason) for one element of a ``.json`` array. A malformed
    element raises orjson's ``JSONDecodeError``: the array's file is corrupt."""
    try:
        value = orjson.loads(element)
    except orjson.JSONDecodeError as e:
        try:  # orjson refuses some valid JSON (a 5,000-digit number, deep nesting): the standard library decides
            value = _stdlib_loads(element.decode("utf-8"))
        except Unusable as u:
            return None, str(u)
        except ValueError:  # malformed (a JSONDecodeError or UnicodeDecodeError)
            raise e from None
        return _as_row(value)
    try:
        return _as_row(_exact(element, value))
    except Unusable as e:
        return None, str(e)


def too_large(max_row_bytes: int) -> str:
    """The reason given for a row over the size cap."""
    return f"row too large: more than {max_row_bytes} bytes"


def open_lines(path: str, compression: str | None = None) -> BufferedIOBase:
    """``path`` opened for reading lines: a reader whose ``read1(n)`` gives at most ``n`` bytes
    and whose ``readline(limit)`` honours the limit (fsspec's remote files take no limit, so
    they get a buffer of their own)."""
    f = storage.open_read(path, compression)
    # an fsspec file: raw reads (readinto) that BufferedReader buffers
    return f if isinstance(f, BufferedIOBase) else BufferedReader(cast(RawIOBase, f), READ_BYTES)


def _skip_line(f: BufferedIOBase, line: bytes) -> int:
    """Read the rest of a line whose start was ``line``, in pieces; returns its size."""
    size = len(line)
    while not line.endswith(b"\n") and (line := f.readline(READ_BYTES)):
        size += len(line)
    return size


class LineBlock(NamedTuple):
    """Consecutive lines of a JSON lines file, as :func:`line_blocks` reads them: each line's
    bytes without its ``\n`` (None for a line over the row cap); ``open_end``: the last line
    is the file's last and has no ``\n``; ``starts``: each line's first byte in the file,
    given only when the reader was asked to stop at a byte (a range's end)."""

    lines: list[bytes | None]
    open_end: bool = False
    starts: list[int] | None = None


def _cut(data: bytes, start: int, max_row_bytes: int) -> tuple[list[bytes | None], int]:
    """The lines ``data[start:]`` ends (each without its ``\n``, None over the cap) and where
    the unended rest begins."""
    last = data.rfind(b"\n")
    if last < start:
        return [], start
    lines: list[bytes | None] = list(data[start:last].split(b"\n"))
    if last - start > max_row_bytes:  # (a line can be over the cap only in a block longer than it)
        lines = [line if line is None or len(line) <= max_row_bytes else None for line in lines]
    return lines, last + 1


def line_blocks(f: BufferedIOBase, max_row_bytes: int, at: int = 0, stop: int | None = None
                ) -> Iterator[LineBlock]:
    """THE lines of the JSON lines file ``f`` (:func:`open_lines`), a block per read of up to
    :data:`READ_BYTES` (``read1``). A line longer than ``max_row_bytes`` (its ``\n`` not
    counted) is None, read to its end without being held: memory holds a block and at most
    one line up to the cap. ``at``: the file position ``f`` is at; ``stop``: give each block
    its lines' ``starts`` (the caller keeps the lines that start before ``stop``). A read that
    raises (damage: a truncated gzip) raises after the block of the lines it completed."""
    head: list[bytes] = []  # the start of the line the last read cut (within the cap)
    head_size, skipping, pos = 0, False, at  # in a line over the cap; the file position of data[0]
    line_start = at  # where the next line starts
    while data := f.read1(READ_BYTES):
        lines: list[bytes | None] = []
        starts: list[int] | None = [] if stop is not None else None
        begin = 0
        if head or skipping:  # the line a read cut goes on
            nl = data.find(b"\n")
            if nl < 0:
                if not skipping:
                    head.append(data)
                    head_size += len(data)
                    if head_size > max_row_bytes:  # too large: said now, its rest dropped as it comes
                        head, head_size, skipping = [], 0, True
                        yield LineBlock([None], False, [line_start] if stop is not None else None)
                pos += len(data)
                continue
            if not skipping:
                line = b"".join(head) + data[:nl]
                lines.append(line if len(line) <= max_row_bytes else None)
                if starts is not None:
                    starts.append(line_start)
            head, head_size, skipping, begin = [], 0, False, nl + 1
            line_start = pos + begin
        ended, rest = _cut(data, begin, max_row_bytes)
        if starts is not None and ended:
            sizes = [0] + [len(x) + 1 if x is not None else 0 for x in ended]
            if any(x is None for x in ended):  # (sizes of lines over the cap, from the raw bytes)
                sizes = [0] + [len(x) + 1 for x in data[begin:rest - 1].split(b"\n")]
            acc = line_start
            for size in sizes[:-1]:
                acc += size
                starts.append(acc)
        lines += ended
        line_start = pos + rest
        if rest < len(data):  # a line the read cut
            if len(data) - rest > max_row_bytes:
                lines.append(None)
                if starts is not None:
                    starts.append(line_start)
                skipping = True
            else:
                head, head_size = [data[rest:]], len(data) - rest
        pos += len(data)
        if lines:
            yield LineBlock(lines, False, starts)
    if head:  # the file's last line, without a "\n"
        yield LineBlock([b"".join(head)], True, [line_start] if stop is not None else None)


def _blank(line: bytes | None) -> bool:
    """A line of nothing but JSON whitespace (spaces, tabs, ``\r``, ``\n``)."""
    return line is not None and not line.strip(_JSON_SPACE)


class RowLines(NamedTuple):
    """Lines of :func:`row_lines`: ``rows`` (the lines that are rows, in order) then
    ``after``, blank lines that are not rows (those that end the file); ``open_end`` as
    :class:`LineBlock`'s (for the last of ``rows`` or of ``after``, whichever is last)."""

    rows: list[bytes | None]
    after: list[bytes | None]
    open_end: bool


def row_lines(blocks: Iterator[LineBlock], more_after: Callable[[], bool] = lambda: False) -> Iterator[RowLines]:
    """The rows among the lines of ``blocks`` (:func:`line_blocks`): the blank lines that end
    the file are not rows (an editor's final empty line). A blank line with a row after it
    is one (a bad row, "blank line"): row numbers stay those of the file's lines.
    ``more_after()``: whether a row follows the last block (a byte range's end is not
    always the file's)."""
    held: list[bytes | None] = []
    open_end = False
    for block in blocks:
        lines, open_end = block.lines, block.open_end
        last = len(lines) - 1
        while last >= 0 and _blank(lines[last]):
            last -= 1
        if last < 0:
            held += lines
            continue
        rows = [*held, *lines[:last + 1]] if held else lines[:last + 1]
        yield RowLines(rows, [], open_end and last == len(lines) - 1)
        held = lines[last + 1:]
    if held:
        yield RowLines(held, [], open_end) if more_after() else RowLines([], held, open_end)


class JsonLine(NamedTuple):
    """One line of a JSON lines file as :func:`jsonl_lines` reads it: ``row``, its 0-based row
    number (None: one of the blank lines that end the file, not a row); ``line``, its bytes
    with their line end (None for a line over the row cap, and for the damage); ``record`` and
    ``error``, the row :func:`iter_rows` gives for it."""

    row: int | None
    line: bytes | None
    record: dict[str, Any] | None
    error: str | None


class RowBlock(NamedTuple):
    """Consecutive rows of a file, as :func:`iter_row_blocks` reads them: ``records[k]`` and
    ``errors[k]`` are row ``first + k`` (a record, or None and the reason); ``lines``: for a
    JSON lines file, each row's bytes without its ``\n`` (None over the cap, and for the
    damage), else None; ``open_end``: the last of them is the file's last line, without a ``\n``."""

    first: int
    records: list[dict[str, Any] | None]
    errors: list[str | None]
    lines: list[bytes | None] | None = None
    open_end: bool = False


def parse_json_lines(lines: list[bytes | None], max_row_bytes: int) -> tuple[list[dict[str, Any] | None],
                                                                             list[str | None]]:
    """(records, errors) of JSON lines: :func:`parse_json_line` of each (None: a line over the
    cap, :func:`too_large`), with orjson in one loop; a line orjson refuses, or whose value
    may be one orjson reads otherwise than the standard library (a nested value, a float: see
    :func:`_exact`), goes through :func:`parse_json_line` itself."""
    records: list[dict[str, Any] | None] = []
    errors: list[str | None] = []
    loads, flat, slow = orjson.loads, _FLAT_TYPES.issuperset, parse_json_line
    for line in lines:
        if line is None:
            records.append(None)
            errors.append(too_large(max_row_bytes))
            continue
        try:
            value = loads(line)
        except orjson.JSONDecodeError:
            value = None
        if type(value) is dict and flat(map(type, value.values())):  # nothing nested, no float: as it is
            records.append(value)
            errors.append(None)
        else:
            record, error = slow(line)
            records.append(record)
            errors.append(error)
    return records, errors


_FLAT_TYPES = frozenset({str, int, bool, type(None)})  # values _check has nothing to look at in


def plain_json_lines(lines: list[bytes | None]) -> list[bool]:
    """Per JSON line (None: over the cap), whether every string it holds is plain ASCII: tabs,
    newlines and printable characters only, so that such a text needs nothing of
    ``normalize_text`` but the strip. True when the line's bytes are ASCII, hold no DEL and no
    escape but ``\\n``, ``\\t``, ``\\"``, ``\\\\`` and ``\\/`` (a raw control character is not
    valid JSON). Three byte scans in C per line, no look at the parsed values."""
    return [line is not None and line.isascii() and b"\x7f" not in line
            and (b"\\" not in line or _NOT_PLAIN_ESCAPE.search(line.replace(b"\\\\", b"")) is None)
            for line in lines]


_NOT_PLAIN_ESCAPE = re.compile(rb'\\[^nt"/]')  # \uXXXX, \r, \b, \f, once the escaped backslashes are gone


def jsonl_row_blocks(parts: Iterator[RowLines], max_row_bytes: int) -> Iterator[RowBlock | RowLines]:
    """The rows of :func:`row_lines` a block at a time (:class:`RowBlock`, numbered from 0),
    parsed (:func:`parse_json_lines`), and the blank lines that end the file as they come
    (the :class:`RowLines` with ``after``)."""
    row = 0
    for part in parts:
        if part.after:
            yield part
            continue
        records, errors = parse_json_lines(part.rows, max_row_bytes)
        yield RowBlock(row, records, errors, part.rows, part.open_end)
        row += len(part.rows)


def _jsonl_file_blocks(f: BufferedIOBase, max_row_bytes: int) -> Iterator[RowBlock | RowLines]:
    """:func:`jsonl_row_blocks` of a whole file; damage (a truncated gzip, a zstd frame cut
    short) ends them with the bad row ``corrupt file after N rows: ...`` (the blank lines
    before it, not yet rows, are dropped)."""
    rows = 0
    try:
        for part in jsonl_row_blocks(row_lines(line_blocks(f, max_row_bytes)), max_row_bytes):
            if isinstance(part, RowBlock):
                rows = part.first + len(part.records)
            yield part
    except CONTENT_ERRORS as e:
        if isinstance(e, ACCESS_ERRORS):
            raise
        yield RowBlock(rows, [None], [corrupt_reason(rows, e)], [None])


def jsonl_lines(f: BufferedIOBase, max_row_bytes: int) -> Iterator[JsonLine]:
    """Every line of the JSON lines file ``f`` (:func:`open_lines`), with the row
    :func:`iter_rows` makes of it (``iter_rows(path, lines=True)`` opens the file and reads it
    so: what ``refinery clean`` copies). A line longer than ``max_row_bytes`` (its ``\\n`` not
    counted) is read to its end in pieces, never held, and is the bad row :func:`too_large`;
    damage (a truncated gzip, a zstd frame cut short) ends the lines with the bad row
    ``corrupt file after N rows: ...`` (the blank lines before it, not yet rows, are dropped)."""
    return _lines_of(_jsonl_file_blocks(f, max_row_bytes))


def _lines_of(parts: Iterator[RowBlock | RowLines]) -> Iterator[JsonLine]:
    """Each line of ``parts`` (:func:`jsonl_row_blocks`' blocks and end lines) with its row."""
    for part in parts:
        if isinstance(part, RowLines):
            last = len(part.after) - 1
            for k, line in enumerate(part.after):
                yield JsonLine(None, _ended(line, part.open_end and k == last), None, None)
            continue
        lines = part.lines or []
        last = len(lines) - 1
        for k, (line, record, error) in enumerate(zip(lines, part.records, part.errors)):
            yield JsonLine(part.first + k, _ended(line, part.open_end and k == last), record, error)


def _ended(line: bytes | None, open_end: bool) -> bytes | None:
    """A line's bytes with their ``\\n`` (none for the file's last line without one)."""
    return line if line is None or open_end else line + b"\n"


def corrupt_reason(rows: int, e: BaseException) -> str:
    """The reason of a file's last row when its content cannot be read on after ``rows`` rows."""
    return f"{CORRUPT} after {rows} rows: {type(e).__name__}: {e}"


def _jsonl_parts(path: str, max_row_bytes: int) -> Iterator[RowBlock | RowLines]:
    """:func:`_jsonl_file_blocks` of the whole file ``path``, opened here: damage met opening
    or closing it (a compressed file's header) ends them with the bad row too. THE reading
    of a JSON lines file: its rows (:func:`iter_rows`) and, with their bytes, its lines
    (``iter_rows(path, lines=True)``) are the same parts."""
    rows = 0
    try:
        with open_lines(path, compression="infer") as f:
            for part in _jsonl_file_blocks(f, max_row_bytes):
                if isinstance(part, RowBlock):
                    rows = part.first + len(part.records)
                yield part
    except CONTENT_ERRORS as e:  # opening or closing the file (a compressed file's header)
        if isinstance(e, ACCESS_ERRORS):
            raise
        yield RowBlock(rows, [None], [corrupt_reason(rows, e)], [None])


def _iter_jsonl(path: str, max_row_bytes: int) -> Iterator[RowBlock]:
    return (part for part in _jsonl_parts(path, max_row_bytes) if isinstance(part, RowBlock))


def _iter_jsonl_range(path: str, lo: int, hi: int, max_row_bytes: int) -> Iterator[RowBlock]:
    """Rows of an uncompressed JSONL file whose first byte lies in ``[lo, hi)``, numbered
    from 0 within the range (the caller adds the rows of the ranges before it)."""
    with open_lines(path) as f:
        if lo > 0:
            f.seek(lo - 1)
            _skip_line(f, b"")  # the rest of the line holding byte lo-1 belongs to the previous range
        blocks = line_blocks(f, max_row_bytes, f.tell(), hi)
        beyond: list[LineBlock] = []

        def in_range() -> Iterator[LineBlock]:
            for block in blocks:
                starts = block.starts or []
                keep = sum(1 for s in starts if s < hi)  # (they ascend)
                if keep:
                    yield LineBlock(block.lines[:keep], block.open_end and keep == len(starts))
                if keep < len(starts):
                    beyond.append(LineBlock(block.lines[keep:]))
                    return

        def more_after() -> bool:  # a row after this range's trailing blank lines, in a later range
            return any(not _blank(line) for b in (*beyond, *blocks) for line in b.lines)

        for part in jsonl_row_blocks(row_lines(in_range(), more_after), max_row_bytes):
            if isinstance(part, RowBlock):
                yield part


_JSON_SPACE = b" \t\n\r"
_STRUCTURE = re.compile(rb'[\[\]{}",]')  # the bytes that matter outside a JSON string


def _string_end(buf: bytes, i: int) -> tuple[int, bool]:
    """Where the JSON string that ``buf[i:]`` continues ends (the index just after its
    closing quote), or ``(-1, escaped)`` when it goes on past ``buf``: ``escaped`` when
    ``buf`` ends in a backslash that escapes the next piece's first byte."""
    lo = i
    while (j := buf.find(b'"', i)) >= 0:
        k = j
        while k > lo and buf[k - 1] == 0x5C:  # the backslashes just before the quote
            k -= 1
        if (j - k) % 2 == 0:
            return j + 1, False
        i = j + 1
    end = len(buf)
    k = end
    while k > lo and buf[k - 1] == 0x5C:
        k -= 1
    return -1, (end - k) % 2 == 1


def json_array_elements(f: IO[bytes], max_row_bytes: int) -> Iterator[bytes | None]:
    """The elements of the JSON array that ``f`` holds, read in pieces of :data:`READ_BYTES`:
    each element's bytes, or None for one longer than ``max_row_bytes`` (read to its end,
    never held whole). Only the array's frame is checked here (strings, nesting, commas);
    an element's own syntax is left to whoever parses its bytes. Raises ValueError when
    the content is not one array, EOFError when it ends inside the array."""
    state = "before"  # -> "inside" the array -> "after" it
    in_string = escaped = False  # inside a string of the element; its next byte escaped
    depth = size = elements = 0  # nesting inside the current element; its size so far; elements seen
    parts: list[bytes] = []  # the current element's bytes, while within the cap
    while buf := f.read(READ_BYTES):
        if state == "after":
            if buf.strip(_JSON_SPACE):
                raise ValueError("data after the end of the array")
            continue
        if state == "before":
            buf = buf.lstrip(_JSON_SPACE)
            if not buf:
                continue
            if buf[:1] != b"[":
                raise ValueError(f".json input must hold an array of objects, found {buf[:1].decode('latin-1')!r}")
            state, buf = "inside", buf[1:]
        i = start = 0  # scan position; where the current element's bytes in buf begin
        while i < len(buf):
            if in_string:
                i, escaped = _string_end(buf, i + escaped)
                if i < 0:
                    break
                in_string = False
            m = _STRUCTURE.search(buf, i)
            if m is None:
                break
            j = m.start()
            c, i = buf[j:j + 1], j + 1
            if c == b'"':
                in_string = True
            elif c in b"[{":
                depth += 1
            elif depth > 0:  # "]", "}" or "," inside the element
                if c != b",":
                    depth -= 1
            elif c == b"}":
                raise ValueError("unexpected '}' in the array")
            else:  # "," or "]": the element ends at j
                size += j - start
                element = b"".join(parts + [buf[start:j]]).strip(_JSON_SPACE) if size <= max_row_bytes else None
                if element is None or element:
                    yield element
                    elements += 1
                elif c == b"," or elements:
                    raise ValueError("empty element in the array")
                parts, size, start = [], 0, i
                if c == b"]":
                    state = "after"
                    if buf[i:].strip(_JSON_SPACE):
                        raise ValueError("data after the end of the array")
                    break
        if state == "inside":
            size += len(buf) - start
            if size <= max_row_bytes:
                parts.append(buf[start:])
            else:
                parts.clear()
    if state == "before":
        raise ValueError(".json input must hold an array of objects, found an empty file")
    if state == "inside":
        raise EOFError("file ends inside the array (cut short)")


def _iter_json_array(path: str, max_row_bytes: int) -> Iterator[Row]:
    row = 0
    try:
        with storage.open_read(path, compression="infer") as f:
            for element in json_array_elements(f, max_row_bytes):
                yield (row, None, too_large(max_row_bytes)) if element is None else (row, *parse_json_element(element))
                row += 1
    except CONTENT_ERRORS as e:  # orjson.JSONDecodeError is a ValueError: a malformed element
        if isinstance(e, ACCESS_ERRORS):
            raise
        yield row, None, f"{CORRUPT} after {row} rows: {type(e).__name__}: {e}"


def parquet_row_groups(path: str) -> list[int]:
    """Number of rows in each row group of a parquet file."""
    import pyarrow.parquet as pq

    with storage.open_read(path) as f:
        meta = pq.ParquetFile(f).metadata
        return [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]


def _batch_rows(batch: Any, max_row_bytes: int) -> Iterator[tuple[dict[str, Any] | None, str | None]]:
    """(record, None) or (None, too-large reason) for each row of an Arrow record batch; a
    row whose values take more than ``max_row_bytes`` is never turned into Python objects."""
    if batch.nbytes <= max_row_bytes:
        for record in batch.to_pylist():
            yield record, None
        return
    for i in range(batch.num_rows):
        one = batch.slice(i, 1)
        yield (None, too_large(max_row_bytes)) if one.nbytes > max_row_bytes else (one.to_pylist()[0], None)


def _iter_parquet(path: str, row_groups: tuple[int, int] | None, columns: list[str] | None,
                  max_row_bytes: int) -> Iterator[Row]:
    import pyarrow.parquet as pq

    row = 0
    try:
        with storage.open_read(path) as f:
            pf = pq.ParquetFile(f)
            meta = pf.metadata
            lo, hi = row_groups if row_groups else (0, meta.num_row_groups)
            row = sum(meta.row_group(i).num_rows for i in range(lo))
            names = set(pf.schema_arrow.names)
            cols = [c for c in columns if c in names] if columns is not None else None
            batches = pf.iter_batches(PARQUET_BATCH_ROWS, row_groups=range(lo, hi), columns=cols) if lo < hi else []
            for batch in batches:
                for record, error in _batch_rows(batch, max_row_bytes):
                    yield row, record, error
                    row += 1
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError for corrupt files
        if isinstance(e, ACCESS_ERRORS):
            raise
        yield row, None, f"{CORRUPT} after {row} rows: {type(e).__name__}: {e}"


def _iter_arrow(path: str, max_row_bytes: int) -> Iterator[Row]:
    """Rows of an Arrow IPC file, stream format (what ``datasets`` writes) or file format,
    one record batch at a time."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    row = 0
    try:
        with storage.open_read(path) as f:
            try:
                reader = ipc.open_stream(f)
            except pa.ArrowInvalid:
                f.seek(0)
                file_reader = ipc.open_file(f)
                reader = (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
            for batch in reader:
                for record, error in _batch_rows(batch, max_row_bytes):
                    yield row, record, error
                    row += 1
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid/OSError for corrupt files
        if isinstance(e, ACCESS_ERRORS):
            raise
        yield row, None, f"{CORRUPT} after {row} rows: {type(e).__name__}: {e}"


def iter_row_blocks(path: str, row_groups: tuple[int, int] | None = None, columns: list[str] | None = None,
                    byte_range: tuple[int, int] | None = None,
                    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES) -> Iterator[RowBlock]:
    """The rows of :func:`iter_rows`, many at a time (:class:`RowBlock`): a JSON lines file's
    a read of up to :data:`READ_BYTES` at a time (with their lines), other formats'
    :data:`BLOCK_ROWS` rows at a time. The same arguments, rows, numbers and reasons."""
    if storage.has_suffix(path, ".parquet", ".arrow", ".json", ".json.gz", ".json.zst"):
        if storage.has_suffix(path, ".parquet"):
            rows = _iter_parquet(path, row_groups, columns, max_row_bytes)
        elif storage.has_suffix(path, ".arrow"):
            rows = _iter_arrow(path, max_row_bytes)
        else:
            rows = _iter_json_array(path, max_row_bytes)
        block: list[Row] = []
        for item in rows:
            block.append(item)
            if len(block) >= BLOCK_ROWS:
                yield RowBlock(block[0][0], [r for _, r, _ in block], [e for _, _, e in block])
                block = []
        if block:
            yield RowBlock(block[0][0], [r for _, r, _ in block], [e for _, _, e in block])
    elif byte_range is not None:
        yield from _iter_jsonl_range(path, *byte_range, max_row_bytes)
    else:
        yield from _iter_jsonl(path, max_row_bytes)


BLOCK_ROWS = 1024  # rows of a parquet, arrow or .json file a block holds


@overload
def iter_rows(path: str, row_groups: tuple[int, int] | None = None, columns: list[str] | None = None,
              byte_range: tuple[int, int] | None = None, max_row_bytes: int = DEFAULT_MAX_ROW_BYTES, *,
              lines: Literal[False] = False) -> Iterator[Row]: ...


@overload
def iter_rows(path: str, row_groups: None = None, columns: None = None, byte_range: None = None,
              max_row_bytes: int = DEFAULT_MAX_ROW_BYTES, *, lines: Literal[True]) -> Iterator[JsonLine]: ...


def iter_rows(path: str, row_groups: tuple[int, int] | None = None, columns: list[str] | None = None,
              byte_range: tuple[int, int] | None = None, max_row_bytes: int = DEFAULT_MAX_ROW_BYTES, *,
              lines: bool = False) -> Iterator[Row] | Iterator[JsonLine]:
    """Rows of a data file as (0-based row, record, None) or (row, None, reason).

    ``row_groups=(lo, hi)``: only those parquet row groups (rows still numbered from the
    file's start); ``columns``: only those parquet columns (None = every column);
    ``byte_range=(lo, hi)``: only the lines of an uncompressed ``.jsonl`` that start in that
    byte range (rows numbered from 0 within the range); ``max_row_bytes``: a larger row is
    a bad row (:func:`too_large`), read past without being held whole.

    ``lines=True`` (a whole JSON lines file): every line instead, with its bytes
    (:class:`JsonLine`: the row number and the record or reason of these rows, the line's
    bytes with their end; the blank lines that end the file come too, with no row), read by
    the same parts as the rows, so that a line's bytes and its row number cannot disagree:
    what ``refinery clean`` copies.
    """
    if lines:
        if row_groups is not None or columns is not None or byte_range is not None \
                or not storage.has_suffix(path, ".jsonl", ".jsonl.gz", ".jsonl.zst"):
            raise ValueError(f"{path}: iter_rows(lines=True) reads a whole JSON lines file")
        return _lines_of(_jsonl_parts(path, max_row_bytes))
    return _rows_of(iter_row_blocks(path, row_groups, columns, byte_range, max_row_bytes))


def _rows_of(blocks: Iterator[RowBlock]) -> Iterator[Row]:
    for block in blocks:
        yield from zip(range(block.first, block.first + len(block.records)), block.records, block.errors)
