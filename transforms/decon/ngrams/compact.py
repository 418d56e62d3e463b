"""Eval n-gram records without a Python object per n-gram: memory bounded by the eval text.

A hash partition's detail records ``[n, ngram, hash, [[eval_idx, [[start, end], ...]], ...]]``
(:func:`.index.partition_records`) as :class:`RecordColumns`: a few numpy arrays and one bytes
buffer of the n-grams' UTF-8 text, about 60 bytes per n-gram beside its text (a list of
lists costs about 2 KB per n-gram: the figure issue 46 measured for one eval row of 20 MB).
A record is built as a list only when it is read (:class:`RecordView`).

:func:`build_records` builds every partition's records from the eval rows with numpy (no
dict keyed by n-gram); :func:`pack_records` / :func:`unpack_records` write and read the
msgpack of the lists, one record at a time: the partition files are the same bytes as
``msgpack.packb`` of the lists.
"""
from __future__ import annotations

import re
from array import array
from typing import Any, Collection, Iterable, Iterator, Mapping, Sequence, overload

import msgpack
import numpy as np

from .hashes import batch_all_window_hashes, batch_prefix, ngram_hash, tokenize_batch
from .normalized import prepare, token_spans
from .word_split import WordSplitter, effective_lengths

_SPACES = re.compile(b" {2,}")
WINDOWS_AT_ONCE = 1 << 18  # windows of one row and length whose columns are made at once


class RecordView(Sequence[Any]):
    """Record ``i`` of a :class:`RecordColumns`, read as the list ``[n, ngram, hash, evals]``:
    each field built when asked for (``evals``, ``[[eval_idx, [[start, end], ...]], ...]``, may be
    long: a record of an n-gram many eval rows share)."""

    __slots__ = ("_of", "_i")

    def __init__(self, of: "RecordColumns", i: int):
        self._of, self._i = of, i

    def __len__(self) -> int:
        return 4

    @overload
    def __getitem__(self, k: int) -> Any: ...

    @overload
    def __getitem__(self, k: slice) -> list[Any]: ...

    def __getitem__(self, k: int | slice) -> Any:
        if isinstance(k, slice):
            return [self[j] for j in range(4)[k]]
        k = k + 4 if k < 0 else k
        of, i = self._of, self._i
        if k == 0:
            return int(of.n[i])
        if k == 1:
            return of.gram_bytes(i).decode("utf-8", "surrogatepass")
        if k == 2:
            return int(of.hashes[i])
        if k == 3:
            return of.evals(i)
        raise IndexError(k)

    def __iter__(self) -> Iterator[Any]:
        return iter([self[0], self[1], self[2], self[3]])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (list, tuple, RecordView)) and list(self) == list(other)

    def __repr__(self) -> str:
        return repr(list(self))


