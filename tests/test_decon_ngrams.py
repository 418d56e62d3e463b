"""Pure-function tests of refinery.transforms.decon.ngrams (no Beam)."""
from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
import string
import sys
from collections import defaultdict
from collections.abc import Iterator
from functools import partial
from typing import Any

import msgpack
import numpy as np
import pytest
from helpers import GSM8K_TEST, gsm8k_rows

from refinery.transforms.decon import ngrams as ng
from refinery.transforms.decon.ngrams.normalized import match_text
from refinery.transforms.decon.ngrams.reduce import ReduceResult
from refinery.transforms.formats.row_ids import content_id
from refinery.transforms.io.rows import Row

HELM_RE = re.compile(rf"[\s{re.escape(string.punctuation)}]+")
DEFAULT = ng.TOKENIZERS["default"]


def helm(text: str) -> list[str]:
    return HELM_RE.split(text.lower())


# ---------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("Yes.", ["yes", ""]),
    ("?", ["", ""]),
    ("", [""]),
    ("...behaving.", ["", "behaving", ""]),
    ("Moore’s law", ["moore’s", "law"]),           # curly apostrophe is not ASCII punctuation
    ("Moore's law", ["moore", "s", "law"]),
    ("a\u00a0b\x85c\x1cd\x1fe", ["a", "b", "c", "d", "e"]),  # NBSP, NEL, \x1c-\x1f are \s
    ("zero\u200bwidth", ["zero\u200bwidth"]),     # U+200B is not whitespace
    ("snake_case", ["snake", "case"]),
    ("pi is 3.14", ["pi", "is", "3", "14"]),
    ("em—dash … “quoted”", ["em—dash", "…", "“quoted”"]),
    ("MiXeD  \t\n CaSe", ["mixed", "case"]),
])
def test_default_tokenizer_exact(text: str, expected: list[str]) -> None:
    assert DEFAULT.tokenize(text) == expected == helm(text)
    assert ng.default_tokenize(text) == expected


def test_alternative_tokenizers() -> None:
    assert ng.get_tokenizer("no_lowercase").tokenize("Hello, World!") == ["Hello", "World", ""]
    assert ng.get_tokenizer("whitespace").tokenize("Hello, World!  x") == ["hello,", "world!", "x"]
    assert ng.get_tokenizer("whitespace").tokenize(" a ") == ["", "a", ""]
    with pytest.raises(ValueError):
        ng.get_tokenizer("bpe")


POOL = list("abcXYZ019 _.,;'!?-\t\n") + ["\u00a0", "\x85", "\x1c", "\u200b", "é", "É", "İ", "ß", "’", "—", "😀",
                                          "\u3000", "\x00", "ﬁ", "Ω", "ǅ"]


def _random_texts(seed: int, count: int, pool: list[str] = POOL) -> list[str]:
    rnd = random.Random(seed)
    return ["".join(rnd.choice(pool) for _ in range(rnd.randrange(0, 40))) for _ in range(count)]


def test_tokenizer_matches_regex_on_random_unicode() -> None:
    for name in ng.TOKENIZERS:
        tok = ng.TOKENIZERS[name]
        pat = re.compile(rf"[{tok.separators}]+")
        for text in _random_texts(1, 400):
            exp = pat.split(text.lower() if tok.lowercase else text)
            assert tok.tokenize(text) == exp
            tokens, spans = tok.tokenize_with_offsets(text)
            assert tokens == exp


def test_offsets_index_the_original_text() -> None:
    text = "İstanbul is BIG. İİ end"
    assert len(text.lower()) == len(text) + 3
    tokens, spans = DEFAULT.tokenize_with_offsets(text)
    assert tokens == helm(text) == ["i̇stanbul", "is", "big", "i̇i̇", "end"]
    assert [text[s:e] for s, e in spans] == ["İstanbul", "is", "BIG", "İİ", "end"]
    # re-tokenizing the slice of the original at each span gives the token back
    for tok, (s, e) in zip(tokens, spans):
        assert helm(text[s:e]) == [tok]


def test_offsets_roundtrip_random() -> None:
    for text in _random_texts(2, 500):
        tokens, spans = DEFAULT.tokenize_with_offsets(text)
        assert tokens == helm(text)
        for k, (tok, (s, e)) in enumerate(zip(tokens, spans)):
            assert 0 <= s <= e <= len(text)
            if tok:
                assert helm(text[s:e]) == [tok]
            else:  # empty tokens exist only at the ends of the text
                assert k in (0, len(tokens) - 1) and s == e and s in (0, len(text))
        # n-gram spans: slice and re-tokenize
        for length in (1, 2, 3):
            for key, offs in ng.eval_ngrams(tokens, spans, [length]).items():
                for s, e in offs:
                    assert " ".join(helm(text[s:e])) == key[1]


