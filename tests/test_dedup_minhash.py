"""dedup's arithmetic, without Beam: words and shingle sets against a plain Python oracle, the
Jaccard of many pairs against one pair at a time, signatures and band keys independent of
their batch, the components against a union-find, the buckets and their cap."""
from __future__ import annotations

import random

import numpy as np
import pytest
from helpers import gsm8k_texts, shingle_jaccard, word_shingles

from refinery.transforms.dedup import graph, minhash
from refinery.transforms.dedup.minhash import MinHashParams


def _sets(texts: list[str]) -> list[np.ndarray]:
    values, counts = minhash.shingle_sets(texts)
    ends = np.cumsum(counts)
    return [values[e - c:e] for c, e in zip(counts.tolist(), ends.tolist())]


def test_shingle_sets_are_the_oracles_and_do_not_depend_on_the_batch() -> None:
    texts = ["Hello, World! this is a test of the thing", "hello world this is a test of the thing",
             "a b", "!!! ???", "", "Ünïcode wörds, and ÜNÏCODE WÖRDS here too", "x " * 40,
             "one two three four five", "one two three four five six"] + gsm8k_texts(30)
    sets = _sets(texts)
    for text, got in zip(texts, sets):
        assert len(got) == len(word_shingles(text)), text
        assert np.all(np.diff(got.astype(np.float64)) > 0) or len(got) <= 1  # sorted, distinct
    assert np.array_equal(sets[0], sets[1])  # punctuation and case are not words
    assert len(sets[3]) == len(sets[4]) == 0
    for i, text in enumerate(texts):  # alone, or in another batch: the same set
        assert np.array_equal(_sets([text])[0], sets[i])
        assert np.array_equal(_sets(texts[::-1])[len(texts) - 1 - i], sets[i])
    pairs = [(texts[k], texts[k + 1]) for k in range(len(texts) - 1)] + [(texts[7], texts[8])]
    for a, b in pairs:
        sa, sb = _sets([a, b])
        assert minhash.jaccard(sa, sb) == pytest.approx(shingle_jaccard(a, b))


