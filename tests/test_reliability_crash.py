"""kill -9 anywhere: prep and decon resume to byte-identical outputs, nothing lost or redone.

Each loop runs the real ``refinery`` command in a subprocess (its own process group) and
SIGKILLs the whole group at points chosen from the run's own progress events, never from
the time since its launch: the k-th unit start (or completed unit) of an attempt plus a
seeded jitter of milliseconds, in every stage (tokenize, pack, manifest for prep; index,
scan, reduce for decon), and sometimes at a driver phase mark in start-up. The loops stop
after a number of cycles, not of seconds: a busy machine makes them slower, not thinner.
After every attempt:

- every receipt that was completed before the attempt is byte-for-byte unchanged (a
  finished unit is never redone, its receipt never rewritten);
- the unit log (``$REFINERY_UNIT_LOG``) shows no unit starting after a completed receipt
  of it was written;

and when a run finally exits 0: the sha256 of every final file equals an uninterrupted run,
every document is in the shards exactly once, no temp file is left anywhere, and
``refinery verify --checksums`` passes.
"""
from __future__ import annotations

import collections
import os
import random
import time
from pathlib import Path
from typing import Callable

import reliability_helpers
from helpers import gsm8k_rows, gsm8k_texts, run_prep, write_jsonl
from reliability_helpers import (
    STARTUP_PHASES,
    ForkServer,
    Run,
    child_env,
    completed,
    current_receipts,
    expected_texts,
    final_digest,
    make_corpus,
    planned_units,
    read_unit_log,
    recomputed_units,
    refinery_cmd,
    run_attempt,
    shard_texts,
    spawn,
    stage_progress,
    temp_files,
    write_figures,
)

from refinery.beam_pipelines.cli import main
from refinery.transforms.decon.ngrams.details import read_details

SEED = 5
NUM_SHARDS = 4
FILES = 6
MIN_KILLS_DIRECT = 14
MIN_KILLS_LOCAL = 3
MIN_KILLS_DECON = 10
MIN_KILLS_GCS = 5
MAX_CYCLES = 6  # outputs run to completion per loop (each takes several kills)

# what a Picker aims at: (k-th event to kill at or None, delay, stage or None, event)
Aim = tuple[int | None, float, str | None, str]

forks = reliability_helpers.forks  # the shared fork server (a fixture)
pytest_plugins = ["gcs_emulator"]  # the gcs_bucket fixture


def _prep_argv(corpus: Path, out: Path | str, runner: str, workers: int = 1) -> list[str]:
    return [str(a) for a in ("prep", "--input", corpus, "--output", out, "--num-shards", NUM_SHARDS,
                             "--dataset", "k", "--runner", runner, "--workers", workers, "--no-progress",
                             "--unit-mb", 0)]  # a unit per file: many units to kill between


class Picker:
    """Chooses where the next kill lands, for one output (one cycle of attempts), from the
    run's progress (its receipts, and the plan of the reference run ``plan``): aimed at the
    first stage with work left, at most ``cap`` kills per stage (then the next stage's turn:
    the run goes through the stages before it), either inside a unit (after its start) or
    between units (after the k-th completed one); the last, local stage right at its start;
    sometimes in start-up, at one of the driver's phase marks."""

    def __init__(self, plan: list[tuple[str, int]], cap: int = 3, last_stage_delay: float = 0.002) -> None:
        self.plan, self.cap, self.last_stage_delay = plan, cap, last_stage_delay
        self.aimed: collections.Counter[str] = collections.Counter()

    def __call__(self, rng: random.Random, out: Path) -> Aim:
        progress = stage_progress(out, self.plan)
        if rng.random() < 0.08:  # before the first unit
            return 1, 0.0, None, rng.choice(STARTUP_PHASES)
        left = [i for i, (name, done, units) in enumerate(progress) if done < units and self.aimed[name] < self.cap]
        if not left:
            return None, 0.0, None, "start"  # every stage had its kills: let this run finish
        i = left[0]
        stage = progress[i][0]
        self.aimed[stage] += 1
        if i == len(progress) - 1:
            return 1, rng.uniform(0.0, self.last_stage_delay), stage, "start"
        if rng.random() < 0.5:
            return 1, rng.uniform(0.0, 0.05 if i == 0 else 0.01), stage, "start"
        remaining = progress[i][2] - progress[i][1]  # k never beyond the units left: the kill must land
        return rng.randint(1, min(2, remaining)), rng.uniform(0.0, 0.01), stage, "end-completed"


