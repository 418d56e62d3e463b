"""Benchmark: the straightforward dict-based HELM method vs ``refinery decon`` (1 worker).

Same inputs, one run: eval = the GSM8K test questions; training = GSM8K train documents
(question + answer) repeated ``--copies`` times with test questions planted in every 50th
document. n = 5 9 13 (``--ngrams``). Prints MB/s of training text for both and the ratio
(per core: CPU seconds of the process, so other load on the machine does not skew it),
checks that both find identical instance sets, and reports the side input's memory per
test n-gram and the peak RSS of a scan worker process.

    .venv/bin/python bench/decon.py [--copies 12] [--ngrams 5 9 13] [--scale]

``--scale`` also measures the scan alone against a synthetic eval set of about 1M test
n-grams (throughput should not depend on the number of eval n-grams).
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
import time

from refinery.beam_pipelines import decon
from refinery.transforms.core.rows import iter_rows
from refinery.transforms.decon import ngrams as ng

GSM8K = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "gsm8k")


def gsm8k_rows(split: str) -> list[dict]:
    with gzip.open(os.path.join(GSM8K, f"{split}.jsonl.gz"), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]
ONE_WORKER = ["--runner=DirectRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1"]


def make_training(path: str, copies: int, seed: int = 0) -> float:
    """Write the training JSONL; returns MB of training text (UTF-8 of the text field)."""
    test = [r["question"] for r in gsm8k_rows("test")]
    train = gsm8k_rows("train")
    rnd = random.Random(seed)
    nbytes = 0
    with open(path, "w") as f:
        for c in range(copies):
            for i, r in enumerate(train):
                text = r["question"] + "\n" + r["answer"]
                if i % 50 == c % 50:
                    text += "\n\nSee also: " + rnd.choice(test)
                nbytes += len(text.encode())
                f.write(json.dumps({"text": text}) + "\n")
    return nbytes / 1e6


def run_reference(eval_file: str, train_file: str, ns: list[int]) -> tuple[dict, float]:
    tok = ng.TOKENIZERS["default"]
    t0 = time.process_time()
    evrows, _ = ng.make_eval_rows([eval_file], iter_rows, "question", "id", tok)

    def stream():
        with open(train_file, "rb") as f:
            for row, line in enumerate(f):
                yield train_file, row, json.loads(line)["text"]

    ids, _ = ng.reference_overlap(evrows, stream(), ns, tok)
    return ids, time.process_time() - t0


def run_refinery(eval_file: str, train_dir: str, out: str, ns: list[int]) -> tuple[dict, float, dict]:
    args = decon.build_parser().parse_args(
        ["--eval", eval_file, "--eval-text-field", "question", "--train", train_dir, "--output", out,
         "--ngrams", *map(str, ns), "--force", "--no-progress", "--partitions", "64"])
    t0 = time.process_time()
    rc = decon.run(args, ONE_WORKER)
    wall = time.process_time() - t0  # CPU seconds of this process: the one worker + the driver
    assert rc == 0, rc
    ids = {}
    for line in open(os.path.join(out, "stats/overlap_stats.jsonl"), "rb"):
        s = json.loads(line)
        ids[(s["eval_dataset"], s["n"])] = s["instance_ids"]
    receipts = []
    for dp, _, fs in os.walk(os.path.join(out, ".refinery")):
        for f in fs:
            if f.endswith(".json") and dp.endswith("receipts"):
                receipts.append(json.load(open(os.path.join(dp, f))))
    scan = [r for r in receipts if r["stage"] == "scan"]
    catalog = [r for r in receipts if r["stage"] == "index" and r["unit"] == "catalog"][0]
    info = {"scan_seconds": sum(r["stats"]["seconds"] for r in scan),
            "scan_cpu_seconds": sum(r["stats"]["cpu_seconds"] for r in scan),
            "scan_units": len(scan), "catalog": catalog["stats"],
            "stage_seconds": {}}
    return ids, wall, info


WORKER_SCRIPT = r"""
def vm_hwm_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0

import json, resource, sys, time
from refinery.transforms.core import io
from refinery.transforms.decon import ngrams as ng
from refinery.transforms.decon.stages import (load_partition_file, membership_from_bytes, partition_file)
membership_path, index_parts, train_file = sys.argv[1:4]
def rss(): return vm_hwm_mb()  # ru_maxrss survives exec: it would report the parent
base = rss()
m = membership_from_bytes(io.read_bytes(membership_path))
loaded = rss()
stats = ng.ScanStats()
t0 = time.process_time()
for _ in ng.scan_rows(iter_rows(train_file), text_field="text", id_field="id", tokenizer=ng.TOKENIZERS["default"],
                      membership=m, lookup=lambda p: load_partition_file(f"{index_parts}/{partition_file(p)}"),
                      partitions=int(m.meta["partitions"]), stats=stats):
    pass
print(json.dumps({"rss_after_imports_mb": base, "rss_after_membership_mb": loaded, "peak_rss_mb": rss(),
                  "seconds": time.process_time() - t0, "text_mb": stats.text_bytes / 1e6,
                  "test_ngrams": len(m), "membership_loaded_bytes": m.nbytes}))
