"""clean: a copy of training files, in their own format, without what decon found overlapping.

``refinery clean --train PATH... --exclude-overlaps DECON_OUTPUT... --output DIR`` writes
each training file to ``DIR/<relpath>`` (its path relative to the ``--train`` argument it
came from) in the same format (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``, ``.parquet``),
its rows in the same order, less the rows decon's drop lists name (row mode) or, in span
mode, with each listed row replaced by the pieces :func:`~refinery.transforms.prep.span_cut.cut_row`
keeps of it, each a row of its own. The drop lists and their checks are prep's
(:class:`~refinery.transforms.prep.exclusion.Exclusion`), so ``refinery prep`` of the copy
tokenizes the documents ``refinery prep --exclude-overlaps`` of the original does.

A row is copied only if decon read its text with the same text spec (the drop lists' checks
make sure the spec, normalization and row cap are decon's): a row decon could not read, or
whose text field is not a string (an object, a list, null, missing, chat messages with
multi-part content: decon counts such rows and lists none of them), is left out, counted as
``rows_rejected`` and listed with its reason in ``DIR/_clean_rejects.jsonl``, as prep lists
the rows it rejects; the rows are read by the reader and text rule decon and prep read them
with (:func:`~refinery.transforms.io.rows.iter_rows`, a JSON lines file's rows with each line's
bytes: ``lines=True``; :class:`~refinery.transforms.io.text.TextSpec`).

Stages (each resumable, see ``refinery.transforms.resumable``)::

    clean     unit = a training file -> DIR/<relpath>, written atomically (+ its rejected rows, a part)
    manifest  one unit: the units' counts -> DIR/_clean_rejects.jsonl, DIR/_clean_manifest.json,
              then DIR/.SUCCESS; fails when the listed rows met are not the rows the drop lists name

Exact: a kept row of a JSON lines file is its line's bytes, unchanged (the one JSON lines
reader, ``iter_rows(path, lines=True)``, gives each line's bytes with the row decon and prep
number and parse it as); a parquet file keeps its schema (field order,
types, metadata) and is filtered with pyarrow; gzip is written without a name and with
mtime 0, zstd single-threaded, so a rerun, or a killed run finished, writes the same bytes.

The per-file work is pure functions of a reader and a writer (:func:`copy_jsonl`,
:func:`copy_parquet`) that the tests call without Beam.
"""
from __future__ import annotations

import contextlib
import gzip
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import IO, Any, Iterator, Mapping, Sequence, TypedDict, cast

import numpy as np
import zstandard

from refinery.transforms.io import storage
from refinery.transforms.io.jsonl import json_line
from refinery.transforms.io.positioned import PositionedWriter
from refinery.transforms.io.rows import (
    CORRUPT,
    DEFAULT_MAX_ROW_BYTES,
    JsonLine,
    Row,
    iter_rows,
)
from refinery.transforms.io.text import TextSpec, normalize_text
from refinery.transforms.prep.documents import Rejected
from refinery.transforms.prep.exclusion import Exclusion
from refinery.transforms.prep.piece_ids import check_piece_ids, has_piece_form, id_line
from refinery.transforms.prep.span_cut import SpanRules, cut_row, piece_id
from refinery.transforms.prep.stages import check_unchanged
from refinery.transforms.resumable import Stage, StageConfig, StageRun, Traits, Unit, UnitContext, short_hash
from refinery.transforms.resumable.ledger import META_DIR

FORMATS = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")  # what clean copies (any case)
MANIFEST = "_clean_manifest.json"  # "_": prep, decon (and pyarrow, Spark) do not list it as data
REJECTS = "_clean_rejects.jsonl"  # the rows left out because decon read no text of them: {path, row, reason}
SUCCESS = ".SUCCESS"
GZIP_LEVEL = 6
ZSTD_LEVEL = 3
REASONS_KEPT = 8  # distinct reasons a file's (and the manifest's) rejected_reasons count; the rest as OTHER_REASONS
OTHER_REASONS = "other reasons (see _clean_rejects.jsonl)"


def unsupported_inputs(paths: list[str]) -> list[str]:
    """The paths whose format clean cannot copy as it is."""
    return [p for p in paths if not storage.has_suffix(p, *FORMATS)]


