"""Resumable stages: plan -> units -> idempotent unit outputs -> receipts -> barrier.

Every pipeline (prep, decon, generate, hydra) is a list of :class:`Stage` objects run by
:func:`run_stages`. A stage has a JSON config, a deterministic plan (a list of
:class:`Unit`), and ``run_unit(unit, ctx) -> stats`` which writes its files through a
:class:`UnitContext` so that they are recorded in the unit's receipt.

Layout under OUTPUT::

    .refinery/run.json                                 config, stage hashes, unit counts
    .refinery/<stage>/<stage_hash>/receipts/<unit>.json one per unit, written last, atomically
    .refinery/<stage>/<stage_hash>/parts/...            intermediate unit files

Stage hash = sha256 of (stage name, config, input fingerprints, identity such as the
tokenizer, upstream stage hash). Hashes chain: changing stage k re-runs k and what follows
and keeps what precedes. Outputs of different plans never mix: parts live under the hash.

"Done" is decided by ONE function, :func:`check_receipt`, used both by the planner (which
units are pending) and by the worker right before it runs a unit: the receipt says
completed, its stage hash matches, and every listed file exists with the recorded size
(and sha256 with ``verify_checksums``). A receipt whose files are missing means pending.

Stages run backward-demand-driven: if every unit of the last stages is done, earlier
stages are not run at all, even if their intermediate parts were deleted.

Receipt schema (JSON)::

    {schema, stage, stage_hash, unit, status: completed|failed,
     files: [{path (relative to OUTPUT), bytes, sha256}], stats,
     started_at, finished_at, host, error?: {type, message, traceback}}
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from . import io

log = logging.getLogger("refinery")

RECEIPT_SCHEMA = "refinery.receipt/1"
RUN_SCHEMA = "refinery.run/1"
META_DIR = ".refinery"


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
    - ``plan()``: the deterministic list of units.
    - ``run_unit(unit, ctx)``: do the work, write files only through ``ctx``, return stats.
    - ``needed(units, receipts)``: which units later stages need, given the completed
      receipts so far; returns (units, final). Default: all units, final. A stage with a
      budget (prep's ``--max-tokens``) asks for waves of units until the budget is met.
    - ``side_inputs(pipeline)``: Beam side inputs; their values arrive as ``ctx.side``.
    - ``local = True``: run in the driver, without Beam (small reduce/manifest stages).
    - ``final_outputs = True``: the stage writes user-facing files under fixed names that
      another plan's run would overwrite; receipts of other plans of it are discarded.
    """

    name: str = ""
    local: bool = False
    final_outputs: bool = False

    def config(self) -> dict:
        return {}

    def fingerprints(self) -> list:
        return []

    def identity(self) -> dict:
        return {}

    def plan(self) -> list[Unit]:
        raise NotImplementedError

    def run_unit(self, unit: Unit, ctx: "UnitContext") -> dict:
        raise NotImplementedError

    def needed(self, units: list[Unit], receipts: dict[str, dict]) -> tuple[list[Unit], bool]:
        return units, True

    def side_inputs(self, pipeline) -> dict:
        return {}

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


@dataclass(frozen=True)
class Completion:
    done: bool
    reason: str
    receipt: dict | None = None


def check_receipt(output: str, receipt_path: str, stage_hash: str,
                  verify_checksums: bool = False) -> Completion:
    """THE completion check. Used by the planner and by the worker; nothing else decides."""
    try:
        raw = io.read_bytes(receipt_path)
    except FileNotFoundError:
        return Completion(False, "no receipt")
    try:
        receipt = json.loads(raw)
        if not isinstance(receipt, dict):
            raise ValueError("not an object")
    except ValueError as e:
        return Completion(False, f"unreadable receipt ({e})")
    if receipt.get("schema") != RECEIPT_SCHEMA or receipt.get("stage_hash") != stage_hash:
        return Completion(False, "receipt from another plan", receipt)
    if receipt.get("status") != "completed":
        err = receipt.get("error") or {}
        return Completion(False, f"{receipt.get('status')}: {err.get('type', '')} {err.get('message', '')}".strip(), receipt)
    files = receipt.get("files")
    if not isinstance(files, list):
        return Completion(False, "receipt lists no files", receipt)
    for entry in files:
        path = io.join(output, entry["path"])
        size = io.file_size(path)
        if size is None:
            return Completion(False, f"missing output {entry['path']}", receipt)
        if size != entry["bytes"]:
            return Completion(False, f"size mismatch for {entry['path']}: {size} != {entry['bytes']}", receipt)
        if verify_checksums and io.sha256_file(path) != entry["sha256"]:
            return Completion(False, f"checksum mismatch for {entry['path']}", receipt)
    return Completion(True, "completed", receipt)


