"""Near-duplicate arithmetic over a batch of documents at once: words, shingles, MinHash
signatures, band keys and the Jaccard of shingle sets, as numpy array operations (no Python
loop per word, shingle or pair).

- **Words** (:func:`shingle_sets`): the normalized text lowercased (``str.lower``), then its
  UTF-8 bytes; a word is a run of ASCII letters and digits and non-ASCII bytes (so a
  non-ASCII letter is part of a word, ASCII punctuation and white space separate words).
  ``"Hello, World!"`` and ``"hello world"`` have the same words.
- **Word hash**: the polynomial hash of the word's bytes mod 2^64 (prefix sums of ``b_i P^i``
  over the batch's bytes, each word's difference scaled by ``P^-start``), mixed by
  SplitMix64's finalizer.
- **Shingles**: each run of :data:`SHINGLE_WORDS` consecutive words of a document (a document
  of fewer words: one shingle of all of them; of none: no shingle), hashed to 64 bits
  (a sum of the word hashes times odd constants, mixed). A document's **shingle set** is its
  distinct shingle hashes, sorted.
- **Signature**: ``bands * rows`` MinHash values per document, value ``j`` the minimum over
  its shingles ``s`` of ``(a_j * s + b_j) mod 2^64 >> 32`` (multiply-shift hashing; ``a_j``
  odd, ``a_j, b_j`` from :data:`SEED`): uint32, ``(documents, bands * rows)``.
- **Band keys**: band ``k`` of a signature (its ``rows`` values) hashed to 64 bits; two
  documents whose band ``k`` keys are equal are a candidate pair. The probability that two
  documents of Jaccard ``s`` share a band is ``1 - (1 - s^rows)^bands``
  (:func:`candidate_probability`; docs/DEDUP.md draws it).
- **Jaccard** (:func:`jaccard_many`): ``|A & B| / |A | B|`` of the shingle sets of many
  pairs at once.

Every step is a pure function of the text and the parameters: the same text has the same
set, signature and keys on every machine and run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

SHINGLE_WORDS = 5
DEFAULT_BANDS = 16
DEFAULT_ROWS = 8
DEFAULT_THRESHOLD = 0.8
SEED = 0x5EED_D0C5
SIGNATURE_CHUNK = 1 << 12  # shingles hashed at once into a (chunk, bands * rows) block (4 MiB: in cache)

U64 = np.uint64
_P = U64(0x100000001B3)  # the word hash's base (odd: invertible mod 2^64)
_WORD_BYTES = np.zeros(256, dtype=bool)
_WORD_BYTES[np.frombuffer(b"0123456789abcdefghijklmnopqrstuvwxyz", np.uint8)] = True
_WORD_BYTES[0x80:] = True  # any byte of a multi-byte UTF-8 character
_SEPARATOR = "\x00"  # between the batch's texts: normalization drops every control but \t and \n


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer of each uint64 of ``x`` (a bijection that mixes every bit)."""
    with np.errstate(over="ignore"):
        z = x.astype(U64, copy=True)
        z += U64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> U64(30))) * U64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> U64(27))) * U64(0x94D049BB133111EB)
        return z ^ (z >> U64(31))


def _odd_constants(n: int, salt: int) -> np.ndarray:
    """``n`` fixed odd uint64 constants (SplitMix64 of a counter), one set per ``salt``."""
    return splitmix64(np.arange(n, dtype=U64) + U64(salt << 32)) | U64(1)


_SHINGLE_MUL = _odd_constants(SHINGLE_WORDS, 1)


def _inverse(p: np.uint64) -> np.uint64:
    """The inverse of the odd ``p`` mod 2^64 (Newton's iteration)."""
    with np.errstate(over="ignore"):
        x = p
        for _ in range(6):
            x = x * (U64(2) - p * x)
    return U64(x)


_P_INV = _inverse(_P)


def _powers(base: np.uint64, n: int) -> np.ndarray:
    """``base ** i`` mod 2^64 for i in [0, n]."""
    out = np.empty(n + 1, dtype=U64)
    out[0] = 1
    if n:
        with np.errstate(over="ignore"):
            np.cumprod(np.full(n, base, dtype=U64), out=out[1:])
    return out


