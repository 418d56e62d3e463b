"""decon's public PTransforms: BuildNgramIndex + FindOverlaps give HELM's instance sets with exact offsets."""
from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.test_pipeline import TestPipeline as BeamPipeline  # a Beam class: no Test* name to collect
from apache_beam.testing.util import assert_that, equal_to
from helpers import GSM8K_TEST, gsm8k_rows, write_jsonl

from refinery.beam_pipelines.cli import main
from refinery.transforms.decon import BuildNgramIndex, FindOverlaps, Overlap
from refinery.transforms.decon import ngrams as ng
from refinery.transforms.decon.beam import NgramIndexCoder, OverlapCoder
from refinery.transforms.decon.ngrams.details import read_details
from refinery.transforms.io.rows import SourceRow, iter_rows

NS = [5, 9, 13]


def _train_docs(n: int = 1500) -> list[dict[str, str]]:
    """GSM8K train documents, every 25th with a GSM8K test question planted in it."""
    test = gsm8k_rows("test")
    rnd = random.Random(5)
    docs = []
    for i, r in enumerate(gsm8k_rows("train")[:n]):
        text = r["question"] + "\n" + r["answer"]
        if i % 25 == 0:
            text += "\n\nRelated: " + test[rnd.randrange(len(test))]["question"]
        docs.append({"id": f"t{i}", "text": text})
    return docs


def _collect(pcoll: beam.pvalue.PCollection[Any], path: Path,
             encode: Callable[[Any], str] = lambda o: json.dumps(list(o))) -> None:
    """Write a PCollection to one text file (a closure cannot hand elements back: Beam pickles it)."""
    _ = pcoll | f"Encode{path.name}" >> beam.Map(encode) | f"Write{path.name}" >> beam.io.WriteToText(
        str(path), shard_name_template="")


def _overlap(values: list[Any]) -> Overlap:
    fields: list[Any] = [tuple(map(tuple, v)) if k in (4, 6) else v for k, v in enumerate(values)]
    return Overlap(*fields)


def _overlaps(path: Path) -> list[Overlap]:
    return [_overlap(json.loads(line)) for line in path.read_text().splitlines()]


def _source_rows(path: str) -> list[SourceRow]:
    return [SourceRow(path, row, record, "") for row, record, error in iter_rows(path)
            if error is None and record is not None]


def test_find_overlaps_matches_helm_and_the_cli_offsets(tmp_path: Path) -> None:
    """HELM conformance: ``match_fold="none"`` and the CLI's --match-fold none
    --min-eval-tokens 0 (HELM's exact text, every row indexed); the default fold's own
    conformance: tests/test_decon_ngrams.py (both ways) and test_the_match_fold_below."""
    train_path = str(tmp_path / "train" / "docs.jsonl")
    docs, test = _train_docs(), gsm8k_rows("test")
    for i in range(10, len(docs), 100):  # a test question the same to a reader only: not HELM's text
        q = test[i % len(test)]["question"]
        docs[i]["text"] += "\n\nAlso: " + " ".join(w[:1] + "\u00ad" + w[1:] for w in q.split())
    write_jsonl(tmp_path / "train" / "docs.jsonl", docs)
    eval_rows = _source_rows(str(GSM8K_TEST))
    train_rows = _source_rows(train_path)
    random.Random(2).shuffle(train_rows)

    opts = PipelineOptions(["--runner=DirectRunner"])
    with beam.Pipeline(options=opts) as p:
        index = p | "Eval" >> beam.Create(eval_rows) | BuildNgramIndex(NS, text_field="question", match_fold="none")
        _collect(p | "Train" >> beam.Create(train_rows) | FindOverlaps(index), tmp_path / "overlaps.jsonl")
    found = _overlaps(tmp_path / "overlaps.jsonl")

    # HELM's instance set per n (the straightforward reference implementation)
    tok = ng.get_tokenizer("default", "none")
    evrows, _ = ng.make_eval_rows([str(GSM8K_TEST)], iter_rows, "question", "id", tok)
    ref_ids, ref_details = ng.reference_overlap(
        evrows, ((train_path, r.row, r.record["text"]) for r in sorted(train_rows, key=lambda r: r.row)), NS, tok)
    for n in NS:
        assert sorted({o.instance_id for o in found if o.n == n}) == ref_ids[("gsm8k", n)]
    assert not {o.train_row for o in found if o.n == 13 and o.train_row % 100 == 10}
    assert len(ref_ids[("gsm8k", 13)]) >= 50
    by_id = {r.instance_id: r for r in evrows}
    assert {(by_id[o.instance_id].eval_idx, o.train_path, o.train_row, len(o.ngram.split(" ")), o.ngram)
            for o in found} == ref_details

    # exact offsets: the same as refinery decon's detail records, and they hold the n-gram's text
    out = tmp_path / "cli"
    assert main(["decon", "--eval", str(GSM8K_TEST), "--eval-text-field", "question", "--train",
                 str(tmp_path / "train"), "--output", str(out), "--ngrams", *map(str, NS), "--match-fold", "none",
                 "--min-eval-tokens", "0", "--runner", "direct", "--no-progress"]) == 0
    cli = {(d["instance_id"], d["ngram"], tuple(map(tuple, d["eval_offsets"])), d["train_row"],
            tuple(map(tuple, d["train_offsets"]))) for d in read_details(str(out))}
    ours = {(o.instance_id, o.ngram, o.eval_offsets, o.train_row, o.train_offsets) for o in found}
    assert ours == cli
    train_text = {r.row: r.record["text"] for r in train_rows}
    for o in found[:500]:
        for s, e in o.eval_offsets:
            assert " ".join(tok.tokenize(by_id[o.instance_id].text[s:e])) == o.ngram
        for s, e in o.train_offsets:
            assert " ".join(tok.tokenize(train_text[o.train_row][s:e])) == o.ngram


