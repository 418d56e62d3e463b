"""decon's scan as array operations (issue 47): the hits of :func:`scan_rows` against a plain
loop over every window of every training row, on random corpora (seeded, bounded), with
planted overlaps at random n, texts the normalization changes, 'İ', and n-grams forced to
share a hash."""
from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import numpy as np
import pytest

from refinery.transforms.decon import ngrams as ng
from refinery.transforms.decon.ngrams import compact, scan
from refinery.transforms.decon.ngrams.normalized import tokens_with_offsets
from refinery.transforms.io.rows import Row

WORDS = ["the", "a", "fox", "Jumps", "over", "dog", "42", "3.5", "x", "café", "naïve", "Straße", "İstanbul", "ΣΟΦΟΣ",
         "日本", "e\u0301t\u00e9", "co\u0085de", "tab\tbed", "", "''", "don't"]
SEPS = [" ", " ", " ", "  ", ", ", ". ", "\n", "\r\n", "\u00a0", "\u3000", " - ", "?!", "\t"]


def text_of(rng: random.Random, words: int) -> str:
    out = [rng.choice(SEPS) if rng.random() < 0.1 else ""]
    for _ in range(words):
        out += [rng.choice(WORDS), rng.choice(SEPS)]
    return "".join(out[:-1] if rng.random() < 0.7 else out)


def corpus(seed: int) -> tuple[list[str], list[str]]:
    """(eval texts, training texts): training rows of random words, some holding a piece of an
    eval text (its tokens at random n, its separators and case changed or not)."""
    rng = random.Random(seed)
    evals = [text_of(rng, rng.choice([1, 2, 3, 4, 6, 9, 14, 30])) for _ in range(rng.randint(5, 25))]
    train = []
    for _ in range(rng.randint(20, 60)):
        parts = [text_of(rng, rng.randint(0, 12))]
        for _ in range(rng.randint(0, 3)):
            toks = ng.TOKENIZERS["default"].tokenize(rng.choice(evals))
            n = rng.choice([1, 4, 5, 8, 9, 12, 13, 14, 40])
            a = rng.randint(0, max(0, len(toks) - n))
            piece = rng.choice(SEPS[:6]).join(toks[a:a + n])
            parts.append(piece.upper() if rng.random() < 0.2 else piece)
            parts.append(text_of(rng, rng.randint(0, 4)))
        train.append(rng.choice(SEPS[:4]).join(parts))
    return evals, train


def eval_rows(texts: list[str], tok: ng.WordSplitter) -> list[ng.EvalRow]:
    def read(path: str) -> Iterator[Row]:
        for i, t in enumerate(texts):
            yield i, {"text": t, "id": f"e{i}"}, None
    return ng.make_eval_rows(["x/ds/test.jsonl"], read, "text", "id", tok)[0]


def reference_hits(rows: list[ng.EvalRow], train: list[str], ns: list[int], tok: ng.WordSplitter) -> Counter[Any]:
    """(training row, n, n-gram, start, end) of every window whose n-gram an eval row has: a
    plain loop over tokens, offsets from the exact tokenizer (into the row's text)."""
    grams: set[tuple[int, str]] = set()
    for r in rows:
        toks = tokens_with_offsets(tok, r.text)[0]
        for length in ng.effective_lengths(ns, len(toks)):
            grams.update((length, g) for _, g in ng.word_split.iter_ngrams(toks, length))
    lengths = sorted({n for n, _ in grams})
    out: Counter[Any] = Counter()
    for j, text in enumerate(train):
        toks, spans = tokens_with_offsets(tok, text)
        for length in lengths:
            for i in range(len(toks) - length + 1):
                gram = " ".join(toks[i:i + length])
                if (length, gram) in grams:
                    out[(j, length, gram, spans[i][0], spans[i + length - 1][1])] += 1
    return out


def scan_hits(rows: list[ng.EvalRow], train: list[str], ns: list[int], tok: ng.WordSplitter, partitions: int,
              batch_bytes: int) -> tuple[Counter[Any], ng.ScanStats]:
    index = ng.NgramIndex.build(rows, {}, ns, tok.name, partitions)
    stats = ng.ScanStats()
    out: Counter[Any] = Counter()
    for hits in ng.scan_rows(((j, {"text": t}, None) for j, t in enumerate(train)), text_field="text", tokenizer=tok,
                             membership=index.membership, lookup=index.lookup, partitions=partitions, stats=stats,
                             batch_bytes=batch_bytes):
        order = np.lexsort((hits.start, hits.record, hits.row, hits.partition))
        assert (order == np.arange(len(order))).all()  # sorted by (partition, row, record, start)
        for r, p, k, s, e in zip(hits.row.tolist(), hits.partition.tolist(), hits.record.tolist(),
                                 hits.start.tolist(), hits.end.tolist()):
            n, gram, _, _ = index.lookup(p).records[k]
            out[(hits.rows[r][0], n, gram, s, e)] += 1
    return out, stats


