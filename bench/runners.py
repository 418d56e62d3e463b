"""Benchmark: which engine runs a command fastest on one machine: the local runner or Prism.

On the corpus of ``bench/prep.py`` (GSM8K-derived JSONL), with the GSM8K test questions as
decon's eval set, ``--repeat`` rounds of, per runner:

1. start-up: ``refinery prep`` on ~1 MB in one file (one tokenize unit) and ``refinery
   decon --ngrams 13`` on it: wall time of the command, nearly all fixed cost (imports,
   planning, starting the job and its workers, ending them);
2. throughput: ``refinery prep`` on ~``--mb`` MB in 8 files (``--num-shards 8``, 16 tokenize
   units) and ``refinery decon`` on ~``--decon-mb`` MB (8 scan units): wall time and input
   MB/s. (At the default unit sizes a 40 MB input is 2 tokenize units and 1 scan unit,
   and its wall time is mostly fixed cost.)

Runners: ``local`` (the default: the local multi-process runner, ``--workers`` processes),
``direct`` (the same engine in-process), ``prism`` (``--runner prism``: the command starts
its own Prism from ``make prism-cache`` and stops it), and with ``--flink`` the embedded
Flink (``--runner flink --flink_master=[local]``, from ``make flink-cache``). The runners
alternate within each round (this machine's speed drifts); medians and ranges are printed,
and each output must be byte-identical to the local runner's. Run it with nothing else on
the machine:

    .venv/bin/python bench/runners.py                       # 3 rounds, 200 MB prep, 40 MB decon
    .venv/bin/python bench/runners.py --repeat 1 --mb 5 --decon-mb 2 --flink
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests"))
from helpers import tree_digest  # noqa: E402  (tests/helpers.py: what the byte-identity tests compare)
from prep import corpus_texts, write_layout  # noqa: E402  (bench/prep.py: the same corpus)

EVAL = REPO / "tests" / "data" / "gsm8k" / "test.jsonl.gz"


def runner_flags(workers: int) -> dict[str, list[str]]:
    return {"local": ["--runner", "local", "--workers", str(workers)],
            "direct": ["--runner", "direct"],
            "prism": ["--runner", "prism"],
            "flink": ["--runner", "flink", "--flink_master=[local]", "--workers", str(workers)]}


def refinery(argv: list[str]) -> float:
    """Seconds ``refinery ARGV`` took end to end (raises if it failed)."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "refinery.beam_pipelines.cli", *argv, "--no-progress"],
                       capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if r.returncode:
        raise SystemExit(f"refinery {' '.join(argv)} failed:\n{r.stderr[-3000:]}")
    return time.perf_counter() - t0


def size_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--mb", type=float, default=200.0, help="prep's throughput corpus (default 200 MB)")
    ap.add_argument("--decon-mb", type=float, default=40.0, help="decon's throughput corpus (default 40 MB)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="local/flink workers (default: cores)")
    ap.add_argument("--runners", nargs="+", default=["local", "direct", "prism"], choices=list(runner_flags(1)))
    ap.add_argument("--flink", action="store_true", help="also the embedded Flink")
    ap.add_argument("--workdir", help="where corpora and outputs go (default: a temp folder, removed)")
    args = ap.parse_args()
    runners = args.runners + (["flink"] if args.flink and "flink" not in args.runners else [])
    flags = runner_flags(args.workers)

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="refinery-bench-runners-"))
    try:
        texts = corpus_texts(max(args.mb, args.decon_mb))
        per_mb = len(texts) / max(args.mb, args.decon_mb)
        small = write_layout(work / "small", corpus_texts(1), 1)
        big = write_layout(work / "big", texts[:int(per_mb * args.mb)], 8)
        dbig = write_layout(work / "dbig", texts[:int(per_mb * args.decon_mb)], 8)
        decon = ["decon", "--eval", str(EVAL), "--eval-text-field", "question", "--ngrams", "13"]
        cases = {
            "start-up prep": (["prep", "--input", str(small), "--num-shards", "1", "--dataset", "s"], small),
            "start-up decon": ([*decon, "--train", str(small)], small),
            "throughput prep": (["prep", "--input", str(big), "--num-shards", "8", "--dataset", "b",
                                 "--unit-mb", f"{args.mb / 16:.3f}"], big),
            "throughput decon": ([*decon, "--train", str(dbig), "--slice-mb", f"{args.decon_mb / 8:.3f}"], dbig),
        }
        print(f"{args.repeat} round(s); runners {', '.join(runners)}; {args.workers} workers for local/flink; "
              f"{os.cpu_count()} cores", flush=True)
        times: dict[tuple[str, str], list[float]] = {}
        for i in range(args.repeat):
            for case, (argv, _) in cases.items():
                digests = {}
                for runner in runners:
                    out = work / f"out-{i}-{runner}"
                    times.setdefault((case, runner), []).append(refinery([*argv, "--output", str(out),
                                                                          *flags[runner]]))
                    digests[runner] = tree_digest(out)
                    shutil.rmtree(out)
                different = [r for r in runners if digests[r] != digests[runners[0]]]
                if different:
                    raise SystemExit(f"{case}: {', '.join(different)} wrote other bytes than {runners[0]}")
                print(f"  round {i + 1}: {case}: " + ", ".join(f"{r} {times[(case, r)][-1]:.2f} s" for r in runners),
                      flush=True)
        print(f"\nmedian [range] of {args.repeat} round(s), seconds end to end (throughput: input MB/s):")
        for case, (_, corpus) in cases.items():
            mb = size_mb(corpus)
            cells = []
            for r in runners:
                v = times[(case, r)]
                rate = f", {mb / statistics.median(v):.2f} MB/s" if case.startswith("throughput") else ""
                cells.append(f"{r} {statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]{rate}")
            print(f"  {case:17} ({mb:5.1f} MB): " + "; ".join(cells))
        if "local" in runners and "prism" in runners:
            print("\nprism / local wall time: " + ", ".join(
                f"{case} {statistics.median(times[(case, 'prism')]) / statistics.median(times[(case, 'local')]):.2f}x"
                for case in cases))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
