"""clean: a copy of training files, in their own format, without what decon found overlapping.

``refinery clean --train PATH... --exclude-overlaps DECON_OUTPUT... --output DIR`` writes
each training file to ``DIR/<relpath>`` (its path relative to the ``--train`` argument it
came from) in the same format (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``, ``.parquet``),
its rows in the same order, less the rows decon's drop lists name (row mode) or, in span
mode, with each listed row replaced by the pieces :func:`~refinery.transforms.prep.span_cut.cut_row`
keeps of it, each a row of its own. The drop lists and their checks are prep's
(:class:`~refinery.transforms.prep.exclusion.Exclusion`), so ``refinery prep`` of the copy
tokenizes the documents ``refinery prep --exclude-overlaps`` of the original does.

Stages (each resumable, see ``refinery.transforms.resumable``)::

    clean     unit = a training file -> DIR/<relpath>, written atomically
    manifest  one unit: the units' counts -> DIR/_clean_manifest.json, then DIR/.SUCCESS;
              fails when the listed rows met are not the rows the drop lists name

Exact: a kept row of a JSON lines file is its line's bytes, unchanged (:func:`raw_rows`
numbers the lines as :func:`~refinery.transforms.io.rows.iter_rows`, the reader decon and
prep number rows with, does); a parquet file keeps its schema (field order, types,
metadata) and is filtered with pyarrow; gzip is written without a name and with mtime 0,
zstd single-threaded, so a rerun, or a killed run finished, writes the same bytes.

The per-file work is pure functions of a reader and a writer (:func:`copy_jsonl`,
:func:`copy_parquet`) that the tests call without Beam.
"""
from __future__ import annotations

import contextlib
import gzip
import json
from dataclasses import dataclass, field
from io import BufferedIOBase, BufferedReader, RawIOBase
from typing import IO, Any, Iterator, Mapping, NamedTuple, Sequence, TypedDict, cast

import numpy as np
import zstandard

from refinery.transforms.io import storage
from refinery.transforms.io.jsonl import json_line
from refinery.transforms.io.positioned import PositionedWriter
from refinery.transforms.io.rows import (
    ACCESS_ERRORS,
    CONTENT_ERRORS,
    CORRUPT,
    DEFAULT_MAX_ROW_BYTES,
    READ_BYTES,
    parse_json_line,
)
from refinery.transforms.io.text import TextSpec, normalize_text
from refinery.transforms.prep.exclusion import Exclusion
from refinery.transforms.prep.span_cut import SpanRules, cut_row, piece_id
from refinery.transforms.prep.stages import check_unchanged
from refinery.transforms.resumable import Stage, StageConfig, StageRun, Traits, Unit, UnitContext, short_hash

FORMATS = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")  # what clean copies (any case)
MANIFEST = "_clean_manifest.json"  # "_": prep, decon (and pyarrow, Spark) do not list it as data
SUCCESS = ".SUCCESS"
GZIP_LEVEL = 6
ZSTD_LEVEL = 3
_JSON_SPACE = b" \t\n\r"


def unsupported_inputs(paths: list[str]) -> list[str]:
    """The paths whose format clean cannot copy as it is."""
    return [p for p in paths if not storage.has_suffix(p, *FORMATS)]


# ---------------------------------------------------------------------------------------
# What to do with one file's rows, and what was done
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RowPlan:
    """One file's listed rows (``drop``: file-global 0-based row numbers, as ``iter_rows``
    numbers them) and, in span mode (``rules`` set), the overlapping spans of each listed row
    that has them (a listed row without spans, one decon could not read, is left out whole);
    ``text_field``/``id_field``: where a piece's text and id go."""

    drop: frozenset[int]
    spans: Mapping[int, np.ndarray] = field(default_factory=dict)
    rules: SpanRules | None = None
    text_field: str = "text"
    id_field: str = "id"


class _FileStatsBase(TypedDict):
    rows_read: int
    rows_kept: int
    rows_left_out: int  # listed rows met (left out whole, or, in span mode, replaced by their pieces)


