"""The drop list: which training rows overlap an eval set, at which n.

A reduce unit sees its partition's hits as blocks of (training row, n-gram record) pairs;
:class:`RowHits` keeps them as arrays while the blocks stream by, and :meth:`RowHits.result`
turns them into the partition's share (msgpack-able: arrays as bytes): its training rows and
the n-gram records each holds, and once per record, what the record overlaps. The run's
merge joins the partitions' shares (:class:`DropList`): one line per training row with an
overlap, for ``stats/contaminated_train_docs.jsonl``, naming what ``prep
--exclude-overlaps`` needs (the row, its document id, the n it overlaps at and, per n, the
largest coverage of the instances it overlaps there, for ``--exclude-min-coverage``) and not
the eval instances (decon's details list them): a line's size does not grow with the eval
rows that share an n-gram. The work is done on numpy arrays, never per hit in Python: a
hit-dense corpus has millions of hits.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from refinery.transforms.io.jsonl import JSON_ERRORS

from .arrays import i64, i64_bytes, merged_spans, ranges, run_starts
from .index import EvalRow, SameText

LINES_AT_ONCE = 4096  # drop-list lines made at once


def _quote(s: str) -> str:
    """A JSON string as ``json.dumps(s, ensure_ascii=False)`` writes it."""
    return json.dumps(s, ensure_ascii=False)


_EMPTY = {"paths": [], "keys": [], "rows": b"", "docs": [], "recs": b"", "rec_starts": b"", "codes": b"",
          "code_starts": b"", "spans": b""}
SPAN_COLUMNS = 5  # a share's spans: (path index, row, n, start, end) per merged range


class RowHits:
    """The (training row, n-gram record) of every counted hit of one reduce unit, in arrays."""

    def __init__(self) -> None:
        self.paths: dict[str, int] = {}
        self.path: list[np.ndarray] = []
        self.row: list[np.ndarray] = []
        self.rec: list[np.ndarray] = []
        self.doc: list[np.ndarray] = []   # (block, position in block) of each hit: its doc id
        self.doc_ids: list[list[str]] = []
        self.occ_hit: list[np.ndarray] = []  # each counted occurrence's hit (its index among the hits added)
        self.occ_start: list[np.ndarray] = []  # and its training offsets
        self.occ_end: list[np.ndarray] = []
        self.hits = 0

    def add(self, path: str, base: int, rows: np.ndarray, recs: np.ndarray, doc_ids: list[str],
            keep: np.ndarray | None = None, occurrences: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
            ) -> None:
        """One block's hits: ``rows`` (numbered from ``base``), ``recs`` and the rows' doc ids;
        ``keep``: the hits that count (n-grams over ``--max-train-count`` do not);
        ``occurrences``: ``(occ_at, starts, ends)``, hit k's training offsets are
        ``starts[occ_at[k]:occ_at[k + 1]]`` (and ``ends``): what span mode cuts out."""
        at = np.arange(len(recs), dtype=np.int64)
        if keep is not None:
            rows, recs, at = rows[keep], recs[keep], at[keep]
        if occurrences is not None:
            occ_at, starts, ends = occurrences
            lo, hi = occ_at[at], occ_at[at + 1]
            picked = ranges(lo, hi)
            self.occ_hit.append(np.repeat(np.arange(self.hits, self.hits + len(at), dtype=np.int64), hi - lo))
            self.occ_start.append(starts[picked].astype(np.int64))
            self.occ_end.append(ends[picked].astype(np.int64))
        self.hits += len(at)
        self.path.append(np.full(len(recs), self.paths.setdefault(path, len(self.paths)), dtype=np.int64))
        self.row.append(rows.astype(np.int64) + base)
        self.rec.append(recs.astype(np.int64))
        self.doc.append(at + (len(self.doc_ids) << 32))
        self.doc_ids.append(doc_ids)

    def result(self, keys_of: dict[int, dict[tuple[str, int], list[int]]], num_eval_rows: int) -> dict[str, Any]:
        """The partition's share, arrays as little-endian int64 bytes:

        - ``paths`` and ``keys``: the training paths and the (eval dataset, n) pairs the
          arrays name by index;
        - ``rows``: its training rows with an overlap, (path index, row) pairs sorted, each
          with its doc id (its first hit's) in ``docs``;
        - ``recs``: the n-gram records of each row, sorted, row ``i``'s from
          ``rec_starts[i]`` to ``rec_starts[i + 1]`` (indices into this share's records);
        - ``codes``: what each record overlaps, sorted codes ``key * num_eval_rows + eval
          row``, record ``j``'s from ``code_starts[j]`` to ``code_starts[j + 1]``;
        - ``spans``: ``(path index, row, configured n, start, end)`` rows (:data:`SPAN_COLUMNS`):
          per training row and n, the union of the training offsets of its hits whose record
          overlaps at that n, merged where they overlap or touch.

        ``keys_of``: each hit record's eval rows by (eval dataset, configured n), as the
        reduce unit built them for its per-file stats (the first row of a text several rows
        have, for each dataset of its rows). Its size is that of the hits and the records,
        whatever the eval rows a record overlaps."""
        if not sum(len(r) for r in self.rec):
            return dict(_EMPTY)
        path, row, rec, doc = (np.concatenate(a) for a in (self.path, self.row, self.rec, self.doc))
        # each distinct record's (key, eval row) codes
        urec, rec_i = np.unique(rec, return_inverse=True)
        keys: dict[tuple[str, int], int] = {}
        lists = []
        for r in urec.tolist():
            codes = set()
            for key, evals in keys_of[r].items():
                base = keys.setdefault(key, len(keys)) * num_eval_rows
                codes.update([base + i for i in evals])
            lists.append(sorted(codes))
        count = np.array([len(c) for c in lists], dtype=np.int64)
        spans = self._spans(path, row, rec_i, [{n for (_, n), evals in keys_of[r].items() if evals}
                                              for r in urec.tolist()])
        # distinct (row, record) pairs; each row's first hit gives its doc id
        order = np.lexsort((rec_i, row, path))
        path, row, rec_i, doc = (a[order] for a in (path, row, rec_i, doc))
        pairs = run_starts(path, row, rec_i)
        firsts = run_starts(path, row)
        return {"paths": list(self.paths), "keys": [[ds, n] for ds, n in keys],
                "rows": np.stack([path[firsts], row[firsts]], axis=1).astype("<i8").tobytes(),
                "docs": [self.doc_ids[d >> 32][d & 0xFFFFFFFF] for d in doc[firsts].tolist()],
                "recs": i64_bytes(rec_i[pairs]),
                "rec_starts": i64_bytes(np.append(np.searchsorted(pairs, firsts), len(pairs))),
                "codes": i64_bytes(np.fromiter((c for codes in lists for c in codes), np.int64, int(count.sum()))),
                "code_starts": i64_bytes(np.append(0, np.cumsum(count))), "spans": spans}

    def _spans(self, path: np.ndarray, row: np.ndarray, rec_i: np.ndarray, rec_ns: list[set[int]]) -> bytes:
        """The share's ``spans`` (see :meth:`result`) from the hits' ``path``, ``row`` and
        distinct record ``rec_i`` (in the order added) and each distinct record's n."""
        if not self.occ_hit:
            return b""
        hit = np.concatenate(self.occ_hit)
        start, end = np.concatenate(self.occ_start), np.concatenate(self.occ_end)
        ns = sorted(set().union(*rec_ns))
        if not ns:
            return b""
        has = np.zeros((len(rec_ns), len(ns)), dtype=bool)
        for i, r_ns in enumerate(rec_ns):
            has[i, [ns.index(n) for n in r_ns]] = True
        occ_rec = rec_i[hit]
        cols: list[list[np.ndarray]] = [[], [], [], [], []]
        for j, n in enumerate(ns):
            sel = np.flatnonzero(has[occ_rec, j])
            for c, values in zip(cols, (path[hit[sel]], row[hit[sel]], np.full(len(sel), n, dtype=np.int64),
                                        start[sel], end[sel])):
                c.append(values)
        (p, r, n_col), s, e = merged_spans([np.concatenate(c) for c in cols[:3]], np.concatenate(cols[3]),
                                           np.concatenate(cols[4]))
        return np.stack([p, r, n_col, s, e], axis=1).astype("<i8").tobytes()


DROP_LIST_VERSION = 4  # 2: a line names the row and its n only; 3: the spans file beside it; 4: max_coverage


def coverage_text(value: float) -> str:
    """A coverage as the drop list writes it: ``json.dumps`` of the float (its shortest repr)."""
    return json.dumps(float(value))


@dataclass
class DropList:
    """``stats/contaminated_train_docs.jsonl`` from the partitions' shares
    (:meth:`RowHits.result`, in partition order) of a run over ``eval_rows``: what prep
    needs to leave a row out, and no more (the eval instances a row overlaps are in decon's
    details and ``overlap_instances.jsonl.gz``, never repeated per training row, so a line's
    size does not grow with the eval rows that share an n-gram). ``coverage``: each eval row's
    coverage (HELM's token metric, on the first row of a shared text) at each configured n
    (a column per n of ``coverage_ns``, ascending: :func:`.reduce.coverage_table`), of which a
    line names, per n, the largest among the instances the row overlaps at n; without it, 0."""

    parts: list[dict[str, Any]]
    eval_rows: list[EvalRow]
    same: SameText
    coverage: np.ndarray | None = None
    coverage_ns: tuple[int, ...] = ()

    def chunks(self, lines_at_once: int | None = None) -> Iterator[bytes]:
        """The drop list's bytes, ``lines_at_once`` (default :data:`LINES_AT_ONCE`) lines at a
        time: one JSON line per training row with an overlap, sorted by path and row:
        ``train_path``, ``train_row``, ``train_doc_id`` (from the first partition that lists
        the row), ``ns`` (the n it overlaps at, ascending) and ``max_coverage`` (per n of
        ``ns``, the largest coverage at that n of the instances the row overlaps there): the
        bytes :func:`~refinery.transforms.io.jsonl.jsonl` writes for those dicts. The work is on
        each share's records (what n each overlaps, the largest coverage of its eval rows
        there), never on (training row, eval instance) pairs: a row's n are those of its
        records."""
        lines_at_once = LINES_AT_ONCE if lines_at_once is None else lines_at_once
        e = max(1, len(self.eval_rows))
        used = [part for part in self.parts if part.get("paths")]
        if not used:
            return
        n_list = sorted({int(n) for part in used for _, n in part["keys"]})
        n_index = {n: i for i, n in enumerate(n_list)}
        paths: dict[str, int] = {}
        row_parts, masks, covers = [], [], []
        for part in used:
            pmap = np.array([paths.setdefault(p, len(paths)) for p in part["paths"]], dtype=np.int64)
            key_n = np.array([n_index[int(n)] for _, n in part["keys"]] or [0], dtype=np.int64)
            rows = i64(part["rows"]).reshape(-1, 2).copy()
            rows[:, 0] = pmap[rows[:, 0]]
            rec_starts, recs = i64(part["rec_starts"]), i64(part["recs"])
            code_starts, codes = i64(part["code_starts"]), i64(part["codes"])
            # which n each record overlaps at, then each row's: those of its records
            has = np.zeros((len(code_starts) - 1, len(n_list)), dtype=np.int64)
            np.add.at(has, (np.repeat(np.arange(len(code_starts) - 1), np.diff(code_starts)), key_n[codes // e]), 1)
            best = self._record_coverage(codes, code_starts, key_n, n_list, e)
            per_pair = has[recs]
            mask = np.zeros((len(rows), len(n_list)), dtype=bool)
            cover = np.zeros((len(rows), len(n_list)), dtype=np.float64)
            filled = np.flatnonzero(np.diff(rec_starts) > 0)
            if len(filled):
                mask[filled] = np.add.reduceat(per_pair, rec_starts[filled], axis=0) > 0
                cover[filled] = np.maximum.reduceat(best[recs], rec_starts[filled], axis=0)
            row_parts.append(rows)
            masks.append(mask)
            covers.append(cover)
        docs = [d for part in used for d in part["docs"]]
        rows, mask, cover = np.concatenate(row_parts), np.concatenate(masks), np.concatenate(covers)
        names = list(paths)
        path_rank = np.argsort(np.argsort(np.array(names, dtype=object)))
        # by path and row (a stable sort: a row's first is its first partition's); a row's n: any partition's
        order = np.lexsort((rows[:, 1], path_rank[rows[:, 0]]))
        starts = run_starts(path_rank[rows[order, 0]], rows[order, 1])
        row_ns = np.logical_or.reduceat(mask[order], starts, axis=0) if len(starts) else mask[:0]
        row_cover = np.maximum.reduceat(cover[order], starts, axis=0) if len(starts) else cover[:0]
        firsts = order[starts]
        keep = np.flatnonzero(row_ns.any(axis=1))  # a row whose records overlap nothing has no line
        quoted = [_quote(p) for p in names]
        for a in range(0, len(keep), max(1, lines_at_once)):
            out = []
            for k in keep[a:a + lines_at_once].tolist():
                i = int(firsts[k])
                at = np.flatnonzero(row_ns[k]).tolist()
                ns = ", ".join(str(n_list[j]) for j in at)
                covered = ", ".join(coverage_text(row_cover[k, j]) for j in at)
                out.append(f'{{"train_path": {quoted[int(rows[i, 0])]}, "train_row": {int(rows[i, 1])}, '
                           f'"train_doc_id": {_quote(docs[i])}, "ns": [{ns}], "max_coverage": [{covered}]}}\n')
            yield "".join(out).encode("utf-8", JSON_ERRORS)

    def _record_coverage(self, codes: np.ndarray, code_starts: np.ndarray, key_n: np.ndarray, n_list: list[int],
                         e: int) -> np.ndarray:
        """Per record of a share (its ``codes`` from ``code_starts``) and n of ``n_list``: the
        largest coverage at that n of the eval rows it overlaps there (0 where it overlaps none,
        or without :attr:`coverage`)."""
        best = np.zeros((len(code_starts) - 1, len(n_list)), dtype=np.float64)
        if self.coverage is None or not len(codes):
            return best
        col = key_n[codes // e]
        table_col = np.array([self.coverage_ns.index(n) for n in n_list], dtype=np.int64)
        rec_of = np.repeat(np.arange(len(code_starts) - 1), np.diff(code_starts))
        np.maximum.at(best, (rec_of, col), self.coverage[codes % e, table_col[col]])
        return best

    def span_chunks(self, lines_at_once: int | None = None) -> Iterator[bytes]:
        """``stats/contaminated_train_spans.jsonl``'s bytes, ``lines_at_once`` lines at a time:
        one JSON line per (training row, configured n) with an overlap, sorted by path, row and
        n: ``train_path``, ``train_row``, ``n`` and ``spans`` (``[[start, end], ...]``, the
        union over every partition of the training offsets of the row's n-grams that overlap
        at n, merged where they overlap or touch). Its (path, row, n) are the drop list's."""
        lines_at_once = LINES_AT_ONCE if lines_at_once is None else lines_at_once
        used = [part for part in self.parts if part.get("spans")]
        if not used:
            return
        paths: dict[str, int] = {}
        blocks = []
        for part in used:
            pmap = np.array([paths.setdefault(p, len(paths)) for p in part["paths"]], dtype=np.int64)
            block = i64(part["spans"]).reshape(-1, SPAN_COLUMNS).copy()
            block[:, 0] = pmap[block[:, 0]]
            blocks.append(block)
        spans = np.concatenate(blocks)
        names = list(paths)
        rank = np.argsort(np.argsort(np.array(names, dtype=object)))
        (p, r, n), s, e = merged_spans([rank[spans[:, 0]], spans[:, 1], spans[:, 2]], spans[:, 3], spans[:, 4])
        by_rank = np.empty(len(names), dtype=np.int64)
        by_rank[rank] = np.arange(len(names))
        quoted = [_quote(names[i]) for i in by_rank.tolist()]  # by rank
        pairs = np.char.add(np.char.add(np.char.add("[", s.astype(str)), np.char.add(", ", e.astype(str))), "]")
        starts = run_starts(p, r, n)
        ends = np.append(starts[1:], len(s))
        for a in range(0, len(starts), max(1, lines_at_once)):
            out = []
            for k in range(a, min(a + lines_at_once, len(starts))):
                i, j = int(starts[k]), int(ends[k])
                out.append(f'{{"train_path": {quoted[int(p[i])]}, "train_row": {int(r[i])}, "n": {int(n[i])}, '
                           f'"spans": [{", ".join(pairs[i:j].tolist())}]}}\n')
            yield "".join(out).encode("utf-8", JSON_ERRORS)
