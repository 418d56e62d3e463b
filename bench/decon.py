"""Benchmark: the straightforward dict-based HELM method vs ``refinery decon`` (1 worker).

Prints, in one run, the baseline and refinery figures and their ratios (per core: CPU seconds
of the process, so other load on the machine does not skew them much):

- **sparse hits** (rare overlaps): eval = the GSM8K test questions; training = GSM8K train
  documents (question + answer) repeated ``--copies`` times with test questions planted in
  every 50th document. Figure: MB/s of the scan stage vs the baseline end to end.
- **dense hits** (a benchmark's own train split in the corpus): eval = GSM8K test
  (question + answer); training = GSM8K train (question + answer) repeated
  ``--dense-copies`` times. Figure: MB/s end to end, details included (index, scan,
  reduce, merge: every stats file, report.md, report.html), once per ``--details-format``
  (parquet, jsonl), with the details' bytes on disk in each (goal: parquet <= 1/2 of
  ``overlap_details.jsonl.gz``).

For both: whether the instance sets equal the baseline's for every n (``--ngrams``, default
5 9 13), the size of the details, and peak RSS (a scan worker process with the side input
loaded; the refinery run's process). Every baseline and refinery run is timed in a fresh
process of its own (one run's heap does not slow the next); Beam's import, once per
process, is done before timing and printed apart.

    .venv/bin/python bench/decon.py [--copies 12] [--dense-copies 12] [--ngrams 5 9 13] [--repeat 3] [--scale]
    .venv/bin/python bench/decon.py --breakdown --copies 60 --files 8 --ngrams 13   # the time, 1 and 2 workers
    .venv/bin/python bench/decon.py --fold-cost --copies 2 --ngrams 13   # --match-fold nfkc-cf vs none, the scan

Each figure is the median of ``--repeat`` rounds, with the range of the ratios.

``--scale`` also measures the scan alone against a synthetic eval set of about 1M test
n-grams (throughput should not depend on the number of eval n-grams).

``--fold-cost`` measures only the cost of the match fold (``--match-fold nfkc-cf``, the
default, against ``none``) on the scan (``scan_rows``: normalize, fold, tokenize, probe,
verify, offsets, hit blocks), in a fresh process per run, on the sparse corpus as it is
(ASCII: the fold's fast path) and with both sides written three other ways: accented
(Latin letters with accents, NFC: a table lookup per character), fullwidth (every letter and
digit fullwidth: each one mapped) and soft hyphens (one inside every word: each dropped).
"""
from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from statistics import median
from typing import Any, Callable, Iterator, TypeVar

from refinery.beam_pipelines import decon
from refinery.transforms.decon import ngrams as ng
from refinery.transforms.io.rows import iter_rows

GSM8K = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "gsm8k")
ONE_WORKER = ["--runner=DirectRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1"]


Json = dict[str, Any]
InstanceSets = dict[tuple[str, int], list[str]]
Round = tuple[float, ...]
_T = TypeVar("_T")


