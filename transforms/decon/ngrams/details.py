"""Detail records as Parquet: one file per eval hash partition, columns built directly.

``refinery decon --details-format parquet`` (the default) writes the detail records of eval
partition ``P`` to ``stats/overlap_details/part-PPPPP.parquet`` (:data:`SCHEMA`, the fields
of a line of ``overlap_details.jsonl.gz``, typed; ``docs/FORMATS.md``). The reduce hands
:class:`DetailRows` one (training row, n-gram) hit at a time with the eval rows it stands for;
the class keeps columns (numpy and Python lists, no JSON) and writes a zstd row group every
:data:`ROW_GROUP_ROWS` rows (or :data:`HELD_CHARS` characters), so its memory does not grow
with the partition's records.

:func:`read_details` reads the records of a decon output back, from either format, as the
dicts of the JSON lines (keys in the documented order, the optional keys only when set).
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from itertools import accumulate, chain
from typing import Any, Callable, Collection, Iterator, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from refinery.transforms.io import storage
from refinery.transforms.io.arrow_columns import bool_column, int_column, string_column
from refinery.transforms.io.jsonl import JSON_ERRORS
from refinery.transforms.io.positioned import PositionedWriter

from .arrays import ranges
from .compact import RecordColumns
from .index import EvalRow, SameText

DETAILS_FORMATS = ("parquet", "jsonl")
DETAILS_JSONL = "stats/overlap_details.jsonl.gz"  # --details-format jsonl: one file
DETAILS_DIR = "stats/overlap_details"             # --details-format parquet: a part per eval partition

ROW_GROUP_ROWS = 1 << 15   # rows of a row group, at most (fewer in a partition's last one)
HELD_CHARS = 4 << 20       # string characters of the rows of a row group, at most (a row's own count)
CACHE_EVALS = 1024         # records with at most this many eval rows keep their eval columns
COMPRESSION_LEVEL = 3      # zstd
NGRAM_MAX_CHARS = 1000     # a detail record's n-gram is cut there: ``ngram_truncated`` says so
PREFIX_CACHE_EVALS = 1024  # JSON lines: records with at most this many eval rows keep their line heads
WRITE_LINES = 1024         # JSON lines: lines built at once for a record with many eval rows
WRITE_CHARS = 1 << 20      # JSON lines: text (characters) held before it is handed to ``write``

# The DetailRecord schema, in one place: a detail record's fields in their order (the keys of a
# JSON line, the columns of a Parquet part); the OPTIONAL ones are left out of a JSON line when unset.
PAIRS = pa.list_(pa.list_(pa.int32()))  # [[start, end], ...]
NAMES = pa.dictionary(pa.int32(), pa.string())
SCHEMA = pa.schema([
    ("eval_dataset", NAMES), ("eval_path", NAMES), ("eval_row", pa.int64()), ("instance_id", pa.string()),
    ("same_text", pa.int32()), ("n", pa.int32()), ("ngram", pa.string()), ("ngram_truncated", pa.bool_()),
    ("eval_offsets", PAIRS), ("train_path", NAMES), ("train_row", pa.int64()), ("train_doc_id", pa.string()),
    ("train_offsets", PAIRS), ("train_snippet_start", pa.int64()), ("train_snippet", pa.string()),
    ("train_snippet_truncated", pa.bool_()),
])
OPTIONAL = {"same_text": 0, "ngram_truncated": False, "train_snippet_truncated": False}  # JSON: only when set


def details_part(p: int) -> str:
    """Eval partition ``p``'s Parquet part, relative to OUTPUT."""
    return f"{DETAILS_DIR}/part-{p:05d}.parquet"


def check_format(details_format: str) -> str:
    if details_format not in DETAILS_FORMATS:
        raise ValueError(f"--details-format must be one of {', '.join(DETAILS_FORMATS)}, got {details_format!r}")
    return details_format


def pairs_array(counts: np.ndarray, flat: np.ndarray) -> pa.Array:
    """``list<list<int32>>``: row ``i`` holds ``counts[i]`` ``[start, end]`` pairs, taken in
    order from ``flat`` (start, end, start, end, ...); pyarrow refuses a value past int32."""
    inner = pa.ListArray.from_arrays(int_column(np.arange(0, len(flat) + 1, 2, dtype=np.int32), "int32"),
                                     int_column(flat, "int32"))
    outer = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=outer[1:])
    return pa.ListArray.from_arrays(int_column(outer, "int32"), inner).cast(PAIRS)


