"""Benchmark: refinery prep on a real Flink session cluster against the local runner.

Starts a standalone Flink session cluster on this machine (a JobManager, a TaskManager with
``--slots`` slots and a Beam worker pool, from ``python -m refinery.runners.flink_local
fetch``) and, in one run, measures:

1. ``refinery prep`` on ~``--mb`` MB of GSM8K-derived JSONL (the same corpus as
   ``bench/prep.py``) with the local runner and ``--workers 2``, and on the cluster with
   ``--workers 2`` (parallelism 2, one SDK worker per slot); shards must be byte-identical;
   each run's time broken down (``bench/breakdown.py``: start-up, Beam, workers, each stage
   and the barriers between them), and the time after the first unit starts, Flink against
   local (issue 51's steady state: goal <= 1.25x);
2. the fixed cost of one Beam job on Flink: from launching ``refinery prep`` on a one-file,
   one-unit input to its first unit starting on a worker (the unit log's first ``start``),
   and to the command's exit, for the embedded Flink (``[local]``), the cluster through
   Beam's job server, and the cluster with ``--flink_submit_uber_jar``, next to the local
   runner's.

Ratios are the figures (this machine's 2 shared vCPUs drift); run it with nothing else on
the machine:

    .venv/bin/python bench/flink.py               # ~200 MB
    .venv/bin/python bench/flink.py --mb 20       # quicker
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from breakdown import breakdown, print_table, timed_run  # noqa: E402  (bench/breakdown.py)
from prep import corpus_texts, write_layout  # noqa: E402  (bench/prep.py: the same corpus)

from refinery.runners import flink_local  # noqa: E402


def refinery(argv: list[str], env: Mapping[str, str] | None = None) -> float:
    """Seconds ``refinery ARGV`` took end to end (raises if it failed)."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "refinery.beam_pipelines.cli", *argv], env=env, capture_output=True,
                       text=True)
    if r.returncode:
        raise SystemExit(f"refinery {' '.join(argv)} failed:\n{r.stderr[-3000:]}")
    return time.perf_counter() - t0


def shard_digests(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.glob("shard_*/*"))}


def first_unit_seconds(argv: list[str], log: Path) -> tuple[float, float]:
    """(seconds from launch to the first unit start, seconds to exit) of one run."""
    log.write_text("")
    env = {**os.environ, "REFINERY_UNIT_LOG": str(log)}
    t0 = time.time()
    total = refinery(argv, env)
    starts = [json.loads(line)["t"] for line in log.read_text().splitlines() if '"start"' in line]
    return (min(starts) - t0 if starts else float("nan")), total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=200.0, help="corpus size (default 200)")
    ap.add_argument("--slots", type=int, default=2, help="task slots = --workers (default 2)")
    ap.add_argument("--keep", action="store_true", help="keep the temp folder")
    args = ap.parse_args()
    home = flink_local.flink_home()
    if home is None or flink_local.find_job_server_jar("1.19") is None:
        raise SystemExit("run: .venv/bin/python -m refinery.runners.flink_local fetch")
    tmp = Path(tempfile.mkdtemp(prefix="refinery-bench-flink-"))
    texts = corpus_texts(args.mb)
    corpus = write_layout(tmp / "corpus", texts, 8)
    size = sum(p.stat().st_size for p in corpus.iterdir()) / 1e6
    tiny = write_layout(tmp / "tiny", texts[:200], 1)
    log = tmp / "units.log"
    workers = str(args.slots)
    prep = ["prep", "--input", str(corpus), "--num-shards", "8", "--dataset", "bench", "--no-progress"]
    one = ["prep", "--input", str(tiny), "--num-shards", "1", "--dataset", "tiny", "--no-progress", "--force"]
    jar = flink_local.find_job_server_jar('1.19')
    print(f"corpus: {size:.0f} MB, {len(texts):,} documents, 8 files; Flink {flink_local.DEFAULT_FLINK}, "
          f"{args.slots} slots; job server {jar.name if jar else 'not cached'}", flush=True)

    with flink_local.LocalFlinkCluster(home, tmp / "cluster", slots=args.slots,
                                       worker_env={"REFINERY_UNIT_LOG": str(log)}) as cluster:
        on_cluster = ["--runner", "flink", "--workers", workers, *cluster.beam_args(),
                      f"--sdk_worker_parallelism={args.slots}"]
        runs: dict[str, list[list[tuple[str, float]]]] = {f"local, {workers} workers": [],
                                                           f"Flink, {args.slots} slots": []}
        for name, argv in ((f"local, {workers} workers", [*prep, "--output", str(tmp / "local"), "--workers", workers]),
                           (f"Flink, {args.slots} slots", [*prep, "--output", str(tmp / "flink"), *on_cluster])):
            # the cluster's SDK workers append to the same log (worker_env)
            runs[name].append(breakdown(*timed_run(argv, {"REFINERY_UNIT_LOG": str(log)})))
        local_s, flink_s = (sum(v for _, v in b[0]) for b in runs.values())
        steady = [sum(v for p, v in b[0] if p.startswith(("stage ", "barrier ", "job end"))) for b in runs.values()]
        same = shard_digests(tmp / "local") == shard_digests(tmp / "flink")
        print_table(f"prep, {size:.0f} MB, 8 files, one run each", runs)
        print(f"\n  end to end: local {local_s:.1f} s, Flink {flink_s:.1f} s: {flink_s / local_s:.2f}x; after the "
              f"first unit starts (stages and the barriers between them, to the job's end): local "
              f"{steady[0]:.1f} s, Flink {steady[1]:.1f} s: {steady[1] / steady[0]:.2f}x (goal <= 1.25); "
              f"shards byte-identical: {same}",
              flush=True)

        print("\nfixed cost of one Beam job (1 file, 1 tokenize unit; launch -> first unit start, launch -> exit):")
        rows = [("local runner (in process)", ["--runner", "direct"]),
                ("embedded Flink [local]", ["--runner", "flink", "--flink_master=[local]", "--workers", "1"]),
                ("cluster, Beam job server", ["--runner", "flink", "--workers", "1", *cluster.beam_args()]),
                ("cluster, --flink_submit_uber_jar", ["--runner", "flink", "--workers", "1", *cluster.beam_args(),
                                                      "--flink_submit_uber_jar"])]
        for name, extra in rows:
            first, total = first_unit_seconds([*one, "--output", str(tmp / "one"), *extra], log)
            print(f"  {name:34} first unit at {first:5.1f} s, exit at {total:5.1f} s", flush=True)
    if not args.keep:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
