"""Spill files: the tokens of one tokenize unit, grouped by output shard.

This is how prep "shuffles" documents to shards in a way that survives restarts: each
tokenize unit writes one spill, and each pack unit reads its shard's ranges from every
spill, in unit order. Memory is bounded: tokens are buffered per shard up to ``run_tokens``
and then flushed as a *run* (shards in ascending order, documents of a shard in input
order), so a unit of any size holds at most one run in memory.

Three files per unit (none ends in ``.npy``: only shards may):

- ``<unit>.spill``: raw little-endian uint32 tokens, runs back to back, no header.
- ``<unit>.spilldocs``: an NPY-format structured array, one row per accepted document,
  sorted by shard and, within a shard, in input order: ``shard`` (u4), ``length`` (u4,
  tokens incl. EOS), ``offset`` (u8, token offset in ``.spill``), ``cum_end`` (u8, tokens of
  this and all earlier documents of the unit in input order: what ``--max-tokens`` cuts on).
- ``<unit>.spillshards``: NPY uint64[num_shards + 1], where each shard's rows start in the
  documents table, so a pack unit reads only its own shard's rows.
"""
from __future__ import annotations

from array import array
from typing import IO, Iterator

import numpy as np

from refinery.transforms.core.storage import BinaryWriter
from refinery.transforms.formats.shards import u32_bytes

DOC_DTYPE = np.dtype([("shard", "<u4"), ("length", "<u4"), ("offset", "<u8"), ("cum_end", "<u8")])
READ_CHUNK_TOKENS = 1 << 22