def test_greek_final_sigma_whole_string_lowering() -> None:
    text = "ΟΔΟΣ ΑΣ'Β"
    # whole-string lowering: the Σ before "'Β" is not final (the apostrophe is case-ignorable)
    assert text.lower() == "οδος ασ'β"
    assert "ΑΣ".lower() == "ας"  # per-token lowering would differ
    tokens, spans = DEFAULT.tokenize_with_offsets(text)
    assert tokens == helm(text) == ["οδος", "ασ", "β"]
    assert [text[s:e] for s, e in spans] == ["ΟΔΟΣ", "ΑΣ", "Β"]
    batch = ng.tokenize_batch([DEFAULT.prepare(text)], DEFAULT.byte_table)
    assert [batch.token_bytes(k).decode() for k in range(len(batch.starts))] == tokens


def test_nonascii_separator_set_is_exact() -> None:
    # every code point: the fast path's notion of a separator equals the regex class
    one = re.compile(rf"[{ng.DEFAULT_SEPARATORS}]")
    table = DEFAULT.byte_table
    nonascii = DEFAULT.nonascii_separators
    chars = "".join(chr(c) for c in range(sys.maxunicode + 1) if not 0xD800 <= c <= 0xDFFF)
    regex_set = set(one.findall(chars))
    fast_set = {chr(b) for b in range(128) if table[b] == 0x20} | set(nonascii.findall(chars))
    assert regex_set == fast_set


# ---------------------------------------------------------------------------------------
# fast path: batch tokenization and hashes equal the exact definitions
# ---------------------------------------------------------------------------------------

def test_batch_tokens_and_hashes_match_exact() -> None:
    long_token = "x" * 100 + "é" * 30
    texts = ["Yes.", "?", "", " lead", "trail ", "a\x00b", "12345678", "123456789", "a" * 64, "b" * 65,
             long_token + " short", "İİİ. ΑΣ'Β x\u00a0y\u2028z", "\ud800 lone surrogate"] + _random_texts(3, 300)
    for name, tok in ng.TOKENIZERS.items():
        batch = ng.tokenize_batch([tok.prepare(t) for t in texts], tok.byte_table)
        for r, text in enumerate(texts):
            lo, hi = int(batch.row_first[r]), int(batch.row_first[r + 1])
            got = [batch.token_bytes(k).decode("utf-8", "surrogatepass") for k in range(lo, hi)]
            exact = tok.tokenize(text)
            assert got == exact, (name, text)
            assert [int(h) for h in batch.hashes[lo:hi]] == [ng.token_hash(t) for t in exact]
        for length in (1, 2, 5):
            pos, hashes = ng.batch_window_hashes(batch, length)
            for p, h in zip(pos.tolist(), hashes.tolist()):
                r = int(batch.row_of[p])
                i = p - int(batch.row_first[r])
                gram = " ".join(tok.tokenize(texts[r])[i:i + length])
                assert h == ng.ngram_hash(length, gram)


def test_ngram_hash_and_partition_are_stable() -> None:
    # fixed values: a change of the hash definition invalidates stored indexes (membership files,
    # partition files); if this fails, bump the decon FORMAT_VERSION, do not update the numbers
    assert ng.ngram_hash(2, "hello world") == 14905141629898920256
    assert ng.ngram_hash(1, "") == 17622645311363874476
    assert ng.ngram_hash(13, "the quick brown fox jumps over the lazy dog and runs far away") == 5594190530321354089
    assert ng.token_hash("hello") == 7494808937238676964
    assert ng.token_hash("x" * 100) == 4815851833863556588  # a long token: the blake2b branch
    assert ng.partition_of(3, "a b c", 7) == 1
    assert ng.ngram_hash(2, "hello world") != ng.ngram_hash(2, "world hello")
    assert ng.ngram_hash(1, "") != ng.ngram_hash(2, " ")
    assert 0 <= ng.partition_of(3, "a b c", 7) < 7
    with pytest.raises(ValueError):
        ng.ngram_hash(3, "a b")


# ---------------------------------------------------------------------------------------
# n-grams
# ---------------------------------------------------------------------------------------

