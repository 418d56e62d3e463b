"""Benchmark and proof for prep's fast encoder: speed, cache memory, exactness, Unicode scan.

Four subcommands, each on one thread, against tiktoken ``encode_ordinary`` as the reference:

``speed``  CPU seconds to encode a corpus (``--corpus gsm8k|web|distinct``, bench/prep.py's
           generators, normalized as prep does), per candidate: tiktoken ``encode_ordinary``
           (the baseline), tiktoken ``encode_to_numpy``, bpe-openai (a list per document),
           riptoken (when installed; a list per document), gigatoken batches of
           ``BATCH_CHARS`` into buffers, cold (a new encoder, first pass) and warm (second
           pass). Ratios to the baseline, medians of ``--repeat`` rounds.
``cache``  gigatoken's encode-cache budget: per budget, in a fresh process, CPU seconds of one
           pass over the corpus and the RSS it ends with (``--budgets`` in MiB).
``exact``  tokens of every document of the 200 MB GSM8K-derived and web-like corpora and of
           twice ``--fuzz`` seeded fuzz strings (tests/encoder_fuzz.py, ``big``: runs of 200,000
           spaces or digits, 1 MB tokens; once with any code point, once with none unassigned in
           Unicode 14.0, so that gigatoken itself encodes them), through prep's batch path
           (``encode_flat``), compared with tiktoken's for each ``--encodings``; prints
           mismatches (must be 0) and documents sent to tiktoken.
``scan``   every code point but surrogates in 20 contexts: where gigatoken's tokens differ
           from tiktoken's, by Unicode 14.0 category (``--assigned-only``: skip those prep sends
           to tiktoken anyway). About 40 s for o200k on this machine.

    .venv/bin/python bench/encoders.py speed --corpus web --mb 50 --repeat 3
    .venv/bin/python bench/encoders.py cache --corpus distinct --mb 200 --budgets 32 64 128 512
    .venv/bin/python bench/encoders.py exact --mb 200 --fuzz 100000
    .venv/bin/python bench/encoders.py scan --encoding cl100k_base --assigned-only
"""
from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))


def corpus(kind: str, mb: float) -> list[str]:
    """bench/prep.py's corpus of ``kind``, normalized as prep normalizes it (empty ones dropped)."""
    import prep as bench_prep

    from refinery.transforms.io.text import normalize_text

    return [t for t in map(normalize_text, bench_prep.CORPORA[kind](mb)) if t]


def batches(texts: list[str]) -> list[list[str]]:
    """``texts`` in prep's batches (:data:`~refinery.transforms.prep.documents.BATCH_CHARS`)."""
    from refinery.transforms.prep.documents import BATCH_CHARS, BATCH_DOCS

    out: list[list[str]] = [[]]
    size = 0
    for t in texts:
        out[-1].append(t)
        size += len(t)
        if size >= BATCH_CHARS or len(out[-1]) >= BATCH_DOCS:
            out.append([])
            size = 0
    return [b for b in out if b]


def cpu(fn: Callable[[], object]) -> float:
    gc.collect()
    gc.disable()
    t0 = time.process_time()
    fn()
    seconds = time.process_time() - t0
    gc.enable()
    return seconds


def rss_mb() -> float:
    return int([x for x in open("/proc/self/status") if x.startswith("VmRSS")][0].split()[1]) / 1024


