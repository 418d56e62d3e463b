"""Benchmark: refinery prep on a real Flink session cluster against the local runner.

Starts a standalone Flink session cluster on this machine (a JobManager, a TaskManager with
``--slots`` slots and a Beam worker pool, from ``python -m refinery.runners.flink_local
fetch``) and, in one run, measures:

1. ``refinery prep`` on ~``--mb`` MB of GSM8K-derived JSONL (the same corpus as
   ``bench/prep.py``) with the local runner and ``--workers 2``, and on the cluster with
   ``--workers 2`` (parallelism 2, one SDK worker per slot); shards must be byte-identical;
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
        local_s = refinery([*prep, "--output", str(tmp / "local"), "--workers", workers])
        flink_s = refinery([*prep, "--output", str(tmp / "flink"), *on_cluster])
        same = shard_digests(tmp / "local") == shard_digests(tmp / "flink")
        print(f"\nprep, {size:.0f} MB, end to end:\n  local runner, {workers} workers: {local_s:7.1f} s\n"
              f"  Flink cluster, {args.slots} slots:  {flink_s:7.1f} s\n"
              f"  Flink / local: {flink_s / local_s:.2f}x the wall time (shards byte-identical: {same})", flush=True)

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
