"""A command's run: plan, run the job (one Beam job, or the next wave of one), account for
what ran, fail loudly on what did not (:func:`run_stages`)."""
from __future__ import annotations

import datetime as _dt
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, cast

from refinery.transforms.io import storage
from refinery.transforms.io.hashing import short_hash
from refinery.transforms.io.timeline import mark
from refinery.transforms.resumable.base import Stage, StageRun
from refinery.transforms.resumable.execution import execute_unit, span_key, unit_counters, unit_times_ms
from refinery.transforms.resumable.hash_changes import explain_plan_changes
from refinery.transforms.resumable.ledger import META_DIR, Receipt
from refinery.transforms.resumable.planner import (
    Step,
    bind_stages,
    discard_other_plans,
    first_unfinished,
    next_job,
    record_inputs,
    unfinished,
    write_plans,
)
from refinery.transforms.resumable.progress import Progress
from refinery.transforms.resumable.run_record import RUN_SCHEMA, RunRecord, StageEntry
from refinery.transforms.resumable.units import Unit

log = logging.getLogger("refinery")

# runs a job's steps: (steps, beam_args, verify_checksums) -> the runner's counters, if it has any
Runner = Callable[[list[Step], list[str], bool], "dict[str, int] | None"]


class StageFailed(RuntimeError):
    def __init__(self, stage: str, failures: dict[str, str]):
        self.stage = stage
        self.failures = failures
        lines = "\n".join(f"  {u}: {why}" for u, why in sorted(failures.items())[:20])
        more = f"\n  ... and {len(failures) - 20} more" if len(failures) > 20 else ""
        super().__init__(f"stage {stage}: {len(failures)} unit(s) not completed:\n{lines}{more}")


class JobFailed(RuntimeError):
    """A stage's Beam job failed as a whole (a lost worker or task manager, a runner
    error), as opposed to units that failed inside it (:class:`StageFailed`). Receipts of
    the units that finished before are kept; ``cause`` is the runner's exception."""

    def __init__(self, stage: str, cause: BaseException):
        self.stage = stage
        self.cause = cause
        first = next((ln.strip() for ln in str(cause).splitlines() if ln.strip()), "")
        super().__init__(f"stage {stage}: the Beam job failed: {type(cause).__name__}: {first[:400]}")


@dataclass
class JobResult:
    """What a run did: per stage the units it ran, their wall time and the runner's counters;
    the stages it did not run (found done)."""

    runs: list[StageRun]
    ran: dict[str, int]  # stage -> units executed this time
    skipped_stages: list[str]
    seconds: dict[str, float] = field(default_factory=dict)  # stage -> wall time this time
    metrics: dict[str, dict[str, int]] = field(default_factory=dict)  # stage -> the runner's refinery counters


def _span_seconds(receipts: list[Receipt]) -> float:
    """Wall time from the first unit's start to the last one's end (0 if none ran)."""
    try:
        starts = [_dt.datetime.fromisoformat(r["started_at"]) for r in receipts]
        ends = [_dt.datetime.fromisoformat(r["finished_at"]) for r in receipts]
    except (KeyError, TypeError, ValueError):
        return 0.0
    return (max(ends) - min(starts)).total_seconds() if starts else 0.0


def run_in_driver(steps: list[Step], beam_args: list[str] | None = None,
                  verify_checksums: bool = False) -> dict[str, int]:
    """A step runner for ``run_stages`` without Beam: each step's units in this process, in
    order; a step with a unit not completed blocks the steps after it (as in the pipeline).
    Returns the counters a Beam job would report (:func:`unit_counters`)."""
    counters: dict[str, int] = {}
    for step in steps:
        receipts = [execute_unit(step.run, u, verify_checksums) for u in step.units]
        for r in receipts:
            for k, v in unit_counters(step.run.name, r).items():
                counters[k] = counters.get(k, 0) + v
        if times := [t for r in receipts if (t := unit_times_ms(r))]:
            counters[span_key(step.run.name)] = max(e for _, e in times) - min(s for s, _ in times)
        if any(r["status"] != "completed" for r in receipts):
            break
    return counters


