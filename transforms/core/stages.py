"""Resumable stages: plan -> units -> idempotent unit outputs -> receipts -> barrier.

Every pipeline (prep, decon, generate, hydra) is a list of :class:`Stage` objects run by
:func:`run_stages`. A stage has a JSON config, a deterministic plan (a list of
:class:`Unit`), and ``run_unit(unit, ctx) -> stats`` which writes its files through a
:class:`UnitContext` so that they are recorded in the unit's receipt.

Layout under OUTPUT::

    .refinery/run.json                                 config, stage hashes, unit counts
    .refinery/<stage>/<stage_hash>/receipts/<unit>.json one per unit, written last, atomically
    .refinery/<stage>/<stage_hash>/parts/...            intermediate unit files
    .refinery/<stage>/<stage_hash>/progress/<unit>.json a running unit's counts so far (removed
                                                        when its receipt is written; progress only)
    .refinery/fingerprints/<stage>-<stage_hash>.json    input fingerprints of that plan (to say
                                                        which input changed when a plan changes)

Stage hash = sha256 of (stage name, config, input fingerprints, identity such as the
tokenizer, upstream stage hash). Hashes chain: changing stage k re-runs k and what follows
and keeps what precedes. Outputs of different plans never mix: parts live under the hash.

"Done" is decided by ONE function, :func:`~refinery.transforms.core.receipts.check_receipt`
(in :mod:`.receipts`, with the receipt schema below), used both by the planner (which
units are pending) and by the worker right before it runs a unit: the receipt says
completed, its stage hash matches, every listed file exists with the recorded size
(and sha256 with ``verify_checksums``), and no unit of an earlier stage was repaired
since it was built. A receipt whose files are missing means pending.

Repairs: a unit redone because its files were *damaged* (wrong size or sha256, or an
unreadable receipt) gets a new ``repair`` token in its receipt, because what was built
from it may have read the damage; each receipt records the repair tokens of the earlier
stages' done units it was built after (``upstream_repairs``), and a unit whose record
differs from the current one is pending. So a repair invalidates everything after it,
while a unit redone only because a file went missing (rebuilt identically) keeps its token
and invalidates nothing.

Stages run backward-demand-driven: if every unit of the last stages is done, earlier
stages are not run at all, even if their intermediate parts were deleted.

Each run first removes temp files left under OUTPUT by dead writers (``storage.remove_dead_temp_files``)
and, when a stage's hash differs from the previous run's, logs why (:mod:`.plan_changes`).
While a job runs, :mod:`.progress` draws its steps from their receipts.
``$REFINERY_UNIT_LOG`` (optional) receives one JSON line per unit start/skip/end: an audit
trail the fault-injection tests use (see RELIABILITY.md).

Receipt schema (JSON)::

    {schema, stage, stage_hash, unit, status: completed|failed,
     files: [{path (relative to OUTPUT), bytes, sha256}], stats,
     started_at, finished_at, host, error?: {type, message, traceback},
     repair?: token, upstream_repairs?: {"stage/unit": token}}
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import hashlib
import json
import logging
import os
import socket
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from refinery.transforms.core import storage
from refinery.transforms.core.plan_changes import explain_plan_changes, fingerprints_path
from refinery.transforms.core.plans import PlanRef, read_units
from refinery.transforms.core.progress import Progress
from refinery.transforms.core.receipts import (
    META_DIR,
    RECEIPT_SCHEMA,
    Completion,
    check_receipt,
    check_recorded_run,
    repairs_of,
)

log = logging.getLogger("refinery")

RUN_SCHEMA = "refinery.run/1"


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def short_hash(obj: Any, length: int = 16) -> str:
    return hashlib.sha256(canonical_json(obj)).hexdigest()[:length]


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


@dataclass(frozen=True)
class Unit:
    """One unit of work: a stable, file-name-safe id and a JSON-able payload."""

    id: str
    payload: dict = field(default_factory=dict)


class Stage:
    """Base class of a pipeline stage. Subclasses set ``name`` and implement ``plan``/``run_unit``.

    - ``config()``: JSON-able settings that change the unit outputs (enters the hash).
    - ``fingerprints()``: input fingerprints (path, size, mtime/generation) (enters the hash).
    - ``identity()``: other identities, e.g. the tokenizer's (enters the hash).
    - ``make_plan()``: the deterministic list of units (subclasses implement it; callers use
      ``plan()``, which makes it once in the driver, and in a worker reads what the driver
      wrote under OUTPUT: ``plan_ref``, set by :func:`bind_stages`, :mod:`.plans`).
    - ``driver_only``: attributes a worker never needs (input lists, plans): left out when
      the stage is pickled into a job once its plan is written, so that the job's size does
      not grow with the corpus.
    - ``run_unit(unit, ctx)``: do the work, write files only through ``ctx``, return stats.
    - ``needed(units, receipts)``: which units later stages need, given the completed
      receipts so far; returns (units, final). Default: all units, final. A stage with a
      budget (prep's ``--max-tokens``) asks for waves of units until the budget is met
      (each wave is a Beam job that ends at that stage).
    - ``side_inputs(run, start)``: Beam side inputs of the stage bound as ``run`` (its
      upstream stages are ``run.upstream[name]``), built from ``start``, a PCollection of
      one element that exists once every unit upstream completed; their values arrive as
      ``ctx.side``.
    - ``step_transform(run, units, verify_checksums, after, ref)``: the stage's own PTransform
      (PBegin -> PCollection of ``{unit, status, stats}``) when its units are not one
      ParDo each (inference: RunInference); ``ref``: where the driver wrote ``units``
      (``pipeline.ReadUnits`` reads them in the workers); None (the default):
      ``pipeline.RunStage``.
    - ``title``: the step's name in the command's Beam pipeline (``Tokenize units``).
    - ``light = True``: mostly I/O, or one unit: on the local multi-process runner a job
      of only light steps runs in the driver's process instead of starting a pool of
      worker processes (seconds of start-up for a second of work).
    - ``chained = False``: the stage's hash does not enter the hashes of the stages after it
      (its outputs are a pure function of inputs that the next stage's hash covers already).
    - ``final_outputs = True``: the stage writes user-facing files under fixed names that
      another plan's run would overwrite; receipts of other plans of it are discarded. Its
      pending units are always run (with what precedes them); a stage of intermediate files
      runs only for a later stage that runs (:func:`demanded`).
    """

    name: str = ""
    title: str = ""
    light: bool = False
    final_outputs: bool = False
    driver_only: tuple[str, ...] = ()
    chained: bool = True  # False: its hash does not enter the stages' after it (see bind_stages)
    plan_ref: PlanRef | None = None  # where the driver writes this stage's plan (bind_stages)
    _units: list[Unit] | None = None
    _unpickled = False  # True in a worker's copy: its plan is read from plan_ref

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not cls.__dict__.get("title") and cls.name:
            cls.title = cls.name.capitalize()

    def config(self) -> dict:
        return {}

    def fingerprints(self) -> list:
        return []

    def identity(self) -> dict:
        return {}

    def make_plan(self) -> list[Unit]:
        raise NotImplementedError

    def plan(self) -> list[Unit]:
        """The stage's units: made once (``make_plan``), or in a worker read from ``plan_ref``."""
        if self._units is None:
            if self.plan_ref is not None and self._unpickled:
                self._units = read_units(self.plan_ref)
            else:
                self._units = self.make_plan()
        return self._units

    def __getstate__(self) -> dict:
        """What a job carries of the stage: without its units and ``driver_only`` attributes once
        its plan has a place in the output (a worker reads the plan from there)."""
        state = dict(self.__dict__)
        if self.plan_ref is not None:
            state.pop("_units", None)
            for name in self.driver_only:
                state.pop(name, None)
        state["_unpickled"] = True
        return state

    def run_unit(self, unit: Unit, ctx: "UnitContext") -> dict:
        raise NotImplementedError

    def needed(self, units: list[Unit], receipts: dict[str, dict]) -> tuple[list[Unit], bool]:
        return units, True

    def has_budget(self) -> bool:
        """Whether ``needed`` asks for units by what the done ones hold (a token budget): then
        the driver reads the stage's receipts to plan (:func:`run_stages`)."""
        return False

    def side_inputs(self, run: "StageRun", start) -> dict:
        return {}

    def step_transform(self, run: "StageRun", units: list[Unit], verify_checksums: bool, after,
                       ref: PlanRef | None = None):
        return None

    def describe_progress(self, stats: dict, seconds: float) -> str:
        """A short progress postfix from the summed stats of finished units."""
        return ""


def compute_stage_hash(stage: Stage, upstream_hash: str | None) -> str:
    return short_hash({
        "stage": stage.name,
        "config": stage.config(),
        "inputs": stage.fingerprints(),
        "identity": stage.identity(),
        "upstream": upstream_hash,
    })


UNIT_LOG_ENV = "REFINERY_UNIT_LOG"


def _log_unit_event(event: str, run: "StageRun", unit_id: str) -> None:
    """Append ``{event, stage, stage_hash, unit, pid, t}`` to the file named by
    ``$REFINERY_UNIT_LOG`` (if set): an audit trail of unit starts/ends/skips across
    processes and runs (one ``write`` per line on an ``O_APPEND`` file). Fault-injection
    tests use it to prove that no unit starts again after its receipt was written."""
    path = os.environ.get(UNIT_LOG_ENV)
    if not path:
        return
    line = json.dumps({"event": event, "stage": run.name, "stage_hash": run.stage_hash, "unit": unit_id,
                       "pid": os.getpid(), "t": time.time()}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


CHECK_THREADS = 32  # receipt checks in flight at once on an object store


@functools.lru_cache(maxsize=8)
def _recorded_fingerprints(path: str) -> list:
    return storage.read_json(path)


@dataclass
class StageRun:
    """A stage bound to an output directory and its (chained) hash. Picklable.

    ``upstream_repairs``: the :func:`repairs_of` the earlier stages' done units, set by the
    planner; its units' receipts record it and :meth:`check` compares (None: not judged)."""

    stage: Stage
    output: str
    stage_hash: str
    upstream: dict[str, "StageRun"] = field(default_factory=dict)
    upstream_repairs: dict[str, str] | None = None
    listing_job: str | None = None  # a job planned from listings: the workers judge repairs (see execute_unit)

    @property
    def name(self) -> str:
        return self.stage.name

    @property
    def dir(self) -> str:
        return storage.join(self.output, META_DIR, self.stage.name, self.stage_hash)

    @property
    def receipts_dir(self) -> str:
        return storage.join(self.dir, "receipts")

    @property
    def parts_dir(self) -> str:
        return storage.join(self.dir, "parts")

    @property
    def repairs_dir(self) -> str:
        """One file per unit whose receipt carries a ``repair`` token, holding the token: the
        stage's repairs, known from one listing instead of every receipt."""
        return storage.join(self.dir, "repairs")

    def recorded_repairs(self) -> dict[str, str]:
        """``{"stage/unit": token}`` of the stage's units rebuilt over damaged files, from
        ``repairs_dir`` (what :func:`~.receipts.repairs_of` gives from their receipts)."""
        out = {}
        for path in storage.listdir(self.repairs_dir):
            name = storage.basename(path)
            if not storage.is_temp_name(name):
                out[f"{self.name}/{name}"] = storage.read_bytes(path).decode()
        return out

    def record_repair(self, unit_id: str, token: str) -> None:
        storage.atomic_write_bytes(storage.join(self.repairs_dir, unit_id), token.encode())

    @property
    def failures_dir(self) -> str:
        """One file per unit whose last attempt failed, holding why: the failures of a job,
        known from one listing instead of every receipt (removed when the unit completes)."""
        return storage.join(self.dir, "failures")

    def listed_units(self) -> set[str]:
        """Ids of the units that have a receipt file, whatever it says: one listing of the
        receipts folder (a LIST call per 1,000 receipts on an object store), no receipt read."""
        return {storage.basename(p)[:-len(".json")] for p in storage.listdir(self.receipts_dir)
                if p.endswith(".json") and not storage.is_temp_name(storage.basename(p))}

    def listed_failures(self) -> set[str]:
        """Ids of the units whose last attempt failed (``failures_dir``), from one listing."""
        return {storage.basename(p) for p in storage.listdir(self.failures_dir)
                if not storage.is_temp_name(storage.basename(p))}

    def listed_upstream_repairs(self) -> dict[str, str]:
        """The repair tokens of every earlier stage's units, from their ``repairs`` listings:
        what this stage's receipts are judged against once those stages have finished."""
        out: dict[str, str] = {}
        for up in self.upstream.values():
            out.update(up.recorded_repairs())
        return dict(sorted(out.items()))

    def receipt_path(self, unit_id: str) -> str:
        return storage.join(self.receipts_dir, f"{unit_id}.json")

    @property
    def progress_dir(self) -> str:
        """One file per running unit that has reported its counts so far
        (:meth:`UnitContext.report_progress`): what the progress display adds to the finished
        units' receipts. Never read to decide what is done."""
        return storage.join(self.dir, "progress")

    def progress_path(self, unit_id: str) -> str:
        return storage.join(self.progress_dir, f"{unit_id}.json")

    def input_fingerprints(self) -> list:
        """The stage's input fingerprints (``Stage.fingerprints``): its own in the driver, else,
        in a worker (whose job does not carry input lists), those the driver recorded under
        OUTPUT for this plan (:func:`record_inputs`), read once per process."""
        try:
            return self.stage.fingerprints()
        except AttributeError:  # a driver_only input list, left out of the job
            return _recorded_fingerprints(fingerprints_path(self.output, self.name, self.stage_hash))

    def check(self, unit_id: str, verify_checksums: bool = False) -> Completion:
        """:func:`check_receipt` of one unit, judged against ``upstream_repairs``, or in a job
        planned from listings against the earlier stages' repairs listed once they finished."""
        if self.listing_job is not None:
            self.upstream_repairs = _listed_repairs(self.listing_job, self)
        return check_receipt(self.output, self.receipt_path(unit_id), self.stage_hash, verify_checksums,
                             self.upstream_repairs)

    def check_all(self, unit_ids: list[str], verify_checksums: bool = False) -> dict[str, Completion]:
        """:meth:`check` of many units. On an object store every check is a few requests of
        tens of milliseconds each, so they are made CHECK_THREADS at a time."""
        if not storage.is_remote(self.output) or len(unit_ids) < 2:
            return {u: self.check(u, verify_checksums) for u in unit_ids}
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(CHECK_THREADS) as pool:
            return dict(zip(unit_ids, pool.map(lambda u: self.check(u, verify_checksums), unit_ids)))

    def pending(self, units: list[Unit], verify_checksums: bool = False) -> list[Unit]:
        checks = self.check_all([u.id for u in units], verify_checksums)
        return [u for u in units if not checks[u.id].done]

    def completed_receipts(self, units: list[Unit] | None = None, verify_checksums: bool = False) -> dict[str, dict]:
        """Receipts of the completed units (of ``units``, default: the whole plan)."""
        units = self.stage.plan() if units is None else units
        checks = self.check_all([u.id for u in units], verify_checksums)
        return {u.id: checks[u.id].receipt for u in units if checks[u.id].done}

    def read_receipts(self, cache: dict[str, dict] | None = None) -> Iterator[dict]:
        """Every parseable receipt of this stage hash, whatever its status (for status/progress).

        ``cache`` (path -> receipt): completed receipts read before are taken from it and new
        ones added, so a progress poll on GCS reads only the receipts that appeared since
        the last poll (one listing + one GET per new receipt, not one GET per unit).
        """
        for path in storage.listdir(self.receipts_dir):
            if path.endswith(".json") and not storage.is_temp_name(storage.basename(path)):
                if cache is not None and path in cache:
                    yield cache[path]
                    continue
                with contextlib.suppress(ValueError, OSError):
                    r = storage.read_json(path)
                    if isinstance(r, dict) and r.get("stage_hash") == self.stage_hash:
                        if cache is not None and r.get("status") == "completed":
                            cache[path] = r
                        yield r


# How often a running unit publishes its counts (:meth:`UnitContext.report_progress`), in
# seconds: on a local disk about every second; on an object store, where a write is a request
# the user pays for, every 10 s. A unit shorter than the first interval writes none.
PROGRESS_EVERY_S = 1.0
REMOTE_PROGRESS_EVERY_S = 10.0


class UnitContext:
    """What ``run_unit`` writes through. Every file written here is listed in the receipt."""

    def __init__(self, run: StageRun, unit: Unit, side: dict | None = None):
        self.run = run
        self.unit = unit
        self.output = run.output
        self.parts_dir = run.parts_dir
        self.side = side or {}
        self.files: list[dict] = []
        self._progress_every = REMOTE_PROGRESS_EVERY_S if storage.is_remote(run.output) else PROGRESS_EVERY_S
        self._next_progress = time.monotonic() + self._progress_every
        self.progress_written = False

    def report_progress(self, counts: dict[str, int | float]) -> None:
        """Publish the unit's counts so far (the keys of its final stats that the stage's
        ``describe_progress`` shows, e.g. documents and tokens), so that the progress display
        moves while a long unit runs. Cheap to call often: it writes at most every
        :data:`PROGRESS_EVERY_S` (:data:`REMOTE_PROGRESS_EVERY_S` on an object store) and
        never for a unit shorter than that. A failed write is ignored: progress is a display."""
        now = time.monotonic()
        if now < self._next_progress:
            return
        self._next_progress = now + self._progress_every
        with contextlib.suppress(OSError):
            storage.atomic_write_json(self.run.progress_path(self.unit.id),
                                      {"unit": self.unit.id, "stats": dict(counts), "updated_at": _now()})
            self.progress_written = True

    def part_path(self, name: str) -> str:
        return storage.join(self.parts_dir, name)

    def output_path(self, relpath: str) -> str:
        return storage.join(self.output, relpath)

    def _relpath(self, path: str) -> str:
        """``path`` relative to OUTPUT, normalized; ValueError if it is not inside OUTPUT
        (a ``..`` escape is judged after normalization, not before)."""
        root = self.output.rstrip("/") + "/"
        if not path.startswith(root):
            raise ValueError(f"{path} is outside the output directory {self.output}")
        try:
            return storage.safe_relpath(path[len(root):])
        except ValueError:
            raise ValueError(f"{path} is outside the output directory {self.output}") from None

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[storage.HashingWriter]:
        rel = self._relpath(path)
        with storage.atomic_open(path) as f:
            yield f
        self.files.append({"path": rel, "bytes": f.bytes_written, "sha256": f.sha256})

    def write_bytes(self, path: str, data: bytes) -> None:
        with self.open_write(path) as f:
            f.write(data)

    def upstream(self, stage_name: str) -> StageRun:
        return self.run.upstream[stage_name]


# CPython 3.11 can raise this in a thread that builds an AST (``ast.parse``, a traceback's
# caret line) while another thread does the same (python/cpython#106905): the unit's work is
# not at fault, so it is run once more before it is called failed.
_INTERPRETER_GLITCHES = ("AST constructor recursion depth mismatch",)


def _interpreter_glitch(e: BaseException) -> bool:
    return isinstance(e, SystemError) and str(e).startswith(_INTERPRETER_GLITCHES)


def _run_unit(run: StageRun, unit: Unit, side: dict | None) -> tuple[dict, "UnitContext"]:
    """(stats, context) of one unit's work; an interpreter glitch (see above) runs it again once."""
    ctx = UnitContext(run, unit, side)
    try:
        return run.stage.run_unit(unit, ctx) or {}, ctx
    except SystemError as e:
        if not _interpreter_glitch(e):
            raise
        log.warning("unit %s/%s: %s (a Python interpreter glitch); running it again", run.name, unit.id, e)
    ctx = UnitContext(run, unit, side)
    return run.stage.run_unit(unit, ctx) or {}, ctx


def execute_unit(run: StageRun, unit: Unit, verify_checksums: bool = False,
                 side: dict | None = None, stale: Callable[[dict], bool] | None = None) -> dict:
    """Run one unit unless :func:`check_receipt` says it is done; write its receipt last.

    Returns the receipt (with ``"skipped": True`` added, not stored, if it was already done).
    A failing unit gets a ``failed`` receipt with the error and is retried on the next run;
    the exception is not re-raised, so one bad unit does not abort the others. ``stale``:
    a done unit whose receipt it calls stale is run again (a sink whose input changed).
    A unit redone over damaged files gets a new ``repair`` token (derived from the previous
    one and the damage, so two runs repairing the same damage agree); otherwise it keeps
    the previous receipt's token.

    In a job planned from listings (``run.listing_job``), the earlier stages' repair tokens
    are read by :meth:`StageRun.check`, from their listings, once per job and process: they
    have finished when a unit of this stage runs. A failed unit is also recorded under ``failures/`` (before
    its receipt), a repaired one under ``repairs/`` (before its receipt), so that the
    driver learns both from listings.
    """
    done = run.check(unit.id, verify_checksums)
    if done.done and not (stale and stale(done.receipt)):
        _log_unit_event("skip", run, unit.id)
        return {**done.receipt, "skipped": True}
    _log_unit_event("start", run, unit.id)
    ctx = UnitContext(run, unit, side)  # replaced by the one of the attempt that returns
    receipt = {
        "schema": RECEIPT_SCHEMA, "stage": run.name, "stage_hash": run.stage_hash, "unit": unit.id,
        "started_at": _now(), "host": socket.gethostname(), "pid": os.getpid(),
    }
    if repair := next_repair(done):
        receipt["repair"] = repair
    if run.upstream_repairs:
        receipt["upstream_repairs"] = run.upstream_repairs
    try:
        stats, ctx = _run_unit(run, unit, side)
        receipt.update(status="completed", files=ctx.files, stats=stats)
    except Exception as e:  # noqa: BLE001 - recorded in the receipt, retried next run
        receipt.update(status="failed", files=ctx.files, stats={}, error={
            "type": type(e).__name__, "message": str(e)[:2000],
            "traceback": traceback.format_exc()[-4000:],
        })
        log.error("unit %s/%s failed: %s: %s", run.name, unit.id, type(e).__name__, e)
    receipt["finished_at"] = _now()
    failure = storage.join(run.failures_dir, unit.id)
    if receipt["status"] == "completed":
        if repair:  # before the receipt: a kill between the two leaves the unit pending, not unrecorded
            run.record_repair(unit.id, repair)
        storage.remove(failure, root=run.output)
    else:
        storage.atomic_write_bytes(failure, f"{receipt['error']['type']}: {receipt['error']['message']}"[:500].encode())
    storage.atomic_write_json(run.receipt_path(unit.id), receipt)
    if ctx.progress_written or receipt["status"] != "completed":  # its counts are in the receipt now
        with contextlib.suppress(OSError):
            storage.remove(run.progress_path(unit.id), root=run.output)
    _log_unit_event("end-" + receipt["status"], run, unit.id)
    return receipt


_LISTED_REPAIRS: dict[tuple[str, str], dict[str, str]] = {}


def _listed_repairs(job: str, run: StageRun) -> dict[str, str]:
    """:meth:`StageRun.listed_upstream_repairs` of ``run``, read once per job (``job``) per process."""
    key = (job, run.dir)
    if key not in _LISTED_REPAIRS:
        if len(_LISTED_REPAIRS) > 64:
            _LISTED_REPAIRS.clear()
        _LISTED_REPAIRS[key] = run.listed_upstream_repairs()
    return _LISTED_REPAIRS[key]


# ---------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------

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
    runs: list[StageRun]
    ran: dict[str, int]  # stage -> units executed this time
    skipped_stages: list[str]
    seconds: dict[str, float] = field(default_factory=dict)  # stage -> wall time this time
    metrics: dict[str, dict[str, int]] = field(default_factory=dict)  # stage -> the runner's refinery counters


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


def _discard_other_plans(run: StageRun) -> None:
    """Remove receipts of other plans of a stage that writes fixed, user-facing names."""
    stage_root = storage.join(run.output, META_DIR, run.name)
    for path in storage.listdir(stage_root):
        if storage.basename(path) != run.stage_hash:
            log.info("discarding receipts of plan %s of stage %s (its outputs are being replaced)",
                     storage.basename(path), run.name)
            storage.remove_tree(path, root=run.output)


def next_repair(done: Completion) -> str | None:
    """The ``repair`` token a unit gets when it is run now, given its :func:`check_receipt`:
    a unit redone over damaged files gets a new one (derived from the previous one and the
    damage, so two runs repairing the same damage agree); otherwise it keeps the previous
    receipt's token. The planner uses it to know, before anything runs, what the later
    stages' receipts will record as ``upstream_repairs``."""
    repair = (done.receipt or {}).get("repair")
    if done.damaged:
        repair = short_hash({"after": repair, "damage": done.reason})
    return repair


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
class _Planned:
    run: StageRun
    plan: list[Unit]
    receipts: dict[str, dict]  # unit id -> receipt of the units done
    pending: list[Unit]  # of the units the stage needs now
    final: bool  # False: needed() will ask for more units once these are done
    stale: list[str] = field(default_factory=list)  # pending units whose receipt predates an upstream repair


def _plan_runs(runs: list[StageRun], plans: list[list[Unit]], verify_checksums: bool) -> list[_Planned]:
    """Each stage's done and pending units, in order. A stage's receipts are judged against
    the repair tokens its upstream units will have once the pending ones ran
    (:func:`next_repair`): a unit built before an upstream repair made in this run is pending."""
    planned: list[_Planned] = []
    repairs: dict[str, str] = {}
    for run, plan in zip(runs, plans):
        run.upstream_repairs = dict(repairs)
        checks = run.check_all([u.id for u in plan], verify_checksums)
        receipts = {u.id: checks[u.id].receipt for u in plan if checks[u.id].done}
        needed, final = run.stage.needed(plan, receipts)
        pending = [u for u in needed if u.id not in receipts]
        done_repairs = repairs_of(run.name, receipts)
        if done_repairs and run.recorded_repairs() != done_repairs:  # a run killed before it recorded one
            for key, token in done_repairs.items():
                run.record_repair(key.split("/", 1)[1], token)
        repairs.update(done_repairs)
        for u in pending:
            if token := next_repair(checks[u.id]):
                repairs[f"{run.name}/{u.id}"] = token
        planned.append(_Planned(run, plan, receipts, pending, final, [u.id for u in pending if checks[u.id].stale]))
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
            repairs.update(repairs_of(run.name, {u: c.receipt for u, c in checks.items()}))
        else:
            repairs.update(run.recorded_repairs())
    return True


def plans_by_listing(runs: list[StageRun]) -> bool:
    """Whether the jobs of ``runs`` are planned from listings (:func:`run_stages`): no stage
    asks for units by what the done ones hold (``has_budget``) and each is a plain
    ``pipeline.RunStage`` step whose workers check every unit's receipt before running it."""
    return all(not r.stage.has_budget() and type(r.stage).step_transform is Stage.step_transform for r in runs)


def _listing_steps(runs: list[StageRun], plans: list[list[Unit]]) -> tuple[list, dict[str, list[str]]]:
    """The steps of a job planned from listings: every unit of every stage (the workers skip
    the ones whose receipt verifies), and per stage the ids of the units
    with no receipt file (run now, for certain)."""
    import uuid

    from refinery.transforms.core.pipeline import Step

    job = uuid.uuid4().hex[:16]
    steps, fresh = [], {}
    for run, plan in zip(runs, plans):
        run.listing_job = job
        if not plan:
            continue
        listed = run.listed_units()
        fresh[run.name] = [u.id for u in plan if u.id not in listed]
        log.info("stage %s [%s]: %d of %d units have no receipt; the workers check the other %d before running them",
                 run.name, run.stage_hash, len(fresh[run.name]), len(plan), len(plan) - len(fresh[run.name]))
        steps.append(Step(run, plan, to_run=len(fresh[run.name])))
    return steps, fresh


def _listed_unfinished(run: StageRun, units: list[Unit]) -> list[str]:
    """Ids of ``units`` with no receipt file, or whose last attempt is listed under ``failures/``:
    the units a job planned from listings may not have completed (two listings, no receipt read)."""
    listed, failed = run.listed_units(), run.listed_failures()
    return [u.id for u in units if u.id not in listed or u.id in failed]


def _listing_failures(run: StageRun, units: list[Unit], verify_checksums: bool) -> dict[str, str]:
    """After a job planned from listings: unit id -> why it is not done, of ``units`` of ``run``.
    Only the units without a receipt file, or listed under ``failures/``, are checked (the
    workers checked the others); a failure record left by a kill after its unit completed is
    removed."""
    out = {}
    for unit_id, c in run.check_all(_listed_unfinished(run, units), verify_checksums).items():
        if c.done:
            storage.remove(storage.join(run.failures_dir, unit_id), root=run.output)
        else:
            out[unit_id] = c.reason
    return out


def _read_receipts_of(run: StageRun, unit_ids: list[str]) -> list[dict]:
    """The receipts of ``unit_ids`` that can be read (CHECK_THREADS at a time on an object store)."""
    def read(unit_id: str) -> dict | None:
        try:
            r = storage.read_json(run.receipt_path(unit_id))
        except (OSError, ValueError):
            return None
        return r if isinstance(r, dict) else None

    if not storage.is_remote(run.output) or len(unit_ids) < 2:
        found = [read(u) for u in unit_ids]
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(CHECK_THREADS) as pool:
            found = list(pool.map(read, unit_ids))
    return [r for r in found if r is not None]


def _span_seconds(receipts: list[dict]) -> float:
    """Wall time from the first unit's start to the last one's end (0 if none ran)."""
    try:
        starts = [_dt.datetime.fromisoformat(r["started_at"]) for r in receipts]
        ends = [_dt.datetime.fromisoformat(r["finished_at"]) for r in receipts]
    except (KeyError, TypeError, ValueError):
        return 0.0
    return (max(ends) - min(starts)).total_seconds() if starts else 0.0


def step_ref(run: StageRun, units: list[Unit]) -> PlanRef:
    """Where the units one job runs of ``run`` lie: its plan's parts when they are the whole
    plan, else ``steps/<hash of their ids>/`` (written by :func:`write_plans`)."""
    plan = run.stage.plan()
    if len(units) == len(plan) and all(a.id == b.id for a, b in zip(units, plan)):
        return run.stage.plan_ref
    return PlanRef(storage.join(run.dir, "steps", short_hash([u.id for u in units])), len(units))


def record_inputs(run: StageRun, fingerprints: list) -> None:
    """Write the input ``fingerprints`` of ``run``'s plan (``Stage.fingerprints()``) under OUTPUT,
    unless already there: what a later run names changed inputs from, and what a worker reads
    for the stage's input list (:meth:`StageRun.input_fingerprints`)."""
    path = fingerprints_path(run.output, run.name, run.stage_hash)
    if fingerprints and not storage.exists(path):
        storage.atomic_write_json(path, fingerprints)


def write_plans(runs: list[StageRun], steps: list) -> list:
    """Write the plan of every stage of ``runs``, and the units of each step (``pipeline.Step``),
    into the output, where the job's workers read them; the steps with their ``ref`` set.
    (The input fingerprints a worker may read too are :func:`record_inputs`'.)"""
    from dataclasses import replace

    from refinery.transforms.core.plans import write_units

    for r in runs:
        write_units(r.stage.plan_ref, r.stage.plan())
    out = []
    for s in steps:
        ref = step_ref(s.run, s.units)
        write_units(ref, s.units)
        out.append(replace(s, ref=ref))
    return out


def unit_counters(stage: str, receipt: dict) -> dict[str, int]:
    """The counters one unit's receipt adds: ``<stage>_units_<status>`` (``skipped`` for a unit
    found done, ``blocked`` for one whose upstream failed), and for a unit run now
    ``<stage>_<stat>`` for each integer stat (``tokenize_tokens``, ``scan_verified_hits``, ...)."""
    if receipt.get("skipped"):
        return {f"{stage}_units_skipped": 1}
    out = {f"{stage}_units_{receipt['status']}": 1}
    for key, v in (receipt.get("stats") or {}).items():
        if isinstance(v, int) and not isinstance(v, bool):
            out[f"{stage}_{key}"] = v
    return out


def span_key(stage: str) -> str:
    """The key of a runner's counters that holds ``stage``'s wall time in ms this job: from its
    first unit's start to its last one's end, over the units run now (:func:`unit_times_ms`)."""
    return f"{stage}:span_ms"


def unit_times_ms(receipt: dict) -> tuple[int, int] | None:
    """(start, end) of a unit run now, in ms since the epoch, from its receipt (None: skipped, blocked)."""
    if receipt.get("skipped") or "started_at" not in receipt:
        return None
    try:
        start, end = (_dt.datetime.fromisoformat(receipt[k]) for k in ("started_at", "finished_at"))
    except (KeyError, TypeError, ValueError):
        return None
    return int(start.timestamp() * 1000), int(end.timestamp() * 1000)


def run_in_driver(steps: list, beam_args: list[str] | None = None, verify_checksums: bool = False) -> dict:
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


def _checked_steps(runs: list[StageRun], plans: list[list[Unit]], verify_checksums: bool,
                   output: str) -> tuple[list, list[StageRun], bool]:
    """The steps of a job planned by reading every receipt (a stage with a budget, or one with
    its own step transform): each stage's pending units up to the last demanded stage, or up
    to a stage whose ``needed`` will ask for more; the stages of the job; whether the job is
    the last one. Receipts built before an upstream repair are removed first."""
    from refinery.transforms.core.pipeline import Step

    planned = _plan_runs(runs, plans, verify_checksums)
    last = demanded([p.run.stage.final_outputs for p in planned], [bool(p.pending) for p in planned])
    job: list[_Planned] = []
    for p in planned[:last + 1]:
        job.append(p)
        if not p.final:
            if not p.pending:
                raise RuntimeError(f"stage {p.run.name}: needed() asked for more units but none is pending")
            break
    for p in job:
        if p.pending:
            log.info("stage %s [%s]: %d of %d units pending", p.run.name, p.run.stage_hash,
                     len(p.pending), len(p.plan))
    steps = [Step(p.run, p.pending) for p in job if p.pending]
    if steps:
        for p in job:  # receipts built before an upstream repair go first: a later run, even one
            for unit_id in p.stale:  # killed before these units are redone, sees them pending
                storage.remove(p.run.receipt_path(unit_id), root=output)
    return steps, [p.run for p in job], not job or job[-1].final


def _first_unfinished(steps: list, by_listing: bool) -> str:
    """The stage a failed job is reported at: the first step with a unit not done (by listings
    for a job planned from them: a unit with no receipt or a recorded failure)."""
    for s in steps:
        if by_listing:
            if _listed_unfinished(s.run, s.units):
                return s.run.name
        elif not all(c.done for c in s.run.check_all([u.id for u in s.units]).values()):
            return s.run.name
    return steps[-1].run.name


def run_stages(stages: list[Stage], output: str, beam_args: list[str], *,
               verify_checksums: bool = False, force: bool = False, progress: bool = True,
               run_info: dict | None = None,
               on_plan: Callable[[list[StageRun], list[list[Unit]]], None] | None = None,
               runner: Callable[[list, list[str], bool], dict | None] | None = None) -> JobResult:
    """Run ``stages`` in order on ``output``, skipping every unit whose receipt verifies.

    The driver plans. Commonly (:func:`plans_by_listing`) it reads only the receipts of the
    stages with user-facing files (:func:`final_stages_done`); when one has a unit not done,
    a job runs every unit of every stage, and its workers check each
    receipt (:func:`check_receipt`, as always) before running the unit: a valid one is
    skipped there. The driver learns the rest from listings: of each stage's receipts
    before the job (the units that will run for certain, for the log and the local
    runner's choice of processes) and, after it, of receipts and ``failures/``; it reads
    only the receipts of the units that ran, for the time each stage took. A run with a
    stage that has a budget, or its own step transform (inference), is planned the older
    way: every receipt checked in the driver, and only the pending units in the job (up
    to the last one with pending units; a stage after it is done, so what precedes it is
    not needed again). ``runner(steps, beam_args, verify_checksums)`` then
    runs those steps (``pipeline.Step``: stage + units) as ONE Beam job, each step after
    the one before (default: ``pipeline.run_on_beam``; :func:`run_in_driver` runs them here,
    without Beam) and may return the runner's counters, kept per stage in
    ``JobResult.metrics``. A stage with a budget (``needed`` not final) ends a job; the
    next job, planned again, goes on from there.

    ``force`` deletes ``OUTPUT/.refinery`` first (a fresh run). ``on_plan`` is called with
    the bound stages and their plans before anything runs (prep uses it to clear a stale
    manifest). Raises :class:`StageFailed` naming the first stage with units not
    completed, :class:`JobFailed` when the Beam job failed; the receipts of everything that
    finished are kept for the next run.
    """
    if runner is None:
        from refinery.transforms.core.pipeline import run_on_beam as runner
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
    fingerprints = [r.stage.fingerprints() for r in runs]  # once: a list per input file
    entries = [{"name": r.name, "stage_hash": r.stage_hash, "units": len(p), "config": r.stage.config(),
                "inputs_hash": short_hash(fps), "identity_hash": short_hash(r.stage.identity()),
                "final": r.stage.final_outputs or i == len(runs) - 1}
               for i, (r, p, fps) in enumerate(zip(runs, plans, fingerprints))]
    for r, fps in zip(runs, fingerprints):
        record_inputs(r, fps)
    try:
        previous = storage.read_json(run_json)
    except (FileNotFoundError, ValueError):
        previous = None
    if isinstance(previous, dict):
        for line in explain_plan_changes(output, previous, entries):
            log.warning("%s", line)
    storage.atomic_write_json(run_json, {"schema": RUN_SCHEMA, **(run_info or {}), "stages": entries})
    if on_plan:
        on_plan(runs, plans)

    ran: dict[str, int] = {}
    seconds: dict[str, float] = {}
    metrics: dict[str, dict[str, int]] = {}
    discarded: set[str] = set()
    by_listing = plans_by_listing(runs)
    while True:
        fresh: dict[str, list[str]] = {}
        if by_listing:  # only the final stages' receipts are read here; the workers check the rest
            # a unit repaired in the job invalidates what was built from it, even in a final stage
            # found done here: with anything to do, every stage is in the job (done units skip)
            if not verify_checksums and final_stages_done(runs, plans):
                break  # with checksums, every unit's files are verified: by the workers
            steps, fresh = _listing_steps(runs, plans)
            job_runs, final_job = runs, True
        else:
            if not verify_checksums and final_stages_done(runs, plans):
                break  # nothing to do: the earlier stages' receipts are not read
            steps, job_runs, final_job = _checked_steps(runs, plans, verify_checksums, output)
        for run in job_runs:
            ran.setdefault(run.name, 0)
            if run.stage.final_outputs and run.name not in discarded:
                _discard_other_plans(run)
                discarded.add(run.name)
        if not steps:
            break
        steps = write_plans(job_runs, steps)
        with Progress([(s.run, len(s.units)) for s in steps], interval=10.0 if storage.is_remote(output) else 1.0,
                      enabled=progress):
            try:
                counters = runner(steps, beam_args, verify_checksums) or {}
            except Exception as e:  # noqa: BLE001 - the runner's failure, reported as one line
                log.info("the Beam job failed", exc_info=True)
                raise JobFailed(_first_unfinished(steps, by_listing), e) from e
        for s in steps:
            mine = {k: v for k, v in counters.items() if k.startswith(s.run.name + "_")}
            log.info("stage %s: runner counters %s", s.run.name, json.dumps(mine, sort_keys=True))
            if mine:
                stage_counters = metrics.setdefault(s.run.name, {})
                for k, v in mine.items():
                    stage_counters[k] = stage_counters.get(k, 0) + v
        for s in steps:
            if by_listing:
                failures = _listing_failures(s.run, s.units, verify_checksums)
                # the stage's wall time: from the runner's metrics, else from the receipts of the units run
                new = [] if span_key(s.run.name) in counters else \
                    _read_receipts_of(s.run, [u for u in fresh[s.run.name] if u not in failures])
                if any(k.startswith(f"{s.run.name}_units_") for k in counters):
                    ran[s.run.name] += sum(counters.get(f"{s.run.name}_units_{k}", 0) for k in ("completed", "failed"))
                else:  # a runner without metrics: the units that had no receipt
                    ran[s.run.name] += len(fresh[s.run.name])
            else:
                ran[s.run.name] += len(s.units)
                checks = s.run.check_all([u.id for u in s.units], verify_checksums)
                failures = {u: c.reason for u, c in checks.items() if not c.done}
                new = [c.receipt for c in checks.values()]
            if failures:
                raise StageFailed(s.run.name, failures)
            span = counters[span_key(s.run.name)] / 1000 if span_key(s.run.name) in counters else _span_seconds(new)
            seconds[s.run.name] = seconds.get(s.run.name, 0.0) + span
        if final_job:
            break
    if by_listing and not any(ran.values()):
        ran.clear()  # the workers found every unit done (a run with --verify-checksums): nothing ran
    return JobResult(runs, ran, [r.name for r in runs if r.name not in ran], seconds, metrics)


def stage_status(output: str, verify_checksums: bool = False) -> list[dict]:
    """Per stage of the run recorded in OUTPUT: units done/failed/pending, each receipt judged
    by :func:`check_receipt` (a receipt whose files are missing or truncated is pending)."""
    run_json = storage.join(output, META_DIR, "run.json")
    try:
        info = storage.read_json(run_json)
    except FileNotFoundError:
        raise FileNotFoundError(f"{output}: no refinery run here ({run_json} not found)") from None
    rows = []
    for st, _, checks in check_recorded_run(output, info, verify_checksums):
        done = failed = 0
        for c in checks:
            done += c.done
            failed += c.failed
        rows.append({"stage": st["name"], "stage_hash": st["stage_hash"], "units": st["units"],
                     "done": done, "failed": failed, "pending": max(0, st["units"] - done - failed),
                     "final": bool(st.get("final", st is info["stages"][-1]))})
    last = demanded([r["final"] for r in rows], [r["done"] < r["units"] for r in rows])
    for i, r in enumerate(rows):
        r["needed"] = i <= last  # False: a next run would not run it (the stages after it are complete)
    return rows