@pytest.mark.parametrize("tokenizer", sorted(ng.TOKENIZERS))
def test_the_scan_finds_what_a_plain_loop_finds(tokenizer: str) -> None:
    tok = ng.TOKENIZERS[tokenizer]
    planted = 0
    for seed in range(12):
        rng = random.Random(1000 + seed)
        evals, train = corpus(seed)
        ns = sorted(rng.sample([1, 2, 3, 5, 9, 13], rng.randint(1, 3)))
        rows = eval_rows(evals, tok)
        want = reference_hits(rows, train, ns, tok)
        got, stats = scan_hits(rows, train, ns, tok, rng.choice([1, 3, 8]), rng.choice([64, 1000, 1 << 20]))
        assert got == want, (seed, ns, sorted(set(got) ^ set(want))[:5])
        assert stats.verified_hits == sum(want.values()) and stats.false_hits == 0
        planted += sum(want.values())
    assert planted > 500  # the corpora hold overlaps


def test_n_grams_that_share_a_hash_are_told_apart_by_their_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """Window hashes cut to 2 bits, on both sides: every window is a hash hit, most of the
    index's n-grams share a hash with others; a hit still counts only where its text is the
    record's, and names that record."""
    def few_bits(real: Callable[..., Any]) -> Callable[..., Any]:
        return lambda *args: real(*args) & np.uint64(3)

    monkeypatch.setattr(compact, "batch_all_window_hashes", few_bits(vars(compact)["batch_all_window_hashes"]))
    monkeypatch.setattr(scan, "batch_all_window_hashes", few_bits(vars(scan)["batch_all_window_hashes"]))
    monkeypatch.setattr(scan, "window_hashes_at", few_bits(vars(scan)["window_hashes_at"]))
    tok = ng.TOKENIZERS["default"]
    for seed in range(4):
        evals, train = corpus(50 + seed)
        rows = eval_rows(evals, tok)
        ns = [2, 5, 9]
        want = reference_hits(rows, train, ns, tok)
        got, stats = scan_hits(rows, train, ns, tok, 2, 500)
        assert got == want and want
        assert stats.false_hits > stats.verified_hits  # most hash hits were other n-grams


def test_the_scan_verifies_hits_without_a_lookup_per_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: each hash hit was looked up by its text, one at a time (``RecordColumns.find``: a
    hash and a search per n-gram). Now the hits of a batch are checked together."""
    def per_hit(*_args: object) -> NoReturn:
        raise AssertionError("a lookup per hit")

    monkeypatch.setattr(compact.RecordColumns, "find", per_hit)
    tok = ng.TOKENIZERS["default"]
    evals, train = corpus(7)
    rows = eval_rows(evals, tok)
    got, _ = scan_hits(rows, train, [5, 13], tok, 4, 1 << 20)
    assert got == reference_hits(rows, train, [5, 13], tok) and got


def test_records_out_of_hash_order_are_found_too() -> None:
    """A partition's records are in hash order (the scan searches their hashes as they are);
    a partition made of records in another order (a test's, a tool's) is searched through
    their order by hash, and a hit names the record's own index."""
    tok = ng.TOKENIZERS["default"]
    evals, train = corpus(3)
    rows = eval_rows(evals, tok)
    index = ng.NgramIndex.build(rows, {}, [2, 5], "default", 2)
    rng = random.Random(3)
    parts = {}
    for p, recs in index.records.items():
        lists = recs.to_lists()
        rng.shuffle(lists)
        parts[p] = ng.Partition(lists)
        assert parts[p].records.by_hash()[1] is not None  # not in hash order
    got: Counter[Any] = Counter()
    for hits in ng.scan_rows(((j, {"text": t}, None) for j, t in enumerate(train)), text_field="text", tokenizer=tok,
                             membership=index.membership, lookup=parts.__getitem__, partitions=2,
                             stats=ng.ScanStats()):
        for r, p, k, s, e in zip(hits.row.tolist(), hits.partition.tolist(), hits.record.tolist(),
                                 hits.start.tolist(), hits.end.tolist()):
            n, gram, _, _ = parts[p].records[k]
            got[(hits.rows[r][0], n, gram, s, e)] += 1
    assert got == reference_hits(rows, train, [2, 5], tok) and got
