"""The drop list: which training rows overlap which eval instances, at which n.

A reduce unit sees its partition's hits as blocks of (training row, n-gram record) pairs;
:class:`RowHits` keeps them as arrays while the blocks stream by, and :meth:`RowHits.result`
turns them into the partition's share (msgpack-able: arrays as bytes). The run's merge joins
the partitions' shares (:func:`contaminated_jsonl`): one line per training row with an
overlap, for ``stats/contaminated_train_docs.jsonl``. The work is done on numpy arrays of
(training row, eval dataset and n, eval row) codes, never per hit in Python: a hit-dense
corpus has millions of hits.
"""
from __future__ import annotations

import json
from typing import Iterable

import numpy as np

from refinery.transforms.core.jsonl import JSON_ERRORS

from .index import EvalRow


def _quote(s: str) -> str:
    """A JSON string as ``json.dumps(s, ensure_ascii=False)`` writes it."""
    return json.dumps(s, ensure_ascii=False)


_EMPTY = {"paths": [], "keys": [], "rows": b"", "docs": [], "codes": b"", "starts": b""}


def _distinct(*columns: np.ndarray) -> np.ndarray:
    """Positions of the first of each run of equal tuples in ``columns`` (already sorted)."""
    change = np.zeros(len(columns[0]), dtype=bool)
    change[0] = True
    for c in columns:
        change[1:] |= c[1:] != c[:-1]
    return np.flatnonzero(change)


class RowHits:
    """The (training row, n-gram record) of every counted hit of one reduce unit, in arrays."""

    def __init__(self) -> None:
        self.paths: dict[str, int] = {}
        self.path: list[np.ndarray] = []
        self.row: list[np.ndarray] = []
        self.rec: list[np.ndarray] = []
        self.doc: list[np.ndarray] = []   # (block, position in block) of each hit: its doc id
        self.doc_ids: list[list[str]] = []

    def add(self, path: str, base: int, rows: np.ndarray, recs: np.ndarray, doc_ids: list[str],
            keep: np.ndarray | None = None) -> None:
        """One block's hits: ``rows`` (numbered from ``base``), ``recs`` and the rows' doc ids;
        ``keep``: the hits that count (n-grams over ``--max-train-count`` do not)."""
        at = np.arange(len(recs), dtype=np.int64)
        if keep is not None:
            rows, recs, at = rows[keep], recs[keep], at[keep]
        self.path.append(np.full(len(recs), self.paths.setdefault(path, len(self.paths)), dtype=np.int64))
        self.row.append(rows.astype(np.int64) + base)
        self.rec.append(recs.astype(np.int64))
        self.doc.append(at + (len(self.doc_ids) << 32))
        self.doc_ids.append(doc_ids)

    def result(self, keys_of: dict[int, dict[tuple[str, int], list[int]]], num_eval_rows: int) -> dict:
        """The partition's share: its rows with an overlap (path index, row), each row's doc id,
        and per row the sorted codes ``key * num_eval_rows + eval row`` (key: an index into
        ``keys``, the (eval dataset, n) pairs), as arrays of little-endian int64. ``keys_of``:
        each hit record's eval rows by (eval dataset, configured n), as the reduce unit built
        them for its per-file stats."""
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
        flat = np.array([c for codes in lists for c in codes], dtype=np.int64)
        start = np.cumsum(count) - count
        # distinct (row, record) pairs; each row's first hit gives its doc id
        rowkey = path * (int(row.max()) + 1) + row
        order = np.lexsort((rec_i, rowkey))
        rowkey, rec_i, path, row, doc = (a[order] for a in (rowkey, rec_i, path, row, doc))
        pairs = _distinct(rowkey, rec_i)
        firsts = _distinct(rowkey)
        # every (row, code), distinct and sorted
        n_codes = count[rec_i[pairs]]
        hit_row = np.repeat(rowkey[pairs], n_codes)
        within = np.arange(int(n_codes.sum()), dtype=np.int64) - np.repeat(np.cumsum(n_codes) - n_codes, n_codes)
        codes = flat[np.repeat(start[rec_i[pairs]], n_codes) + within]
        order = np.lexsort((codes, hit_row))
        hit_row, codes = hit_row[order], codes[order]
        keep = _distinct(hit_row, codes)
        hit_row, codes = hit_row[keep], codes[keep]
        starts = np.append(_distinct(hit_row), len(codes))
        return {"paths": list(self.paths), "keys": [[ds, n] for ds, n in keys],
                "rows": np.stack([path[firsts], row[firsts]], axis=1).astype("<i8").tobytes(),
                "docs": [self.doc_ids[d >> 32][d & 0xFFFFFFFF] for d in doc[firsts].tolist()],
                "codes": codes.astype("<i8").tobytes(), "starts": starts.astype("<i8").tobytes()}


