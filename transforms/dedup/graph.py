"""From band keys to clusters, as numpy array operations: exact groups, candidate pairs of
the band buckets (with the bucket cap), connected components.

A document is a **node**: ``unit << 40 | row``, its sign unit's number in plan order and its
row there (:func:`node_of`), so nodes sort as the documents do in input order (file, then
row). A cluster's kept document is its smallest node: the first of its copies in input
order.

- :func:`exact_edges`: the records of the exact band (a document's 128-bit text hash): each
  document whose text an earlier node has too -> an edge to the first such node.
- :func:`bucket_pairs`: the records of the near bands: documents sharing a band key are a
  bucket; the copies of one text in a bucket count once (the first node of each text); a
  bucket of 2 to ``cap`` texts gives every pair of them as a candidate, a larger one is
  skipped (counted and sampled: :class:`Skipped`).
- :func:`components`: the connected components of the edges, as (node, root) with root the
  component's smallest node: roots hooked under smaller roots, then pointer jumping, each round a few
  array operations over the edges between trees (about log2 of the largest component's
  size rounds).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from refinery.transforms.dedup.minhash import splitmix64

ROW_BITS = 40
ROW_MASK = np.uint64((1 << ROW_BITS) - 1)
EXACT_BAND = 0xFFFF  # the band number of the exact records (the near bands are 0 .. bands - 1)

KEY_DTYPE = np.dtype([("band", "<u2"), ("key", "<u8"), ("text_hi", "<u8"), ("text_lo", "<u8"), ("node", "<u8")])
PAIR_DTYPE = np.dtype([("a", "<u8"), ("b", "<u8")])
EDGE_DTYPE = np.dtype([("a", "<u8"), ("b", "<u8"), ("jaccard", "<f4")])


def node_of(unit: int, rows: np.ndarray) -> np.ndarray:
    """The nodes of ``rows`` (their row numbers in the sign unit numbered ``unit``)."""
    if unit >= 1 << (64 - ROW_BITS):
        raise ValueError(f"at most {1 << (64 - ROW_BITS)} sign units, not {unit + 1}")
    return (np.uint64(unit) << np.uint64(ROW_BITS)) | rows.astype(np.uint64)


def unit_of(nodes: np.ndarray) -> np.ndarray:
    return (nodes >> np.uint64(ROW_BITS)).astype(np.int64)


def row_of(nodes: np.ndarray) -> np.ndarray:
    return (nodes & ROW_MASK).astype(np.int64)


def runs(sorted_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) of each run of equal values of ``sorted_keys``."""
    if not len(sorted_keys):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    return starts, np.diff(np.r_[starts, len(sorted_keys)])


def _shared(records: np.ndarray, key: str) -> np.ndarray:
    """The records whose ``key`` another record has too, ordered by (key, text, node): one
    sort of the key alone, then a full sort of the few records that share one."""
    order = np.argsort(records[key], kind="stable")
    keys = records[key][order]
    starts, lengths = runs(keys)
    many = np.repeat(lengths > 1, lengths)
    shared = records[order[many]]
    return shared[np.lexsort((shared["node"], shared["text_lo"], shared["text_hi"], shared[key]))]


