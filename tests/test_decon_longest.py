"""The longest match per instance (ConTAM) and its coverage: the reduce's partial results and
the merge, checked against a straightforward reference written here, then a whole run."""
from __future__ import annotations

import gzip
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from test_decon_pipeline import read_jsonl, run_cli, write_jsonl

from refinery.transforms.decon import ngrams as ng
from refinery.transforms.decon.ngrams.longest import longest_matches
from refinery.transforms.io.rows import Row

DEFAULT = ng.TOKENIZERS["default"]


def reference(eval_text: str, train_texts: list[str], n: int) -> tuple[int, float]:
    """(longest match, coverage) by loops over tokens: for each training row, mark the eval
    tokens its shared n-grams cover, take the longest run of marks; coverage: the tokens
    marked by any row."""
    tokens = DEFAULT.tokenize(eval_text)
    size = min(n, len(tokens))
    any_row = [False] * len(tokens)
    longest = 0
    for train in train_texts:
        t = DEFAULT.tokenize(train)
        grams = set()
        for i in range(len(t) - size + 1):
            if any(t[i:i + size]):
                grams.add(" ".join(t[i:i + size]))
        marked = [False] * len(tokens)
        for i in range(len(tokens) - size + 1):
            window = tokens[i:i + size]
            if any(window) and " ".join(window) in grams:
                for k in range(i, i + size):
                    marked[k] = True
                    any_row[k] = True
        run = 0
        for m in marked:
            run = run + 1 if m else 0
            longest = max(longest, run)
    return longest, sum(any_row) / len(tokens)


def eval_rows(texts: list[str]) -> list[ng.EvalRow]:
    def read(path: str) -> Iterator[Row]:
        for i, t in enumerate(texts):
            yield i, {"text": t, "id": f"e{i}"}, None
    rows, _ = ng.make_eval_rows(["x/ds/test.jsonl"], read, "text", "id", DEFAULT)
    return rows


def reduce_all(rows: list[ng.EvalRow], train: list[str], ns: list[int], partitions: int) -> list[Any]:
    """Every partition's reduce result, through msgpack as on disk; the training rows split in
    two scan units (two training files)."""
    index = ng.NgramIndex.build(rows, {}, ns, "default", partitions, skip=ng.same_text(rows).first)
    blocks: dict[int, list[tuple[int, str, int, dict[str, Any]]]] = {}
    half = len(train) // 2
    for unit, (path, part) in enumerate((("a.jsonl", train[:half]), ("b.jsonl", train[half:]))):
        hits = list(ng.scan_rows(((j, {"text": t}, None) for j, t in enumerate(part)), text_field="text",
                                 tokenizer=DEFAULT, membership=index.membership, lookup=index.lookup,
                                 partitions=partitions, stats=ng.ScanStats()))
        for p, b in ng.hit_blocks([ng.hit_groups(h, "id") for h in hits]) if hits else []:
            blocks.setdefault(p, []).append((unit, path, 0, msgpack.unpackb(msgpack.packb(b))))
    results = []  # each a PartitionResult, through msgpack as reduce's results are
    for p in range(partitions):
        def part_blocks(p: int = p) -> list[tuple[int, str, int, dict[str, Any]]]:
            return blocks.get(p, [])

        res = ng.reduce_partition(index.records.get(p, []), rows, ns, part_blocks, None,
                                  lambda lines: None, 2)  # details capped hard: the metrics must not care
        results.append(msgpack.unpackb(msgpack.packb(res), strict_map_key=False))
    return results


def metrics_of(rows: list[ng.EvalRow], train: list[str], ns: list[int],
               partitions: int = 3) -> dict[tuple[int, int], tuple[int, Any]]:
    """(longest, coverage) by (eval row, n); coverage Any: the tests compare it with pytest.approx."""
    result = ng.merge_partitions(rows, ns, reduce_all(rows, train, ns, partitions), DEFAULT)
    return {(int(m["instance_id"][1:]), m["n"]): (m["longest_match"], m["coverage"]) for m in result.metrics}


def test_longest_run_joins_overlapping_and_touching_windows_only() -> None:
    assert ng.longest_run([]) == 0
    assert ng.longest_run([(0, 3), (1, 4), (2, 5)]) == 5       # overlapping
    assert ng.longest_run([(3, 6), (0, 3)]) == 6               # touching, any order
    assert ng.longest_run([(0, 3), (4, 7), (5, 8)]) == 4       # a gap of one token
    assert ng.longest_run([(0, 3), (0, 3)]) == 3               # repeated


TEXT = "a1 b2 c3 d4 e5 f6 g7 h8 i9 j10"  # 10 tokens


@pytest.mark.parametrize("partitions", [1, 2, 5])
@pytest.mark.parametrize("train, longest, coverage", [
    (["x a1 b2 c3 d4 e5 y"], 5, 0.5),                         # overlapping 3-gram windows
    (["a1 b2 c3 zz d4 e5 f6"], 6, 0.6),                        # touching windows: one run
    (["a1 b2 c3 q g7 h8 i9"], 3, 0.6),                         # a gap: two runs of 3
    (["a1 b2 c3 d4 e5", "f6 g7 h8 i9 j10"], 5, 1.0),           # two rows, half each: longest of one row
    (["nothing here", "f6 g7 h8 q", "c3 d4 e5 f6 g7 h8 q"], 6, 0.6),
])
def test_planted_cases_at_3(partitions: int, train: list[str], longest: int, coverage: float) -> None:
    rows = eval_rows([TEXT])
    got = metrics_of(rows, train, [3], partitions)
    assert got[(0, 3)] == (longest, pytest.approx(coverage))
    assert got[(0, 3)] == pytest.approx(reference(TEXT, train, 3))