def _output_files(output: str) -> Iterator[tuple[str, str]]:
    """(path, path relative to ``output``) of every file under the folder ``output``, in a
    sorted walk, but those of ``output/.refinery`` (the run's record); a link to a folder is
    one entry (never followed)."""
    root = output.rstrip("/")
    if storage.is_remote(root):
        fs, p = storage.filesystem(root)
        top = p.rstrip("/") + "/"
        for name in sorted(fs.find(p)):
            rel = name[len(top):] if name.startswith(top) else name
            if rel and not rel.startswith(f"{META_DIR}/"):
                yield storage.join(root, rel), rel
        return
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        if folder == root and META_DIR in dirs:
            dirs.remove(META_DIR)
        for name in sorted(files) + sorted(d for d in dirs if os.path.islink(os.path.join(folder, d))):
            path = os.path.join(folder, name)
            yield path, os.path.relpath(path, root).replace(os.sep, "/")


def foreign_files(output: str, relpaths: set[str] | None, limit: int = 3) -> tuple[list[str], int]:
    """The first ``limit`` files under ``output`` that a clean run of inputs at ``relpaths``
    does not write, and how many there are: anything but its copies, its manifest, its
    rejects, ``.SUCCESS``, its record (``.refinery``) and the temp files of its killed
    writers. ``relpaths`` None (the folder records no clean run): every file is foreign."""
    ours = {MANIFEST, REJECTS, SUCCESS} | (relpaths or set())
    found: list[str] = []
    count = 0
    for path, rel in _output_files(output):
        if relpaths is not None and (rel in ours or storage.is_temp_name(storage.basename(rel))):
            continue
        count += 1
        if len(found) < limit:
            found.append(path)
    return found, count


# ---------------------------------------------------------------------------------------
# What to do with one file's rows, and what was done
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RowPlan:
    """One file's listed rows (``drop``: file-global 0-based row numbers, as ``iter_rows``
    numbers them) and, in span mode (``rules`` set), the overlapping spans of each listed row
    that has them (a listed row without spans, one decon could not read, is left out whole);
    ``text``: the text spec decon read the rows with (a row it reads no text of is left out);
    ``text_field``/``id_field``: where a piece's text and id go."""

    drop: frozenset[int]
    spans: Mapping[int, np.ndarray] = field(default_factory=dict)
    rules: SpanRules | None = None
    text_field: str = "text"
    id_field: str = "id"
    text: TextSpec = TextSpec(field="text")


class _FileStatsBase(TypedDict):
    rows_read: int
    rows_kept: int
    rows_left_out: int  # listed rows met (left out whole, or, in span mode, replaced by their pieces)
    rows_rejected: int  # rows decon read no text of (unlisted): left out, each in the rejects file


class FileStats(_FileStatsBase, total=False):
    """A clean unit's receipt stats (one training file); the span keys in span mode only."""

    rows_split: int        # listed rows replaced by the pieces kept of them (possibly none: all too short)
    rows_dropped: int      # listed rows left out whole: more holes than --exclude-max-splits, or no spans
    pieces: int            # pieces written, each a row
    pieces_too_short: int  # pieces shorter than --exclude-min-chars (or blank once normalized), dropped
    chars_removed: int     # characters of the split and dropped rows' texts not written
    piece_form_ids: int    # kept rows whose id has a piece's form (piece_ids.has_piece_form)
    corrupt: str           # the file's content ends in damage decon listed: the copy holds the rows before it
    rejected_reasons: dict[str, int]  # rows_rejected by reason (at most REASONS_KEPT, then OTHER_REASONS)


SPAN_KEYS = ("rows_split", "rows_dropped", "pieces", "pieces_too_short", "chars_removed")
FILE_KEYS = ("rows_read", "rows_kept", "rows_left_out", "rows_rejected", *SPAN_KEYS, "corrupt",
             "rejected_reasons")  # a file's record, in this order


def count_reasons(into: dict[str, int], reasons: Mapping[str, int]) -> None:
    """``reasons`` added to ``into``, which keeps at most :data:`REASONS_KEPT` distinct reasons
    (later ones are counted as :data:`OTHER_REASONS`): a file of rows each malformed its own
    way does not make its record grow."""
    for reason, k in reasons.items():
        key = reason if reason in into or len(into.keys() - {OTHER_REASONS}) < REASONS_KEPT else OTHER_REASONS
        into[key] = into.get(key, 0) + k


