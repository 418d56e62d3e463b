"""The training-row side of the results, merged a window of training rows at a time.

Each reduce unit's drop-list share (:meth:`.droplist.RowHits.result`: its training rows, their
n-gram records, what each record overlaps, the rows' spans) and its records' eval windows
(:func:`.longest.record_windows`) are written as one column file (:func:`encode_row_share`):
the rows sorted by training path (by name) and row, each with its doc id, its records and its
spans; then, once per record, its codes and eval windows (with their token positions, so the
merge tokenizes nothing). The merge (:func:`merge_train_rows`) reads every partition's file a
window at a time: the next rows in (path, row) order, at most ``rows_at_once`` of each
partition, all of every row the window holds (a row's entries of every partition come
together). Each window becomes small shares in :meth:`.droplist.RowHits.result`'s form that
hold only its rows, records and keys, and the drop list, its spans, the longest matches and
the per-path row counts are made from them: a window's lines are the whole run's lines for
its rows, in the same order, so the outputs are the bytes of one merge of whole shares. The
merge holds one window of rows and, per partition, its records' columns (the eval side),
never one object per contaminated training row of the run.
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from refinery.transforms.io import storage

from .arrays import i64, i64_bytes, ranges, run_starts
from .droplist import SPAN_COLUMNS, DropList
from .index import EvalRow, SameText
from .longest import longest_matches, token_positions
from .word_split import WordSplitter

MAGIC = b"refinery-row-share/1\n"
ROW_BITS = 40                       # a key is (path index << ROW_BITS) | row
ROW_MASK = (1 << ROW_BITS) - 1
ROWS_AT_ONCE = 2048                 # rows of each partition in one window of the merge
_ROW_ARRAYS = ("key", "doc_at", "rec_starts", "recs", "span_at", "spans")
_RECORD_ARRAYS = ("code_starts", "codes", "win_lens", "win_starts", "win_evals", "win_toks")


def encode_row_share(rows: dict[str, Any], windows: dict[str, Any], eval_rows: list[EvalRow],
                     tokenizer: WordSplitter) -> bytes:
    """One reduce unit's row-share file from its drop-list share ``rows`` and its records' eval
    ``windows`` (whose character starts become token positions of ``eval_rows``)."""
    names = list(rows.get("paths", []))
    order_of_names = sorted(range(len(names)), key=names.__getitem__)
    new_index = np.empty(len(names), dtype=np.int64)
    new_index[order_of_names] = np.arange(len(names), dtype=np.int64)
    got = i64(rows.get("rows", b"")).reshape(-1, 2)
    if len(got) and int(got[:, 1].max()) > ROW_MASK:
        raise ValueError(f"a training row past row {ROW_MASK:,}: too many rows in one file for the drop list")
    key = (new_index[got[:, 0]] << ROW_BITS) | got[:, 1] if len(got) else np.zeros(0, dtype=np.int64)
    order = np.argsort(key, kind="stable")
    key = key[order]
    docs = [rows["docs"][i] for i in order.tolist()]
    encoded = [d.encode("utf-8", "surrogatepass") for d in docs]
    doc_at = np.append(0, np.cumsum([len(d) for d in encoded], dtype=np.int64)).astype(np.int64)
    rec_starts = i64(rows.get("rec_starts", i64_bytes([0])))
    recs = i64(rows.get("recs", b""))
    picked = ranges(rec_starts[:-1][order], rec_starts[1:][order])
    new_rec_starts = np.append(0, np.cumsum(np.diff(rec_starts)[order])).astype(np.int64)
    spans = i64(rows.get("spans", b"")).reshape(-1, SPAN_COLUMNS)
    span_key = (new_index[spans[:, 0]] << ROW_BITS) | spans[:, 1] if len(spans) else np.zeros(0, dtype=np.int64)
    span_order = np.lexsort((spans[:, 3], spans[:, 2], span_key)) if len(spans) else np.zeros(0, dtype=np.int64)
    spans = spans[span_order]
    span_key = span_key[span_order]
    span_at = np.searchsorted(span_key, np.append(key, np.iinfo(np.int64).max)).astype(np.int64)
    if int(span_at[-1]) != len(span_key):
        raise ValueError("a reduce unit's spans name a training row its share does not list")
    starts = i64(windows.get("starts", i64_bytes([0])))
    evals, chars = i64(windows.get("evals", b"")), i64(windows.get("chars", b""))
    arrays: dict[str, bytes] = {
        "key": i64_bytes(key), "doc_at": i64_bytes(doc_at), "docs": b"".join(encoded),
        "rec_starts": i64_bytes(new_rec_starts), "recs": i64_bytes(recs[picked]), "span_at": i64_bytes(span_at),
        "spans": i64_bytes(spans[:, 2:].reshape(-1)),  # n, start, end per span (the row is its key's)
        "code_starts": rows.get("code_starts", i64_bytes([0])), "codes": rows.get("codes", b""),
        "win_lens": windows.get("lens", b""), "win_starts": i64_bytes(starts), "win_evals": i64_bytes(evals),
        "win_toks": i64_bytes(token_positions(eval_rows, evals, chars, tokenizer)),
    }
    table, at = {}, 0
    for name, data in arrays.items():
        table[name] = [at, len(data)]
        at += len(data)
    header = json.dumps({"paths": [names[i] for i in order_of_names], "keys": rows.get("keys", []),
                         "rows": len(key), "arrays": table}).encode()
    return MAGIC + len(header).to_bytes(8, "little") + header + b"".join(arrays.values())


Read = Callable[[int, int], bytes]  # bytes [start, end) of a row-share file


def bytes_reader(data: bytes) -> Read:
    """A :data:`Read` of a file held in memory."""
    def read(start: int, end: int) -> bytes:
        return data[start:end]

    return read


def file_reader(path: str) -> Read:
    """A :data:`Read` of the file at ``path`` (local or remote): a ranged read each call."""
    def read(start: int, end: int) -> bytes:
        return storage.read_range(path, start, end)

    return read


class RowShare:
    """One partition's row-share file (:func:`encode_row_share`), read through ``read``: its
    header and its records' columns at once, its rows a range at a time."""

    def __init__(self, read: Read, where: str):
        self._read, self.where = read, where
        head = read(0, len(MAGIC) + 8)
        if head[:len(MAGIC)] != MAGIC:
            raise ValueError(f"{where}: not a row-share file of this version")
        size = int.from_bytes(head[len(MAGIC):], "little")
        header = json.loads(read(len(MAGIC) + 8, len(MAGIC) + 8 + size))
        self.base = len(MAGIC) + 8 + size
        self.paths: list[str] = header["paths"]
        self.keys: list[tuple[str, int]] = [(ds, int(n)) for ds, n in header["keys"]]
        self.rows: int = header["rows"]
        self._table: dict[str, list[int]] = header["arrays"]
        self.code_starts, self.codes, self.win_lens, self.win_starts, self.win_evals, self.win_toks = (
            self.ints(name) for name in _RECORD_ARRAYS)

    def raw(self, name: str, lo: int = 0, hi: int | None = None) -> bytes:
        """Bytes ``[lo, hi)`` of column ``name``."""
        at, size = self._table[name]
        hi = size if hi is None else hi
        return self._read(self.base + at + lo, self.base + at + hi) if hi > lo else b""

    def ints(self, name: str, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Values ``[lo, hi)`` of int64 column ``name``."""
        return i64(self.raw(name, 8 * lo, None if hi is None else 8 * hi))


@dataclass
class TrainRowTotals:
    """What the merge of the row shares gives the rest of the merge."""

    longest: np.ndarray                                  # :func:`.longest.longest_matches`
    rows_by_path: dict[tuple[str, str, int], int]        # (training path, eval dataset, n) -> rows overlapping
    rows_at_n: dict[int, int]                            # configured n -> training rows overlapping at it
    drop_list: bytes | None = None                       # the drop list and its spans, when kept in memory
    spans: bytes | None = None
    windows: int = 0                                     # windows merged
    largest_window: int = 0                              # the most (row, partition) entries one held

    def chunks(self) -> list[bytes]:
        return [self.drop_list] if self.drop_list else []

    def span_chunks(self) -> list[bytes]:
        return [self.spans] if self.spans else []


@dataclass
class _Cursor:
    share: RowShare
    to_global: np.ndarray    # the share's path index -> the run's (by name)
    at: int = 0
    ahead: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # global keys from ``at``

    def fill(self, count: int) -> None:
        if len(self.ahead) < min(count, self.share.rows - self.at):
            local = self.share.ints("key", self.at, min(self.share.rows, self.at + count))
            self.ahead = (self.to_global[local >> ROW_BITS] << ROW_BITS) | (local & ROW_MASK)


def merge_train_rows(shares: list[RowShare], eval_rows: list[EvalRow], same: SameText, ns: list[int],
                     tokenizer: WordSplitter, drop_out: Callable[[bytes], Any], spans_out: Callable[[bytes], Any],
                     rows_at_once: int | None = None, coverage: np.ndarray | None = None) -> TrainRowTotals:
    """The drop list (to ``drop_out``), its spans (to ``spans_out``), the longest matches and
    the per-path row counts of every partition's row share (in partition order), a window of
    at most ``rows_at_once`` (default :data:`ROWS_AT_ONCE`) rows of each partition at a time
    (see the module). ``coverage``: each eval row's coverage per configured n
    (:func:`.reduce.coverage_table`), whose largest per row and n the drop list names."""
    rows_at_once = ROWS_AT_ONCE if rows_at_once is None else rows_at_once
    ns = sorted(set(ns))
    names = sorted(set().union(*(s.paths for s in shares))) if shares else []
    rank = {p: i for i, p in enumerate(names)}
    cursors = [_Cursor(s, np.array([rank[p] for p in s.paths] or [0], dtype=np.int64)) for s in shares]
    best = np.zeros((len(eval_rows), len(ns)), dtype=np.int64)
    counts = _RowCounts(names, ns, eval_rows)
    windows = largest = 0
    while True:
        live = [c for c in cursors if c.at < c.share.rows]
        if not live:
            break
        for c in live:
            c.fill(rows_at_once)
        full = [int(c.ahead[rows_at_once - 1]) for c in live if len(c.ahead) >= rows_at_once]
        bound = min(full) + 1 if full else None
        subs = []
        for c in live:
            take = len(c.ahead) if bound is None else int(np.searchsorted(c.ahead, bound))
            if take:
                subs.append(_window_share(c.share, c.at, c.at + take, len(eval_rows)))
            c.at += take
            c.ahead = c.ahead[take:]
        windows += 1
        rows_part = [r for r, _ in subs]
        largest = max(largest, sum(len(r["docs"]) for r in rows_part))
        dl = DropList(rows_part, eval_rows, same, coverage, tuple(ns))
        for chunk in dl.chunks():
            drop_out(chunk)
        for chunk in dl.span_chunks():
            spans_out(chunk)
        longest_matches(subs, eval_rows, ns, tokenizer, best=best)
        counts.add(rows_part, rank)
    return TrainRowTotals(best, counts.by_path(), counts.at_n(), windows=windows, largest_window=largest)


def _window_share(share: RowShare, a: int, b: int, num_eval_rows: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Rows ``[a, b)`` of ``share`` as a (drop-list share, windows share) pair holding only
    their paths, records and keys (:meth:`.droplist.RowHits.result`, :func:`.longest.record_windows`)."""
    key = share.ints("key", a, b)
    local, row = key >> ROW_BITS, key & ROW_MASK
    paths, path_i = np.unique(local, return_inverse=True)
    doc_at = share.ints("doc_at", a, b + 1)
    data = share.raw("docs", int(doc_at[0]), int(doc_at[-1]))
    cuts = (doc_at - doc_at[0]).tolist()
    docs = [data[s:e].decode("utf-8", "surrogatepass") for s, e in zip(cuts, cuts[1:])]
    rec_starts = share.ints("rec_starts", a, b + 1)
    recs = share.ints("recs", int(rec_starts[0]), int(rec_starts[-1]))
    urec, rec_i = np.unique(recs, return_inverse=True)
    cs = share.code_starts
    codes = share.codes[ranges(cs[urec], cs[urec + 1])]
    e = max(1, num_eval_rows)
    ukey, key_i = np.unique(codes // e, return_inverse=True)
    codes = key_i.astype(np.int64) * num_eval_rows + codes % e
    span_at = share.ints("span_at", a, b + 1)
    span_cols = share.ints("spans", 3 * int(span_at[0]), 3 * int(span_at[-1])).reshape(-1, 3)
    span_row = np.repeat(np.arange(b - a, dtype=np.int64), np.diff(span_at))
    spans = np.column_stack([path_i[span_row], row[span_row], span_cols]) if len(span_row) else np.zeros((0, 5))
    ws = share.win_starts
    picked = ranges(ws[urec], ws[urec + 1])
    rows_share = {"paths": [share.paths[i] for i in paths.tolist()],
                  "keys": [list(share.keys[k]) for k in ukey.tolist()],
                  "rows": np.column_stack([path_i, row]).astype("<i8").tobytes(), "docs": docs,
                  "recs": i64_bytes(rec_i), "rec_starts": i64_bytes(rec_starts - rec_starts[0]),
                  "codes": i64_bytes(codes),
                  "code_starts": i64_bytes(np.append(0, np.cumsum(cs[urec + 1] - cs[urec]))),
                  "spans": spans.astype("<i8").tobytes()}
    win_share = {"lens": i64_bytes(share.win_lens[urec]),
                 "starts": i64_bytes(np.append(0, np.cumsum(ws[urec + 1] - ws[urec]))),
                 "evals": i64_bytes(share.win_evals[picked]), "toks": i64_bytes(share.win_toks[picked])}
    return rows_share, win_share


class _RowCounts:
    """The training rows overlapping per (path, eval dataset, n) and per n, a window at a time
    (a row's entries of every partition are in one window: it is counted once)."""

    def __init__(self, names: list[str], ns: list[int], eval_rows: list[EvalRow]):
        self.names, self.ns = names, ns
        self.keys: dict[tuple[str, int], int] = {}
        self.per_key: dict[tuple[int, int], int] = defaultdict(int)   # (path rank, key index) -> rows
        self.per_n: dict[int, int] = defaultdict(int)
        self.e = max(1, len(eval_rows))

    def add(self, parts: list[dict[str, Any]], rank: dict[str, int]) -> None:
        cols: list[list[np.ndarray]] = [[], [], []]
        for part in parts:
            gpath = np.array([rank[p] for p in part["paths"]] or [0], dtype=np.int64)
            gkey = np.array([self.keys.setdefault((ds, int(n)), len(self.keys)) for ds, n in part["keys"]] or [0],
                            dtype=np.int64)
            got = i64(part["rows"]).reshape(-1, 2)
            rec_starts, recs = i64(part["rec_starts"]), i64(part["recs"])
            code_starts, codes = i64(part["code_starts"]), i64(part["codes"])
            # each record's keys once (a record overlaps many eval rows of few keys), then each row's
            num_recs, num_keys = len(code_starts) - 1, max(1, len(part["keys"]))
            code_rec = np.repeat(np.arange(num_recs, dtype=np.int64), np.diff(code_starts))
            rec_key = np.unique(code_rec * num_keys + codes // self.e)
            key_at = np.searchsorted(rec_key // num_keys, np.arange(num_recs + 1, dtype=np.int64))
            pair_row = np.repeat(np.arange(len(got), dtype=np.int64), np.diff(rec_starts))
            picked = ranges(key_at[recs], key_at[recs + 1])
            key_row = np.repeat(pair_row, key_at[recs + 1] - key_at[recs])
            for c, values in zip(cols, (gpath[got[key_row, 0]], got[key_row, 1], gkey[rec_key[picked] % num_keys])):
                c.append(values)
        if not cols[0]:
            return
        path, row, key = (np.concatenate(c) for c in cols)
        if not len(path):
            return
        order = np.lexsort((row, path, key))
        path, row, key = path[order], row[order], key[order]
        firsts = run_starts(key, path, row)  # each (key, path, row) once
        path, row, key = path[firsts], row[firsts], key[firsts]
        groups = run_starts(key, path)
        sizes = np.diff(np.append(groups, len(key)))
        for k, p, size in zip(key[groups].tolist(), path[groups].tolist(), sizes.tolist()):
            self.per_key[(p, k)] += size
        n_of_key = np.array([n for _, n in self.keys], dtype=np.int64)
        n = n_of_key[key]
        order = np.lexsort((row, path, n))
        n, path, row = n[order], path[order], row[order]
        firsts = run_starts(n, path, row)
        values, sizes = np.unique(n[firsts], return_counts=True)
        for v, size in zip(values.tolist(), sizes.tolist()):
            self.per_n[v] += size

    def by_path(self) -> dict[tuple[str, str, int], int]:
        key_of = list(self.keys)
        return {(self.names[p], *key_of[k]): size for (p, k), size in self.per_key.items()}

    def at_n(self) -> dict[int, int]:
        return {n: self.per_n.get(n, 0) for n in self.ns}

