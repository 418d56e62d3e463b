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

And two that carry each document's provenance to pack (its sidecar, ``formats.provenance``):

- ``<unit>.spillmeta``: an NPY structured array aligned row for row with ``.spilldocs``:
  ``row`` (u8, the row's number in its file), ``names`` (u8, byte offset in ``.spillnames``),
  ``id_bytes`` and ``source_bytes`` (u4).
- ``<unit>.spillnames``: per document, its id then its source path (UTF-8, surrogates passed),
  at ``names``; written like the tokens, run by run and shard by shard, so a shard's names
  are a few contiguous ranges.
"""
from __future__ import annotations

from array import array
from typing import IO, Iterator, Sequence

import numpy as np

from refinery.transforms.formats.shards import u32_bytes
from refinery.transforms.io import storage
from refinery.transforms.io.arrow_columns import Utf8Column
from refinery.transforms.io.storage import BinaryWriter

DOC_DTYPE = np.dtype([("shard", "<u4"), ("length", "<u4"), ("offset", "<u8"), ("cum_end", "<u8")])
META_DTYPE = np.dtype([("row", "<u8"), ("names", "<u8"), ("id_bytes", "<u4"), ("source_bytes", "<u4")])
SPILL_FORMAT = "spill/2: names"  # enters tokenize's hash: spills of before carry no names
NAMES_BATCH = 1 << 16  # documents whose names pack reads at once
READ_CHUNK_TOKENS = 1 << 22


def spill_files(parts_dir: str, unit_id: str) -> dict[str, str]:
    """The spill of one tokenize (or merge) unit: tokens, documents table, per-shard starts,
    and the documents' names table and names (their provenance)."""
    return {k: storage.join(parts_dir, f"{unit_id}.{ext}") for k, ext in
            (("tokens", "spill"), ("docs", "spilldocs"), ("shards", "spillshards"), ("meta", "spillmeta"),
             ("names", "spillnames"))}


class SpillWriter:
    """Accumulates documents for one unit; ``close()`` returns the documents table.

    A run is held as one byte buffer per shard (a document's tokens are appended to its
    shard's buffer as it comes) and two small arrays (shard and length per document, in
    input order), so a flush writes each shard's bytes once, with no per-document work."""

    def __init__(self, tokens_out: BinaryWriter, run_tokens: int = 1 << 24, names_out: BinaryWriter | None = None):
        """``names_out``: where the documents' names go (``.spillnames``); then every document
        is added with its (row, doc id, source) and :attr:`meta` is its table after ``close()``."""
        self._out = tokens_out
        self._names_out = names_out
        self._name_runs: dict[int, bytearray] = {}  # shard -> its names in this run, in input order
        self._rows = array("Q")                     # per document of the run, in input order
        self._id_bytes = array("I")
        self._source_bytes = array("I")
        self._names_written = 0
        self._meta_tables: list[np.ndarray] = []
        self._source_cache: tuple[str, bytes] = ("", b"")
        self.meta = np.zeros(0, META_DTYPE)
        self._run_tokens = run_tokens
        self._written = 0                      # tokens already flushed
        self._buffered = 0                     # tokens in the current run
        self._runs: dict[int, bytearray] = {}  # shard -> its tokens in this run, in input order
        self._shards = array("I")              # per document of the run, in input order
        self._lengths = array("I")
        self._ends: list[int] = []             # given input positions (a merge), else empty
        self._tables: list[np.ndarray] = []
        self._cum = 0

    def add(self, shard: int, tokens: array[int] | np.ndarray | Sequence[int], cum_end: int | None = None,
            name: tuple[int, str, str] | None = None) -> None:
        """Append one document's tokens (a uint32 ``array('I')`` or numpy array). ``cum_end``:
        its position in the whole input, when it is known already (merging spills); then
        every document must be given one, and those of a shard must come in input order.
        ``name``: its (row, doc id, source), required with ``names_out``."""
        if self._names_out is not None:
            if name is None:
                raise ValueError("SpillWriter.add: this spill records names: give each document its (row, id, source)")
            id_b, source_b = self._encode(name[1], name[2])
            self._name_run(shard).extend(id_b + source_b)
            self._rows.append(name[0])
            self._id_bytes.append(len(id_b))
            self._source_bytes.append(len(source_b))
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

    def add_batch(self, shards: np.ndarray, order: np.ndarray, tokens: np.ndarray, lengths: np.ndarray,
                  names: tuple[Sequence[int], Sequence[str], Sequence[str]] | None = None) -> None:
        """Append a batch of documents of the unit, next in input order, as buffers.
        ``shards``: each document's shard, in input order. ``order``: the stable argsort of
        ``shards`` (:func:`~refinery.transforms.prep.documents.encode_by_shard`'s); ``tokens``
        and ``lengths`` (uint32, EOS included) are the documents' in that order, so each
        shard's tokens are one slice, appended to its run as it is. ``names``: (rows, doc ids,
        sources) in input order, required with ``names_out``."""
        n = len(shards)
        if n == 0:
            return
        if self._ends:
            raise ValueError("add_batch: this spill's documents are given input positions (add with cum_end)")
        if self._names_out is not None:
            if names is None or not len(names[0]) == len(names[1]) == len(names[2]) == n:
                raise ValueError(f"add_batch: this spill records names: give the {n} documents' rows, ids, sources")
            self._add_names(names, order, shards[order])
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

    def _add_names(self, names: tuple[Sequence[int], Sequence[str], Sequence[str]], order: np.ndarray,
                   sorted_shards: np.ndarray) -> None:
        """A batch's names (rows, ids, sources in input order) into the run: each document's id
        then its source, UTF-8 with surrogates passed, in shard order (``order``), encoded in one
        call, and each shard's bytes appended to its run as one slice."""
        rows, ids, sources = names
        at = order.tolist()
        parts: list[str] = [""] * (2 * len(at))
        parts[0::2] = [ids[i] for i in at]
        parts[1::2] = [sources[i] for i in at]
        text = "".join(parts)
        blob = text.encode("utf-8", "surrogatepass")
        view = memoryview(blob)
        if len(blob) == len(text):  # ASCII: a character is a byte
            id_n = np.fromiter(map(len, ids), np.uint32, len(ids))
            source_n = np.fromiter(map(len, sources), np.uint32, len(sources))
        else:
            encoded = [self._encode(i, s) for i, s in zip(ids, sources)]
            id_n = np.array([len(i) for i, _ in encoded], np.uint32)
            source_n = np.array([len(s) for _, s in encoded], np.uint32)
        self._rows.extend(rows)
        self._id_bytes.frombytes(id_n.astype(f"=u{self._id_bytes.itemsize}").tobytes())
        self._source_bytes.frombytes(source_n.astype(f"=u{self._source_bytes.itemsize}").tobytes())
        bounds = np.zeros(len(at) + 1, np.int64)
        np.cumsum(id_n[order].astype(np.int64) + source_n[order], out=bounds[1:])
        cuts = np.flatnonzero(sorted_shards[1:] != sorted_shards[:-1]) + 1  # each shard's first document
        firsts, ends = np.concatenate(([0], cuts)), np.append(cuts, len(at))
        for shard, lo, hi in zip(sorted_shards[firsts].tolist(), bounds[firsts].tolist(), bounds[ends].tolist()):
            self._name_run(shard).extend(view[lo:hi])

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
        if self._names_out is not None:
            meta = np.zeros(n, META_DTYPE)
            meta["row"] = np.frombuffer(self._rows, f"=u{self._rows.itemsize}")
            meta["id_bytes"] = np.frombuffer(self._id_bytes, f"=u{self._id_bytes.itemsize}")
            meta["source_bytes"] = np.frombuffer(self._source_bytes, f"=u{self._source_bytes.itemsize}")
            sizes = meta["id_bytes"].astype(np.uint64) + meta["source_bytes"]
            names = np.zeros(n, np.uint64)  # the same order as the tokens: run, shard, input order
            names[order] = self._names_written + np.concatenate(([0], np.cumsum(sizes[order], dtype=np.uint64)[:-1]))
            meta["names"] = names
            for shard in sorted(self._name_runs):
                self._names_out.write(self._name_runs[shard])
            self._names_written += int(sizes.sum(dtype=np.uint64))
            self._meta_tables.append(meta)
            self._name_runs, self._rows, self._id_bytes, self._source_bytes = {}, array("Q"), array("I"), array("I")

    def _name_run(self, shard: int) -> bytearray:
        run = self._name_runs.get(shard)
        if run is None:
            run = self._name_runs[shard] = bytearray()
        return run

    def _encode(self, doc_id: str, source: str) -> tuple[bytes, bytes]:
        if source != self._source_cache[0]:  # a unit's documents mostly share their file
            self._source_cache = (source, source.encode("utf-8", "surrogatepass"))
        return doc_id.encode("utf-8", "surrogatepass"), self._source_cache[1]

    def close(self) -> np.ndarray:
        """Flush; the documents table (in input order). With ``names_out``, :attr:`meta` is
        then the names table aligned with it."""
        self._flush()
        if self._names_out is not None:
            self.meta = np.concatenate(self._meta_tables) if self._meta_tables else np.zeros(0, META_DTYPE)
        return np.concatenate(self._tables) if self._tables else np.zeros(0, DOC_DTYPE)


def _le_u32(tokens: array[int] | np.ndarray | Sequence[int]) -> array[int] | memoryview | bytes:
    """``tokens`` as little-endian uint32 bytes: the object itself where its buffer already is."""
    if isinstance(tokens, array):
        if np.little_endian and tokens.itemsize == 4 and tokens.typecode in "IL":
            return tokens
    elif isinstance(tokens, np.ndarray) and tokens.dtype == _LE_U32 and tokens.flags.c_contiguous:
        return tokens.data.cast("B")  # (bytearray += ndarray would be numpy's addition)
    return u32_bytes(tokens)


_LE_U32 = np.dtype("<u4")


def by_shard(table: np.ndarray, num_shards: int) -> tuple[np.ndarray, np.ndarray]:
    """(table sorted by shard, stable; uint64[num_shards + 1] row starts per shard)."""
    table = table[np.argsort(table["shard"], kind="stable")]
    starts = np.searchsorted(table["shard"], np.arange(num_shards + 1), side="left").astype(np.uint64)
    return table, starts


def by_shard_with_meta(table: np.ndarray, meta: np.ndarray,
                       num_shards: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`by_shard`, and the names table aligned with ``table`` put in the same order."""
    if len(meta) != len(table):
        raise ValueError(f"the names table has {len(meta)} rows, the documents table {len(table)}")
    order = np.argsort(table["shard"], kind="stable")
    sorted_table, starts = by_shard(table, num_shards)
    return sorted_table, meta[order], starts


def write_array(out: BinaryWriter, array: np.ndarray) -> None:
    np.lib.format.write_array(out, array, allow_pickle=False)


def read_table(docs_file: IO[bytes], dtype: np.dtype = DOC_DTYPE) -> np.ndarray:
    """A whole documents table (``.spilldocs``), or names table (``.spillmeta``, ``dtype``
    :data:`META_DTYPE`)."""
    table: np.ndarray = np.load(docs_file, allow_pickle=False)
    if table.dtype != dtype or table.ndim != 1:
        what = "documents" if dtype == DOC_DTYPE else "names"
        raise ValueError(f"spill {what} table has dtype {table.dtype} shape {table.shape}, expected {dtype}")
    return table


def iter_named_documents(tokens_file: IO[bytes], names_file: IO[bytes], table: np.ndarray,
                         meta: np.ndarray) -> Iterator[tuple[int, np.ndarray, int, tuple[int, str, str]]]:
    """(shard, tokens, cum_end, (row, doc id, source)) of every document of a spill, reading
    the ``.spill`` and ``.spillnames`` front to back once each (a document's names lie in the
    same order as its tokens)."""
    by_offset = np.argsort(table["offset"], kind="stable").tolist()
    docs = iter_documents(tokens_file, table)
    pos = 0
    for i, (shard, tokens, cum_end) in zip(by_offset, docs):
        off, id_n, src_n = int(meta["names"][i]), int(meta["id_bytes"][i]), int(meta["source_bytes"][i])
        if off != pos:
            names_file.seek(off)
        raw = names_file.read(id_n + src_n)
        if len(raw) != id_n + src_n:
            raise ValueError(f"spill names file is truncated at byte {off}")
        yield shard, tokens, cum_end, (int(meta["row"][i]), raw[:id_n].decode("utf-8", "surrogatepass"),
                                       raw[id_n:].decode("utf-8", "surrogatepass"))
        pos = off + id_n + src_n


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


def write_contiguous_names(local: IO[bytes], meta: np.ndarray, out: BinaryWriter) -> np.ndarray:
    """:func:`write_contiguous` of the names: copy each document's names (``meta`` in table
    order) from the local ``.spillnames`` to ``out``; returns ``meta`` with its offsets into ``out``."""
    local.flush()
    meta = meta.copy()
    pos = 0
    offsets = np.empty(len(meta), np.uint64)
    for k, (off, n) in enumerate(zip(meta["names"].tolist(),
                                     (meta["id_bytes"].astype(np.uint64) + meta["source_bytes"]).tolist())):
        local.seek(off)
        out.write(local.read(n))
        offsets[k] = pos
        pos += n
    meta["names"] = offsets
    return meta


def read_names(names_file: IO[bytes], meta: np.ndarray) -> tuple[list[str], list[str]]:
    """(doc ids, sources) of the documents of ``meta`` (rows of a names table), reading
    their coalesced byte ranges of ``.spillnames`` (give it a bounded batch of rows:
    :data:`NAMES_BATCH`)."""
    offs, id_ns = meta["names"].tolist(), meta["id_bytes"].tolist()
    sizes = (meta["id_bytes"].astype(np.uint64) + meta["source_bytes"]).tolist()
    ids: list[str] = []
    sources: list[str] = []
    i, n = 0, len(offs)
    while i < n:
        j, end = i + 1, offs[i] + sizes[i]
        while j < n and offs[j] == end:
            end += sizes[j]
            j += 1
        names_file.seek(offs[i])
        blob = names_file.read(end - offs[i])
        if len(blob) != end - offs[i]:
            raise ValueError(f"spill names file is truncated at byte {offs[i]}")
        for k in range(i, j):
            lo = offs[k] - offs[i]
            ids.append(blob[lo:lo + id_ns[k]].decode("utf-8", "surrogatepass"))
            sources.append(blob[lo + id_ns[k]:lo + sizes[k]].decode("utf-8", "surrogatepass"))
        i = j
    return ids, sources


def read_name_columns(names_file: IO[bytes], meta: np.ndarray) -> tuple[Utf8Column, Utf8Column]:
    """(doc ids, sources) of the documents of ``meta`` (rows of a names table) as their bytes,
    none decoded: :func:`read_names`'s strings, gathered by numpy from the coalesced byte
    ranges of ``.spillnames`` (give it a bounded batch of rows: :data:`NAMES_BATCH`)."""
    n = len(meta)
    offs = meta["names"].astype(np.int64)
    id_n, src_n = meta["id_bytes"].astype(np.int64), meta["source_bytes"].astype(np.int64)
    sizes = id_n + src_n
    if n == 0:
        return Utf8Column.of([]), Utf8Column.of([])
    firsts = np.flatnonzero(np.concatenate(([True], offs[1:] != offs[:-1] + sizes[:-1])))  # each range's first
    ends = np.append(firsts[1:], n)
    blobs, at = [], 0
    range_at = np.zeros(len(firsts), np.int64)  # where each range lies in the joined blobs
    for k, (lo, hi) in enumerate(zip(offs[firsts].tolist(), (offs[ends - 1] + sizes[ends - 1]).tolist())):
        names_file.seek(lo)
        blob = names_file.read(hi - lo)
        if len(blob) != hi - lo:
            raise ValueError(f"spill names file is truncated at byte {lo}")
        blobs.append(blob)
        range_at[k] = at
        at += hi - lo
    data = np.frombuffer(b"".join(blobs), np.uint8)
    which = np.repeat(np.arange(len(firsts)), ends - firsts)
    pos = offs - offs[firsts][which] + range_at[which]  # each document's names in data
    return _gather(data, pos, id_n), _gather(data, pos + id_n, src_n)


def _gather(data: np.ndarray, lo: np.ndarray, lengths: np.ndarray) -> Utf8Column:
    """The column of ``data[lo[i]:lo[i] + lengths[i]]`` for each i."""
    offsets = np.zeros(len(lo) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    index = np.repeat(lo - offsets[:-1], lengths) + np.arange(int(offsets[-1]), dtype=np.int64)
    return Utf8Column(data[index], offsets)


def read_shard_rows(docs_file: IO[bytes], starts: np.ndarray, shard: int, dtype: np.dtype = DOC_DTYPE) -> np.ndarray:
    """The rows of one shard of a documents table (or, ``dtype`` :data:`META_DTYPE`, of its
    names table), read with one seek (not the whole table)."""
    version = np.lib.format.read_magic(docs_file)
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, got = read_header(docs_file)
    what = "documents" if dtype == DOC_DTYPE else "names"
    if got != dtype or len(shape) != 1:
        raise ValueError(f"spill {what} table has dtype {got} shape {shape}, expected {dtype}")
    lo, hi = int(starts[shard]), int(starts[shard + 1])
    if hi > shape[0]:
        raise ValueError(f"spill {what} table has {shape[0]} rows, the shard's end at {hi}")
    docs_file.seek(docs_file.tell() + lo * dtype.itemsize)
    data = docs_file.read((hi - lo) * dtype.itemsize)
    if len(data) != (hi - lo) * dtype.itemsize:
        raise ValueError(f"spill {what} table is truncated")
    return np.frombuffer(data, dtype)


def budget_mask(rows: np.ndarray, budget_left: int | None) -> np.ndarray | None:
    """Which rows stay within the remaining token budget (by their cumulative unit position);
    None: all of them."""
    if budget_left is None:
        return None
    mask: np.ndarray = rows["cum_end"] <= np.uint64(max(budget_left, 0))
    return mask


def within_budget(rows: np.ndarray, budget_left: int | None) -> np.ndarray:
    """Rows whose cumulative unit position stays within the remaining token budget."""
    mask = budget_mask(rows, budget_left)
    return rows if mask is None else rows[mask]


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
