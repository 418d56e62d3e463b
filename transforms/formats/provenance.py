"""A shard's provenance sidecar: from a token document back to the row it was made from.

Beside each shard's ``.npy``/``.idx``, ``{dataset}-v1-shard-NNNNNN.docs.parquet`` (documented
in ``docs/FORMATS.md``): one row per document of the shard, in shard order, with the columns
of :data:`SCHEMA`:

- ``doc`` (uint64): the document's index in the shard (its ``.idx`` entry),
- ``doc_id`` (string): its id (the id field, else ``relpath:row``, ...: ``prep.documents``),
- ``source`` (string): the path of the input file its row was read from, as prep read it
  (the path ``rejects.jsonl`` names; ``""`` for a row given to ``Normalize`` as a plain dict),
- ``row`` (uint64): the row's 0-based number in that file (a line of a ``.jsonl``, a row of a
  ``.parquet``), counted over the whole file whatever units it was split into,
- ``num_tokens`` (uint64): the document's tokens, EOS included (equal to its ``.idx`` length).

The row number is what locates a row, however the file was read (whole, by parquet row
groups or by byte ranges): the same key as ``rejects.jsonl`` and decon's drop lists.

The bytes are a function of those values alone: fixed writer options, row groups of
exactly :data:`ROWS_PER_GROUP` documents (the last one shorter), no timestamp; so ``refinery
prep`` and ``WriteTokenShards`` write the same sidecar for the same documents. It is written
through the unit's atomic writer, so its receipt lists it (size, sha256) and ``manifest.json``
names it (``docs_path``, ``docs_sha256``). A string that is not valid Unicode (an id with an
unpaired surrogate) is written with that code point as a ``\\udXXX`` escape.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Sequence

import numpy as np

from refinery.transforms.io import storage
from refinery.transforms.io.arrow_columns import Utf8Column, int_column, string_column
from refinery.transforms.io.positioned import PositionedWriter
from refinery.transforms.io.rows import iter_rows

if TYPE_CHECKING:
    import pyarrow as pa

DOCS_FORMAT = "docs.parquet/1"  # enters the hash of the stages that write sidecars
DOCS_SUFFIX = ".docs.parquet"
COLUMNS = ("doc", "doc_id", "source", "row", "num_tokens")
ROWS_PER_GROUP = 1 << 16
WRITER_OPTIONS: dict[str, Any] = {"compression": "zstd", "compression_level": 3, "use_dictionary": True,
                                  "write_statistics": True, "version": "2.6", "data_page_size": 1 << 20}

# a batch of documents, in shard order: (doc ids, sources, rows, token counts); the ids and
# sources as strings or as their bytes (a Utf8Column: as the spill holds them, none decoded)
DocBatch = tuple[Sequence[str] | Utf8Column, Sequence[str] | Utf8Column, Sequence[int] | np.ndarray,
                 Sequence[int] | np.ndarray]


def schema() -> pa.Schema:
    """The sidecar's columns and types."""
    import pyarrow as pa

    return pa.schema([("doc", pa.uint64()), ("doc_id", pa.string()), ("source", pa.string()),
                      ("row", pa.uint64()), ("num_tokens", pa.uint64())])


def docs_path_for(npy_path: str) -> str:
    """``.../name.npy`` -> ``.../name.docs.parquet``."""
    if not npy_path.endswith(".npy"):
        raise ValueError(f"{npy_path}: not a .npy shard")
    return npy_path[: -len(".npy")] + DOCS_SUFFIX


class DocsWriter:
    """Writes a sidecar to ``out`` (a byte writer: the unit's atomic one) document by document,
    in row groups of :data:`ROWS_PER_GROUP`: memory holds one row group, whatever the shard's size."""

    def __init__(self, out: storage.BinaryWriter):
        import pyarrow as pa
        import pyarrow.parquet as pq

        self._file = pa.PythonFile(PositionedWriter(out), mode="w")
        self._writer = pq.ParquetWriter(self._file, schema(), **WRITER_OPTIONS)
        self._ids: list[Utf8Column] = []  # what is buffered, as it came
        self._sources: list[Utf8Column] = []
        self._rows: list[np.ndarray] = []
        self._lengths: list[np.ndarray] = []
        self._buffered = 0
        self.docs = 0  # documents written or buffered

    def add(self, batch: DocBatch) -> None:
        ids, sources, rows, lengths = batch
        n = len(ids)
        if not len(sources) == len(rows) == len(lengths) == n:
            raise ValueError(f"a documents batch of {n} ids, {len(sources)} sources, {len(rows)} rows, "
                             f"{len(lengths)} lengths")
        self._ids.append(Utf8Column.of(ids))
        self._sources.append(Utf8Column.of(sources))
        self._rows.append(np.asarray(rows, np.uint64))
        self._lengths.append(np.asarray(lengths, np.uint64))
        self.docs += n
        self._buffered += n
        if self._buffered >= ROWS_PER_GROUP:
            self._write(final=False)

    def _write(self, final: bool) -> None:
        import pyarrow as pa

        rows = np.concatenate(self._rows) if self._rows else np.zeros(0, np.uint64)
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.uint64)
        ids, sources = (Utf8Column.concat(c) if c else Utf8Column.of([]) for c in (self._ids, self._sources))
        first = self.docs - self._buffered
        cut = self._buffered if final else self._buffered - self._buffered % ROWS_PER_GROUP
        for lo in range(0, cut, ROWS_PER_GROUP):
            hi = min(lo + ROWS_PER_GROUP, cut)
            table = pa.Table.from_arrays(
                [int_column(np.arange(first + lo, first + hi, dtype=np.uint64), "uint64"),
                 string_column(ids.slice(lo, hi)), string_column(sources.slice(lo, hi)),
                 int_column(rows[lo:hi], "uint64"), int_column(lengths[lo:hi], "uint64")], schema=schema())
            self._writer.write_table(table, row_group_size=ROWS_PER_GROUP)
        self._ids, self._sources = [ids.slice(cut, self._buffered)], [sources.slice(cut, self._buffered)]
        self._rows, self._lengths = [rows[cut:]], [lengths[cut:]]
        self._buffered -= cut

    def close(self) -> int:
        """Write what is buffered and the footer; returns the number of documents."""
        self._write(final=True)
        self._writer.close()
        self._file.close()
        return self.docs


