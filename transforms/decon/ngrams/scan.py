"""The training side: the scan (batching, probing, verification, offsets)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from refinery.transforms.io.rows import Row
from refinery.transforms.io.text import TextSpec

from .arrays import ranges
from .compact import RecordColumns
from .hashes import (
    _U,
    TokenBatch,
    batch_all_window_hashes,
    batch_prefix,
    tokenize_batch,
    window_hashes_at,
    window_in_row,
)
from .index import Partition
from .membership import Membership
from .normalized import char_offsets, match_texts
from .word_split import WordSplitter

ReadRow = tuple[int, dict[str, Any], str]  # a training row read: (row, record, its text)


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

    rows: list[ReadRow]
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


def scan_rows(rows: Iterable[Row], *, text_field: str | TextSpec,
              tokenizer: WordSplitter, membership: Membership, lookup: Callable[[int], Partition], partitions: int,
              stats: ScanStats,
              batch_bytes: int = 1 << 20) -> Iterator[ScanHits]:
    """Stream training rows ``(row, record, error)`` in batches; yield the :class:`ScanHits` of
    each batch that has any.

    ``text_field``: a field name or a :class:`TextSpec` (a template, chat rows); a row without
    text (unreadable, a missing field, not a string) is counted in ``stats.bad_rows``.
    ``lookup(p)`` returns hash partition ``p`` (:func:`load_partition`); a hash hit counts
    only if its exact n-gram is in it (no false positives). The n-grams are those of the
    row's match text (:func:`.normalized.match_text`: the text prep trains on, folded with
    the tokenizer's match fold), the offsets into the row's text (:mod:`.normalized`).
    """
    loaded: dict[int, RecordColumns] = {}

    def records(p: int) -> RecordColumns:
        recs = loaded.get(p)
        if recs is None:
            recs = loaded[p] = lookup(p).records
        return recs

    prepare = tokenizer.prepare
    extract = TextSpec.of(text_field).extract

    def scan(pending: list[ReadRow]) -> ScanHits | None:
        normed = match_texts(tokenizer, [text for _, _, text in pending])
        prepared = [prepare(text) for text in normed]
        stats.text_bytes += sum(map(len, prepared))
        return _scan_batch(pending, prepared, normed, tokenizer, membership, records, partitions, stats)

    pending: list[ReadRow] = []
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


def probe_windows(batch: TokenBatch, membership: Membership, stats: ScanStats
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first token, length, hash) of each window of the batch, in one row, whose hash is in
    ``membership``: the candidates :func:`verify_windows` checks, a length at a time."""
    prefix = batch_prefix(batch)
    t = len(batch.hashes)
    pos_l, len_l, h_l = [], [], []
    n0 = min(membership.meta.get("ns") or [1])
    first_hits = None  # positions whose n0-gram is in the set
    for length in membership.lengths:
        stats.windows += max(0, t - length + 1)
        if first_hits is not None and length > n0:
            # An eval n-gram longer than n0 comes from an eval row of more than n0 tokens, whose
            # first n0 tokens are an eval n-gram too (n0 >= 2: never all empty): only windows
            # whose n0-gram is in the set need probing.
            pos = first_hits[first_hits + length <= t]
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
        pos_l.append(pos[inrow])
        h_l.append(h[inrow])
        len_l.append(np.full(len(pos_l[-1]), length, dtype=np.int64))
    if not pos_l:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint64)
    return np.concatenate(pos_l).astype(np.int64), np.concatenate(len_l), np.concatenate(h_l)


