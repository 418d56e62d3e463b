"""What a run must do, and what a rerun skips: THE planner.

- :func:`bind_stages`: each stage bound to the output with its chained hash (a changed stage
  re-runs it and what follows; what precedes is kept).
- :func:`next_job`: the units of the next Beam job. Nothing, when every unit of the stages
  with user-facing files verifies (:func:`final_stages_done`: the earlier stages' receipts are
  not read, backward demand). Otherwise listings decide: every unit of a stage goes into the
  job and each worker checks the unit's receipt (:func:`~.ledger.check_receipt`) right before
  running it, so a done unit is skipped there; the driver lists which units have no receipt
  file (those run for certain). A stage with a wave policy (:class:`Waves`: prep's token
  budget, inference, whose job must hold exactly the units to run) and the stages before it
  are judged here instead, from their receipts: the policy picks the units of this wave, and
  a wave that does not finish the stage ends the job there (the next job is planned again).
- :func:`write_plans`: the units written where the workers read them (:mod:`.unit_lists`).
- After a job, :func:`unfinished`: what did not complete, from listings of receipts and
  ``failures/`` (or the receipts themselves, for stages judged here).

Whether one unit is done is the ledger's call alone (:mod:`.ledger`)."""
from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from refinery.transforms.io import storage
from refinery.transforms.io.hashing import short_hash
from refinery.transforms.resumable.base import Stage, StageRun, compute_stage_hash, traits_of
from refinery.transforms.resumable.hash_changes import fingerprints_bytes
from refinery.transforms.resumable.ledger import META_DIR, Receipt, fingerprints_path, next_repair, repairs_of
from refinery.transforms.resumable.unit_lists import PlanRef, write_units
from refinery.transforms.resumable.units import Unit

log = logging.getLogger("refinery")


@dataclass(frozen=True)
class Step:
    """One stage's part of a command's pipeline: the stage, bound, and its units in the job;
    ``ref``: where the driver wrote those units (None: they travel in the job itself);
    ``fresh``: for a stage judged by listings, the ids of its units with no receipt file (they
    run for certain; the workers check the others, most likely skipping them); None for a
    stage judged in the driver, whose units in the job are exactly the ones to run."""

    run: StageRun
    units: list[Unit[Any]]
    ref: PlanRef | None = None
    fresh: tuple[str, ...] | None = None

    @property
    def to_run(self) -> int | None:
        """How many of the units run for certain (None: all of them)."""
        return None if self.fresh is None else len(self.fresh)


@dataclass(frozen=True)
class Job:
    """The next Beam job of a run: its steps, in order; the stages it covers (a stage with
    nothing pending among them is in ``runs`` without a step); whether no job follows."""

    steps: list[Step]
    runs: list[StageRun]
    last: bool


def bind_stages(stages: list[Stage[Any, Any]], output: str) -> list[StageRun]:
    """Each stage bound to ``output`` and its chained hash, in order; each stage's ``plan_ref``
    set to where its plan lies in the output (written by :func:`write_plans` before a job)."""
    runs: list[StageRun] = []
    upstream_hash = None
    upstream: dict[str, StageRun] = {}
    for stage in stages:
        h = compute_stage_hash(stage, upstream_hash)
        run = StageRun(stage, output, h, dict(upstream))
        stage.plan_ref = PlanRef(storage.join(run.dir, "plan"), len(stage.plan()))
        upstream[stage.name] = run
        runs.append(run)
        if traits_of(stage).chained:  # an unchained stage's outputs are a function of what the next stage's hash covers
            upstream_hash = h
    return runs


def discard_other_plans(run: StageRun) -> None:
    """Remove receipts of other plans of a stage that writes fixed, user-facing names."""
    stage_root = storage.join(run.output, META_DIR, run.name)
    for path in storage.listdir(stage_root):
        if storage.basename(path) != run.stage_hash:
            log.info("discarding receipts of plan %s of stage %s (its outputs are being replaced)",
                     storage.basename(path), run.name)
            storage.remove_tree(path, root=run.output)


def demanded(final: list[bool], pending: list[bool]) -> int:
    """Backward demand: the index of the last stage a run must run (-1: none), given per stage
    in chain order whether its outputs are user-facing (``final_outputs``; the chain's last
    stage always counts as such) and whether it has units pending. A stage of intermediate
    files whose later stages are all complete is not run, even if its own files or receipts
    are gone: nothing would read them (``.refinery/tokenize/`` may be removed after a finished
    prep). Every stage up to the returned one runs its pending units."""
    for i in reversed(range(len(pending))):
        if pending[i] and (final[i] or i == len(pending) - 1):
            return i
    return -1


@dataclass
class Planned:
    run: StageRun
    plan: list[Unit[Any]]
    receipts: dict[str, Receipt]  # unit id -> receipt of the units done
    pending: list[Unit[Any]]  # of the units the stage needs now
    final: bool  # False: needed() will ask for more units once these are done
    stale: list[str] = field(default_factory=list)  # pending units whose receipt predates an upstream repair