class FileStats(_FileStatsBase, total=False):
    """A clean unit's receipt stats (one training file); the span keys in span mode only."""

    rows_split: int        # listed rows replaced by the pieces kept of them (possibly none: all too short)
    rows_dropped: int      # listed rows left out whole: more holes than --exclude-max-splits, or no spans
    pieces: int            # pieces written, each a row
    pieces_too_short: int  # pieces shorter than --exclude-min-chars (or blank once normalized), dropped
    chars_removed: int     # characters of the split and dropped rows' texts not written
    corrupt: str           # the file's content ends in damage decon listed: the copy holds the rows before it


SPAN_KEYS = ("rows_split", "rows_dropped", "pieces", "pieces_too_short", "chars_removed")
FILE_KEYS = ("rows_read", "rows_kept", "rows_left_out", *SPAN_KEYS, "corrupt")  # a file's record, in this order


@dataclass
class _Counts:
    rows_read: int = 0
    rows_kept: int = 0
    rows_left_out: int = 0
    rows_split: int = 0
    rows_dropped: int = 0
    pieces: int = 0
    pieces_too_short: int = 0
    chars_removed: int = 0
    corrupt: str = ""

    def stats(self, span: bool) -> FileStats:
        out: FileStats = {"rows_read": self.rows_read, "rows_kept": self.rows_kept,
                          "rows_left_out": self.rows_left_out}
        if span:
            out["rows_split"], out["rows_dropped"], out["pieces"] = self.rows_split, self.rows_dropped, self.pieces
            out["pieces_too_short"], out["chars_removed"] = self.pieces_too_short, self.chars_removed
        if self.corrupt:
            out["corrupt"] = self.corrupt
        return out


def row_pieces(record: dict[str, Any], row: int, plan: RowPlan, counts: _Counts, path: str) -> list[dict[str, Any]]:
    """Span mode: the rows that replace the listed ``row`` (``record``): one per piece kept,
    the row's object with its text field set to the piece's text (cut from the text as read)
    and, when the row has an id, its id set to :func:`piece_id`; none when the row is dropped
    whole; a piece blank once normalized is dropped, as too short (prep makes no document of
    it). :class:`ValueError` naming the file and row when the row's text is not one decon
    could have read (no text, spans past its end)."""
    assert plan.rules is not None
    spans = plan.spans.get(row)
    if spans is None:  # listed without spans: a row decon could not read, left out whole
        counts.rows_dropped += 1
        return []
    text, error = TextSpec.of(plan.text_field).extract(record)
    if text is None:
        raise ValueError(f"{path}: row {row}: {error}, but decon's spans file lists spans of its text: the file is "
                         "not what decon read")
    try:
        cut = cut_row(len(text), spans, plan.rules)
    except ValueError as e:
        raise ValueError(f"{path}: row {row}: {e}") from None
    counts.pieces_too_short += cut.too_short
    counts.chars_removed += cut.removed_chars
    if cut.dropped:
        counts.rows_dropped += 1
        return []
    counts.rows_split += 1
    row_id = record.get(plan.id_field)
    pieces = []
    for a, b in cut.pieces:
        if not normalize_text(text[a:b]):  # blank once normalized: no document (prep counts it so too)
            counts.pieces_too_short += 1
            continue
        obj = {**record, plan.text_field: text[a:b]}
        if row_id is not None:
            obj[plan.id_field] = piece_id(str(row_id), a)
        pieces.append(obj)
    counts.pieces += len(pieces)
    return pieces


# ---------------------------------------------------------------------------------------
# JSON lines: the raw lines, numbered as iter_rows numbers rows
# ---------------------------------------------------------------------------------------

class RawRow(NamedTuple):
    """One line of a JSON lines file as :func:`raw_rows` reads it: ``row``, its row number as
    ``iter_rows`` gives it (None: a blank line at the file's end, not a row); ``line``, its
    bytes with their line end (None for a line over the row cap); ``rest``, for such a line,
    its bytes in pieces (read as they are asked for; those not asked for are skipped);
    ``corrupt``: the reason the file could not be read on (the last item: ``row`` is the one
    ``iter_rows`` gives its ``corrupt file`` row)."""

    row: int | None
    line: bytes | None
    rest: Iterator[bytes] | None = None
    corrupt: str | None = None