def test_short_rows_and_empty_skip() -> None:
    tokens, spans = DEFAULT.tokenize_with_offsets("Hello there, friend.")
    assert tokens == ["hello", "there", "friend", ""]
    grams = ng.eval_ngrams(tokens, spans, [2, 5, 13])
    # n=5 and n=13 both map to the one 4-gram
    assert set(grams) == {(2, "hello there"), (2, "there friend"), (2, "friend "), (4, "hello there friend ")}
    assert grams[(4, "hello there friend ")] == [(0, 20)]
    assert ng.effective_lengths([2, 5, 13], 4) == {2: [2], 4: [5, 13]}
    # punctuation-only and empty rows yield nothing
    for text in ["?!", "", "...", " "]:
        t, s = DEFAULT.tokenize_with_offsets(text)
        assert ng.eval_ngrams(t, s, [1, 3, 13]) == {}
    # a single word row at n=1 still works, and '' windows are skipped
    t, s = DEFAULT.tokenize_with_offsets("Yes.")
    assert ng.eval_ngrams(t, s, [1]) == {(1, "yes"): [(0, 3)]}
    assert ng.eval_ngrams(t, s, [5]) == {(2, "yes "): [(0, 4)]}


def test_repeated_ngram_offsets() -> None:
    t, s = DEFAULT.tokenize_with_offsets("a b a b a b")
    assert ng.eval_ngrams(t, s, [2]) == {(2, "a b"): [(0, 3), (4, 7), (8, 11)], (2, "b a"): [(2, 5), (6, 9)]}


# ---------------------------------------------------------------------------------------
# names and ids
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("path,name", [
    ("decontamination/gsm8k-dolma-3fa9c1/test.jsonl", "gsm8k"),
    ("gs://b/decon/mmlu-dolma-abcdef/data.jsonl.zst", "mmlu"),
    ("x/gsm8k/test.jsonl.gz", "gsm8k"),
    ("x/math-3fa9c1/test.parquet", "math"),
    ("x/math-3FA9C1/test.json", "math-3FA9C1"),          # uppercase hex is not stripped
    ("x/humaneval-dolma/test.json.zst", "humaneval"),
    ("x/arc-dolma-12345/test.jsonl", "arc-dolma-12345"),  # 5 hex chars: not a hash suffix
    ("x/boolq-dolma-3fa9c1", "boolq"),                     # not a data file: its own name
    ("x/piqa-3fa9c1-dolma-abcdef/t.jsonl", "piqa-3fa9c1"),
    ("x/y/notes.txt", "notes.txt"),
])
def test_eval_dataset_name(path: str, name: str) -> None:
    assert ng.eval_dataset_name(path) == name


def test_record_ids() -> None:
    assert ng.record_id({"id": 100005, "text": "x"}) == "100005"
    assert ng.record_id({"id": "abc"}) == "abc"
    assert ng.record_id({"doc": 7}, id_field="doc") == "7"
    rec = {"text": "hello", "meta": {"b": 1, "a": [{"z": 1, "y": 2}]}}
    sorted_rec = {"meta": {"a": [{"y": 2, "z": 1}], "b": 1}, "text": "hello"}
    expected = str(int.from_bytes(hashlib.blake2b(msgpack.packb(sorted_rec, use_bin_type=True),
                                                  digest_size=8).digest(), "big"))
    assert ng.record_id(rec) == expected
    # key order of the input does not matter; "id": null is part of the hashed record
    assert ng.record_id({"meta": {"a": [{"y": 2, "z": 1}], "b": 1}, "text": "hello"}) == expected
    with_null = ng.record_id({**rec, "id": None})
    assert with_null != expected
    assert with_null == str(int.from_bytes(hashlib.blake2b(msgpack.packb(
        {"id": None, **sorted_rec}, use_bin_type=True), digest_size=8).digest(), "big"))


# ---------------------------------------------------------------------------------------
# membership + scan verification
# ---------------------------------------------------------------------------------------