def plan_runs(runs: list[StageRun], plans: list[list[Unit[Any]]], verify_checksums: bool) -> list[Planned]:
    """Each stage's done and pending units, in order. A stage's receipts are judged against
    the repair tokens its upstream units will have once the pending ones ran
    (:func:`next_repair`): a unit built before an upstream repair made in this run is pending."""
    planned: list[Planned] = []
    repairs: dict[str, str] = {}
    for run, plan in zip(runs, plans):
        run.upstream_repairs = dict(repairs)
        checks = run.check_all([u.id for u in plan], verify_checksums)
        receipts = {u.id: c.receipt for u in plan if (c := checks[u.id]).done and c.receipt is not None}
        waves = run.traits.waves
        needed, final = waves.needed(plan, receipts) if waves else (plan, True)
        pending = [u for u in needed if u.id not in receipts]
        done_repairs = repairs_of(run.name, receipts)
        if done_repairs and run.ledger.recorded_repairs() != done_repairs:  # a run killed before it recorded one
            for key, token in done_repairs.items():
                run.ledger.record_repair(key.split("/", 1)[1], token)
        repairs.update(done_repairs)
        for u in pending:
            if repair := next_repair(checks[u.id]):
                repairs[f"{run.name}/{u.id}"] = repair
        planned.append(Planned(run, plan, receipts, pending, final, [u.id for u in pending if checks[u.id].stale]))
    return planned


def final_stages_done(runs: list[StageRun], plans: list[list[Unit[Any]]], verify_checksums: bool = False) -> bool:
    """Whether every unit of the stages whose files are user-facing (``final_outputs``, and the
    last stage) is done by :func:`check_receipt`: then a run has nothing to do, whatever the
    stages before them hold (backward demand, :func:`demanded`), and their receipts need not
    be read: a no-op re-plan reads the final stages' receipts and one listing of each earlier
    stage's recorded repairs (the tokens the final receipts are judged against), not a receipt
    per unit of the corpus."""
    repairs: dict[str, str] = {}
    for i, (run, plan) in enumerate(zip(runs, plans)):
        if run.traits.final_outputs or i == len(runs) - 1:
            run.upstream_repairs = dict(repairs)
            checks = run.check_all([u.id for u in plan], verify_checksums)
            if not all(c.done for c in checks.values()):
                return False
            repairs.update(repairs_of(run.name, {u: c.receipt for u, c in checks.items() if c.receipt is not None}))
        else:
            repairs.update(run.ledger.recorded_repairs())
    return True


def plan_ref(stage: Stage[Any, Any]) -> PlanRef:
    """Where the plan of a bound stage lies (set by :func:`bind_stages`)."""
    if stage.plan_ref is None:
        raise RuntimeError(f"stage {stage.name}: not bound to an output (bind_stages sets where its plan lies)")
    return stage.plan_ref


def step_ref(run: StageRun, units: list[Unit[Any]]) -> PlanRef:
    """Where the units one job runs of ``run`` lie: its plan's parts when they are the whole
    plan, else ``steps/<hash of their ids>/`` (written by :func:`write_plans`)."""
    plan = run.stage.plan()
    if len(units) == len(plan) and all(a.id == b.id for a, b in zip(units, plan)):
        return plan_ref(run.stage)
    return PlanRef(storage.join(run.dir, "steps", short_hash([u.id for u in units])), len(units))


def record_inputs(run: StageRun, fingerprints: list[Any]) -> None:
    """Write the input ``fingerprints`` of ``run``'s plan (``Stage.fingerprints()``) under OUTPUT,
    unless the file there holds exactly these bytes (checked by content: an edited or cut one
    is written again, with a warning naming it): what a later run names changed inputs from,
    and what a worker reads for the stage's input list (:meth:`StageRun.input_fingerprints`),
    which checks it against ``run.inputs_hash``, set here."""
    if not fingerprints:
        return
    path = fingerprints_path(run.output, run.name, run.stage_hash)
    run.inputs_hash = short_hash(fingerprints)
    data = fingerprints_bytes(fingerprints)
    size = storage.file_size(path)
    if size == len(data) and storage.read_bytes(path) == data:
        return
    if size is not None:
        log.warning("%s: not the input fingerprints of plan %s (damaged after it was written): written again",
                    path, run.stage_hash)
    storage.atomic_write_bytes(path, data)


def write_plans(runs: list[StageRun], steps: list[Step]) -> list[Step]:
    """Write the plan of every stage of ``runs``, and the units of each step (``pipeline.Step``),
    into the output, where the job's workers read them (each part checked by content,
    :func:`write_units`); the steps with their ``ref`` set, which, like each stage's
    ``plan_ref``, now holds the sha256 of every part.
    (The input fingerprints a worker may read too are :func:`record_inputs`'.)"""
    for r in runs:  # the stage's plan_ref gets each part's sha256, which the workers check
        r.stage.plan_ref, _ = write_units(plan_ref(r.stage), r.stage.plan())
    out = []
    for s in steps:
        ref, _ = write_units(step_ref(s.run, s.units), s.units)
        out.append(replace(s, ref=ref))
    return out


