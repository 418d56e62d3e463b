"""kill -9 and SIGINT on ``refinery generate``: resumed runs give byte-identical generations.

The run is the real command with a tiny random gpt-oss checkpoint, sampling at temperature
0.8 with a fixed seed (each document draws from its own RNG seeded by (seed, doc id), so
the bytes must not depend on which documents share a batch or a wave). 21 documents (one
of them a malformed row, which must come out as an ``error`` row), 3 per infer unit, 2 units
per wave: 8 infer units in 4 waves chained inside one Beam job, then its merge step.

Kills are aimed with the run's own progress events, never with the time since its launch:
the unit log (``$REFINERY_UNIT_LOG``) and the driver's phase marks written to it. A start-up
kill lands at a driver phase (the plan written, the job about to be made or run). An infer
unit logs its start and end only after RunInference produced its results (the unit's write
step), so a kill "after the k-th completed unit plus a jitter under the reference run's
shortest wave" lands between units of a wave or during the next wave's inference; a kill
right at a unit start lands in its write; a merge kill lands while the merge unit writes
``generations.jsonl``. The loops stop after a number of cycles, not of seconds. After every attempt:
no completed receipt changed, no unit started after its completed receipt (unit log), and a
``generations.jsonl`` present under its final name is the finished one. When a run exits 0:
the sha256 of every final file equals the uninterrupted run's, every input document is in
``generations.jsonl`` exactly once and in input order, and no temp file is left.
"""
from __future__ import annotations

import collections
import json
import random
import signal
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("torch", reason="the inference extra (torch) is not installed")

from engine_fixtures import write_harmony_checkpoint  # noqa: E402
from helpers import gsm8k_texts, write_jsonl  # noqa: E402
from reliability_helpers import (  # noqa: E402
    STARTUP_PHASES,
    ForkServer,
    child_env,
    completed,
    current_receipts,
    final_digest,
    kill_cycle,
    planned_units,
    read_unit_log,
    recomputed_units,
    refinery_cmd,
    run_attempt,
    spawn,
    stage_progress,
    temp_files,
    write_figures,
)

SEED = 5
MIN_KILLS_DIRECT = 6
MIN_KILLS_LOCAL = 1
MAX_CYCLES = 6  # runs to completion; two or three usually suffice (a kill aimed at the merge may miss)
OUTPUT = "generations.jsonl"
# (argv without --output/--runner, input ids in order, reference digest, reference rows, the reference's
# plan (stage, units) and half its shortest wave, in seconds)
Job = tuple[list[str], list[str], dict[str, str], list[dict[str, Any]], list[tuple[str, int]], float]

PRELOAD = ("torch", "apache_beam.ml.inference.base", "refinery.transforms.inference.handler",
           "refinery.transforms.inference.stages", "refinery.beam_pipelines.generate")


