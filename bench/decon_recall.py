"""Recall of ``refinery decon`` (HELM's n-gram overlap): what it catches of eval items planted
in a training corpus, edited in the ways a crawl or a copy edits them, and what it flags
where nothing was planted.

Eval set: the GSM8K test questions the repo ships (tests/data/gsm8k, 1,319 rows, ``id``
``test-ROW``), plus, for the short kinds, short eval rows cut from them (``short-ROW``: the
question's last sentence, 5 to 12 tokens; ``tiny-ROW``: its last 3 words, under 5 tokens).

Training corpus (one JSON-lines file, rows shuffled with ``--seed``): ``--items`` rows per
planted kind, each a different eval question, edited, inside filler text (sentences of random
pseudo-words, none of them a token of the eval set, so that only the planted text can match):

- ``verbatim``: the question as is;
- ``case_punct``: upper-cased, every ASCII punctuation mark swapped for another;
- ``punct_removed``: every ASCII punctuation mark deleted (``don't`` -> ``dont``, ``5.5`` -> ``55``);
- ``word_dropped`` / ``word_replaced``: one word (at a random place) dropped / replaced by a
  filler word;
- ``every_6th_word_replaced``: every 6th word replaced by a filler word;
- ``numbers_changed``: every number changed (``48`` -> ``53``), the words kept;
- ``first_half``: the first half of its words;
- ``wrapped``: line-wrapped at 60 characters at spaces (``textwrap.fill``);
- ``hard_wrapped``: a newline inserted every 60 characters, inside words too (fixed-width dumps);
- ``in_long_doc``: verbatim, in the middle of ~50 KB of filler;
- ``short_question``: a ``short-ROW`` eval row (5-12 tokens), verbatim inside filler;
- ``short_question_at_end``: the same, at the end of its training row (filler before it only);
- ``tiny_question``: a ``tiny-ROW`` eval row (under ``--min-eval-tokens``' 5), verbatim inside filler.

and ``--clean`` rows of each clean kind, nothing planted: ``clean_filler`` (filler only) and
``clean_gsm8k_train`` (GSM8K train question + answer: the same domain, other items).

The ground truth (which row holds which eval id, of which kind) is kept in memory when the
corpus is written. Then ``refinery decon`` runs once (a subprocess: ``--runner local
--no-progress --ngrams N...``), and from its detail records (``stats/overlap_details``) and
drop list (``stats/contaminated_train_docs.jsonl``) this prints, per kind and configured n:

- recall: planted rows with a detail record naming their own eval id at that n (the record's
  ``n`` is ``min(n, tokens of the eval row)``) / planted rows;
- flagged: clean rows in the drop list at that n (false flags: nothing was planted there).

Every detail pair (training row, eval id, n) is also checked against a plain-Python reference
of the same method (``ng.reference_overlap`` with decon's ``--min-eval-tokens`` rule): a
difference exits 1, naming it. Prints a markdown table (docs/DECON.md, "Recall") and writes
the figures as JSON to ``--out``.

    .venv/bin/python bench/decon_recall.py [--items 50] [--clean 500] [--ngrams 5 9 13] [--seed 0] \\
        [--workdir DIR] [--out recall.json]
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import string
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from datetime import date
from typing import Any, Callable, Iterable

from refinery.transforms.decon import ngrams as ng
from refinery.transforms.decon.ngrams.details import read_details
from refinery.transforms.io.text import normalize_text

HERE = os.path.dirname(os.path.abspath(__file__))
GSM8K = os.path.join(HERE, "..", "tests", "data", "gsm8k")
MIN_EVAL_TOKENS = 5  # refinery decon's --min-eval-tokens default (docs/DECON.md)
FILLER_CHARS = (150, 500)  # filler on either side of a planted item, characters (uniform)
LONG_DOC_CHARS = 25_000  # filler on either side of an ``in_long_doc`` item
WRAP = 60
PUNCT = string.punctuation
PUNCT_SWAP = str.maketrans(PUNCT, PUNCT[1:] + PUNCT[0])  # each ASCII punctuation mark -> the next one
TOKENIZER = ng.TOKENIZERS["default"]


@dataclass(frozen=True)
class Plant:
    """One training row and its ground truth: ``kind``; the eval row planted in it (None for
    a clean row) and that row's text as the eval set has it; ``text``: the training row's text."""

    row: int
    kind: str
    eval_id: str | None
    eval_text: str | None
    text: str


@dataclass(frozen=True)
class Corpus:
    """What the bench writes: the eval rows (``{"id", "text"}``, eval order) and the training rows."""

    eval_rows: list[dict[str, Any]]
    plants: list[Plant]


def num_tokens(text: str) -> int:
    """HELM tokens of the normalized text, as decon counts an eval row's (an empty token at
    either end included)."""
    return len(TOKENIZER.tokenize(normalize_text(text)))


# ---- filler ------------------------------------------------------------------------------------


def pseudo_words(rnd: random.Random, count: int, avoid: set[str]) -> list[str]:
    """``count`` distinct lower-case pseudo-words of 2-3 syllables, none in ``avoid``."""
    onsets, vowels, codas = "bdfgklmnprstvz", "aeiou", ["", "", "n", "r", "s", "k"]
    words: set[str] = set()
    while len(words) < count:
        w = "".join(rnd.choice(onsets) + rnd.choice(vowels) + rnd.choice(codas) for _ in range(rnd.randint(2, 3)))
        if w not in avoid:
            words.add(w)
    return sorted(words)


def filler(rnd: random.Random, vocab: list[str], chars: int) -> str:
    """Sentences of 6-14 words of ``vocab`` (capitalized, ending in a period), ``chars`` characters or a few more."""
    out: list[str] = []
    size = 0
    while size < chars:
        words = rnd.choices(vocab, k=rnd.randint(6, 14))
        sentence = " ".join([words[0].capitalize(), *words[1:]]) + "."
        out.append(sentence)
        size += len(sentence) + 1
    return " ".join(out)


# ---- the edits (each: question, rng, filler vocabulary -> the text planted, or None: not applicable) ----


def edit_word_dropped(q: str, rnd: random.Random, vocab: list[str]) -> str | None:
    words = q.split()
    del words[rnd.randrange(len(words))]
    return " ".join(words)


def edit_word_replaced(q: str, rnd: random.Random, vocab: list[str]) -> str | None:
    words = q.split()
    words[rnd.randrange(len(words))] = rnd.choice(vocab)
    return " ".join(words)


def edit_every_6th(q: str, rnd: random.Random, vocab: list[str]) -> str | None:
    words = q.split()
    for i in range(5, len(words), 6):
        words[i] = rnd.choice(vocab)
    return " ".join(words)


def edit_numbers(q: str, rnd: random.Random, vocab: list[str]) -> str | None:
    if not re.search(r"\d", q):
        return None
    return re.sub(r"\d+", lambda m: str(int(m.group()) + rnd.randint(1, 9)), q)


def edit_half(q: str, rnd: random.Random, vocab: list[str]) -> str | None:
    words = q.split()
    return " ".join(words[:max(1, len(words) // 2)])


def edit_hard_wrap(q: str, rnd: random.Random, vocab: list[str]) -> str | None:
    return "\n".join(q[i:i + WRAP] for i in range(0, len(q), WRAP))


def last_sentence(q: str) -> str:
    return re.split(r"(?<=[.!?])\s+", q.strip())[-1]


def short_question(q: str) -> str | None:
    """The question's last sentence when it has 5-12 tokens (a short eval item decon indexes)."""
    s = last_sentence(q)
    return s if MIN_EVAL_TOKENS <= num_tokens(s) <= 12 else None


