"""decon's eval index built in slices (issue 59): the ``eval`` stage reads the eval files a
slice at a time, in parallel units; the ``index`` stage merges the slices' windows into
each hash partition and the slices' rows into the catalog. No process builds the whole index.

Exact: the partition files, membership and catalog are the bytes the whole-index builder
(``NgramIndex.build``, what the index stage ran before) gives, and every output of a run
cut into many eval slices is the bytes of a run of one slice, on rows that cross the seams
(texts repeated in other slices, short rows, bad rows, broken lines, rows without ids, a
lone surrogate, ``--eval-dataset-field``)."""
from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
from helpers import gsm8k_texts, tree_digest, write_jsonl

from refinery.beam_pipelines.cli import main
from refinery.transforms.decon import ngrams as ng
from refinery.transforms.decon.ngrams import eval_slices as es
from refinery.transforms.decon.ngrams.compact import RecordColumns
from refinery.transforms.decon.ngrams.index import LISTED_BAD_ROWS, short_rows
from refinery.transforms.decon.stages import partition_file
from refinery.transforms.io.rows import iter_rows


def _eval_rows(seed: int = 59) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    texts = gsm8k_texts(400)
    rows: list[dict[str, Any]] = []
    for i, t in enumerate(texts):
        r: dict[str, Any] = {"id": f"q{i}", "text": t, "ds": f"set{i % 5}"}
        if i % 37 == 3:
            r["text"] = texts[i - 1]                      # the text of the row before (often the slice before)
        if i % 91 == 5:
            r["text"] = texts[rng.randrange(i)]           # the text of a row far before
        if i % 53 == 7:
            r = {"id": f"q{i}", "text": "two words", "ds": "short"}  # not indexed (--min-eval-tokens)
        if i % 71 == 9:
            r = {"id": f"q{i}", "question": t, "ds": "set1"}        # no text: a bad row
        if i % 67 == 1:
            r = {"text": "caf\u00e9 \udc80 a lone surrogate in a row without an id, long enough", "ds": "set2"}
        rows.append(r)
    return rows


def _inputs(root: Path) -> tuple[list[str], Path]:
    rows = _eval_rows()
    broken = {k: "{not json" for k in range(17, len(rows), 97)} | {k: "" for k in range(40, len(rows), 151)}
    a = write_jsonl(root / "eval" / "a.jsonl", rows, raw_lines=broken)
    b = write_jsonl(root / "eval" / "b.jsonl.gz", rows[:90])
    train = root / "train"
    docs = gsm8k_texts(300, offset=200) + [r.get("text", "") for r in rows[::7]]
    write_jsonl(train / "t.jsonl", [{"id": f"t{i}", "text": d} for i, d in enumerate(docs)])
    return [str(a), str(b)], train


def _decon(evals: list[str], train: Path, out: Path, *extra: object) -> int:
    return main(["decon", "--eval", *evals, "--train", str(train), "--output", str(out), "--ngrams", "4", "13",
                 "--partitions", "6", "--runner", "direct", "--no-progress", *map(str, extra)])


def _index_parts(out: Path) -> dict[str, bytes]:
    parts, = (out / ".refinery" / "index").glob("*/parts")
    return {str(p.relative_to(parts)): p.read_bytes() for p in sorted(parts.rglob("*")) if p.is_file()}


def _eval_units(out: Path) -> int:
    return len(list((out / ".refinery" / "eval").glob("*/receipts/*.json")))


