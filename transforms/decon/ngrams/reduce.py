"""Reduce: one hash partition's hits joined with its eval records (detail records, training
document counts), and the whole run's stats and HELM metrics."""
from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence, TypedDict

import numpy as np

from refinery.transforms.formats.row_ids import doc_id_for

from . import normalized
from .arrays import ranges, run_starts
from .compact import RecordColumns
from .details import (
    NGRAM_MAX_CHARS,
    DetailRows,
    DetailSink,
    HitBatch,
    JsonLinesSink,
    ParquetSink,
    RecordSide,
)
from .droplist import RowHits
from .index import EvalRow, SameText, same_text
from .longest import EMPTY_WINDOWS, longest_at, record_windows
from .row_shares import RowShare, TrainRowTotals, bytes_reader, encode_row_share, merge_train_rows
from .scan import ScanHits
from .steering import Steering, steering_of
from .word_split import WordSplitter, configured_ns


def instance_metrics(tokens: list[str], n: int, overlap_counts: dict[str, int]) -> dict[str, float]:
    """HELM metrics of one instance at configured n.

    The instance's n-grams are its windows of ``L = min(n, len(tokens))`` tokens (all-empty
    windows skipped); a window overlaps if its n-gram is in ``overlap_counts`` (n-gram ->
    number of training documents containing it, after any frequency filter).

    - ``binary``: 1 if any window overlaps.
    - ``jaccard``: overlapping windows / all windows.
    - ``token``: tokens covered by an overlapping window / all tokens (ConTAM's
      ``coverage``, :mod:`.longest`).
    - ``jaccard_weighted``: sum over overlapping windows of 1/count, / all windows.
    - ``token_weighted``: sum over tokens of the largest 1/count among the overlapping
      windows covering it, / all tokens.

    ``overlap_counts`` is keyed by :func:`overlap_key` (the n-gram itself unless it is very long).
    """
    if not overlap_counts:
        return {"binary": 0, "jaccard": 0.0, "token": 0.0, "jaccard_weighted": 0.0, "token_weighted": 0.0}
    length = min(n, len(tokens))
    blank = " " * (length - 1)  # the all-empty window is not an n-gram
    total = 0
    cover = [0.0] * len(tokens)
    covered = [False] * len(tokens)
    hits = 0
    wsum = 0.0
    for i in range(len(tokens) - length + 1):  # a window's n-gram at a time: none kept (a long row has millions)
        gram = " ".join(tokens[i:i + length])
        if gram == blank:
            continue
        total += 1
        c = overlap_counts.get(overlap_key(gram))
        if not c:
            continue
        hits += 1
        w = 1.0 / c
        wsum += w
        for k in range(i, i + length):
            covered[k] = True
            if w > cover[k]:
                cover[k] = w
    nt = len(tokens) or 1
    return {
        "binary": 1 if hits else 0,
        "jaccard": hits / total if total else 0.0,
        "token": sum(covered) / nt if total else 0.0,
        "jaccard_weighted": wsum / total if total else 0.0,
        "token_weighted": sum(cover) / nt if total else 0.0,
    }


# -- the scan's output, grouped by hash partition ---------------------------------------

SNIPPET_CONTEXT = 50  # characters of training text kept on each side of a hit's first occurrence
SNIPPET_MAX_CHARS = 1000  # a snippet is cut there (a huge token): ``train_snippet_truncated`` says so


def _i64(data: bytes) -> list[int]:
    values: list[int] = np.frombuffer(data, dtype="<i8").tolist()
    return values


def _b64(values: np.ndarray) -> bytes:
    return np.ascontiguousarray(values, dtype="<i8").tobytes()


@dataclass
class HitGroups:
    """One entry per (training row, n-gram) of a batch's hits, in their order, as columns:
    ``partition``, ``row`` (the row number the reader gave), ``doc_id``, ``record`` (index in
    the partition's records), ``occurrences`` (count) with their ``start``/``end`` code-point
    offsets, and a ``snippet`` of the training text (:data:`SNIPPET_CONTEXT` characters
    either side of the first occurrence, at most :data:`SNIPPET_MAX_CHARS`) with its
    ``snippet_start``."""

    partition: np.ndarray
    row: np.ndarray
    doc_id: list[str]
    record: np.ndarray
    occurrences: np.ndarray
    start: np.ndarray
    end: np.ndarray
    snippet_start: np.ndarray
    snippet: list[str]


ROW_ID_MARK = "\x00"  # a hit group's doc id "\x00RELPATH": RELPATH:ROW once the row is file-global