def test_jaccard_many_is_the_jaccard_of_each_pair() -> None:
    rng = np.random.default_rng(7)
    a_sets, b_sets = [], []
    for i in range(400):
        base = np.unique(rng.integers(0, 2**64, rng.integers(0, 60), dtype=np.uint64))
        if i % 5 == 0:  # values that share their top 40 bits: the keys tie, the whole value decides
            base = np.unique(np.r_[base, (np.uint64(i) << np.uint64(40)) + np.arange(3, dtype=np.uint64)])
        other = np.unique(np.r_[base[: len(base) // 2], rng.integers(0, 2**64, rng.integers(0, 30), dtype=np.uint64),
                                (np.uint64(i) << np.uint64(40)) + np.uint64(1)])
        a_sets.append(base)
        b_sets.append(other)
    a_sets[3], b_sets[3] = np.zeros(0, np.uint64), np.zeros(0, np.uint64)  # two empty sets: 1
    got = minhash.jaccard_many(np.concatenate(a_sets), np.array([len(s) for s in a_sets]),
                               np.concatenate(b_sets), np.array([len(s) for s in b_sets]))
    want = np.array([minhash.jaccard(a, b) for a, b in zip(a_sets, b_sets)])
    assert np.array_equal(got, want) and got[3] == 1.0


def test_signatures_and_band_keys_do_not_depend_on_the_batch_or_the_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    texts = gsm8k_texts(40)
    params = MinHashParams(bands=4, rows=3)
    values, counts = minhash.shingle_sets(texts)
    sigs = minhash.signatures(values, counts, params)
    a, b = params.coefficients()
    ends = np.cumsum(counts)
    for i in range(len(texts)):  # the definition: the minimum of each hash function over the set
        s = values[ends[i] - counts[i]:ends[i]]
        want = ((s[:, None] * a[None, :] + b[None, :]) >> np.uint64(32)).min(axis=0).astype(np.uint32)
        assert np.array_equal(sigs[i], want)
    monkeypatch.setattr(minhash, "SIGNATURE_CHUNK", 7)  # a document's shingles cut across chunks
    assert np.array_equal(minhash.signatures(values, counts, params), sigs)
    keys = minhash.band_keys(sigs, params)
    one = minhash.band_keys(minhash.signatures(*minhash.shingle_sets(texts[5:6]), params), params)
    assert keys.shape == (40, 4) and np.array_equal(one[0], keys[5])
    assert len({int(k) for k in keys.ravel()}) == keys.size  # distinct documents, distinct keys


def test_the_s_curve_is_what_a_thousand_seeds_show() -> None:
    """Two texts of a known Jaccard: the share of seeds that make them a candidate is the curve's
    value (within 4 standard deviations)."""
    words = [f"w{i}" for i in range(300)]
    a, b = " ".join(words), " ".join(words[:250] + [f"v{i}" for i in range(50)])
    s = shingle_jaccard(a, b)
    values, counts = minhash.shingle_sets([a, b])
    hits = 0
    trials = 1000
    for seed in range(trials):
        params = MinHashParams(bands=6, rows=4, seed=seed)
        keys = minhash.band_keys(minhash.signatures(values, counts, params), params)
        hits += bool((keys[0] == keys[1]).any())
    p = float(minhash.candidate_probability(s, 6, 4))
    assert abs(hits / trials - p) < 4 * (p * (1 - p) / trials) ** 0.5 + 0.01, (s, p, hits)


def _union_find(a: list[int], b: list[int]) -> dict[int, int]:
    parent: dict[int, int] = {}

    def root(x: int) -> int:
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    for x, y in zip(a, b):
        rx, ry = root(x), root(y)
        if rx != ry:
            parent[max(rx, ry)] = min(rx, ry)
    return {x: root(x) for x in set(a) | set(b)}


def test_components_are_a_union_find_s_and_a_long_path_is_one() -> None:
    rng = np.random.default_rng(3)
    a = (rng.integers(0, 3000, 2500) * 11).astype(np.uint64)
    b = (rng.integers(0, 3000, 2500) * 11).astype(np.uint64)
    nodes, roots = graph.components(a, b)
    want = _union_find(a.tolist(), b.tolist())
    assert nodes.tolist() == sorted(want) and roots.tolist() == [want[n] for n in nodes.tolist()]
    order = rng.permutation(20_000).astype(np.uint64)  # a path, in random order: one component
    nodes, roots = graph.components(order[:-1], order[1:])
    assert len(nodes) == 20_000 and set(roots.tolist()) == {0}
    empty = np.zeros(0, np.uint64)
    assert [len(x) for x in graph.components(empty, empty)] == [0, 0]


def _records(rows: list[tuple[int, int, int, int]]) -> np.ndarray:
    out = np.zeros(len(rows), dtype=graph.KEY_DTYPE)
    for name, values in zip(("band", "key", "text_hi", "node"), zip(*rows)):
        out[name] = values
    return out


def test_buckets_give_every_pair_of_their_texts_and_a_bucket_over_the_cap_is_counted() -> None:
    # bucket 1: texts 5, 6, 7 and 8 (text 5 twice: counted once, its first node); bucket 2: two texts
    recs = _records([(0, 1, 5, 10), (0, 1, 6, 11), (0, 1, 7, 12), (0, 1, 5, 16), (0, 1, 8, 17),
                     (1, 2, 8, 13), (1, 2, 9, 14), (2, 3, 1, 15)])
    skipped = graph.Skipped()
    pairs = graph.bucket_pairs(recs, 4, skipped)
    assert {(int(p["a"]), int(p["b"])) for p in pairs} == {(10, 11), (10, 12), (11, 12), (10, 17), (11, 17),
                                                             (12, 17), (13, 14)}
    assert skipped.buckets == 0
    pairs = graph.bucket_pairs(recs, 3, skipped)
    assert {(int(p["a"]), int(p["b"])) for p in pairs} == {(13, 14)}
    assert skipped.to_json() == {"buckets": 1, "documents": 4, "largest": [[0, 4, 10]]}


def test_exact_edges_join_each_copy_to_the_first_of_its_text() -> None:
    recs = np.zeros(6, dtype=graph.KEY_DTYPE)
    recs["text_hi"], recs["text_lo"] = [1, 2, 1, 1, 3, 1], [0, 0, 0, 1, 0, 0]
    recs["node"] = [40, 30, 20, 10, 0, 50]
    member, first = graph.exact_edges(recs)
    assert sorted(zip(member.tolist(), first.tolist())) == [(40, 20), (50, 20)]


def test_a_random_corpus_of_planted_pairs_is_recalled_at_the_curve() -> None:
    """Near copies (a few words changed) of Jaccard >= 0.85 share a band in almost every case at
    the defaults (the curve says 0.994 at 0.85)."""
    rng = random.Random(11)
    texts = gsm8k_texts(200)
    copies = []
    for t in texts:
        words = t.split()
        for _ in range(max(1, len(words) // 120)):
            words[rng.randrange(len(words))] = "changed"
        copies.append(" ".join(words))
    params = MinHashParams()
    values, counts = minhash.shingle_sets(texts + copies)
    keys = minhash.band_keys(minhash.signatures(values, counts, params), params)
    high = [i for i in range(200) if shingle_jaccard(texts[i], copies[i]) >= 0.85]
    found = [i for i in high if (keys[i] == keys[200 + i]).any()]
    assert len(high) > 100 and len(found) >= 0.97 * len(high)
