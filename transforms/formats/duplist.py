"""dedup's outputs that other commands read: the duplicate list and what it was made of.

``refinery dedup`` writes them (its report stage); ``prep --exclude-duplicates`` and
``refinery clean --exclude-duplicates`` read them through the exclusion that reads decon's
drop lists (:mod:`refinery.transforms.prep.exclusion`): the format lives here, below both.

- :data:`DUP_LIST`: one :class:`DupEntry` per row removed as a duplicate (every row of a
  cluster but its kept row), sorted by input order (file, then row). Its ``train_path`` and
  ``train_row`` are a drop list's: the readers of decon's drop lists read it as one.
- :data:`INPUT_FILES`: one :class:`~refinery.transforms.formats.droplist.TrainFile` per input
  file dedup read, with how it read the text (the same record as decon's ``train_files.jsonl``:
  a reader checks its own text spec, normalization and row cap against it).
- :data:`CLUSTERS`: one :class:`ClusterEntry` per cluster, by cluster id.
- :data:`REPORT`: the report (markdown): duplicate share per input, the largest clusters with
  their kept row and a removed one side by side, the buckets skipped over the cap.
- :data:`STATS`: the totals as JSON (``dedup_stats.json``).
"""
from __future__ import annotations

from typing import TypedDict

DUP_LIST = "dup_list.jsonl"
CLUSTERS = "clusters.jsonl"
REPORT = "report.md"
STATS = "dedup_stats.json"
INPUT_FILES = "stats/input_files.jsonl"
LAST_STAGE = "report"  # the stage whose receipt records the sha256 of every file above


class DupEntry(TypedDict):
    """A row removed as a duplicate: where it is (``train_path`` as dedup was given it,
    ``train_row`` its 0-based row), the row kept in its cluster (``dup_of_path``,
    ``dup_of_row``), the Jaccard of their shingle sets (1.0 for the same text), whether
    the texts are the same (``exact``) and the cluster's id."""

    train_path: str
    train_row: int
    dup_of_path: str
    dup_of_row: int
    jaccard: float
    exact: bool
    cluster: int


class ClusterEntry(TypedDict):
    """A cluster of duplicates: its id (the clusters numbered from 0 in the order of their
    kept rows), its kept row, how many rows it holds (the kept one included), how many of the
    removed ones have the kept row's text, and the lowest Jaccard of a removed row to the
    kept row."""

    cluster: int
    kept_path: str
    kept_row: int
    size: int
    exact: int
    min_jaccard: float