def contaminated_jsonl(parts: Iterable[dict], eval_rows: list[EvalRow]) -> bytes:
    """``stats/contaminated_train_docs.jsonl`` from the partitions' shares
    (:meth:`RowHits.result`): one JSON line per training row with an overlap, sorted by path
    and row: ``train_path``, ``train_row``, ``train_doc_id``, ``ns`` (the n it overlaps at)
    and ``overlaps`` (per eval dataset and n, in that order, the sorted distinct instance
    ids). The bytes :func:`~refinery.transforms.core.jsonl.jsonl` writes for those dicts,
    built from pre-quoted strings (a hit-dense run lists millions of ids)."""
    e = len(eval_rows)
    ids, id_of = np.unique(np.array([r.instance_id for r in eval_rows] or [""], dtype=object), return_inverse=True)
    quoted = [_quote(i) for i in ids.tolist()]
    paths: dict[str, int] = {}
    keys: dict[tuple[str, int], int] = {}
    row_chunks, code_chunks, doc_rows, doc_ids = [], [], [], []
    for part in parts:
        if not part.get("paths"):
            continue
        pmap = np.array([paths.setdefault(p, len(paths)) for p in part["paths"]], dtype=np.int64)
        kmap = np.array([keys.setdefault((ds, int(n)), len(keys)) for ds, n in part["keys"]], dtype=np.int64)
        rows = np.frombuffer(part["rows"], dtype="<i8").reshape(-1, 2)
        rows = np.stack([pmap[rows[:, 0]], rows[:, 1]], axis=1)
        codes = np.frombuffer(part["codes"], dtype="<i8")
        row_chunks.append(np.repeat(rows, np.diff(np.frombuffer(part["starts"], dtype="<i8")), axis=0))
        code_chunks.append(np.stack([kmap[codes // e], id_of[codes % e]], axis=1))
        doc_rows.append(rows)
        doc_ids += part["docs"]
    if not row_chunks:
        return b""
    names, key_list = list(paths), list(keys)
    path_rank = np.argsort(np.argsort(np.array(names, dtype=object)))
    key_rank = np.argsort(np.argsort(np.array([f"{ds}\0{n:012d}" for ds, n in key_list], dtype=object)))
    rows, codes = np.concatenate(row_chunks), np.concatenate(code_chunks)
    order = np.lexsort((codes[:, 1], key_rank[codes[:, 0]], rows[:, 1], path_rank[rows[:, 0]]))
    rows, codes = rows[order], codes[order]
    keep = _distinct(rows[:, 0], rows[:, 1], codes[:, 0], codes[:, 1])
    rows, codes = rows[keep], codes[keep]
    row_starts = _distinct(rows[:, 0], rows[:, 1])
    group_starts = _distinct(rows[:, 0], rows[:, 1], codes[:, 0])  # one per (row, eval dataset and n)
    # each distinct row's doc id: from the first partition that listed it
    all_rows = np.concatenate(doc_rows)
    width = int(max(all_rows[:, 1].max(), rows[:, 1].max())) + 1
    listed, first = np.unique(all_rows[:, 0] * width + all_rows[:, 1], return_index=True)
    doc_of = first[np.searchsorted(listed, rows[row_starts, 0] * width + rows[row_starts, 1])].tolist()
    # one string per (row, eval dataset and n) group, then one line per row
    heads = [f'{{"eval_dataset": {_quote(ds)}, "n": {n}, "instance_ids": [' for ds, n in key_list]
    id_list = codes[:, 1].tolist()
    group_key = codes[group_starts, 0].tolist()
    g_bounds = np.append(group_starts, len(codes)).tolist()
    groups = [heads[k] + ", ".join([quoted[i] for i in id_list[s:t]]) + "]}"
              for k, s, t in zip(group_key, g_bounds[:-1], g_bounds[1:])]
    row_groups = np.append(np.searchsorted(group_starts, row_starts), len(group_starts)).tolist()
    n_of = [n for _, n in key_list]
    quoted_names = [_quote(p) for p in names]
    out: list[str] = []
    for k, (a, b) in enumerate(zip(row_groups[:-1], row_groups[1:])):
        s = int(row_starts[k])
        p, r = int(rows[s, 0]), int(rows[s, 1])
        ns = sorted({n_of[key] for key in group_key[a:b]})
        out.append(f'{{"train_path": {quoted_names[p]}, "train_row": {r}, '
                   f'"train_doc_id": {_quote(doc_ids[doc_of[k]])}, "ns": [{", ".join(map(str, ns))}], '
                   f'"overlaps": [{", ".join(groups[a:b])}]}}\n')
    return "".join(out).encode("utf-8", JSON_ERRORS)