def test_many_eval_slices_give_the_bytes_of_one(tmp_path: Path) -> None:
    evals, train = _inputs(tmp_path)
    for extra in ([], ["--eval-dataset-field", "ds"]):
        one, many = tmp_path / f"one{len(extra)}", tmp_path / f"many{len(extra)}"
        assert _decon(evals, train, one, *extra) == 0
        assert _decon(evals, train, many, "--eval-slice-mb", 0.004, *extra) == 0
        assert _eval_units(one) == 2 and _eval_units(many) > 20  # a.jsonl cut into slices; b.jsonl.gz whole
        assert tree_digest(one) == tree_digest(many)
        assert _index_parts(one) == _index_parts(many)
        stats = [json.loads(line) for line in (many / "stats" / "overlap_stats.jsonl").read_text().splitlines()]
        assert sum(len(s["instance_ids"]) for s in stats) > 20  # the rows planted in the training data are found


def test_the_partitions_are_the_whole_index_builders_bytes(tmp_path: Path) -> None:
    """What the index stage wrote before it was cut into slices: ``NgramIndex.build`` over every
    eval row, the later rows of a shared text and the short rows left out."""
    evals, train = _inputs(tmp_path)
    out = tmp_path / "out"
    assert _decon(evals, train, out, "--eval-slice-mb", 0.004) == 0
    tok = ng.get_tokenizer("default")
    rows, bad = ng.make_eval_rows(evals, lambda p: iter_rows(p), "text", "id", tok)
    skip = set(ng.same_text(rows).first) | {r.eval_idx for r in short_rows(rows, 5)}
    whole = ng.NgramIndex.build(rows, bad, [4, 13], "default", 6, skip)
    got = _index_parts(out)
    for p in range(6):
        want = ng.dumps_partition(whole.records[p] if p in whole.records else RecordColumns.from_lists([]))
        assert got[partition_file(p)] == want, p
    assert got["membership.bin"] == whole.membership.to_bytes()
    assert got["eval_rows.jsonl.gz"] == ng.dumps_jsonl_gz(r.to_json() for r in rows)
    assert json.loads(got["eval_bad_rows.json"]) == bad
    assert gzip.decompress(got["eval_rows.jsonl.gz"]).count(b"\n") == len(rows)


def test_the_first_row_of_a_text_is_the_one_indexed() -> None:
    metas = [np.array([(1, 2, 0), (3, 4, 0), (1, 2, 0)], dtype=es.ROW_META),
             np.array([(3, 4, 0), (5, 6, 1), (7, 8, 0), (7, 8, 0)], dtype=es.ROW_META)]
    assert es.indexed_rows(metas).tolist() == [True, True, False, False, False, True, False]
    assert es.slice_firsts(metas[1]).tolist() == [True, False, True, False]


def test_bad_rows_merge_in_eval_order_to_the_listed_cap() -> None:
    cap = LISTED_BAD_ROWS
    first: dict[str, dict[str, Any]] = {"a": {"bad_rows": cap - 1, "reasons": [["f", i, "x"] for i in range(cap - 1)]},
                                        "b": {"bad_rows": 0}}
    second: dict[str, dict[str, Any]] = {"a": {"bad_rows": 3, "reasons": [["f", i, "y"] for i in range(3)]},
                                         "c": {"bad_rows": 1}}
    got = es.merge_bad([(first, 0), (second, 500)])
    assert got["a"]["bad_rows"] == cap + 2 and len(got["a"]["reasons"]) == cap
    assert got["a"]["reasons"][-1] == ["f", 500, "y"]  # the second slice's first, its row in the file
    assert got["b"] == {"bad_rows": 0} and got["c"] == {"bad_rows": 1}


def test_the_membership_is_merged_a_hash_range_at_a_time() -> None:
    rng = np.random.default_rng(0)
    slices = [rng.integers(0, 2**63, 5000, dtype=np.int64).view(np.uint64) * np.uint64(2) for _ in range(4)]
    slices[2][:100] = slices[0][:100]  # n-grams two slices share
    want = np.unique(np.concatenate(slices))
    for per_pass in (1 << 30, 3000, 100):
        got = es.membership_hashes(lambda k: slices[k], 4, sum(map(len, slices)), per_pass)
        assert got.dtype == np.uint64 and np.array_equal(got, want), per_pass