def _long_line(f: BufferedIOBase, first: bytes) -> Iterator[bytes]:
    """A line over the cap, from its first piece, in pieces of :data:`READ_BYTES`."""
    piece = first
    yield piece
    while not piece.endswith(b"\n") and (piece := f.readline(READ_BYTES)):
        yield piece


def raw_rows(f: BufferedIOBase, max_row_bytes: int) -> Iterator[RawRow]:
    """The lines of ``f`` with the row numbers ``iter_rows`` gives them: a line longer than
    ``max_row_bytes`` (its ``\\n`` not counted) is one row, never held whole; a blank line
    (JSON whitespace only) is a row when a row follows it, and the blank lines that end the
    file are none (an editor's final empty line); damage (a truncated gzip, a zstd frame cut
    short) ends the rows with a ``corrupt`` item, as ``iter_rows`` ends them with a bad row."""
    row = 0
    held: list[bytes] = []
    try:
        while line := f.readline(max_row_bytes + 1):
            if len(line) <= max_row_bytes or line.endswith(b"\n"):
                if not line.strip(_JSON_SPACE):
                    held.append(line)
                    continue
                long = None
            else:
                long = _long_line(f, line)
            for blank in held:
                yield RawRow(row, blank)
                row += 1
            held.clear()
            if long is None:
                yield RawRow(row, line)
            else:
                yield RawRow(row, None, long)
                for _ in long:  # what the reader did not ask for
                    pass
            row += 1
    except CONTENT_ERRORS as e:
        if isinstance(e, ACCESS_ERRORS):
            raise
        yield RawRow(row, None, corrupt=f"{CORRUPT} after {row} rows: {type(e).__name__}: {e}")
        return
    for blank in held:
        yield RawRow(None, blank)


def open_lines(path: str) -> BufferedIOBase:
    """``path`` opened for reading lines, decompressed by its suffix (as ``iter_rows`` opens it)."""
    f = storage.open_read(path, compression="infer")
    return f if isinstance(f, BufferedIOBase) else BufferedReader(cast(RawIOBase, f), READ_BYTES)


@contextlib.contextmanager
def compressed_writer(out: storage.BinaryWriter, path: str) -> Iterator[storage.BinaryWriter]:
    """A writer into ``out`` that compresses as ``path``'s suffix says: gzip without a file name
    and with mtime 0, zstd single-threaded (the same bytes on every run), or none."""
    if storage.has_suffix(path, ".gz"):
        with gzip.GzipFile(filename="", mode="wb", compresslevel=GZIP_LEVEL, mtime=0,
                           fileobj=cast("IO[bytes]", out)) as gz:
            yield gz
    elif storage.has_suffix(path, ".zst"):
        with zstandard.ZstdCompressor(level=ZSTD_LEVEL).stream_writer(cast("IO[bytes]", out), closefd=False) as z:
            yield cast(storage.BinaryWriter, z)
    else:
        yield out


def copy_jsonl(rows: Iterator[RawRow], out: storage.BinaryWriter, plan: RowPlan, path: str) -> FileStats:
    """Write the rows of :func:`raw_rows` to ``out`` as ``plan`` says: a kept row's line as it
    is, a listed row left out, or in span mode replaced by its pieces (:func:`row_pieces`),
    each ``json.dumps(obj, ensure_ascii=False)`` and a newline; the blank lines that end the
    file are copied. A damaged file whose damage decon listed (its last row) is copied up
    to the damage; damage decon did not list raises :class:`storage.InputError`."""
    c = _Counts()
    for r in rows:
        if r.row is None:
            assert r.line is not None
            out.write(r.line)
            continue
        c.rows_read += 1
        if r.corrupt is not None:
            if r.row not in plan.drop:
                raise storage.InputError(f"{path}: {r.corrupt}; decon did not list it (the file changed, or was not "
                                         "scanned): replace the file, or run decon on it again")
            c.rows_left_out += 1
            c.rows_dropped += plan.rules is not None
            c.corrupt = r.corrupt
            break
        if r.row not in plan.drop:
            c.rows_kept += 1
            if r.line is not None:
                out.write(r.line)
            else:
                assert r.rest is not None
                for piece in r.rest:
                    out.write(piece)
            continue
        c.rows_left_out += 1
        if plan.rules is None:
            continue
        record, error = parse_json_line(r.line) if r.line is not None else (None, "row too large")
        if record is None:
            if r.row in plan.spans:
                raise ValueError(f"{path}: row {r.row}: {error}, but decon's spans file lists spans of it: the file "
                                 "is not what decon read")
            c.rows_dropped += 1
            continue
        for obj in row_pieces(record, r.row, plan, c, path):
            out.write(json_line(obj))
    return c.stats(plan.rules is not None)