def hit_groups(hits: ScanHits, id_field: str, relpath: str | None = None) -> HitGroups:
    """The :class:`HitGroups` of a batch's hits, in rows of the file at ``relpath`` (relative to
    the input the user named: a row without an id is ``relpath:row``, as in prep's shards;
    :func:`~refinery.transforms.formats.row_ids.doc_id_for`; here ``ROW_ID_MARK + relpath``,
    finished by :func:`row_ids_at` where the row's number in its file is known)."""
    g = hits.group_starts()
    first = g[:-1]
    grow = hits.row[first].tolist()
    lo = np.maximum(hits.start[first] - SNIPPET_CONTEXT, 0)
    rows = hits.rows
    doc_ids: dict[int, str] = {}
    for r in grow:
        if r not in doc_ids:
            record = rows[r][1]
            # an id-less row's id is relpath:ROW, ROW file-global: a byte slice's row base is known
            # only to the reduce (row_ids_at), which the marker tells which ids to finish
            doc_ids[r] = doc_id_for(record, id_field, None, None) if record.get(id_field) is not None or not relpath \
                else ROW_ID_MARK + relpath
    texts = [text for _, _, text in rows]
    hi = np.minimum(hits.end[first] + SNIPPET_CONTEXT, lo + SNIPPET_MAX_CHARS).tolist()
    return HitGroups(hits.partition[first], np.array([rows[r][0] for r in grow], dtype=np.int64),
                     [doc_ids[r] for r in grow], hits.record[first], np.diff(g), hits.start, hits.end, lo,
                     [texts[r][s:e] for r, s, e in zip(grow, lo.tolist(), hi)])


def split_hits(hits: ScanHits, max_chars: int) -> Iterator[ScanHits]:
    """``hits`` in consecutive pieces of whole (partition, row, record) groups, each piece's
    snippets (:func:`hit_groups`) at most about ``max_chars`` characters (a group alone may
    be more): a scan unit makes the snippets of one piece at a time, however many n-grams
    its batch of training rows holds (each hit n-gram has a snippet of its own)."""
    g = hits.group_starts()
    first = g[:-1]
    lo = np.maximum(hits.start[first] - SNIPPET_CONTEXT, 0)
    total = np.cumsum(np.minimum(hits.end[first] + SNIPPET_CONTEXT, lo + SNIPPET_MAX_CHARS) - lo)  # at most
    if not len(total) or total[-1] <= max_chars:
        yield hits
        return
    a = 0
    while a < len(first):
        b = max(int(np.searchsorted(total, (total[a - 1] if a else 0) + max_chars, side="right")), a + 1)
        s, e = g[a], g[b]
        yield ScanHits(hits.rows, hits.row[s:e], hits.partition[s:e], hits.record[s:e], hits.start[s:e], hits.end[s:e])
        a = b


def hit_blocks(groups: list[HitGroups]) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(partition, block)`` for each partition of some batches' hit groups, ascending; a
    block holds the partition's groups in scan order, the :class:`HitGroups` columns but
    ``partition``, integer columns as little-endian int64 bytes."""
    part = np.concatenate([x.partition for x in groups])
    occ = np.concatenate([x.occurrences for x in groups])
    start, end = np.concatenate([x.start for x in groups]), np.concatenate([x.end for x in groups])
    row, record = np.concatenate([x.row for x in groups]), np.concatenate([x.record for x in groups])
    snip_start = np.concatenate([x.snippet_start for x in groups])
    doc_ids = [d for x in groups for d in x.doc_id]
    snippets = [s for x in groups for s in x.snippet]
    order = np.argsort(part, kind="stable")
    first_occ = np.cumsum(occ) - occ
    cuts = np.flatnonzero(np.diff(part[order])) + 1
    for sel in np.split(order, cuts):
        counts = occ[sel]
        at = np.repeat(first_occ[sel] - (np.cumsum(counts) - counts), counts) + np.arange(counts.sum())
        picked = sel.tolist()
        yield int(part[sel[0]]), {
            "row": _b64(row[sel]), "doc_id": [doc_ids[k] for k in picked], "record": _b64(record[sel]),
            "occurrences": _b64(counts), "start": _b64(start[at]), "end": _b64(end[at]),
            "snippet_start": _b64(snip_start[sel]), "snippet": [snippets[k] for k in picked],
        }


# -- reduce: one eval partition ---------------------------------------------------------

def overlap_key(gram: str) -> str:
    """An n-gram's key in the results' ``overlaps``: the n-gram itself, or, past
    :data:`NGRAM_MAX_CHARS`, its first characters and a blake2b digest of it (bounded, and
    never equal to a shorter n-gram)."""
    if len(gram) <= NGRAM_MAX_CHARS:
        return gram
    digest = hashlib.blake2b(gram.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    return f"{gram[:NGRAM_MAX_CHARS]} {digest}"


DEFAULT_MAX_NGRAM_DETAILS = 100_000  # detail records written per n-gram (--max-ngram-details)


class PartitionResult(TypedDict):
    """One eval partition's share of the results (:func:`reduce_partition`; msgpack-able)."""

    details: int                                     # detail records written
    ignored: int                                     # n-grams over max_train_count
    capped: list[list[Any]]                          # [n, n-gram (cut), written, all] per capped n-gram
    overlaps: dict[int, dict[int, dict[str, int]]]   # eval_idx -> n -> {overlap_key: training documents}
    spans: dict[int, dict[int, list[Any]]]           # eval_idx -> n-gram length -> eval offsets
    by_path: list[list[Any]]                         # [train_path, eval_dataset, n, first rows, train rows]
    train_rows: dict[str, Any]                       # :meth:`.droplist.RowHits.result`
    windows: dict[str, Any]                          # :func:`.longest.record_windows`
    samples: dict[int, dict[int, list[Any]]]         # eval_idx -> n-gram length -> first two training rows
    ignored_evals: dict[int, dict[int, int]]         # eval_idx -> n-gram length -> its n-grams over max_train_count


