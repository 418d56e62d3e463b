"""Resumable stages, the public face: everything a stage author or a command needs, from the
modules that hold it, one concern each (imports point down this list):

- :mod:`.units`: :class:`Unit`; :mod:`.hashing`: the canonical JSON that hashes are taken of;
- :mod:`.base`: the Stage API (:class:`Stage`, :class:`StageRun`, :class:`UnitContext`),
  the output layout, the stage hash and the receipt schema;
- :mod:`.execution`: one unit run and recorded (:func:`execute_unit`), its counters;
- :mod:`.planner`: stages bound to an output (:func:`bind_stages`), what is done and what is
  pending (backward demand, repairs), plans written for the workers;
- :mod:`.orchestration`: a command's run (:func:`run_stages`), and how it fails;
- :mod:`.status`: ``refinery status`` (:func:`stage_status`).

The Beam job itself is built in :mod:`.beam_steps`.
"""
from __future__ import annotations

from refinery.transforms.io.hashing import canonical_json, short_hash
from refinery.transforms.resumable.base import (
    PROGRESS_EVERY_S,
    REMOTE_PROGRESS_EVERY_S,
    AllPending,
    BeamWiring,
    Stage,
    StageConfig,
    StageRun,
    StageWiring,
    Traits,
    UnitContext,
    Waves,
    compute_stage_hash,
    now_iso,
    traits_of,
)
from refinery.transforms.resumable.execution import execute_unit, span_key, unit_counters, unit_times_ms
from refinery.transforms.resumable.ledger import CHECK_THREADS, next_repair
from refinery.transforms.resumable.orchestration import (
    JobFailed,
    JobResult,
    StageFailed,
    run_in_driver,
    run_stages,
)
from refinery.transforms.resumable.planner import (
    bind_stages,
    demanded,
    final_stages_done,
    next_job,
    record_inputs,
    step_ref,
    write_plans,
)
from refinery.transforms.resumable.run_record import RUN_SCHEMA
from refinery.transforms.resumable.status import stage_status
from refinery.transforms.resumable.units import Unit

__all__ = [
    "CHECK_THREADS", "PROGRESS_EVERY_S", "REMOTE_PROGRESS_EVERY_S", "RUN_SCHEMA", "AllPending", "BeamWiring",
    "JobFailed", "JobResult", "Stage", "StageConfig", "StageFailed", "StageRun", "StageWiring", "Traits", "Unit",
    "UnitContext", "Waves", "bind_stages", "canonical_json", "compute_stage_hash", "demanded", "execute_unit",
    "final_stages_done", "next_job", "next_repair", "now_iso", "record_inputs", "run_in_driver", "run_stages",
    "short_hash", "span_key", "stage_status", "step_ref", "traits_of", "unit_counters", "unit_times_ms",
    "write_plans",
]