def tiny_question(q: str) -> str | None:
    """The last 3 words of the question when they have fewer than 5 tokens (decon does not index it)."""
    s = " ".join(q.split()[-3:])
    return s if num_tokens(s) < MIN_EVAL_TOKENS else None


Edit = Callable[[str, random.Random, list[str]], "str | None"]
EDITS: dict[str, Edit] = {
    "verbatim": lambda q, rnd, vocab: q,
    "case_punct": lambda q, rnd, vocab: q.upper().translate(PUNCT_SWAP),
    "punct_removed": lambda q, rnd, vocab: q.translate(str.maketrans("", "", PUNCT)),
    "word_dropped": edit_word_dropped,
    "word_replaced": edit_word_replaced,
    "every_6th_word_replaced": edit_every_6th,
    "numbers_changed": edit_numbers,
    "first_half": edit_half,
    "wrapped": lambda q, rnd, vocab: textwrap.fill(q, WRAP),
    "hard_wrapped": edit_hard_wrap,
    "in_long_doc": lambda q, rnd, vocab: q,
}
# kind -> (id prefix, the eval row cut from a question)
DERIVED: dict[str, tuple[str, Callable[[str], "str | None"]]] = {
    "short_question": ("short", short_question),
    "short_question_at_end": ("short", short_question),
    "tiny_question": ("tiny", tiny_question),
}
AT_END = {"short_question_at_end"}  # planted at the row's end (filler before it only)
KINDS = [*EDITS, *DERIVED]
CLEAN_KINDS = ["clean_filler", "clean_gsm8k_train"]