class SpillWriter:
    """Accumulates documents for one unit; ``close()`` returns the documents table.

    A run is held as one byte buffer per shard (a document's tokens are appended to its
    shard's buffer as it comes) and two small arrays (shard and length per document, in
    input order), so a flush writes each shard's bytes once, with no per-document work."""

    def __init__(self, tokens_out: BinaryWriter, run_tokens: int = 1 << 24):
        self._out = tokens_out
        self._run_tokens = run_tokens
        self._written = 0                      # tokens already flushed
        self._buffered = 0                     # tokens in the current run
        self._runs: dict[int, bytearray] = {}  # shard -> its tokens in this run, in input order
        self._shards = array("I")              # per document of the run, in input order
        self._lengths = array("I")
        self._ends: list[int] = []             # given input positions (a merge), else empty
        self._tables: list[np.ndarray] = []
        self._cum = 0

    def add(self, shard: int, tokens, cum_end: int | None = None) -> None:
        """Append one document's tokens (a uint32 ``array('I')`` or numpy array). ``cum_end``:
        its position in the whole input, when it is known already (merging spills); then
        every document must be given one, and those of a shard must come in input order."""
        if cum_end is not None:
            self._ends.append(cum_end)
        run = self._runs.get(shard)
        if run is None:
            run = self._runs[shard] = bytearray()
        run += _le_u32(tokens)
        n = len(tokens)
        self._shards.append(shard)
        self._lengths.append(n)
        self._buffered += n
        if self._buffered >= self._run_tokens:
            self._flush()

    def add_batch(self, shards: np.ndarray, order: np.ndarray, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append a batch of documents of the unit, next in input order, as buffers.
        ``shards``: each document's shard, in input order. ``order``: the stable argsort of
        ``shards`` (:func:`~refinery.transforms.prep.documents.encode_by_shard`'s); ``tokens``
        and ``lengths`` (uint32, EOS included) are the documents' in that order, so each
        shard's tokens are one slice, appended to its run as it is."""
        n = len(shards)
        if n == 0:
            return
        if self._ends:
            raise ValueError("add_batch: this spill's documents are given input positions (add with cum_end)")
        sorted_shards = shards[order]
        cuts = np.flatnonzero(sorted_shards[1:] != sorted_shards[:-1]) + 1  # where a shard's documents start
        doc_lo = np.concatenate(([0], cuts))
        bounds = np.zeros(n + 1, np.int64)
        np.cumsum(lengths, out=bounds[1:])
        raw = _le_u32(tokens)
        for shard, lo, hi in zip(sorted_shards[doc_lo].tolist(), bounds[doc_lo].tolist(),
                                 bounds[np.append(cuts, n)].tolist()):
            run = self._runs.get(shard)
            if run is None:
                run = self._runs[shard] = bytearray()
            run += raw[4 * lo:4 * hi]
        in_order = np.empty(n, np.uint32)
        in_order[order] = lengths
        self._shards.frombytes(np.ascontiguousarray(shards, np.uint32).tobytes())
        self._lengths.frombytes(in_order.tobytes())
        self._buffered += int(bounds[-1])
        if self._buffered >= self._run_tokens:
            self._flush()

    def _flush(self) -> None:
        if not self._shards:
            return
        n = len(self._shards)
        table = np.zeros(n, DOC_DTYPE)
        table["shard"] = np.frombuffer(self._shards, f"=u{self._shards.itemsize}")  # (4 bytes on every usual C)
        table["length"] = np.frombuffer(self._lengths, f"=u{self._lengths.itemsize}")
        if self._ends:
            table["cum_end"] = self._ends
            self._ends = []
        else:
            table["cum_end"] = self._cum + np.cumsum(table["length"], dtype=np.uint64)
            self._cum = int(table["cum_end"][-1])
        order = np.argsort(table["shard"], kind="stable")
        starts = np.zeros(n, np.uint64)
        starts[order] = self._written + np.concatenate(([0], np.cumsum(table["length"][order], dtype=np.uint64)[:-1]))
        table["offset"] = starts
        for shard in sorted(self._runs):  # shards in ascending order, each one's documents in input order
            self._out.write(self._runs[shard])
        self._written += self._buffered
        self._tables.append(table)
        self._runs, self._shards, self._lengths, self._buffered = {}, array("I"), array("I"), 0

    def close(self) -> np.ndarray:
        self._flush()
        return np.concatenate(self._tables) if self._tables else np.zeros(0, DOC_DTYPE)


def _le_u32(tokens):
    """``tokens`` as little-endian uint32 bytes: the object itself where its buffer already is."""
    if isinstance(tokens, array):
        if np.little_endian and tokens.itemsize == 4 and tokens.typecode in "IL":
            return tokens
    elif isinstance(tokens, np.ndarray) and tokens.dtype == _LE_U32 and tokens.flags.c_contiguous:
        return memoryview(tokens).cast("B")  # (bytearray += ndarray would be numpy's addition)
    return u32_bytes(tokens)


_LE_U32 = np.dtype("<u4")


def by_shard(table: np.ndarray, num_shards: int) -> tuple[np.ndarray, np.ndarray]:
    """(table sorted by shard, stable; uint64[num_shards + 1] row starts per shard)."""
    table = table[np.argsort(table["shard"], kind="stable")]
    starts = np.searchsorted(table["shard"], np.arange(num_shards + 1), side="left").astype(np.uint64)
    return table, starts


def write_array(out: BinaryWriter, array: np.ndarray) -> None:
    np.lib.format.write_array(out, array, allow_pickle=False)


def read_table(docs_file: IO[bytes]) -> np.ndarray:
    """A whole documents table (``.spilldocs``)."""
    table = np.load(docs_file, allow_pickle=False)
    if table.dtype != DOC_DTYPE or table.ndim != 1:
        raise ValueError(f"spill documents table has dtype {table.dtype} shape {table.shape}, expected {DOC_DTYPE}")
    return table


def iter_documents(tokens_file: IO[bytes], table: np.ndarray) -> Iterator[tuple[int, np.ndarray, int]]:
    """(shard, tokens, cum_end) of every document of a spill, reading the ``.spill`` front to
    back once (offset order: a shard's documents come in input order)."""
    by_offset = np.argsort(table["offset"], kind="stable")
    pos = 0
    for i in by_offset.tolist():
        off, n = int(table["offset"][i]), int(table["length"][i])
        if off != pos:
            tokens_file.seek(4 * off)
        raw = tokens_file.read(4 * n)
        if len(raw) != 4 * n:
            raise ValueError(f"spill file is truncated at token {off}")
        yield int(table["shard"][i]), np.frombuffer(raw, dtype="<u4"), int(table["cum_end"][i])
        pos = off + n


def write_contiguous(local: IO[bytes], table: np.ndarray, out: BinaryWriter) -> np.ndarray:
    """Copy the documents of ``table`` (sorted by shard) from the local spill ``local`` to
    ``out`` in table order, so each shard's tokens are one contiguous range; returns the
    table with its offsets into ``out``."""
    local.flush()
    table = table.copy()
    pos = 0
    offsets = np.empty(len(table), np.uint64)
    for k, (off, n) in enumerate(zip(table["offset"].tolist(), table["length"].tolist())):
        local.seek(4 * off)
        out.write(local.read(4 * n))
        offsets[k] = pos
        pos += n
    table["offset"] = offsets
    return table


def read_shard_rows(docs_file: IO[bytes], starts: np.ndarray, shard: int) -> np.ndarray:
    """The documents-table rows of one shard, read with one seek (not the whole table)."""
    version = np.lib.format.read_magic(docs_file)
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = read_header(docs_file)
    if dtype != DOC_DTYPE or len(shape) != 1:
        raise ValueError(f"spill documents table has dtype {dtype} shape {shape}, expected {DOC_DTYPE}")
    lo, hi = int(starts[shard]), int(starts[shard + 1])
    docs_file.seek(docs_file.tell() + lo * DOC_DTYPE.itemsize)
    data = docs_file.read((hi - lo) * DOC_DTYPE.itemsize)
    if len(data) != (hi - lo) * DOC_DTYPE.itemsize:
        raise ValueError("spill documents table is truncated")
    return np.frombuffer(data, DOC_DTYPE)


def within_budget(rows: np.ndarray, budget_left: int | None) -> np.ndarray:
    """Rows whose cumulative unit position stays within the remaining token budget."""
    if budget_left is None:
        return rows
    return rows[rows["cum_end"] <= np.uint64(max(budget_left, 0))]


def contiguous_ranges(docs: np.ndarray) -> list[tuple[int, int]]:
    """Coalesced [start, end) token ranges in the spill covering ``docs`` (in order)."""
    ranges: list[tuple[int, int]] = []
    for off, length in zip(docs["offset"].tolist(), docs["length"].tolist()):
        if ranges and ranges[-1][1] == off:
            ranges[-1] = (ranges[-1][0], off + length)
        else:
            ranges.append((off, off + length))
    return ranges


def iter_token_chunks(f: IO[bytes], ranges: list[tuple[int, int]],
                      chunk_tokens: int = READ_CHUNK_TOKENS) -> Iterator[bytes]:
    """Raw uint32 bytes of the given token ranges, read in bounded chunks."""
    for start, end in ranges:
        f.seek(start * 4)
        left = end - start
        while left > 0:
            n = min(left, chunk_tokens)
            data = f.read(n * 4)
            if len(data) != n * 4:
                raise ValueError(f"spill file is truncated at token {start + (end - start - left)}")
            yield data
            left -= n