def test_membership_roundtrip_and_contains() -> None:
    rnd = np.random.default_rng(0)
    hashes = rnd.integers(0, 2**63, size=5000, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    m = ng.Membership(hashes, [5, 13], {"partitions": 4})
    m2 = ng.Membership.from_bytes(m.to_bytes())
    assert m2.lengths == (5, 13) and m2.meta == {"partitions": 4} and len(m2) == len(np.unique(hashes))
    probe = np.concatenate([hashes[:100], hashes[:100] + np.uint64(1)])  # odd + even
    got = m2.contains(probe)
    assert got[:100].all() and not got[100:].any()
    assert m.nbytes <= 16 * len(m)
    assert not ng.Membership([], [5]).contains(probe).any()


def _eval_rows(texts: list[str], dataset: str = "ds") -> list[ng.EvalRow]:
    def read(path: str) -> Iterator[Row]:
        for i, t in enumerate(texts):
            yield i, {"text": t, "id": f"e{i}"}, None
    rows, _ = ng.make_eval_rows([f"x/{dataset}/test.jsonl"], read, "text", "id", DEFAULT)
    return rows


def _scan(eval_rows: list[ng.EvalRow], train_texts: list[str], ns: list[int], partitions: int = 4,
          membership: ng.Membership | None = None, batch_bytes: int = 1 << 20, tok: ng.WordSplitter = DEFAULT
          ) -> tuple[list[ng.ScanHits], ng.ScanStats, dict[int, ng.Partition]]:
    index = ng.build_index(eval_rows, ns, tok)
    parts = {p: ng.Partition(recs) for p, recs in ng.partition_records(index, partitions).items()}
    if membership is None:
        membership = ng.Membership([v[0] for v in index.values()], {k[0] for k in index}, {"ns": ns})
    stats = ng.ScanStats()
    batches = list(ng.scan_rows(((i, {"text": t}, None) for i, t in enumerate(train_texts)), text_field="text",
                                tokenizer=tok, membership=membership,
                                lookup=lambda p: parts.get(p, ng.Partition([])), partitions=partitions, stats=stats,
                                batch_bytes=batch_bytes))
    return batches, stats, parts


def _hits(batches: list[ng.ScanHits], parts: dict[int, ng.Partition]) -> dict[tuple[int, int, str], list[list[int]]]:
    """(training row, n, ngram) -> offsets of its occurrences, from the scan's batches."""
    out: dict[tuple[int, int, str], list[list[int]]] = {}
    for hits in batches:
        g = hits.group_starts().tolist()
        for a, b in zip(g[:-1], g[1:]):
            n, gram, _, _ = parts[int(hits.partition[a])].records[int(hits.record[a])]
            key = (hits.rows[int(hits.row[a])][0], n, gram)
            assert key not in out  # one group per (row, n-gram)
            out[key] = [[s, e] for s, e in zip(hits.start[a:b].tolist(), hits.end[a:b].tolist())]
    return out


def test_hash_hits_are_verified_no_false_positives() -> None:
    rows = _eval_rows(["the quick brown fox jumps"])
    index = ng.build_index(rows, [3], DEFAULT)
    # a membership that (wrongly) claims n-grams the index does not have: every probe of
    # "lazy dog sleeps" hits the hash set, and verification must reject it
    fake = [ng.ngram_hash(3, "lazy dog sleeps"), ng.ngram_hash(3, "dog sleeps all")]
    m = ng.Membership([v[0] for v in index.values()] + fake, [3])
    batches, stats, parts = _scan(rows, ["the lazy dog sleeps all day", "quick brown fox!"], [3], membership=m)
    assert stats.false_hits == 2 and stats.verified_hits == 1 and stats.rows_with_hits == 1
    assert list(_hits(batches, parts)) == [(1, 3, "quick brown fox")]


def test_scan_offsets_and_short_eval_rows() -> None:
    rows = _eval_rows(["Quick fox.", "İstanbul Grand Bazaar opens", "?", "word"])
    train = ["A QUICK fox. and a quick  fox.", "in İSTANBUL grand bazaar opens daily", "sword words", "word"]
    batches, stats, parts = _scan(rows, train, [2, 13], batch_bytes=8)
    got = _hits(batches, parts)
    assert got[(0, 2, "quick fox")] == [[2, 11], [19, 29]]
    # the short eval row's one 3-gram (n=13) ends with the empty token: only at the row end
    assert got[(0, 3, "quick fox ")] == [[19, 30]]
    assert got[(1, 4, "i̇stanbul grand bazaar opens")] == [[3, 30]]
    assert got[(3, 1, "word")] == [[0, 4]]
    assert (2, 1, "word") not in got  # "sword"/"words" are other tokens
    for (row, _n, gram), offsets in got.items():
        for s, t in offsets:
            assert " ".join(helm(train[row][s:t])) == gram


def test_hit_blocks_snippets_and_doc_ids() -> None:
    rows = _eval_rows(["quick brown fox"])
    text = "x" * 80 + " quick brown fox " + "y" * 80 + " quick brown fox"
    batches, _, parts = _scan(rows, [text], [3])
    (p, block), = ng.hit_blocks([ng.hit_groups(hits, "id") for hits in batches])
    assert parts[p].records[np.frombuffer(block["record"], "<i8")[0]][1] == "quick brown fox"
    assert block["doc_id"] == [content_id({"text": text})]  # a row with no file: prep's rule for a bare dict
    (_, marked), = ng.hit_blocks([ng.hit_groups(hits, "id", "sub/t.jsonl") for hits in batches])
    # in a file: relpath:row as prep names it, the row file-global once the reduce knows the slice's row base
    assert ng.row_ids_at(marked, 40)["doc_id"] == [f"sub/t.jsonl:{40 + batches[0].rows[0][0]}"]
    assert np.frombuffer(block["occurrences"], "<i8").tolist() == [2]
    assert np.frombuffer(block["start"], "<i8").tolist() == [81, 178]
    lo = int(np.frombuffer(block["snippet_start"], "<i8")[0])
    assert lo == 81 - ng.SNIPPET_CONTEXT and block["snippet"] == [text[lo:96 + ng.SNIPPET_CONTEXT]]


# ---------------------------------------------------------------------------------------
# metrics, reduce, report
# ---------------------------------------------------------------------------------------

def test_instance_metrics() -> None:
    tokens = ["a", "b", "c", "d", "e"]
    # windows of 2: ab bc cd de; overlapping: ab (count 1), cd (count 4)
    m = ng.instance_metrics(tokens, 2, {"a b": 1, "c d": 4})
    assert m["binary"] == 1
    assert m["jaccard"] == pytest.approx(2 / 4)
    assert m["token"] == pytest.approx(4 / 5)
    assert m["jaccard_weighted"] == pytest.approx((1 + 0.25) / 4)
    assert m["token_weighted"] == pytest.approx((1 + 1 + 0.25 + 0.25) / 5)
    assert ng.instance_metrics(tokens, 2, {})["binary"] == 0
    # short row: n=13 means the one 5-gram
    assert ng.instance_metrics(tokens, 13, {"a b c d e": 2})["jaccard_weighted"] == pytest.approx(0.5)
    assert ng.instance_metrics(["", ""], 5, {})["jaccard"] == 0.0


def _blocks_of(blocks: list[dict[str, Any]]) -> Iterator[tuple[int, str, int, dict[str, Any]]]:
    return ((0, "t.jsonl", 0, b) for b in blocks)


def _reduce(eval_rows: list[ng.EvalRow], batches: list[ng.ScanHits], parts: dict[int, ng.Partition], ns: list[int],
            max_train_count: int | None = None, tok: ng.WordSplitter = DEFAULT
            ) -> tuple[ReduceResult, list[dict[str, Any]]]:
    """The reduce of every partition (blocks through a msgpack round trip, as on disk), then the merge."""
    blocks: defaultdict[int, list[dict[str, Any]]] = defaultdict(list)
    for p, block in ng.hit_blocks([ng.hit_groups(hits, "id") for hits in batches]):
        blocks[p].append(msgpack.unpackb(msgpack.packb(block)))
    details: list[dict[str, Any]] = []
    results = []
    for p in sorted(parts):
        res = ng.reduce_partition(parts[p].records, eval_rows, ns,
                                  partial(_blocks_of, blocks[p]),
                                  max_train_count, lambda lines: details.extend(map(json.loads, lines.splitlines())))
        results.append(msgpack.unpackb(msgpack.packb(res), strict_map_key=False))
    return ng.merge_partitions(eval_rows, ns, results, tok), details


def test_reduce_max_train_count_and_empty_rows() -> None:
    rows = _eval_rows(["common phrase here", "rare words only", "?!"])
    train = ["common phrase here"] * 3 + ["rare words only"]
    batches, _, parts = _scan(rows, train, [3])
    res, details = _reduce(rows, batches, parts, [3])
    assert res.overlap_stats == [{"eval_dataset": "ds", "n": 3, "num_instances": 3, "instance_ids": ["e0", "e1"]}]
    assert len(details) == 4
    res2, details2 = _reduce(rows, batches, parts, [3], max_train_count=2)
    assert res2.overlap_stats[0]["instance_ids"] == ["e1"] and res2.ignored_ngrams == 1
    assert len(details2) == 1
    m = {(r["instance_id"], r["n"]): r for r in res.metrics}
    assert m[("e0", 3)]["jaccard_weighted"] == pytest.approx(1 / 3)
    assert res.summary[0]["num_empty_instances"] == 1
    report = ng.render_report(res, {"rows": 4, "text_bytes": 70}, None)
    assert "| ds | 3 | 2 | 3 | 66.67 | 4 | t.jsonl (2) |" in report     # ... 4 training rows at n = 3


# ---------------------------------------------------------------------------------------
# agreement with the straightforward implementation on real data
# ---------------------------------------------------------------------------------------

FOLDED_EVERY = 120  # _gsm8k's training rows with a test question the same to a reader only (soft hyphens, ligatures)


def _gsm8k(limit_train: int | None = None, tok: ng.WordSplitter = DEFAULT
           ) -> tuple[list[ng.EvalRow], list[str], dict[int, int]]:
    """(eval rows, training texts, training row -> the eval row planted in it the same to a reader only)."""
    def read(path: str) -> Iterator[Row]:
        with gzip.open(path, "rb") as f:
            for i, line in enumerate(f):
                yield i, json.loads(line), None
    evrows, _ = ng.make_eval_rows([str(GSM8K_TEST)], read, "question", "id", tok)
    train = gsm8k_rows("train")[:limit_train]
    rnd = random.Random(7)
    docs, folded = [], {}
    long = [r for r in evrows if r.num_tokens > 20]
    for i, r in enumerate(train):
        text = r["question"] + "\n" + r["answer"]
        if i % 40 == 0:  # plant a test question, sometimes mangled in case/punctuation
            q = evrows[rnd.randrange(len(evrows))].text
            q = q.upper() if i % 80 == 0 else q.replace(" ", "  ").replace(".", "!")
            text = f"{text}\n\nSee also: {q} -- end"
        elif i % FOLDED_EVERY == 20:  # one the match fold alone finds
            e = long[rnd.randrange(len(long))]
            q = " ".join(w[:1] + "\u00ad" + w[1:] for w in e.text.replace("fi", "\ufb01").split(" "))
            text = f"{text}\n\nSee also: {q} -- end"
            folded[i] = e.eval_idx
        docs.append(text)
    return evrows, docs, folded


@pytest.mark.parametrize("tok", [DEFAULT, ng.get_tokenizer("default", "none")], ids=["nfkc-cf", "none"])
def test_scan_agrees_with_reference_on_gsm8k(tok: ng.WordSplitter) -> None:
    """Both ways: the default match fold, and none (HELM's exact text; the offsets then hold
    HELM's own tokens of the raw text)."""
    evrows, docs, folded = _gsm8k(2500, tok)
    ns = [5, 9, 13]
    ref_ids, ref_details = ng.reference_overlap(evrows, (("t", i, d) for i, d in enumerate(docs)), ns, tok)
    batches, stats, parts = _scan(evrows, docs, ns, partitions=16, batch_bytes=64 << 10, tok=tok)
    by_gram = {(r[0], r[1]): r[3] for part in parts.values() for r in part.records}

    def gram_of(text: str) -> str:
        return " ".join(helm(text) if tok.fold == "none" else tok.tokenize(match_text(tok, text)))

    mine = set()
    for (row, n, gram), offsets in _hits(batches, parts).items():
        for idx, _ in by_gram[(n, gram)]:
            mine.add((idx, "t", row, n, gram))
        for s, t in offsets:
            assert gram_of(docs[row][s:t]) == gram
    assert stats.false_hits == 0
    assert mine == ref_details and len(mine) > 1000
    at13 = {(row, idx) for idx, _, row, n, _ in ref_details if n == 13}
    assert (set(folded.items()) & at13) == (set(folded.items()) if tok.fold == "nfkc-cf" else set())
    assert len(folded) == 21
    res, details = _reduce(evrows, batches, parts, ns, tok=tok)
    assert len(details) == len(ref_details) and len(batches) > 10
    for d in details:  # hits regrouped from many batches by partition keep their own offsets and snippets
        text = docs[d["train_row"]]
        assert all(gram_of(text[s:e]) == d["ngram"] for s, e in d["train_offsets"])
        assert text[d["train_snippet_start"]:].startswith(d["train_snippet"])
    assert {(d["eval_row"], d["train_row"], d["n"], d["ngram"]) for d in details} == {
        (evrows[idx].eval_row, row, n, gram) for idx, _, row, n, gram in ref_details}
    got = {(s["eval_dataset"], s["n"]): s["instance_ids"] for s in res.overlap_stats}
    assert got == ref_ids
    assert len(ref_ids[("gsm8k", 13)]) >= 60  # the planted questions (at least)