def gsm8k_rows(split: str) -> list[Json]:
    with gzip.open(os.path.join(GSM8K, f"{split}.jsonl.gz"), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def write_jsonl(path: str, texts: list[str]) -> float:
    """One ``{"text"}`` row per text; returns MB of text (UTF-8)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return sum(len(t.encode()) for t in texts) / 1e6


def sparse_training(copies: int, seed: int = 0) -> list[str]:
    """GSM8K train documents, ``copies`` times, a test question planted in every 50th."""
    test = [r["question"] for r in gsm8k_rows("test")]
    train = gsm8k_rows("train")
    rnd = random.Random(seed)
    texts = []
    for c in range(copies):
        for i, r in enumerate(train):
            text = r["question"] + "\n" + r["answer"]
            if i % 50 == c % 50:
                text += "\n\nSee also: " + rnd.choice(test)
            texts.append(text)
    return texts


def run_reference(eval_file: str, train_file: str, ns: list[int]) -> tuple[InstanceSets, float]:
    """The baseline: dict of test n-grams, stream the training rows (HELM's shape)."""
    tok = ng.TOKENIZERS["default"]
    t0 = time.process_time()
    evrows, _ = ng.make_eval_rows([eval_file], iter_rows, "text", "id", tok)

    def stream() -> Iterator[tuple[str, int, str]]:
        with open(train_file, "rb") as f:
            for row, line in enumerate(f):
                yield train_file, row, json.loads(line)["text"]

    ids, _ = ng.reference_overlap(evrows, stream(), ns, tok)
    return ids, time.process_time() - t0


def fresh(fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` in a new Python process (spawned: nothing inherited), its result back."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        result: _T = pool.apply(fn, args)
        return result


def details_bytes(out: str) -> int:
    """Bytes on disk of a decon output's detail records, whichever the format."""
    folder = os.path.join(out, "stats", "overlap_details")
    if os.path.isdir(folder):
        return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    return os.path.getsize(os.path.join(out, "stats", "overlap_details.jsonl.gz"))


def run_refinery(eval_file: str, train_dir: str, out: str, ns: list[int],
                 details_format: str = "parquet") -> tuple[InstanceSets, float, Json]:
    """``refinery decon`` end to end; (instance sets, CPU seconds of this process, scan figures)."""
    import apache_beam  # noqa: F401  (once per process, before timing)

    args = decon.build_parser().parse_args(
        ["--eval", eval_file, "--train", train_dir, "--output", out, "--ngrams", *map(str, ns), "--force",
         "--no-progress", "--details-format", details_format])
    t0 = time.process_time()
    rc = decon.run(args, ONE_WORKER)
    cpu = time.process_time() - t0  # the one worker and the driver share this process
    assert rc == 0, rc
    ids: InstanceSets = {}
    for line in open(os.path.join(out, "stats/overlap_stats.jsonl"), "rb"):
        s = json.loads(line)
        ids[(s["eval_dataset"], s["n"])] = s["instance_ids"]
    receipts = []
    for dp, _, fs in os.walk(os.path.join(out, ".refinery")):
        if dp.endswith("receipts"):
            receipts += [json.load(open(os.path.join(dp, f))) for f in fs if f.endswith(".json")]
    scan = [r for r in receipts if r["stage"] == "scan"]
    stage_seconds: dict[str, float] = {}  # wall seconds of each stage's units (one worker: they run one at a time)
    for r in receipts:
        took = datetime.fromisoformat(r["finished_at"]) - datetime.fromisoformat(r["started_at"])
        stage_seconds[r["stage"]] = stage_seconds.get(r["stage"], 0.0) + took.total_seconds()
    catalog = [r for r in receipts if r["stage"] == "index" and r["unit"] == "catalog"][0]
    sizes = {name: os.path.getsize(os.path.join(out, "stats", name))
             for name in ("overlap_instances.jsonl.gz", "report.html")}
    sizes["details"] = details_bytes(out)
    return ids, cpu, {"scan_cpu_seconds": sum(r["stats"]["cpu_seconds"] for r in scan), "stage_seconds": stage_seconds,
                      "scan_units": len(scan), "catalog": catalog["stats"], "sizes": sizes,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


WORKER_SCRIPT = r"""
import json, sys, time
from refinery.transforms.io import storage
from refinery.transforms.io.rows import iter_rows
from refinery.transforms.decon import ngrams as ng
from refinery.transforms.decon.stages import load_partition_file, membership_from_bytes, partition_file

def vm_hwm_mb():  # ru_maxrss survives exec: it would report the parent
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0

membership_path, index_parts, train_file = sys.argv[1:4]
base = vm_hwm_mb()
m = membership_from_bytes(storage.read_bytes(membership_path))
loaded = vm_hwm_mb()
stats = ng.ScanStats()
t0 = time.process_time()
for hits in ng.scan_rows(iter_rows(train_file), text_field="text", tokenizer=ng.TOKENIZERS["default"], membership=m,
                         lookup=lambda p: load_partition_file(f"{index_parts}/{partition_file(p)}"),
                         partitions=int(m.meta["partitions"]), stats=stats):
    list(ng.hit_blocks([ng.hit_groups(hits, "id")]))
print(json.dumps({"rss_after_imports_mb": base, "rss_after_membership_mb": loaded, "peak_rss_mb": vm_hwm_mb(),
                  "seconds": time.process_time() - t0, "text_mb": stats.text_bytes / 1e6}))
"""


def scan_worker(out: str, train_file: str) -> Json:
    """A scan in a fresh process (its own peak RSS): the membership side input, the hit path."""
    for dp, _, fs in os.walk(os.path.join(out, ".refinery", "index")):
        if "membership.bin" in fs:
            res = subprocess.run([sys.executable, "-c", WORKER_SCRIPT, os.path.join(dp, "membership.bin"), dp,
                                  train_file], check=True, capture_output=True, text=True)
            figures: Json = json.loads(res.stdout.strip().splitlines()[-1])
            return figures
    raise FileNotFoundError(f"no membership.bin under {out}")


def synthetic_eval(path: str, target_ngrams: int, ns: list[int], seed: int = 1) -> None:
    """Eval rows made of shuffled GSM8K words, enough for about ``target_ngrams`` n-grams."""
    words = []
    for r in gsm8k_rows("train"):
        words.extend(r["question"].split())
    rnd = random.Random(seed)
    per_row = sum(max(1, 60 - n + 1) for n in ns)
    with open(path, "w") as f:
        for i in range(target_ngrams // per_row + 1):
            f.write(json.dumps({"text": " ".join(rnd.choice(words) for _ in range(60)), "id": f"s{i}"}) + "\n")


def span(rounds: list[Round], ratio: Callable[[Round], float]) -> str:
    """``[lo-hi]`` of a ratio over the rounds."""
    values = [ratio(r) for r in rounds]
    return f"[{min(values):.1f}-{max(values):.1f}]"


def sets_line(same: bool, ids: InstanceSets, ns: list[int]) -> str:
    return f"identical instance sets: {same}  " + ", ".join(f"n={n}: {len(ids[('gsm8k', n)])}" for n in ns)


def dense_figures(fmt: str, rounds: list[Round], info: Json, mb: float) -> None:
    """The dense-hits lines of one details format: ``rounds`` of (baseline s, CPU s, hit path s, index s)."""
    ref_s, cpu, hit_path, index_s = (median(r[k] for r in rounds) for k in range(4))
    st = info["stage_seconds"]
    print(f"  --details-format {fmt}:")
    print(f"    refinery end to end        : {cpu:7.2f} s  {mb / cpu:7.1f} MB/s   ratio "
          f"{median(r[0] / r[1] for r in rounds):5.1f}x {span(rounds, lambda r: r[0] / r[1])}  "
          f"(details included; scan stage {info['scan_cpu_seconds']:.2f} s)")
    print(f"    scan + reduce + merge, start-up and index excluded: {hit_path:5.2f} s   ratio "
          f"{median(r[0] / r[2] for r in rounds):5.1f}x {span(rounds, lambda r: r[0] / r[2])} (goal >= 5); "
          f"index {index_s:.2f} s; by stage: " + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(st.items())))
    print(f"    details on disk: {info['sizes']['details']:,} B")



def decon_breakdown(work: str, copies: int, files: int, ns: list[int], rounds: int) -> None:
    """The breakdown (bench/breakdown.py) of ``refinery decon`` on the sparse corpus in
    ``files`` files, with 1 and 2 workers (rounds alternating), and 2 / 1 for the run and
    for its scan stage."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from breakdown import breakdown, print_table, timed_run

    texts = sparse_training(copies)
    train = os.path.join(work, "sparse-files")
    per = (len(texts) + files - 1) // files
    mb = sum(write_jsonl(os.path.join(train, f"part-{k:03d}.jsonl"), texts[k * per:(k + 1) * per])
             for k in range(files))
    eval_q = os.path.join(work, "eval-q", "gsm8k", "test.jsonl")
    write_jsonl(eval_q, [r["question"] for r in gsm8k_rows("test")])
    runs: dict[str, list[list[tuple[str, float]]]] = {"1 worker": [], "2 workers": []}
    for _ in range(rounds):
        for workers in (1, 2):
            out = os.path.join(work, f"out-breakdown-{workers}")
            subprocess.run(["rm", "-rf", out], check=True)
            argv = ["decon", "--eval", eval_q, "--train", train, "--output", out, "--ngrams", *map(str, ns),
                    "--no-progress", "--workers", str(workers)]
            runs[f"{workers} worker{'s' if workers > 1 else ''}"].append(breakdown(*timed_run(argv)))
    print_table(f"decon breakdown: sparse hits, {mb:,.0f} MB in {files} files, n = {' '.join(map(str, ns))}", runs)
    for part in ("total", "stage scan"):
        one, two = (median(sum(v for p, v in b if part == "total" or p == part) for b in runs[k]) for k in runs)
        print(f"  {part}: 2 workers / 1 worker {one / two:.2f}x")


FOLD_CORPORA = ("ascii", "accented", "fullwidth", "soft hyphens")


def written(texts: list[str], how: str) -> list[str]:
    """``texts`` written as ``how`` says (:data:`FOLD_CORPORA`), the same way on both sides."""
    if how == "accented":
        table = str.maketrans({"e": "\u00e9", "a": "\u00e0", "o": "\u00f4", "u": "\u00fc", "c": "\u00e7"})
        return [t.translate(table) for t in texts]
    if how == "fullwidth":
        table = str.maketrans({c: chr(ord(c) + 0xFEE0) for c in map(chr, range(0x21, 0x7F)) if c.isalnum()})
        return [t.translate(table) for t in texts]
    if how == "soft hyphens":
        return [" ".join(w[:1] + "\u00ad" + w[1:] for w in t.split(" ")) for t in texts]
    return texts


def fold_scan(eval_texts: list[str], train_texts: list[str], ns: list[int], fold: str) -> tuple[float, float, int]:
    """(CPU seconds of the scan, MB of training text, verified hits) under ``fold``; the
    index is built and the fold's tables loaded before timing."""
    from refinery.transforms.io.text import fold_text

    fold_text("\u00e9", "nfkc-cf")  # the fold's lookup tables, once per process (not timed)
    tok = ng.get_tokenizer("default", fold)
    rows, _ = ng.eval_rows_of([("gsm8k", "e", i, {"id": str(i), "text": t}) for i, t in enumerate(eval_texts)],
                              "text", "id", tok)
    index = ng.NgramIndex.build(rows, {}, ns, "default", 16, match_fold=fold)
    stats = ng.ScanStats()
    t0 = time.process_time()
    for hits in ng.scan_rows(((i, {"text": t}, None) for i, t in enumerate(train_texts)), text_field="text",
                             tokenizer=tok, membership=index.membership, lookup=index.lookup, partitions=16,
                             stats=stats):
        list(ng.hit_blocks([ng.hit_groups(hits, "id")]))
    return time.process_time() - t0, sum(len(t.encode()) for t in train_texts) / 1e6, stats.verified_hits


def fold_cost(copies: int, ns: list[int], rounds: int) -> int:
    """The scan's CPU seconds under --match-fold nfkc-cf against none, on each corpus of
    :data:`FOLD_CORPORA`; exit 1 if the folds found other hits where the fold leaves the text
    as it is (ASCII, accented NFC) or maps it one to one (fullwidth). With soft hyphens the
    counts may differ: under none a hyphen after a punctuation mark is a token of its own."""
    questions = [r["question"] for r in gsm8k_rows("test")]
    train = sparse_training(copies)
    from refinery.transforms.io.text import _fold_tables

    t0 = time.process_time()
    _fold_tables()
    print(f"--fold-cost: sparse corpus ({copies} x GSM8K train, test questions planted), n = "
          f"{' '.join(map(str, ns))}, the scan alone, {rounds} round(s), medians; load {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} cores; the fold's tables, once per process: {time.process_time() - t0:.2f} CPU s")
    same = True
    for how in FOLD_CORPORA:
        ev, tr = written(questions, how), written(train, how)
        got: dict[str, list[tuple[float, float, int]]] = {"none": [], "nfkc-cf": []}
        for r in range(rounds):
            for fold in list(got)[::1 if r % 2 == 0 else -1]:  # each fold first in every other round
                got[fold].append(fresh(fold_scan, ev, tr, ns, fold))
        (s0, mb, hits0), (s1, _, hits1) = ((median(r[0] for r in got[f]), got[f][0][1], got[f][0][2]) for f in got)
        same &= hits0 == hits1 or how == "soft hyphens"
        ascii_rows = sum(t.isascii() for t in tr) / len(tr)
        print(f"  {how:13s}: {mb:6.1f} MB, {ascii_rows:4.0%} ASCII rows  none {s0:6.2f} s {mb / s0:6.1f} MB/s   "
              f"nfkc-cf {s1:6.2f} s {mb / s1:6.1f} MB/s   nfkc-cf / none {s1 / s0:4.2f}x "
              f"[{min(a[0] / b[0] for a, b in zip(got['nfkc-cf'], got['none'])):.2f}-"
              f"{max(a[0] / b[0] for a, b in zip(got['nfkc-cf'], got['none'])):.2f}]   hits {hits0:,} / {hits1:,}")
    return 0 if same else 1


def main() -> int:
    if any(arg.split("=")[0] == "--eval-rows" for arg in sys.argv[1:]):  # the eval side at a suite's size
        side = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decon_eval_side.py")
        return subprocess.call([sys.executable, side, *sys.argv[1:]])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=12, help="copies of GSM8K train in the sparse-hits corpus")
    ap.add_argument("--dense-copies", type=int, default=12, help="copies of GSM8K train in the dense-hits corpus")
    ap.add_argument("--ngrams", type=int, nargs="+", default=[5, 9, 13])
    ap.add_argument("--scale", action="store_true", help="also scan against ~1M synthetic test n-grams")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of the sparse and dense runs (default 3)")
    ap.add_argument("--breakdown", action="store_true",
                    help="only the time breakdown of refinery decon (start-up, planning, Beam, workers, each stage "
                         "and the barriers between them, exit) with 1 and 2 workers, on the sparse corpus "
                         "(--copies) in --files files")
    ap.add_argument("--files", type=int, default=8, help="training files of --breakdown (default 8)")
    ap.add_argument("--fold-cost", action="store_true",
                    help="only the match fold's cost on the scan: --match-fold nfkc-cf against none, on the sparse "
                         "corpus (--copies) as it is (ASCII) and written accented, fullwidth and with soft hyphens")
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args()
    work = a.workdir or tempfile.mkdtemp(prefix="decon-bench-")
    if a.breakdown:
        decon_breakdown(work, a.copies, a.files, a.ngrams, a.repeat)
        return 0
    if a.fold_cost:
        return fold_cost(a.copies, a.ngrams, a.repeat)
    t0 = time.process_time()
    import apache_beam  # noqa: F401  (once per process; not part of either figure)
    print(f"Beam import: {time.process_time() - t0:.2f} CPU s, done before timing; load: "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; n = {' '.join(map(str, a.ngrams))}; 1 worker")
    test = gsm8k_rows("test")
    eval_q = os.path.join(work, "eval-q", "gsm8k", "test.jsonl")
    write_jsonl(eval_q, [r["question"] for r in test])
    eval_qa = os.path.join(work, "eval-qa", "gsm8k", "test.jsonl")
    write_jsonl(eval_qa, [r["question"] + "\n" + r["answer"] for r in test])
    same_all = True

    # sparse hits: the scan stage against the baseline
    sparse_file = os.path.join(work, "sparse", "docs.jsonl")
    mb = sparse_mb = write_jsonl(sparse_file, sparse_training(a.copies))
    out = os.path.join(work, "out-sparse")
    rounds: list[Round] = []
    for _ in range(a.repeat):  # each round: the baseline, then refinery, each in a fresh process
        ref_ids, ref_s = fresh(run_reference, eval_q, sparse_file, a.ngrams)
        ids, cpu, info = fresh(run_refinery, eval_q, os.path.dirname(sparse_file), out, a.ngrams)
        same_all &= ids == ref_ids
        rounds.append((ref_s, info["scan_cpu_seconds"], cpu))
    ref_s, scan_s, cpu = (median(r[k] for r in rounds) for k in range(3))
    print(f"\nsparse hits: {mb:.1f} MB ({a.copies} x GSM8K train, test questions planted); eval: 1,319 questions; "
          f"{a.repeat} round(s), medians [ranges]")
    print(f"  baseline (dict, pure Python) : {ref_s:7.2f} s  {mb / ref_s:7.1f} MB/s")
    print(f"  refinery scan stage          : {scan_s:7.2f} s  {mb / scan_s:7.1f} MB/s   ratio "
          f"{median(r[0] / r[1] for r in rounds):5.1f}x {span(rounds, lambda r: r[0] / r[1])}  "
          f"({info['scan_units']} unit(s))")
    print(f"  refinery end to end          : {cpu:7.2f} s  {mb / cpu:7.1f} MB/s   ratio "
          f"{median(r[0] / r[2] for r in rounds):5.1f}x {span(rounds, lambda r: r[0] / r[2])}")
    print(f"  {sets_line(ids == ref_ids, ids, a.ngrams)}")
    cat = info["catalog"]
    print(f"  side input: {cat['test_ngrams']:,} test n-grams; membership file "
          f"{cat['membership_bytes'] / cat['test_ngrams']:.1f} B/n-gram, loaded (with bitmap) "
          f"{cat['membership_loaded_bytes'] / cat['test_ngrams']:.1f} B/n-gram")
    w = scan_worker(out, sparse_file)
    print(f"  scan worker process: peak RSS {w['peak_rss_mb']:.0f} MB (after imports {w['rss_after_imports_mb']:.0f} "
          f"MB, after loading the side input {w['rss_after_membership_mb']:.0f} MB); "
          f"{w['text_mb'] / w['seconds']:.1f} MB/s")

    # dense hits: end to end, details included, in each details format
    dense_file = os.path.join(work, "dense", "docs.jsonl")
    train = [r["question"] + "\n" + r["answer"] for r in gsm8k_rows("train")]
    mb = write_jsonl(dense_file, train * a.dense_copies)
    formats = ("parquet", "jsonl")
    by_format: dict[str, list[Round]] = {fmt: [] for fmt in formats}
    infos: dict[str, Json] = {}
    for _ in range(a.repeat):
        ref_ids, ref_s = fresh(run_reference, eval_qa, dense_file, a.ngrams)
        for fmt in formats:  # the same hits, the details in each format
            out = os.path.join(work, f"out-dense-{fmt}")
            ids, cpu, infos[fmt] = fresh(run_refinery, eval_qa, os.path.dirname(dense_file), out, a.ngrams, fmt)
            same_all &= ids == ref_ids
            st = infos[fmt]["stage_seconds"]
            by_format[fmt].append((ref_s, cpu, st["scan"] + st["reduce"] + st["merge"], st["index"]))
    print(f"\ndense hits: {mb:.1f} MB ({a.dense_copies} x GSM8K train); eval: 1,319 test questions + answers; "
          f"{a.repeat} round(s), medians [ranges]")
    print(f"  baseline (dict, pure Python) : {median(r[0] for r in by_format['parquet']):7.2f} s  "
          f"{mb / median(r[0] for r in by_format['parquet']):7.1f} MB/s")
    for fmt in formats:
        dense_figures(fmt, by_format[fmt], infos[fmt], mb)
    print(f"  {sets_line(ids == ref_ids, ids, a.ngrams)}")
    pq_bytes, js_bytes = (infos[fmt]["sizes"]["details"] for fmt in formats)
    print(f"  details on disk: parquet folder {pq_bytes:,} B, overlap_details.jsonl.gz {js_bytes:,} B: "
          f"parquet / jsonl.gz = {pq_bytes / js_bytes:.2f} (goal <= 0.50); overlap_instances.jsonl.gz "
          f"{infos['parquet']['sizes']['overlap_instances.jsonl.gz'] / 1e6:.2f} MB for {mb:.1f} MB of training text; "
          f"report.html {infos['parquet']['sizes']['report.html'] / 1e3:.0f} kB")
    w = scan_worker(os.path.join(work, "out-dense-parquet"), dense_file)
    print(f"  scan worker process: peak RSS {w['peak_rss_mb']:.0f} MB; the refinery run's process (driver and "
          f"worker): peak RSS parquet {infos['parquet']['peak_rss_mb']:.0f} MB, jsonl "
          f"{infos['jsonl']['peak_rss_mb']:.0f} MB")

    if a.scale:
        syn = os.path.join(work, "synthetic", "synthetic", "test.jsonl")
        os.makedirs(os.path.dirname(syn), exist_ok=True)
        synthetic_eval(syn, 1_000_000, a.ngrams)
        mb = sparse_mb
        ref2_ids, ref2_s = fresh(run_reference, syn, sparse_file, a.ngrams)
        out2 = os.path.join(work, "out-1m")
        ids2, cpu2, info2 = fresh(run_refinery, syn, os.path.dirname(sparse_file), out2, a.ngrams)
        w2 = scan_worker(out2, sparse_file)
        c2 = info2["catalog"]
        scan2 = info2["scan_cpu_seconds"]
        same_all &= ids2 == ref2_ids
        print(f"\nscale: synthetic eval, {c2['test_ngrams']:,} test n-grams (few hits), the sparse corpus:")
        print(f"  baseline {mb / ref2_s:.1f} MB/s; refinery scan stage {mb / scan2:.1f} MB/s (ratio "
              f"{ref2_s / scan2:.1f}x), end to end {mb / cpu2:.1f} MB/s (ratio {ref2_s / cpu2:.1f}x); identical "
              f"instance sets: {ids2 == ref2_ids}")
        print(f"  side input loaded {c2['membership_loaded_bytes'] / c2['test_ngrams']:.1f} B/n-gram; scan worker "
              f"peak RSS {w2['peak_rss_mb']:.0f} MB (after loading the side input {w2['rss_after_membership_mb']:.0f}"
              f" MB), {w2['text_mb'] / w2['seconds']:.1f} MB/s")
    print("\n(MB/s per core = MB / CPU seconds of the process; the baseline's figure is end to end)")
    return 0 if same_all else 1


if __name__ == "__main__":
    sys.exit(main())