@dataclass(frozen=True)
class UnitLists:
    """Where a clean unit lists rows (None: not listed, only counted): ``rejects``, the rows
    decon read no text of (prep's rejects lines); in span mode ``piece_ids``, each piece
    written with an id, and ``formed_ids``, each kept row whose id has a piece's form
    (:mod:`~refinery.transforms.prep.piece_ids`, which the manifest unit compares)."""

    rejects: storage.BinaryWriter | None = None
    piece_ids: storage.BinaryWriter | None = None
    formed_ids: storage.BinaryWriter | None = None


@dataclass
class _Counts:
    lists: UnitLists = UnitLists()
    rows_read: int = 0
    rows_kept: int = 0
    rows_left_out: int = 0
    rows_rejected: int = 0
    rows_split: int = 0
    rows_dropped: int = 0
    pieces: int = 0
    pieces_too_short: int = 0
    chars_removed: int = 0
    corrupt: str = ""
    formed: int = 0  # kept rows whose id has a piece's form
    reasons: Counter[str] = field(default_factory=Counter)

    def reject(self, path: str, row: int, reason: str) -> None:
        """A row decon read no text of: left out, counted, and its line (prep's rejects line) written."""
        self.rows_rejected += 1
        self.reasons[reason] += 1
        if self.lists.rejects is not None:
            self.lists.rejects.write(json_line(Rejected(path, row, reason).to_json(), sort_keys=True))

    def keep(self, path: str, row: int, record: Mapping[str, Any], id_field: str) -> None:
        """A row kept as it is: counted, and listed when its id has a piece's form (span mode)."""
        self.rows_kept += 1
        if self.lists.formed_ids is None:
            return
        value = record.get(id_field)
        if value is not None and has_piece_form(doc_id := str(value)):
            self.lists.formed_ids.write(id_line(doc_id, path, row))
            self.formed += 1

    def piece(self, path: str, row: int, doc_id: str) -> None:
        """A piece written with the id ``doc_id`` (span mode): listed."""
        if self.lists.piece_ids is not None:
            self.lists.piece_ids.write(id_line(doc_id, path, row))

    def stats(self, span: bool) -> FileStats:
        out: FileStats = {"rows_read": self.rows_read, "rows_kept": self.rows_kept,
                          "rows_left_out": self.rows_left_out, "rows_rejected": self.rows_rejected}
        if span:
            out["rows_split"], out["rows_dropped"], out["pieces"] = self.rows_split, self.rows_dropped, self.pieces
            out["pieces_too_short"], out["chars_removed"] = self.pieces_too_short, self.chars_removed
            out["piece_form_ids"] = self.formed
        if self.corrupt:
            out["corrupt"] = self.corrupt
        if self.reasons:
            kept: dict[str, int] = {}
            count_reasons(kept, dict(self.reasons.most_common()))
            out["rejected_reasons"] = kept
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
    text, error = plan.text.extract(record)
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
            counts.piece(path, row, obj[plan.id_field])
        pieces.append(obj)
    counts.pieces += len(pieces)
    return pieces


# ---------------------------------------------------------------------------------------
# JSON lines: the lines of the one reader, with their rows
# ---------------------------------------------------------------------------------------

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


def copy_jsonl(lines: Iterator[JsonLine], out: storage.BinaryWriter, plan: RowPlan, path: str,
               lists: UnitLists = UnitLists()) -> FileStats:
    """Write the lines of ``iter_rows(path, lines=True)`` to ``out`` as ``plan``
    says: a row decon read a text of, unlisted, as its line's bytes; a listed row left out, or
    in span mode replaced by its pieces (:func:`row_pieces`), each ``json.dumps(obj,
    ensure_ascii=False)`` and a newline; any other row (decon read no text of it) left out,
    its reason to ``lists.rejects``; the blank lines that end the file are copied. A damaged
    file whose damage decon listed (its last row) is copied up to the damage; damage decon did
    not list raises :class:`storage.InputError`."""
    c = _Counts(lists)
    for r in lines:
        if r.row is None:
            assert r.line is not None
            out.write(r.line)
            continue
        c.rows_read += 1
        corrupt = r.error is not None and r.error.startswith(CORRUPT)
        if r.row not in plan.drop:
            if corrupt:
                raise storage.InputError(f"{path}: {r.error}; decon did not list it (the file changed, or was not "
                                         "scanned): replace the file, or run decon on it again")
            text, error = plan.text.extract(r.record) if r.record is not None else (None, r.error)
            if text is None or r.line is None:
                c.reject(path, r.row, error or "unreadable")
                continue
            assert r.record is not None  # a text is of a row
            c.keep(path, r.row, r.record, plan.id_field)
            out.write(r.line)
            continue
        c.rows_left_out += 1
        if corrupt:
            c.rows_dropped += plan.rules is not None
            c.corrupt = r.error or ""
            break
        if plan.rules is None:
            continue
        if r.record is None:
            if r.row in plan.spans:
                raise ValueError(f"{path}: row {r.row}: {r.error}, but decon's spans file lists spans of it: the file "
                                 "is not what decon read")
            c.rows_dropped += 1
            continue
        for obj in row_pieces(r.record, r.row, plan, c, path):
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