def strings(values: list[str]) -> pa.Array:
    """A string column; a lone surrogate (text that was not valid UTF-8) becomes its ``\\uXXXX``
    escape, as in the JSON lines (where a JSON reader turns it back into the surrogate)."""
    return string_column(values, JSON_ERRORS)


def utf8(value: str) -> str:
    """``value`` as valid UTF-8 text: a lone surrogate becomes its ``\\uXXXX`` escape."""
    return value.encode("utf-8", JSON_ERRORS).decode("utf-8")


def _names(values: list[str]) -> pa.Array:
    return strings(values).dictionary_encode().cast(NAMES)


@dataclass(frozen=True)
class EvalColumns:
    """The eval side of the detail rows, one entry per eval row (``eval_idx``): made once per
    process for every partition, taken by index for each row group."""

    eval_dataset: pa.Array
    eval_path: pa.Array
    eval_row: pa.Array
    instance_id: pa.Array
    same_text: pa.Array

    @classmethod
    def of(cls, eval_rows: list[EvalRow], same: SameText) -> "EvalColumns":
        return cls(_names([r.eval_dataset for r in eval_rows]), _names([r.eval_path for r in eval_rows]),
                   int_column([r.eval_row for r in eval_rows], "int64"),
                   strings([r.instance_id for r in eval_rows]),
                   int_column([len(same.others.get(r.eval_idx, ())) for r in eval_rows], "int32"))

    def take(self, idx: np.ndarray) -> list[pa.Array]:
        at = int_column(idx, "int64")
        return [c.take(at) for c in (self.eval_dataset, self.eval_path, self.eval_row, self.instance_id,
                                     self.same_text)]


