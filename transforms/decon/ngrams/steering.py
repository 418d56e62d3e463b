"""Steering decon at a low n: the few n-grams (boilerplate such as "what was the original
price") that hit a large share of the training rows overlapping at their n, named with the
``--max-train-count K`` that would ignore them.

At a low n a phrase many eval instances share can touch thousands of training rows, and the
drop list then holds them all: a leak and boilerplate look alike there. decon's console
summary and ``report.md`` name such n-grams (:func:`steering_of`, :func:`steering_lines`)
with a concrete K: one less than the fewest training rows among them, so that a rerun with
``--max-train-count K`` ignores exactly the n-grams in more than K training rows (how many at
each n is said too). The counts are the ones ``--max-train-count`` compares: the training
rows that hold the n-gram (a row once however often).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .index import EvalRow, SameText

HEAVY_MIN_ROWS = 100  # an n-gram in fewer training rows is never named
HEAVY_SHARE = 0.1     # ... nor one in at most this share of the training rows overlapping at its n
SHOWN = 5             # n-grams named in the summary and the report


@dataclass(frozen=True)
class HeavyNgram:
    """An n-gram in more than :data:`HEAVY_SHARE` of the training rows overlapping at its n."""

    n: int
    ngram: str
    train_rows: int   # training rows that hold it
    instances: int    # eval rows that have it
    share: float      # train_rows / the training rows overlapping at n


@dataclass(frozen=True)
class Steering:
    """The heavy n-grams of a run (most training rows first) and what would ignore them."""

    heavy: tuple[HeavyNgram, ...]
    max_train_count: int           # the K to suggest: one less than the fewest training rows of ``heavy``
    ignored_at_n: dict[int, int]   # configured n -> n-grams in more than K training rows there

    def record(self) -> dict[str, Any]:
        """As a receipt's stats hold it (JSON): the first :data:`SHOWN` n-grams and the counts."""
        return {"heavy": [[h.n, h.ngram[:200], h.train_rows, h.instances, round(h.share, 4)]
                          for h in self.heavy[:SHOWN]],
                "heavy_total": len(self.heavy), "max_train_count": self.max_train_count,
                "ignored_at_n": [[n, k] for n, k in sorted(self.ignored_at_n.items())]}


def _counts_at(eval_rows: list[EvalRow], n: int, overlaps: dict[int, dict[int, dict[str, int]]],
               same: SameText) -> tuple[dict[str, int], dict[str, int]]:
    """(n-gram -> training rows, n-gram -> eval rows having it) of the overlapping n-grams at
    configured ``n`` (a row shorter than n: its whole text)."""
    rows: dict[str, int] = {}
    instances: dict[str, int] = {}
    for r in eval_rows:
        grams = overlaps.get(same.first_of(r.eval_idx), {}).get(min(n, r.num_tokens), {})
        for gram, count in grams.items():
            rows[gram] = count
            instances[gram] = instances.get(gram, 0) + 1
    return rows, instances


def steering_of(eval_rows: list[EvalRow], ns: list[int], overlaps: dict[int, dict[int, dict[str, int]]],
                same: SameText, rows_at_n: dict[int, int], max_train_count: int | None = None) -> Steering | None:
    """The run's :class:`Steering` (None when no n-gram is heavy): per configured n, the
    n-grams in more than :data:`HEAVY_MIN_ROWS` training rows and more than
    :data:`HEAVY_SHARE` of the ``rows_at_n`` training rows overlapping at n. A given
    ``max_train_count`` already ignored the n-grams over it; a heavier one under it is named
    with a smaller K."""
    heavy: list[HeavyNgram] = []
    counts: dict[int, dict[str, int]] = {}
    for n in sorted(set(ns)):
        rows, instances = _counts_at(eval_rows, n, overlaps, same)
        counts[n] = rows
        total = rows_at_n.get(n, 0)
        bar = max(HEAVY_MIN_ROWS, HEAVY_SHARE * total)
        heavy += [HeavyNgram(n, g, c, instances[g], c / total) for g, c in rows.items() if c > bar]
    if not heavy:
        return None
    heavy.sort(key=lambda h: (-h.train_rows, h.n, h.ngram))
    k = min(h.train_rows for h in heavy) - 1
    if max_train_count is not None:
        k = min(k, max_train_count)
    return Steering(tuple(heavy), k, {n: sum(1 for c in rows.values() if c > k) for n, rows in counts.items()})


def steering_lines(record: dict[str, Any]) -> list[str]:
    """What the summary and ``report.md`` say of a run's steering (:meth:`Steering.record`)."""
    heavy = record["heavy"]
    k = record["max_train_count"]
    named = "; ".join(f'"{gram}" (n = {n}: {rows:,} training rows, {100 * share:.0f}% of those overlapping at '
                      f'n = {n}; {inst:,} eval row(s))' for n, gram, rows, inst, share in heavy)
    more = record["heavy_total"] - len(heavy)
    ignored = ", ".join(f"{c:,} at n = {n}" for n, c in record["ignored_at_n"])
    return [f"{record['heavy_total']:,} n-gram(s) hit more than {100 * HEAVY_SHARE:.0f}% of the training rows "
            f"overlapping at their n (boilerplate more likely than a leak): {named}"
            + (f"; and {more:,} more" if more > 0 else ""),
            f"to list the rows behind the other n-grams only, rerun decon with --max-train-count {k} (it ignores "
            f"the n-grams in more than {k} training rows: {ignored})"]