def speed(args: argparse.Namespace) -> None:
    from refinery.transforms.formats import tiktoken_vocab as tk
    from refinery.transforms.formats.bpe_encoder import _bpe_bindings
    from refinery.transforms.formats.gigatoken_encoder import GigatokenTokenizer, gigatoken_backend
    from refinery.transforms.formats.tokenizer_choice import DEFAULT

    texts = corpus(args.corpus, args.mb)
    parts = batches(texts)
    enc = tk.get_encoding()
    bpe = _bpe_bindings().tokenizer_for_encoding("o200k_base")
    try:
        import riptoken

        rip = riptoken.CoreBPE(enc._mergeable_ranks, {}, enc._pat_str)
    except ImportError:
        rip = None
    candidates = {
        "tiktoken encode_ordinary (baseline)": lambda: [enc.encode_ordinary(t) for t in texts],
        "tiktoken encode_to_numpy": lambda: [enc.encode_to_numpy(t, allowed_special=set(), disallowed_special=())
                                             for t in texts],
        "bpe-openai encode (a list each)": lambda: [bpe.encode(t) for t in texts],
        **({"riptoken encode_ordinary (a list each)": lambda: [rip.encode_ordinary(t) for t in texts]} if rip else {}),
    }
    results: dict[str, list[float]] = {}
    for _ in range(args.repeat):
        for label, fn in candidates.items():
            results.setdefault(label, []).append(cpu(fn))
        fast = GigatokenTokenizer(DEFAULT, tk.get_encoding, gigatoken_backend(DEFAULT))  # a new cache
        results.setdefault("gigatoken batches -> buffers, cold", []).append(
            cpu(lambda: [fast.encode_flat(b) for b in parts]))  # noqa: B023 - called at once
        results.setdefault("gigatoken batches -> buffers, warm", []).append(
            cpu(lambda: [fast.encode_flat(b) for b in parts]))  # noqa: B023
    base = results["tiktoken encode_ordinary (baseline)"]
    print(f"speed, one thread, CPU seconds ({args.corpus}: {len(texts):,} documents, "
          f"{sum(map(len, texts)) / 1e6:.1f} M characters; medians of {args.repeat}):")
    for label, secs in results.items():
        ratios = [b / s for b, s in zip(base, secs)]
        print(f"  {label:42s} {statistics.median(secs):7.2f} s  {statistics.median(ratios):5.2f} x "
              f"[{min(ratios):.2f}-{max(ratios):.2f}]")


CACHE_RUN = """
import sys, time
sys.path.insert(0, {here!r})
import encoders
from refinery.transforms.formats.gigatoken_encoder import gigatoken_backend
from refinery.transforms.formats.tokenizer_choice import DEFAULT
parts = encoders.batches(encoders.corpus({kind!r}, {mb}))
fast = gigatoken_backend(DEFAULT, {budget})

def run():
    for b in parts:  # each result dropped at once: what grows is the encoder
        fast.encode_batch(b, parallel=False)

start = encoders.rss_mb()
t = encoders.cpu(run)
print(t, start, encoders.rss_mb())
"""


def cache(args: argparse.Namespace) -> None:
    print(f"gigatoken's encode cache ({args.corpus}, {args.mb:.0f} MB, one pass, a fresh process each):")
    for budget in args.budgets:
        code = CACHE_RUN.format(here=str(HERE), kind=args.corpus, mb=args.mb, budget=budget << 20)
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
        secs, start, end = map(float, out[-3:])
        print(f"  budget {budget:5d} MiB: {secs:6.2f} s CPU, RSS {start:5.0f} -> {end:5.0f} MiB "
              f"(+{end - start:.0f}; the corpus in memory before)")


def exact(args: argparse.Namespace) -> None:
    import numpy as np
    from encoder_fuzz import fuzz_texts

    from refinery.transforms.formats import tiktoken_vocab as tk
    from refinery.transforms.formats.bpe_encoder import FastTiktokenTokenizer
    from refinery.transforms.formats.encoders import load_tokenizer
    from refinery.transforms.formats.tokenizer_choice import resolve_tokenizer

    sets = {f"{kind} {args.mb:.0f} MB": corpus(kind, args.mb) for kind in args.corpora}
    if args.fuzz:  # any code point (those holding an unassigned one go to tiktoken), then assigned ones only
        sets[f"fuzz {args.fuzz:,} (seed {args.seed})"] = fuzz_texts(args.seed, args.fuzz, big=True)
        sets[f"fuzz {args.fuzz:,} assigned (seed {args.seed + 1})"] = fuzz_texts(args.seed + 1, args.fuzz, big=True,
                                                                                 assigned=True)
    for encoding in args.encodings:
        spec = resolve_tokenizer(encoding)
        fast = load_tokenizer(spec, "fast")
        if not isinstance(fast, FastTiktokenTokenizer):
            sys.exit(f"{encoding}: no fast encoder here (neither gigatoken nor bpe-openai is usable)")
        enc = tk.get_encoding() if encoding == tk.ENCODING_NAME else tk.get_tiktoken(encoding)
        for name, texts in sets.items():
            t0, before, bad, tokens_n = time.perf_counter(), fast.fallbacks, 0, 0
            for part in batches(texts):
                tokens, offsets = fast.encode_flat(part)
                for i, text in enumerate(part):
                    ref = enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())
                    if not np.array_equal(tokens[offsets[i]:offsets[i + 1]], ref):
                        bad += 1
                        if bad <= 5:
                            print(f"    MISMATCH {encoding} {name}: {text[:120]!r}")
                tokens_n += len(tokens)
            print(f"exact {encoding:13s} {name:24s}: {len(texts):9,} documents, {tokens_n:12,} tokens, "
                  f"{bad} mismatches, {fast.fallbacks - before:,} to tiktoken ({time.perf_counter() - t0:.0f}s)",
                  flush=True)