Blocks = Callable[[], Iterable[tuple[int, str, int, dict[str, Any]]]]


def reduce_partition(records: Sequence[Sequence[Any]], eval_rows: list[EvalRow], ns: list[int], blocks: Blocks,
                     max_train_count: int | None, write: Callable[[bytes], object] | None,
                     max_ngram_details: int | None = None, same: SameText | None = None,
                     rows_out: DetailRows | None = None) -> PartitionResult:
    """Join one eval partition's records with the scan's hit blocks of that partition.

    ``blocks()`` yields ``(scan unit index, training path, row base, block)`` in scan order
    (the row base makes a byte slice's rows file-global); it is called twice when
    ``max_train_count`` is set (document counts first). ``write`` receives the detail records
    as UTF-8 bytes of JSON lines (:class:`.details.JsonLinesSink`); with ``rows_out``, the same
    records go to it as Parquet (:class:`.details.ParquetSink`), and ``write`` is not used.

    Eval rows with the same text (``same``, default :func:`same_text`) get one detail record
    per (training row, n-gram): the first row's, with ``same_text`` (how many others). At most
    ``max_ngram_details`` detail records are written per n-gram (scan order, then eval
    order); the stats still count every one. N-grams and snippets are cut at
    :data:`NGRAM_MAX_CHARS` / :data:`SNIPPET_MAX_CHARS`, marked ``ngram_truncated`` /
    ``train_snippet_truncated``.

    The steps, each a pass of its own over a block's hits as columns: which hits count
    (:func:`counted_hits`: ``--max-train-count``), what each counted hit writes
    (:class:`Tally`: per-record counts with ``--max-ngram-details``), the detail records (a
    :class:`.details.DetailSink`), the samples (:class:`Sampler`), and once at the end the
    partition's share (:func:`partition_result`): ``details`` (written), ``ignored``
    (n-grams over ``max_train_count``), ``capped`` ([n, n-gram (cut), written, all] per
    n-gram over ``max_ngram_details``), ``overlaps`` (eval_idx -> n -> {:func:`overlap_key`:
    training documents}; first rows only), ``by_path`` ([train_path, eval_dataset, n, first
    rows of the texts with rows of that dataset, train rows]), ``train_rows``
    (:meth:`.droplist.RowHits.result`), ``spans`` (eval_idx -> n-gram length -> eval offsets
    of its overlapping n-grams of that length; first rows only), ``samples`` (eval_idx ->
    n-gram length -> its first two training rows sharing an n-gram of that length, each
    ``[unit, row, train_path, [[ngram hash, offsets, snippet_start, snippet], ...]]``; first
    rows only) and ``windows`` (:func:`.longest.record_windows`).
    """
    same = same_text(eval_rows) if same is None else same
    recs = records if isinstance(records, RecordColumns) else RecordColumns.from_lists(records)
    side = RecordSide(recs, same.first)
    skip = ignored_records(len(recs), blocks, max_train_count)
    sink: DetailSink = (ParquetSink(rows_out, side) if rows_out is not None
                        else JsonLinesSink(write if write is not None else _no_writer, side, eval_rows, same))
    tally = Tally(side, max_ngram_details)
    sampler = Sampler(side)
    row_hits = RowHits()  # every counted hit's (training row, record): the drop list
    for unit, path, base, block in blocks():
        block = row_ids_at(block, base)
        hits = counted_hits(block, base, skip)
        row_hits.add(path, base, hits.block_rows, hits.block_recs, block["doc_id"], hits.keep,
                     (hits.occ_at, hits.starts, hits.ends))
        room = tally.add(path, hits)
        sink.add(hits.batch(path, block, room))
        sink.end_block()
        sampler.add(unit, path, hits, block)
    sink.finish()
    return partition_result(side, tally, sampler, row_hits, eval_rows, sorted(set(ns)), same,
                            int(skip.sum()) if skip is not None else 0, ignored_instances(side, skip))


def ignored_instances(side: RecordSide, skip: np.ndarray | None) -> dict[int, dict[int, int]]:
    """The eval rows (first rows of shared texts) the ignored records (``skip``: n-grams over
    ``--max-train-count``) name: eval_idx -> n-gram length -> how many of its n-grams were
    ignored. An instance listed here and not overlapping at that length otherwise is one
    the limit hid (:func:`overlap_stats`)."""
    out: dict[int, dict[int, int]] = {}
    for rec in (np.flatnonzero(skip).tolist() if skip is not None else []):
        length = int(side.records.n[rec])
        for eval_idx, _ in side.evals(rec):
            by_len = out.setdefault(eval_idx, {})
            by_len[length] = by_len.get(length, 0) + 1
    return out


