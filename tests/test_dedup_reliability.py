"""kill -9 anywhere: ``refinery dedup`` resumes to byte-identical outputs, nothing redone.

The real command runs in a process group of its own (forked from the shared fork server,
``--runner direct``; then once with two local workers) and is SIGKILLed at seeded moments
aimed at the unit log's progress events: the k-th unit start or completion of a stage with
work left, plus a seeded delay, in every stage (sign, bucket, verify, components, report).
After every attempt (:func:`reliability_helpers.kill_cycle`): no completed receipt is
rewritten or lost, no unit starts again after its receipt was written, and no final file is
ever half written under its name; once a run exits 0 its files are the bytes of an
uninterrupted run, no temp file is left, and a rerun starts no unit."""
from __future__ import annotations

import collections
import json
import random
from pathlib import Path

import reliability_helpers
from helpers import gsm8k_texts, write_jsonl
from reliability_helpers import (
    STARTUP_PHASES,
    ForkServer,
    child_env,
    completed,
    current_receipts,
    final_digest,
    kill_cycle,
    read_unit_log,
    refinery_cmd,
    run_attempt,
    spawn,
    temp_files,
)

from refinery.beam_pipelines.cli import main

forks = reliability_helpers.forks  # the shared fork server (a fixture)
SEED = 63
MIN_KILLS = 12
MAX_CYCLES = 6  # a cycle is one output killed until it finishes: bounded by count, never by a clock
OUTPUTS = ["dup_list.jsonl", "clusters.jsonl", "report.md", "dedup_stats.json", "stats/input_files.jsonl"]


def _corpus(root: Path) -> Path:
    """Four files of GSM8K text, every 9th document of the last three a copy (exact, or a word changed) of the
    first file's document of that row."""
    texts = gsm8k_texts(240)
    rng = random.Random(SEED)
    for f in range(4):
        rows = []
        for i, t in enumerate(texts[f * 60:(f + 1) * 60]):
            if i % 9 == 4 and f:
                words = texts[i].split(" ")
                if i % 2:
                    words[rng.randrange(len(words))] = "changed"
                t = " ".join(words)
            rows.append({"id": f"{f}-{i}", "text": t})
        write_jsonl(root / f"part-{f}.jsonl", rows)
    return root


def _argv(corpus: Path, out: Path, runner: str = "direct", workers: int = 1) -> list[str]:
    return [str(a) for a in ("dedup", "--input", corpus, "--output", out, "--partitions", 3, "--slice-mb", 0.02,
                             "--runner", runner, "--workers", workers, "--no-progress")]


class Aimer:
    """Where the next kill lands: at the first stage with units left (at most ``cap`` kills
    each, then the next stage's turn), right after the k-th start of its units (inside one) or
    its k-th completion (between two); sometimes during start-up, right after one of the
    driver's phase marks (never at a time since the launch)."""

    def __init__(self, cap: int = 2) -> None:
        self.cap = cap
        self.aimed: collections.Counter[str] = collections.Counter()

    def __call__(self, rng: random.Random, out: Path) -> tuple[int | None, float, str | None, str]:
        try:
            stages = json.loads((out / ".refinery" / "run.json").read_text())["stages"]
        except FileNotFoundError:  # no plan yet: the first unit's start
            return 1, rng.uniform(0.0, 0.02), None, "start"
        done = completed(current_receipts(out))
        left = [(st["name"], st["units"] - sum(f"/{st['name']}/" in k for k in done)) for st in stages]
        left = [(name, n) for name, n in left if n > 0 and self.aimed[name] < self.cap]
        if rng.random() < 0.06:
            return 1, rng.uniform(0.0, 0.02), None, rng.choice(STARTUP_PHASES)
        if not left:
            return None, 0.0, None, "start"
        stage, remaining = left[0]
        self.aimed[stage] += 1
        if rng.random() < 0.5 or remaining < 2:
            return 1, rng.uniform(0.0, 0.02), stage, "start"
        return rng.randint(1, min(2, remaining - 1)), rng.uniform(0.0, 0.01), stage, "end-completed"


def test_dedup_kill9_loop_resumes_to_the_same_bytes(tmp_path: Path, forks: ForkServer) -> None:
    corpus = _corpus(tmp_path / "corpus")
    ref = tmp_path / "ref"
    assert main(_argv(corpus, ref)) == 0
    want = final_digest(ref)
    assert len((ref / "dup_list.jsonl").read_text().splitlines()) >= 15  # the copies are found
    assert len(list((ref / ".refinery" / "sign").glob("*/receipts/*.json"))) >= 8  # sliced: units to kill between

    rng = random.Random(SEED)
    kills: list[str] = []
    cycle = 0
    while len(kills) < MIN_KILLS and cycle < MAX_CYCLES:
        out, log = tmp_path / f"out{cycle}", tmp_path / f"out{cycle}.log"
        argv = _argv(corpus, out)
        kills += kill_cycle(rng, lambda env: forks.start(argv, env), out, log, want, OUTPUTS, MIN_KILLS - len(kills),
                            Aimer())
        assert temp_files(out) == [] and final_digest(out) == want
        cycle += 1

    # a rerun of the finished job: no unit starts
    before = len(read_unit_log(log))
    a = run_attempt(lambda: forks.start(argv, child_env(log)), log)
    assert a.returncode == 0, a.stderr[-2000:]
    assert read_unit_log(log)[before:] == []

    # the local runner's worker processes, killed with the driver (a process group)
    out, log = tmp_path / "local", tmp_path / "local.log"
    cmd = refinery_cmd(*_argv(corpus, out, "local", 2))
    local = kill_cycle(rng, lambda env: spawn(cmd, env), out, log, want, OUTPUTS, 2, Aimer(cap=1))
    assert temp_files(out) == [] and final_digest(out) == want
    stages = collections.Counter(k.split(":")[0] for k in kills)
    print(f"dedup kill -9: {len(kills)} direct + {len(local)} local kills, at {dict(stages)}")
    assert len(kills) >= MIN_KILLS and {"sign", "bucket", "verify", "components", "report"} <= set(stages), stages
