"""THE row reader: rows out of JSONL / JSON / Parquet files, local or remote, with one error policy.

:func:`iter_rows` yields ``(row, record, None)`` for each good row and ``(row, None, reason)``
for each bad one; every pipeline (prep, decon, generate) reads its inputs through it.

Formats: ``.jsonl`` / ``.jsonl.gz`` / ``.jsonl.zst`` are read line by line (an uncompressed
``.jsonl`` also by byte range, so that several units can share one big file); ``.json``
(optionally ``.gz``/``.zst``) holds an array of objects; ``.parquet`` is read one row group at a
time, optionally only a range of row groups and only some columns; ``.arrow`` (Arrow IPC, as
Hugging Face ``datasets``' ``save_to_disk`` writes it) one record batch at a time.

Error policy (the same for every reader):

- A row that is not a JSON object (malformed JSON, invalid UTF-8, a blank line, an array...)
  is a bad row with its reason; reading goes on with the next row.
- A file whose content cannot be read to the end (a truncated gzip, a zstd stream cut
  mid-frame, a corrupt parquet file or JSON array) yields one final ``corrupt file after N
  rows: ...`` row: nothing vanishes silently.
- A file that cannot be *accessed* (gone, no permission, network down:
  :data:`ACCESS_ERRORS`) raises: the unit fails and is retried by the next run, instead of
  recording a permanent rejection.

JSON lines are parsed with orjson; a line orjson refuses goes through the standard library
parser, which decides (and words the reason), so both give the same rows.
"""
from __future__ import annotations

import gzip
import json
import zlib
from typing import Iterator

import orjson

from refinery.transforms.core import io

try:
    from zstandard import ZstdError as _ZstdError
except ImportError:  # pragma: no cover - zstandard is a core dependency
    class _ZstdError(Exception):
        pass

Row = tuple[int, "dict | None", "str | None"]  # (0-based row, record or None, error or None)

# Errors that say a file could not be *accessed*, not that its content is bad.
ACCESS_ERRORS = (FileNotFoundError, PermissionError, ConnectionError, TimeoutError)
# Errors that say a compressed or structured file's content is damaged.
CONTENT_ERRORS = (EOFError, OSError, zlib.error, gzip.BadGzipFile, ValueError, _ZstdError)


def _json_fallback(line: bytes) -> tuple[dict | None, str | None]:
    try:
        record = json.loads(line.decode("utf-8"))  # strict UTF-8 (json.loads(bytes) would sniff UTF-16)
    except UnicodeDecodeError as e:
        return None, f"invalid UTF-8 at byte {e.start}"
    except json.JSONDecodeError as e:
        if not line.strip():
            return None, "blank line"
        return None, f"malformed JSON: {e.msg} at column {e.colno}"
    if not isinstance(record, dict):
        return None, f"row is a JSON {type(record).__name__}, not an object"
    return record, None


def parse_json_line(line: bytes) -> tuple[dict | None, str | None]:
    """(record, None) or (None, reason) for one JSONL line (a trailing ``\\n``/``\\r\\n`` is ignored)."""
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        if line.endswith(b"\n"):
            line = line[:-1]
        if line.endswith(b"\r"):
            line = line[:-1]
        return _json_fallback(line)
    if isinstance(record, dict):
        return record, None
    return None, f"row is a JSON {type(record).__name__}, not an object"


def _iter_jsonl(path: str) -> Iterator[Row]:
    row = 0
    try:
        with io.open_read(path, compression="infer") as f:
            for line in f:
                record, error = parse_json_line(line)
                yield row, record, error
                row += 1
    except CONTENT_ERRORS as e:
        if isinstance(e, ACCESS_ERRORS):
            raise
        yield row, None, f"corrupt file after {row} rows: {type(e).__name__}: {e}"