def exact_edges(records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(member, first): for each document whose text (128-bit hash) an earlier node has too,
    an edge to the first node of that text."""
    shared = _shared(records, "text_hi")
    text = np.stack([shared["text_hi"], shared["text_lo"]], axis=1)
    same = np.r_[False, (text[1:] == text[:-1]).all(axis=1)] if len(shared) else np.zeros(0, dtype=bool)
    first = np.maximum.accumulate(np.where(~same, np.arange(len(shared)), 0))
    return shared["node"][same], shared["node"][first[same]]


@dataclass
class Skipped:
    """The buckets over the cap: how many, how many documents they held, and the largest
    (``[band, size, first node]``, at most ``keep``)."""

    buckets: int = 0
    documents: int = 0
    largest: list[list[int]] = field(default_factory=list)
    keep: int = 10

    def add(self, bands: np.ndarray, sizes: np.ndarray, firsts: np.ndarray) -> None:
        self.buckets += len(sizes)
        self.documents += int(sizes.sum())
        rows = [[int(b), int(s), int(n)] for b, s, n in zip(bands.tolist(), sizes.tolist(), firsts.tolist())]
        self.largest = sorted(self.largest + rows, key=lambda r: (-r[1], r[2], r[0]))[:self.keep]

    def to_json(self) -> dict[str, Any]:
        return {"buckets": self.buckets, "documents": self.documents, "largest": self.largest}


def bucket_pairs(records: np.ndarray, cap: int, skipped: Skipped) -> np.ndarray:
    """The candidate pairs (:data:`PAIR_DTYPE`, ``a < b``, distinct) of the near-band records'
    buckets of 2 to ``cap`` distinct texts; larger buckets are added to ``skipped``."""
    shared = _shared(records, "key")
    if not len(shared):
        return np.zeros(0, dtype=PAIR_DTYPE)
    new_text = np.r_[True, (shared["key"][1:] != shared["key"][:-1]) | (shared["text_hi"][1:] != shared["text_hi"][:-1])
                     | (shared["text_lo"][1:] != shared["text_lo"][:-1])]
    reps = shared[new_text]  # the first node of each text of each bucket
    starts, sizes = runs(reps["key"])
    over = sizes > cap
    if over.any():
        firsts = np.minimum.reduceat(reps["node"], starts)[over]
        skipped.add(reps["band"][starts[over]], sizes[over], firsts)
    out_a, out_b = [], []
    for k in np.unique(sizes[(sizes >= 2) & ~over]).tolist():
        at = starts[sizes == k]
        i, j = np.triu_indices(k, 1)
        x, y = reps["node"][at[:, None] + i[None, :]].ravel(), reps["node"][at[:, None] + j[None, :]].ravel()
        out_a.append(np.minimum(x, y))
        out_b.append(np.maximum(x, y))
    return unique_pairs(np.concatenate(out_a) if out_a else np.zeros(0, np.uint64),
                        np.concatenate(out_b) if out_b else np.zeros(0, np.uint64))


def unique_pairs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The distinct pairs ``(a[i], b[i])``, sorted (:data:`PAIR_DTYPE`)."""
    order = np.lexsort((b, a))
    a, b = a[order], b[order]
    keep = np.r_[True, (a[1:] != a[:-1]) | (b[1:] != b[:-1])] if len(a) else np.zeros(0, dtype=bool)
    out = np.empty(int(keep.sum()), dtype=PAIR_DTYPE)
    out["a"], out["b"] = a[keep], b[keep]
    return out


def pair_partition(a: np.ndarray, b: np.ndarray, partitions: int) -> np.ndarray:
    """The partition of each pair: a hash of both nodes (the same pair, wherever it was found,
    goes to one partition, which counts it once)."""
    with np.errstate(over="ignore"):
        h = splitmix64(splitmix64(a) ^ b)
    return (h % np.uint64(partitions)).astype(np.int64)


def components(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(nodes, roots): every node of the edges ``a[i] - b[i]``, ascending, and the smallest
    node of its connected component. Each round, every edge between two trees hooks the
    larger root under the smaller (the smallest such root, per root), then every node points
    to its root (pointer jumping); a tree with an edge to another merges with at least one
    each round, so the rounds are at most about log2 of the largest component; the edges
    inside one tree are dropped as the rounds go."""
    nodes = np.unique(np.concatenate([a, b]))
    parent = np.arange(len(nodes))
    ia, ib = np.searchsorted(nodes, a), np.searchsorted(nodes, b)
    while len(ia):
        pa, pb = parent[ia], parent[ib]
        apart = pa != pb
        ia, ib, pa, pb = ia[apart], ib[apart], pa[apart], pb[apart]
        if not len(ia):
            break
        np.minimum.at(parent, np.maximum(pa, pb), np.minimum(pa, pb))
        while True:  # every node to its root
            up = parent[parent]
            if np.array_equal(up, parent):
                break
            parent = up
    return nodes, nodes[parent]
