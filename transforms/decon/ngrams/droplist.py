"""The drop list: which training rows overlap which eval instances, at which n.

A reduce unit sees its partition's hits as blocks of (training row, n-gram record) pairs;
:class:`RowHits` keeps them as arrays while the blocks stream by, and :meth:`RowHits.result`
turns them into the partition's share (msgpack-able: arrays as bytes): its training rows and
the n-gram records each holds, and once per record, what the record overlaps. The run's
merge joins the partitions' shares (:class:`DropList`): one line per training row with an
overlap, for ``stats/contaminated_train_docs.jsonl``, made a bounded number of (training
row, eval instance) pairs at a time (:data:`PAIRS_AT_ONCE`): what one training row overlaps
is expanded only while its line is made. Eval rows that share a text are listed once per
text (:class:`~.index.SameText`), by reference. The work is done on numpy arrays of
(training row, eval dataset and n, eval instance) codes, never per hit in Python: a
hit-dense corpus has millions of hits.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from refinery.transforms.core.jsonl import JSON_ERRORS

from .arrays import batches, i64, i64_bytes, ranges, run_starts
from .index import EvalRow, SameText

PAIRS_AT_ONCE = 1 << 16  # (training row, eval instance) pairs the drop list expands at once


def _quote(s: str) -> str:
    """A JSON string as ``json.dumps(s, ensure_ascii=False)`` writes it."""
    return json.dumps(s, ensure_ascii=False)


_EMPTY = {"paths": [], "keys": [], "rows": b"", "docs": [], "recs": b"", "rec_starts": b"", "codes": b"",
          "code_starts": b""}


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
        """The partition's share, arrays as little-endian int64 bytes:

        - ``paths`` and ``keys``: the training paths and the (eval dataset, n) pairs the
          arrays name by index;
        - ``rows``: its training rows with an overlap, (path index, row) pairs sorted, each
          with its doc id (its first hit's) in ``docs``;
        - ``recs``: the n-gram records of each row, sorted, row ``i``'s from
          ``rec_starts[i]`` to ``rec_starts[i + 1]`` (indices into this share's records);
        - ``codes``: what each record overlaps, sorted codes ``key * num_eval_rows + eval
          row``, record ``j``'s from ``code_starts[j]`` to ``code_starts[j + 1]``.

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
                "code_starts": i64_bytes(np.append(0, np.cumsum(count)))}


@dataclass
class DropList:
    """``stats/contaminated_train_docs.jsonl`` from the partitions' shares
    (:meth:`RowHits.result`, in partition order) of a run over ``eval_rows``."""

    parts: list[dict]
    eval_rows: list[EvalRow]
    same: SameText

    def chunks(self, pairs_at_once: int | None = None) -> Iterator[bytes]:
        """The drop list's bytes, a few lines at a time: one JSON line per training row with an
        overlap, sorted by path and row: ``train_path``, ``train_row``, ``train_doc_id`` (from
        the first partition that lists the row), ``ns`` (the n it overlaps at) and
        ``overlaps`` (per eval dataset and n, in that order: ``instance_ids``, the sorted
        distinct instance ids of the eval rows whose text no other eval row has, and, only
        when it overlaps rows whose text other eval rows also have, ``same_text``: one
        ``{"eval_path", "eval_row", "rows"}`` per such text, in eval order: its first eval row
        (any dataset; its line in ``overlap_instances.jsonl.gz`` lists every row of that
        text) and how many rows of this dataset have it). The bytes
        :func:`~refinery.transforms.core.jsonl.jsonl` writes for those dicts, built from
        pre-quoted strings (a hit-dense run lists millions of ids), each chunk from at most
        about ``pairs_at_once`` (default :data:`PAIRS_AT_ONCE`) (training row, instance)
        pairs (more only for one row that has more)."""
        pairs_at_once = PAIRS_AT_ONCE if pairs_at_once is None else pairs_at_once
        eval_rows, same = self.eval_rows, self.same
        e = len(eval_rows)
        ids, id_of = np.unique(np.array([r.instance_id for r in eval_rows] or [""], dtype=object),
                               return_inverse=True)
        quoted = [_quote(i) for i in ids.tolist()]
        # each first row's member: its instance id's rank, or past them, its text's (eval order)
        texts = sorted(same.others)
        member = id_of.reshape(-1).astype(np.int64)
        member[np.array(texts, dtype=np.int64)] = len(ids) + np.arange(len(texts), dtype=np.int64)
        width = len(ids) + len(texts)
        used = [part for part in self.parts if part.get("paths")]
        if not used:
            return
        paths: dict[str, int] = {}
        keys: dict[tuple[str, int], int] = {}
        pmaps = [np.array([paths.setdefault(p, len(paths)) for p in part["paths"]], dtype=np.int64) for part in used]
        kmaps = [np.array([keys.setdefault((ds, int(n)), len(keys)) for ds, n in part["keys"]], dtype=np.int64)
                 for part in used]
        # every partition's arrays in one, copied once from the shares' bytes, then renumbered in place
        end = [np.zeros(1, dtype=np.int64)]
        rows = np.concatenate([i64(part["rows"]).reshape(-1, 2) for part in used])
        rec_starts = np.concatenate([i64(part["rec_starts"])[:-1] for part in used] + end)
        recs = np.concatenate([i64(part["recs"]) for part in used])
        code_starts = np.concatenate([i64(part["code_starts"])[:-1] for part in used] + end)
        codes = np.concatenate([i64(part["codes"]) for part in used])
        r = q = c = k = 0  # rows, (row, record) pairs, records and codes of the partitions before
        for part, pmap, kmap in zip(used, pmaps, kmaps):
            n_rows, n_pairs, n_codes = len(part["rows"]) // 16, len(part["recs"]) // 8, len(part["codes"]) // 8
            n_recs = len(part["code_starts"]) // 8 - 1
            rows[r:r + n_rows, 0] = pmap[rows[r:r + n_rows, 0]]
            rec_starts[r:r + n_rows] += q
            recs[q:q + n_pairs] += c
            code_starts[c:c + n_recs] += k
            got = codes[k:k + n_codes]
            codes[k:k + n_codes] = kmap[got // e] * width + member[got % e]
            r, q, c, k = r + n_rows, q + n_pairs, c + n_recs, k + n_codes
        rec_starts[-1], code_starts[-1] = q, k
        docs = [d for part in used for d in part["docs"]]
        names, key_list = list(paths), list(keys)
        path_rank = np.argsort(np.argsort(np.array(names, dtype=object)))
        key_order = np.argsort(np.array([f"{ds}\0{n:012d}" for ds, n in key_list], dtype=object))
        key_rank = np.argsort(key_order)
        key_list = [key_list[k] for k in key_order.tolist()]  # by rank from here on
        codes = key_rank[codes // width] * width + codes % width
        # the partitions' rows by path and row (a stable sort: a row's first is its first partition's)
        order = np.lexsort((rows[:, 1], path_rank[rows[:, 0]]))
        row_starts = np.append(run_starts(path_rank[rows[order, 0]], rows[order, 1]), len(order))
        # (row, instance) pairs of each of them, before duplicates are dropped
        pair_codes = np.append(0, np.cumsum(np.diff(code_starts)[recs]))
        before = np.append(0, np.cumsum((pair_codes[rec_starts[1:]] - pair_codes[rec_starts[:-1]])[order]))
        at = before[row_starts]
        del pair_codes, before
        lines = _Lines(names, key_list, quoted, texts, len(ids), eval_rows, same)
        for a, b in batches(at, pairs_at_once):
            chosen = order[row_starts[a]:row_starts[b]]
            label = np.repeat(np.arange(b - a, dtype=np.int64), np.diff(row_starts[a:b + 1]))
            pair = ranges(rec_starts[chosen], rec_starts[chosen + 1])
            label = np.repeat(label, rec_starts[chosen + 1] - rec_starts[chosen])
            rec = recs[pair]
            got = codes[ranges(code_starts[rec], code_starts[rec + 1])]
            label = np.repeat(label, code_starts[rec + 1] - code_starts[rec])
            firsts = chosen[row_starts[a:b] - row_starts[a]]
            yield lines.render(rows[firsts], [docs[i] for i in firsts.tolist()], label, got, width)


class _Lines:
    """The drop list's JSON lines, from sorted (row, eval dataset and n, member) codes."""

    def __init__(self, names: list[str], key_list: list[tuple[str, int]], quoted: list[str], texts: list[int],
                 num_ids: int, eval_rows: list[EvalRow], same: SameText):
        self.names = [_quote(p) for p in names]
        self.heads = [f'{{"eval_dataset": {_quote(ds)}, "n": {n}, "instance_ids": [' for ds, n in key_list]
        self.key_ds = [ds for ds, _ in key_list]
        self.n_of = [n for _, n in key_list]
        self.quoted, self.texts, self.num_ids = quoted, texts, num_ids
        self.eval_rows, self.same = eval_rows, same
        self.refs: dict[tuple[int, str], str] = {}

    def ref(self, text: int, ds: str) -> str:
        """``{"eval_path", "eval_row", "rows"}`` of shared text ``text`` in dataset ``ds``."""
        got = self.refs.get((text, ds))
        if got is None:
            first = self.eval_rows[self.texts[text]]
            rows = sum(1 for j in self.same.rows_of(first.eval_idx) if self.eval_rows[j].eval_dataset == ds)
            got = self.refs[(text, ds)] = (f'{{"eval_path": {_quote(first.eval_path)}, "eval_row": {first.eval_row}, '
                                           f'"rows": {rows}}}')
        return got

    def render(self, rows: np.ndarray, docs: list[str], label: np.ndarray, codes: np.ndarray, width: int) -> bytes:
        """The UTF-8 lines of ``rows`` ((path index, row), each with its doc id), from
        ``label[i]``, the index in ``rows`` of the row of ``codes[i]`` (``key rank * width +
        member``), in any order, duplicates included."""
        if not len(codes):
            return b""
        order = np.lexsort((codes, label))
        label, codes = label[order], codes[order]
        keep = run_starts(label, codes)
        label, codes = label[keep], codes[keep]
        key, member = codes // width, codes % width
        row_starts = run_starts(label)
        rows_at = label[row_starts].tolist()  # a row whose records overlap nothing has no line
        group_starts = run_starts(label, key)  # one per (row, eval dataset and n)
        ids_in = np.add.reduceat((member < self.num_ids).astype(np.int64), group_starts)
        members = member.tolist()
        group_key = key[group_starts].tolist()
        bounds = np.append(group_starts, len(codes)).tolist()
        quoted, heads, num_ids = self.quoted, self.heads, self.num_ids
        groups = []
        for k, s, m, t in zip(group_key, bounds[:-1], ids_in.tolist(), bounds[1:]):
            group = heads[k] + ", ".join([quoted[i] for i in members[s:s + m]]) + "]"
            if m < t - s:
                ds = self.key_ds[k]
                group += ', "same_text": [' + ", ".join([self.ref(i - num_ids, ds) for i in members[s + m:t]]) + "]"
            groups.append(group + "}")
        row_groups = np.append(np.searchsorted(group_starts, row_starts), len(group_starts)).tolist()
        out: list[str] = []
        for k, a, b in zip(rows_at, row_groups[:-1], row_groups[1:]):
            p, r = int(rows[k, 0]), int(rows[k, 1])
            ns = sorted({self.n_of[key] for key in group_key[a:b]})
            out.append(f'{{"train_path": {self.names[p]}, "train_row": {r}, '
                       f'"train_doc_id": {_quote(docs[k])}, "ns": [{", ".join(map(str, ns))}], '
                       f'"overlaps": [{", ".join(groups[a:b])}]}}\n')
        return "".join(out).encode("utf-8", JSON_ERRORS)