def _iter_jsonl_range(path: str, lo: int, hi: int) -> Iterator[Row]:
    """Rows of an uncompressed JSONL file whose first byte lies in ``[lo, hi)``, numbered
    from 0 within the range (the caller adds the rows of the ranges before it)."""
    with io.open_read(path) as f:
        if lo > 0:
            f.seek(lo - 1)
            f.readline()  # the rest of the line holding byte lo-1 belongs to the previous range
        pos = f.tell()
        row = 0
        while pos < hi:
            line = f.readline()
            if not line:
                break
            pos += len(line)
            record, error = parse_json_line(line)
            yield row, record, error
            row += 1


def _iter_json_array(path: str) -> Iterator[Row]:
    try:
        with io.open_read(path, compression="infer") as f:
            data = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, *CONTENT_ERRORS) as e:
        if isinstance(e, ACCESS_ERRORS):
            raise
        yield 0, None, f"corrupt file: {type(e).__name__}: {e}"
        return
    if not isinstance(data, list):
        yield 0, None, f"corrupt file: .json input must hold an array of objects, found {type(data).__name__}"
        return
    for row, record in enumerate(data):
        if isinstance(record, dict):
            yield row, record, None
        else:
            yield row, None, f"row is a JSON {type(record).__name__}, not an object"


def parquet_row_groups(path: str) -> list[int]:
    """Number of rows in each row group of a parquet file."""
    import pyarrow.parquet as pq

    with io.open_read(path) as f:
        meta = pq.ParquetFile(f).metadata
        return [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]


def _iter_parquet(path: str, row_groups: tuple[int, int] | None, columns: list[str] | None) -> Iterator[Row]:
    import pyarrow.parquet as pq

    row = 0
    try:
        with io.open_read(path) as f:
            pf = pq.ParquetFile(f)
            meta = pf.metadata
            lo, hi = row_groups if row_groups else (0, meta.num_row_groups)
            row = sum(meta.row_group(i).num_rows for i in range(lo))
            names = set(pf.schema_arrow.names)
            cols = [c for c in columns if c in names] if columns is not None else None
            for g in range(lo, hi):
                table = pf.read_row_group(g, columns=cols)
                for batch in table.to_batches(max_chunksize=4096):
                    for record in batch.to_pylist():
                        yield row, record, None
                        row += 1
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError for corrupt files
        if isinstance(e, ACCESS_ERRORS):
            raise
        yield row, None, f"corrupt file after {row} rows: {type(e).__name__}: {e}"


def _iter_arrow(path: str) -> Iterator[Row]:
    """Rows of an Arrow IPC file, stream format (what ``datasets`` writes) or file format,
    one record batch at a time."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    row = 0
    try:
        with io.open_read(path) as f:
            try:
                reader = ipc.open_stream(f)
            except pa.ArrowInvalid:
                f.seek(0)
                file_reader = ipc.open_file(f)
                reader = (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
            for batch in reader:
                for record in batch.to_pylist():
                    yield row, record, None
                    row += 1
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid/OSError for corrupt files
        if isinstance(e, ACCESS_ERRORS):
            raise
        yield row, None, f"corrupt file after {row} rows: {type(e).__name__}: {e}"


def iter_rows(path: str, row_groups: tuple[int, int] | None = None, columns: list[str] | None = None,
              byte_range: tuple[int, int] | None = None) -> Iterator[Row]:
    """Rows of a data file as (0-based row, record, None) or (row, None, reason).

    ``row_groups=(lo, hi)``: only those parquet row groups (rows still numbered from the
    file's start); ``columns``: only those parquet columns (None = every column);
    ``byte_range=(lo, hi)``: only the lines of an uncompressed ``.jsonl`` that start in that
    byte range (rows numbered from 0 within the range).
    """
    if path.endswith(".parquet"):
        yield from _iter_parquet(path, row_groups, columns)
    elif path.endswith(".arrow"):
        yield from _iter_arrow(path)
    elif path.endswith((".json", ".json.gz", ".json.zst")):
        yield from _iter_json_array(path)
    elif byte_range is not None:
        yield from _iter_jsonl_range(path, *byte_range)
    else:
        yield from _iter_jsonl(path)