# ---------------------------------------------------------------------------------------
# Parquet: the same schema, rows filtered with pyarrow
# ---------------------------------------------------------------------------------------

_CODECS = {"UNCOMPRESSED": "none", "SNAPPY": "snappy", "GZIP": "gzip", "BROTLI": "brotli", "ZSTD": "zstd",
           "LZ4": "lz4", "LZ4_RAW": "lz4"}


def _codec(meta: Any) -> str:
    """The compression of a parquet file's first column chunk (snappy, pyarrow's default, when
    it has none or one pyarrow does not write)."""
    if meta.num_row_groups and meta.num_columns:
        return _CODECS.get(str(meta.row_group(0).column(0).compression).upper(), "snappy")
    return "snappy"


def _string_column(table: Any, name: str, path: str) -> Any:
    import pyarrow as pa

    column = table.column(name)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise ValueError(f"{path}: column {name!r} is {column.type}, not a string: a piece's text or id cannot be "
                         "put into it (--exclude-mode span)")
    return column.combine_chunks()


def _cut_group(table: Any, base: int, listed: np.ndarray, plan: RowPlan, c: _Counts, path: str) -> Any:
    """Span mode: a row group with listed rows -> its kept rows and the pieces of its listed
    rows, in row order (each piece a copy of its row, its text and, when the row has one,
    id replaced)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    take: list[np.ndarray] = []
    texts: list[str] = []
    ids: list[str | None] = []
    start = 0
    for p in np.flatnonzero(listed).tolist():
        take.append(np.arange(start, p, dtype=np.int64))
        start = p + 1
        record = table.slice(p, 1).to_pylist()[0]
        pieces = row_pieces(record, base + p, plan, c, path)
        take.append(np.full(len(pieces), p, dtype=np.int64))
        texts += [obj[plan.text_field] for obj in pieces]
        ids += [obj[plan.id_field] if record.get(plan.id_field) is not None else None for obj in pieces]
    take.append(np.arange(start, table.num_rows, dtype=np.int64))
    order = np.concatenate(take)
    out = table.take(pa.array(order))
    is_piece = listed[order]  # a listed row's index in the order: one of its pieces
    if not texts:
        return out
    i = out.schema.get_field_index(plan.text_field)
    column = _string_column(out, plan.text_field, path)
    out = out.set_column(i, out.schema.field(i),
                         pc.replace_with_mask(column, pa.array(is_piece), pa.array(texts, column.type)))
    with_id = [k for k, v in zip(np.flatnonzero(is_piece).tolist(), ids) if v is not None]
    if with_id:
        j = out.schema.get_field_index(plan.id_field)
        column = _string_column(out, plan.id_field, path)
        mask = np.zeros(len(order), dtype=bool)
        mask[with_id] = True
        out = out.set_column(j, out.schema.field(j),
                             pc.replace_with_mask(column, pa.array(mask), pa.array([v for v in ids if v is not None],
                                                                                   column.type)))
    return out


def copy_parquet(f: IO[bytes], out: storage.BinaryWriter, plan: RowPlan, path: str) -> FileStats:
    """Write the parquet file ``f`` to ``out`` as ``plan`` says, a row group at a time (one row
    group written per row group read, empty ones left out), with its schema (field order,
    types, metadata) and compression: row mode filters each row group (``Table.filter``);
    span mode replaces each listed row by its pieces (:func:`row_pieces`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(f)
    meta = pf.metadata
    drop = np.fromiter(sorted(plan.drop), dtype=np.int64, count=len(plan.drop))
    c = _Counts()
    writer = pq.ParquetWriter(pa.PythonFile(PositionedWriter(out), mode="w"), pf.schema_arrow, compression=_codec(meta))
    base = 0
    for g in range(meta.num_row_groups):
        table = pf.read_row_group(g)
        n = table.num_rows
        listed = np.isin(np.arange(base, base + n, dtype=np.int64), drop)
        left_out = int(listed.sum())
        c.rows_read += n
        c.rows_left_out += left_out
        c.rows_kept += n - left_out
        if left_out and plan.rules is None:
            table = table.filter(pa.array(~listed))
        elif left_out:
            table = _cut_group(table, base, listed, plan, c, path)
        if table.num_rows:
            writer.write_table(table)
        base += n
    writer.close()
    return c.stats(plan.rules is not None)


def copy_file(path: str, out: storage.BinaryWriter, plan: RowPlan, max_row_bytes: int) -> FileStats:
    """The copy of the training file ``path`` (a :data:`FORMATS` file) into ``out``."""
    if storage.has_suffix(path, ".parquet"):
        with storage.open_read(path) as f:
            return copy_parquet(f, out, plan, path)
    if not storage.has_suffix(path, *FORMATS):
        raise ValueError(f"{path}: clean copies {', '.join(FORMATS)} files only")
    with open_lines(path) as f, compressed_writer(out, path) as w:
        return copy_jsonl(raw_rows(f, max_row_bytes), w, plan, path)


# ---------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------

@dataclass
class CleanConfig:
    inputs: list[storage.InputFile]
    output: str
    exclude: Exclusion
    text_field: str = "text"
    text_template: str | None = None  # row mode only: span mode cannot put pieces back into several fields
    id_field: str = "id"
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES
    num_inputs: int = -1  # len(inputs); kept when a job carries the config without its input list

    def __post_init__(self) -> None:
        self.num_inputs = len(self.inputs)

    @property
    def text(self) -> TextSpec:
        return TextSpec.from_options(None, self.text_template, self.text_field)

    def __getstate__(self) -> dict[str, Any]:
        """What a job carries: the settings, not the input list (the workers read the plan)."""
        return {**self.__dict__, "inputs": None}


class CleanPayload(TypedDict):
    path: str
    relpath: str
    fingerprint: dict[str, Any]


class CleanStage(Stage[CleanPayload, FileStats]):
    """Unit: one training file -> ``DIR/<relpath>``, its rows in order."""

    name = "clean"

    def __init__(self, cfg: CleanConfig):
        self.cfg = cfg

    def traits(self) -> Traits:
        return Traits(title="Clean files", final_outputs=True, progress_text=self._progress_text)

    def config(self) -> StageConfig:
        cfg = self.cfg
        settings = {**cfg.text.identity(), "id_field": cfg.id_field, "max_row_bytes": cfg.max_row_bytes,
                    "exclude": cfg.exclude.identity(), "gzip_level": GZIP_LEVEL, "zstd_level": ZSTD_LEVEL,
                    "relpaths": short_hash([f.relpath for f in cfg.inputs])}
        return StageConfig(settings, [f.fingerprint() for f in cfg.inputs])

    def make_plan(self) -> list[Unit[CleanPayload]]:
        return [Unit(f"{i:05d}", CleanPayload(path=f.path, relpath=f.relpath, fingerprint=f.fingerprint()))
                for i, f in enumerate(self.cfg.inputs)]

    def run_unit(self, unit: Unit[CleanPayload], ctx: UnitContext) -> FileStats:
        cfg, p = self.cfg, unit.payload
        check_unchanged(p)
        exclude = cfg.exclude
        plan = RowPlan(exclude.rows_of(p["path"]), exclude.spans_of(p["path"]) if exclude.rules else {},
                       exclude.rules, cfg.text_field, cfg.id_field)
        with ctx.open_write(ctx.output_path(p["relpath"])) as out:
            stats = copy_file(p["path"], out, plan, cfg.max_row_bytes)
        check_unchanged(p)  # what was read is what was planned
        return stats

    def _progress_text(self, stats: Mapping[str, Any], seconds: float) -> str:
        return f"rows={int(stats.get('rows_read', 0)):,} left out={int(stats.get('rows_left_out', 0)):,}"


class CleanManifestPayload(TypedDict):
    """The manifest unit's payload: nothing (one unit, ``manifest``)."""


class CleanManifestStats(TypedDict):
    files: int
    rows_read: int
    rows_kept: int
    rows_left_out: int


def totals(files: Sequence[Mapping[str, Any]], span: bool) -> dict[str, int]:
    """The per-file counts summed (the span keys in span mode only)."""
    keys = ("rows_read", "rows_kept", "rows_left_out", *(SPAN_KEYS if span else ()))
    return {k: sum(int(f[k]) for f in files) for k in keys}


def build_manifest(cfg: CleanConfig, files: list[dict[str, Any]], plan_hash: str) -> dict[str, Any]:
    """``_clean_manifest.json``: per file (train path, output path, its counts), the totals and
    what was excluded (:meth:`Exclusion.manifest`). :class:`RuntimeError` when the listed rows
    met are not the rows the drop lists name in these inputs (a listed row matches no row
    read: the drop list and the inputs disagree)."""
    span = cfg.exclude.rules is not None
    total = totals(files, span)
    expected = cfg.exclude.expected
    if expected is not None and total["rows_left_out"] != expected:
        raise RuntimeError(f"the drop lists name {expected:,} row(s) of these inputs, but {total['rows_left_out']:,} "
                           "were met and left out: a listed row matches no row read (a row number past its file's "
                           "end?); the drop list and the inputs disagree")
    cut = {k: total[k] for k in SPAN_KEYS} if span else None
    return {"format": "refinery-clean/1", "mode": cfg.exclude.mode, **cfg.text.identity(), "id_field": cfg.id_field,
            "files": files, "totals": {"files": len(files), **total},
            "excluded_overlaps": cfg.exclude.manifest(total["rows_left_out"], cut), "plan_hash": plan_hash}


class CleanManifestStage(Stage[CleanManifestPayload, CleanManifestStats]):
    """One unit: the clean units' receipts -> ``_clean_manifest.json``, then ``.SUCCESS`` (last)."""

    name = "manifest"

    def __init__(self, cfg: CleanConfig):
        self.cfg = cfg

    def traits(self) -> Traits:
        return Traits(title="Write clean manifest", light=True, final_outputs=True)

    def config(self) -> StageConfig:
        return StageConfig({"clean_manifest": 1})

    def make_plan(self) -> list[Unit[CleanManifestPayload]]:
        return [Unit("manifest", CleanManifestPayload())]

    def run_unit(self, unit: Unit[CleanManifestPayload], ctx: UnitContext) -> CleanManifestStats:
        clean = ctx.upstream("clean")
        files: list[dict[str, Any]] = []
        for u in clean.stage.plan():
            c = clean.check(u.id)
            if not c.done:
                raise RuntimeError(f"clean unit {u.id} ({u.payload['path']}) is not complete: {c.reason}")
            stats = c.done_receipt()["stats"]
            files.append({"train_path": u.payload["path"], "output_path": u.payload["relpath"],
                          **{k: stats[k] for k in FILE_KEYS if k in stats}})
        manifest = build_manifest(self.cfg, files, ctx.run.stage_hash)
        ctx.write_bytes(ctx.output_path(MANIFEST), (json.dumps(manifest, indent=2, ensure_ascii=False) + "\n").encode())
        ctx.write_bytes(ctx.output_path(SUCCESS), b"")
        t = manifest["totals"]
        return {"files": t["files"], "rows_read": t["rows_read"], "rows_kept": t["rows_kept"],
                "rows_left_out": t["rows_left_out"]}


def build_stages(cfg: CleanConfig) -> list[Stage[Any, Any]]:
    """THE shape of ``refinery clean``'s job: clean (a unit per training file) -> manifest."""
    return [CleanStage(cfg), CleanManifestStage(cfg)]


def clear_stale_success(runs: list[StageRun], plans: list[list[Unit[Any]]]) -> None:
    """Once the stages are planned: a run whose manifest is not done must not leave an earlier
    run's ``.SUCCESS`` (nor its manifest) beside files being rewritten."""
    manifest_run = runs[-1]
    if manifest_run.check(plans[-1][0].id).done:
        return
    for name in (SUCCESS, MANIFEST):
        storage.remove(storage.join(manifest_run.output, name), root=manifest_run.output)
