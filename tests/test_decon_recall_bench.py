"""bench/decon_recall.py (issue 50 item 5): its planting keeps a true ground truth, its scoring
counts a planted row only when decon names that row's own eval item at the n's effective
length, and it reads a real decon output as the reference method finds it."""
from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from helpers import gsm8k_rows

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "decon_recall.py"


@pytest.fixture(scope="module")
def dr() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("bench_decon_recall", SCRIPT)
    assert spec is not None and spec.loader is not None, SCRIPT
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def corpus(dr: ModuleType) -> Any:  # bench/decon_recall.py's Corpus (a module loaded from its file)
    questions = [r["question"] for r in gsm8k_rows("test")[:200]]
    train = [r["question"] + "\n\n" + r["answer"] for r in gsm8k_rows("train")[:20]]
    return dr.build_corpus(questions, train, items=2, clean=3, seed=0)


def test_planting_ground_truth(dr: ModuleType, corpus: Any) -> None:
    plants = corpus.plants
    assert [p.row for p in plants] == list(range(len(plants)))
    kinds = [p.kind for p in plants]
    assert all(kinds.count(k) == 2 for k in dr.KINDS) and all(kinds.count(k) == 3 for k in dr.CLEAN_KINDS)
    evals = {r["id"]: r["text"] for r in corpus.eval_rows}
    assert len(evals) == len(corpus.eval_rows) == len(set(evals.values()))  # distinct ids and texts
    eval_tokens = {t for text in evals.values() for t in dr.TOKENIZER.tokenize(text)}
    for p in plants:
        if p.eval_id is None:
            assert p.eval_text is None and p.kind in dr.CLEAN_KINDS
            continue
        assert evals[p.eval_id] == p.eval_text  # the ground truth names the eval row as decon reads it
        if p.kind in ("verbatim", "in_long_doc", "short_question", "tiny_question"):
            assert p.eval_text in p.text
        if p.kind in ("word_dropped", "word_replaced", "every_6th_word_replaced", "numbers_changed", "hard_wrapped"):
            assert p.eval_text not in p.text  # edited: not a verbatim copy
        if p.kind == "short_question_at_end":
            assert p.text.endswith(" " + p.eval_text)
        if p.kind == "in_long_doc":
            assert len(p.text) > 50_000
        if p.kind == "tiny_question":
            assert dr.num_tokens(p.eval_text) < dr.MIN_EVAL_TOKENS
        if p.kind == "clean_filler":  # filler shares no token with the eval set: only planted text can match
            assert not set(dr.TOKENIZER.tokenize(p.text)) & (eval_tokens - {""})
    again = dr.build_corpus([r["question"] for r in gsm8k_rows("test")[:200]],
                            [r["question"] + "\n\n" + r["answer"] for r in gsm8k_rows("train")[:20]], 2, 3, 0)
    assert again == corpus  # --seed makes the same corpus


def test_score_counts_only_the_rows_own_eval_item(dr: ModuleType, corpus: Any) -> None:
    verbatim = [p for p in corpus.plants if p.kind == "verbatim"]
    clean = [p for p in corpus.plants if p.kind == "clean_filler"]
    other = next(p.eval_id for p in corpus.plants if p.kind == "word_dropped")
    tokens = {p.eval_id: dr.num_tokens(p.eval_text) for p in verbatim}
    flags = dr.Flags({(verbatim[0].row, verbatim[0].eval_id, 13),  # its own item: caught
                      (verbatim[1].row, other, 13)},  # another item: not this row's catch
                     {clean[0].row: [5]})  # a clean row dropped at n=5 only
    assert all(t > 13 for t in tokens.values())
    s = dr.score(corpus, flags, [5, 13])
    assert s["verbatim"]["caught"] == {"5": 0, "13": 1}
    assert s["clean_filler"]["flagged"] == {"5": 1, "13": 0}
    assert s["clean_gsm8k_train"]["flagged"] == {"5": 0, "13": 0}
    assert "| verbatim | 2 |" in dr.table(s, [5, 13]) and "0.50 (1/2)" in dr.table(s, [5, 13])


def test_recall_by_the_reference_method(dr: ModuleType, corpus: Any) -> None:
    s = dr.score(corpus, dr.reference_flags(corpus, [13]), [13])
    for kind in ("verbatim", "case_punct", "wrapped", "in_long_doc"):
        assert s[kind]["caught"]["13"] == 2, kind
    assert s["every_6th_word_replaced"]["caught"]["13"] == 0  # no run of 13 unedited tokens
    assert s["tiny_question"]["caught"]["13"] == 0  # under --min-eval-tokens: not indexed
    # a short row's one n-gram (its min(n, len)) ends in the empty token after its '?': found at a
    # row's end, never inside a text; counted under n=13 although its records have n=len
    assert s["short_question"]["caught"]["13"] == 0 and s["short_question_at_end"]["caught"]["13"] == 2
    assert s["clean_filler"]["flagged"]["13"] == 0


@pytest.mark.timeout(120)
def test_bench_reads_a_real_decon_output(dr: ModuleType, corpus: Any, tmp_path: Path) -> None:
    """One run of refinery decon (the bench's own command) on the tiny corpus: the detail
    pairs and the drop list it reads are the reference method's."""
    out = dr.run_decon(str(tmp_path), corpus, [9, 13])
    flags = dr.read_flags(out)
    ref = dr.reference_flags(corpus, [9, 13])
    assert dr.differences(flags, ref) == []
    assert flags.pairs == ref.pairs and flags.dropped == ref.dropped
    assert dr.score(corpus, flags, [9, 13])["in_long_doc"]["caught"] == {"9": 2, "13": 2}