def _kill_cycle(rng: random.Random, launch: Callable[[dict[str, str]], Run], out: Path | None, unit_log: Path,
                max_kills: int, pick: Callable[[random.Random, Path], Aim],
                view: Callable[[], Path] | None = None) -> list[str]:
    """Attempts on one output until a run exits 0; at most ``max_kills`` kills. Returns the kills.
    ``launch(env)`` starts one run of the command; ``view()`` gives a local folder holding the
    output as it is now (default: ``out`` itself; a downloaded copy for gs:// outputs)."""
    kills: list[str] = []
    env = child_env(unit_log, phases=True)
    def own_folder() -> Path:
        assert out is not None  # a gs:// output comes with its view
        return out

    view = view or own_folder
    for _ in range(max_kills + 20):
        now = view()
        before = completed(current_receipts(now))
        k, delay, stage, event = pick(rng, now) if len(kills) < max_kills else (None, 0.0, None, "start")
        a = run_attempt(lambda: launch(env), unit_log, kill_at_start=k, delay=delay, stage=stage, event=event)
        if os.environ.get("RELIABILITY_DEBUG"):
            print(f"aim k={k} stage={stage} event={event} delay={delay:.3f}: rc={a.returncode} phase={a.phase}")
        after = current_receipts(view())
        changed = [p for p, b in before.items() if after.get(p) != b]
        assert not changed, f"completed receipts rewritten or lost by a rerun: {changed[:5]}"
        assert recomputed_units(read_unit_log(unit_log)) == []
        if a.killed:
            kills.append(a.phase)
            continue
        assert a.returncode == 0, a.stderr[-3000:]
        return kills
    raise AssertionError("the run never finished")


def _check_final(out: Path, corpus: Path, want: dict[str, str]) -> None:
    assert temp_files(out) == []
    assert final_digest(out) == want
    assert shard_texts(out) == expected_texts(corpus)  # every document exactly once
    assert main(["verify", str(out / "manifest.json"), "--checksums"]) == 0


def test_prep_kill9_loop(tmp_path: Path, forks: ForkServer) -> None:
    t0 = time.time()
    corpus = make_corpus(tmp_path / "corpus", files=FILES, docs_per_file=50)
    ref = tmp_path / "ref"
    assert run_prep([corpus], ref, "--num-shards", NUM_SHARDS, "--dataset", "k", "--unit-mb", 0) == 0
    want = final_digest(ref)
    docs = sum(expected_texts(corpus).values())
    assert shard_texts(ref) == expected_texts(corpus)
    rng = random.Random(SEED)
    plan = planned_units(ref)

    phases: collections.Counter[str] = collections.Counter()
    direct_kills = local_kills = cycles = 0
    while direct_kills < MIN_KILLS_DIRECT and cycles < MAX_CYCLES:
        out, log = tmp_path / f"direct{cycles}", tmp_path / f"direct{cycles}.log"
        argv = _prep_argv(corpus, out, "direct")
        kills = _kill_cycle(rng, lambda env: forks.start(argv, env), out, log,
                            MIN_KILLS_DIRECT - direct_kills, Picker(plan))
        _check_final(out, corpus, want)
        direct_kills += len(kills)
        phases.update(kills)
        cycles += 1
    out, log = tmp_path / "local", tmp_path / "local.log"
    cmd = refinery_cmd(*_prep_argv(corpus, out, "local", 2))
    kills = _kill_cycle(rng, lambda env: spawn(cmd, env), out, log, MIN_KILLS_LOCAL,
                        Picker(plan, cap=1, last_stage_delay=0.02))
    _check_final(out, corpus, want)
    local_kills = len(kills)
    phases.update(kills)

    write_figures("prep_kill9", {"kills_direct": direct_kills, "kills_local": local_kills, "cycles": cycles + 1,
                                 "phases": dict(phases), "documents": docs, "documents_lost": 0,
                                 "seconds": round(time.time() - t0, 1)})
    print(f"prep kill -9: {direct_kills} direct + {local_kills} local kills, phases {dict(phases)}")
    assert direct_kills >= MIN_KILLS_DIRECT and local_kills >= MIN_KILLS_LOCAL
    assert phases["tokenize"] >= 3 and phases["pack"] >= 3 and phases["manifest"] >= 1, phases


def _decon_inputs(root: Path) -> tuple[Path, Path]:
    """200 GSM8K test questions as eval data; 3 training files of GSM8K train text, every
    20th document carrying an eval question (planted overlap)."""
    test = gsm8k_rows("test")[:200]
    write_jsonl(root / "eval" / "gsm8k" / "test.jsonl",
                [{"id": f"t{i}", "text": r["question"]} for i, r in enumerate(test)])
    texts = gsm8k_texts(600)
    for f in range(3):
        rows = []
        for i, t in enumerate(texts[f * 200:(f + 1) * 200]):
            if i % 20 == 0:
                t += "\n\nSee also: " + test[(f * 200 + i) % 200]["question"]
            rows.append({"id": f"{f}-{i}", "text": t})
        write_jsonl(root / "train" / f"train-{f}.jsonl", rows)
    return root / "eval", root / "train"


