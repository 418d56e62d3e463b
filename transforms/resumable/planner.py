"""What a run must do: stages bound to an output and their chained hashes, which units are
done and which pending (backward demand, repairs), and the plans written where workers read
them."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from refinery.transforms.io import storage
from refinery.transforms.io.hashing import short_hash
from refinery.transforms.resumable.base import Stage, StageRun, compute_stage_hash
from refinery.transforms.resumable.hash_changes import fingerprints_bytes
from refinery.transforms.resumable.ledger import META_DIR, Receipt, fingerprints_path, next_repair, repairs_of
from refinery.transforms.resumable.unit_lists import PlanRef, write_units
from refinery.transforms.resumable.units import Unit

log = logging.getLogger("refinery")


@dataclass(frozen=True)
class Step:
    """One stage's part of a command's pipeline: the stage, bound, and its units to run;
    ``ref``: where the driver wrote those units (None: they travel in the job itself);
    ``to_run``: how many of them have no receipt (the others are checked, and most likely
    skipped, by the workers; None: all of them are to run)."""

    run: StageRun
    units: list[Unit]
    ref: PlanRef | None = None
    to_run: int | None = None


def bind_stages(stages: list[Stage], output: str) -> list[StageRun]:
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
        if stage.chained:  # an unchained stage's outputs are a function of what the next stage's hash covers
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
    plan: list[Unit]
    receipts: dict[str, Receipt]  # unit id -> receipt of the units done
    pending: list[Unit]  # of the units the stage needs now
    final: bool  # False: needed() will ask for more units once these are done
    stale: list[str] = field(default_factory=list)  # pending units whose receipt predates an upstream repair


def plan_runs(runs: list[StageRun], plans: list[list[Unit]], verify_checksums: bool) -> list[Planned]:
    """Each stage's done and pending units, in order. A stage's receipts are judged against
    the repair tokens its upstream units will have once the pending ones ran
    (:func:`next_repair`): a unit built before an upstream repair made in this run is pending."""
    planned: list[Planned] = []
    repairs: dict[str, str] = {}
    for run, plan in zip(runs, plans):
        run.upstream_repairs = dict(repairs)
        checks = run.check_all([u.id for u in plan], verify_checksums)
        receipts = {u.id: c.receipt for u in plan if (c := checks[u.id]).done and c.receipt is not None}
        needed, final = run.stage.needed(plan, receipts)
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


def final_stages_done(runs: list[StageRun], plans: list[list[Unit]], verify_checksums: bool = False) -> bool:
    """Whether every unit of the stages whose files are user-facing (``final_outputs``, and the
    last stage) is done by :func:`check_receipt`: then a run has nothing to do, whatever the
    stages before them hold (backward demand, :func:`demanded`), and their receipts need not
    be read: a no-op re-plan reads the final stages' receipts and one listing of each earlier
    stage's recorded repairs (the tokens the final receipts are judged against), not a receipt
    per unit of the corpus."""
    repairs: dict[str, str] = {}
    for i, (run, plan) in enumerate(zip(runs, plans)):
        if run.stage.final_outputs or i == len(runs) - 1:
            run.upstream_repairs = dict(repairs)
            checks = run.check_all([u.id for u in plan], verify_checksums)
            if not all(c.done for c in checks.values()):
                return False
            repairs.update(repairs_of(run.name, {u: c.receipt for u, c in checks.items() if c.receipt is not None}))
        else:
            repairs.update(run.ledger.recorded_repairs())
    return True


def plans_by_listing(runs: list[StageRun]) -> bool:
    """Whether the jobs of ``runs`` are planned from listings (:func:`run_stages`): no stage
    asks for units by what the done ones hold (``has_budget``) and each is a plain
    ``pipeline.RunStage`` step whose workers check every unit's receipt before running it."""
    return all(not r.stage.has_budget() and type(r.stage).step_transform is Stage.step_transform for r in runs)


def plan_ref(stage: Stage) -> PlanRef:
    """Where the plan of a bound stage lies (set by :func:`bind_stages`)."""
    if stage.plan_ref is None:
        raise RuntimeError(f"stage {stage.name}: not bound to an output (bind_stages sets where its plan lies)")
    return stage.plan_ref


def step_ref(run: StageRun, units: list[Unit]) -> PlanRef:
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
