"""Peak RSS of ``refinery decon`` on hostile eval sets, per stage and per run.

Each case builds its inputs (a few MB at most; their size is printed), then

- runs ``refinery decon --runner direct`` end to end in a fresh process: the peak RSS of the
  largest process (the run is one process: driver and worker);
- runs the four stages again on a fresh output, each stage in a fresh process of its own
  (its units in that process, without Beam, as :func:`~refinery.transforms.resumable.run_in_driver`
  does): the peak RSS of each stage's process (Python, numpy and refinery's imports included).

A watchdog kills a process past ``--limit-gb`` (the figure then reads ``>LIMIT (killed)``).

Cases (``--cases``, default all):

- ``identical-N-T``: N eval rows with the same text (a GSM8K test question, distinct ids)
  against T training rows, each holding that text;
- ``distinct-N``: N eval rows with distinct texts (random words), all contaminated: the
  training rows are the eval texts, one each;
- ``common-N-T``: N eval rows with distinct texts that all hold one 13-gram, against T
  training rows holding it (each training row overlaps every eval row);
- ``rows-T``: the GSM8K test questions against T training rows, each holding one of them
  (T contaminated training rows: the drop list, its spans and the per-row tallies).

    .venv/bin/python bench/decon_memory.py [--cases identical-2000-60 ...] [--limit-gb 6] [--no-stages]

It prints a JSON line per case as it goes, then a markdown table (README, decon figures).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
GSM8K_TEST = os.path.join(HERE, "..", "tests", "data", "gsm8k", "test.jsonl.gz")
CASES = ["identical-2000-60", "identical-2000-600", "identical-2000-2400", "identical-50000-60", "distinct-20000",
         "common-20000-60", "common-20000-600"]
COMMON = "the quick brown fox jumps over the lazy dog while the cat sleeps"  # 13 tokens
STAGES = ("index", "scan", "reduce", "merge")

# One stage's units in this (fresh) process; prints the process's peak RSS (MB).
STAGE_SCRIPT = r"""
import json, sys
from refinery.beam_pipelines import decon
from refinery.transforms.resumable import bind_stages, execute_unit
from refinery.transforms.decon.stages import build_stages
stage, argv = sys.argv[1], sys.argv[2:]
args = decon.build_parser().parse_args(argv)
runs = bind_stages(build_stages(decon.settings_from_args(args)), args.output)
run, = [r for r in runs if r.name == stage]
failed = [u.id for u in run.stage.plan() if execute_unit(run, u)["status"] != "completed"]
assert not failed, failed
"""


def write_jsonl(path: str, rows: list[dict[str, Any]]) -> int:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return os.path.getsize(path)


def question() -> str:
    with gzip.open(GSM8K_TEST, "rt", encoding="utf-8") as f:
        first: str = json.loads(f.readline())["question"]
        return first


def build_case(case: str, root: str) -> tuple[str, str, str]:
    """(eval file, training folder, description) of ``case``, written under ``root``."""
    kind, *sizes = case.split("-")
    ev, train = os.path.join(root, "eval", "gsm8k", "test.jsonl"), os.path.join(root, "train", "t.jsonl")
    if kind == "identical":
        n_eval, n_train = map(int, sizes)
        q = question()
        write_jsonl(ev, [{"id": f"test-{i}", "text": q} for i in range(n_eval)])
        write_jsonl(train, [{"id": f"doc-{j}", "text": f"Doc {j}. {q} Answer: 18."} for j in range(n_train)])
        return ev, os.path.dirname(train), f"{n_eval:,} identical eval rows x {n_train:,} training rows"
    if kind == "distinct":
        n_eval, = map(int, sizes)
        rnd = random.Random(0)
        vocab = [f"w{k}" for k in range(5000)]
        texts = [" ".join(rnd.choice(vocab) for _ in range(14)) for _ in range(n_eval)]
        write_jsonl(ev, [{"id": f"test-{i}", "text": t} for i, t in enumerate(texts)])
        write_jsonl(train, [{"id": f"doc-{j}", "text": t} for j, t in enumerate(texts)])
        return ev, os.path.dirname(train), f"{n_eval:,} distinct eval rows, each in one training row"
    if kind == "common":
        n_eval, n_train = map(int, sizes)
        write_jsonl(ev, [{"id": f"test-{i}", "text": f"{COMMON} row{i}"} for i in range(n_eval)])
        write_jsonl(train, [{"id": f"doc-{j}", "text": f"doc {j}: {COMMON} and dreams"} for j in range(n_train)])
        what = f"{n_eval:,} distinct eval rows sharing a 13-gram x {n_train:,} training rows"
        return ev, os.path.dirname(train), what
    if kind == "rows":
        n_train, = map(int, sizes)
        with gzip.open(GSM8K_TEST, "rt", encoding="utf-8") as f:
            qs = [json.loads(line)["question"] for line in f]
        write_jsonl(ev, [{"id": f"test-{i}", "text": q} for i, q in enumerate(qs)])
        write_jsonl(train, [{"id": f"doc-{j}", "text": f"Doc {j}. {qs[j % len(qs)]} Answer: {j}."}
                            for j in range(n_train)])
        return ev, os.path.dirname(train), f"{len(qs):,} GSM8K questions x {n_train:,} training rows, each holding one"
    raise SystemExit(f"unknown case {case!r}")


def peak_of(cmd: list[str], limit_mb: float) -> tuple[float | None, float]:
    """(peak RSS in MB of the process ``cmd`` runs, or None when the watchdog killed it past
    ``limit_mb``; wall seconds). The peak is its own ``VmHWM``, read until it exits."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = [0.0, False]

    def watch() -> None:
        while proc.poll() is None:
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            peak[0] = max(peak[0], int(line.split()[1]) / 1024)
            except OSError:
                return
            if peak[0] > limit_mb:
                peak[1] = True
                proc.kill()
                return
            time.sleep(0.05)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    _, err = proc.communicate()
    t.join()
    if proc.returncode != 0 and not peak[1]:
        raise SystemExit(f"{' '.join(cmd[:4])}... exited {proc.returncode}:\n{err.decode()[-3000:]}")
    return (None if peak[1] else peak[0]), time.perf_counter() - t0