def test_repeated_n_grams_cover_every_occurrence() -> None:
    text = "a b c a b c a b c z"
    got = metrics_of(eval_rows([text]), ["a b c"], [3])
    # one training 3-gram, three touching occurrences in the instance
    want: object = (9, pytest.approx(0.9))  # a float beside pytest.approx: no overlap to mypy
    assert got[(0, 3)] == want == reference(text, ["a b c"], 3)


def test_n_larger_than_the_text_and_several_n() -> None:
    texts = ["What is 2+2?", TEXT]   # 5 tokens, the last empty
    train = ["Q: what is 2+2?", "a1 b2 c3 d4 e5 f6 g7 h8 i9 j10 k11", "b2 c3 d4 e5 f6"]
    got = metrics_of(eval_rows(texts), train, [2, 3, 8, 13], partitions=4)
    assert [got[(0, n)] for n in (2, 3, 8, 13)] == [(5, 1.0)] * 4   # the empty last token counts
    assert [got[(1, n)][0] for n in (2, 3, 8, 13)] == [10, 10, 10, 10]
    for i, text in enumerate(texts):
        for n in (2, 3, 8, 13):
            assert got[(i, n)] == pytest.approx(reference(text, train, n))


def test_a_shared_text_gives_every_row_its_first_rows_values() -> None:
    texts = [TEXT, "zz yy xx ww", TEXT]
    got = metrics_of(eval_rows(texts), ["a1 b2 c3 d4", "zz yy xx"], [3])
    assert got[(0, 3)] == got[(2, 3)] == (4, pytest.approx(0.4))
    assert got[(1, 3)] == (3, pytest.approx(0.75))


@pytest.mark.parametrize("seed", range(6))
def test_random_runs_agree_with_the_reference_whatever_the_partitions(seed: int) -> None:
    rng = random.Random(seed)
    vocab = ["a", "b", "c", "d", "e", ",", "f"]

    def text(k: int) -> str:
        return " ".join(rng.choice(vocab) for _ in range(k))

    texts = [text(rng.randint(1, 14)) for _ in range(8)]
    train = [text(rng.randint(2, 30)) for _ in range(10)]
    ns = [2, 3, 5]
    rows = eval_rows(texts)
    want = {}
    for r in rows:
        if not r.empty:
            for n in ns:
                want[(r.eval_idx, n)] = reference(r.text, train, n)
    for partitions in (1, 3, 7):
        got = metrics_of(rows, train, ns, partitions)
        assert {k: v for k, v in got.items() if k in want} == want, partitions  # the same counts, divided


def test_the_merge_expands_rows_a_few_windows_at_a_time_with_the_same_result() -> None:
    rng = random.Random(7)
    texts = [" ".join(rng.choice("abcde") for _ in range(12)) for _ in range(6)]
    train = [" ".join(rng.choice("abcde") for _ in range(25)) for _ in range(12)]
    rows = eval_rows(texts)
    parts = reduce_all(rows, train, [3, 4], 3)
    shares = [(p["train_rows"], p["windows"]) for p in parts]
    whole = longest_matches(shares, rows, [3, 4], DEFAULT)
    assert whole.max() > 4
    assert (longest_matches(shares, rows, [3, 4], DEFAULT, windows_at_once=1) == whole).all()


def test_a_run_writes_longest_match_and_coverage(tmp_path: Path) -> None:
    ev, tr, out = tmp_path / "eval", tmp_path / "train", str(tmp_path / "out")
    write_jsonl(ev / "ds" / "test.jsonl", [{"id": "half", "text": TEXT}, {"id": "none", "text": "no overlap at all"},
                                           {"id": "short", "text": "What is 2+2?"}])
    write_jsonl(tr / "a.jsonl", [{"text": "a1 b2 c3 d4 e5"}, {"text": "f6 g7 h8 i9 j10"}])
    write_jsonl(tr / "b.jsonl", [{"text": "so: what is 2+2?"}, {"text": "a1 b2 c3 d4 e5 f6 g7 zz"}])
    assert run_cli(["--eval", str(ev), "--train", str(tr), "--output", out, "--ngrams", "3", "13",
                    "--partitions", "3", "--max-ngram-details", "1"]) == 0
    with gzip.open(os.path.join(out, "stats/overlap_instances.jsonl.gz"), "rt") as f:
        lines = {x["instance_id"]: x for x in map(json.loads, f)}
    assert set(lines) == {"half", "short"}
    # at 3, one row covers tokens 0-6; both halves cover all; at 13 the instance is one window, never matched
    assert lines["half"]["by_n"] == [{"n": 3, "longest_match": 7, "coverage": 1.0},
                                     {"n": 13, "longest_match": 0, "coverage": 0.0}]
    assert lines["short"]["by_n"] == [{"n": 3, "longest_match": 5, "coverage": 1.0},
                                      {"n": 13, "longest_match": 5, "coverage": 1.0}]
    metrics = {(m["instance_id"], m["n"]): m for m in read_jsonl(os.path.join(out, "stats/overlap_metrics.jsonl"))}
    assert metrics[("half", 3)]["longest_match"] == 7 and metrics[("none", 3)]["longest_match"] == 0
    assert metrics[("half", 3)]["coverage"] == metrics[("half", 3)]["token"] == 1.0
    report = open(os.path.join(out, "stats/report.md")).read()
    at_3, at_13 = report.split("## ds at n = 3")[1].split("## ds at n = 13")
    assert "| ds | short | 2 | 5 | 1.0000 |" in at_13 and "| half |" not in at_13  # at 13 only "short" overlaps
    assert "| ds | half | 0 | 7 | 1.0000 |" in at_3                                # at 3 both
    page = open(os.path.join(out, "stats/report.html")).read()
    assert "longest match 5 tokens" in page and "<script" not in page