def row_ids_at(block: dict[str, Any], base: int) -> dict[str, Any]:
    """``block`` with each marked doc id (:data:`ROW_ID_MARK`: a row without an id) made
    ``relpath:row``, the row file-global (``base``: the rows of the file before the block's
    byte slice)."""
    ids = block["doc_id"]
    if not any(d.startswith(ROW_ID_MARK) for d in ids):
        return block
    rows = np.frombuffer(block["row"], dtype="<i8") + base
    return {**block, "doc_id": [f"{d[1:]}:{r}" if d.startswith(ROW_ID_MARK) else d for d, r in zip(ids, rows.tolist())]}


def _no_writer(data: bytes) -> None:
    raise ValueError("reduce_partition: detail records to write, but neither write nor rows_out was given")


def ignored_records(num_records: int, blocks: Blocks, max_train_count: int | None) -> np.ndarray | None:
    """The counting pass: which records more than ``max_train_count`` hits name (None: no limit)."""
    if max_train_count is None:
        return None
    seen = np.zeros(num_records, dtype=np.int64)
    for _, _, _, block in blocks():
        seen += np.bincount(np.frombuffer(block["record"], dtype="<i8"), minlength=num_records)
    return seen > max_train_count


@dataclass
class CountedHits:
    """A block's hits as columns (``block_*``: all of them; the rest: those that count, in
    scan order, ``at`` their positions in the block)."""

    block_rows: np.ndarray
    block_recs: np.ndarray
    keep: np.ndarray | None
    at: np.ndarray
    rec: np.ndarray
    row: np.ndarray        # file-global
    occ_at: np.ndarray     # the block's occurrences: hit k's are occ_at[k] to occ_at[k + 1]
    starts: np.ndarray
    ends: np.ndarray
    snippet_start: np.ndarray

    def batch(self, path: str, block: dict[str, Any], room: np.ndarray) -> HitBatch:
        """The hits that write detail records (``room`` each, 0: none)."""
        w = np.flatnonzero(room)
        at = self.at[w]
        lo, hi = self.occ_at[at], self.occ_at[at + 1]
        occ = ranges(lo, hi)
        flat = np.empty(2 * len(occ), dtype=np.int64)
        flat[0::2], flat[1::2] = self.starts[occ], self.ends[occ]
        snip = self.snippet_start[w]
        doc_ids, snippets = block["doc_id"], block["snippet"]
        listed = at.tolist()
        return HitBatch(path, self.rec[w], room[w], self.row[w], [doc_ids[k] for k in listed], hi - lo, flat, snip,
                        [snippets[k] for k in listed], self.ends[lo] + SNIPPET_CONTEXT - snip > SNIPPET_MAX_CHARS)


def counted_hits(block: dict[str, Any], base: int, skip: np.ndarray | None) -> CountedHits:
    """A block's hits as :class:`CountedHits`; ``skip``: records over ``--max-train-count``."""
    recs, rows = np.frombuffer(block["record"], dtype="<i8"), np.frombuffer(block["row"], dtype="<i8")
    occ = np.frombuffer(block["occurrences"], dtype="<i8")
    keep = None if skip is None else ~skip[recs]
    at = np.arange(len(recs), dtype=np.int64) if keep is None else np.flatnonzero(keep)
    return CountedHits(rows, recs, keep, at, recs[at].astype(np.int64), rows[at] + base,
                       np.append(0, np.cumsum(occ)), np.frombuffer(block["start"], dtype="<i8"),
                       np.frombuffer(block["end"], dtype="<i8"),
                       np.frombuffer(block["snippet_start"], dtype="<i8")[at])


class Tally:
    """Per record: the training documents that hold it (``counts``), the detail records it
    wrote (``written``), the order records were first counted in (``order``), and the
    counted hits' (record, row) per training path."""

    def __init__(self, side: RecordSide, max_ngram_details: int | None):
        self.side, self.cap = side, max_ngram_details
        self.counts = np.zeros(len(side.size), dtype=np.int64)
        self.firsts: list[np.ndarray] = []
        self.path_hits: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}

    def add(self, path: str, hits: CountedHits) -> np.ndarray:
        """Count a block's hits; the detail records each writes (the n-gram's next ones, up to
        ``max_ngram_details`` over all its hits)."""
        rec = hits.rec
        self.path_hits.setdefault(path, []).append((rec, hits.row))
        if not len(rec):
            return np.zeros(0, dtype=np.int64)
        order = np.argsort(rec, kind="stable")
        starts = run_starts(rec[order])
        within = np.empty(len(rec), dtype=np.int64)
        within[order] = np.arange(len(rec)) - np.repeat(starts, np.diff(np.append(starts, len(rec))))
        before = self.counts[rec] + within  # this n-gram's hits before each
        new = rec[order[starts]][self.counts[rec[order[starts]]] == 0]
        if len(new):
            first_at = order[starts][self.counts[rec[order[starts]]] == 0]
            self.firsts.append(new[np.argsort(first_at, kind="stable")])
        np.add.at(self.counts, rec, 1)
        size = self.side.size[rec]
        room: np.ndarray = size.copy() if self.cap is None else np.clip(self.cap - before * size, 0, size)
        return room

    @property
    def order(self) -> list[int]:
        return np.concatenate(self.firsts).tolist() if self.firsts else []

    @property
    def written(self) -> np.ndarray:
        full = self.counts * self.side.size
        return full if self.cap is None else np.minimum(full, self.cap)


