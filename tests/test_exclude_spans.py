"""Span mode: decon's spans file, and ``prep --exclude-overlaps D --exclude-mode span``.

decon writes each contaminated row's overlapping spans (``stats/contaminated_train_spans.jsonl``):
the same (row, n) as the drop list, and exactly the union of the detail records' training
offsets. prep cuts them out, widened, splits the row at the holes and keeps the pieces long
enough: the documents it writes are re-derived here from the details alone.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import reliability_helpers
from helpers import gsm8k_rows, run_prep, write_jsonl
from reliability_helpers import ForkServer, child_env, final_digest, read_unit_log, recomputed_units, run_attempt
from test_exclude_overlaps import PLANTED, _corpus, _decon, _drop_list, _shard_texts

from refinery.beam_pipelines.cli import main
from refinery.transforms.decon.ngrams.arrays import merged_spans
from refinery.transforms.decon.ngrams.details import read_details
from refinery.transforms.io import storage
from refinery.transforms.io.rows import iter_rows
from refinery.transforms.io.text import normalize_text
from refinery.transforms.prep.documents import shard_of
from refinery.transforms.prep.exclusion import _check_spans_match
from refinery.transforms.prep.span_cut import SpanRules, cut_row, holes

forks = reliability_helpers.forks  # the shared fork server (a fixture)
WINDOW, MIN_CHARS = 20, 40
SPAN_FLAGS = ("--exclude-mode", "span", "--exclude-window", WINDOW, "--exclude-min-chars", MIN_CHARS)


def _spans_file(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "stats/contaminated_train_spans.jsonl").read_text().splitlines()]


def _union(ranges: list[list[int]]) -> list[list[int]]:
    """The union of ``[start, end)`` ranges, touching ones joined: the plain way."""
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


@pytest.fixture(scope="module")
def decon_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    tmp = tmp_path_factory.mktemp("spans")
    corpus, evals, _ = _corpus(tmp)
    assert _decon(corpus, evals, tmp / "decon") == 0
    return tmp, corpus, evals


def test_spans_are_the_drop_lists_rows_and_the_details_offsets(decon_run: tuple[Path, Path, Path]) -> None:
    tmp, _, _ = decon_run
    spans = _spans_file(tmp / "decon")
    keys = [(s["train_path"], s["train_row"], s["n"]) for s in spans]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    listed = {(d["train_path"], d["train_row"], n) for d in _drop_list(tmp / "decon") for n in d["ns"]}
    assert set(keys) == listed and len(listed) > 10
    details: dict[tuple[str, int, int], list[list[int]]] = {}
    for d in read_details(str(tmp / "decon")):
        details.setdefault((d["train_path"], d["train_row"], d["n"]), []).extend(d["train_offsets"])
    assert {k: _union(v) for k, v in details.items()} == {k: s["spans"] for k, s in zip(keys, spans)}


def _expected_documents(corpus: Path, spans: dict[tuple[str, int], np.ndarray], rules: SpanRules) -> Counter[str]:
    """The documents span mode must write, from the spans alone: each unlisted row's text, and
    each listed row's pieces, normalized."""
    docs: Counter[str] = Counter()
    for name in ("a.jsonl", "b.jsonl"):
        path = str(corpus / name)
        for row, record, _ in iter_rows(path):
            assert record is not None
            text = record["text"]
            if (path, row) not in spans:
                docs[normalize_text(text)] += 1
                continue
            cut = cut_row(len(text), spans[(path, row)], rules)
            docs.update(t for a, b in cut.pieces if (t := normalize_text(text[a:b])))
    return docs


