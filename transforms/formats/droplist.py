"""decon's drop list: the files one decon output holds for prep to leave rows out.

decon writes them (its merge stage), ``prep --exclude-overlaps`` reads them
(:mod:`refinery.transforms.prep.exclusion`): the format lives here, below both.

- :data:`CONTAMINATED_DOCS`: one :class:`DropEntry` per training row with an overlap, sorted
  by path and row;
- :data:`TRAIN_FILES`: one :class:`TrainFile` per training file decon scanned;
- :data:`OVERLAP_STATS`: one line per (eval dataset, n), which says the n decon ran at.
"""
from __future__ import annotations

import json
from typing import Any, TypedDict

from refinery.transforms.core import storage

CONTAMINATED_DOCS = "stats/contaminated_train_docs.jsonl"
TRAIN_FILES = "stats/train_files.jsonl"
OVERLAP_STATS = "stats/overlap_stats.jsonl"


class DropEntry(TypedDict):
    """A training row with an overlap: where it is (as decon was given it), its document id,
    the n it overlaps at, and per eval dataset and n the instances it overlaps (``overlaps``:
    see ``docs/FORMATS.md``; prep reads only the first four)."""

    train_path: str
    train_row: int
    train_doc_id: str
    ns: list[int]
    overlaps: list[dict[str, Any]]


class TrainFile(TypedDict):
    """A training file decon scanned: as given, resolved, and the version it read."""

    train_path: str
    resolved: str
    size: int
    version: str


def read_jsonl(path: str, data: bytes) -> list[dict[str, Any]]:
    """The JSON lines of ``data``, the bytes of ``path``; :class:`storage.InputError` naming
    the first line that is not JSON."""
    out = []
    for i, line in enumerate(data.splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError as e:
                raise storage.InputError(f"{path}: row {i} is not JSON ({e})") from None
    return out


def drop_rows(docs_path: str, data: bytes, files: list[dict[str, Any]], n: int) -> dict[str, set[int]]:
    """The rows a drop list (``data``, the bytes of ``docs_path``) lists at ``n``, by the resolved
    path of their file (``files``: decon's ``train_files.jsonl`` rows, which resolve the paths
    as decon named them); :class:`storage.InputError` naming a row that is not an entry."""
    by_given = {f["train_path"]: f["resolved"] for f in files}
    rows: dict[str, set[int]] = {}
    for i, doc in enumerate(read_jsonl(docs_path, data), 1):
        try:
            if n not in doc["ns"]:
                continue
            path = by_given.get(doc["train_path"]) or storage.resolved(doc["train_path"])
            rows.setdefault(path, set()).add(int(doc["train_row"]))
        except (KeyError, TypeError, ValueError) as e:
            raise storage.InputError(f"{docs_path}: row {i} is not a drop-list entry ({e!r})") from None
    return rows
