"""The eval index built in slices: no process holds every eval row or every eval n-gram.

``refinery decon``'s ``eval`` stage cuts the eval files into slices (as the scan cuts the
training files); a slice unit reads its rows (:func:`slice_rows`) and writes

- its rows, as the catalog's JSON lines with slice-local numbers (:func:`row_lines`);
- a row table (:data:`ROW_META`): each row's text hash (BLAKE2b, 128 bits) and whether it is
  too short to index (``--min-eval-tokens``);
- its windows (:func:`slice_windows`): a block per hash partition of the columns
  :data:`WINDOW_FIELDS`, 8 bytes each (:data:`WINDOW_BYTES` per window), and the prepared
  text they point into (the slice's buffer).

A partition unit of the ``index`` stage (:func:`partition_records`) reads its block of every
slice, gives the windows their global eval row and keeps those of the rows the index holds
(:func:`indexed_rows`: the first row of each text, not short); from them it builds the
partition's records with the same code and order as the whole index did
(:func:`.compact.built_from_windows`), so the partition files are the same bytes. The
catalog unit merges the row files, the bad-row counts and the membership
(:func:`membership_hashes`, a hash range at a time).

Two rows are taken for the same text when their 128-bit text hashes are equal (the merge
compares the texts themselves); a collision of BLAKE2b-128 between two eval texts is not
expected in any eval set.
"""
from __future__ import annotations

import hashlib
import json
import mmap
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from refinery.transforms.io import storage
from refinery.transforms.io.jsonl import json_line

from .compact import RecordColumns, built_from_windows, window_columns
from .index import LISTED_BAD_ROWS, EvalRow
from .membership import sorted_unique
from .word_split import WordSplitter

WINDOW_FIELDS = ("h", "eval_idx", "s", "e", "bs", "be", "length")
WINDOW_BYTES = 8 * len(WINDOW_FIELDS)
ROW_META = np.dtype([("hi", "<u8"), ("lo", "<u8"), ("short", "u1")])
CHUNK_ROWS = 4096


def text_hash(text: str) -> tuple[int, int]:
    """The 128-bit BLAKE2b hash of an eval row's text (its UTF-8, lone surrogates kept), as two integers."""
    d = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    return int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little")


def row_meta(rows: Sequence[EvalRow], min_tokens: int) -> np.ndarray:
    """The :data:`ROW_META` table of ``rows``: text hash and whether the row is short (not empty, fewer
    than ``min_tokens`` tokens: :func:`.index.short_rows`)."""
    meta = np.zeros(len(rows), dtype=ROW_META)
    for i, r in enumerate(rows):
        hi, lo = text_hash(r.text)
        meta[i] = (hi, lo, (not r.empty) and r.num_tokens < min_tokens)
    return meta


@dataclass(frozen=True)
class SliceWindows:
    """A slice's windows: ``data``, the blocks of :data:`WINDOW_FIELDS` (int64 each, a row per
    window) partition by partition, the windows of partition ``p`` in rows ``part_at[p]`` to
    ``part_at[p + 1]`` (each partition's in index order); ``buffer``, the prepared text ``bs``/``be`` index."""

    data: np.ndarray        # (windows, len(WINDOW_FIELDS)) int64
    part_at: list[int]
    buffer: bytes


def slice_windows(rows: Sequence[EvalRow], meta: np.ndarray, ns: list[int], tokenizer: WordSplitter,
                  partitions: int) -> SliceWindows:
    """The windows of the slice's rows (``eval_idx`` local to the slice) but its short ones, cut by
    hash partition, and those of a text an earlier row of the slice has (a row of a text an
    earlier slice has is dropped only by the partition units: that is known across slices)."""
    keep = [rows[i] for i in np.flatnonzero(slice_firsts(meta)).tolist()]
    bufs, col = window_columns(keep, ns, tokenizer, CHUNK_ROWS)
    if not col:
        return SliceWindows(np.zeros((0, len(WINDOW_FIELDS)), dtype=np.int64), [0] * (partitions + 1), b"".join(bufs))
    base = np.zeros(len(bufs) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in bufs], out=base[1:])
    at = base[col["buf"].astype(np.int64)]
    h = col["h"]
    part = (h % np.uint64(partitions)).astype(np.int64)
    order = np.argsort(part, kind="stable")  # each partition's windows stay in index order
    data = np.empty((len(order), len(WINDOW_FIELDS)), dtype=np.int64)
    data[:, 0] = h[order].view(np.int64)
    data[:, 1] = col["eval_idx"][order]
    data[:, 2] = col["s"][order]
    data[:, 3] = col["e"][order]
    data[:, 4] = (col["bs"].astype(np.int64) + at)[order]
    data[:, 5] = (col["be"].astype(np.int64) + at)[order]
    data[:, 6] = col["length"][order]
    part_at = np.searchsorted(part[order], np.arange(partitions + 1)).tolist()
    return SliceWindows(data, part_at, b"".join(bufs))


def row_lines(rows: Iterable[EvalRow]) -> bytes:
    """The JSON lines of ``rows`` as the catalog writes them (:meth:`.index.EvalRow.to_json`)."""
    return b"".join(json_line(r.to_json()) for r in rows)