def verify_windows(batch: TokenBatch, pos: np.ndarray, lens: np.ndarray, h: np.ndarray, partitions: int,
                   records: Callable[[int], RecordColumns]) -> np.ndarray:
    """``partition << 32 | record`` of each window of ``lens[k]`` tokens at token ``pos[k]``
    (its hash ``h[k]``), or -1 where its n-gram is not in the test index: exact, as arrays.

    A window's n-gram is its tokens joined by one space. Its candidate records are those of
    its hash in partition ``h % partitions`` (found by ``searchsorted``; several where
    n-grams share a hash); a candidate of the window's length whose text is as long as the
    n-gram is compared with it byte for byte (a record's text is unique in its partition).
    """
    ids = np.full(len(pos), -1, dtype=np.int64)
    if not len(pos):
        return ids
    starts, ends = batch.starts, batch.ends
    span = np.zeros(len(starts) + 1, dtype=np.int64)  # a token's bytes and the space after it, cumulated
    np.cumsum(ends - starts + 1, out=span[1:])
    width = span[pos + lens] - span[pos] - 1  # each window's n-gram, in bytes
    parts = (h % _U(partitions)).astype(np.int64)
    by_part = np.argsort(parts, kind="stable")
    cuts = np.flatnonzero(np.diff(parts[by_part])) + 1
    cand, rec, part, size, same_n, grams = [], [], [], [], [], []
    for sel in np.split(by_part, cuts):  # a partition at a time: its records' own arrays
        p = int(parts[sel[0]])
        recs = records(p)
        keys, order, unique = recs.by_hash()
        if not len(keys):
            continue
        hs = h[sel]
        lo = np.searchsorted(keys, hs)
        if unique:  # a record per hash: the one at lo, if any (its text tells)
            c, k = sel, np.minimum(lo, len(keys) - 1)
        else:  # each record of the window's hash
            hi = np.searchsorted(keys, hs, "right")
            c, k = np.repeat(sel, hi - lo), ranges(lo, hi)
        if order is not None:
            k = order[k]
        g0, g1 = recs.gram_at[k], recs.gram_at[k + 1]
        cand.append(c)
        rec.append(k)
        part.append(np.full(len(c), p, dtype=np.int64))
        size.append(g1 - g0)
        same_n.append(recs.n[k] == lens[c])
        grams.append(np.frombuffer(recs.grams, dtype=np.uint8)[ranges(g0, g1)])
    if not cand:
        return ids
    c, k, p_of, glen, gram = (np.concatenate(x) for x in (cand, rec, part, size, grams))
    same = (glen == width[c]) & np.concatenate(same_n)
    if not same.all():  # candidates of another length or size: not compared
        gram = gram[np.repeat(same, glen)]
        c, k, p_of = c[same], k[same], p_of[same]
    # each candidate's window, a token and the byte after it at a time; those bytes are spaces
    tok = ranges(pos[c], pos[c] + lens[c])
    got = np.frombuffer(batch.buf, dtype=np.uint8)[ranges(starts[tok], ends[tok] + 1)]
    got[np.cumsum(ends[tok] - starts[tok] + 1) - 1] = 0x20
    last = np.cumsum(width[c] + 1) - 1  # the space after each window's last token: not in its n-gram
    keep = np.ones(len(got), dtype=np.bool_)
    keep[last] = False
    differ = np.zeros(len(got) - len(last) + 1, dtype=np.int64)  # bytes that differ, cumulated
    np.cumsum(got[keep] != gram, out=differ[1:])
    at = np.zeros(len(c) + 1, dtype=np.int64)
    np.cumsum(width[c], out=at[1:])
    ok = differ[at[1:]] == differ[at[:-1]]
    ids[c[ok]] = p_of[ok] << 32 | k[ok]
    return ids


def _scan_batch(pending: list[ReadRow], prepared: list[bytes], normed: list[str], tokenizer: WordSplitter,
                membership: Membership, records: Callable[[int], RecordColumns], partitions: int, stats: ScanStats
                ) -> ScanHits | None:
    batch = tokenize_batch(prepared, tokenizer.byte_table)
    pos, lens, h = probe_windows(batch, membership, stats)
    if not len(pos):
        return None
    stats.hash_hits += len(pos)
    ids = verify_windows(batch, pos, lens, h, partitions, records)
    ok = ids >= 0
    found = int(ok.sum())
    stats.false_hits += len(ok) - found
    stats.verified_hits += found
    if not found:
        return None
    pos, lens, ids = pos[ok], lens[ok], ids[ok]
    rows = batch.row_of[pos]
    start, end = char_offsets(batch, pos, lens, rows, pending, prepared, normed, tokenizer)
    part, rec = ids >> 32, ids & 0xFFFFFFFF
    order = np.lexsort((start, rec, rows, part))
    stats.rows_with_hits += len(np.unique(rows))
    return ScanHits(pending, rows[order], part[order], rec[order], start[order], end[order])