@pytest.fixture(scope="module")
def gen_forks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    """A fork server that has also imported torch and the inference modules."""
    server = ForkServer(tmp_path_factory.mktemp("genforks"), preload=PRELOAD)
    yield server
    server.close()


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, gen_forks: ForkServer) -> Job:
    """(argv without --output/--runner, input ids in order, reference digest, reference rows,
    plan, jitter: :data:`Job`)."""
    root = tmp_path_factory.mktemp("gen")
    ckpt = write_harmony_checkpoint(root / "ckpt", num_hidden_layers=1)
    texts = gsm8k_texts(20)
    ids: list[str] = []
    for k in range(2):
        rows = [{"id": f"{k}-{i}", "text": t[:300]} for i, t in enumerate(texts[k * 10:(k + 1) * 10])]
        write_jsonl(root / "in" / f"part-{k}.jsonl", rows, raw_lines={4: '{"id": "broken'} if k == 0 else None)
        file_ids = [r["id"] for r in rows]
        if k == 0:
            file_ids.insert(4, "part-0.jsonl:4")  # the malformed row: an error row, not dropped
        ids += file_ids
    base = ["generate", "--checkpoint", str(ckpt), "--input", str(root / "in"), "--max-tokens", "8",
            "--dtype", "float32", "--device", "cpu", "--max-seq-len", "256", "--max-batch", "1",
            "--docs-per-unit", "3", "--wave-units", "2", "--temperature", "0.8", "--seed", "7", "--no-progress"]
    ref = root / "ref"
    a = run_attempt(lambda: gen_forks.start([*base, "--output", str(ref), "--runner", "direct"],
                                            child_env(root / "ref.log")), root / "ref.log")
    assert a.returncode == 0, a.stderr[-3000:]
    rows = [json.loads(line) for line in (ref / OUTPUT).read_text().splitlines()]
    assert [r["id"] for r in rows] == ids
    assert "malformed JSON" in rows[4]["error"] and sum("error" in r for r in rows) == 1
    assert all(r["generated_tokens"] > 0 and r["text"] for r in rows if "error" not in r)
    units = [e for e in read_unit_log(root / "ref.log") if e["event"] == "end-completed"]
    assert collections.Counter(e["stage"] for e in units) == {"infer": 8, "merge": 1}
    ends = sorted(e["t"] for e in units if e["stage"] == "infer")
    gaps = [b - a for a, b in zip(ends, ends[1:]) if b - a > 0.01]  # the units of one wave end ms apart
    return base, ids, final_digest(ref), rows, planned_units(ref), min(gaps) / 2 if gaps else 0.0


class Picker:
    """Where the next kill lands (for one output), from the run's progress (its receipts) and
    the reference run's plan: maybe once at a driver phase in start-up (planning and the
    first wave follow), at most ``infer_cap`` kills in infer, then one in merge."""

    def __init__(self, plan: list[tuple[str, int]], wave_s: float, infer_cap: int = 4, merge_cap: int = 1) -> None:
        self.plan = plan
        self.cap = {"infer": infer_cap, "merge": merge_cap}
        self.wave_s = wave_s
        self.aimed: collections.Counter[str] = collections.Counter()

    def __call__(self, rng: random.Random, out: Path) -> tuple[int | None, float, str | None, str]:
        if not self.aimed and rng.random() < 0.4:
            self.aimed["startup"] += 1
            return 1, 0.0, None, rng.choice(STARTUP_PHASES)
        progress = {name: (done, units) for name, done, units in stage_progress(out, self.plan)}
        infer_done, infer_units = progress["infer"]
        left = infer_units - infer_done
        if left > 2 and self.aimed["infer"] < self.cap["infer"]:  # (the last wave: merge's turn)
            self.aimed["infer"] += 1
            if rng.random() < 0.25:  # inside a unit's write
                return 1, 0.0, "infer", "start"
            k = rng.randint(1, min(3, left - 2))  # between units / in the next wave, one wave left at least
            return k, rng.uniform(0.0, self.wave_s), "infer", "end-completed"
        if self.aimed["merge"] < self.cap["merge"]:
            self.aimed["merge"] += 1
            return 1, 0.0, "merge", "start"  # the merge unit takes ~5 ms
        return None, 0.0, None, "start"


def _check_final(out: Path, ids: list[str], want: dict[str, str]) -> None:
    assert temp_files(out) == []
    assert final_digest(out) == want  # sampled at temperature 0.8: still the same bytes
    got = [json.loads(line)["id"] for line in (out / OUTPUT).read_text().splitlines()]
    assert got == ids  # every input document exactly once, in input order


