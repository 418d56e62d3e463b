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
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from refinery.transforms.core import storage
from refinery.transforms.core.jsonl import JSON_ERRORS

from .index import EvalRow, SameText

DETAILS_FORMATS = ("parquet", "jsonl")
DETAILS_JSONL = "stats/overlap_details.jsonl.gz"  # --details-format jsonl: one file
DETAILS_DIR = "stats/overlap_details"             # --details-format parquet: a part per eval partition

ROW_GROUP_ROWS = 1 << 15   # rows of a row group, at most (fewer in a partition's last one)
HELD_CHARS = 4 << 20       # string characters of the rows of a row group, at most (a row's own count)
CACHE_EVALS = 1024         # records with at most this many eval rows keep their eval columns
COMPRESSION_LEVEL = 3      # zstd

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
    inner = pa.ListArray.from_arrays(pa.array(np.arange(0, len(flat) + 1, 2, dtype=np.int32)),
                                     pa.array(flat, pa.int32()))
    outer = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=outer[1:])
    return pa.ListArray.from_arrays(pa.array(outer), inner).cast(PAIRS)


def strings(values: list[str]) -> pa.Array:
    """A string column; a lone surrogate (text that was not valid UTF-8) becomes its ``\\uXXXX``
    escape, as in the JSON lines (where a JSON reader turns it back into the surrogate)."""
    try:
        return pa.array(values, pa.string())
    except UnicodeEncodeError:
        return pa.array([utf8(v) for v in values], pa.string())


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
                   pa.array([r.eval_row for r in eval_rows], pa.int64()),
                   strings([r.instance_id for r in eval_rows]),
                   pa.array([len(same.others.get(r.eval_idx, ())) for r in eval_rows], pa.int32()))

    def take(self, idx: np.ndarray) -> list[pa.Array]:
        at = pa.array(idx, pa.int64())
        return [c.take(at) for c in (self.eval_dataset, self.eval_path, self.eval_row, self.instance_id,
                                     self.same_text)]


class _Position:
    """A write-only file that knows its position (what pyarrow asks of a Python file)."""

    def __init__(self, out: storage.BinaryWriter):
        self.out, self.position, self.closed = out, 0, False

    def write(self, data: bytes) -> int:
        n = self.out.write(data)
        self.position += n
        return n

    def tell(self) -> int:
        return self.position

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class DetailRows:
    """A partition's detail records, written to ``out`` (a binary file) as Parquet.

    :meth:`add` takes one (training row, n-gram) hit and the first ``room`` of the n-gram's
    eval rows (``[eval_idx, eval offsets]``, one per distinct text): ``room`` rows, in that
    order. :meth:`close` writes what is held and the file's footer (a file with no rows has
    the schema and no row group)."""

    def __init__(self, out: storage.BinaryWriter, evals: EvalColumns, row_group_rows: int = ROW_GROUP_ROWS):
        self.evals = evals
        self.row_group_rows = row_group_rows
        self.writer = pq.ParquetWriter(pa.PythonFile(_Position(out), mode="w"), SCHEMA, compression="zstd",
                                       compression_level=COMPRESSION_LEVEL)
        self.cache: dict[int, tuple[list[int], list[int], list[int], list[int]]] = {}
        self.rows = 0  # written, all row groups
        self._clear()

    _HIT_COLUMNS = ("n", "ngram", "ngram_truncated", "train_path", "train_row", "train_doc_id", "train_pairs",
                    "train_flat", "train_snippet_start", "train_snippet", "train_snippet_truncated", "rows")

    def _clear(self) -> None:
        self._columns: tuple[list, ...] = tuple([] for _ in self._HIT_COLUMNS)  # the hits' columns, in that order
        self.eval_idx: list[int] = []    # the eval side of the rows held, one entry per row
        self.eval_pairs: list[int] = []
        self.eval_flat: list[int] = []
        self.held_rows = self.held_chars = 0

    def _eval_side(self, key: int, evals: list, a: int, b: int) -> tuple[list[int], list[int], list[int]]:
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

    def add(self, key: int, n: int, ngram: str, ngram_truncated: bool, evals: list, room: int, train_path: str,
            train_row: int, train_doc_id: str, train_offsets: list, snippet_start: int, snippet: str,
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
        rep = pa.array(np.repeat(np.arange(len(h["rows"]), dtype=np.int64), h["rows"]))
        hit_cols = {
            "n": pa.array(h["n"], pa.int32()), "ngram": strings(h["ngram"]),
            "ngram_truncated": pa.array(h["ngram_truncated"], pa.bool_()),
            "train_path": _names(h["train_path"]), "train_row": pa.array(h["train_row"], pa.int64()),
            "train_doc_id": strings(h["train_doc_id"]),
            "train_offsets": pairs_array(np.asarray(h["train_pairs"], dtype=np.int64),
                                         np.asarray(h["train_flat"], dtype=np.int64)),
            "train_snippet_start": pa.array(h["train_snippet_start"], pa.int64()),
            "train_snippet": strings(h["train_snippet"]),
            "train_snippet_truncated": pa.array(h["train_snippet_truncated"], pa.bool_()),
        }
        eval_cols = dict(zip(("eval_dataset", "eval_path", "eval_row", "instance_id", "same_text"),
                             self.evals.take(np.asarray(self.eval_idx, dtype=np.int64))))
        eval_cols["eval_offsets"] = pairs_array(np.asarray(self.eval_pairs, dtype=np.int64),
                                                np.asarray(self.eval_flat, dtype=np.int64))
        columns = [eval_cols[f.name] if f.name in eval_cols else hit_cols[f.name].take(rep) for f in SCHEMA]
        self.writer.write_table(pa.Table.from_arrays(columns, schema=SCHEMA), row_group_size=self.held_rows)
        self.rows += self.held_rows
        self._clear()

    def close(self) -> None:
        self.flush()
        self.writer.close()


def record_of(row: dict) -> dict:
    """A Parquet row as the dict of its JSON line: the optional keys only when set."""
    return {k: v for k, v in row.items() if k not in OPTIONAL or v != OPTIONAL[k]}


def read_parquet_part(path: str) -> Iterator[dict]:
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


def read_details(output: str) -> Iterator[dict]:
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