def _cut_group(table: Any, base: int, listed: np.ndarray, rejected: np.ndarray, plan: RowPlan, c: _Counts,
               path: str) -> Any:
    """Span mode: a row group with listed rows -> its kept rows and the pieces of its listed
    rows, in row order (each piece a copy of its row, its text and, when the row has one,
    id replaced); the ``rejected`` rows left out."""
    import pyarrow as pa
    import pyarrow.compute as pc

    take: list[np.ndarray] = []
    texts: list[str] = []
    ids: list[str | None] = []
    start = 0
    for p in np.flatnonzero(listed | rejected).tolist():
        take.append(np.arange(start, p, dtype=np.int64))
        start = p + 1
        if rejected[p]:
            continue
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


def _rejected(rows: Iterator[Row], base: int, listed: np.ndarray, plan: RowPlan, c: _Counts, path: str
              ) -> np.ndarray:
    """The rows ``base``... of a row group (``listed``: those the drop lists name) that decon read
    no text of, from the next ``len(listed)`` rows of the row reader's ``rows``: a mask, each
    such row rejected into ``c``, each other unlisted row kept there."""
    mask = np.zeros(len(listed), dtype=bool)
    for i in range(len(listed)):
        item = next(rows, None)
        if item is None or item[0] != base + i or (item[2] or "").startswith(CORRUPT):
            raise storage.InputError(f"{path}: row {base + i}: {item[2] if item else 'missing'}: the row reader "
                                     "does not read the file's row groups")
        row, record, error = item
        if listed[i]:
            continue
        text, why = plan.text.extract(record) if record is not None else (None, error)
        if text is None or record is None:
            mask[i] = True
            c.reject(path, row, why or "unreadable")
        else:
            c.keep(path, row, record, plan.id_field)
    return mask