CONTEXTS = ["{c}", "a{c}", "A{c}", "{c}a", "{c}A", "%{c}", "{c}%", "1{c}", "{c}1", " {c}", "{c} ", "{c}{c}{c}{c}",
            "x{c}y", "X{c}y", "{c}'s", "\n{c}", "{c}\n", "{c}%s", "'{c}", "{c}ab"]


def scan(args: argparse.Namespace) -> None:
    import unicodedata

    from refinery.transforms.formats import tiktoken_vocab as tk
    from refinery.transforms.formats.gigatoken_encoder import batch_buffers, gigatoken_backend
    from refinery.transforms.formats.tokenizer_choice import resolve_tokenizer

    spec = resolve_tokenizer(args.encoding)
    giga = gigatoken_backend(spec)
    enc = tk.get_encoding() if args.encoding == tk.ENCODING_NAME else tk.get_tiktoken(args.encoding)
    differ: list[int] = []
    t0 = time.perf_counter()
    for lo in range(0, 0x110000, 1 << 14):
        cps = [cp for cp in range(lo, lo + (1 << 14)) if not 0xD800 <= cp <= 0xDFFF
               and not (args.assigned_only and unicodedata.category(chr(cp)) == "Cn")]
        texts = [ctx.format(c=chr(cp)) for cp in cps for ctx in CONTEXTS]
        tokens, offsets = batch_buffers(giga.encode_batch(texts, parallel=False), len(texts))
        for k, cp in enumerate(cps):
            for j in range(k * len(CONTEXTS), (k + 1) * len(CONTEXTS)):
                if tokens[offsets[j]:offsets[j + 1]].tolist() != enc.encode_ordinary(texts[j]):
                    differ.append(cp)
                    break
    by_category: dict[str, list[int]] = {}
    for cp in differ:
        by_category.setdefault(unicodedata.category(chr(cp)), []).append(cp)
    print(f"scan {args.encoding}: {len(differ):,} code points where gigatoken's tokens differ from tiktoken's in "
          f"{len(CONTEXTS)} contexts ({'assigned ones only, ' if args.assigned_only else ''}Unicode "
          f"{unicodedata.unidata_version} categories; {time.perf_counter() - t0:.0f}s)")
    for category, cps in sorted(by_category.items()):
        print(f"  {category}: {len(cps):,} (e.g. {', '.join(f'U+{cp:04X}' for cp in cps[:6])})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("speed")
    p.add_argument("--corpus", choices=["gsm8k", "web", "distinct"], default="web")
    p.add_argument("--mb", type=float, default=50)
    p.add_argument("--repeat", type=int, default=3)
    p = sub.add_parser("cache")
    p.add_argument("--corpus", choices=["gsm8k", "web", "distinct"], default="distinct")
    p.add_argument("--mb", type=float, default=200)
    p.add_argument("--budgets", type=int, nargs="+", default=[32, 64, 128, 512], metavar="MIB")
    p = sub.add_parser("exact")
    p.add_argument("--mb", type=float, default=200)
    p.add_argument("--corpora", nargs="*", choices=["gsm8k", "web"], default=["gsm8k", "web"])
    p.add_argument("--fuzz", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--encodings", nargs="+", default=["o200k_harmony", "o200k_base", "cl100k_base"])
    p = sub.add_parser("scan")
    p.add_argument("--encoding", default="o200k_harmony")
    p.add_argument("--assigned-only", action="store_true")
    args = ap.parse_args()
    {"speed": speed, "cache": cache, "exact": exact, "scan": scan}[args.command](args)


if __name__ == "__main__":
    main()