def _decon_argv(ev: Path, train: Path, out: Path) -> list[str]:
    return [str(a) for a in ("decon", "--eval", ev, "--train", train, "--output", out, "--ngrams", 5, 13,
                             "--partitions", 4, "--slice-mb", 0.15, "--runner", "direct", "--no-progress")]


def test_decon_kill9_loop_and_rerun_skips(tmp_path: Path, forks: ForkServer) -> None:
    t0 = time.time()
    ev, train = _decon_inputs(tmp_path)
    ref = tmp_path / "ref"
    assert main(_decon_argv(ev, train, ref)) == 0
    want = final_digest(ref)
    assert (ref / ".SUCCESS").exists() and "stats/overlap_details/part-00003.parquet" in want  # by the reduce
    details = list(read_details(str(ref)))
    assert len(details) >= 30  # the planted overlaps are found

    rng = random.Random(SEED)
    plan = planned_units(ref)
    phases: collections.Counter[str] = collections.Counter()
    kills: list[str] = []
    cycle = 0
    while len(kills) < MIN_KILLS_DECON and cycle < MAX_CYCLES:
        out, log = tmp_path / f"out{cycle}", tmp_path / f"out{cycle}.log"
        argv = _decon_argv(ev, train, out)
        new = _kill_cycle(rng, lambda env: forks.start(argv, env), out, log, MIN_KILLS_DECON - len(kills),
                          Picker(plan, cap=3))
        kills += new
        phases.update(new)
        assert temp_files(out) == [] and final_digest(out) == want
        cycle += 1

    # a rerun of the finished job: no unit starts, no final file is rewritten
    stat = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.rglob("*")
            if p.is_file() and "run.json" not in p.name}
    before = len(read_unit_log(log))
    a = run_attempt(lambda: forks.start(argv, child_env(log)), log)
    assert a.returncode == 0, a.stderr[-2000:]
    assert [e["event"] for e in read_unit_log(log)[before:]] == []  # backward demand: no stage even planned work
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.rglob("*")
            if p.is_file() and "run.json" not in p.name} == stat
    write_figures("decon_kill9", {"kills": len(kills), "cycles": cycle, "phases": dict(phases),
                                  "seconds": round(time.time() - t0, 1)})
    print(f"decon kill -9: {len(kills)} kills, phases {dict(phases)}")
    assert len(kills) >= MIN_KILLS_DECON and {"index", "scan", "reduce"} <= set(phases), phases


def _download(gs_path: str, local: Path) -> Path:
    """A fresh local copy of everything under ``gs_path``."""
    import shutil

    from refinery.transforms.io import storage

    shutil.rmtree(local, ignore_errors=True)
    local.mkdir(parents=True)
    fs, root = storage.filesystem(gs_path)
    fs.invalidate_cache()
    for obj in fs.find(root):
        target = local / obj[len(root):].lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(fs.cat_file(obj))
    return local


def test_prep_kill9_loop_with_outputs_on_gcs_emulator(tmp_path: Path, forks: ForkServer, gcs_bucket: str) -> None:
    """The same loop with the output on a local GCS emulator (object uploads, no renames)."""
    t0 = time.time()
    corpus = make_corpus(tmp_path / "corpus", files=4, docs_per_file=40)
    ref = tmp_path / "ref"
    assert run_prep([corpus], ref, "--num-shards", NUM_SHARDS, "--dataset", "k", "--unit-mb", 0) == 0
    want = final_digest(ref)
    out = f"{gcs_bucket}/prep"
    argv = _prep_argv(corpus, out, "direct")
    rng = random.Random(SEED)
    kills = _kill_cycle(rng, lambda env: forks.start(argv, env), None, tmp_path / "gcs.log", MIN_KILLS_GCS,
                        Picker(planned_units(ref), cap=2), view=lambda: _download(out, tmp_path / "view"))
    local = _download(out, tmp_path / "view")
    assert final_digest(local) == want
    assert shard_texts(local) == expected_texts(corpus)
    assert main(["verify", f"{out}/manifest.json", "--checksums"]) == 0
    write_figures("prep_kill9_gcs", {"kills": len(kills), "phases": dict(collections.Counter(kills)),
                                     "seconds": round(time.time() - t0, 1)})
    assert len(kills) >= MIN_KILLS_GCS
