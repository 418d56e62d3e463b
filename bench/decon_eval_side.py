"""decon's eval side at the size of a benchmark suite (``bench/decon.py --eval-rows N``).

Builds N random-word eval rows (20-100 words, in 50 datasets: nearly every 13-gram
distinct) and a training corpus of GSM8K train documents (``--train-mb``), with some eval
rows planted in it verbatim and re-wrapped at 8 words a line; runs ``refinery decon`` as a
user would (a subprocess, the default local runner with ``--workers``), then the same
command with the eval rows scanned as *training* text against a 100-row eval set (the
ratio: what indexing an eval byte costs against scanning one). Prints, per stage, the wall
seconds (first unit start to last unit end), MB/s of eval or training text, and the peak
RSS of the largest process of the run (polled from ``/proc``: VmHWM of the command and every
process under it); then whether exactly the planted rows were found.
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
from datetime import datetime
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
GSM8K_TRAIN = os.path.join(HERE, "..", "examples", "sample_corpus")
WORDS = [f"w{i:05d}" for i in range(50_000)]
PLANTED = 300


def eval_rows(n: int, seed: int = 59) -> list[dict[str, Any]]:
    """``n`` rows of 20-100 random words from a 50,000-word vocabulary, in 50 datasets."""
    rng = random.Random(seed)
    return [{"id": f"e{i}", "ds": f"bench{i % 50:02d}", "text": " ".join(rng.choices(WORDS, k=rng.randint(20, 100)))}
            for i in range(n)]


def training_texts() -> list[str]:
    """The GSM8K train documents the repo ships (examples/sample_corpus)."""
    texts = []
    for name in sorted(os.listdir(GSM8K_TRAIN)):
        path = os.path.join(GSM8K_TRAIN, name)
        opener = gzip.open if name.endswith(".gz") else open
        if name.startswith("gsm8k_train"):
            with opener(path, "rt", encoding="utf-8") as f:
                texts += [json.loads(line)["text"] for line in f if line.strip()]
    return texts


def write_inputs(work: str, n: int, train_mb: float, seed: int = 59) -> tuple[str, str, set[str], float]:
    """(eval file, training folder, the ids of the planted eval rows, MB of eval text)."""
    rows = eval_rows(n, seed)
    ev = os.path.join(work, "eval", "suite.jsonl")
    os.makedirs(os.path.dirname(ev), exist_ok=True)
    with open(ev, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    rng = random.Random(seed + 1)
    planted = rng.sample(range(n), min(PLANTED, n))
    docs = training_texts()
    train = os.path.join(work, "train")
    os.makedirs(train, exist_ok=True)
    written, k, target = 0, 0, int(train_mb * 1e6)
    plant_at = {int(target * (j + 1) / (len(planted) + 1)): i for j, i in enumerate(planted)}
    marks = sorted(plant_at)
    with open(os.path.join(train, "corpus.jsonl"), "w") as f:
        while written < target:
            text = docs[k % len(docs)]
            if marks and written >= marks[0]:
                i = plant_at[marks.pop(0)]
                words = rows[i]["text"].split(" ")
                planted_text = rows[i]["text"] if i % 2 else "\n".join(" ".join(words[j:j + 8])
                                                                         for j in range(0, len(words), 8))
                text = f"{text} {planted_text} {docs[(k + 1) % len(docs)]}"
            f.write(json.dumps({"id": f"t{k}", "text": text}) + "\n")
            written += len(text)
            k += 1
    eval_mb = sum(len(r["text"]) for r in rows) / 1e6
    return ev, train, {rows[i]["id"] for i in planted}, eval_mb


def _vm_hwm_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def run_watched(cmd: list[str]) -> tuple[int, float, float, str]:
    """(exit code, wall seconds, the largest peak RSS (MB) of the command and its processes, stderr's tail)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, float] = {}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            todo, seen = [proc.pid], set()
            while todo:
                pid = todo.pop()
                if pid in seen:
                    continue
                seen.add(pid)
                peaks[pid] = max(peaks.get(pid, 0.0), _vm_hwm_mb(pid))
                todo += _children(pid)
            time.sleep(0.2)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    out, err = proc.communicate()
    done.set()
    t.join()
    return proc.returncode, time.perf_counter() - t0, max(peaks.values(), default=0.0), (out + err)[-3000:]


def stage_walls(out: str) -> dict[str, tuple[float, float]]:
    """Per stage: (wall seconds from its first unit's start to its last unit's end, the largest unit peak RSS in MB)."""
    spans: dict[str, list[datetime]] = {}
    peaks: dict[str, float] = {}
    for dp, _, fs in os.walk(os.path.join(out, ".refinery")):
        if os.path.basename(dp) != "receipts":
            continue
        for name in fs:
            if name.endswith(".json"):
                r = json.load(open(os.path.join(dp, name)))
                s = spans.setdefault(r["stage"], [])
                s += [datetime.fromisoformat(r["started_at"]), datetime.fromisoformat(r["finished_at"])]
                peaks[r["stage"]] = max(peaks.get(r["stage"], 0.0), float(r["stats"].get("peak_rss_mb", 0.0) or 0.0))
    return {k: ((max(v) - min(v)).total_seconds(), peaks.get(k, 0.0)) for k, v in spans.items()}


def found_ids(out: str) -> set[str]:
    got: set[str] = set()
    for line in open(os.path.join(out, "stats", "overlap_stats.jsonl"), "rb"):
        got |= set(json.loads(line)["instance_ids"])
    return got


def decon_cmd(ev: str, train: str, out: str, ns: list[int], workers: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "refinery.beam_pipelines.cli", "decon", "--eval", ev, "--train", train,
            "--output", out, "--ngrams", *map(str, ns), "--workers", str(workers), "--no-progress", "--force",
            *extra]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eval-rows", type=int, required=True)
    ap.add_argument("--train-mb", type=float, default=100.0, help="MB of training text (default 100)")
    ap.add_argument("--ngrams", type=int, nargs="+", default=[13])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--no-baseline", action="store_true", help="skip the run that scans the eval text as training")
    a = ap.parse_args(argv)
    work = a.workdir or tempfile.mkdtemp(prefix="decon-eval-side-")
    ev, train, planted, eval_mb = write_inputs(work, a.eval_rows, a.train_mb)
    train_mb = os.path.getsize(os.path.join(train, "corpus.jsonl")) / 1e6
    print(f"eval: {a.eval_rows:,} rows ({eval_mb:.0f} MB, 50 datasets); training: {train_mb:.0f} MB; "
          f"n = {' '.join(map(str, a.ngrams))}; {a.workers} workers; load {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores")
    out = os.path.join(work, "out")
    rc, wall, peak, tail = run_watched(decon_cmd(ev, train, out, a.ngrams, a.workers, ["--eval-dataset-field", "ds"]))
    if rc:
        print(tail)
        return rc
    walls = stage_walls(out)
    print("| stage | wall s | MB/s | largest unit peak RSS |")
    print("|---|---|---|---|")
    order = ["eval", "index", "scan", "reduce", "merge"]
    for stage, (secs, unit_peak) in sorted(walls.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 9):
        mb = eval_mb if stage in ("eval", "index") else train_mb if stage == "scan" else 0.0
        speed = f"{mb / secs:.1f}" if mb and secs else ""
        print(f"| {stage} | {secs:.1f} | {speed} | {f'{unit_peak:.0f} MB' if unit_peak else ''} |")
    got = found_ids(out)
    print(f"whole run: {wall:.1f} s; largest process peak RSS {peak:.0f} MB; planted rows found "
          f"{len(got & planted)} of {len(planted)}, other rows flagged {len(got - planted)}")
    if not a.no_baseline:  # the same eval bytes scanned as training text, against a small eval set
        small = os.path.join(work, "eval-small", "small.jsonl")
        os.makedirs(os.path.dirname(small), exist_ok=True)
        with open(ev) as src, open(small, "w") as dst:
            for _, line in zip(range(100), src):
                dst.write(line)
        base_train = os.path.join(work, "train-as-eval")
        os.makedirs(base_train, exist_ok=True)
        for name, target in (("suite.jsonl", ev), ("corpus.jsonl", os.path.join(train, "corpus.jsonl"))):
            link = os.path.join(base_train, name)
            if not os.path.exists(link):
                os.symlink(target, link)
        rc2, wall2, peak2, tail2 = run_watched(decon_cmd(small, base_train, os.path.join(work, "out-base"), a.ngrams,
                                                         a.workers, []))
        if rc2:
            print(tail2)
            return rc2
        print(f"the same {eval_mb + train_mb:.0f} MB scanned as training text: {wall2:.1f} s (peak {peak2:.0f} MB); "
              f"ratio {wall / wall2:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