class DetailRows:
    """A partition's detail records, written to ``out`` (a binary file) as Parquet.

    :meth:`add` takes one (training row, n-gram) hit and the first ``room`` of the n-gram's
    eval rows (``[eval_idx, eval offsets]``, one per distinct text): ``room`` rows, in that
    order. :meth:`close` writes what is held and the file's footer (a file with no rows has
    the schema and no row group)."""

    def __init__(self, out: storage.BinaryWriter, evals: EvalColumns, row_group_rows: int = ROW_GROUP_ROWS):
        self.evals = evals
        self.row_group_rows = row_group_rows
        self.writer = pq.ParquetWriter(pa.PythonFile(PositionedWriter(out), mode="w"), SCHEMA, compression="zstd",
                                       compression_level=COMPRESSION_LEVEL)
        self.cache: dict[int, tuple[list[int], list[int], list[int], list[int]]] = {}
        self.rows = 0  # written, all row groups
        self._clear()

    _HIT_COLUMNS = ("n", "ngram", "ngram_truncated", "train_path", "train_row", "train_doc_id", "train_pairs",
                    "train_flat", "train_snippet_start", "train_snippet", "train_snippet_truncated", "rows")

    def _clear(self) -> None:
        self._columns: tuple[list[Any], ...] = tuple([] for _ in self._HIT_COLUMNS)  # the hits' columns, in that order
        self.eval_idx: list[int] = []    # the eval side of the rows held, one entry per row
        self.eval_pairs: list[int] = []
        self.eval_flat: list[int] = []
        self.held_rows = self.held_chars = 0

    def _eval_side(self, key: int, evals: list[Any], a: int, b: int) -> tuple[list[int], list[int], list[int]]:
        """(eval_idx, pairs per row, flat offsets) of ``evals[a:b]``, as lists of ints (most
        records have one or two eval rows: numpy arrays per hit would cost more than they
        hold); cached by record ``key`` for a record with few eval rows (it comes back with
        each training row)."""
        got = self.cache.get(key) if len(evals) <= CACHE_EVALS else None
        if got is None:
            lo, hi = (0, len(evals)) if len(evals) <= CACHE_EVALS else (a, b)
            part = evals[lo:hi]
            pairs = [len(e[1]) for e in part]
            got = ([e[0] for e in part], pairs, [x for e in part for pair in e[1] for x in pair],
                   list(accumulate(pairs, initial=0)))
            if len(evals) <= CACHE_EVALS:
                self.cache[key] = got
            else:
                a, b = 0, b - a
        idx, pairs, flat, starts = got
        if a == 0 and b == len(idx):  # the common case: all of a record's eval rows
            return idx, pairs, flat
        return idx[a:b], pairs[a:b], flat[2 * starts[a]:2 * starts[b]]

    def add(self, key: int, n: int, ngram: str, ngram_truncated: bool, evals: list[Any], room: int, train_path: str,
            train_row: int, train_doc_id: str, train_offsets: list[Any], snippet_start: int, snippet: str,
            snippet_truncated: bool) -> None:
        """``room`` rows: the hit of record ``key`` (its ``n``, ``ngram`` as written) in a
        training row, for each of ``evals[:room]``. A row group holds at most
        :data:`HELD_CHARS` characters of the hit's strings, repeated on each of its rows (a
        row with a huge snippet alone may be more)."""
        per_row = len(ngram) + len(train_doc_id) + len(snippet) + 1
        step = max(1, min(self.row_group_rows, HELD_CHARS // per_row))
        for a in range(0, room, step):
            b = min(room, a + step)
            idx, pairs, flat = self._eval_side(key, evals, a, b)
            (n_, ngram_, ngram_truncated_, path_, row_, doc_id_, pairs_, flat_, snippet_start_, snippet_,
             snippet_truncated_, rows_) = self._columns  # one hit per call: its columns' lists, bound once
            n_.append(n)
            ngram_.append(ngram)
            ngram_truncated_.append(ngram_truncated)
            path_.append(train_path)
            row_.append(train_row)
            doc_id_.append(train_doc_id)
            pairs_.append(len(train_offsets))
            flat_.extend(chain.from_iterable(train_offsets))
            snippet_start_.append(snippet_start)
            snippet_.append(snippet)
            snippet_truncated_.append(snippet_truncated)
            rows_.append(b - a)
            self.eval_idx.extend(idx)
            self.eval_pairs.extend(pairs)
            self.eval_flat.extend(flat)
            self.held_rows += b - a
            self.held_chars += (b - a) * per_row
            if self.held_rows >= self.row_group_rows or self.held_chars >= HELD_CHARS:
                self.flush()

    def flush(self) -> None:
        """Write the rows held as one row group."""
        if not self.held_rows:
            return
        h = dict(zip(self._HIT_COLUMNS, self._columns))
        self.write_group(h, np.asarray(self.eval_idx, dtype=np.int64), np.asarray(self.eval_pairs, dtype=np.int64),
                         np.asarray(self.eval_flat, dtype=np.int64))
        self._clear()

    def write_group(self, h: dict[str, Any], eval_idx: np.ndarray, eval_pairs: np.ndarray, eval_flat: np.ndarray
                    ) -> None:
        """One row group: ``h`` the hit columns (:data:`_HIT_COLUMNS`, one entry per piece of a
        hit, ``rows`` its rows), the eval side one entry per row."""
        rows = np.asarray(h["rows"], dtype=np.int64)
        rep = int_column(np.repeat(np.arange(len(rows), dtype=np.int64), rows), "int64")
        hit_cols = {
            "n": int_column(h["n"], "int32"), "ngram": strings(h["ngram"]),
            "ngram_truncated": bool_column(h["ngram_truncated"]),
            "train_path": _names(h["train_path"]), "train_row": int_column(h["train_row"], "int64"),
            "train_doc_id": strings(h["train_doc_id"]),
            "train_offsets": pairs_array(np.asarray(h["train_pairs"], dtype=np.int64),
                                         np.asarray(h["train_flat"], dtype=np.int64)),
            "train_snippet_start": int_column(h["train_snippet_start"], "int64"),
            "train_snippet": strings(h["train_snippet"]),
            "train_snippet_truncated": bool_column(h["train_snippet_truncated"]),
        }
        eval_cols = dict(zip(("eval_dataset", "eval_path", "eval_row", "instance_id", "same_text"),
                             self.evals.take(eval_idx)))
        eval_cols["eval_offsets"] = pairs_array(eval_pairs, eval_flat)
        columns = [eval_cols[f.name] if f.name in eval_cols else hit_cols[f.name].take(rep) for f in SCHEMA]
        held = int(rows.sum())
        self.writer.write_table(pa.Table.from_arrays(columns, schema=SCHEMA), row_group_size=held)
        self.rows += held

    def close(self) -> None:
        self.flush()
        self.writer.close()


# -- the reduce's detail records, a block of hits at a time ----------------------------

class RecordSide:
    """A partition's records as their detail rows see them: per record its n, its n-gram and
    its eval entries kept (the first row of each text: :class:`SameText`), in columns: record
    ``r``'s kept entries are ``entry[at[r]:at[r + 1]]`` (indices into ``records``' eval
    entries, in order)."""

    def __init__(self, records: RecordColumns, first: Collection[int]):
        self.records = records
        self.ev_idx = records.ev_idx.astype(np.int64)
        self.off_at = records.off_at.astype(np.int64)
        self.offs = records.offs.astype(np.int64)
        keep = ~np.isin(self.ev_idx, np.fromiter(first, np.int64, len(first)))
        self.entry = np.flatnonzero(keep)
        self.at = np.append(0, np.cumsum(keep, dtype=np.int64))[records.ev_at.astype(np.int64)]
        self.size = np.diff(self.at)  # kept eval entries per record
        self._grams: dict[int, str] = {}
        self._evals: dict[int, list[Any]] = {}

    def gram(self, rec: int) -> str:
        got = self._grams.get(rec)
        if got is None:
            got = self._grams[rec] = self.records.gram_bytes(rec).decode("utf-8", "surrogatepass")
        return got

    def evals(self, rec: int) -> list[Any]:
        """Record ``rec``'s kept ``[[eval_idx, [[start, end], ...]], ...]``."""
        got = self._evals.get(rec)
        if got is None:
            keep = set(self.ev_idx[self.entry[self.at[rec]:self.at[rec + 1]]].tolist())
            got = self._evals[rec] = [e for e in self.records.evals(rec) if e[0] in keep]
        return got

    def eval_side(self, rec: np.ndarray, a: np.ndarray, size: np.ndarray) -> tuple[np.ndarray, ...]:
        """(eval_idx, pairs per row, flat offsets) of entries ``a`` to ``a + size`` of each record."""
        lo = self.at[rec] + a
        entry = self.entry[ranges(lo, lo + size)]
        lo2, hi2 = self.off_at[entry], self.off_at[entry + 1]
        return self.ev_idx[entry], hi2 - lo2, self.offs[ranges(2 * lo2, 2 * hi2)]


@dataclass
class HitBatch:
    """The hits of one block that write detail rows, in scan order, as columns: hit ``k``
    writes ``room[k]`` rows (its record's first kept eval entries); its occurrences are
    ``flat[2 * occ_at[k]:2 * occ_at[k + 1]]`` (start, end, ...)."""

    path: str
    rec: np.ndarray
    room: np.ndarray
    row: np.ndarray
    doc_id: list[str]
    occ: np.ndarray
    flat: np.ndarray
    snippet_start: np.ndarray
    snippet: list[str]
    snippet_truncated: np.ndarray

    @property
    def occ_at(self) -> np.ndarray:
        return np.append(0, np.cumsum(self.occ))


class DetailSink(Protocol):
    """Where the reduce's detail records go, a block of hits at a time."""

    def add(self, batch: HitBatch) -> None: ...

    def end_block(self) -> None: ...

    def finish(self) -> None: ...


class ParquetSink:
    """Detail records into a :class:`DetailRows` (its writer, eval columns and row group
    size) as columns: the row groups :meth:`DetailRows.add` would make for the same hits,
    the same bytes (a hit cut into pieces of at most ``row_group_rows`` rows and
    :data:`HELD_CHARS` characters; a group written when either is reached)."""

    def __init__(self, rows: DetailRows, side: RecordSide):
        self.rows, self.side = rows, side
        self.pending: list[tuple[Any, ...]] = []
        self.held_rows = self.held_chars = 0

    def add(self, batch: HitBatch) -> None:
        if not len(batch.rec):
            return
        h = len(batch.rec)
        gram = [self.side.gram(r)[:NGRAM_MAX_CHARS] for r in batch.rec.tolist()]
        per_row = (np.fromiter(map(len, gram), np.int64, h) + np.fromiter(map(len, batch.doc_id), np.int64, h)
                   + np.fromiter(map(len, batch.snippet), np.int64, h) + 1)
        step = np.maximum(1, np.minimum(self.rows.row_group_rows, HELD_CHARS // per_row))
        pieces = -(-batch.room // step)
        hit = np.repeat(np.arange(h, dtype=np.int64), pieces)
        a = (np.arange(len(hit), dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * step[hit]
        size = np.minimum(step[hit], batch.room[hit] - a)
        cum_rows, cum_chars = np.cumsum(size), np.cumsum(size * per_row[hit])
        s = 0
        while s < len(hit):
            before_r, before_c = (int(cum_rows[s - 1]), int(cum_chars[s - 1])) if s else (0, 0)
            j = min(int(np.searchsorted(cum_rows, before_r + self.rows.row_group_rows - self.held_rows)),
                    int(np.searchsorted(cum_chars, before_c + HELD_CHARS - self.held_chars)))
            e = min(j + 1, len(hit))
            self.pending.append((batch, gram, hit[s:e], a[s:e], size[s:e]))
            self.held_rows += int(cum_rows[e - 1]) - before_r
            self.held_chars += int(cum_chars[e - 1]) - before_c
            if j < len(hit):
                self._write()
            s = e

    def end_block(self) -> None:
        pass

    def _write(self) -> None:
        cols: dict[str, list[Any]] = {k: [] for k in DetailRows._HIT_COLUMNS}
        ev: list[list[np.ndarray]] = [[], [], []]
        for batch, gram, hit, a, size in self.pending:
            hl = hit.tolist()
            rec = batch.rec[hit]
            occ_at = batch.occ_at
            cols["n"].append(self.side.records.n[rec])
            cols["ngram"].append([gram[k] for k in hl])
            cols["ngram_truncated"].append([len(self.side.gram(r)) > NGRAM_MAX_CHARS for r in rec.tolist()])
            cols["train_path"].append([batch.path] * len(hl))
            cols["train_row"].append(batch.row[hit])
            cols["train_doc_id"].append([batch.doc_id[k] for k in hl])
            cols["train_pairs"].append(batch.occ[hit])
            cols["train_flat"].append(batch.flat[ranges(2 * occ_at[hit], 2 * occ_at[hit + 1])])
            cols["train_snippet_start"].append(batch.snippet_start[hit])
            cols["train_snippet"].append([batch.snippet[k] for k in hl])
            cols["train_snippet_truncated"].append(batch.snippet_truncated[hit])
            cols["rows"].append(size)
            for got, part in zip(ev, self.side.eval_side(rec, a, size)):
                got.append(part)
        h = {k: list(chain.from_iterable(v)) if isinstance(v[0], list) else np.concatenate(v)
             for k, v in cols.items()}
        self.rows.write_group(h, *(np.concatenate(x) for x in ev))
        self.pending.clear()
        self.held_rows = self.held_chars = 0

    def finish(self) -> None:
        if self.pending:
            self._write()


SNIPPET_CUT = ', "train_snippet_truncated": true'


def pairs_text(flat: list[int]) -> str:
    """``[[1, 2], [3, 4]]`` (as ``json.dumps`` writes it) of flat ``[1, 2, 3, 4]``."""
    if len(flat) == 2:
        return f"[[{flat[0]}, {flat[1]}]]"
    return "[" + ", ".join(f"[{flat[k]}, {flat[k + 1]}]" for k in range(0, len(flat), 2)) + "]"


class JsonLinesSink:
    """Detail records as UTF-8 JSON lines (keys in :data:`SCHEMA` order, the optional ones only
    when set) handed to ``write`` a few at a time: at most about :data:`WRITE_CHARS`
    characters, whatever the fan-out, and what a block of hits left at its end (the gzip
    member's bytes depend on those cuts: they are those of the code before the columns)."""

    def __init__(self, write: Callable[[bytes], object], side: RecordSide, eval_rows: list[EvalRow], same: SameText):
        self.write, self.side, self.eval_rows, self.same = write, side, eval_rows, same
        self.heads: dict[int, str] = {}
        self.middles: dict[int, str] = {}
        self.prefixes: dict[int, list[str]] = {}  # record -> its lines up to the training part (few eval rows)
        self.out: list[bytes] = []
        self.held = 0

    def _head(self, eval_idx: int) -> str:
        h = self.heads.get(eval_idx)
        if h is None:
            er, quote = self.eval_rows[eval_idx], json.encoder.encode_basestring
            h = (f'{{"eval_dataset": {quote(er.eval_dataset)}, "eval_path": {quote(er.eval_path)}, '
                 f'"eval_row": {er.eval_row}, "instance_id": {quote(er.instance_id)}')
            if eval_idx in self.same.others:
                h = f'{h}, "same_text": {len(self.same.others[eval_idx])}'
            self.heads[eval_idx] = h
        return h

    def _lines(self, rec: int, evals: list[Any]) -> list[str]:
        middle = self.middles.get(rec)
        if middle is None:
            gram, quote = self.side.gram(rec), json.encoder.encode_basestring
            cut = ', "ngram_truncated": true' if len(gram) > NGRAM_MAX_CHARS else ""
            middle = self.middles[rec] = (f'"n": {int(self.side.records.n[rec])}, "ngram": '
                                          f'{quote(gram[:NGRAM_MAX_CHARS])}{cut}, "eval_offsets": ')
        return [f'{self._head(e)}, {middle}{pairs_text([x for p in offs for x in p])}, ' for e, offs in evals]

    def add(self, batch: HitBatch) -> None:
        quote = json.encoder.encode_basestring
        path = quote(batch.path)
        flat, occ_at = batch.flat.tolist(), batch.occ_at.tolist()
        for k, (rec, room, row, start, cut) in enumerate(zip(batch.rec.tolist(), batch.room.tolist(),
                                                             batch.row.tolist(), batch.snippet_start.tolist(),
                                                             batch.snippet_truncated.tolist())):
            evals = self.side.evals(rec)
            cached = self.prefixes.get(rec)
            if cached is None and len(evals) <= PREFIX_CACHE_EVALS:
                cached = self.prefixes[rec] = self._lines(rec, evals)
            tail = (f'"train_path": {path}, "train_row": {row}, "train_doc_id": {quote(batch.doc_id[k])}, '
                    f'"train_offsets": {pairs_text(flat[2 * occ_at[k]:2 * occ_at[k + 1]])}, '
                    f'"train_snippet_start": {start}, "train_snippet": {quote(batch.snippet[k])}'
                    f'{SNIPPET_CUT if cut else ""}}}\n')
            for c in range(0, room, WRITE_LINES):
                lines = cached[c:room] if cached is not None else self._lines(rec, evals[c:min(room, c + WRITE_LINES)])
                # encoded a few lines at a time: most are ASCII (a copy), where one non-ASCII
                # character would make a whole joined chunk a slow encode
                text = tail.join(lines) + tail
                self.out.append(text.encode("utf-8", JSON_ERRORS))
                self.held += len(text)
                if self.held >= WRITE_CHARS:
                    self.end_block()

    def end_block(self) -> None:
        if self.out:
            self.write(b"".join(self.out))
            self.out.clear()
            self.held = 0

    def finish(self) -> None:
        self.end_block()


def record_of(row: dict[str, Any]) -> dict[str, Any]:
    """A Parquet row as the dict of its JSON line: the optional keys only when set."""
    return {k: v for k, v in row.items() if k not in OPTIONAL or v != OPTIONAL[k]}


def read_parquet_part(path: str) -> Iterator[dict[str, Any]]:
    """The records of one Parquet part, as :func:`record_of` gives them; ValueError naming
    ``path`` when it is not a Parquet file of :data:`SCHEMA`."""
    with storage.open_read(path) as f:
        try:
            part = pq.ParquetFile(f)
            if not part.schema_arrow.equals(SCHEMA):
                raise ValueError(f"its columns are not those of decon's detail records: {part.schema_arrow}")
            for batch in part.iter_batches(batch_size=8192):
                yield from map(record_of, batch.to_pylist())
        except (pa.ArrowException, ValueError) as e:
            raise ValueError(f"{path}: unreadable detail records ({e}); run the same decon command again with "
                             "--verify-checksums to rebuild it") from None


def details_format_of(output: str) -> str:
    """Which format the decon output ``output`` holds its details in; ValueError when it holds
    neither (or both: a folder written by hand)."""
    has = [fmt for fmt, rel in (("parquet", DETAILS_DIR), ("jsonl", DETAILS_JSONL))
           if storage.exists(storage.join(output, rel))]
    if len(has) != 1:
        raise ValueError(f"{output}: expected one of {DETAILS_DIR}/ or {DETAILS_JSONL} (a finished refinery decon "
                         f"output), found {' and '.join(has) or 'neither'}")
    return has[0]


def read_details(output: str) -> Iterator[dict[str, Any]]:
    """Every detail record of the decon output ``output``, in partition order, whichever the
    format: the dicts of ``overlap_details.jsonl.gz``'s lines (a lone surrogate, from text that
    was not valid UTF-8, given as its ``\\uXXXX`` escape, as Parquet holds it)."""
    if details_format_of(output) == "jsonl":
        path = storage.join(output, DETAILS_JSONL)
        with storage.open_read(path) as raw, gzip.open(raw, "rb") as f:
            for i, line in enumerate(f, 1):
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"{path}: line {i} is not JSON ({e})") from None
                if b"\\ud" in line.lower():  # may hold a lone surrogate: given as Parquet holds it
                    record = {k: utf8(v) if isinstance(v, str) else v for k, v in record.items()}
                yield record
        return
    folder = storage.join(output, DETAILS_DIR)
    for path in sorted(p for p in storage.listdir(folder) if p.endswith(".parquet")):
        yield from read_parquet_part(path)