def word_hashes(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(hash, document) of every word of ``texts`` in order: two uint64 / int64 arrays."""
    data = np.frombuffer(_SEPARATOR.join(texts).lower().encode("utf-8", "surrogatepass"), np.uint8)
    word = _WORD_BYTES[data]
    edges = np.diff(word.astype(np.int8), prepend=np.int8(0), append=np.int8(0))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    docs = np.searchsorted(np.flatnonzero(data == 0), starts)
    with np.errstate(over="ignore"):
        prefix = np.zeros(len(data) + 1, dtype=U64)
        np.cumsum(data.astype(U64) * _powers(_P, len(data))[:-1], out=prefix[1:])
        raw = (prefix[ends] - prefix[starts]) * _powers(_P_INV, len(data))[starts]
    return splitmix64(raw ^ (ends - starts).astype(U64)), docs.astype(np.int64)


def shingle_sets(texts: Sequence[str], words: int = SHINGLE_WORDS) -> tuple[np.ndarray, np.ndarray]:
    """(values, counts): the shingle sets of ``texts``, concatenated in document order, each
    sorted and distinct (uint64), and the size of each (int64, one per text; 0 for a text
    without a word)."""
    h, doc = word_hashes(texts)
    m = len(h)
    mul = _SHINGLE_MUL if words == SHINGLE_WORDS else _odd_constants(words, 1)
    index = np.arange(m)
    counts = np.bincount(doc, minlength=len(texts))
    first = np.r_[True, doc[1:] != doc[:-1]] if m else np.zeros(0, dtype=bool)
    full = np.zeros(m, dtype=bool)
    if m >= words:
        full[:m - words + 1] = doc[words - 1:] == doc[:m - words + 1]
    start = full | (first & (counts[doc] < words))
    at = index[start]
    acc = np.zeros(len(at), dtype=U64)
    with np.errstate(over="ignore"):
        for k in range(words):
            j = np.minimum(at + k, m - 1)
            inside = (at + k < m) & (doc[j] == doc[at])
            acc += np.where(inside, h[j], U64(0)) * mul[k]
    values, owner = splitmix64(acc), doc[at]
    values, owner = _sorted_by_document(values, owner)
    keep = np.r_[True, (values[1:] != values[:-1]) | (owner[1:] != owner[:-1])] if len(values) \
        else np.zeros(0, dtype=bool)
    return values[keep], np.bincount(owner[keep], minlength=len(texts)).astype(np.int64)


def _sorted_by_document(values: np.ndarray, owner: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``values`` sorted within each document (``owner``: non-decreasing, < 2^24), by one sort of
    a key of the document and the value's top 40 bits; values whose keys tie and differ (two
    of a document's shingles 40 bits alike: rare) are put in order by a sort on both."""
    if len(owner) and int(owner[-1]) >= 1 << 24:
        order = np.lexsort((values, owner))
        return values[order], owner[order]
    key = (owner.astype(U64) << U64(40)) | (values >> U64(24))
    order = np.argsort(key)
    values, owner, key = values[order], owner[order], key[order]
    tied = (key[1:] == key[:-1]) & (values[1:] != values[:-1])
    if tied.any():
        order = np.lexsort((values, owner))
        values, owner = values[order], owner[order]
    return values, owner


@dataclass(frozen=True)
class MinHashParams:
    """The signature's shape: ``bands`` bands of ``rows`` values each, from seed :data:`SEED`."""

    bands: int = DEFAULT_BANDS
    rows: int = DEFAULT_ROWS
    seed: int = SEED

    def __post_init__(self) -> None:
        if self.bands < 1 or self.rows < 1:
            raise ValueError(f"MinHash needs at least 1 band of 1 row, not {self.bands} x {self.rows}")
        if self.bands > 1024:
            raise ValueError(f"at most 1024 bands, not {self.bands}")

    @property
    def size(self) -> int:
        return self.bands * self.rows

    def coefficients(self) -> tuple[np.ndarray, np.ndarray]:
        """(a, b) of the ``bands * rows`` hash functions: a odd."""
        return _odd_constants(self.size, self.seed), splitmix64(np.arange(self.size, dtype=U64) + U64(self.seed))

    def identity(self) -> dict[str, int]:
        return {"bands": self.bands, "rows": self.rows, "seed": self.seed, "shingle_words": SHINGLE_WORDS}


def signatures(values: np.ndarray, counts: np.ndarray, params: MinHashParams) -> np.ndarray:
    """The MinHash signatures ``(len(counts), bands * rows)`` uint32 of the shingle sets
    (:func:`shingle_sets`' arrays); a document without a shingle has all values 2^32 - 1
    (it gets no band key: :func:`band_keys` callers leave it out)."""
    a, b = params.coefficients()
    out = np.full((len(counts), params.size), np.iinfo(np.uint32).max, dtype=np.uint32)
    owner = np.repeat(np.arange(len(counts)), counts)
    block = np.empty((SIGNATURE_CHUNK, params.size), dtype=U64)  # reused: one block of hashes in cache
    for lo in range(0, len(values), SIGNATURE_CHUNK):
        chunk, docs = values[lo:lo + SIGNATURE_CHUNK], owner[lo:lo + SIGNATURE_CHUNK]
        hashed = block[:len(chunk)]
        np.multiply(chunk[:, None], a[None, :], out=hashed)
        np.add(hashed, b[None, :], out=hashed)
        np.right_shift(hashed, U64(32), out=hashed)
        starts = np.flatnonzero(np.r_[True, docs[1:] != docs[:-1]])
        rows = docs[starts]  # distinct within a chunk: a document's shingles are contiguous
        out[rows] = np.minimum(out[rows], np.minimum.reduceat(hashed, starts, axis=0).astype(np.uint32))
    return out


def band_keys(sigs: np.ndarray, params: MinHashParams) -> np.ndarray:
    """``(documents, bands)`` uint64: each band of each signature hashed (its band's number
    mixed in)."""
    mul = _odd_constants(params.rows, 2)
    with np.errstate(over="ignore"):
        bands = sigs.reshape(len(sigs), params.bands, params.rows).astype(U64)
        summed = (bands * mul[None, None, :]).sum(axis=2, dtype=U64)
        return splitmix64(summed + np.arange(params.bands, dtype=U64)[None, :] * U64(0x9E3779B97F4A7C15))


def candidate_probability(s: float | np.ndarray, bands: int, rows: int) -> np.ndarray:
    """The probability that two documents of Jaccard ``s`` share a band (the S-curve)."""
    return np.asarray(1.0 - (1.0 - np.power(s, rows)) ** bands)


def curve_midpoint(bands: int, rows: int) -> float:
    """The Jaccard where the S-curve is steepest, about ``(1 / bands) ** (1 / rows)``."""
    return float((1.0 / bands) ** (1.0 / rows))


# ---------------------------------------------------------------------------------------
# Jaccard of many pairs of sets at once
# ---------------------------------------------------------------------------------------

PAIR_BITS = 24  # pairs per jaccard_many call: at most 2^24
_VALUE_SHIFT = U64(PAIR_BITS)


def _segment_ids(lengths: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(len(lengths), dtype=U64), lengths)


def jaccard_many(a_values: np.ndarray, a_lengths: np.ndarray, b_values: np.ndarray,
                 b_lengths: np.ndarray) -> np.ndarray:
    """The Jaccard of each pair ``i`` of sets (float64): set ``A_i`` is the ``i``-th run of
    ``a_lengths[i]`` values of ``a_values`` (each run sorted and distinct), ``B_i`` likewise.
    Two empty sets have Jaccard 1. Each value of ``B_i`` is looked up among ``A_i``'s by a key
    that puts the pair in the high bits and the value's top bits below (the ``A`` keys are then
    sorted as they come), and a hit is confirmed on the whole value."""
    n = len(a_lengths)
    if n >= 1 << PAIR_BITS:
        raise ValueError(f"jaccard_many takes fewer than {1 << PAIR_BITS} pairs at once, not {n}")
    a_keys = (_segment_ids(a_lengths) << U64(64 - PAIR_BITS)) | (a_values >> _VALUE_SHIFT)
    b_pair = _segment_ids(b_lengths)
    b_keys = (b_pair << U64(64 - PAIR_BITS)) | (b_values >> _VALUE_SHIFT)
    pos = np.searchsorted(a_keys, b_keys)
    hit = np.zeros(len(b_keys), dtype=bool)
    for step in range(3):  # values of one set sharing their top 40 bits: a run of at most 3 is looked through
        p = np.minimum(pos + step, max(len(a_keys) - 1, 0))
        if not len(a_keys):
            break
        hit |= (pos + step < len(a_keys)) & (a_keys[p] == b_keys) & (a_values[p] == b_values)
    inter = np.bincount(b_pair[hit].astype(np.int64), minlength=n).astype(np.float64)
    union = a_lengths.astype(np.float64) + b_lengths.astype(np.float64) - inter
    return np.where(union > 0, inter / np.maximum(union, 1.0), 1.0)


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """The Jaccard of two sorted distinct sets (the reference :func:`jaccard_many` is tested against)."""
    if not len(a) and not len(b):
        return 1.0
    inter = len(np.intersect1d(a, b, assume_unique=True))
    return inter / (len(a) + len(b) - inter)