class RecordColumns(Sequence[RecordView]):
    """A partition's records as columns: ``n`` (int32), ``hashes`` (uint64), the n-grams'
    UTF-8 text ``grams`` cut at ``gram_at``; per record its eval entries ``ev_at[i]:ev_at[i+1]``,
    each an eval row ``ev_idx`` and its offsets ``offs[2 * off_at[e]:2 * off_at[e + 1]]``
    (start, end, start, end, ...)."""

    def __init__(self, n: np.ndarray, hashes: np.ndarray, gram_at: np.ndarray, grams: bytes, ev_at: np.ndarray,
                 ev_idx: np.ndarray, off_at: np.ndarray, offs: np.ndarray):
        self.n, self.hashes, self.gram_at, self.grams = narrow(n), hashes, narrow(gram_at), grams
        self.ev_at, self.ev_idx, self.off_at, self.offs = narrow(ev_at), narrow(ev_idx), narrow(off_at), narrow(offs)
        self._sorted: tuple[np.ndarray, np.ndarray | None, bool] | None = None

    @property
    def nbytes(self) -> int:
        return len(self.grams) + sum(a.nbytes for a in (self.n, self.hashes, self.gram_at, self.ev_at, self.ev_idx,
                                                          self.off_at, self.offs))

    def __len__(self) -> int:
        return len(self.n)

    @overload
    def __getitem__(self, i: int) -> RecordView: ...

    @overload
    def __getitem__(self, i: slice) -> list[RecordView]: ...

    def __getitem__(self, i: int | slice) -> RecordView | list[RecordView]:
        if isinstance(i, slice):
            return [RecordView(self, j) for j in range(len(self))[i]]
        j = i + len(self) if i < 0 else i
        if not 0 <= j < len(self):
            raise IndexError(i)
        return RecordView(self, j)

    def __iter__(self) -> Iterator[RecordView]:
        return (RecordView(self, i) for i in range(len(self)))

    def gram_bytes(self, i: int) -> bytes:
        return self.grams[int(self.gram_at[i]):int(self.gram_at[i + 1])]

    def evals(self, i: int) -> list[list[Any]]:
        """Record ``i``'s ``[[eval_idx, [[start, end], ...]], ...]``."""
        a, b = int(self.ev_at[i]), int(self.ev_at[i + 1])
        at = self.off_at[a:b + 1].tolist()
        flat = self.offs[2 * at[0]:2 * at[-1]].tolist()
        pairs = [flat[k:k + 2] for k in range(0, len(flat), 2)]
        base = at[0]
        return [[e, pairs[s - base:t - base]] for e, s, t in zip(self.ev_idx[a:b].tolist(), at, at[1:])]

    def to_lists(self) -> list[list[Any]]:
        return [list(r) for r in self]

    def by_hash(self) -> tuple[np.ndarray, np.ndarray | None, bool]:
        """(the records' hashes ascending, the record of each or None where that is its
        position (a partition's records are in hash order: no copy), whether no two records
        share a hash): ties in record order. Made on first use, then kept."""
        if self._sorted is None:
            h = self.hashes
            if len(h) < 2 or bool((h[1:] >= h[:-1]).all()):
                keys, order = h, None
            else:
                order = np.argsort(h, kind="stable")
                keys = h[order]
            self._sorted = (keys, order, len(keys) < 2 or bool((keys[1:] != keys[:-1]).all()))
        return self._sorted

    def find(self, n: int, gram: bytes) -> int | None:
        """The index of the record of n-gram ``gram`` (UTF-8) of ``n`` tokens, or None: found by
        its hash, then checked by its text."""
        try:
            h = ngram_hash(n, gram.decode("utf-8", "surrogatepass"))
        except (ValueError, UnicodeDecodeError):
            return None
        keys, order, _ = self.by_hash()
        at = int(np.searchsorted(keys, np.uint64(h)))
        while at < len(keys) and int(keys[at]) == h:
            i = at if order is None else int(order[at])
            if int(self.n[i]) == n and self.gram_bytes(i) == gram:
                return i
            at += 1
        return None

    @classmethod
    def from_lists(cls, records: Iterable[Sequence[Any]]) -> "RecordColumns":
        """:class:`RecordColumns` of ``[n, ngram, hash, evals]`` lists (or :class:`RecordView`\\ s), in order."""
        b = _Builder()
        for rec in records:
            b.add(rec)
        return b.done()


class HashFind:
    """``(n, UTF-8 n-gram) -> record index`` of a :class:`RecordColumns` (what the scan's
    ``Partition.find`` answers), looked up by hash: no dict with a key per n-gram."""

    def __init__(self, records: RecordColumns):
        self.records = records

    def get(self, key: tuple[int, bytes], default: int | None = None) -> int | None:
        i = self.records.find(*key)
        return default if i is None else i

    def __getitem__(self, key: tuple[int, bytes]) -> int:
        i = self.records.find(*key)
        if i is None:
            raise KeyError(key)
        return i

    def __contains__(self, key: object) -> bool:
        return isinstance(key, tuple) and len(key) == 2 and self.records.find(*key) is not None

    def __len__(self) -> int:
        return len(self.records)


