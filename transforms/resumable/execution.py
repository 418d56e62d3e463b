"""Running one unit: check its receipt, run it, record what it wrote (:func:`execute_unit`),
and what a runner reports of it (counters and times)."""
from __future__ import annotations

import datetime as _dt
import logging
import os
import socket
import traceback
from typing import Any, Callable, Mapping

from refinery.transforms.io.timeline import append_event
from refinery.transforms.resumable.base import StageRun, UnitContext, now_iso
from refinery.transforms.resumable.ledger import RECEIPT_SCHEMA, Receipt, UnitError, next_repair
from refinery.transforms.resumable.units import Unit

log = logging.getLogger("refinery")


def _log_unit_event(event: str, run: "StageRun", unit_id: str) -> None:
    """Append ``{event, stage, stage_hash, unit, pid, t}`` to ``$REFINERY_UNIT_LOG`` (if set;
    :mod:`.timeline`): an audit trail of unit starts/ends/skips across processes and runs.
    Fault-injection tests use it to prove that no unit starts again after its receipt was
    written; ``bench/breakdown.py`` times the stages with it."""
    append_event({"event": event, "stage": run.name, "stage_hash": run.stage_hash, "unit": unit_id})


# CPython 3.11 can raise this in a thread that builds an AST (``ast.parse``, a traceback's
# caret line) while another thread does the same (python/cpython#106905): the unit's work is
# not at fault, so it is run once more before it is called failed.
_INTERPRETER_GLITCHES = ("AST constructor recursion depth mismatch",)


def _interpreter_glitch(e: BaseException) -> bool:
    return isinstance(e, SystemError) and str(e).startswith(_INTERPRETER_GLITCHES)


def _run_unit(run: StageRun, unit: Unit[Any], side: dict[str, Any] | None) -> tuple[Mapping[str, Any], UnitContext]:
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


def execute_unit(run: StageRun, unit: Unit[Any], verify_checksums: bool = False,
                 side: dict[str, Any] | None = None,
                 stale: Callable[[Receipt], bool] | None = None) -> Receipt:
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
    if done.done and done.receipt is not None and not (stale and stale(done.receipt)):
        if token := done.receipt.get("repair"):
            run.ledger.keep_repair_recorded(unit.id, token)
        _log_unit_event("skip", run, unit.id)
        return {**done.receipt, "skipped": True}
    _log_unit_event("start", run, unit.id)
    ctx = UnitContext(run, unit, side)  # replaced by the one of the attempt that returns
    receipt: Receipt = {
        "schema": RECEIPT_SCHEMA, "stage": run.name, "stage_hash": run.stage_hash, "unit": unit.id,
        "started_at": now_iso(), "host": socket.gethostname(), "pid": os.getpid(),
    }
    if repair := next_repair(done):
        receipt["repair"] = repair
    if run.upstream_repairs:
        receipt["upstream_repairs"] = run.upstream_repairs
    try:
        stats, ctx = _run_unit(run, unit, side)
        receipt.update({"status": "completed", "files": ctx.files, "stats": dict(stats)})
    except Exception as e:  # noqa: BLE001 - recorded in the receipt, retried next run
        error: UnitError = {
            "type": type(e).__name__, "message": str(e)[:2000],
            "traceback": traceback.format_exc()[-4000:],
        }
        receipt.update({"status": "failed", "files": ctx.files, "stats": {}, "error": error})
        log.error("unit %s/%s failed: %s: %s", run.name, unit.id, type(e).__name__, e)
    receipt["finished_at"] = now_iso()
    receipt = run.ledger.record(receipt, ctx.progress_written)
    _log_unit_event("end-" + receipt["status"], run, unit.id)
    return receipt


def unit_counters(stage: str, receipt: Receipt) -> dict[str, int]:
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


def unit_times_ms(receipt: Receipt) -> tuple[int, int] | None:
    """(start, end) of a unit run now, in ms since the epoch, from its receipt (None: skipped, blocked)."""
    if receipt.get("skipped") or "started_at" not in receipt:
        return None
    try:
        start = _dt.datetime.fromisoformat(receipt["started_at"])
        end = _dt.datetime.fromisoformat(receipt["finished_at"])
    except (KeyError, TypeError, ValueError):
        return None
    return int(start.timestamp() * 1000), int(end.timestamp() * 1000)