"""


def scan_worker(out: str, train_file: str) -> dict:
    membership = None
    index_parts = None
    for dp, ds, fs in os.walk(os.path.join(out, ".refinery", "index")):
        if "membership.bin" in fs:
            membership = os.path.join(dp, "membership.bin")
            index_parts = dp
    res = subprocess.run([sys.executable, "-c", WORKER_SCRIPT, membership, index_parts, train_file],
                         check=True, capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def synthetic_eval(path: str, target_ngrams: int, ns: list[int], seed: int = 1) -> None:
    """Eval rows made of shuffled GSM8K words, enough for about ``target_ngrams`` n-grams."""
    words = []
    for r in gsm8k_rows("train"):
        words.extend(r["question"].split())
    rnd = random.Random(seed)
    per_row = sum(max(1, 60 - n + 1) for n in ns)
    rows = target_ngrams // per_row + 1
    with open(path, "w") as f:
        for i in range(rows):
            f.write(json.dumps({"question": " ".join(rnd.choice(words) for _ in range(60)), "id": f"s{i}"}) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=12, help="copies of GSM8K train in the training file")
    ap.add_argument("--ngrams", type=int, nargs="+", default=[5, 9, 13])
    ap.add_argument("--scale", action="store_true", help="also scan against ~1M synthetic test n-grams")
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args()
    work = a.workdir or tempfile.mkdtemp(prefix="decon-bench-")
    os.makedirs(os.path.join(work, "train"), exist_ok=True)
    train_file = os.path.join(work, "train", "docs.jsonl")
    mb = make_training(train_file, a.copies)
    eval_file = os.path.join(GSM8K, "test.jsonl.gz")
    print(f"training text: {mb:.1f} MB ({a.copies} x GSM8K train, planted test questions); "
          f"eval: GSM8K test (1319 questions); n = {' '.join(map(str, a.ngrams))}; 1 worker")

    ref_ids, ref_s = run_reference(eval_file, train_file, a.ngrams)
    out = os.path.join(work, "out")
    ids, wall, info = run_refinery(eval_file, os.path.join(work, "train"), out, a.ngrams)
    same = ids == ref_ids
    scan_s = info["scan_cpu_seconds"]
    print(f"reference (dict, pure Python)   : {ref_s:7.2f} s  {mb / ref_s:7.1f} MB/s")
    print(f"refinery decon, end to end      : {wall:7.2f} s  {mb / wall:7.1f} MB/s   ratio {ref_s / wall:5.1f}x")
    print(f"refinery decon, scan stage only : {scan_s:7.2f} s  {mb / scan_s:7.1f} MB/s   ratio {ref_s / scan_s:5.1f}x"
          f"  ({info['scan_units']} unit(s))")
    print(f"identical instance sets: {same}  " + ", ".join(f"n={n}: {len(ids[('gsm8k', n)])}" for n in a.ngrams))
    cat = info["catalog"]
    print(f"side input: {cat['test_ngrams']:,} test n-grams; membership file {cat['membership_bytes'] / cat['test_ngrams']:.1f}"
          f" B/n-gram, loaded (with bitmap) {cat['membership_loaded_bytes'] / cat['test_ngrams']:.1f} B/n-gram")
    print("(MB/s per core = MB / CPU seconds of the process; end to end includes index, Beam and reduce)")
    w = scan_worker(out, train_file)
    print(f"scan worker process: peak RSS {w['peak_rss_mb']:.0f} MB (after imports {w['rss_after_imports_mb']:.0f} MB, "
          f"after loading the side input {w['rss_after_membership_mb']:.0f} MB); {w['text_mb'] / w['seconds']:.1f} MB/s")
    if a.scale:
        syn = os.path.join(work, "synthetic", "test.jsonl")
        os.makedirs(os.path.dirname(syn), exist_ok=True)
        synthetic_eval(syn, 1_000_000, a.ngrams)
        out2 = os.path.join(work, "out-1m")
        ref2_ids, ref2_s = run_reference(syn, train_file, a.ngrams)
        ids2, wall2, info2 = run_refinery(syn, os.path.join(work, "train"), out2, a.ngrams)
        w2 = scan_worker(out2, train_file)
        c2 = info2["catalog"]
        scan2 = info2["scan_cpu_seconds"]
        same = same and ids2 == ref2_ids
        print(f"scale: synthetic eval, {c2['test_ngrams']:,} test n-grams (few hits):")
        print(f"  reference {mb / ref2_s:.1f} MB/s; refinery end to end {mb / wall2:.1f} MB/s (ratio {ref2_s / wall2:.1f}x), "
              f"scan stage {mb / scan2:.1f} MB/s (ratio {ref2_s / scan2:.1f}x; vs {mb / scan_s:.1f} MB/s with "
              f"{cat['test_ngrams']:,} n-grams); identical instance sets: {ids2 == ref2_ids}")
        print(f"  side input loaded {c2['membership_loaded_bytes'] / c2['test_ngrams']:.1f} B/n-gram; scan worker "
              f"peak RSS {w2['peak_rss_mb']:.0f} MB (after loading the side input {w2['rss_after_membership_mb']:.0f} MB), "
              f"{w2['text_mb'] / w2['seconds']:.1f} MB/s")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
