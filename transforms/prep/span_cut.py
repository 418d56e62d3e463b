"""Span mode: what is left of a training row once its overlapping spans are cut out.

``prep --exclude-overlaps D --exclude-mode span`` and ``refinery clean --exclude-mode
span`` keep what GPT-3's rule keeps (Brown et al., 2020, appendix C; NeMo Curator's
``TaskDecontamination``): each overlapping span of the row's text (decon's
``stats/contaminated_train_spans.jsonl``: the union of the training offsets of every
n-gram the row shares with an eval set, at the chosen n) is widened by ``window``
characters on both sides and removed; the row is split at the holes; a piece shorter than
``min_chars`` is dropped; a row with more than ``max_splits`` holes is dropped whole.

Offsets are ``[start, end)`` code-point indices into the row's text as read (its field
or template, before normalization): the text decon n-grammed, mapped back. A piece is
cut from that text, then normalized as a row's text is; its document id is
:func:`piece_id`, and it stays in the row's shard.

Pure functions of numbers: both commands call them, and tests re-derive what they remove
from decon's detail records.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT_WINDOW = 200
DEFAULT_MIN_CHARS = 200
DEFAULT_MAX_SPLITS = 10


@dataclass(frozen=True)
class SpanRules:
    """The span-mode rules (``--exclude-window``, ``--exclude-min-chars``,
    ``--exclude-max-splits``)."""

    window: int = DEFAULT_WINDOW
    min_chars: int = DEFAULT_MIN_CHARS
    max_splits: int = DEFAULT_MAX_SPLITS

    def __post_init__(self) -> None:
        for name in ("window", "min_chars", "max_splits"):
            if getattr(self, name) < 0:
                raise ValueError(f"--exclude-{name.replace('_', '-')} must be 0 or more, got {getattr(self, name)}")

    def identity(self) -> dict[str, int]:
        """What enters a stage's hash."""
        return {"window": self.window, "min_chars": self.min_chars, "max_splits": self.max_splits}


@dataclass(frozen=True)
class RowCut:
    """One row's cut: the ``pieces`` kept (``[start, end)`` in its text, in order), the
    ``holes`` removed (the spans widened, clipped and merged), whether the row is
    ``dropped`` whole (more than ``max_splits`` holes), the pieces dropped as ``too_short``
    and the characters removed (all the row's when dropped; else those of the holes and of
    the short pieces)."""

    pieces: list[tuple[int, int]]
    holes: list[tuple[int, int]]
    dropped: bool
    too_short: int
    removed_chars: int


def holes(spans: np.ndarray, length: int, window: int) -> np.ndarray:
    """The ranges to remove from a text of ``length`` code points: ``spans`` (``(k, 2)``
    ``[start, end)``) each widened by ``window`` on both sides, clipped to the text, and
    merged where they overlap or touch; ``(m, 2)`` int64, sorted. :class:`ValueError` when
    a span is empty, reversed or ends past the text (the row is not the text decon read)."""
    s = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    if len(s) and (int(s[:, 0].min()) < 0 or bool((s[:, 1] <= s[:, 0]).any()) or int(s[:, 1].max()) > length):
        bad = s[(s[:, 0] < 0) | (s[:, 1] <= s[:, 0]) | (s[:, 1] > length)][0].tolist()
        raise ValueError(f"overlap span {bad} does not lie in the row's text of {length:,} characters: the row "
                         "is not the text decon read")
    lo = np.maximum(s[:, 0] - window, 0)
    hi = np.minimum(s[:, 1] + window, length)
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    if not len(lo):
        return np.empty((0, 2), dtype=np.int64)
    reach = np.maximum.accumulate(hi)
    new = np.ones(len(lo), dtype=bool)
    new[1:] = lo[1:] > reach[:-1]  # a gap before it: a hole of its own
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], len(lo)) - 1
    return np.stack([lo[starts], reach[ends]], axis=1)


def cut_row(length: int, spans: np.ndarray, rules: SpanRules) -> RowCut:
    """The :class:`RowCut` of a text of ``length`` code points with overlap ``spans``."""
    h = holes(spans, length, rules.window)
    if len(h) > rules.max_splits:
        return RowCut([], [(int(a), int(b)) for a, b in h.tolist()], True, 0, length)
    bounds = [0, *h.reshape(-1).tolist(), length]
    pieces, too_short, removed = [], 0, int((h[:, 1] - h[:, 0]).sum())
    for a, b in zip(bounds[0::2], bounds[1::2]):
        if b <= a:
            continue
        if b - a < rules.min_chars:
            too_short += 1
            removed += b - a
            continue
        pieces.append((a, b))
    return RowCut(pieces, [(int(a), int(b)) for a, b in h.tolist()], False, too_short, removed)


def piece_id(row_id: str, start: int) -> str:
    """A piece's document id: the row's id, ``@``, and the code point the piece starts at in
    the row's text (``doc-7@0``, ``doc-7@1834``): unique in the row, and it says where the
    piece came from. A real row may have such an id too: :mod:`.piece_ids` fails the run on
    one that is a piece's."""
    return f"{row_id}@{start}"