class _Builder:
    """Records appended one at a time into flat arrays (``array``, ``bytearray``: no object per value)."""

    def __init__(self) -> None:
        self.n, self.hashes = array("q"), array("Q")
        self.gram_at, self.grams = array("q", [0]), bytearray()
        self.ev_at, self.ev_idx, self.off_at, self.offs = array("q", [0]), array("q"), array("q", [0]), array("q")

    def add(self, rec: Sequence[Any]) -> None:
        n, gram, h, evals = rec
        self.n.append(n)
        self.hashes.append(h)
        self.grams += gram.encode("utf-8", "surrogatepass")
        self.gram_at.append(len(self.grams))
        for eval_idx, offsets in evals:
            self.ev_idx.append(eval_idx)
            for s, e in offsets:
                self.offs.append(s)
                self.offs.append(e)
            self.off_at.append(len(self.offs) // 2)
        self.ev_at.append(len(self.ev_idx))

    def done(self) -> RecordColumns:
        return RecordColumns(np.frombuffer(self.n, dtype=np.int64).astype(np.int32),
                             np.frombuffer(self.hashes, np.uint64), np.frombuffer(self.gram_at, np.int64),
                             bytes(self.grams), np.frombuffer(self.ev_at, np.int64),
                             np.frombuffer(self.ev_idx, np.int64), np.frombuffer(self.off_at, np.int64),
                             np.frombuffer(self.offs, np.int64))


def pack_records(records: Sequence[Sequence[Any]]) -> bytes:
    """``msgpack.packb`` of the records as lists (the same bytes), packed one record at a time."""
    packer = msgpack.Packer(use_bin_type=True, unicode_errors="surrogatepass")
    out = [packer.pack_array_header(len(records))]
    out.extend(packer.pack(list(r)) for r in records)
    return b"".join(out)


def unpack_records(data: bytes) -> RecordColumns:
    """:class:`RecordColumns` of a :func:`pack_records` (or ``msgpack.packb``) buffer, read one record at
    a time: the lists of one record at a time are all that is ever held."""
    unpacker = msgpack.Unpacker(raw=False, unicode_errors="surrogatepass", strict_map_key=False,
                                max_buffer_size=max(len(data), 1 << 20))
    unpacker.feed(data)
    b = _Builder()
    for _ in range(unpacker.read_array_header()):
        b.add(unpacker.unpack())
    return b.done()


# ---------------------------------------------------------------------------------------
# Building: the eval rows' n-grams, in columns
# ---------------------------------------------------------------------------------------

def narrow(values: np.ndarray) -> np.ndarray:
    """``values`` (integers) as int32 when they all fit (offsets, counts, row numbers almost
    always do), else as they are."""
    if values.dtype == np.int32 or not len(values):
        return values.astype(np.int32)
    lo, hi = int(values.min()), int(values.max())
    return values.astype(np.int32) if -(1 << 31) <= lo and hi < (1 << 31) else values


def token_starts(tokenizer: WordSplitter, text: str) -> np.ndarray:
    """The code-point offset in ``text`` where each of its tokens starts (the starts of
    :func:`.normalized.tokens_with_offsets`), as one array: no Python object per token."""
    prepared = prepare(tokenizer, text)
    batch = tokenize_batch([prepared], tokenizer.byte_table)
    return token_spans(tokenizer, text, prepared, batch.starts - 1, batch.ends - 1)[0]


def _collapse(raw: bytes) -> bytes:
    """A window's bytes (separators already spaces) as its n-gram: tokens joined by one space."""
    return _SPACES.sub(b" ", raw) if b"  " in raw else raw


WINDOW_COLUMNS = ("h", "length", "eval_idx", "s", "e", "buf", "bs", "be")


def build_records(rows: Sequence[Any], ns: Iterable[int], tokenizer: WordSplitter, partitions: int,
                  skip: Collection[int] = (), chunk: int = 4096
                  ) -> tuple[Mapping[int, RecordColumns], np.ndarray, list[int]]:
    """(partition -> :class:`RecordColumns` (:class:`BuiltIndex`), the n-grams' hashes, their lengths) of the
    eval rows ``rows`` (:class:`.index.EvalRow`), those in ``skip`` left out: the records
    :func:`.index.partition_records` gives of :func:`.index.build_index`, the same lists in the
    same order (a partition's records by hash, ties in index order; a record's eval rows in row
    order, each with its offsets in text order), built from columns of every window (hash, eval
    row, length, offsets, where its text lies: :func:`window_columns`), grouped into records
    (:func:`record_runs`): about 80 bytes per window while building."""
    ns = sorted(set(int(n) for n in ns))
    if skip:
        rows = [r for r in rows if r.eval_idx not in skip]
    bufs, col = window_columns(rows, ns, tokenizer, chunk)
    if not col:
        return {}, np.zeros(0, dtype=np.uint64), []
    return built_from_windows(col, bufs, partitions)


def built_from_windows(col: dict[str, np.ndarray], bufs: Sequence[Any], partitions: int
                       ) -> tuple["BuiltIndex", np.ndarray, list[int]]:
    """(:class:`BuiltIndex`, the records' hashes, their lengths) of the windows ``col`` (the
    columns :data:`WINDOW_COLUMNS`, in index order; consumed) whose bytes lie in ``bufs``
    (each indexable by a slice, giving bytes): what :func:`build_records` builds of its windows."""
    order, starts = record_runs(col, bufs)
    rec_first = order[starts]  # each record's first window (index order)
    rec_end = np.append(starts[1:], len(order))
    # what a record needs of its first window; the windows keep their eval row and offsets only
    rec_h, rec_len = col.pop("h")[rec_first], col.pop("length")[rec_first]
    rec_buf, rec_bs, rec_be = col.pop("buf")[rec_first], col.pop("bs")[rec_first], col.pop("be")[rec_first]
    built = BuiltIndex(partitions, bufs, narrow(order), narrow(starts), narrow(rec_end), narrow(rec_first), rec_h,
                       rec_len, narrow(rec_buf), narrow(rec_bs), narrow(rec_be), col.pop("eval_idx"), col.pop("s"),
                       col.pop("e"))
    return built, rec_h, np.unique(rec_len).tolist()


def window_columns(rows: Sequence[Any], ns: list[int], tokenizer: WordSplitter, chunk: int
                   ) -> tuple[list[bytes], dict[str, np.ndarray]]:
    """(each chunk's prepared bytes, the columns :data:`WINDOW_COLUMNS` of every window of the
    eval rows ``rows``, in index order; no column when no row has a window): ``h`` its hash,
    ``length`` its tokens, ``eval_idx`` its row, ``s``/``e`` its code-point offsets in the row's
    text, ``buf``/``bs``/``be`` where its bytes lie in the chunks' buffers."""
    bufs: list[bytes] = []
    cols: dict[str, list[np.ndarray]] = {k: [] for k in WINDOW_COLUMNS}
    for c in range(0, len(rows), chunk):
        bufs.append(_chunk_windows(rows[c:c + chunk], ns, tokenizer, len(bufs), cols))
    if not cols["h"]:
        return bufs, {}
    col: dict[str, np.ndarray] = {}
    for name in list(cols):  # a column at a time: its pieces go as it is made
        col[name] = np.concatenate(cols.pop(name))
    return bufs, col


def _chunk_windows(part: Sequence[Any], ns: list[int], tokenizer: WordSplitter, b: int,
                   cols: dict[str, list[np.ndarray]]) -> bytes:
    """Append the columns of every window of the eval rows ``part`` (one chunk, buffer ``b``)
    to ``cols``; the chunk's prepared bytes (its windows' ``bs``/``be`` index them)."""
    prepared = [prepare(tokenizer, r.text) for r in part]
    batch = tokenize_batch(prepared, tokenizer.byte_table)
    row_first, row_base = batch.row_first, batch.row_base
    sizes = np.diff(row_first).tolist()
    lengths = {length for r, t in zip(part, sizes) if not r.empty for length in effective_lengths(ns, t)}
    prefix = batch_prefix(batch)
    window_hashes = {length: batch_all_window_hashes(batch, prefix, length) for length in sorted(lengths)}
    del prefix
    all_starts, all_ends, buf = batch.starts, batch.ends, batch.buf
    del batch  # its token hashes and row numbers: not needed past the window hashes
    nonempty = np.zeros(len(all_starts) + 1, dtype=np.int64)
    np.cumsum(all_ends > all_starts, out=nonempty[1:])
    for k, r in enumerate(part):
        if r.empty:
            continue
        first, last = int(row_first[k]), int(row_first[k + 1])
        base = int(row_base[k]) + 1
        ts, te = all_starts[first:last], all_ends[first:last]
        span_s, span_e = token_spans(tokenizer, r.text, prepared[k], ts - base, te - base)
        t = last - first
        for length in effective_lengths(ns, t):
            w = t - length + 1
            for a in range(0, w, WINDOWS_AT_ONCE):  # a long row's windows a block at a time: bounded temporaries
                pos = np.arange(a, min(w, a + WINDOWS_AT_ONCE), dtype=np.int64)
                keep = nonempty[first + pos + length] - nonempty[first + pos] > 0  # all-empty windows: no n-gram
                pos = pos[keep]
                cols["h"].append(window_hashes[length][first + pos])
                cols["length"].append(np.full(len(pos), length, dtype=np.int32))
                cols["eval_idx"].append(narrow(np.full(len(pos), r.eval_idx, dtype=np.int64)))
                cols["s"].append(narrow(span_s[pos]))
                cols["e"].append(narrow(span_e[pos + length - 1]))
                cols["buf"].append(np.full(len(pos), b, dtype=np.int32))
                cols["bs"].append(narrow(ts[pos]))
                cols["be"].append(narrow(te[pos + length - 1]))
    # the chunk's arrays go when it returns, before the next chunk's and before the sort (a row's
    # views would keep them)
    return buf


def record_runs(col: dict[str, np.ndarray], bufs: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """(the windows of :func:`window_columns` in record order, where each record's run starts):
    occurrences by (hash, length, index order), a record a run, unless two n-grams share a hash
    (then a record per n-gram, in the order of their first windows)."""
    order = np.lexsort((np.arange(len(col["h"])), col["length"], col["h"]))
    h_sorted, len_sorted = col["h"][order], col["length"][order]
    new = np.ones(len(order), dtype=np.bool_)
    new[1:] = (h_sorted[1:] != h_sorted[:-1]) | (len_sorted[1:] != len_sorted[:-1])
    del h_sorted, len_sorted
    rec_of = np.cumsum(new) - 1
    group = np.flatnonzero(new)
    sizes = np.diff(np.append(group, len(order)))
    if not _split_shared_hashes(col, bufs, order, rec_of, group, sizes):
        return order, group
    perm = np.lexsort((order, rec_of))
    order, rec_of = order[perm], rec_of[perm]
    return order, np.flatnonzero(np.diff(rec_of, prepend=-1) != 0)


def _split_shared_hashes(col: dict[str, np.ndarray], bufs: Sequence[Any], order: np.ndarray, rec_of: np.ndarray,
                         group: np.ndarray, sizes: np.ndarray) -> bool:
    """Give each different n-gram of a run of one hash a record of its own (``rec_of``, in
    place: new ids past the last, by first window); whether any run was split."""

    def gram(o: int) -> bytes:  # the n-gram of window o
        return _collapse(bufs[int(col["buf"][o])][int(col["bs"][o]):int(col["be"][o])])

    split = False
    next_id = int(rec_of[-1]) + 1
    for g in np.flatnonzero(sizes > 1).tolist():  # several windows of one hash: the same n-gram?
        a, z = int(group[g]), int(group[g] + sizes[g])
        texts = [gram(int(o)) for o in order[a:z].tolist()]
        if texts.count(texts[0]) == len(texts):
            continue
        split = True  # a hash shared by different n-grams: a record per n-gram, by first window
        ids: dict[bytes, int] = {texts[0]: int(rec_of[a])}
        for j, text in enumerate(texts):
            if text not in ids:
                ids[text] = next_id
                next_id += 1
            rec_of[a + j] = ids[text]
    return split


class BuiltIndex(Mapping[int, RecordColumns]):
    """partition -> :class:`RecordColumns` of :func:`build_records`, each partition's made when it is
    read (then not kept): what is held is a few columns per window and per n-gram, about 80
    bytes per n-gram, not every partition's records at once."""

    def __init__(self, partitions: int, bufs: Sequence[Any], order: np.ndarray, starts: np.ndarray, rec_end: np.ndarray,
                 rec_first: np.ndarray, rec_h: np.ndarray, rec_len: np.ndarray, rec_buf: np.ndarray,
                 rec_bs: np.ndarray, rec_be: np.ndarray, eval_idx: np.ndarray, s: np.ndarray, e: np.ndarray):
        self.bufs, self.order, self.starts, self.rec_end, self.rec_first = bufs, order, starts, rec_end, rec_first
        self.rec_h, self.rec_len, self.rec_buf, self.rec_bs, self.rec_be = rec_h, rec_len, rec_buf, rec_bs, rec_be
        self.eval_idx, self.s, self.e = eval_idx, s, e
        self.rec_part = narrow((rec_h % np.uint64(partitions)).astype(np.int64))
        self._keys = np.unique(self.rec_part).tolist()

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[int]:
        return iter(self._keys)

    def __contains__(self, p: object) -> bool:
        return isinstance(p, int) and p in self._keys

    def __getitem__(self, p: int) -> RecordColumns:
        if p not in self:
            raise KeyError(p)
        recs = np.flatnonzero(self.rec_part == p)
        recs = recs[np.lexsort((self.rec_first[recs], self.rec_h[recs]))]  # by hash, ties in index order
        counts = self.rec_end[recs] - self.starts[recs]
        occ = np.repeat(self.starts[recs] - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
        occ = self.order[occ]  # the windows of each record, in index order (row order, then text order)
        ev = self.eval_idx[occ]
        rec_at = np.zeros(len(recs) + 1, dtype=np.int64)
        np.cumsum(counts, out=rec_at[1:])
        entry = np.ones(len(occ), dtype=np.bool_)  # a new eval entry: a new record, or another eval row
        entry[1:] = ev[1:] != ev[:-1]
        entry[rec_at[:-1]] = True
        entry_at = np.flatnonzero(entry)
        ev_at = np.searchsorted(entry_at, rec_at)
        grams = bytearray()
        gram_at = np.zeros(len(recs) + 1, dtype=np.int64)
        bufs = self.bufs
        for j, (b, lo, hi) in enumerate(zip(self.rec_buf[recs].tolist(), self.rec_bs[recs].tolist(),
                                            self.rec_be[recs].tolist())):
            grams += _collapse(bufs[b][lo:hi])
            gram_at[j + 1] = len(grams)
        offs = np.empty(2 * len(occ), dtype=np.int64)
        offs[0::2], offs[1::2] = self.s[occ], self.e[occ]
        return RecordColumns(self.rec_len[recs], self.rec_h[recs], gram_at, bytes(grams), ev_at.astype(np.int64),
                       ev[entry_at], np.append(entry_at, len(occ)).astype(np.int64), offs)
