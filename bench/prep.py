"""Benchmark: refinery prep against raw tiktoken ``encode_ordinary`` on the same documents.

Builds a JSONL corpus of about ``--mb`` megabytes in several layouts: GSM8K text
(tests/data/gsm8k; short English documents), or with ``--corpus web`` web-like text the bench
generates itself (long documents of prose, other scripts, code, URLs, tables and numbers), or
with ``--corpus distinct`` text whose words hardly ever repeat (random letters and CJK runs:
what grows an encoder's cache), and, in one run, measures:

1. raw: tiktoken's ``encode_ordinary`` over every (normalized) document already in memory,
   one process, no EOS, nothing written: the loop refinery's encoder is measured against;
2. ``refinery prep --workers 1`` end to end (start-up, tokenize, pack, manifest), per layout;
3. ``refinery prep`` with every core (the default local runner), per layout;

and prints tokens/s, the ratios 1 worker / raw (goal >= 1.5; >= 2 on 1 GB of web-like text)
and all cores / 1 worker (goal >= 1.8), and each run's peak RSS (the driver and its workers;
goal <= 1 GB a worker). ``--encoders fast tiktoken`` also runs 1 worker with each further
encoder and checks that its shards are byte-identical to the first's. ``--rss`` adds a run on
a quarter of the corpus, to show that peak RSS does not grow with corpus size. ``--scale``
simulates a run of thousands of tiny tokenize units on an object store (fsspec memory://)
and counts the files pack opens with and without the merge stage.

Absolute numbers on a shared machine are noise; the ratios are the figures. This machine's
speed drifts by 20-30% over minutes, so each layout runs ``--repeat`` rounds of (raw on a
quarter of the documents, 1 worker, all cores), each ratio is taken within its round, and
the medians are printed with their range. Run it with nothing else on the machine:

    .venv/bin/python bench/prep.py                   # ~200 MB, layouts: 8 files, 16 files, 1 file, 2000 files
    .venv/bin/python bench/prep.py --mb 40 --layouts 8
    .venv/bin/python bench/prep.py --corpus web --mb 100 --layouts 8 --encoders fast tiktoken
    .venv/bin/python bench/prep.py --corpus distinct --mb 1000 --layouts 8 --repeat 1 --rss
    .venv/bin/python bench/prep.py --scale --units 3000
    .venv/bin/python bench/prep.py --per-document --mb 40 --layouts 8 --repeat 5
    .venv/bin/python bench/prep.py --exclude-modes --mb 100    # span vs row mode, 1% of rows contaminated
    .venv/bin/python bench/prep.py --breakdown --mb 200 --layouts 16   # where the time goes, 1 and 2 workers
    .venv/bin/python bench/prep.py --parts-only --mb 200 --layouts 16 --before main   # part by part, old vs new

``--breakdown`` then times the tokenize and pack stages part by part against the encoder
alone (``--parts-only``: that alone; ``bench/prep_parts.py``), and the bare encoder in 2
processes against 1 beside 2 workers against 1.

``--per-document`` prints what the tokenize units do besides encoding, per document (read,
parse, normalize, id, shard, spill), with the units run in the bench's own process.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any, Mapping

HERE = Path(__file__).resolve().parent
GSM8K = HERE.parent / "tests" / "data" / "gsm8k" / "train.jsonl.gz"  # shipped with the repo
LAYOUTS = {"8": 8, "16": 16, "1": 1, "2000": 2000}  # number of input files

# Peak RSS of a prep run: the process's own high-water mark from /proc (VmHWM: its
# ru_maxrss would include this bench's RSS, which a child keeps across fork and exec), and
# the largest of its worker processes (ru_maxrss of its children, forked from it or its pool).
PEAK_RSS = ("import resource, sys\n"
            "from refinery.beam_pipelines.cli import main\n"
            "rc = main(sys.argv[1:])\n"
            "hwm = [int(x.split()[1]) for x in open('/proc/self/status') if x.startswith('VmHWM:')][0]\n"
            "print('PEAK_RSS_KB', max(hwm, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))\n"
            "sys.exit(rc)\n")


def corpus_texts(mb: float) -> list[str]:
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
    return texts


SCRIPTS = {  # code point ranges of letters of other scripts, for web-like text
    "cyrillic": (0x430, 0x44F), "greek": (0x3B1, 0x3C9), "arabic": (0x627, 0x64A),
    "devanagari": (0x915, 0x939), "hangul": (0xAC00, 0xD7A3), "cjk": (0x4E00, 0x9FFF),
}


def web_texts(mb: float, seed: int = 0) -> list[str]:
    """Web-like documents, deterministic: 1-30 KB each (log-normal), paragraphs of English
    prose (GSM8K's words reshuffled, with numbers, dates, URLs), lines in six other scripts
    (CJK and Hangul without spaces), code blocks, lists and tables."""
    rnd = random.Random(seed)
    words = []
    with gzip.open(GSM8K, "rt", encoding="utf-8") as f:
        for line in f:
            words += json.loads(line)["question"].split()
    idents = ["data", "result", "value", "items", "config", "parse", "load", "count", "node", "path", "x", "i"]

    def sentence() -> str:
        s = " ".join(rnd.choice(words) for _ in range(rnd.randint(6, 28)))
        if rnd.random() < 0.2:
            s += f" ({rnd.randint(1, 31)}/{rnd.randint(1, 12)}/{rnd.randint(1990, 2026)}, ${rnd.randint(1, 10**6):,})"
        if rnd.random() < 0.1:
            s += (f" https://www.{rnd.choice(idents)}.org/{rnd.choice(idents)}/{rnd.randint(1, 99999)}"
                  f"?q={rnd.choice(words)}")
        return s[0].upper() + s[1:] + rnd.choice(".!?")

    def foreign() -> str:
        lo, hi = SCRIPTS[rnd.choice(list(SCRIPTS))]
        spaced = hi < 0x4E00 or lo > 0xD7A3
        tokens = ["".join(chr(rnd.randint(lo, hi)) for _ in range(rnd.randint(2, 9)))
                  for _ in range(rnd.randint(5, 40))]
        return (" " if spaced else "").join(tokens) + ("." if spaced else "。")

    def code() -> str:
        name, arg = rnd.choice(idents), rnd.choice(idents)
        body = [f"def {name}_{rnd.randint(0, 99)}({arg}, n={rnd.randint(0, 9)}):"]
        for _ in range(rnd.randint(2, 12)):
            a, b = rnd.choice(idents), rnd.choice(idents)
            body.append(rnd.choice([f"    {a} = {b}[{rnd.randint(0, 9)}] + {rnd.random():.3f}",
                                    f"    if {a} >= {rnd.randint(0, 999)}:\n        return {b}",
                                    f"    for {a} in range(len({b})):\n        {b}[{a}] *= 2",
                                    f"    # {' '.join(rnd.choice(words) for _ in range(6))}"]))
        body.append(f"    return {arg}")
        return "```python\n" + "\n".join(body) + "\n```"

    def table() -> str:
        rows = ["| " + " | ".join(rnd.choice(words) for _ in range(4)) + " |" for _ in range(rnd.randint(2, 8))]
        return "\n".join([rows[0], "|---|---|---|---|", *rows[1:]])

    texts, size = [], 0
    while size < mb * 1e6:
        target = min(30_000, max(1_000, int(rnd.lognormvariate(8.5, 0.8))))
        parts, n = [" ".join(rnd.choice(words) for _ in range(rnd.randint(3, 10))).title()], 0
        while n < target:
            kind = rnd.random()
            part = (" ".join(sentence() for _ in range(rnd.randint(2, 8))) if kind < 0.6 else
                    foreign() if kind < 0.75 else code() if kind < 0.87 else table() if kind < 0.94 else
                    "\n".join(f"- {sentence()}" for _ in range(rnd.randint(2, 6))))
            parts.append(part)
            n += len(part)
        text = "\n\n".join(parts)
        texts.append(text)
        size += len(text.encode())
    return texts


def distinct_texts(mb: float, seed: int = 0) -> list[str]:
    """Documents of 2-30 KB whose words hardly repeat, deterministic: words of 2-12 random
    letters (Latin with a few accented, Cyrillic), numbers, and now and then a run of random
    CJK characters; each new word is a new piece for an encoder's cache."""
    import numpy as np

    rng = np.random.default_rng(seed)
    letters = np.array([ord(c) for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZéüßçжщыя"], np.uint32)
    texts, size = [], 0
    while size < mb * 1e6:
        n = int(rng.integers(2_000, 30_000))
        cps = letters[rng.integers(0, len(letters), n)]
        cps[rng.random(n) < 0.15] = ord(" ")  # words of ~6 letters
        digits = rng.random(n) < 0.02
        cps[digits] = rng.integers(ord("0"), ord("9") + 1, int(digits.sum()))
        cjk = rng.random(n) < 0.0005  # a run of up to 40 CJK characters starts here
        for start in np.flatnonzero(cjk).tolist():
            k = int(rng.integers(2, 40))
            cps[start:start + k] = rng.integers(0x4E00, 0x9FFF, len(cps[start:start + k]))
        text = cps.tobytes().decode("utf-32-le").strip()
        texts.append(text)
        size += len(text.encode())
    return texts


CORPORA = {"gsm8k": corpus_texts, "web": web_texts, "distinct": distinct_texts}


def write_layout(path: Path, texts: list[str], files: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    per = (len(texts) + files - 1) // files
    for k in range(files):
        with open(path / f"part-{k:04d}.jsonl", "w") as f:
            for j, t in enumerate(texts[k * per:(k + 1) * per]):
                f.write(json.dumps({"id": f"{k}-{j}", "text": t}) + "\n")
    return path


def same_shards(a: Path, b: Path) -> bool:
    """Whether two prep outputs hold the same shard files, byte for byte (as their manifests list them)."""
    ma, mb = (json.loads((d / "manifest.json").read_text()) for d in (a, b))
    paths = [(s["path"], s["index_path"]) for s in ma["shards"]]
    return paths == [(s["path"], s["index_path"]) for s in mb["shards"]] and all(
        (a / p).read_bytes() == (b / p).read_bytes() for pair in paths for p in pair)


def run_prep(corpus: Path, out: Path, workers: int | None, encoder: str = "fast",
             extra: tuple[str, ...] = ()) -> tuple[float, float]:
    """(seconds end to end, peak RSS in MiB of the driver and its workers) of one prep run."""
    argv = ["prep", "--input", str(corpus), "--output", str(out), "--num-shards", "8", "--no-progress",
            "--dataset", "bench", "--encoder", encoder, *(["--workers", str(workers)] if workers else []), *extra]
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", PEAK_RSS, *argv], check=True, capture_output=True, text=True)
    secs = time.perf_counter() - t0
    peak = [int(line.split()[1]) for line in res.stdout.splitlines() if line.startswith("PEAK_RSS_KB")][0]
    return secs, peak / 1024


def per_document_work(corpus: Path, out: Path, texts: list[str], rounds: int) -> None:
    """The tokenize units' work besides the encoder, per document: the units run in this
    process (no job around them), and, in the same round, the encoder alone (``--encoder
    fast``: batches of ``BATCH_CHARS``, EOS put in, one uint32 buffer each) over the same
    documents' normalized text, already in memory."""
    import gc

    from refinery.transforms.formats.encoders import load_tokenizer
    from refinery.transforms.formats.tokenizer_choice import DEFAULT
    from refinery.transforms.io import storage
    from refinery.transforms.io.text import normalize_text
    from refinery.transforms.prep.documents import BATCH_CHARS, encode_documents
    from refinery.transforms.prep.stages import PrepConfig, build_stages
    from refinery.transforms.resumable import UnitContext, bind_stages

    tok = load_tokenizer(DEFAULT, "fast")
    normalized = [normalize_text(t) for t in texts]
    batches: list[list[str]] = [[]]
    size = 0
    for t in normalized:
        batches[-1].append(t)
        size += len(t)
        if size >= BATCH_CHARS:
            batches.append([])
            size = 0
    per_doc, units_s, encoder_s = [], [], []
    for _ in range(rounds):
        gc.disable()
        t0 = time.perf_counter()
        for batch in batches:
            encode_documents(tok, batch)
        encoder_s.append(time.perf_counter() - t0)
        gc.enable()
        shutil.rmtree(out, ignore_errors=True)
        run = bind_stages(build_stages(PrepConfig(storage.expand_inputs([str(corpus)]), str(out), "bench")),
                          str(out))[0]
        t0 = time.perf_counter()
        for unit in run.stage.plan():
            run.stage.run_unit(unit, UnitContext(run, unit))
        units_s.append(time.perf_counter() - t0)
        per_doc.append((units_s[-1] - encoder_s[-1]) / len(texts) * 1e6)
    shutil.rmtree(out, ignore_errors=True)
    print(f"per document: tokenize units {statistics.median(units_s):.2f} s, the encoder alone "
          f"{statistics.median(encoder_s):.2f} s: {statistics.median(per_doc):.2f} us of other work per document "
          f"[{min(per_doc):.2f}-{max(per_doc):.2f}] ({len(texts):,} documents, {rounds} rounds)")


def simulate_scale(units: int, num_shards: int) -> None:
    """Tiny tokenize units on memory://: files pack opens without and with the merge stage."""
    from refinery.beam_pipelines.cli import main
    from refinery.transforms.io import storage
    from refinery.transforms.prep import stages
    from refinery.transforms.resumable import Unit, UnitContext

    work = Path(tempfile.mkdtemp(prefix="refinery-scale-"))
    texts = corpus_texts(units * 0.0008)[:units]
    for k, t in enumerate(texts):
        (work / "in").mkdir(exist_ok=True)
        (work / "in" / f"f{k:05d}.jsonl").write_text(json.dumps({"id": f"d{k}", "text": t}) + "\n")
    opened = {"n": 0, "on": False}
    real_open, real_pack = storage.open_read, stages.PackStage.run_unit

    def counting_open(path: str, compression: str | None = None) -> IO[bytes]:
        opened["n"] += opened["on"]
        return real_open(path, compression)

    def counting_pack(self: stages.PackStage, unit: Unit[Any], ctx: UnitContext) -> Mapping[str, Any]:
        opened["on"] = True
        try:
            return real_pack(self, unit, ctx)
        finally:
            opened["on"] = False

    storage.open_read = counting_open
    hook = "run_unit"  # patched to count the pack's opens (a method: setattr, as a test's monkeypatch does)
    setattr(stages.PackStage, hook, counting_pack)
    results = {}
    for label, limit in (("without merge", 1 << 60), ("with merge", 1)):
        stages.MERGE_ABOVE = limit
        opened["n"] = 0
        t0 = time.perf_counter()
        assert main(["prep", "--input", str(work / "in"), "--output", f"memory://scale/{label.replace(' ', '-')}",
                     "--num-shards", str(num_shards), "--unit-mb", "0", "--runner", "direct", "--no-progress"]) == 0
        results[label] = (opened["n"], time.perf_counter() - t0)
    for label, (n, secs) in results.items():
        print(f"scale: {units:,} tokenize units x {num_shards} shards on memory://, {label:13}: "
              f"pack opened {n:>9,} files ({secs:.0f}s end to end)")
    print(f"scale: pack opens with / without the merge stage: "
          f"{results['with merge'][0] / max(1, results['without merge'][0]):.4f}")


GSM8K_TEST = HERE.parent / "tests" / "data" / "gsm8k" / "test.jsonl.gz"


def prep_breakdown(work: Path, texts: list[str], files: int, rounds: int) -> None:
    """The breakdown (bench/breakdown.py) of ``refinery prep`` with 1 and 2 workers, rounds
    alternating, each round also timing the bare encoder in 1 and in 2 processes (the
    machine's ceiling on 2 workers / 1)."""
    import prep_parts  # bench/prep_parts.py (imported here: bench/prep_identity.py runs old code with this file)
    from breakdown import breakdown, print_table, timed_run

    from refinery.transforms.io.text import normalize_text

    corpus = write_layout(work / f"corpus-{files}", texts, files)
    normalized = [normalize_text(t) for t in texts]
    runs: dict[str, list[list[tuple[str, float]]]] = {"1 worker": [], "2 workers": []}
    scaling, loads = [], []
    for _ in range(rounds):
        for workers in (1, 2):
            out = work / f"out-breakdown-{workers}"
            shutil.rmtree(out, ignore_errors=True)
            argv = ["prep", "--input", str(corpus), "--output", str(out), "--num-shards", "8", "--no-progress",
                    "--dataset", "bench", "--workers", str(workers)]
            runs[f"{workers} worker{'s' if workers > 1 else ''}"].append(breakdown(*timed_run(argv)))
        scaling.append(prep_parts.bare_scaling(normalized, 2))
        loads.append(os.getloadavg()[0])
    size = sum(len(t.encode()) for t in texts) / 1e6
    print_table(f"prep breakdown: {size:,.0f} MB in {files} files", runs)
    ratios = [sum(s for _, s in one) / sum(s for _, s in two) for one, two in zip(runs["1 worker"], runs["2 workers"])]
    print(f"  2 workers / 1 worker: {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]; the bare "
          f"encoder in 2 processes / 1, the same rounds: {statistics.median(scaling):.2f}x "
          f"[{min(scaling):.2f}-{max(scaling):.2f}]; prep's share of that ceiling "
          f"{statistics.median(r / c for r, c in zip(ratios, scaling)):.0%} (goal >= 90%, or 1.8x); "
          f"load average {', '.join(f'{x:.1f}' for x in loads)}")


def parts_rounds(work: Path, kind: str, mb: float, files: int, rounds: int, before: str | None,
                 as_json: bool) -> None:
    """``--parts-only``: the tokenize and pack stages part by part against the encoder alone
    (bench/prep_parts.py), ``rounds`` rounds; with ``before``, each round runs the code of
    that revision first and this checkout's second, each in a fresh process."""
    import prep_parts  # bench/prep_parts.py

    corpus, done = work / f"corpus-{kind}-{mb:g}-{files}", work / f"corpus-{kind}-{mb:g}-{files}.done"
    if not done.exists():  # written once per workdir, shared by the rounds and the versions
        shutil.rmtree(corpus, ignore_errors=True)
        write_layout(corpus, CORPORA[kind](mb), files)
        done.write_text("")
    if before is None and not as_json:
        results = {"now": [prep_parts.measure_round(corpus, work) for _ in range(rounds)]}
    elif before is None:
        for _ in range(rounds):
            print(json.dumps(prep_parts.measure_round(corpus, work)), flush=True)
        return
    else:
        results = versions_rounds(work, corpus, kind, mb, files, rounds, before)
    size = sum(f.stat().st_size for f in corpus.glob("*.jsonl")) / 1e6
    prep_parts.print_parts(f"prep's tokenize and pack stages, part by part: {kind}, {size:,.0f} MB of JSON lines "
                           f"in {files} files, 1 worker's encoder", results)


def versions_rounds(work: Path, corpus: Path, kind: str, mb: float, files: int, rounds: int,
                    before: str) -> dict[str, list[dict[str, float]]]:
    """Rounds of ``--parts-only --json`` alternating: the code of ``before``, then this checkout's."""
    from startup import old_code

    root = Path(tempfile.mkdtemp(prefix="refinery-before-"))
    env = old_code(before, root)
    trees = {before: (root / "tree" / "bench" / "prep.py", env), "now": (HERE / "prep.py", {})}
    results: dict[str, list[dict[str, float]]] = {k: [] for k in trees}
    try:
        for _ in range(rounds):
            for version, (script, extra) in trees.items():
                done = subprocess.run([sys.executable, str(script), "--parts-only", "--json", "--repeat", "1",
                                       "--workdir", str(work), "--corpus", kind, "--mb", str(mb), "--layouts",
                                       str(files)], check=True, capture_output=True, text=True,
                                      env={**os.environ, **extra})
                results[version].append(json.loads(done.stdout.strip().splitlines()[-1]))
    finally:
        subprocess.run(["git", "-C", str(HERE.parent), "worktree", "remove", "--force", str(root / "tree")],
                       check=False)
        shutil.rmtree(root, ignore_errors=True)
    return results


def exclude_modes(work: Path, mb: float, share: float, rounds: int) -> None:
    """``prep --exclude-overlaps`` in row and in span mode (1 worker, end to end) on GSM8K text
    with a GSM8K test question planted in ``share`` of its rows, after one decon run (not
    timed): the time of each, and span / row per round (goal <= 1.10)."""
    with gzip.open(GSM8K_TEST, "rt", encoding="utf-8") as f:
        questions = [json.loads(line)["question"] for line in f]
    texts = corpus_texts(mb)
    rnd = random.Random(0)
    planted = rnd.sample(range(len(texts)), max(1, int(len(texts) * share)))
    for k, i in enumerate(planted):  # the question in the middle of the document
        t = texts[i]
        texts[i] = t[:len(t) // 2] + " " + questions[k % len(questions)] + " " + t[len(t) // 2:]
    corpus = write_layout(work / "corpus-exclude", texts, 8)
    evals = work / "eval" / "gsm8k" / "test.jsonl"
    evals.parent.mkdir(parents=True, exist_ok=True)
    evals.write_text("".join(json.dumps({"id": f"q{i}", "text": q}) + "\n" for i, q in enumerate(questions)))
    decon = work / "decon-exclude"
    subprocess.run([sys.executable, "-m", "refinery.beam_pipelines.cli", "decon", "--eval", str(evals), "--train",
                    str(corpus), "--output", str(decon), "--ngrams", "13", "--no-progress"], check=True,
                   capture_output=True)
    listed = sum(1 for _ in open(decon / "stats" / "contaminated_train_docs.jsonl"))
    print(f"exclude modes: {len(texts):,} rows ({mb:g} MB, 8 files), {len(planted):,} planted, {listed:,} listed "
          f"by decon at n=13; prep --workers 1, end to end")
    row, span, ratios = [], [], []
    for r in range(rounds):
        times = {}
        for mode in (("row", "span") if r % 2 == 0 else ("span", "row")):  # alternate: the machine drifts
            out = work / f"out-exclude-{mode}"
            shutil.rmtree(out, ignore_errors=True)
            times[mode], _ = run_prep(corpus, out, 1, extra=("--exclude-overlaps", str(decon), "--exclude-mode",
                                                             mode))
        row.append(times["row"])
        span.append(times["span"])
        ratios.append(times["span"] / times["row"])
        print(f"  round {r + 1}: row {times['row']:.2f}s  span {times['span']:.2f}s  span/row "
              f"{ratios[-1]:.3f}")
    cut = json.loads((work / "out-exclude-span" / "manifest.json").read_text())["excluded_overlaps"]
    print(f"  span mode: {cut['rows_split']:,} rows split into {cut['pieces']:,} pieces, {cut['rows_dropped']:,} "
          f"dropped whole, {cut['chars_removed']:,} characters removed")
    print(f"exclude modes, medians of {rounds}: row {statistics.median(row):.2f}s, span "
          f"{statistics.median(span):.2f}s, span/row {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f}; goal <= 1.10)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=200.0, help="corpus size in MB of text (default 200)")
    ap.add_argument("--corpus", choices=list(CORPORA), default="gsm8k",
                    help="GSM8K documents (default), web-like text generated here, or distinct words")
    ap.add_argument("--encoders", nargs="+", choices=["fast", "bpe-openai", "tiktoken"], default=["fast"],
                    help="prep's --encoder for the 1-worker runs (default: fast; the first also runs all cores, "
                         "the others' shards are compared with its)")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), metavar="FILES",
                    help="input layouts as a number of files (default: 8 16 1 2000)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds per layout; medians and ranges shown (default 3)")
    ap.add_argument("--rss", action="store_true", help="also a 1-worker run on a quarter of the corpus")
    ap.add_argument("--scale", action="store_true", help="only the object-store simulation of many units")
    ap.add_argument("--per-document", action="store_true",
                    help="only the tokenize units' work besides the encoder, per document (first layout)")
    ap.add_argument("--units", type=int, default=3000, help="tokenize units of the --scale simulation")
    ap.add_argument("--breakdown", action="store_true",
                    help="only the time breakdown (start-up, planning, Beam, workers, each stage and the barriers "
                         "between them, exit) with 1 and 2 workers, on the first layout")
    ap.add_argument("--parts-only", action="store_true",
                    help="only the tokenize and pack stages part by part (read, parse, text, normalize, ids, "
                         "encode, spill, sha256, pack, sidecar) against the encoder alone, 1 worker, in this "
                         "process (bench/prep_parts.py); --breakdown runs it too")
    ap.add_argument("--before", metavar="REV",
                    help="with --parts-only or --breakdown: also the code of this git revision, rounds alternating")
    ap.add_argument("--json", action="store_true", help="with --parts-only: each round's figures as a JSON line")
    ap.add_argument("--exclude-modes", action="store_true",
                    help="only prep --exclude-overlaps in row and span mode, on GSM8K text with test questions "
                         "planted in --planted of its rows (after one decon run, not timed)")
    ap.add_argument("--planted", type=float, default=0.01, help="share of rows with a planted question (0.01)")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    if args.scale:
        simulate_scale(args.units, 64)
        return
    if args.breakdown or args.parts_only:
        work = Path(args.workdir or tempfile.mkdtemp(prefix="refinery-bench-"))
        if not args.json:
            print(f"load average at the start: {os.getloadavg()[0]:.1f} (2 shared cores: compare ratios only)")
        if args.breakdown:
            prep_breakdown(work, CORPORA[args.corpus](args.mb), int(args.layouts[0]), args.repeat)
        parts_rounds(work, args.corpus, args.mb, int(args.layouts[0]), args.repeat, args.before, args.json)
        return
    if args.exclude_modes:
        exclude_modes(Path(args.workdir or tempfile.mkdtemp(prefix="refinery-bench-")), args.mb, args.planted,
                      args.repeat)
        return

    from refinery.transforms.formats.tiktoken_vocab import get_encoding
    from refinery.transforms.io.text import normalize_text

    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"warning: load average {load:.1f}: the machine is busy, the ratios will be off")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="refinery-bench-"))
    texts = CORPORA[args.corpus](args.mb)
    if args.per_document:
        per_document_work(write_layout(work / f"corpus-{args.layouts[0]}", texts, int(args.layouts[0])),
                          work / "out-per-document", texts, args.repeat)
        return
    enc = get_encoding()
    normalized = [normalize_text(t) for t in texts]
    sample = normalized[::4]  # raw speed is measured on a quarter, right before each run it is compared with

    def raw_tps() -> float:
        t0 = time.perf_counter()
        tokens = sum(len(enc.encode_ordinary(t)) + 1 for t in sample)
        return tokens / (time.perf_counter() - t0)

    def raw_scaling(n: int) -> float:
        """How much faster ``n`` processes encode the sample at once than one alone, now: the
        ceiling the machine itself puts on "all cores vs 1 worker" (shared vCPUs vary)."""
        alone = raw_tps()
        t0 = time.perf_counter()
        pids = []
        for _ in range(n):
            pid = os.fork()
            if pid == 0:
                for t in sample:
                    enc.encode_ordinary(t)
                os._exit(0)
            pids.append(pid)
        for pid in pids:
            os.waitpid(pid, 0)
        return n * sample_tokens / (time.perf_counter() - t0) / alone

    raw_tokens = sum(len(enc.encode_ordinary(t)) + 1 for t in normalized)
    sample_tokens = sum(len(enc.encode_ordinary(t)) + 1 for t in sample)
    cores = os.cpu_count() or 1
    print(f"corpus ({args.corpus}): {len(texts):,} documents, {sum(len(t.encode()) for t in texts) / 1e6:.1f} MB, "
          f"{raw_tokens:,} tokens; cores: {cores}; {args.repeat} round(s) per layout, medians shown")
    for files in args.layouts:
        corpus = write_layout(work / f"corpus-{files}", texts, int(files))
        rounds, identical = [], {}
        for _ in range(args.repeat):
            raw = raw_tps()  # this machine's speed drifts: each ratio uses the raw figure taken just before
            s1, rss1 = run_prep(corpus, work / f"out-{files}-1", 1, args.encoders[0])
            others = []
            for encoder in args.encoders[1:]:
                raw_e = raw_tps()
                s_e, _ = run_prep(corpus, work / f"out-{files}-{encoder}", 1, encoder)
                others.append(raw_tokens / s_e / raw_e)
                identical[encoder] = same_shards(work / f"out-{files}-1", work / f"out-{files}-{encoder}")
                assert identical[encoder], f"--encoder {encoder} wrote other shards than --encoder {args.encoders[0]}"
                shutil.rmtree(work / f"out-{files}-{encoder}")
            ceiling = raw_scaling(cores)
            sn, rssn = run_prep(corpus, work / f"out-{files}-n", None, args.encoders[0])
            rounds.append((raw_tokens / s1 / raw, s1 / sn, raw, s1, sn, max(rss1, rssn), ceiling, *others))
            m = json.loads((work / f"out-{files}-1" / "manifest.json").read_text())
            assert m["total_tokens"] == raw_tokens, (m["total_tokens"], raw_tokens)
            assert same_shards(work / f"out-{files}-1", work / f"out-{files}-n"), \
                "1 worker and all cores wrote different shards"
            for d in (f"out-{files}-1", f"out-{files}-n"):
                shutil.rmtree(work / d)
        med = [statistics.median(x[k] for x in rounds) for k in range(len(rounds[0]))]

        def span(k: int) -> str:
            return f"{min(x[k] for x in rounds):.2f}-{max(x[k] for x in rounds):.2f}"

        print(f"{files:>5} file(s): raw {med[2]:11,.0f} tokens/s; 1 worker {raw_tokens / med[3]:11,.0f} tokens/s "
              f"({med[3]:5.1f}s) = {med[0]:.2f} x raw [{span(0)}] (goal >= 1.5; --encoder {args.encoders[0]}"
              + "".join(f"; --encoder {e}: {med[7 + i]:.2f} x raw [{span(7 + i)}]"
                        for i, e in enumerate(args.encoders[1:]))
              + f"); {cores} workers "
              f"{raw_tokens / med[4]:11,.0f} tokens/s ({med[4]:5.1f}s) = {med[1]:.2f} x 1 worker [{span(1)}] "
              f"(goal >= 1.8; raw encode in {cores} processes scaled {med[6]:.2f} x [{span(6)}] on this machine "
              f"meanwhile); peak RSS {med[5]:.0f} MiB; load average {os.getloadavg()[0]:.1f}; "
              f"shards identical between 1 and {cores} workers: True"
              + "".join(f", to --encoder {e}'s: {same}" for e, same in identical.items()))
    if args.rss:
        quarter = write_layout(work / "corpus-quarter", texts[: len(texts) // 4], 8)
        sq, rssq = run_prep(quarter, work / "out-quarter", 1)
        s1, rss1 = run_prep(work / f"corpus-{args.layouts[0]}", work / "out-rss", 1)
        print(f"peak RSS, 1 worker: {rssq:.0f} MiB on {args.mb / 4:.0f} MB, {rss1:.0f} MiB on {args.mb:.0f} MB")


if __name__ == "__main__":
    main()