class Sampler:
    """The first two training rows (scan order) of each (eval row, n-gram length) among the
    counted hits: a record stops sampling once each of its eval rows has two."""

    def __init__(self, side: RecordSide):
        self.side = side
        self.open = np.ones(len(side.size), dtype=bool)  # records still sampling
        self.sampled: dict[int, list[int]] = {}
        self.samples: dict[tuple[int, int], dict[tuple[int, int], list[Any]]] = {}

    def add(self, unit: int, path: str, hits: CountedHits, block: dict[str, Any]) -> None:
        recs = self.side.records
        for k in np.flatnonzero(self.open[hits.rec]).tolist():
            rec = int(hits.rec[k])
            todo = self.sampled.get(rec)
            if todo is None:
                todo = self.sampled[rec] = [e for e, _ in self.side.evals(rec)]
            if not todo:
                self.open[rec] = False
                continue
            at, row = int(hits.at[k]), int(hits.row[k])
            lo, hi = int(hits.occ_at[at]), int(hits.occ_at[at + 1])
            hit = [int(recs.hashes[rec]), list(zip(hits.starts[lo:hi].tolist(), hits.ends[lo:hi].tolist())),
                   int(hits.snippet_start[k]), block["snippet"][at]]
            n = int(recs.n[rec])
            for eval_idx in todo:
                rows_of = self.samples.setdefault((eval_idx, n), {})
                if (unit, row) in rows_of or len(rows_of) < 2:
                    rows_of.setdefault((unit, row), [unit, row, path, []])[3].append(hit)
            # rows come in scan order: an eval row with two rows takes no later one from this record
            todo = self.sampled[rec] = [e for e in todo if len(self.samples[(e, n)]) < 2]
            if not todo:
                self.open[rec] = False

    def result(self) -> dict[int, dict[int, list[Any]]]:
        """``{eval row: {length: [training rows]}}``."""
        out: dict[int, dict[int, list[Any]]] = {}
        for (eval_idx, n), rows_of in self.samples.items():
            out.setdefault(eval_idx, {})[n] = list(rows_of.values())
        return out


def partition_result(side: RecordSide, tally: Tally, sampler: Sampler, row_hits: RowHits, eval_rows: list[EvalRow],
                     ns: list[int], same: SameText, ignored: int, ignored_evals: dict[int, dict[int, int]]
                     ) -> PartitionResult:
    """The partition's share of the results, once its blocks are through (:func:`reduce_partition`)."""
    order = tally.order
    kept = {rec: side.evals(rec) for rec in order}
    written = tally.written
    overlaps: dict[int, dict[int, dict[str, int]]] = {}
    spans: dict[int, dict[int, list[Any]]] = {}
    capped = []
    for rec, evals in kept.items():  # the first row of each text only: the others share its state
        n, gram, count = int(side.records.n[rec]), side.gram(rec), int(tally.counts[rec])
        key = overlap_key(gram)
        for eval_idx, eval_offsets in evals:
            overlaps.setdefault(eval_idx, {}).setdefault(n, {})[key] = count
            spans.setdefault(eval_idx, {}).setdefault(n, []).extend(eval_offsets)
        if count * len(evals) > written[rec]:
            capped.append([n, gram[:NGRAM_MAX_CHARS], int(written[rec]), count * len(evals)])
    keys_of = {rec: record_keys(int(side.records.n[rec]), evals, eval_rows, ns, same) for rec, evals in kept.items()}
    return {"details": int(written.sum()), "ignored": ignored, "capped": capped, "overlaps": overlaps,
            "spans": spans, "by_path": by_path(tally.path_hits, keys_of),
            "train_rows": row_hits.result(keys_of, len(eval_rows)), "windows": record_windows(side.records, kept),
            "samples": sampler.result(), "ignored_evals": ignored_evals}


def record_keys(n_rec: int, evals: list[Any], eval_rows: list[EvalRow], ns: list[int], same: SameText
                ) -> dict[tuple[str, int], list[int]]:
    """A record's eval rows by (eval dataset, configured n): the first rows of the texts with
    rows of that dataset."""
    keys: dict[tuple[str, int], list[int]] = {}
    for eval_idx, _ in evals:
        er = eval_rows[eval_idx]
        for ds in same.datasets.get(eval_idx, (er.eval_dataset,)):
            for n in configured_ns(ns, er.num_tokens, n_rec):
                keys.setdefault((ds, n), []).append(eval_idx)
    return keys


def by_path(path_hits: dict[str, list[tuple[np.ndarray, np.ndarray]]],
            keys_of: dict[int, dict[tuple[str, int], list[int]]]) -> list[list[Any]]:
    """``[train_path, eval_dataset, n, first rows, train rows]`` sorted: per training path and
    key of :func:`record_keys`, the eval rows of the records its counted hits name and its rows."""
    out: dict[tuple[str, str, int], tuple[set[Any], np.ndarray]] = {}
    for path, parts in path_hits.items():
        rec = np.concatenate([r for r, _ in parts])
        row = np.concatenate([w for _, w in parts])
        urec, inv = np.unique(rec, return_inverse=True)
        ids: dict[tuple[str, int], set[Any]] = {}
        has: dict[tuple[str, int], np.ndarray] = {}
        for i, r in enumerate(urec.tolist()):
            for key, evals in keys_of[r].items():
                ids.setdefault(key, set()).update(evals)
                has.setdefault(key, np.zeros(len(urec), dtype=bool))[i] = True
        for key, mask in has.items():
            out[(path, *key)] = (ids[key], np.unique(row[mask[inv]]))
    return [[*key, sorted(got), rows.tolist()] for key, (got, rows) in sorted(out.items())]


