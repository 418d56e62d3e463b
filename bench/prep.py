"""Benchmark: refinery prep vs raw tiktoken ``encode_ordinary`` on the same documents.

Builds a JSONL corpus of about ``--mb`` megabytes from GSM8K text (tests/data/gsm8k), then in
one process run measures:

1. raw: ``encode_ordinary`` over every document already in memory (the ceiling);
2. ``refinery prep`` with 1 worker (subprocess, in-process DirectRunner);
3. ``refinery prep`` with 2 workers (subprocess, multi-processing DirectRunner);

and prints tokens/s of each, prep-1 / raw, prep-2 / prep-1 and the peak RSS of each prep
run. Absolute numbers on a shared machine are noise; the ratios are the figures.

    .venv/bin/python bench/prep.py --mb 40
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GSM8K = HERE.parent / "tests" / "data" / "gsm8k" / "train.jsonl.gz"  # shipped with the repo


def build_corpus(path: Path, mb: float, files: int) -> list[str]:
    base = []
    with gzip.open(GSM8K, "rt", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            base.append(r["question"] + "\n\n" + r["answer"])
    texts, size, i = [], 0, 0
    while size < mb * 1e6:
        t = f"[{i}] " + base[i % len(base)]  # unique ids and slightly varying text
        texts.append(t)
        size += len(t.encode())
        i += 1
    path.mkdir(parents=True, exist_ok=True)
    per = (len(texts) + files - 1) // files
    for k in range(files):
        with open(path / f"part-{k:03d}.jsonl", "w") as f:
            for j, t in enumerate(texts[k * per:(k + 1) * per]):
                f.write(json.dumps({"id": f"{k}-{j}", "text": t}) + "\n")
    return texts


def run_prep(corpus: Path, out: Path, workers: int) -> tuple[float, float]:
    """(seconds, peak RSS MiB of the largest process) for one prep run."""
    cmd = [sys.executable, "-m", "refinery.beam_pipelines.cli", "prep", "--input", str(corpus), "--output", str(out),
           "--num-shards", "8", "--workers", str(workers), "--no-progress", "--dataset", "bench"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    secs = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return secs, max(peak, before) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=40.0, help="corpus size in MB of text (default 40)")
    ap.add_argument("--files", type=int, default=8, help="number of input files (tokenize units)")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()

    from refinery.transforms.prep.documents import normalize_text
    from refinery.transforms.formats.tokenizer import get_encoding

    work = Path(args.workdir or tempfile.mkdtemp(prefix="refinery-bench-"))
    texts = build_corpus(work / "corpus", args.mb, args.files)
    enc = get_encoding()
    normalized = [normalize_text(t) for t in texts]
    t0 = time.perf_counter()
    raw_tokens = sum(len(enc.encode_ordinary(t)) + 1 for t in normalized)
    raw_secs = time.perf_counter() - t0
    raw_tps = raw_tokens / raw_secs

    s1, rss1 = run_prep(work / "corpus", work / "out1", 1)
    s2, rss2 = run_prep(work / "corpus", work / "out2", 2)
    m = json.loads((work / "out1" / "manifest.json").read_text())
    assert m["total_tokens"] == raw_tokens, (m["total_tokens"], raw_tokens)
    tps1, tps2 = raw_tokens / s1, raw_tokens / s2
    print(f"corpus: {len(texts):,} documents, {sum(len(t.encode()) for t in texts) / 1e6:.1f} MB, "
          f"{raw_tokens:,} tokens, {args.files} files; cores: {os.cpu_count()}")
    print(f"raw encode_ordinary      {raw_tps:12,.0f} tokens/s  ({raw_secs:.1f}s)")
    print(f"refinery prep, 1 worker  {tps1:12,.0f} tokens/s  ({s1:.1f}s end to end, peak RSS {rss1:,.0f} MiB)")
    print(f"refinery prep, 2 workers {tps2:12,.0f} tokens/s  ({s2:.1f}s end to end)")
    print(f"ratio prep(1 worker) / raw encode : {tps1 / raw_tps:.2f}   (goal >= 0.6)")
    print(f"ratio prep(2 workers) / 1 worker  : {tps2 / tps1:.2f}   (goal >= 1.6)")


if __name__ == "__main__":
    main()