def test_the_match_fold_below() -> None:
    """BuildNgramIndex(match_fold=...): FindOverlaps folds the training rows with the index's
    fold; the offsets index the raw text."""
    q = "The florist sells fifteen fine flowers to the fishmonger every Friday morning"
    eval_rows = [{"id": "q", "text": q.replace("fi", "\ufb01").replace("fl", "\ufb02")}]  # ligatures
    shy = "Ａ note: " + " ".join(w[:1] + "\u00ad" + w[1:] for w in q.split(" ")) + "!"  # soft hyphens
    train_rows = [{"id": "d1", "text": shy}, {"id": "d2", "text": q}]
    for fold, found in (("nfkc-cf", True), ("none", False)):
        with BeamPipeline() as p:
            index = p | "Eval" >> beam.Create(eval_rows) | BuildNgramIndex([13], match_fold=fold)
            overlaps = p | "Train" >> beam.Create(train_rows) | FindOverlaps(index)
            assert_that(overlaps | beam.Map(lambda o: (o.train_doc_id, o.ngram, o.train_offsets)) | beam.Distinct(),
                        equal_to([("d1", q.lower(), ((8, 8 + len(shy) - 9),)), ("d2", q.lower(), ((0, len(q)),))]
                                 if found else []))
    with pytest.raises(ValueError, match="unknown match fold"):
        BuildNgramIndex([13], match_fold="nfkc")


def test_plain_dicts_short_instances_and_metrics() -> None:
    eval_rows = [{"id": "q1", "text": "The quick brown fox jumps over the lazy dog"},
                 {"id": "q2", "text": "Tiny one"},            # 2 tokens: its 2-gram stands for every n
                 {"id": "q3", "text": "?!"},                  # only empty tokens: never overlaps
                 {"id": "bad", "body": "no text field"}]
    train_rows = [{"id": "d1", "text": "... the QUICK brown fox, jumps over the lazy dog!"},
                  {"id": "d2", "text": "a tiny one here"},
                  {"text": "nothing in common"}]
    with BeamPipeline() as p:
        index = p | "Eval" >> beam.Create(eval_rows) | BuildNgramIndex([3, 13], eval_dataset="toy")
        overlaps = p | "Train" >> beam.Create(train_rows) | FindOverlaps(index)
        assert_that(overlaps | beam.Map(lambda o: (o.instance_id, o.n, o.train_doc_id)) | beam.Distinct(),
                    equal_to([("q1", 3, "d1"), ("q1", 13, "d1"), ("q2", 3, "d2"), ("q2", 13, "d2")]))
        assert_that(overlaps | beam.Filter(lambda o: o.instance_id == "q2")
                    | beam.Map(lambda o: (o.ngram, o.eval_offsets, o.train_offsets, o.train_path, o.train_row)),
                    equal_to([("tiny one", ((0, 8),), ((2, 10),), "", -1)] * 2), label="short")
        assert_that(index | beam.Map(lambda i: (len(i.rows), i.bad)), equal_to([(3, {"toy": {"bad_rows": 1}})]),
                    label="index")