# -- merge: all partitions --------------------------------------------------------------

NO_OVERLAP = {"binary": 0, "jaccard": 0.0, "token": 0.0, "jaccard_weighted": 0.0, "token_weighted": 0.0,
              "longest_match": 0, "coverage": 0.0}


@dataclass
class ReduceResult:
    overlap_stats: list[dict[str, Any]]
    by_train_path: list[dict[str, Any]]
    metrics: list[dict[str, Any]]
    summary: list[dict[str, Any]]
    ignored_ngrams: int
    overlaps: dict[int, dict[int, dict[str, int]]]   # first row of a text -> n -> {ngram: training documents}
    spans: dict[int, dict[int, list[Any]]]                # first row of a text -> n -> eval offsets of its n-grams
    samples: dict[int, dict[int, list[Any]]]              # first row of a text -> n -> its first two training rows
    capped: list[Any]                                     # [n, n-gram, written, all] per n-gram over max_ngram_details
    contaminated: TrainRowTotals                     # the drop list's merge (its lines, in memory: ``.chunks()``)
    train_rows_at_n: dict[int, int] = field(default_factory=dict)  # configured n -> training rows overlapping at it
    steering: Steering | None = None                 # the n-grams that hit the most training rows (.steering)


def merge_partitions(eval_rows: list[EvalRow], ns: list[int], parts: Iterable[PartitionResult] | MergedParts,
                     tokenizer: WordSplitter, eval_bad_rows: dict[str, dict[str, Any]] | None = None,
                     same: SameText | None = None, max_train_count: int | None = None,
                     train: TrainRowTotals | None = None, helm: HelmMetrics | None = None) -> ReduceResult:
    """The stats, HELM metrics and report inputs of a run from its partitions' results
    (:func:`reduce_partition`); a partition's n-grams are its own, so the overlaps of an
    instance are the union of its partitions' (metrics need all of them). Rows with the
    same text (``same``, default :func:`same_text`) share their first row's overlaps, spans,
    samples and metrics (HELM's, then ``longest_match`` and ``coverage``: :mod:`.longest`):
    ``overlaps``, ``spans`` and ``samples`` are keyed by first rows
    only (:meth:`SameText.first_of`); the stats and metrics list every row. With
    ``max_train_count``, each line of the stats also names the instances that overlap at its n
    only through ignored n-grams (:func:`overlap_stats`). ``parts``: the partitions' results, or
    them gathered (:func:`gather_partitions`); ``helm``: their :func:`helm_metrics`, when the
    caller computed them (for the drop list's coverage) first. ``train``: the merge of the
    partitions' row shares (:func:`.row_shares.merge_train_rows`, which wrote the drop list and
    its spans); without it, the shares the ``parts`` hold are merged here, the drop list kept
    in memory."""
    ns = sorted(set(ns))
    same = same_text(eval_rows) if same is None else same
    got = parts if isinstance(parts, MergedParts) else gather_partitions(parts)
    helm = helm_metrics(eval_rows, ns, got.overlaps, tokenizer, same) if helm is None else helm
    datasets = sorted({r.eval_dataset for r in eval_rows} | set(eval_bad_rows or {}))
    stats, all_ids, empty_ids = overlap_stats(eval_rows, ns, datasets, got.overlaps, same,
                                              got.ignored_evals if max_train_count is not None else None)
    if train is None:
        train = train_rows_in_memory(got.row_shares, eval_rows, same, ns, tokenizer,
                                     coverage_table(helm, len(eval_rows), ns))
    longest = train.longest
    summary = [{"eval_dataset": ds,
                "num_rows": sum(1 for r in eval_rows if r.eval_dataset == ds),
                "num_instances": len(all_ids[ds]),
                "num_empty_instances": len(empty_ids[ds]),
                "num_bad_rows": (eval_bad_rows or {}).get(ds, {}).get("bad_rows", 0)} for ds in datasets]
    first_rows: dict[int, dict[int, list[Any]]] = defaultdict(dict)
    for (eval_idx, n), rows_of in got.samples.items():
        first_rows[eval_idx][n] = [rows_of[k] for k in sorted(rows_of)[:2]]
    return ReduceResult(stats, train_path_stats(got.by_path, train.rows_by_path, eval_rows, same),
                        instance_metrics_rows(eval_rows, ns, helm, longest, same), summary,
                        got.ignored, dict(got.overlaps), dict(got.spans), dict(first_rows),
                        sorted(got.capped, key=lambda c: (-c[3], c[0], c[1])),
                        train, train.rows_at_n,
                        steering_of(eval_rows, ns, got.overlaps, same, train.rows_at_n, max_train_count))