def write_docs(open_write: Callable[[str], ContextManager[storage.BinaryWriter]], path: str,
               batches: Iterable[DocBatch]) -> int:
    """THE sidecar writer: ``batches`` (a shard's documents in order) -> ``path``, through
    ``open_write`` (``UnitContext.open_write``: atomic, listed in the receipt). Returns the
    number of documents written."""
    with open_write(path) as out:
        writer = DocsWriter(out)
        for batch in batches:
            writer.add(batch)
        return writer.close()


def _parquet(path: str) -> Any:
    import pyarrow.parquet as pq

    if storage.is_remote(path):
        return pq.ParquetFile(storage.open_read(path))
    return pq.ParquetFile(path)


def read_doc(path: str, i: int) -> dict[str, Any]:
    """Row ``i`` of a sidecar (reading only its row group): ``{doc, doc_id, source, row, num_tokens}``.
    IndexError when the sidecar holds no document ``i``; ValueError when it is not a sidecar."""
    f = _parquet(path)
    problems = _schema_problems(path, f)
    if problems:
        raise ValueError(problems[0])
    n = f.metadata.num_rows
    if not 0 <= i < n:
        raise IndexError(f"{path}: document {i} out of range (0..{n - 1})")
    group = i // ROWS_PER_GROUP
    row: dict[str, Any] = f.read_row_group(group).slice(i - group * ROWS_PER_GROUP, 1).to_pylist()[0]
    if row["doc"] != i:
        raise ValueError(f"{path}: row {i} is document {row['doc']}, not {i} (not a sidecar's row groups)")
    return row


def _schema_problems(path: str, f: Any) -> list[str]:
    got = f.schema_arrow
    if not got.equals(schema()):
        return [f"{path}: columns {', '.join(f'{c.name} {c.type}' for c in got)}, expected "
                f"{', '.join(f'{c.name} {c.type}' for c in schema())}"]
    return []


def check_docs(path: str, lengths: np.ndarray | None = None, expected_docs: int | None = None) -> list[str]:
    """Problems with a shard's sidecar ([] if none): missing, not Parquet, other columns, a
    document count other than the shard's, a ``doc`` column other than 0..n-1, or token counts
    other than the ``.idx`` lengths (``lengths``, when given). Reads the sidecar a row group
    at a time."""
    try:
        f = _parquet(path)
    except FileNotFoundError:
        return [f"{path}: missing (the shard's provenance sidecar)"]
    except Exception as e:  # noqa: BLE001 - any parse failure is a problem to report
        return [f"{path}: not a readable Parquet file ({type(e).__name__}: {e})"]
    problems = _schema_problems(path, f)
    if problems:
        return problems
    n = f.metadata.num_rows
    if expected_docs is not None and n != expected_docs:
        return [f"{path}: {n} documents, the shard holds {expected_docs}"]
    if lengths is not None and n != len(lengths):
        return [f"{path}: {n} documents, the shard's .idx holds {len(lengths)}"]
    lo = 0
    for g in range(f.num_row_groups):
        try:
            t = f.read_row_group(g, columns=["doc", "num_tokens"])
        except Exception as e:  # noqa: BLE001 - a damaged page (a flipped byte): reported, never a crash
            return [f"{path}: not a readable Parquet file (row group {g}: {type(e).__name__}: {e})"]
        doc = t.column("doc").to_numpy()
        if not np.array_equal(doc, np.arange(lo, lo + len(doc), dtype=np.uint64)):
            return [f"{path}: the doc column is not 0..{n - 1} in order (row group {g})"]
        if lengths is not None:
            want = np.asarray(lengths[lo:lo + len(doc)], np.uint64)
            bad = np.flatnonzero(t.column("num_tokens").to_numpy() != want)
            if len(bad):
                k = lo + int(bad[0])
                return [f"{path}: document {k} has {int(t.column('num_tokens')[int(bad[0])].as_py())} tokens, "
                        f"the .idx says {int(lengths[k])}"]
        lo += len(doc)
    return []


def source_row(source: str, row: int) -> tuple[dict[str, Any] | None, str | None]:
    """(record, None) of row ``row`` of the input file ``source`` as prep reads it, or
    (None, why not): the file is gone, holds fewer rows, or that row is not readable. Reads
    the file from its start up to that row (parquet: rows still counted from the file's start)."""

    try:
        for k, record, error in iter_rows(source):
            if k == row:
                return (record, None) if error is None else (None, f"row {row}: {error}")
            if k > row:
                break
    except FileNotFoundError:
        return None, f"{source}: not found here"
    except Exception as e:  # noqa: BLE001 - showing the row is a convenience: say why not
        return None, f"{source}: not readable here ({type(e).__name__}: {e})"
    return None, f"{source}: no row {row}"
