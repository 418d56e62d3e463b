"""Where a command's wall time goes: its serial parts and its stages, from the run's timeline.

A command run with ``$REFINERY_UNIT_LOG`` and ``$REFINERY_TIMELINE`` set (here, to one file)
appends a JSON line per unit event (start, end) and per driver phase
(``refinery.transforms.io.timeline.PHASES``: the command's code starts, planning done, a
job started, Beam imported and the pipeline built, the job done, its workers stopped, the
command returns). :func:`timed_run` runs a command so and
:func:`breakdown` splits its wall time, from launch to the process's end, into:

- start-up (the interpreter and the CLI module), checks and planning;
- per Beam job: Beam's import and the pipeline's build, the workers' start (submission to
  the first unit), each stage (its first unit's start to its last one's end) and the
  barrier before it (the previous stage's last end to its first start), the job's end
  (last unit to the runner's "done"), the runner's teardown;
- the summary, and the process's exit.

The parts add up to the wall time. ``bench/prep.py --breakdown`` and ``bench/decon.py
--breakdown`` print them for 1 and 2 workers.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def timed_run(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float, list[dict[str, Any]]]:
    """(launch time, end time, timeline events) of ``refinery ARGV`` in a fresh process; its
    timeline in a temp file, or in ``env``'s ``REFINERY_UNIT_LOG`` (emptied first) when given
    (where a cluster's workers write theirs too)."""
    with tempfile.TemporaryDirectory(prefix="refinery-timeline-") as tmp:
        log = Path((env or {}).get("REFINERY_UNIT_LOG") or Path(tmp) / "timeline.jsonl")
        log.write_text("")
        full = {**os.environ, **(env or {}), "REFINERY_UNIT_LOG": str(log), "REFINERY_TIMELINE": str(log)}
        t0 = time.time()
        subprocess.run([sys.executable, "-m", "refinery.beam_pipelines.cli", *argv], check=True,
                       capture_output=True, env=full)
        t1 = time.time()
        events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return t0, t1, events


def breakdown(t0: float, t1: float, events: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """``(part, seconds)`` in order; they add up to ``t1 - t0`` (see the module's doc)."""
    phases = [e for e in events if e["event"] == "phase"]
    units = [e for e in events if e["event"] != "phase"]
    at = {p: [e["t"] for e in phases if e["phase"] == p] for p in ("main", "planned", "job_start", "submitted",
                                                                    "job_done", "job_end", "exit")}
    out: list[tuple[str, float]] = [("start-up (interpreter, CLI)", at["main"][0] - t0)]
    last = at["main"][0]
    for j, (start, sub, done, end) in enumerate(zip(at["job_start"], at["submitted"], at["job_done"], at["job_end"])):
        out.append(("checks and planning" if j == 0 else f"job {j + 1}: planned again", start - last))
        name = f"job {j + 1}: " if len(at["job_start"]) > 1 else ""
        out.append((f"{name}Beam import, pipeline build", sub - start))
        mine = [u for u in units if sub <= u["t"] <= done]
        stages: dict[str, list[float]] = {}
        for u in mine:
            stages.setdefault(u["stage"], []).append(u["t"])
        prev = sub
        for k, (stage, times) in enumerate(stages.items()):
            out.append((f"{name}workers start (to the first unit)" if k == 0 else f"{name}barrier before {stage}",
                        min(times) - prev))
            out.append((f"{name}stage {stage}", max(times) - min(times)))
            prev = max(times)
        out.append((f"{name}job end (last unit to done)", done - prev))
        out.append((f"{name}teardown (workers, servers)", end - done))
        last = end
    out.append(("summary", at["exit"][0] - last))
    out.append(("process exit", t1 - at["exit"][0]))
    return out


def print_table(title: str, runs: dict[str, list[list[tuple[str, float]]]]) -> None:
    """Medians per part, a column per setting (``runs``: setting -> rounds of breakdowns)."""
    parts: list[str] = []
    for rounds in runs.values():
        for b in rounds:
            parts += [p for p, _ in b if p not in parts]
    cols = list(runs)
    print(f"\n{title} (seconds, median of {max(len(r) for r in runs.values())} rounds)")
    print(f"  {'part':44s}" + "".join(f"{c:>12s}" for c in cols))
    for part in parts:
        cells = []
        for c in cols:
            values = [dict(b).get(part) for b in runs[c]]
            got = [v for v in values if v is not None]
            cells.append(f"{statistics.median(got):12.2f}" if got else f"{'-':>12s}")
        print(f"  {part:44s}" + "".join(cells))
    totals = [f"{statistics.median([sum(s for _, s in b) for b in runs[c]]):12.2f}" for c in cols]
    print(f"  {'total (wall)':44s}" + "".join(totals))