def gather_partitions(parts: Iterable[PartitionResult]) -> MergedParts:
    """The partitions' results gathered, one partition at a time."""
    got = MergedParts()
    for part in parts:
        got.add(part)
    return got


@dataclass
class MergedParts:
    """The partitions' shares (:class:`PartitionResult`) gathered, one partition at a time
    (:func:`merge_partitions`)."""

    overlaps: dict[int, dict[int, dict[str, int]]] = field(default_factory=lambda: defaultdict(dict))
    spans: dict[int, dict[int, list[Any]]] = field(default_factory=lambda: defaultdict(dict))
    samples: dict[tuple[int, int], dict[tuple[int, int], list[Any]]] = field(
        default_factory=lambda: defaultdict(dict))
    by_path: dict[tuple[str, str, int], set[int]] = field(default_factory=dict)  # -> eval rows (first rows)
    # (train_rows share, its records' eval windows) per partition that holds them (in memory: a test's)
    row_shares: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    ignored: int = 0
    ignored_evals: dict[int, dict[int, int]] = field(default_factory=lambda: defaultdict(dict))
    capped: list[list[Any]] = field(default_factory=list)

    def add(self, part: PartitionResult) -> None:
        self.ignored += part["ignored"]
        for eval_idx, by_len in part.get("ignored_evals", {}).items():
            mine = self.ignored_evals[eval_idx]
            for length, count in by_len.items():
                mine[length] = mine.get(length, 0) + count
        self.capped += part.get("capped", [])
        for eval_idx, grams_by_n in part["overlaps"].items():
            for n, grams in grams_by_n.items():
                self.overlaps[eval_idx].setdefault(n, {}).update(grams)
        for eval_idx, offsets_by_n in part["spans"].items():
            for n, offsets in offsets_by_n.items():
                self.spans[eval_idx].setdefault(n, []).extend(offsets)
        for eval_idx, sampled_by_n in part["samples"].items():
            for n, sampled in sampled_by_n.items():
                for unit, row, path, hits in sampled:
                    self.samples[(eval_idx, n)].setdefault((unit, row), [unit, row, path, []])[3].extend(hits)
        for path, ds, n, ids, _ in part["by_path"]:  # its training rows are counted from the row shares
            self.by_path.setdefault((path, ds, n), set()).update(ids)
        if "train_rows" in part:
            self.row_shares.append((part["train_rows"], part.get("windows", EMPTY_WINDOWS)))


def overlap_stats(eval_rows: list[EvalRow], ns: list[int], datasets: list[str],
                  overlaps: dict[int, dict[int, dict[str, int]]], same: SameText,
                  ignored: dict[int, dict[int, int]] | None = None
                  ) -> tuple[list[dict[str, Any]], dict[str, set[str]], dict[str, set[str]]]:
    """(the lines of ``overlap_stats.jsonl``: per eval dataset and configured n its instances and
    the overlapping ones, each dataset's instance ids, its empty ones). Given ``ignored``
    (:func:`ignored_instances`, merged: ``--max-train-count`` was set), each line also has
    ``instance_ids_ignored_only`` and its count: the instances that share n-grams with the
    training data at n only through n-grams the limit ignored, so that no training row is
    listed for them."""
    all_ids: dict[str, set[str]] = defaultdict(set)
    empty_ids: dict[str, set[str]] = defaultdict(set)
    hit_ids: dict[tuple[str, int], set[str]] = defaultdict(set)
    hidden: dict[tuple[str, int], set[str]] = defaultdict(set)
    for r in eval_rows:
        all_ids[r.eval_dataset].add(r.instance_id)
        if r.empty:
            empty_ids[r.eval_dataset].add(r.instance_id)
        first = same.first_of(r.eval_idx)
        for length in overlaps.get(first, {}):
            for n in configured_ns(ns, r.num_tokens, length):
                hit_ids[(r.eval_dataset, n)].add(r.instance_id)
        for length in (ignored or {}).get(first, {}):
            for n in configured_ns(ns, r.num_tokens, length):
                hidden[(r.eval_dataset, n)].add(r.instance_id)
    stats: list[dict[str, Any]] = []
    for ds in datasets:
        for n in ns:
            line: dict[str, Any] = {"eval_dataset": ds, "n": n, "num_instances": len(all_ids[ds]),
                                    "instance_ids": sorted(hit_ids[(ds, n)])}
            if ignored is not None:
                only = sorted(hidden[(ds, n)] - hit_ids[(ds, n)])
                line.update(num_instances_ignored_only=len(only), instance_ids_ignored_only=only)
            stats.append(line)
    return stats, all_ids, empty_ids


def ignored_only_warning(overlap_stats: list[dict[str, Any]], max_train_count: int | None) -> str | None:
    """One line naming, per eval dataset and n, the instances that overlap the training data
    only through n-grams ``--max-train-count`` ignored (None: there are none)."""
    hidden = [s for s in overlap_stats if s.get("num_instances_ignored_only")]
    if not hidden:
        return None
    where = "; ".join(f"{s['eval_dataset']} at n = {s['n']}: {s['num_instances_ignored_only']} "
                      f"({_some(s['instance_ids_ignored_only'])})" for s in hidden)
    return (f"instances that overlap training rows only through n-grams ignored by --max-train-count "
            f"{max_train_count} (each in more than {max_train_count} training documents), so no training row is "
            f"listed for them: {where}; stats/overlap_stats.jsonl lists them (instance_ids_ignored_only). Raise "
            f"--max-train-count, or leave it out, to list the rows behind them")