@dataclass
class StageRun:
    """A stage bound to an output directory and its (chained) hash. Picklable."""

    stage: Stage
    output: str
    stage_hash: str
    upstream: dict[str, "StageRun"] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.stage.name

    @property
    def dir(self) -> str:
        return io.join(self.output, META_DIR, self.stage.name, self.stage_hash)

    @property
    def receipts_dir(self) -> str:
        return io.join(self.dir, "receipts")

    @property
    def parts_dir(self) -> str:
        return io.join(self.dir, "parts")

    def receipt_path(self, unit_id: str) -> str:
        return io.join(self.receipts_dir, f"{unit_id}.json")

    def check(self, unit_id: str, verify_checksums: bool = False) -> Completion:
        return check_receipt(self.output, self.receipt_path(unit_id), self.stage_hash, verify_checksums)

    def pending(self, units: list[Unit], verify_checksums: bool = False) -> list[Unit]:
        return [u for u in units if not self.check(u.id, verify_checksums).done]

    def completed_receipts(self, units: list[Unit] | None = None, verify_checksums: bool = False) -> dict[str, dict]:
        """Receipts of the completed units (of ``units``, default: the whole plan)."""
        units = self.stage.plan() if units is None else units
        out = {}
        for u in units:
            c = self.check(u.id, verify_checksums)
            if c.done:
                out[u.id] = c.receipt
        return out

    def read_receipts(self) -> Iterator[dict]:
        """Every parseable receipt of this stage hash, whatever its status (for status/progress)."""
        for path in io.listdir(self.receipts_dir):
            if path.endswith(".json") and io.TMP_MARKER not in path:
                with contextlib.suppress(ValueError, OSError):
                    r = io.read_json(path)
                    if isinstance(r, dict) and r.get("stage_hash") == self.stage_hash:
                        yield r


class UnitContext:
    """What ``run_unit`` writes through. Every file written here is listed in the receipt."""

    def __init__(self, run: StageRun, unit: Unit, side: dict | None = None):
        self.run = run
        self.unit = unit
        self.output = run.output
        self.parts_dir = run.parts_dir
        self.side = side or {}
        self.files: list[dict] = []

    def part_path(self, name: str) -> str:
        return io.join(self.parts_dir, name)

    def output_path(self, relpath: str) -> str:
        return io.join(self.output, relpath)

    def _relpath(self, path: str) -> str:
        root = self.output.rstrip("/") + "/"
        if not path.startswith(root):
            raise ValueError(f"{path} is outside the output directory {self.output}")
        return path[len(root):]

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[io.HashingWriter]:
        rel = self._relpath(path)
        with io.atomic_open(path) as f:
            yield f
        self.files.append({"path": rel, "bytes": f.bytes_written, "sha256": f.sha256})

    def write_bytes(self, path: str, data: bytes) -> None:
        with self.open_write(path) as f:
            f.write(data)

    def upstream(self, stage_name: str) -> StageRun:
        return self.run.upstream[stage_name]


def execute_unit(run: StageRun, unit: Unit, verify_checksums: bool = False,
                 side: dict | None = None) -> dict:
    """Run one unit unless :func:`check_receipt` says it is done; write its receipt last.

    Returns the receipt (with ``"skipped": True`` added, not stored, if it was already done).
    A failing unit gets a ``failed`` receipt with the error and is retried on the next run;
    the exception is not re-raised, so one bad unit does not abort the others.
    """
    done = run.check(unit.id, verify_checksums)
    if done.done:
        return {**done.receipt, "skipped": True}
    ctx = UnitContext(run, unit, side)
    receipt = {
        "schema": RECEIPT_SCHEMA, "stage": run.name, "stage_hash": run.stage_hash, "unit": unit.id,
        "started_at": _now(), "host": socket.gethostname(), "pid": os.getpid(),
    }
    try:
        stats = run.stage.run_unit(unit, ctx)
        receipt.update(status="completed", files=ctx.files, stats=stats or {})
    except Exception as e:  # noqa: BLE001 - recorded in the receipt, retried next run
        receipt.update(status="failed", files=ctx.files, stats={}, error={
            "type": type(e).__name__, "message": str(e)[:2000],
            "traceback": traceback.format_exc()[-4000:],
        })
        log.error("unit %s/%s failed: %s: %s", run.name, unit.id, type(e).__name__, e)
    receipt["finished_at"] = _now()
    io.atomic_write_json(run.receipt_path(unit.id), receipt)
    return receipt


