"""The training side: the scan (batching, probing, verification, offsets)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from itertools import repeat
from typing import Callable, Iterable, Iterator

import numpy as np

from refinery.transforms.core.text import TextSpec, normalize_text

from .compact import HashFind
from .hashes import _U, batch_all_window_hashes, batch_prefix, tokenize_batch, window_hashes_at, window_in_row
from .index import Partition
from .membership import Membership
from .normalized import to_raw
from .tokenizers import Tokenizer


@dataclass
class ScanStats:
    rows: int = 0
    bad_rows: int = 0
    text_bytes: int = 0
    windows: int = 0
    hash_hits: int = 0
    false_hits: int = 0
    verified_hits: int = 0
    rows_with_hits: int = 0

    def add(self, other: "ScanStats") -> None:
        for k, v in other.__dict__.items():
            setattr(self, k, getattr(self, k) + v)


@dataclass
class ScanHits:
    """The verified hits of one batch of training rows: one entry per occurrence of a test
    n-gram, sorted by (partition, row, record, start).

    ``rows`` are the batch's rows ``(row, record, text)``; ``row`` indexes them; ``record``
    is the n-gram's index in its partition's records; ``start``/``end`` are code-point
    offsets into the row's text.
    """

    rows: list[tuple[int, dict, str]]
    row: np.ndarray
    partition: np.ndarray
    record: np.ndarray
    start: np.ndarray
    end: np.ndarray

    def group_starts(self) -> np.ndarray:
        """Index of the first occurrence of each (partition, row, record) group, then ``len``."""
        k = len(self.row)
        new = np.ones(k, dtype=np.bool_)
        if k > 1:
            new[1:] = (np.diff(self.row) != 0) | (np.diff(self.partition) != 0) | (np.diff(self.record) != 0)
        return np.append(np.flatnonzero(new), k)


def scan_rows(rows: Iterable[tuple[int, dict | None, str | None]], *, text_field: str | TextSpec, tokenizer: Tokenizer,
              membership: Membership, lookup: Callable[[int], Partition], partitions: int, stats: ScanStats,
              batch_bytes: int = 1 << 20) -> Iterator[ScanHits]:
    """Stream training rows ``(row, record, error)`` in batches; yield the :class:`ScanHits` of
    each batch that has any.

    ``text_field``: a field name or a :class:`TextSpec` (a template, chat rows); a row without
    text (unreadable, a missing field, not a string) is counted in ``stats.bad_rows``.
    ``lookup(p)`` returns hash partition ``p`` (:func:`load_partition`); a hash hit counts
    only if its exact n-gram is in it (no false positives). The n-grams are those of the
    row's normalized text (:func:`~refinery.transforms.core.text.normalize_text`, the text
    prep trains on), the offsets into the row's text (:mod:`.normalized`).
    """
    loaded: dict[int, Partition] = {}

    def partition(p: int) -> Partition:
        part = loaded.get(p)
        if part is None:
            part = loaded[p] = lookup(p)
        return part

    known: dict[int, dict[bytes, int]] = defaultdict(dict)  # verified windows, see _verify
    prepare = tokenizer.prepare
    extract = TextSpec.of(text_field).extract

    def scan(pending: list[tuple[int, dict, str]]) -> ScanHits | None:
        normed = [normalize_text(text) for _, _, text in pending]
        prepared = [prepare(text) for text in normed]
        stats.text_bytes += sum(map(len, prepared))
        return _scan_batch(pending, prepared, tokenizer, membership, partition, partitions, stats, known, normed)

    pending: list[tuple[int, dict, str]] = []
    size = 0
    for row, record, _error in rows:
        stats.rows += 1
        text, _ = extract(record)
        if text is None or record is None:  # a text only of a row (never of None)
            stats.bad_rows += 1
            continue
        pending.append((row, record, text))
        size += len(text) + 3
        if size >= batch_bytes:
            hits = scan(pending)
            if hits is not None:
                yield hits
            pending, size = [], 0
    if pending:
        hits = scan(pending)
        if hits is not None:
            yield hits


MAX_KNOWN_WINDOWS = 1 << 20  # per length; the cache of verified windows is cleared past this
_NOT_FOUND = -1
_UNKNOWN = -2


def _verify(buf: bytes, starts: list[int], ends: list[int], parts: list[int], length: int,
            known: dict[bytes, int], lookup: Callable[[int], Partition]) -> np.ndarray:
    """``partition << 32 | record`` of each window ``buf[starts[k]:ends[k]]`` of ``length``
    tokens, or -1 where its n-gram is not in the test index.

    A window's bytes, from its first token's start to its last token's end (separator runs
    included), determine its n-gram when neither end token is empty (tokens never contain a
    separator): ``known`` caches the answer by those bytes.
    """
    if len(known) > MAX_KNOWN_WINDOWS:
        known.clear()
    raws = [buf[s:e] for s, e in zip(starts, ends)]
    ids = np.fromiter(map(known.get, raws, repeat(_UNKNOWN)), dtype=np.int64, count=len(raws))
    finds: dict[int, HashFind] = {}
    for k in np.flatnonzero(ids == _UNKNOWN).tolist():
        raw, part = raws[k], parts[k]
        find = finds.get(part)
        if find is None:
            find = finds[part] = lookup(part).find
        rec = find.get((length, b" ".join(raw.split())))
        ids[k] = known[raw] = _NOT_FOUND if rec is None else part << 32 | rec
    return ids


def _scan_batch(pending, prepared, tokenizer, membership, lookup, partitions, stats, known, normed
                ) -> ScanHits | None:
    batch = tokenize_batch(prepared, tokenizer.byte_table)
    prefix = batch_prefix(batch)
    buf, starts, ends = batch.buf, batch.starts, batch.ends
    pos_l, len_l, id_l = [], [], []
    n0 = min(membership.meta.get("ns") or [1])
    first_hits = None  # positions whose n0-gram is in the set
    for length in membership.lengths:
        stats.windows += max(0, len(batch.hashes) - length + 1)
        if first_hits is not None and length > n0:
            # An eval n-gram longer than n0 comes from an eval row of more than n0 tokens, whose
            # first n0 tokens are an eval n-gram too (n0 >= 2: never all empty): only windows
            # whose n0-gram is in the set need probing.
            pos = first_hits[first_hits + length <= len(batch.hashes)]
            h = window_hashes_at(batch, prefix, pos, length)
            found = membership.contains(h)
            pos, h = pos[found], h[found]
        else:
            h = batch_all_window_hashes(batch, prefix, length)
            pos = np.flatnonzero(membership.contains(h))
            h = h[pos]
            if length == n0 >= 2:
                first_hits = pos
        inrow = window_in_row(batch, pos, length)
        pos, h = pos[inrow], h[inrow]
        if not len(pos):
            continue
        stats.hash_hits += len(pos)
        last = pos + length - 1
        parts = (h % _U(partitions)).astype(np.int64)
        edge = (starts[pos] == ends[pos]) | (starts[last] == ends[last])
        ids = np.empty(len(pos), dtype=np.int64)
        inner = ~edge
        ids[inner] = _verify(buf, starts[pos[inner]].tolist(), ends[last[inner]].tolist(), parts[inner].tolist(),
                             length, known[length], lookup)
        for k in np.flatnonzero(edge).tolist():  # an empty token at an end: join the tokens
            p = int(pos[k])
            gram = b" ".join(buf[a:b] for a, b in zip(starts[p:p + length].tolist(), ends[p:p + length].tolist()))
            rec = lookup(int(parts[k])).find.get((length, gram))
            ids[k] = _NOT_FOUND if rec is None else int(parts[k]) << 32 | rec
        pos_l.append(pos)
        len_l.append(np.full(len(pos), length, dtype=np.int64))
        id_l.append(ids)
    if not pos_l:
        return None
    ids = np.concatenate(id_l)
    ok = ids >= 0
    stats.false_hits += int(len(ok) - ok.sum())
    stats.verified_hits += int(ok.sum())
    if not ok.any():
        return None
    pos, lens, ids = np.concatenate(pos_l)[ok], np.concatenate(len_l)[ok], ids[ok]
    last = pos + lens - 1
    rows = batch.row_of[pos]
    base = batch.row_base[rows] + 1
    start = starts[pos] - base
    end = ends[last] - base
    for r in np.unique(rows).tolist():  # rows whose byte offsets are not code-point offsets of their text
        raw, text = pending[r][2], normed[r]
        same = text is raw or text == raw  # (normalize_text hands a clean text back as it is)
        if len(prepared[r]) == len(text) and same:
            continue
        at = np.flatnonzero(rows == r)
        if len(prepared[r]) == len(text):
            pass
        elif len(text.lower() if tokenizer.lowercase else text) == len(text):
            lead = (np.frombuffer(prepared[r], dtype=np.uint8) & 0xC0) != 0x80
            chars = np.zeros(len(lead) + 1, dtype=np.int64)
            np.cumsum(lead, out=chars[1:])
            start[at], end[at] = chars[start[at]], chars[end[at]]
        else:  # lowering changed the length ('İ'): the exact tokenizer maps offsets
            spans = tokenizer.tokenize_with_offsets(text)[1]
            first = int(batch.row_first[r])
            for k in at.tolist():
                i = int(pos[k]) - first
                start[k], end[k] = spans[i][0], spans[i + int(lens[k]) - 1][1]
        if not same:  # offsets into the normalized text -> into the row's text
            start[at], end[at] = to_raw(raw, text, start[at], end[at])
    part, rec = ids >> 32, ids & 0xFFFFFFFF
    order = np.lexsort((start, rec, rows, part))
    hits = ScanHits(pending, rows[order], part[order], rec[order], start[order], end[order])
    stats.rows_with_hits += len(np.unique(rows))
    return hits