def next_job(runs: list[StageRun], plans: list[list[Unit[Any]]], verify_checksums: bool) -> Job | None:
    """The next job of a run (module docstring), or None when there is nothing to do. With
    checksums every unit's files are verified, by the workers or here."""
    if not verify_checksums and final_stages_done(runs, plans):
        return None  # nothing to do: the earlier stages' receipts are not read
    here = max((i + 1 for i, r in enumerate(runs) if r.traits.waves is not None), default=0)
    steps: list[Step] = []
    if here:
        steps, job_runs, final = _judged_here(runs[:here], plans[:here], verify_checksums, more=here < len(runs))
        if not final:
            return Job(steps, job_runs, last=False)
    return Job(steps + _judged_by_workers(runs[here:], plans[here:]), runs, last=True)


def _judged_by_workers(runs: list[StageRun], plans: list[list[Unit[Any]]]) -> list[Step]:
    """The steps of stages judged by listings: every unit of every stage (the workers skip the
    ones whose receipt verifies), each with the ids of its units with no receipt file. A unit
    repaired in the job invalidates what was built from it, so the workers judge a receipt
    against the earlier stages' repairs listed once those stages have finished
    (``StageRun.listing_job``)."""
    job = uuid.uuid4().hex[:16]
    steps: list[Step] = []
    for run, plan in zip(runs, plans):
        run.listing_job = job
        if not plan:
            continue
        listed = run.ledger.listed_units()
        fresh = tuple(u.id for u in plan if u.id not in listed)
        log.info("stage %s [%s]: %d of %d units have no receipt; the workers check the other %d before running them",
                 run.name, run.stage_hash, len(fresh), len(plan), len(plan) - len(fresh))
        steps.append(Step(run, plan, fresh=fresh))
    return steps


def _judged_here(runs: list[StageRun], plans: list[list[Unit[Any]]], verify_checksums: bool,
                 more: bool) -> tuple[list[Step], list[StageRun], bool]:
    """The steps of stages judged in the driver: each stage's pending units (its wave
    policy's, :class:`Waves`), up to the last one demanded (every one when ``more`` stages
    follow, judged by listings: they run, so what precedes them is needed), or up to a stage
    whose policy asks for more waves; the stages of the job; whether the wave is final.
    Receipts built before an upstream repair are removed first."""
    planned = plan_runs(runs, plans, verify_checksums)
    last = len(planned) - 1 if more else \
        demanded([p.run.traits.final_outputs for p in planned], [bool(p.pending) for p in planned])
    job: list[Planned] = []
    for p in planned[:last + 1]:
        job.append(p)
        if not p.final:
            if not p.pending:
                raise RuntimeError(f"stage {p.run.name}: its wave policy asked for more units but none is pending")
            break
    for p in job:
        if p.pending:
            log.info("stage %s [%s]: %d of %d units pending", p.run.name, p.run.stage_hash,
                     len(p.pending), len(p.plan))
    steps = [Step(p.run, p.pending) for p in job if p.pending]
    if steps:
        for p in job:  # receipts built before an upstream repair go first: a later run, even one
            for unit_id in p.stale:  # killed before these units are redone, sees them pending
                p.run.ledger.remove_receipt(unit_id)
    return steps, [p.run for p in job], not job or job[-1].final


def unfinished(step: Step, verify_checksums: bool = False) -> dict[str, str]:
    """After a job: unit id -> why it is not done, of ``step``'s units. For a stage judged by
    listings only the units without a receipt file, or listed under ``failures/``, are checked
    (the workers checked the others), and a failure record left by a kill after its unit
    completed is removed; a stage judged here has each unit checked."""
    run = step.run
    if step.fresh is None:
        checks = run.check_all([u.id for u in step.units], verify_checksums)
        return {u: c.reason for u, c in checks.items() if not c.done}
    listed, failed = run.ledger.listed_units(), run.ledger.listed_failures()
    maybe = [u.id for u in step.units if u.id not in listed or u.id in failed]
    out = {}
    for unit_id, c in run.check_all(maybe, verify_checksums).items():
        if c.done:
            run.ledger.forget_failure(unit_id)
        else:
            out[unit_id] = c.reason
    return out


def first_unfinished(steps: list[Step]) -> str:
    """The stage a failed job is reported at: the first step with a unit not done (for a stage
    judged by listings: a unit with no receipt or a recorded failure)."""
    for s in steps:
        if s.fresh is not None:
            listed, failed = s.run.ledger.listed_units(), s.run.ledger.listed_failures()
            if any(u.id not in listed or u.id in failed for u in s.units):
                return s.run.name
        elif not all(c.done for c in s.run.check_all([u.id for u in s.units]).values()):
            return s.run.name
    return steps[-1].run.name
