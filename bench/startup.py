"""Benchmark: start-up, the wall time of ``refinery prep`` and ``refinery decon`` on a 1 MB input.

On a small input a command's time is nearly all fixed cost: Python and Beam imports,
planning, starting the job and its workers, ending them. This runs, on ~1 MB of
GSM8K-derived JSONL (the corpus of ``bench/prep.py``), with the default local runner:

- ``refinery prep --num-shards 4``;
- ``refinery decon --ngrams 13`` against the GSM8K test questions (shipped in tests/data);

``--repeat`` times each, and prints the medians and ranges. ``--before REV`` also runs the
same commands with the code of git revision REV (checked out into a temporary worktree and
put first on ``PYTHONPATH``; the venv is this one), alternating with the current code, and
prints each ratio. Run it with nothing else on the machine:

    .venv/bin/python bench/startup.py --repeat 5 --before ddf1d55
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
from prep import corpus_texts, write_layout  # noqa: E402  (bench/prep.py: the same corpus)

EVAL = REPO / "tests" / "data" / "gsm8k" / "test.jsonl.gz"
PACKAGES = ("beam_pipelines", "transforms", "kernels", "runners")  # the folders setup.py installs as refinery.*


def old_code(rev: str, root: Path) -> dict[str, str]:
    """An environment whose ``refinery`` is the code of ``rev`` (a worktree under ``root``)."""
    tree = root / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
    pkg = root / "path" / "refinery"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")  # a regular package: found before the editable install's
    for folder in PACKAGES:
        (pkg / folder).symlink_to(tree / folder)
    return {"PYTHONPATH": str(root / "path")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--before", metavar="REV", help="also time the code of this git revision")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="refinery-startup-"))
    versions: dict[str, dict[str, str]] = {"now": {}}
    try:
        if args.before:
            versions = {args.before: old_code(args.before, work / "old"), "now": {}}
        write_layout(work / "corpus", corpus_texts(1), 1)
        commands = {
            "prep": ["prep", "--input", str(work / "corpus"), "--num-shards", "4", "--dataset", "s"],
            "decon": ["decon", "--train", str(work / "corpus"), "--eval", str(EVAL), "--ngrams", "13",
                      "--eval-text-field", "question"],
        }
        times: dict[tuple[str, str], list[float]] = {}
        beam: list[float] = []
        for i in range(args.repeat):
            t0 = time.perf_counter()  # the floor under both: Beam's own import, in the same rounds
            subprocess.run([sys.executable, "-c", "import apache_beam"], check=True, capture_output=True)
            beam.append(time.perf_counter() - t0)
            for name, argv in commands.items():
                for version, env in versions.items():
                    out = work / f"out-{name}-{i}-{len(times)}"
                    t0 = time.perf_counter()
                    subprocess.run([sys.executable, "-m", "refinery.beam_pipelines.cli", *argv, "--output", str(out),
                                    "--no-progress"], check=True, capture_output=True, env={**os.environ, **env})
                    times.setdefault((name, version), []).append(time.perf_counter() - t0)
                    shutil.rmtree(out)
        print(f"1 MB input, default local runner, {args.repeat} runs each (median [range]); load average "
              f"{os.getloadavg()[0]:.1f}; python -c 'import apache_beam' {statistics.median(beam):.2f} s "
              f"[{min(beam):.2f}-{max(beam):.2f}] in the same rounds:")
        for name in commands:
            line = []
            for version in versions:
                v = times[(name, version)]
                line.append(f"{version} {statistics.median(v):.2f} s [{min(v):.2f}-{max(v):.2f}]")
            line.append(f"{statistics.median(times[(name, 'now')]) / statistics.median(beam):.2f}x Beam's import")
            if args.before:
                ratio = statistics.median(times[(name, args.before)]) / statistics.median(times[(name, "now")])
                line.append(f"{ratio:.2f}x faster now")
            print(f"  {name:6} " + "; ".join(line))
    finally:
        if args.before:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(work / "old" / "tree")],
                           check=False)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