# ---------------------------------------------------------------------------------------
# Beam wiring
# ---------------------------------------------------------------------------------------

def _run_unit_fn():
    import apache_beam as beam

    class RunUnitFn(beam.DoFn):
        """(unit_id, payload) -> receipt dict. Side inputs arrive as keyword arguments."""

        def __init__(self, run: StageRun, verify_checksums: bool):
            self.run = run
            self.verify_checksums = verify_checksums

        def process(self, element, **side):
            unit_id, payload = element
            receipt = execute_unit(self.run, Unit(unit_id, payload), self.verify_checksums, side)
            beam.metrics.Metrics.counter("refinery", f"{self.run.name}_units_{receipt['status']}").inc()
            yield {k: receipt.get(k) for k in ("unit", "status", "stats")}

    return RunUnitFn


def run_stage_transform(run: StageRun, verify_checksums: bool = False):
    """PTransform: PBegin -> PCollection[dict] (unit, status, stats) for the pending units.

    ``Create(pending units) | Reshuffle | ParDo(execute_unit)``. The units are planned in the
    driver; the worker re-checks each one with :func:`check_receipt` before doing it.
    """
    import apache_beam as beam

    RunUnitFn = _run_unit_fn()

    class RunStage(beam.PTransform):
        def __init__(self, units: list[Unit]):
            super().__init__(label=f"Run_{run.name}")
            self.units = units

        def expand(self, pbegin):
            side = run.stage.side_inputs(pbegin.pipeline)
            return (
                pbegin
                | "Units" >> beam.Create([(u.id, u.payload) for u in self.units], reshuffle=False)
                | "Spread" >> beam.Reshuffle()
                | "RunUnits" >> beam.ParDo(RunUnitFn(run, verify_checksums), **side)
            )

    return RunStage


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


@dataclass
class JobResult:
    runs: list[StageRun]
    ran: dict[str, int]  # stage -> units executed this time
    skipped_stages: list[str]
    seconds: dict[str, float] = field(default_factory=dict)  # stage -> wall time this time


def bind_stages(stages: list[Stage], output: str) -> list[StageRun]:
    runs: list[StageRun] = []
    upstream_hash = None
    upstream: dict[str, StageRun] = {}
    for stage in stages:
        h = compute_stage_hash(stage, upstream_hash)
        run = StageRun(stage, output, h, dict(upstream))
        upstream[stage.name] = run
        runs.append(run)
        upstream_hash = h
    return runs


class Progress:
    """A tqdm bar fed from receipts (the source of truth), polled in a background thread."""

    def __init__(self, run: StageRun, total: int, interval: float, enabled: bool):
        self.run, self.total, self.interval, self.enabled = run, total, interval, enabled
        self._stop = threading.Event()
        self._thread = None
        self._start = time.time()
        self._started_iso = _dt.datetime.fromtimestamp(self._start, _dt.timezone.utc).isoformat(timespec="milliseconds")

    def __enter__(self):
        if self.enabled:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def _poll(self, bar) -> None:
        done = failed = 0
        stats: dict[str, float] = {}
        for r in self.run.read_receipts():
            if r.get("status") == "completed":
                done += 1
                if r.get("finished_at", "") >= self._started_iso:
                    for k, v in (r.get("stats") or {}).items():
                        if isinstance(v, (int, float)):
                            stats[k] = stats.get(k, 0) + v
            else:
                failed += 1
        bar.n = min(done, self.total)
        post = self.run.stage.describe_progress(stats, time.time() - self._start)
        bar.set_postfix_str((post + (f" failed={failed}" if failed else "")).strip(), refresh=False)
        bar.refresh()

    def _loop(self) -> None:
        from tqdm import tqdm

        with tqdm(total=self.total, desc=self.run.name, unit="unit", file=sys.stderr,
                  dynamic_ncols=True) as bar:
            while not self._stop.wait(self.interval):
                with contextlib.suppress(Exception):
                    self._poll(bar)
            with contextlib.suppress(Exception):
                self._poll(bar)

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)


def _run_beam_stage(run: StageRun, units: list[Unit], beam_args: list[str], verify_checksums: bool) -> None:
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    options = PipelineOptions(beam_args)
    RunStage = run_stage_transform(run, verify_checksums)
    with beam.Pipeline(options=options) as p:
        _ = p | RunStage(units)


def _discard_other_plans(run: StageRun) -> None:
    """Remove receipts of other plans of a stage that writes fixed, user-facing names."""
    stage_root = io.join(run.output, META_DIR, run.name)
    for path in io.listdir(stage_root):
        if io.basename(path) != run.stage_hash:
            log.info("discarding receipts of plan %s of stage %s (its outputs are being replaced)",
                     io.basename(path), run.name)
            io.remove_tree(path)


