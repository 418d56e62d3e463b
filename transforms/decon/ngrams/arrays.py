"""numpy helpers shared by the drop list and the longest-match merge: int64 columns as bytes,
ranges of positions, runs of equal tuples, and work-bounded batches of groups."""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np


def i64(data: bytes) -> np.ndarray:
    """Little-endian int64 values from ``data`` (no copy)."""
    return np.frombuffer(data, dtype="<i8")


def i64_bytes(values: np.ndarray | Sequence[int]) -> bytes:
    """``values`` as little-endian int64 bytes (what :func:`i64` reads back)."""
    return np.ascontiguousarray(values, dtype="<i8").tobytes()


def ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The positions ``lo[0] .. hi[0] - 1``, then ``lo[1] .. hi[1] - 1``, ..., in one array."""
    size = hi - lo
    return np.repeat(lo - (np.cumsum(size) - size), size) + np.arange(int(size.sum()), dtype=np.int64)


def run_starts(*columns: np.ndarray) -> np.ndarray:
    """Positions where a run of equal tuples of ``columns`` (already sorted) begins ([] when empty)."""
    change = np.zeros(len(columns[0]), dtype=bool)
    if len(change):
        change[0] = True
    for c in columns:
        change[1:] |= c[1:] != c[:-1]
    return np.flatnonzero(change)


def batches(at: np.ndarray, limit: int) -> Iterator[tuple[int, int]]:
    """Spans ``[a, b)`` of consecutive groups, one group at least, whose work stays within
    ``limit``: ``at[k]`` is the work of the groups before group k (cumulative; the last entry
    closes the last group)."""
    a, last = 0, len(at) - 1
    while a < last:
        b = min(max(int(np.searchsorted(at, at[a] + limit, side="right")) - 1, a + 1), last)
        yield a, b
        a = b


def merged_spans(groups: Sequence[np.ndarray], start: np.ndarray,
                 end: np.ndarray) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """The union of the ``[start, end)`` ranges of each group (a tuple of the ``groups``
    columns), ranges that overlap or touch merged into one: ``(group columns, start, end)``
    of the merged ranges, sorted by group (its columns in order) and start."""
    order = np.lexsort((end, start, *reversed(groups)))
    cols = [np.asarray(c)[order] for c in groups]
    s, e = np.asarray(start)[order], np.asarray(end)[order]
    if not len(s):
        return cols, s, e
    firsts = run_starts(*cols)
    gid = np.zeros(len(s), dtype=np.int64)
    gid[firsts] = 1
    gid = np.cumsum(gid) - 1
    width = int(e.max()) - min(int(s.min()), 0) + 1
    if width * len(firsts) < (1 << 62):  # one running max over all groups, each lifted above the one before
        reach = np.maximum.accumulate(e + gid * width) - gid * width
    else:  # (offsets too large to lift: group by group)
        reach = np.concatenate([np.maximum.accumulate(part) for part in np.split(e, firsts[1:])])
    new = np.ones(len(s), dtype=bool)
    new[1:] = (s[1:] > reach[:-1]) | (gid[1:] != gid[:-1])
    at = np.flatnonzero(new)
    last = np.append(at[1:], len(s)) - 1
    return [c[at] for c in cols], s[at], reach[last]