def test_span_mode_writes_the_pieces_the_details_say(decon_run: tuple[Path, Path, Path],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    tmp, corpus, evals = decon_run
    out = tmp / "span"
    capsys.readouterr()
    assert run_prep([corpus], out, "--num-shards", 3, "--unit-mb", 0.02, "--exclude-overlaps", tmp / "decon",
                    *SPAN_FLAGS) == 0
    said = capsys.readouterr().out
    # the holes, re-derived from the detail records (every record is written at this size)
    details: dict[tuple[str, int], list[list[int]]] = {}
    for d in read_details(str(tmp / "decon")):
        if d["n"] == 13:
            details.setdefault((d["train_path"], d["train_row"]), []).extend(d["train_offsets"])
    spans = {k: np.array(v) for k, v in details.items()}
    rules = SpanRules(WINDOW, MIN_CHARS, 10)
    want = _expected_documents(corpus, spans, rules)
    got = _shard_texts(out)
    assert Counter(got) == want
    for q in gsm8k_rows("test")[:len(PLANTED)]:  # every planted question is gone, whole and in part
        assert not any(q["question"] in t or q["question"][:60] in t for t in got)
    manifest = json.loads((out / "manifest.json").read_text())
    cut = manifest["excluded_overlaps"]
    assert cut["mode"] == "span" and (cut["window"], cut["min_chars"], cut["max_splits"]) == (WINDOW, MIN_CHARS, 10)
    assert cut["documents"] == len(spans) == manifest["rows"]["excluded"]
    assert cut["rows_split"] + cut["rows_dropped"] == len(spans) and cut["rows_split"] > 0
    assert cut["pieces"] == manifest["rows"]["pieces"] > 0
    # characters removed: all those of the listed rows that no piece keeps
    texts = {(str(corpus / n), row): rec["text"] for n in ("a.jsonl", "b.jsonl")
             for row, rec, _ in iter_rows(str(corpus / n)) if rec is not None}
    kept = sum(b - a for k, s in spans.items() for a, b in cut_row(len(texts[k]), s, rules).pieces)
    assert cut["chars_removed"] == sum(len(texts[k]) for k in spans) - kept
    for k, s in spans.items():  # no character outside the widened spans is removed
        h = holes(s, len(texts[k]), WINDOW)
        pieces = cut_row(len(texts[k]), s, rules).pieces
        removed = np.ones(len(texts[k]), bool)
        for a, b in pieces:
            removed[a:b] = False
        inside = np.zeros(len(texts[k]), bool)
        for a, b in h.tolist():
            inside[a:b] = True
        assert not (removed & ~inside & ~_short_mask(len(texts[k]), h, MIN_CHARS)).any()
    rows = manifest["rows"]
    assert rows["read"] + rows["pieces"] == rows["accepted"] + rows["empty"] + rows["rejected"] + rows["excluded"]
    assert "spans cut (\u00b120 chars)" in said and f"{cut['chars_removed']:,} characters removed" in said
    # a rerun does nothing; another output of the same command writes the same bytes
    assert run_prep([corpus], out, "--num-shards", 3, "--unit-mb", 0.02, "--exclude-overlaps", tmp / "decon",
                    *SPAN_FLAGS) == 0
    assert "nothing (all units already done)" in capsys.readouterr().out
    assert run_prep([corpus], tmp / "span2", "--num-shards", 3, "--exclude-overlaps", tmp / "decon",
                    *SPAN_FLAGS) == 0
    again = json.loads((tmp / "span2" / "manifest.json").read_text())
    assert [(s["sha256"], s["index_sha256"]) for s in again["shards"]] == \
        [(s["sha256"], s["index_sha256"]) for s in manifest["shards"]]
    # a row's pieces stay in its shard, named ROW_ID@START, with the row's provenance
    piece_docs = 0
    for i, s in enumerate(manifest["shards"]):
        table = pq.read_table(out / s["docs_path"]).to_pylist()
        for doc in table:
            if "@" in doc["doc_id"]:
                row_id, start = doc["doc_id"].rsplit("@", 1)
                assert shard_of(row_id, 3) == i and (doc["source"], doc["row"]) in spans and int(start) >= 0
                piece_docs += 1
    assert piece_docs == cut["pieces"]


def _short_mask(length: int, h: np.ndarray, min_chars: int) -> np.ndarray:
    """The characters of the pieces between holes that are shorter than ``min_chars``."""
    mask = np.zeros(length, bool)
    bounds = [0, *h.reshape(-1).tolist(), length]
    for a, b in zip(bounds[0::2], bounds[1::2]):
        if b - a < min_chars:
            mask[a:b] = True
    return mask


def test_span_mode_rules_enter_the_plan(decon_run: tuple[Path, Path, Path],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    tmp, corpus, _ = decon_run
    out = tmp / "replan"
    assert run_prep([corpus], out, "--num-shards", 2, "--exclude-overlaps", tmp / "decon") == 0
    row_docs = json.loads((out / "manifest.json").read_text())["total_documents"]
    capsys.readouterr()
    assert run_prep([corpus], out, "--num-shards", 2, "--exclude-overlaps", tmp / "decon", *SPAN_FLAGS) == 0
    assert "tokenize 1 " in capsys.readouterr().out  # span mode re-plans the row-mode output
    span_docs = json.loads((out / "manifest.json").read_text())["total_documents"]
    assert span_docs > row_docs
    assert run_prep([corpus], out, "--num-shards", 2, "--exclude-overlaps", tmp / "decon", *SPAN_FLAGS,
                    "--exclude-max-splits", 0) == 0  # every listed row has a hole: all dropped, as in row mode
    assert "tokenize 1 " in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["total_documents"] == row_docs and manifest["excluded_overlaps"]["rows_split"] == 0


def test_span_mode_refusals(decon_run: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    tmp, corpus, _ = decon_run
    capsys.readouterr()

    def refused(*extra: object) -> str:
        assert run_prep([corpus], tmp / "refused", *extra) == 2
        return capsys.readouterr().err

    assert "--exclude-window needs --exclude-mode span" in refused("--exclude-overlaps", tmp / "decon",
                                                                   "--exclude-window", 5)
    assert "--exclude-mode span needs --exclude-overlaps" in refused("--exclude-mode", "span")
    assert "must be 0 or more" in refused("--exclude-overlaps", tmp / "decon", "--exclude-mode", "span",
                                          "--exclude-window", -1)
    spans = tmp / "decon" / "stats" / "contaminated_train_spans.jsonl"
    data = spans.read_bytes()
    try:
        spans.write_bytes(data.replace(b"[[", b"[[1", 1))
        assert "edited after decon wrote it" in refused("--exclude-overlaps", tmp / "decon", *SPAN_FLAGS)
    finally:
        spans.write_bytes(data)


def test_cut_row_rules() -> None:
    rules = SpanRules(window=2, min_chars=3, max_splits=2)
    # two spans 2 apart merge once widened; clipped at both ends
    assert holes(np.array([[1, 3], [7, 8], [30, 40]]), 40, 2).tolist() == [[0, 10], [28, 40]]
    cut = cut_row(40, np.array([[1, 3], [7, 8], [30, 40]]), rules)
    assert cut.pieces == [(10, 28)] and not cut.dropped and cut.removed_chars == 22 and cut.too_short == 0
    cut = cut_row(20, np.array([[4, 5], [10, 11]]), rules)  # pieces 0-2 (short), 7-8 (short), 13-20
    assert cut.pieces == [(13, 20)] and cut.too_short == 2 and cut.removed_chars == 13
    assert cut_row(50, np.array([[5, 6], [15, 16], [25, 26]]), rules).dropped  # 3 holes > 2
    assert cut_row(50, np.array([[5, 6], [15, 16], [25, 26]]), rules).removed_chars == 50
    with pytest.raises(ValueError, match="does not lie in the row's text"):
        cut_row(10, np.array([[5, 11]]), rules)


def test_merged_spans_is_the_plain_union() -> None:
    rng = np.random.default_rng(7)
    for _ in range(20):
        k = int(rng.integers(1, 200))
        g = rng.integers(0, 5, k)
        s = rng.integers(0, 100, k)
        e = s + rng.integers(1, 15, k)
        (got_g,), got_s, got_e = merged_spans([g], s, e)
        want = [(int(grp), a, b) for grp in sorted(set(g.tolist()))
                for a, b in _union([[int(x), int(y)] for x, y, gg in zip(s, e, g) if gg == grp])]
        assert list(zip(got_g.tolist(), got_s.tolist(), got_e.tolist())) == want


def test_span_mode_killed_then_rerun_writes_the_same_bytes(decon_run: tuple[Path, Path, Path], tmp_path: Path,
                                                           forks: ForkServer) -> None:
    tmp, corpus, _ = decon_run
    flags = ("--num-shards", 3, "--unit-mb", 0.02, "--exclude-overlaps", tmp / "decon", *SPAN_FLAGS)
    assert run_prep([corpus], tmp_path / "ref", *flags) == 0
    want = final_digest(tmp_path / "ref")
    out, log = tmp_path / "out", tmp_path / "units.log"
    argv = [str(a) for a in ("prep", "--input", corpus, "--output", out, *flags, "--runner", "direct",
                             "--no-progress")]
    env = child_env(log)
    kills = 0
    for stage, k in (("tokenize", 1), ("tokenize", 2), ("pack", 1)):
        a = run_attempt(lambda: forks.start(argv, env), log, kill_at_start=k, stage=stage)
        kills += a.killed
    final = run_attempt(lambda: forks.start(argv, env), log)
    assert final.returncode == 0, final.stderr[-2000:]
    assert kills >= 2 and final_digest(out) == want
    assert recomputed_units(read_unit_log(log)) == []  # no finished unit ran twice


def test_a_spans_file_that_is_not_the_drop_lists_rows_is_refused() -> None:
    """Its sha256 is the one decon recorded, yet it names other rows (a decon bug): refused."""
    one = np.array([[0, 5]])
    _check_spans_match("D", {"/t/a.jsonl": {1, 2}}, {"/t/a.jsonl": {1: one, 2: one}}, 13)  # the same rows: fine
    with pytest.raises(storage.InputError, match=r"disagree at n=13 on /t/a.jsonl \(rows \[2\]\)"):
        _check_spans_match("D", {"/t/a.jsonl": {1, 2}}, {"/t/a.jsonl": {1: one}}, 13)
    with pytest.raises(storage.InputError, match="disagree"):
        _check_spans_match("D", {}, {"/t/b.jsonl": {0: one}}, 13)


# ---------------------------------------------------------------------------------------
# A piece's id is no real row's (issue 58, item 9)
# ---------------------------------------------------------------------------------------

def _piece_corpus(root: Path, real_id: str) -> tuple[Path, Path]:
    """Row 0 holds a test question after its own text (its first piece starts at 0: ``r0@0``);
    row 5's id is ``real_id``."""
    train, question = gsm8k_rows("train")[:30], gsm8k_rows("test")[0]["question"]
    rows = [{"id": f"r{i}", "text": r["question"] + "\n\n" + r["answer"]} for i, r in enumerate(train)]
    rows[0]["text"] += " " + question + " That was the question; the rest of the row follows it here."
    rows[5]["id"] = real_id
    corpus = root / "corpus"
    write_jsonl(corpus / "a.jsonl", rows)
    evals = write_jsonl(root / "eval" / "test.jsonl", [{"id": "t0", "text": question}])
    assert _decon(corpus, evals, root / "decon") == 0
    return corpus, root / "decon"


def _clean(corpus: Path, decon: Path, out: Path, *extra: object) -> int:
    return main(["clean", "--train", str(corpus), "--exclude-overlaps", str(decon), "--output", str(out),
                 "--runner", "direct", "--no-progress", *map(str, extra)])


def test_a_piece_id_that_is_a_real_rows_id_is_refused_naming_both_rows(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flags = ("--exclude-mode", "span", "--exclude-window", 5, "--exclude-min-chars", 10)
    corpus, decon = _piece_corpus(tmp_path / "same", "r0@0")
    a = corpus / "a.jsonl"
    capsys.readouterr()
    assert run_prep([corpus], tmp_path / "prep", "--num-shards", 2, "--exclude-overlaps", decon, *flags) == 1
    said = capsys.readouterr()
    named = (f"document id 'r0@0' is both the piece of {a} row 0 that starts at character 0 and the id of {a} "
             "row 5")
    assert named in said.err, said.err
    assert not (tmp_path / "prep" / "manifest.json").exists()
    assert _clean(corpus, decon, tmp_path / "clean", *flags) == 1
    said = capsys.readouterr()
    assert named in said.err, said.err
    assert not (tmp_path / "clean" / "_clean_manifest.json").exists()

    # an id of a piece's form that is no piece's is a document like any other; every id is unique
    corpus, decon = _piece_corpus(tmp_path / "other", "r0@1")
    assert run_prep([corpus], tmp_path / "prep2", "--num-shards", 2, "--exclude-overlaps", decon, *flags) == 0
    manifest = json.loads((tmp_path / "prep2" / "manifest.json").read_text())
    ids = [d for s in manifest["shards"] for d in pq.read_table(tmp_path / "prep2" / s["docs_path"])["doc_id"]
           .to_pylist()]
    assert "r0@0" in ids and "r0@1" in ids and len(ids) == len(set(ids))
    assert _clean(corpus, decon, tmp_path / "clean2", *flags) == 0
    copied = [json.loads(line)["id"] for line in (tmp_path / "clean2" / "a.jsonl").read_text().splitlines()]
    assert "r0@0" in copied and "r0@1" in copied and len(copied) == len(set(copied))
