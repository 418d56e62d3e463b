"""A batch of documents signed: text hashes, shingle sets, band keys, and the records the
bucket stage groups (pure functions of the texts: the sign stage and the public transforms
call them).

Exact mode keys each document by the 128-bit hash of its normalized text (BLAKE2b); minhash
mode adds one record per band of its MinHash signature (:mod:`.minhash`), and keeps its
shingle set for the Jaccard that verifies a candidate pair."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from refinery.transforms.dedup import graph
from refinery.transforms.dedup.minhash import MinHashParams, band_keys, shingle_sets, signatures, splitmix64

MODES = ("exact", "minhash")
DOC_DTYPE = np.dtype([("row", "<u8"), ("text_hi", "<u8"), ("text_lo", "<u8"), ("start", "<u8"), ("count", "<u4")])


def text_hashes(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(high, low) uint64 halves of the 128-bit BLAKE2b of each text's UTF-8 bytes."""
    digests = b"".join(hashlib.blake2b(t.encode("utf-8", "surrogatepass"), digest_size=16).digest() for t in texts)
    halves = np.frombuffer(digests, dtype=">u8").reshape(-1, 2) if texts else np.zeros((0, 2), ">u8")
    return halves[:, 0].astype(np.uint64), halves[:, 1].astype(np.uint64)


@dataclass
class SignedBatch:
    """Documents signed: their rows (in their sign unit), text hashes and, in minhash mode,
    shingle sets (``values`` split by ``counts``) and band keys ``(documents, bands)``."""

    rows: np.ndarray
    text_hi: np.ndarray
    text_lo: np.ndarray
    values: np.ndarray
    counts: np.ndarray
    keys: np.ndarray | None = None


def sign_batch(rows: Sequence[int], texts: Sequence[str], mode: str, params: MinHashParams) -> SignedBatch:
    """The documents ``texts`` (normalized) of ``rows``, signed as ``mode`` says."""
    hi, lo = text_hashes(texts)
    row_array = np.asarray(rows, dtype=np.uint64)
    if mode == "exact":
        return SignedBatch(row_array, hi, lo, np.zeros(0, np.uint64), np.zeros(len(texts), np.int64))
    values, counts = shingle_sets(texts)
    return SignedBatch(row_array, hi, lo, values, counts, band_keys(signatures(values, counts, params), params))


def key_records(batch: SignedBatch, unit: int) -> np.ndarray:
    """The bucket stage's records of ``batch`` (:data:`~.graph.KEY_DTYPE`): one of the exact
    band per document, and in minhash mode one per band of each document with a shingle."""
    nodes = graph.node_of(unit, batch.rows)
    exact = np.zeros(len(nodes), dtype=graph.KEY_DTYPE)
    exact["band"], exact["key"] = graph.EXACT_BAND, batch.text_hi
    exact["text_hi"], exact["text_lo"], exact["node"] = batch.text_hi, batch.text_lo, nodes
    if batch.keys is None:
        return exact
    has = batch.counts > 0
    bands = batch.keys.shape[1]
    near = np.zeros(int(has.sum()) * bands, dtype=graph.KEY_DTYPE)
    near["band"] = np.tile(np.arange(bands, dtype=np.uint16), int(has.sum()))
    near["key"] = batch.keys[has].ravel()
    for name, column in (("text_hi", batch.text_hi), ("text_lo", batch.text_lo), ("node", nodes)):
        near[name] = np.repeat(column[has], bands)
    return np.concatenate([exact, near])


def key_partition(records: np.ndarray, partitions: int) -> np.ndarray:
    """The bucket partition of each record: its key, mixed, mod ``partitions``."""
    return (splitmix64(records["key"]) % np.uint64(partitions)).astype(np.int64)


def doc_records(batch: SignedBatch, start: int) -> np.ndarray:
    """The sign unit's index of ``batch``'s documents (:data:`DOC_DTYPE`): row, text hash and
    where its shingle set lies in the unit's sets file (``start``: the values before the batch)."""
    out = np.zeros(len(batch.rows), dtype=DOC_DTYPE)
    out["row"], out["text_hi"], out["text_lo"] = batch.rows, batch.text_hi, batch.text_lo
    out["start"] = start + np.r_[0, np.cumsum(batch.counts)[:-1]] if len(batch.rows) else 0
    out["count"] = batch.counts
    return out
