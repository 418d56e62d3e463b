"""The longest match per eval instance (ConTAM, Singh et al. 2024) and its coverage.

For an eval instance, a configured n and its effective length ``L = min(n, tokens)``, each
overlapping n-gram the instance shares with a training row covers a window of ``L`` eval
tokens (once per occurrence in the instance). ``longest_match`` is the longest run of
consecutive eval tokens covered by the windows of ONE training row (windows that overlap or
touch join a run), the largest over training rows; ``coverage`` is the fraction of the
instance's tokens covered by any overlapping window: HELM's ``token`` metric
(:func:`.reduce.instance_metrics`), the same quantity under the ConTAM name. Tokens are
those of the tokenizer, as HELM counts them (an empty token at either end of a text
included).

A training row's windows for one instance come from n-grams of several hash partitions, so
the reduce cannot compute a row's runs alone. Each reduce unit keeps, per n-gram record it
saw hit (:func:`record_windows`), the eval windows of that record (their character starts):
bounded by the eval side, whatever the number of training rows. Which training rows hit which
records is already in the partition's drop-list share (:meth:`.droplist.RowHits.result`).
The merge (:func:`longest_matches`) joins the shares by training row across partitions,
expands each row's records to their windows a bounded number at a time
(:data:`WINDOWS_AT_ONCE`) and keeps, per (instance, length), the longest run: exact, whatever
the partitioning.
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Any, Iterable, Sequence

import numpy as np

from .arrays import batches, i64, i64_bytes, ranges, run_starts
from .compact import token_starts
from .index import EvalRow
from .word_split import WordSplitter

WINDOWS_AT_ONCE = 1 << 17  # (training row, eval window) pairs the merge expands at once


def longest_run(windows: Iterable[tuple[int, int]]) -> int:
    """The longest run of consecutive tokens covered by ``[start, end)`` token windows
    (overlapping or touching windows join one run); 0 for none."""
    best = 0
    run_start = run_end = None
    for s, e in sorted(windows):
        if run_start is None or run_end is None or s > run_end:  # both None before the first window
            run_start, run_end = s, e
        else:
            run_end = max(run_end, e)
        best = max(best, run_end - run_start)
    return best


EMPTY_WINDOWS = {"lens": b"", "starts": i64_bytes([0]), "evals": b"", "chars": b""}


def record_windows(records: Sequence[Sequence[Any]], kept: dict[int, list[Any]]) -> dict[str, Any]:
    """A reduce unit's share for the longest match: per record it saw counted hits of, in
    ascending record index (the order of the records of :meth:`.droplist.RowHits.result`),
    its effective length (``lens``) and its eval windows ``starts[j]`` to ``starts[j + 1]``:
    the eval row (``evals``) and the character offset where the window starts (``chars``).
    ``kept``: record index -> its ``[eval_idx, offsets]`` (first rows of shared texts only).
    Arrays as little-endian int64 bytes."""
    lens, starts, evals, chars = [], [0], [], []
    for rec in sorted(kept):
        lens.append(records[rec][0])
        for eval_idx, offsets in kept[rec]:
            for s, _ in offsets:
                evals.append(eval_idx)
                chars.append(s)
        starts.append(len(evals))
    return {"lens": i64_bytes(lens), "starts": i64_bytes(starts), "evals": i64_bytes(evals), "chars": i64_bytes(chars)}


def token_positions(eval_rows: list[EvalRow], evals: np.ndarray, chars: np.ndarray, tokenizer: WordSplitter
                    ) -> np.ndarray:
    """The token index of each window start: ``chars[i]`` is the character offset where a
    token of eval row ``evals[i]`` starts (:func:`.normalized.tokens_with_offsets`; token
    starts strictly increase along a text)."""
    if not len(evals):
        return np.zeros(0, dtype=np.int64)
    rows = np.unique(evals).tolist()
    big = max(len(eval_rows[i].text) for i in rows) + 2
    keys, positions = [], []
    for i in rows:
        starts = token_starts(tokenizer, eval_rows[i].text)  # as the index's offsets are (an array: a long row)
        keys.append(starts + i * big)
        positions.append(np.arange(len(starts), dtype=np.int64))
    key, position = np.concatenate(keys), np.concatenate(positions)
    want = evals * big + chars
    at = np.minimum(np.searchsorted(key, want), len(key) - 1)
    if not np.array_equal(key[at], want):
        raise ValueError("an eval window does not start at a token of its eval row")
    found: np.ndarray = position[at]
    return found


def longest_matches(shares: list[tuple[dict[str, Any], dict[str, Any]]], eval_rows: list[EvalRow], ns: list[int],
                    tokenizer: WordSplitter, windows_at_once: int = WINDOWS_AT_ONCE, best: np.ndarray | None = None
                    ) -> np.ndarray:
    """The longest match of every eval row: an array ``[eval_idx, k]`` for effective length
    ``L`` at ``k = searchsorted(ns, L)`` (the first configured n with ``min(n, tokens) ==
    L``; see :func:`longest_at`), 0 where nothing overlaps; rows whose text an earlier row
    has hold nothing (look up their first row).

    ``shares``: each reduce unit's ``(train_rows share, windows share)``
    (:meth:`.droplist.RowHits.result`, :func:`record_windows`). A training row's windows of
    one instance are the union over every partition that lists the row; a training row's
    pairs are expanded ``windows_at_once`` windows at a time (more only for one row that has
    more). A windows share with ``toks`` (the token positions of its ``chars``:
    :func:`token_positions`, made ahead) is not tokenized again. ``best``: raised in place
    (the merge of :mod:`.row_shares` calls this once per window of training rows)."""
    ns = sorted(set(ns))
    best = np.zeros((len(eval_rows), len(ns)), dtype=np.int64) if best is None else best
    used = [(rows, win) for rows, win in shares if rows.get("paths")]
    if not used:
        return best
    paths: dict[str, int] = {}
    row_list, lo_list, hi_list, rec_list = [], [], [], []
    lens, wlo, whi, evals, chars = [], [], [], [], []
    pairs_before = recs_before = windows_before = 0
    for rows, win in used:
        pmap = np.array([paths.setdefault(p, len(paths)) for p in rows["paths"]], dtype=np.int64)
        got = i64(rows["rows"]).reshape(-1, 2).copy()
        got[:, 0] = pmap[got[:, 0]]
        row_list.append(got)
        rec_starts = i64(rows["rec_starts"])
        lo_list.append(rec_starts[:-1] + pairs_before)
        hi_list.append(rec_starts[1:] + pairs_before)
        recs = i64(rows["recs"])
        rec_list.append(recs + recs_before)
        starts = i64(win["starts"])
        n_recs = len(starts) - 1
        if n_recs != len(i64(rows["code_starts"])) - 1:
            raise ValueError("a reduce unit's windows do not match its training rows' records")
        lens.append(i64(win["lens"]))
        wlo.append(starts[:-1] + windows_before)
        whi.append(starts[1:] + windows_before)
        evals.append(i64(win["evals"]))
        chars.append(i64(win["toks"] if "toks" in win else win["chars"]))
        pairs_before += len(recs)
        recs_before += n_recs
        windows_before += int(starts[-1])
    row_of = np.concatenate(row_list)
    pair_lo, pair_hi, pair_rec = np.concatenate(lo_list), np.concatenate(hi_list), np.concatenate(rec_list)
    rec_len, rec_wlo, rec_whi = np.concatenate(lens), np.concatenate(wlo), np.concatenate(whi)
    win_eval = np.concatenate(evals)
    toks_made = [("toks" in win) for _, win in used]
    if any(toks_made) and not all(toks_made):
        raise ValueError("longest_matches: windows shares with and without token positions")
    win_tok = np.concatenate(chars) if all(toks_made) else token_positions(eval_rows, win_eval, np.concatenate(chars),
                                                                           tokenizer)
    ns_arr = np.array(ns, dtype=np.int64)
    # the windows of each listed row, before the rows of several partitions are joined
    pair_windows = np.append(0, np.cumsum((rec_whi - rec_wlo)[pair_rec]))
    order = np.lexsort((row_of[:, 1], row_of[:, 0]))
    row_starts = np.append(run_starts(row_of[order, 0], row_of[order, 1]), len(order))
    before = np.append(0, np.cumsum((pair_windows[pair_hi] - pair_windows[pair_lo])[order]))
    at = before[row_starts]
    for a, b in batches(at, windows_at_once):
        chosen = order[row_starts[a]:row_starts[b]]
        label = np.repeat(np.arange(b - a, dtype=np.int64), np.diff(row_starts[a:b + 1]))
        pair = ranges(pair_lo[chosen], pair_hi[chosen])
        label = np.repeat(label, pair_hi[chosen] - pair_lo[chosen])
        rec = pair_rec[pair]
        count = rec_whi[rec] - rec_wlo[rec]
        window = ranges(rec_wlo[rec], rec_whi[rec])
        _runs_into(best, np.repeat(label, count), win_eval[window], np.repeat(rec_len[rec], count),
                   win_tok[window], ns_arr)
    return best


def _runs_into(best: np.ndarray, label: np.ndarray, ev: np.ndarray, length: np.ndarray, start: np.ndarray,
               ns: np.ndarray) -> None:
    """Raise ``best[eval, k]`` to the longest run of each (training row ``label``, eval row,
    length) group of windows ``[start, start + length)``."""
    if not len(label):
        return
    order = np.lexsort((start, length, ev, label))
    label, ev, length, start = label[order], ev[order], length[order], start[order]
    groups = run_starts(label, ev, length)
    first = np.zeros(len(label), dtype=np.int64)
    first[groups] = 1
    group = np.cumsum(first) - 1
    stride = int((start + length).max()) + 1
    s = start + group * stride   # groups apart: a run never crosses into the next group
    e = s + length
    reach = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    new[groups] = True
    runs = np.flatnonzero(new)
    run_len = np.maximum.reduceat(e, runs) - s[runs]
    np.maximum.at(best, (ev[runs], np.searchsorted(ns, length[runs])), run_len)


def longest_at(best: np.ndarray, ns: list[int], eval_idx: int, num_tokens: int, n: int) -> int:
    """The longest match of first row ``eval_idx`` (``num_tokens`` tokens) at configured ``n``,
    from :func:`longest_matches` over the sorted distinct ``ns``."""
    return int(best[eval_idx, bisect_left(ns, min(n, num_tokens))])