def copy_parquet(f: IO[bytes], out: storage.BinaryWriter, plan: RowPlan, path: str, rows: Iterator[Row],
                 lists: UnitLists = UnitLists()) -> FileStats:
    """Write the parquet file ``f`` to ``out`` as ``plan`` says, a row group at a time (one row
    group written per row group read, empty ones left out), with its schema (field order,
    types, metadata) and compression: row mode filters each row group (``Table.filter``);
    span mode replaces each listed row by its pieces (:func:`row_pieces`). ``rows``: the same
    file's rows as the row reader reads them (:func:`~refinery.transforms.io.rows.iter_rows`,
    its text and id columns): a row decon read no text of is left out, its reason to
    ``lists.rejects``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(f)
    meta = pf.metadata
    drop = np.fromiter(sorted(plan.drop), dtype=np.int64, count=len(plan.drop))
    c = _Counts(lists)
    writer = pq.ParquetWriter(pa.PythonFile(PositionedWriter(out), mode="w"), pf.schema_arrow, compression=_codec(meta))
    base = 0
    for g in range(meta.num_row_groups):
        table = pf.read_row_group(g)
        n = table.num_rows
        listed = np.isin(np.arange(base, base + n, dtype=np.int64), drop)
        rejected = _rejected(rows, base, listed, plan, c, path)
        left_out = int(listed.sum())
        c.rows_read += n
        c.rows_left_out += left_out
        if left_out and plan.rules is not None:
            table = _cut_group(table, base, listed, rejected, plan, c, path)
        elif left_out or rejected.any():
            table = table.filter(pa.array(~(listed | rejected)))
        if table.num_rows:
            writer.write_table(table)
        base += n
    writer.close()
    return c.stats(plan.rules is not None)


def copy_file(path: str, out: storage.BinaryWriter, plan: RowPlan, max_row_bytes: int,
              lists: UnitLists = UnitLists()) -> FileStats:
    """The copy of the training file ``path`` (a :data:`FORMATS` file) into ``out``; the rows
    it lists go to ``lists``."""
    if storage.has_suffix(path, ".parquet"):
        with storage.open_read(path) as f:
            columns = [*plan.text.fields(), plan.id_field]  # the columns prep reads
            rows = iter_rows(path, columns=columns, max_row_bytes=max_row_bytes)
            return copy_parquet(f, out, plan, path, rows, lists)
    if not storage.has_suffix(path, *FORMATS):
        raise ValueError(f"{path}: clean copies {', '.join(FORMATS)} files only")
    with compressed_writer(out, path) as w:  # the lines of the one row reader, with their bytes
        return copy_jsonl(iter_rows(path, max_row_bytes=max_row_bytes, lines=True), w, plan, path, lists)


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
        # rows_without_text: a row decon read no text of is left out and listed (before, it was copied)
        settings = {**cfg.text.identity(), "id_field": cfg.id_field, "max_row_bytes": cfg.max_row_bytes,
                    "exclude": cfg.exclude.identity(), "gzip_level": GZIP_LEVEL, "zstd_level": ZSTD_LEVEL,
                    "relpaths": short_hash([f.relpath for f in cfg.inputs]), "rows_without_text": "rejected/1",
                    **({"piece_ids": "listed/1"} if cfg.exclude.rules is not None else {})}
        return StageConfig(settings, [f.fingerprint() for f in cfg.inputs])

    def make_plan(self) -> list[Unit[CleanPayload]]:
        return [Unit(f"{i:05d}", CleanPayload(path=f.path, relpath=f.relpath, fingerprint=f.fingerprint()))
                for i, f in enumerate(self.cfg.inputs)]

    def run_unit(self, unit: Unit[CleanPayload], ctx: UnitContext) -> FileStats:
        cfg, p = self.cfg, unit.payload
        check_unchanged(p)
        exclude = cfg.exclude
        plan = RowPlan(exclude.rows_of(p["path"]), exclude.spans_of(p["path"]) if exclude.rules else {},
                       exclude.rules, cfg.text_field, cfg.id_field, cfg.text)
        with ctx.open_write(ctx.output_path(p["relpath"])) as out, \
                ctx.open_write(ctx.part_path(rejects_part(unit.id))) as rejects, contextlib.ExitStack() as more:
            if exclude.rules is not None:  # span mode: the ids piece_ids compares
                lists = UnitLists(rejects, more.enter_context(ctx.open_write(ctx.part_path(piece_ids_part(unit.id)))),
                                  more.enter_context(ctx.open_write(ctx.part_path(formed_ids_part(unit.id)))))
            else:
                lists = UnitLists(rejects)
            stats = copy_file(p["path"], out, plan, cfg.max_row_bytes, lists)
        check_unchanged(p)  # what was read is what was planned
        return stats

    def _progress_text(self, stats: Mapping[str, Any], seconds: float) -> str:
        return (f"rows={int(stats.get('rows_read', 0)):,} left out={int(stats.get('rows_left_out', 0)):,} "
                f"rejected={int(stats.get('rows_rejected', 0)):,}")


def rejects_part(unit_id: str) -> str:
    """A clean unit's rejected rows (prep's rejects lines), which the manifest unit gathers into
    :data:`REJECTS`."""
    return f"{unit_id}.rejects.jsonl"


def piece_ids_part(unit_id: str) -> str:
    """Span mode: a clean unit's list of the ids of the pieces it wrote."""
    return f"{unit_id}.piece_ids.jsonl"


def formed_ids_part(unit_id: str) -> str:
    """Span mode: a clean unit's list of the ids of a piece's form of the rows it kept."""
    return f"{unit_id}.formed_ids.jsonl"


def check_clean_piece_ids(clean: StageRun, receipts: Mapping[str, Mapping[str, Any]]) -> None:
    """Span mode: no piece's id is the id of a row kept as it is, in any file of the copy
    (:func:`~refinery.transforms.prep.piece_ids.check_piece_ids` over the units' lists;
    ``receipts``: each unit's stats); :class:`RuntimeError` naming both rows."""
    def files(part: Any, key: str) -> tuple[list[str], int]:
        ids = [u for u, s in receipts.items() if s.get(key)]
        return [storage.join(clean.parts_dir, part(u)) for u in ids], sum(int(receipts[u][key]) for u in ids)

    check_piece_ids(*files(piece_ids_part, "pieces"), *files(formed_ids_part, "piece_form_ids"))