def fmt(mb: float | None, limit_mb: float) -> str:
    return f">{limit_mb / 1024:.1f} GB (killed)" if mb is None else f"{mb:,.0f} MB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=CASES)
    ap.add_argument("--limit-gb", type=float, default=6.0, help="kill a process past this peak RSS")
    ap.add_argument("--no-stages", action="store_true", help="only the end-to-end run")
    ap.add_argument("--keep", help="build the inputs and outputs here (default: a temporary folder)")
    a = ap.parse_args()
    limit = a.limit_gb * 1024
    python = sys.executable
    rows = []
    for case in a.cases:
        with tempfile.TemporaryDirectory() as tmp:
            root = os.path.join(a.keep, case) if a.keep else tmp
            ev, train, what = build_case(case, root)
            argv = ["--eval", ev, "--train", train, "--no-progress"]
            whole, secs = peak_of([python, "-m", "refinery.beam_pipelines.cli", "decon", *argv,
                                   "--output", os.path.join(root, "out"), "--runner", "direct", "--force"], limit)
            per = {}
            if not a.no_stages:
                out = os.path.join(root, "out-stages")
                for stage in STAGES:
                    per[stage], _ = peak_of([python, "-c", STAGE_SCRIPT, stage, *argv, "--output", out], limit)
                    if per[stage] is None:
                        break
            size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(os.path.dirname(ev))
                       for f in fs) + sum(os.path.getsize(os.path.join(train, f)) for f in os.listdir(train))
            drop = os.path.join(root, "out", "stats", "contaminated_train_docs.jsonl")
            rows.append((what, size, whole, secs, per, os.path.getsize(drop) if os.path.exists(drop) else None))
            print(json.dumps({"case": case, "inputs_bytes": size, "peak_rss_mb": whole, "seconds": round(secs, 1),
                              "stages_peak_rss_mb": per, "drop_list_bytes": rows[-1][5]}), flush=True)
    print()
    print("| inputs | inputs size | peak RSS of `refinery decon --runner direct` (wall time) | index | scan | reduce "
          "| merge | drop list |")
    print("|---|---|---|---|---|---|---|---|")
    for what, size, whole, secs, per, drop_bytes in rows:
        stages = " | ".join(fmt(per[s], limit) if s in per else "-" for s in STAGES)
        print(f"| {what} | {size / 1e6:.2f} MB | {fmt(whole, limit)} ({secs:.0f} s) | {stages} | "
              f"{'-' if drop_bytes is None else f'{drop_bytes / 1e6:.2f} MB'} |")


if __name__ == "__main__":
    main()