def run_stages(stages: list[Stage], output: str, beam_args: list[str], *,
               verify_checksums: bool = False, force: bool = False, progress: bool = True,
               run_info: dict | None = None,
               on_plan: Callable[[list[StageRun], list[list[Unit]]], None] | None = None,
               runner: Callable[[StageRun, list[Unit], list[str], bool], None] | None = None) -> JobResult:
    """Run ``stages`` in order on ``output``, skipping every unit whose receipt verifies.

    ``force`` deletes ``OUTPUT/.refinery`` first (a fresh run). ``on_plan`` is called with
    the bound stages and their plans before anything runs (prep uses it to clear a stale
    manifest). Raises :class:`StageFailed` when a stage ends with units not completed;
    the receipts of everything that finished are kept for the next run.
    """
    runner = runner or _run_beam_stage
    if force:
        io.remove_tree(io.join(output, META_DIR))
    runs = bind_stages(stages, output)
    plans = [r.stage.plan() for r in runs]
    ids = [[u.id for u in plan] for plan in plans]
    for name, unit_ids in zip((r.name for r in runs), ids):
        if len(set(unit_ids)) != len(unit_ids):
            raise ValueError(f"stage {name}: duplicate unit ids in plan")
    io.atomic_write_json(io.join(output, META_DIR, "run.json"), {
        "schema": RUN_SCHEMA,
        **(run_info or {}),
        "stages": [{"name": r.name, "stage_hash": r.stage_hash, "units": len(p), "config": r.stage.config()}
                   for r, p in zip(runs, plans)],
    })
    if on_plan:
        on_plan(runs, plans)

    # Backward demand: a stage runs only if it, or a later stage, has pending units.
    pending_any = [bool(r.pending(p, verify_checksums)) for r, p in zip(runs, plans)]
    last = max((i for i, p in enumerate(pending_any) if p), default=-1)
    skipped = [r.name for r in runs[last + 1:]] if last >= 0 else [r.name for r in runs]
    ran: dict[str, int] = {}
    seconds: dict[str, float] = {}
    for run, plan in zip(runs[: last + 1], plans[: last + 1]):
        t0 = time.perf_counter()
        if run.stage.final_outputs:
            _discard_other_plans(run)
        ran[run.name] = 0
        while True:
            receipts = run.completed_receipts(plan, verify_checksums)
            needed, final = run.stage.needed(plan, receipts)
            pending = [u for u in needed if u.id not in receipts]
            if not pending:
                if final:
                    break
                raise RuntimeError(f"stage {run.name}: needed() asked for more units but none is pending")
            log.info("stage %s [%s]: %d of %d units pending", run.name, run.stage_hash, len(pending), len(plan))
            with Progress(run, len(needed), interval=10.0 if io.is_remote(output) else 1.0, enabled=progress):
                if run.stage.local:
                    for unit in pending:
                        execute_unit(run, unit, verify_checksums)
                else:
                    runner(run, pending, beam_args, verify_checksums)
            ran[run.name] += len(pending)
            failures = {u.id: run.check(u.id, verify_checksums).reason for u in pending}
            failures = {k: v for k, v in failures.items() if v != "completed"}
            if failures:
                raise StageFailed(run.name, failures)
            if final:
                break
        seconds[run.name] = time.perf_counter() - t0
    return JobResult(runs, ran, skipped, seconds)


def stage_status(output: str) -> list[dict]:
    """Per stage of the run recorded in OUTPUT: units done/failed/pending, from receipts."""
    run_json = io.join(output, META_DIR, "run.json")
    try:
        info = io.read_json(run_json)
    except FileNotFoundError:
        raise FileNotFoundError(f"{output}: no refinery run here ({run_json} not found)") from None
    rows = []
    for st in info.get("stages", []):
        receipts_dir = io.join(output, META_DIR, st["name"], st["stage_hash"], "receipts")
        done = failed = 0
        for path in io.listdir(receipts_dir):
            if not path.endswith(".json") or io.TMP_MARKER in path:
                continue
            try:
                r = io.read_json(path)
            except (ValueError, OSError):
                failed += 1
                continue
            if r.get("status") == "completed" and r.get("stage_hash") == st["stage_hash"]:
                done += 1
            else:
                failed += 1
        rows.append({"stage": st["name"], "stage_hash": st["stage_hash"], "units": st["units"],
                     "done": done, "failed": failed, "pending": max(0, st["units"] - done - failed)})
    return rows

# STAGES-API-READY