def test_the_index_is_the_same_whatever_the_arrival_order_and_round_trips(tmp_path: Path) -> None:
    rows = [{"id": f"r{i}", "text": f"row {i} says something about item {i * 7}"} for i in range(40)]
    built = []
    for seed in (1, 2):
        shuffled = rows[:]
        random.Random(seed).shuffle(shuffled)
        with BeamPipeline() as p:
            _collect(p | beam.Create(shuffled) | BuildNgramIndex([4]), tmp_path / f"index{seed}",
                     lambda i: i.to_bytes().hex())
        built.append(ng.NgramIndex.from_bytes(bytes.fromhex((tmp_path / f"index{seed}").read_text().strip())))
    assert built[0].to_bytes() == built[1].to_bytes() and len(built[0].rows) == 40
    coder = NgramIndexCoder()
    assert coder.decode(coder.encode(built[0])).to_bytes() == built[0].to_bytes()
    o = Overlap("i", "ds", 5, "a b c d e", ((0, 9),), "t", ((3, 12), (20, 29)), "p.jsonl", 4)
    assert OverlapCoder().decode(OverlapCoder().encode(o)) == o


def test_asking_for_an_n_the_index_lacks_is_an_error() -> None:
    with pytest.raises(Exception, match=r"built for n = \[5\]"):
        with BeamPipeline() as p:
            index = p | "Eval" >> beam.Create([{"text": "a b c d e f"}]) | BuildNgramIndex([5])
            _ = p | "Train" >> beam.Create([{"text": "a b c d e f"}]) | FindOverlaps(index, ngrams=[13])


def test_beam_reads_no_type_hints_from_the_annotations() -> None:
    """The transforms' ``expand`` and the scan's ``process`` are annotated for mypy only: Beam
    takes no type hints from them (before, it read the scan's ``process`` as hints of Any), so
    type checks and coders stay those of ``with_output_types``."""
    from refinery.transforms.decon.beam import DeconPipeline, DropOverlaps, _FindOverlapsFn
    from refinery.transforms.decon.stages import DeconSettings
    from refinery.transforms.io.text import TextSpec

    p = beam.Pipeline()  # built, never run
    index = p | "Eval" >> beam.Create([{"text": "a b c d e f"}]) | BuildNgramIndex([5])
    overlaps = p | "Train" >> beam.Create([{"text": "a b c d e f"}]) | FindOverlaps(index)
    transforms: list[Any] = [BuildNgramIndex([5]), FindOverlaps(index), DropOverlaps(overlaps),
                             DeconPipeline(DeconSettings(eval_paths=[], train_paths=[], ns=[5]), "/unused"),
                             _FindOverlapsFn(None, TextSpec.of("text"), "id")]
    for t in transforms:
        hints = t.get_type_hints()
        assert (hints.input_types, hints.output_types) == (None, None), type(t).__name__

def test_through_portable_runner(tmp_path: Path) -> None:
    """One run through the job API that Flink's job server speaks (embedded, LOOPBACK)."""
    eval_rows = [{"id": f"q{i}", "text": r["question"]} for i, r in enumerate(gsm8k_rows("test")[:50])]
    train_rows = _train_docs(300)
    for i in range(0, 300, 30):  # some eval questions appear in the training data
        train_rows[i] = {**train_rows[i], "text": train_rows[i]["text"] + "\n" + eval_rows[i // 10]["text"]}
    results = {}
    for name, args in (("direct", ["--runner=DirectRunner"]),
                       ("portable",
                        ["--runner=PortableRunner", "--job_endpoint=embed", "--environment_type=LOOPBACK"])):
        path = tmp_path / f"{name}.jsonl"
        with beam.Pipeline(options=PipelineOptions(args)) as p:
            index = p | "Eval" >> beam.Create(eval_rows) | BuildNgramIndex([8])
            _collect(p | "Train" >> beam.Create(train_rows) | FindOverlaps(index), path)
        results[name] = sorted(path.read_text().splitlines())
    assert results["portable"] == results["direct"] and results["direct"]
