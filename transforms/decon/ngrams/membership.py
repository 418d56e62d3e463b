"""Membership: the compact set of test n-gram hashes the scan probes."""
from __future__ import annotations

import json
import math
from typing import Any, Iterable

import numpy as np

from .hashes import _U

MEMBERSHIP_MAGIC = b"REFINERY-DECON-MEMBERSHIP/1\n"


def sorted_unique(a: np.ndarray) -> np.ndarray:
    """np.unique, via sort (much faster than np.unique for large uint64 arrays here)."""
    s = np.sort(a)
    if len(s) < 2:
        return s
    keep = np.empty(len(s), dtype=np.bool_)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


class Membership:
    """Sorted unique uint64 n-gram hashes + a packed bitmap prefilter (built on load).

    ``maybe(h)`` says which hashes are in the set (exactly, as hashes); hits must still be
    verified against the n-gram text (:func:`scan_rows` does).
    """

    def __init__(self, hashes: np.ndarray | Iterable[int], lengths: Iterable[int], meta: dict[str, Any] | None = None):
        if not isinstance(hashes, np.ndarray):
            hashes = np.fromiter(hashes, dtype=np.uint64)
        self.hashes = sorted_unique(hashes.astype(np.uint64, copy=False))
        self.lengths = tuple(sorted(set(int(x) for x in lengths)))
        self.meta = dict(meta or {})
        count = max(1, len(self.hashes))
        self.bits = max(16, min(40, math.ceil(math.log2(count * 32))))  # <= 1/32 false hits
        self.shift = _U(64 - self.bits)
        bitmap = np.zeros(1 << self.bits, dtype=np.bool_)
        if len(self.hashes):
            bitmap[self.hashes >> self.shift] = True
        self.bitmap = np.packbits(bitmap, bitorder="little")

    def __len__(self) -> int:
        return len(self.hashes)

    @property
    def nbytes(self) -> int:
        return int(self.hashes.nbytes + self.bitmap.nbytes)

    def contains(self, h: np.ndarray) -> np.ndarray:
        """Boolean mask: which of the uint64 hashes ``h`` are in the set."""
        h = np.asarray(h, dtype=np.uint64)
        if len(h) == 0 or len(self.hashes) == 0:
            return np.zeros(len(h), dtype=np.bool_)
        slot = h >> self.shift
        mask: np.ndarray = ((self.bitmap[slot >> _U(3)] >> (slot & _U(7)).astype(np.uint8)) & 1).astype(np.bool_)
        cand = np.flatnonzero(mask)
        if len(cand):
            hc = h[cand]
            idx = np.searchsorted(self.hashes, hc)
            idx[idx == len(self.hashes)] = 0
            mask[cand] = self.hashes[idx] == hc
        return mask

    def to_bytes(self) -> bytes:
        header = {"count": int(len(self.hashes)), "lengths": list(self.lengths), **self.meta}
        return (MEMBERSHIP_MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n"
                + self.hashes.astype("<u8").tobytes())

    @classmethod
    def from_bytes(cls, data: bytes) -> "Membership":
        if not data.startswith(MEMBERSHIP_MAGIC):
            raise ValueError("not a decon membership file")
        nl = data.index(b"\n", len(MEMBERSHIP_MAGIC))
        header = json.loads(data[len(MEMBERSHIP_MAGIC):nl])
        hashes = np.frombuffer(data, dtype="<u8", offset=nl + 1).astype(np.uint64)
        if len(hashes) != header["count"]:
            raise ValueError("truncated decon membership file")
        meta = {k: v for k, v in header.items() if k not in ("count", "lengths")}
        return cls(hashes, header["lengths"], meta)