def _some(ids: list[str], k: int = 3) -> str:
    shown = ", ".join(ids[:k])
    return shown + (f", and {len(ids) - k} more" if len(ids) > k else "")


def train_rows_in_memory(shares: list[tuple[dict[str, Any], dict[str, Any]]], eval_rows: list[EvalRow],
                         same: SameText, ns: list[int], tokenizer: WordSplitter,
                         coverage: np.ndarray | None = None) -> TrainRowTotals:
    """:func:`.row_shares.merge_train_rows` of shares held in memory (each encoded as the reduce
    stage writes its file), the drop list and its spans kept as bytes."""
    files = []
    for rows, windows in shares:
        data = encode_row_share(rows, windows, eval_rows, tokenizer)
        files.append(RowShare(bytes_reader(data), "a partition's row share"))
    drop, spans = bytearray(), bytearray()
    totals = merge_train_rows(files, eval_rows, same, ns, tokenizer, drop.extend, spans.extend, coverage=coverage)
    totals.drop_list, totals.spans = bytes(drop), bytes(spans)
    return totals


def train_path_stats(by_path: dict[tuple[str, str, int], set[int]], rows_by_path: dict[tuple[str, str, int], int],
                     eval_rows: list[EvalRow], same: SameText) -> list[dict[str, Any]]:
    """The lines of ``by_train_path.jsonl``: per training path, eval dataset and n, the instances
    its rows overlap (every row of a shared text, from ``by_path``) and its rows that do
    (``rows_by_path``, :class:`.row_shares.TrainRowTotals`)."""
    if set(by_path) != set(rows_by_path):
        raise ValueError("the reduce results and the row shares name other (training path, eval dataset, n)")
    paths = []
    for (path, ds, n), ids in sorted(by_path.items()):
        rows = rows_by_path[(path, ds, n)]
        instance_ids = sorted({eval_rows[j].instance_id for i in ids for j in same.rows_of(i)
                               if eval_rows[j].eval_dataset == ds})
        paths.append({"train_path": path, "eval_dataset": ds, "n": n, "num_instances": len(instance_ids),
                      "instance_ids": instance_ids, "num_train_rows": rows})
    return paths


HelmMetrics = dict[int, list[dict[str, float]]]  # first row of an overlapping text -> its HELM metrics per n


def helm_metrics(eval_rows: list[EvalRow], ns: list[int], overlaps: dict[int, dict[int, dict[str, int]]],
                 tokenizer: WordSplitter, same: SameText) -> HelmMetrics:
    """Per overlapping text (its first row) its :func:`instance_metrics` at each configured n of
    ``ns`` (ascending): a text several rows have is measured once."""
    out: HelmMetrics = {}
    for r in eval_rows:
        first = same.first_of(r.eval_idx)
        if first in overlaps and first not in out:
            text = eval_rows[first]
            tokens = normalized.tokens(tokenizer, text.text)
            out[first] = [instance_metrics(tokens, n, overlaps[first].get(min(n, text.num_tokens), {})) for n in ns]
    return out


def coverage_table(helm: HelmMetrics, num_eval_rows: int, ns: list[int]) -> np.ndarray:
    """Each eval row's coverage (HELM's token metric) at each configured n of ``ns``
    (ascending), on the first row of a shared text (0 elsewhere): ``(eval rows, len(ns))``."""
    table = np.zeros((num_eval_rows, len(ns)), dtype=np.float64)
    for first, per_n in helm.items():
        table[first] = [m["token"] for m in per_n]
    return table


def instance_metrics_rows(eval_rows: list[EvalRow], ns: list[int], helm: HelmMetrics, longest: np.ndarray,
                          same: SameText) -> list[dict[str, Any]]:
    """Per eval row and configured n its metrics (``helm``: :func:`helm_metrics`, then
    ``longest_match`` and ``coverage``): a text several rows have is measured once, on its
    first row."""
    metrics = []
    shared: dict[int, list[dict[str, Any]]] = {}  # first row of a text several rows have -> its metrics per n
    for r in eval_rows:
        first = same.first_of(r.eval_idx)
        per_n = shared.get(first)
        if per_n is None:
            if first in helm:
                # coverage is HELM's token metric under the ConTAM name (.longest)
                per_n = [{**m, "longest_match": longest_at(longest, ns, first, r.num_tokens, n), "coverage": m["token"]}
                         for n, m in zip(ns, helm[first])]
            else:
                per_n = [NO_OVERLAP] * len(ns)
            if first in same.others:
                shared[first] = per_n
        for n, m in zip(ns, per_n):
            metrics.append({"eval_dataset": r.eval_dataset, "eval_path": r.eval_path, "eval_row": r.eval_row,
                            "instance_id": r.instance_id, "n": n, **m})
    return metrics
