"""Stable 64-bit token and n-gram hashes, and their vectorized numpy twins for batches of rows."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

MASK64 = (1 << 64) - 1
_M_BYTE = 0x100000001B3            # odd: invertible mod 2**64
_M_TOKEN = 0x9E3779B97F4A7C15      # odd
_C_LEN = 0xC2B2AE3D27D4EB4F
_C_NGRAM = 0x165667B19E3779F9
_F1 = 0xFF51AFD7ED558CCD
_F2 = 0xC4CEB9FE1A85EC53


def mix64(z: int) -> int:
    z ^= z >> 33
    z = (z * _F1) & MASK64
    z ^= z >> 33
    z = (z * _F2) & MASK64
    z ^= z >> 33
    return z


LONG_TOKEN_BYTES = 64


@lru_cache(maxsize=1 << 20)
def token_hash(token: str) -> int:
    """Stable 64-bit hash of a token's UTF-8 bytes.

    Up to 64 bytes: the bytes are read as little-endian 8-byte words w_0..w_k (the last one
    zero-padded) and ``h = (...(w_0 * M + w_1) * M + ...) + w_k`` (mod 2**64); longer tokens:
    ``h = blake2b(bytes, digest_size=8)`` (big-endian). Then ``mix64(h + len * C)``.
    """
    data = token.encode("utf-8", "surrogatepass")
    if len(data) > LONG_TOKEN_BYTES:
        h = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")
    else:
        h = 0
        for c in range(0, len(data), 8):
            h = (h * _M_BYTE + int.from_bytes(data[c:c + 8], "little")) & MASK64
    return mix64((h + len(data) * _C_LEN) & MASK64)


def ngram_hash(n: int, ngram: str) -> int:
    """Stable 64-bit hash of (n, n-gram): mix64(sum_j token_hash_j * M'^j + n * C')."""
    tokens = ngram.split(" ")
    if len(tokens) != n:
        raise ValueError(f"n-gram {ngram!r} does not have {n} tokens")
    h, p = 0, 1
    for tok in tokens:
        h = (h + token_hash(tok) * p) & MASK64
        p = (p * _M_TOKEN) & MASK64
    return mix64((h + n * _C_NGRAM) & MASK64)


def partition_of(n: int, ngram: str, partitions: int) -> int:
    return ngram_hash(n, ngram) % partitions


# ---------------------------------------------------------------------------------------
# Vectorized twins
# ---------------------------------------------------------------------------------------

_U = np.uint64


def _mix64_np(z: np.ndarray) -> np.ndarray:
    z = z ^ (z >> _U(33))
    z *= _U(_F1)
    z ^= z >> _U(33)
    z *= _U(_F2)
    z ^= z >> _U(33)
    return z


class _Powers:
    """Cached arrays of M^k and M^-k mod 2**64, grown on demand up to ``keep`` entries; a
    larger batch's (one eval row of 3 million tokens) are made for it and not kept: 55 MB a
    process would otherwise hold through every later stage it runs (the local runner's driver)."""

    def __init__(self, m: int, keep: int = 1 << 20):
        self.m = m
        self.minv = pow(m, -1, 1 << 64)
        self.keep = keep
        self.fwd = np.ones(0, dtype=np.uint64)
        self.inv = np.ones(0, dtype=np.uint64)

    def _make(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        fwd = np.full(k, _U(self.m), dtype=np.uint64)
        fwd[0] = 1
        inv = np.full(k, _U(self.minv), dtype=np.uint64)
        inv[0] = 1
        return np.multiply.accumulate(fwd), np.multiply.accumulate(inv)

    def get(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        if size > self.keep:
            return self._make(size)
        if len(self.fwd) < size:
            self.fwd, self.inv = self._make(min(max(size, 2 * len(self.fwd), 1 << 16), max(size, self.keep)))
        return self.fwd[:size], self.inv[:size]


_TOKEN_POWERS = _Powers(_M_TOKEN)


@dataclass
class TokenBatch:
    """Tokens of a batch of rows, as byte spans of one buffer (see :func:`tokenize_batch`)."""

    buf: bytes                 # translated buffer: separators are b' '
    starts: np.ndarray         # int64 [T]: token start in buf
    ends: np.ndarray           # int64 [T]: token end in buf
    row_of: np.ndarray         # int64 [T]: row (0-based in the batch) of each token
    row_first: np.ndarray      # int64 [R + 1]: index of each row's first token; [R] = T
    row_base: np.ndarray       # int64 [R]: offset of each row's first byte in buf
    hashes: np.ndarray         # uint64 [T]: token_hash of each token

    def token_bytes(self, k: int) -> bytes:
        return self.buf[self.starts[k]:self.ends[k]]


def tokenize_batch(prepared: list[bytes], table: bytes) -> TokenBatch:
    """Tokenize many rows at once (rows as :meth:`WordSplitter.prepare` returns them).

    The buffer is ``\\0 row0 \\0 ␠ \\0 row1 \\0 ...`` translated with ``table``. A token is a
    maximal run of non-space bytes; the marker bytes at each row's ends (found by position,
    not by value) are not part of tokens, which reproduces the empty tokens that
    ``re.split`` yields at the ends of a row.
    """
    lens = np.fromiter((len(p) for p in prepared), dtype=np.int64, count=len(prepared))
    buf = (b"\0" + b"\0 \0".join(prepared) + b"\0").translate(table)
    row_base = np.zeros(len(prepared), dtype=np.int64)
    if len(prepared) > 1:
        row_base[1:] = np.cumsum(lens[:-1] + 3)
    arr = np.frombuffer(buf, dtype=np.uint8)
    nonsp = np.zeros(len(arr) + 2, dtype=np.bool_)
    np.not_equal(arr, 0x20, out=nonsp[1:-1])
    edges = np.flatnonzero(nonsp[1:] != nonsp[:-1])  # run boundaries alternate: start, end, start, ...
    starts = edges[0::2].copy()
    ends = edges[1::2].copy()
    # Each row's first token starts at its start marker (non-space, after a space or the
    # buffer start) and its last token ends right after its end marker.
    row_first = np.empty(len(prepared) + 1, dtype=np.int64)
    row_first[:-1] = np.searchsorted(starts, row_base)
    row_first[-1] = len(starts)
    row_of = np.repeat(np.arange(len(prepared), dtype=np.int64), np.diff(row_first))
    starts[row_first[:-1]] += 1                                  # drop the row-start marker
    ends[row_first[1:] - 1] -= 1                                 # drop the row-end marker
    hashes = _token_hashes(buf, starts, ends)
    return TokenBatch(buf, starts, ends, row_of, row_first, row_base, hashes)


_WORD_MASKS = np.array([(1 << (8 * k)) - 1 for k in range(9)], dtype=np.uint64)


def _token_hashes(buf: bytes, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Vectorized :func:`token_hash` of ``buf[starts[k]:ends[k]]`` for every k."""
    padded = buf + b"\0" * (LONG_TOKEN_BYTES + 8)
    # words[i] = the 8 bytes at buf[i:i+8] as a little-endian uint64 (an overlapping view)
    words = np.ndarray(shape=(len(buf),), dtype="<u8", buffer=padded, offset=0, strides=(1,))
    lens = ends - starts
    h = words[starts] & _WORD_MASKS[np.minimum(lens, 8)]
    active = np.flatnonzero(lens > 8)
    for c in range(8, LONG_TOKEN_BYTES, 8):
        active = active[lens[active] > c]
        if not len(active):
            break
        w = words[starts[active] + c] & _WORD_MASKS[np.minimum(lens[active] - c, 8)]
        h[active] = h[active] * _U(_M_BYTE) + w
    for k in np.flatnonzero(lens > LONG_TOKEN_BYTES).tolist():
        h[k] = int.from_bytes(hashlib.blake2b(buf[starts[k]:ends[k]], digest_size=8).digest(), "big")
    h += lens.astype(np.uint64) * _U(_C_LEN)
    return _mix64_np(h)


def batch_prefix(batch: TokenBatch) -> np.ndarray:
    """prefix[k] = sum_{m<k} token_hash_m * M'^m (mod 2**64), shared by all window lengths."""
    t = len(batch.hashes)
    fwd, _ = _TOKEN_POWERS.get(t)
    prefix = np.zeros(t + 1, dtype=np.uint64)
    np.cumsum(batch.hashes * fwd, out=prefix[1:])
    return prefix


def batch_all_window_hashes(batch: TokenBatch, prefix: np.ndarray, length: int) -> np.ndarray:
    """Hashes of the windows starting at every token 0..T-length, including windows that
    cross a row boundary (callers drop those with :func:`window_in_row`)."""
    t = len(batch.hashes)
    w = t - length + 1
    if w <= 0:
        return np.zeros(0, dtype=np.uint64)
    _, inv = _TOKEN_POWERS.get(t)
    raw = prefix[length:] - prefix[:w]
    raw *= inv[:w]
    raw += _U((length * _C_NGRAM) & MASK64)
    return _mix64_np(raw)


def window_hashes_at(batch: TokenBatch, prefix: np.ndarray, pos: np.ndarray, length: int) -> np.ndarray:
    """Hashes of the windows of ``length`` tokens starting at ``pos`` (each ``<= T - length``)."""
    _, inv = _TOKEN_POWERS.get(len(batch.hashes))
    raw = prefix[pos + length] - prefix[pos]
    raw *= inv[pos]
    raw += _U((length * _C_NGRAM) & MASK64)
    return _mix64_np(raw)


def window_in_row(batch: TokenBatch, pos: np.ndarray, length: int) -> np.ndarray:
    same: np.ndarray = batch.row_of[pos] == batch.row_of[pos + length - 1]
    return same


def batch_window_hashes(batch: TokenBatch, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions, hashes) of every window of ``length`` tokens that lies in one row;
    ``hashes[k] == ngram_hash(length, ngram at positions[k])``."""
    h = batch_all_window_hashes(batch, batch_prefix(batch), length)
    pos = np.flatnonzero(window_in_row(batch, np.arange(len(h)), length))
    return pos, h[pos]
