"""The run's audit trail: one JSON line per unit event, appended to the file
``$REFINERY_UNIT_LOG`` names, and one per driver phase, appended to ``$REFINERY_TIMELINE``
(nothing when they are not set; a bench sets both to one file). Here, below the framework,
so that the CLI marks its start and end without importing it. The phases have a variable of
their own: a reader of the unit log (a test pauses a run at its first unit by making the log
a FIFO) sees units only.

Units (:mod:`refinery.transforms.resumable.execution`) append ``{event: start|skip|end-*, stage, stage_hash, unit, pid,
t}``: fault-injection tests prove with them that no unit starts again after its receipt
was written. The driver appends ``{event: "phase", phase, pid, t}`` at the points
:data:`PHASES` names, so that a bench (``bench/breakdown.py``) splits a command's wall time
into its serial parts (start-up, planning, job submission, worker start, the barriers
between stages, the end of the job, exit) and its stages.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

UNIT_LOG_ENV = "REFINERY_UNIT_LOG"
TIMELINE_ENV = "REFINERY_TIMELINE"

PHASES = {
    "main": "the command's code starts (the interpreter and the CLI module are loaded)",
    "planned": "every stage bound and planned, run.json written",
    "job_start": "a Beam job is about to be made (its steps chosen)",
    "submitted": "Beam imported, the pipeline built, about to run",
    "job_done": "the runner says the job finished",
    "job_end": "the job's runner, worker pool and servers stopped",
    "exit": "the summary printed, the command returns",
}


def append_event(record: dict[str, Any], env: str = UNIT_LOG_ENV) -> None:
    """Append ``record`` (with ``pid`` and ``t``, the wall time) as one line to the file
    ``$env`` names, if set (one ``write`` on an ``O_APPEND`` file: lines of several processes
    do not mix)."""
    path = os.environ.get(env)
    if not path:
        return
    line = json.dumps({**record, "pid": os.getpid(), "t": time.time()}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def mark(phase: str) -> None:
    """The driver reached ``phase`` (one of :data:`PHASES`)."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}")
    append_event({"event": "phase", "phase": phase}, TIMELINE_ENV)