def test_generate_kill9_loop(tmp_path: Path, gen_forks: ForkServer, job: Job) -> None:
    base, ids, want, _, plan, wave_s = job
    t0 = time.time()
    rng = random.Random(SEED)
    where: collections.Counter[str] = collections.Counter()
    direct = cycles = 0
    def landed(phase: str) -> int:  # kills whose last unit event before them was in this stage
        return sum(n for w, n in where.items() if w.split(":")[0] == phase)

    # until the kills have landed where they must (aimed kills can land a stage later when
    # runs are faster than the aim assumed), within a number of cycles
    while (direct < MIN_KILLS_DIRECT or landed("infer") < 4 or landed("merge") < 1) and cycles < MAX_CYCLES:
        out, log = tmp_path / f"direct{cycles}", tmp_path / f"direct{cycles}.log"
        argv = [*base, "--output", str(out), "--runner", "direct"]
        kills = kill_cycle(rng, lambda env: gen_forks.start(argv, env), out, log, want, [OUTPUT], 6,
                           Picker(plan, wave_s))
        _check_final(out, ids, want)
        direct += len(kills)
        where.update(kills)
        cycles += 1

    # Beam's multi-process workers (fresh interpreters, about 5 s to start a wave): kill the
    # whole group as the job is submitted, while the first wave starts its workers, then finish
    # on the direct runner (the outputs do not depend on the runner). run_attempt checks that
    # every process of the group is gone.
    local = []
    out, log = tmp_path / "local", tmp_path / "local.log"
    cmd = refinery_cmd(*base, "--output", out, "--runner", "local", "--workers", "2")
    for _ in range(MIN_KILLS_LOCAL):
        a = run_attempt(lambda: spawn(cmd, child_env(log, phases=True)), log, kill_at_start=1,
                        delay=rng.uniform(0.0, 1.0), event="phase:submitted")
        assert a.killed, a.stderr[-3000:]
        local.append("local:" + (f"{a.events_before_kill[-1]['stage']}" if a.events_before_kill else "startup"))
    argv = [*base, "--output", str(out), "--runner", "direct"]
    assert kill_cycle(rng, lambda env: gen_forks.start(argv, env), out, log, want, [OUTPUT], 0, None) == []
    _check_final(out, ids, want)
    where.update(local)

    phases = collections.Counter(w.split(":")[0] for w in where.elements() if not w.startswith("local:"))
    write_figures("generate_kill9", {"kills_direct": direct, "kills_local": len(local), "cycles": cycles + 1,
                                     "where": dict(where), "documents": len(ids), "documents_lost": 0,
                                     "seconds": round(time.time() - t0, 1)})
    print(f"generate kill -9: {direct} direct + {len(local)} local kills, where {dict(where)}")
    assert direct >= MIN_KILLS_DIRECT and len(local) >= MIN_KILLS_LOCAL
    assert phases["infer"] >= 4 and phases["merge"] >= 1, where


def test_generate_sigint_stops_and_resumes(tmp_path: Path, gen_forks: ForkServer, job: Job) -> None:
    """Ctrl-C (SIGINT to the process group) during the second wave: the run stops within
    seconds with exit 130 and the resume command, keeps its finished units, and the next
    run finishes them to the reference bytes without redoing any."""
    base, ids, want, *_ = job
    out, log = tmp_path / "out", tmp_path / "units.log"
    argv = [*base, "--output", str(out), "--runner", "direct"]
    a = run_attempt(lambda: gen_forks.start(argv, child_env(log)), log, kill_at_start=2, delay=0.3,
                    stage="infer", event="end-completed", sig=signal.SIGINT, timeout=60)
    assert a.killed, f"the run finished before the signal: {a.stderr[-2000:]}"
    assert a.returncode == 130, a.stderr[-3000:]
    assert "Resume with:" in a.stderr and "refinery generate" in a.stderr
    assert a.stop_seconds < 10.0
    assert not (out / OUTPUT).exists()
    before = completed(current_receipts(out))
    assert 2 <= len(before) < 8  # the first wave's units are kept, not all are done
    b = run_attempt(lambda: gen_forks.start(argv, child_env(log)), log)
    assert b.returncode == 0, b.stderr[-3000:]
    _check_final(out, ids, want)
    assert all(current_receipts(out)[p] == v for p, v in before.items())
    assert recomputed_units(read_unit_log(log)) == []
    write_figures("generate_sigint", {"stop_seconds": round(a.stop_seconds, 2), "units_kept": len(before)})