def renumbered(lines: Iterable[bytes], first_idx: int, row_base: int) -> Iterator[bytes]:
    """A slice's row lines with their global ``eval_idx`` (from ``first_idx``) and file row (plus ``row_base``)."""
    for line in lines:
        if not line:
            continue
        rec = json.loads(line)
        rec["eval_idx"] += first_idx
        rec["eval_row"] += row_base
        yield json_line(rec)


def merge_bad(parts: Iterable[tuple[Mapping[str, dict[str, Any]], int]]) -> dict[str, dict[str, Any]]:
    """The per-dataset bad-row counts of the slices ``(bad, row_base)`` in eval order, as
    :func:`.index.make_eval_rows` counts them over all rows: counts summed, the listed reasons
    (file rows plus the slice's ``row_base``) kept in eval order, the first :data:`LISTED_BAD_ROWS`."""
    out: dict[str, dict[str, Any]] = {}
    for bad, row_base in parts:
        for ds, counts in bad.items():
            acc = out.setdefault(ds, {"bad_rows": 0})
            acc["bad_rows"] += int(counts["bad_rows"])
            if "reasons" in counts:
                listed = acc.setdefault("reasons", [])
                room = LISTED_BAD_ROWS - len(listed)
                listed.extend([path, row + row_base, why] for path, row, why in counts["reasons"][:max(0, room)])
    return out


def indexed_rows(metas: Sequence[np.ndarray]) -> np.ndarray:
    """Whether the index holds each eval row (global order: the slices' tables one after
    another): the first row of its text (:class:`.index.SameText`), and not short."""
    return slice_firsts(np.concatenate(metas) if metas else np.zeros(0, dtype=ROW_META))


def slice_firsts(meta: np.ndarray) -> np.ndarray:
    """Whether each row of the :data:`ROW_META` table ``meta`` is the first of its text there, and not short."""
    keep = ~meta["short"].astype(np.bool_)
    if len(meta) > 1:
        order = np.lexsort((np.arange(len(meta)), meta["lo"], meta["hi"]))
        hi, lo = meta["hi"][order], meta["lo"][order]
        later = np.zeros(len(order), dtype=np.bool_)
        later[1:] = (hi[1:] == hi[:-1]) & (lo[1:] == lo[:-1])
        keep[order[later]] = False
    return keep


class SliceBuffers(Sequence[bytes]):
    """The slices' prepared text, read when a window's n-gram is needed: a local file is
    memory-mapped (the page cache shares it between processes), a remote one read once."""

    def __init__(self, paths: list[str]):
        self.paths = paths
        self._open: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, b: Any) -> Any:
        got = self._open.get(b)
        if got is None:
            path = self.paths[b]
            if storage.is_remote(path):
                got = storage.read_bytes(path)
            else:
                with open(path, "rb") as f:
                    got = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if storage.file_size(path) else b""
            self._open[b] = got
        return got

    def close(self) -> None:
        for m in self._open.values():
            if isinstance(m, mmap.mmap):
                m.close()
        self._open.clear()


def partition_records(p: int, partitions: int, blocks: Iterable[tuple[np.ndarray, int]], keep: np.ndarray,
                      buffers: Sequence[bytes]) -> RecordColumns:
    """Partition ``p``'s records from its window block of each slice ``(block, first_idx)`` (in
    slice order; ``first_idx``: the global number of the slice's first row), the windows of rows
    ``keep`` leaves out dropped: the records the whole index gives (:func:`.compact.build_records`)."""
    pieces = []
    for b, (block, first) in enumerate(blocks):
        if not len(block):
            continue
        idx = block[:, 1] + first
        mask = keep[idx]
        if mask.any():
            part = block[mask]
            part[:, 1] = idx[mask]
            pieces.append((b, part))
    if not pieces:
        return RecordColumns.from_lists([])
    data = np.concatenate([d for _, d in pieces])
    col = {"h": data[:, 0].view(np.uint64).copy(), "eval_idx": data[:, 1], "s": data[:, 2], "e": data[:, 3],
           "bs": data[:, 4], "be": data[:, 5], "length": data[:, 6].astype(np.int32),
           "buf": np.concatenate([np.full(len(d), b, dtype=np.int32) for b, d in pieces])}
    del data
    built, _, _ = built_from_windows(col, buffers, partitions)
    return built[p] if p in built else RecordColumns.from_lists([])


def membership_hashes(read_hashes: Callable[[int], np.ndarray], slices: int, windows: int,
                      per_pass: int = 1 << 24) -> np.ndarray:
    """The sorted unique n-gram hashes of the indexed windows of every slice (``read_hashes(s)``:
    slice ``s``'s, already filtered), a range of hash values at a time: at most about
    ``per_pass`` hashes held at once beside the result (``windows``: how many there are in all)."""
    passes = max(1, -(-windows // per_pass))
    bits = max(0, (passes - 1).bit_length())
    shift = np.uint64(64 - bits) if bits else None
    out: list[np.ndarray] = []
    for k in range(1 << bits):
        got = []
        for s in range(slices):
            h = read_hashes(s)
            got.append(h if shift is None else h[(h >> shift) == np.uint64(k)])
        merged = sorted_unique(np.concatenate(got)) if got else np.zeros(0, dtype=np.uint64)
        out.append(merged)
    return np.concatenate(out) if out else np.zeros(0, dtype=np.uint64)