def gsm8k(split: str) -> list[dict[str, Any]]:
    with gzip.open(os.path.join(GSM8K, f"{split}.jsonl.gz"), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def build_corpus(questions: list[str], train_docs: list[str], items: int, clean: int, seed: int,
                 kinds: Iterable[str] = KINDS) -> Corpus:
    """The eval rows (every question, ``test-ROW``; then the short rows cut for the short
    kinds) and the training rows: ``items`` per kind, each a distinct question (drawn with
    ``seed``), inside filler; ``clean`` rows of each clean kind (``train_docs`` for
    ``clean_gsm8k_train``); shuffled. ValueError when the questions run out."""
    rnd = random.Random(seed)
    eval_vocab = {t for q in questions for t in TOKENIZER.tokenize(normalize_text(q))}
    vocab = pseudo_words(rnd, 3000, eval_vocab)
    texts = {q for q in questions}
    if len(texts) != len(questions):
        raise ValueError("the eval questions must be distinct texts (decon records a shared text once)")
    order = list(range(len(questions)))
    rnd.shuffle(order)
    pool = iter(order)
    eval_rows = [{"id": f"test-{i}", "text": q} for i, q in enumerate(questions)]
    rows: list[tuple[str, str | None, str | None, str]] = []  # (kind, eval id, eval text, training text)
    for kind in kinds:
        made = 0
        while made < items:
            i = next(pool, None)
            if i is None:
                raise ValueError(f"{kind}: not enough eval questions for --items {items} per kind")
            q = questions[i]
            if kind in DERIVED:
                prefix, cut = DERIVED[kind]
                short = cut(q)
                if short is None or short in texts:
                    continue
                texts.add(short)
                eval_id, text, planted = f"{prefix}-{i}", short, short
                eval_rows.append({"id": eval_id, "text": text})
            else:
                edited = EDITS[kind](q, rnd, vocab)
                if edited is None:
                    continue
                eval_id, text, planted = f"test-{i}", q, edited
            around = LONG_DOC_CHARS if kind == "in_long_doc" else None
            before = filler(rnd, vocab, around or rnd.randint(*FILLER_CHARS))
            after = "" if kind in AT_END else " " + filler(rnd, vocab, around or rnd.randint(*FILLER_CHARS))
            rows.append((kind, eval_id, text, f"{before} {planted}{after}"))
            made += 1
    for _ in range(clean):
        rows.append(("clean_filler", None, None, filler(rnd, vocab, rnd.randint(300, 1000))))
    for doc in rnd.sample(train_docs, min(clean, len(train_docs))):
        rows.append(("clean_gsm8k_train", None, None, doc))
    rnd.shuffle(rows)
    return Corpus(eval_rows, [Plant(r, kind, eid, etext, text) for r, (kind, eid, etext, text) in enumerate(rows)])


# ---- scoring -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Flags:
    """What a decon output says: ``pairs``, every (training row, eval id, record n) of its detail
    records (the record's n is ``min(n, tokens of the eval row)``); ``dropped``: training row ->
    the configured n of its drop-list line."""

    pairs: set[tuple[int, str, int]]
    dropped: dict[int, list[int]]


def read_flags(output: str) -> Flags:
    """The :class:`Flags` of a finished ``refinery decon`` output (one training file)."""
    pairs = {(int(d["train_row"]), str(d["instance_id"]), int(d["n"])) for d in read_details(output)}
    dropped: dict[int, list[int]] = {}
    with open(os.path.join(output, "stats", "contaminated_train_docs.jsonl"), "rb") as f:
        for line in f:
            d = json.loads(line)
            dropped[int(d["train_row"])] = [int(n) for n in d["ns"]]
    return Flags(pairs, dropped)


def eval_rows(corpus: Corpus) -> list[ng.EvalRow]:
    """The corpus's eval rows as decon reads them (``num_tokens``: of the normalized text)."""
    rows, _ = ng.eval_rows_of((("gsm8k", "eval.jsonl", i, r) for i, r in enumerate(corpus.eval_rows)), "text", "id",
                              TOKENIZER)
    return rows


def reference_flags(corpus: Corpus, ns: list[int], min_eval_tokens: int = MIN_EVAL_TOKENS) -> Flags:
    """The same :class:`Flags` by the plain-Python method (``ng.reference_overlap``), eval rows
    of fewer than ``min_eval_tokens`` tokens left out as decon leaves them out."""
    rows = eval_rows(corpus)
    indexed = [r for r in rows if r.num_tokens >= min_eval_tokens]
    _, details = ng.reference_overlap(indexed, (("train", p.row, p.text) for p in corpus.plants), ns, TOKENIZER)
    pairs = {(row, rows[idx].instance_id, length) for idx, _, row, length, _ in details}
    dropped: dict[int, set[int]] = {}
    for idx, _, row, length, _ in details:
        dropped.setdefault(row, set()).update(ng.configured_ns(ns, rows[idx].num_tokens, length))
    return Flags(pairs, {row: sorted(s) for row, s in dropped.items()})


def caught(plant: Plant, flags: Flags, n: int, tokens: dict[str, int]) -> bool:
    """Whether decon flagged ``plant``'s row as overlapping its own eval row at configured ``n``
    (``tokens``: eval id -> tokens of its row)."""
    assert plant.eval_id is not None
    return (plant.row, plant.eval_id, min(n, tokens[plant.eval_id])) in flags.pairs


def score(corpus: Corpus, flags: Flags, ns: list[int]) -> dict[str, dict[str, Any]]:
    """Per planted kind: ``rows``, ``caught`` per n (str(n) keys) and ``eval_tokens``, the
    median tokens of its eval rows; per clean kind: ``rows`` and ``flagged`` per n (rows in the
    drop list at n)."""
    tokens = {r.instance_id: r.num_tokens for r in eval_rows(corpus)}
    out: dict[str, dict[str, Any]] = {}
    lengths: dict[str, list[int]] = {}
    for p in corpus.plants:
        key = "flagged" if p.eval_id is None else "caught"
        k = out.setdefault(p.kind, {"rows": 0, key: {str(n): 0 for n in ns}})
        k["rows"] += 1
        for n in ns:
            if p.eval_id is None:
                k[key][str(n)] += n in flags.dropped.get(p.row, ())
            else:
                k[key][str(n)] += caught(p, flags, n, tokens)
        if p.eval_id is not None:
            lengths.setdefault(p.kind, []).append(tokens[p.eval_id])
    for kind, t in lengths.items():
        out[kind]["eval_tokens"] = sorted(t)[len(t) // 2]
    return {kind: out[kind] for kind in [*KINDS, *CLEAN_KINDS] if kind in out}


def differences(a: Flags, b: Flags, limit: int = 5) -> list[str]:
    """Lines naming what ``a`` (decon) has and ``b`` (the reference) lacks, and the reverse."""
    out = [f"decon only: training row {r}, eval id {e}, n {n}" for r, e, n in sorted(a.pairs - b.pairs)[:limit]]
    out += [f"reference only: training row {r}, eval id {e}, n {n}" for r, e, n in sorted(b.pairs - a.pairs)[:limit]]
    out += [f"drop list: training row {r}: decon {a.dropped.get(r)}, reference {b.dropped.get(r)}"
            for r in sorted(set(a.dropped) | set(b.dropped)) if a.dropped.get(r) != b.dropped.get(r)][:limit]
    return out


def table(scores: dict[str, dict[str, Any]], ns: list[int]) -> str:
    """The markdown table: recall per planted kind and n; then the clean rows flagged per n."""
    head = "| kind | rows | eval tokens (median) | " + " | ".join(f"n={n}" for n in ns) + " |"
    lines = [head, "|---|---:|---:|" + "---:|" * len(ns)]
    for kind, k in scores.items():
        if "caught" in k:
            cells = [f"{k['caught'][str(n)] / k['rows']:.2f} ({k['caught'][str(n)]}/{k['rows']})" for n in ns]
            lines.append(f"| {kind} | {k['rows']} | {k['eval_tokens']} | " + " | ".join(cells) + " |")
    for kind, k in scores.items():
        if "flagged" in k:
            cells = [f"{k['flagged'][str(n)]} flagged" for n in ns]
            lines.append(f"| {kind} (nothing planted) | {k['rows']} | | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- the run -------------------------------------------------------------------------------------


def write_jsonl(path: str, rows: Iterable[dict[str, Any]]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def run_decon(work: str, corpus: Corpus, ns: list[int]) -> str:
    """Writes the inputs under ``work`` and runs ``refinery decon`` on them; its output folder."""
    eval_file = os.path.join(work, "eval", "gsm8k", "test.jsonl")
    train_file = os.path.join(work, "train", "corpus.jsonl")
    write_jsonl(eval_file, corpus.eval_rows)
    write_jsonl(train_file, ({"text": p.text} for p in corpus.plants))
    out = os.path.join(work, "out")
    cmd = [os.path.join(os.path.dirname(sys.executable), "refinery"), "decon", "--eval", eval_file,
           "--train", os.path.dirname(train_file), "--output", out, "--ngrams", *map(str, ns),
           "--min-eval-tokens", str(MIN_EVAL_TOKENS), "--max-ngram-details", "none",
           "--runner", "local", "--no-progress", "--force"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"refinery decon exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=50, help="planted training rows per kind (default 50)")
    ap.add_argument("--clean", type=int, default=500, help="training rows of each clean kind (default 500)")
    ap.add_argument("--ngrams", type=int, nargs="+", default=[5, 9, 13], help="n-gram lengths (default 5 9 13)")
    ap.add_argument("--seed", type=int, default=0, help="the draw of questions, edits and filler (default 0)")
    ap.add_argument("--workdir", default=None,
                    help="where the inputs and decon's output go (default: a new temp folder)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    a = ap.parse_args(argv)
    ns = sorted(set(a.ngrams))
    work = a.workdir or tempfile.mkdtemp(prefix="decon-recall-")
    questions = [r["question"] for r in gsm8k("test")]
    train_docs = [r["question"] + "\n\n" + r["answer"] for r in gsm8k("train")]
    corpus = build_corpus(questions, train_docs, a.items, a.clean, a.seed)
    t0 = time.time()
    out = run_decon(work, corpus, ns)
    took = time.time() - t0
    flags = read_flags(out)
    diff = differences(flags, reference_flags(corpus, ns))
    scores = score(corpus, flags, ns)
    mb = sum(len(p.text.encode()) for p in corpus.plants) / 1e6
    print(f"eval: {len(corpus.eval_rows):,} rows (GSM8K test questions + short rows); training: "
          f"{len(corpus.plants):,} rows, {mb:.1f} MB; --items {a.items} --clean {a.clean} --seed {a.seed}; "
          f"refinery decon --ngrams {' '.join(map(str, ns))} --min-eval-tokens {MIN_EVAL_TOKENS}: {took:.0f} s "
          f"({out})\n")
    print(table(scores, ns))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"date": date.today().isoformat(), "ngrams": ns, "items": a.items, "clean": a.clean,
                       "seed": a.seed, "min_eval_tokens": MIN_EVAL_TOKENS, "kinds": scores}, f, indent=1)
    if diff:
        print("\ndecon's detail records differ from the reference method's:\n  " + "\n  ".join(diff), file=sys.stderr)
        return 1
    print("\ndecon's detail records and drop list equal the reference method's (ng.reference_overlap).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