class CleanManifestPayload(TypedDict):
    """The manifest unit's payload: nothing (one unit, ``manifest``)."""


class CleanManifestStats(TypedDict):
    files: int
    rows_read: int
    rows_kept: int
    rows_left_out: int
    rows_rejected: int


def totals(files: Sequence[Mapping[str, Any]], span: bool) -> dict[str, int]:
    """The per-file counts summed (the span keys in span mode only)."""
    keys = ("rows_read", "rows_kept", "rows_left_out", "rows_rejected", *(SPAN_KEYS if span else ()))
    return {k: sum(int(f.get(k, 0)) for f in files) for k in keys}


def rejected_reasons(files: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """The files' ``rejected_reasons`` summed (at most :data:`REASONS_KEPT` reasons, the most
    common first)."""
    every: Counter[str] = Counter()
    for f in files:
        every.update(f.get("rejected_reasons", {}))
    out: dict[str, int] = {}
    count_reasons(out, dict(every.most_common()))
    return out


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
            "excluded_overlaps": cfg.exclude.manifest(total["rows_left_out"], cut),
            "rejects": {"path": REJECTS, "rows": total["rows_rejected"], "reasons": rejected_reasons(files)},
            "plan_hash": plan_hash}


class CleanManifestStage(Stage[CleanManifestPayload, CleanManifestStats]):
    """One unit: the clean units' receipts and rejected rows -> ``_clean_rejects.jsonl``,
    ``_clean_manifest.json``, then ``.SUCCESS`` (last)."""

    name = "manifest"

    def __init__(self, cfg: CleanConfig):
        self.cfg = cfg

    def traits(self) -> Traits:
        return Traits(title="Write clean manifest", light=True, final_outputs=True)

    def config(self) -> StageConfig:
        return StageConfig({"clean_manifest": 2})  # 2: it gathers the rejected rows too

    def make_plan(self) -> list[Unit[CleanManifestPayload]]:
        return [Unit("manifest", CleanManifestPayload())]

    def run_unit(self, unit: Unit[CleanManifestPayload], ctx: UnitContext) -> CleanManifestStats:
        clean = ctx.upstream("clean")
        files: list[dict[str, Any]] = []
        stats_of: dict[str, Mapping[str, Any]] = {}
        with ctx.open_write(ctx.output_path(REJECTS)) as rejects:
            for u in clean.stage.plan():
                c = clean.check(u.id)
                if not c.done:
                    raise RuntimeError(f"clean unit {u.id} ({u.payload['path']}) is not complete: {c.reason}")
                stats = stats_of[u.id] = c.done_receipt()["stats"]
                files.append({"train_path": u.payload["path"], "output_path": u.payload["relpath"],
                              **{k: stats[k] for k in FILE_KEYS if k in stats}})
                if stats.get("rows_rejected"):
                    with storage.open_read(storage.join(clean.parts_dir, rejects_part(u.id))) as f:
                        while block := f.read(1 << 20):
                            rejects.write(block)
        if self.cfg.exclude.rules is not None:
            check_clean_piece_ids(clean, stats_of)
        manifest = build_manifest(self.cfg, files, ctx.run.stage_hash)
        ctx.write_bytes(ctx.output_path(MANIFEST), (json.dumps(manifest, indent=2, ensure_ascii=False) + "\n").encode())
        ctx.write_bytes(ctx.output_path(SUCCESS), b"")
        t = manifest["totals"]
        return {"files": t["files"], "rows_read": t["rows_read"], "rows_kept": t["rows_kept"],
                "rows_left_out": t["rows_left_out"], "rows_rejected": t["rows_rejected"]}


def build_stages(cfg: CleanConfig) -> list[Stage[Any, Any]]:
    """THE shape of ``refinery clean``'s job: clean (a unit per training file) -> manifest."""
    return [CleanStage(cfg), CleanManifestStage(cfg)]


def clear_stale_success(runs: list[StageRun], plans: list[list[Unit[Any]]]) -> None:
    """Once the stages are planned: a run whose manifest is not done must not leave an earlier
    run's ``.SUCCESS`` (nor its manifest) beside files being rewritten."""
    manifest_run = runs[-1]
    if manifest_run.check(plans[-1][0].id).done:
        return
    for name in (SUCCESS, MANIFEST, REJECTS):
        storage.remove(storage.join(manifest_run.output, name), root=manifest_run.output)