def run_stages(stages: list[Stage[Any, Any]], output: str, beam_args: list[str], *,
               verify_checksums: bool = False, force: bool = False, progress: bool = True,
               run_info: dict[str, Any] | None = None,
               on_plan: Callable[[list[StageRun], list[list[Unit[Any]]]], None] | None = None,
               runner: Runner | None = None) -> JobResult:
    """Run ``stages`` in order on ``output``, skipping every unit whose receipt verifies.

    The planner (:func:`~.planner.next_job`) says what each job holds; ``runner(steps,
    beam_args, verify_checksums)`` runs those steps (:class:`~.planner.Step`: stage + units)
    as ONE Beam job, each step after the one before (default: ``beam_steps.run_on_beam``;
    :func:`run_in_driver` runs them here, without Beam) and may return the runner's counters,
    kept per stage in ``JobResult.metrics``. After each job, what did not complete is learnt
    from listings (:func:`~.planner.unfinished`); the driver reads only the receipts of the
    units that ran, for the time each stage took. A wave that does not finish its stage ends
    a job; the next job, planned again, goes on from there.

    ``force`` deletes ``OUTPUT/.refinery`` first (a fresh run). ``on_plan`` is called with
    the bound stages and their plans before anything runs (prep uses it to clear a stale
    manifest). Raises :class:`StageFailed` naming the first stage with units not
    completed, :class:`JobFailed` when the Beam job failed; the receipts of everything that
    finished are kept for the next run.
    """
    if runner is None:
        from refinery.transforms.resumable.beam_steps import run_on_beam

        runner = run_on_beam
    runs, plans = _start_run(stages, output, force, run_info)
    if on_plan:
        on_plan(runs, plans)
    mark("planned")
    result = JobResult(runs, {}, [])
    discarded: set[str] = set()
    judged_by_workers = False
    while True:
        job = next_job(runs, plans, verify_checksums)
        if job is None:
            break
        steps = job.steps
        for run in job.runs:
            result.ran.setdefault(run.name, 0)
            if run.traits.final_outputs and run.name not in discarded:
                discard_other_plans(run)
                discarded.add(run.name)
        if not steps:
            break
        steps = write_plans(job.runs, steps)
        with Progress([(s.run, len(s.units)) for s in steps], interval=10.0 if storage.is_remote(output) else 1.0,
                      enabled=progress):
            try:
                mark("job_start")
                counters = runner(steps, beam_args, verify_checksums) or {}
                mark("job_end")
            except Exception as e:  # noqa: BLE001 - the runner's failure, reported as one line
                log.info("the Beam job failed", exc_info=True)
                raise JobFailed(first_unfinished(steps), e) from e
        for s in steps:
            _account_step(result, s, counters, verify_checksums)
            judged_by_workers = judged_by_workers or s.fresh is not None
        if job.last:
            break
    if judged_by_workers and not any(result.ran.values()):
        result.ran.clear()  # the workers found every unit done (a run with --verify-checksums): nothing ran
    result.skipped_stages = [r.name for r in runs if r.name not in result.ran]
    return result


def _start_run(stages: list[Stage[Any, Any]], output: str, force: bool,
               run_info: dict[str, Any] | None) -> tuple[list[StageRun], list[list[Unit[Any]]]]:
    """The stages bound to ``output`` and their plans, once the output is ready for a run:
    ``OUTPUT/.refinery`` removed first with ``force``, dead writers' temp files removed, each
    plan's input fingerprints and ``run.json`` recorded, and why a stage's plan changed
    since the previous run logged."""
    if force:
        storage.remove_tree(storage.join(output, META_DIR), root=output)
    for path in storage.remove_dead_temp_files(output):
        log.info("removed %s: a temp file left by an interrupted write", path)
    runs = bind_stages(stages, output)
    plans = [r.stage.plan() for r in runs]
    for r, plan in zip(runs, plans):
        unit_ids = [u.id for u in plan]
        if len(set(unit_ids)) != len(unit_ids):
            raise ValueError(f"stage {r.name}: duplicate unit ids in plan")
    run_json = storage.join(output, META_DIR, "run.json")
    configs = [r.stage.config() for r in runs]  # once: the inputs are a list per input file
    fingerprints = [list(c.inputs) for c in configs]
    entries: list[StageEntry] = [
               {"name": r.name, "stage_hash": r.stage_hash, "units": len(p), "config": dict(c.settings),
                "inputs_hash": short_hash(fps), "identity_hash": short_hash(c.identity),
                "final": r.traits.final_outputs or i == len(runs) - 1}
               for i, (r, p, c, fps) in enumerate(zip(runs, plans, configs, fingerprints))]
    for r, fps in zip(runs, fingerprints):
        record_inputs(r, fps)
    try:
        previous = storage.read_json(run_json)
    except (FileNotFoundError, ValueError):
        previous = None
    if isinstance(previous, dict):
        for line in explain_plan_changes(output, cast(RunRecord, previous), entries):
            log.warning("%s", line)
    storage.atomic_write_json(run_json, {"schema": RUN_SCHEMA, **(run_info or {}), "stages": entries})
    return runs, plans


def _account_step(result: JobResult, step: Step, counters: dict[str, int], verify_checksums: bool) -> None:
    """Add one finished step of a job to ``result`` (units run, wall time, the runner's
    counters), or raise :class:`StageFailed` naming its units not done (:func:`unfinished`)."""
    name = step.run.name
    mine = {k: v for k, v in counters.items() if k.startswith(name + "_")}
    log.info("stage %s: runner counters %s", name, json.dumps(mine, sort_keys=True))
    if mine:
        stage_counters = result.metrics.setdefault(name, {})
        for k, v in mine.items():
            stage_counters[k] = stage_counters.get(k, 0) + v
    failures = unfinished(step, verify_checksums)
    if failures:
        raise StageFailed(name, failures)
    if step.fresh is None:  # judged here: the job held exactly the units to run
        result.ran[name] += len(step.units)
        ran = [u.id for u in step.units]
    elif any(k.startswith(f"{name}_units_") for k in counters):
        result.ran[name] += sum(counters.get(f"{name}_units_{k}", 0) for k in ("completed", "failed"))
        ran = list(step.fresh)
    else:  # a runner without metrics: the units that had no receipt
        result.ran[name] += len(step.fresh)
        ran = list(step.fresh)
    # the stage's wall time: from the runner's metrics, else from the receipts of the units run
    span = counters[span_key(name)] / 1000 if span_key(name) in counters else \
        _span_seconds(step.run.ledger.read_receipts_of(ran))
    result.seconds[name] = result.seconds.get(name, 0.0) + span
