"""The run record, ``OUTPUT/.refinery/run.json``: what a run planned, stage by stage.

Written by :func:`~refinery.transforms.resumable.orchestration.run_stages` before any unit runs;
read by ``refinery status`` and ``verify`` (:mod:`.ledger`), by :mod:`.hash_changes` (why a
plan changed since the previous run), by ``prep --exclude-overlaps`` and the manifest checks.
Only the shape is here (JSON as written; older records may lack ``final``).
"""
from __future__ import annotations

from typing import Any, TypedDict

RUN_SCHEMA = "refinery.run/1"


class _StageEntryBase(TypedDict):
    name: str
    stage_hash: str
    units: int  # units planned


class StageEntry(_StageEntryBase, total=False):
    """One stage of a run record, in the order the run wrote its keys."""

    config: dict[str, Any]  # the stage's Stage.config()
    inputs_hash: str        # short hash of its input fingerprints
    identity_hash: str      # short hash of its Stage.identity()
    final: bool             # user-facing files: every unit must have a receipt


class RunRecord(TypedDict, total=False):
    """``{schema, <the command's run_info: command, argv, ...>, stages}``."""

    schema: str
    command: str
    argv: list[str]
    stages: list[StageEntry]
