"""Text from several fields (--text-template) and chat rows, for prep and decon: the one
extraction rule (transforms.io.text), its reasons, its CLI flags, and the stage hashes it
must leave alone when only --text-field is used."""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from helpers import gsm8k_rows, run_prep, write_jsonl

from refinery.beam_pipelines.checks import UsageError, check_field, text_spec
from refinery.transforms.formats import shards
from refinery.transforms.formats.tiktoken_vocab import get_encoding
from refinery.transforms.io.text import TemplateError, TextSpec, escape, normalize_text, unescape
from refinery.transforms.loader import mixture as mx
from refinery.transforms.prep.documents import Document, Rejected, encode_document, normalize_row
from refinery.transforms.resumable import Stage, short_hash

QA = "{question}\n\n{answer}"
QA_TYPED = r"{question}\n\n{answer}"  # as typed in bash single quotes
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "name": "bot"}]


# ---------------------------------------------------------------------------------------
# The rule (pure)
# ---------------------------------------------------------------------------------------

def test_field_reasons_are_as_before() -> None:
    spec = TextSpec(field="text")
    assert spec.extract({"text": "hi"}) == ("hi", None)
    assert spec.extract({"body": "hi"}) == (None, "missing text field 'text'")
    assert spec.extract({"text": 3}) == (None, "text field 'text' is int, not a string")
    assert spec.extract({"text": None}) == (None, "text field 'text' is NoneType, not a string")
    assert spec.extract({"text": ["a", "b"]}) == (None, "text field 'text' is list, not a string")  # not chat
    assert spec.extract({"text": []}) == (None, "text field 'text' is list, not a string")
    assert spec.fields() == ("text",) and spec.identity() == {"text_field": "text"}


def test_template_joins_fields_with_its_literal_text() -> None:
    spec = TextSpec(template=unescape(QA_TYPED))
    assert spec.template == QA
    assert spec.extract({"question": "Q?", "answer": "A.", "x": 1}) == ("Q?\n\nA.", None)
    assert spec.fields() == ("question", "answer") and spec.identity() == {"text_template": QA}
    braces = TextSpec(template="{{q}}: {q} / {a} / {q}")
    assert braces.extract({"q": "1", "a": "2"}) == ("{q}: 1 / 2 / 1", None)
    assert braces.fields() == ("q", "a")


def test_template_rejects_name_the_field() -> None:
    spec = TextSpec(template=QA)
    assert spec.extract({"question": "Q"}) == (None, "missing field 'answer' (text template)")
    assert spec.extract({"question": "Q", "answer": 42}) == (
        None, "field 'answer' is int, not a string (text template)")
    assert spec.extract({"question": None, "answer": "A"}) == (
        None, "field 'question' is NoneType, not a string (text template)")
    assert str(spec.extract(None)[1]).startswith("not a row")


@pytest.mark.parametrize("typed, meant", [
    (r"a\nb", "a\nb"), (r"a\tb", "a\tb"), (r"a\\nb", "a\\nb"), (r"\\\\", "\\\\"), ("a\nb", "a\nb"), ("plain", "plain"),
])
def test_unescape(typed: str, meant: str) -> None:
    assert unescape(typed) == meant
    assert unescape(escape(meant)) == meant


@pytest.mark.parametrize("typed", [r"a\rb", "a\\", r"\x41", "{q}\\"])
def test_unknown_escapes_are_errors(typed: str) -> None:
    with pytest.raises(TemplateError, match="not an escape it knows"):
        unescape(typed)


@pytest.mark.parametrize("template, message", [
    ("{}", "empty {} field"),
    ("{0}{}", "empty {} field"),
    ("{a.b}", "only plain field names"),
    ("{a[0]}", "only plain field names"),
    ("{a!r}", "conversions"),
    ("{a:>10}", "format specs"),
    ("no field", "names no field"),
    ("{{literal}}", "names no field"),
    ("{question", "not a valid template"),
    ("answer}", "not a valid template"),
])
def test_bad_templates_are_one_line_errors(template: str, message: str) -> None:
    with pytest.raises(TemplateError, match=message.replace("{", r"\{").replace("[", r"\[")) as e:
        TextSpec(template=template)
    assert "\n" not in str(e.value)


def test_spec_needs_exactly_one_source() -> None:
    with pytest.raises(ValueError):
        TextSpec()
    with pytest.raises(ValueError):
        TextSpec(field="a", template="{a}")
    with pytest.raises(ValueError):
        TextSpec.from_options("a", "{a}")
    assert TextSpec.from_options(None, None) == TextSpec(field="text")
    assert TextSpec.of("x") == TextSpec(field="x") and TextSpec.of(TextSpec(template="{x}")).template == "{x}"
    assert len({TextSpec(template=QA), TextSpec(template=QA), TextSpec(field="text")}) == 2  # hashable


def test_chat_rows_are_flattened_by_field_and_in_templates() -> None:
    flat = "system: Be brief.\n\nuser: 2+2?\n\nassistant: 4"
    assert TextSpec(field="messages").extract({"messages": CHAT}) == (flat, None)
    spec = TextSpec(template="[{source}]\n{messages}")
    assert spec.extract({"source": "s", "messages": CHAT}) == ("[s]\n" + flat, None)


@pytest.mark.parametrize("messages, detail", [
    ([{"role": "user", "content": "a"}, "b"], "message 1 is str, not a dict with role and content"),
    ([{"role": "user", "content": "a"}, {"content": "b"}], "message 1 has no 'role'"),
    ([{"role": "user"}], "message 0 has no 'content'"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": None}], "message 1 'content' is NoneType, "
                                                                                 "not a string"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}]}], "message 0 'content' is list, not a string"),
    ([{"role": 1, "content": "a"}], "message 0 'role' is int, not a string"),
])
def test_malformed_chat_rows_are_rejects_naming_field_and_element(messages: object, detail: str) -> None:
    assert TextSpec(field="messages").extract({"messages": messages}) == (None, f"text field 'messages' {detail}")
    assert TextSpec(template="{messages}").extract({"messages": messages}) == (
        None, f"field 'messages' {detail} (text template)")


def _rejected(outcome: Document | Rejected) -> Rejected:
    assert isinstance(outcome, Rejected), outcome
    return outcome


def test_normalize_row_builds_the_text_before_normalizing() -> None:
    spec = TextSpec(template="{q}\r\n{a}  ")
    doc = normalize_row({"id": 1, "q": "  caf\u0065\u0301", "a": "x\x00y"}, None, spec, "id", "f.jsonl", 3)
    assert doc == Document("1", "caf\u00e9\nxy", "f.jsonl", 3)
    assert normalize_row({"q": "a"}, None, spec, "id", "f.jsonl", 4) == Rejected(
        "f.jsonl", 4, "missing field 'a' (text template)")
    assert "surrogates" in _rejected(normalize_row({"q": "a\ud800", "a": "b"}, None, spec, "id")).reason
    # a plain field name still works, with today's reasons
    assert _rejected(normalize_row({"text": 5}, None, "text", "id")).reason == "text field 'text' is int, not a string"


# ---------------------------------------------------------------------------------------
# Stage configs: --text-field keeps every hash; a template enters them
# ---------------------------------------------------------------------------------------

def test_prep_configs_are_unchanged_with_a_field_and_change_with_a_template(tmp_path: Path) -> None:
    from refinery.transforms.prep.stages import ManifestStage, PrepConfig, build_stages

    def stages(**kw: Any) -> list[Stage[Any, Any]]:
        return build_stages(PrepConfig(inputs=[], output=str(tmp_path / "o"), dataset="d", **kw))

    def run_hash(built: list[Stage[Any, Any]]) -> str:
        manifest = built[-1]
        assert isinstance(manifest, ManifestStage)
        return manifest.run_hash

    tokenize = dict(stages()[0].config().settings)
    # the config of the code before templates (so resumed outputs do not re-plan), but the normalization's
    # version: "nfc-crlf-cc-strip/1" until its order changed (issue 58, item 3: a new rule re-plans)
    assert tokenize == {"text_field": "text", "id_field": "id", "num_shards": 8, "row_groups_per_unit": 8,
                        "unit_bytes": 16 << 20, "normalize": "cc-nfc-strip-2", "source": {},
                        "max_row_bytes": tokenize["max_row_bytes"]}
    assert short_hash(tokenize) == "62fe00d7e2af7d10"  # ("5cd82816834a15b1" under nfc-crlf-cc-strip/1)
    assert run_hash(stages()) == run_hash(stages(text_field="text"))
    templated = stages(text_template=QA)
    assert templated[0].config().settings["text_template"] == QA and "text_field" not in templated[0].config().settings
    other = stages(text_template="{question} {answer}")
    assert len({run_hash(templated), run_hash(other), run_hash(stages())}) == 3
    assert short_hash(dict(templated[0].config().settings)) != short_hash(dict(other[0].config().settings))


def test_decon_configs_are_unchanged_with_a_field_and_change_with_a_template(tmp_path: Path) -> None:
    from refinery.transforms.decon.stages import DeconSettings, MergeReportsStage, build_stages
    from refinery.transforms.io.text import TEXT_NORMALIZATION

    ev = write_jsonl(tmp_path / "gsm8k" / "test.jsonl", [{"id": 1, "question": "a b c", "answer": "d"}])
    tr = write_jsonl(tmp_path / "train.jsonl", [{"id": 1, "text": "a b c"}])

    def stages(**kw: Any) -> list[Stage[Any, Any]]:
        return build_stages(DeconSettings(eval_paths=[str(ev)], train_paths=[str(tr)], ns=[3], **kw))

    index, scan = stages(eval_text_field="question")[1:3]  # after the eval slices (issue 59)
    assert index.config().settings == {"format": index.config().settings["format"], "ns": [3], "text_field": "question",
                              "id_field": "id", "partitions": 64, "text_normalization": TEXT_NORMALIZATION,
                              "min_eval_tokens": 5}
    settings = scan.config().settings
    assert settings == {"format": settings["format"], "text_field": "text", "id_field": "id",
                             "slice_bytes": 256 << 20, "unread_rows": 1, "text_normalization": TEXT_NORMALIZATION,
                             "row_ids": "relpath:row"}
    _, index, scan, _, merge = stages(eval_text_template=QA)
    assert isinstance(merge, MergeReportsStage)
    assert index.config().settings["text_template"] == QA and "text_field" not in index.config().settings
    assert "text_template" not in scan.config().settings
    assert ("eval text template", r"{question}\n\n{answer}") in merge.report_settings()
    assert ("train text field", "text") in merge.report_settings()
    with pytest.raises(ValueError, match="names no field"):
        stages(train_text_template="none")


# ---------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------

def test_text_spec_flags() -> None:
    assert text_spec("prep", None, None) == TextSpec(field="text")
    assert text_spec("prep", "body", None) == TextSpec(field="body")
    assert text_spec("prep", None, QA_TYPED) == TextSpec(template=QA)
    assert text_spec("decon", None, None, default=None) is None
    with pytest.raises(UsageError, match="give --text-field or --text-template, not both"):
        text_spec("prep", "text", QA_TYPED)
    with pytest.raises(UsageError, match=r"^refinery prep: --text-template: '\{a\.b\}': field \{a\.b\}"):
        text_spec("prep", None, "{a.b}")


def test_check_field_with_a_template_names_the_missing_field(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [{"question": "q", "answer": "a"}, {"question": "q2"}])
    check_field("prep", "--text-template", ("question", "answer"), [str(path)], shown=QA)  # each in some row
    with pytest.raises(UsageError, match=r"--text-template '\{question\}\\n\\n\{answers\}': field 'answers': no row"):
        check_field("prep", "--text-template", ("question", "answers"), [str(path)], shown="{question}\n\n{answers}")


# ---------------------------------------------------------------------------------------
# prep, end to end
# ---------------------------------------------------------------------------------------

def _load_docs(out: Path) -> list[npt.NDArray[np.uint32]]:
    manifest = json.loads((out / "manifest.json").read_text())
    docs: list[npt.NDArray[np.uint32]] = []
    for s in manifest["shards"]:
        tokens = np.load(out / s["path"])
        docs += [tokens[a:b] for a, b in shards.read_idx(str(out / s["index_path"]))]
    return docs


def test_prep_with_a_text_template(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    qa = gsm8k_rows("train")[:8]
    corpus = tmp_path / "corpus"
    rows = [{"id": f"a{i}", **r} for i, r in enumerate(qa[:5])]
    rows.insert(2, {"id": "no-answer", "question": "What?"})
    rows.insert(4, {"id": "int-answer", "question": "How many?", "answer": 7})
    write_jsonl(corpus / "a.jsonl", rows)
    pq.write_table(pa.table({"id": [f"b{i}" for i in range(3)], "question": [r["question"] for r in qa[5:]],
                             "answer": [r["answer"] for r in qa[5:]], "extra": [1, 2, 3]}), corpus / "b.parquet")
    out = tmp_path / "out"
    assert run_prep([corpus], out, "--num-shards", 1, "--text-template", QA_TYPED) == 0

    enc = get_encoding()
    want = [encode_document(enc, normalize_text(r["question"] + "\n\n" + r["answer"])) for r in qa]
    got = _load_docs(out)
    assert [d.tolist() for d in got] == [list(w) for w in want]
    rejects = [json.loads(line) for line in (out / "rejects" / "rejects.jsonl").read_text().splitlines()]
    assert sorted((r["row"], r["reason"]) for r in rejects) == [
        (2, "missing field 'answer' (text template)"), (4, "field 'answer' is int, not a string (text template)")]
    m = json.loads((out / "manifest.json").read_text())
    assert m["rows"]["read"] == 10 == m["rows"]["accepted"] + m["rows"]["empty"] + m["rows"]["rejected"]
    assert (m["rows"]["accepted"], m["rows"]["rejected"], m["total_documents"]) == (8, 2, 8)

    # the same output resumes as done; a changed template re-plans
    capsys.readouterr()
    assert run_prep([corpus], out, "--num-shards", 1, "--text-template", QA_TYPED) == 0
    assert "nothing (all units already done)" in capsys.readouterr().out
    assert run_prep([corpus], out, "--num-shards", 1, "--text-template", r"{answer}\n\n{question}") == 0
    assert "nothing (all units already done)" not in capsys.readouterr().out
    first = encode_document(enc, normalize_text(qa[0]["answer"] + "\n\n" + qa[0]["question"]))
    assert _load_docs(out)[0].tolist() == list(first)


def test_prep_with_chat_rows(tmp_path: Path) -> None:
    corpus = write_jsonl(tmp_path / "chat.jsonl", [
        {"id": "c0", "messages": CHAT},
        {"id": "c1", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]},
        {"id": "c2", "messages": [{"role": "user", "content": "Hello\r\n there "}]},
    ])
    out = tmp_path / "out"
    assert run_prep([corpus], out, "--num-shards", 1, "--text-field", "messages") == 0
    enc = get_encoding()
    want = [encode_document(enc, normalize_text(t)) for t in
            ("system: Be brief.\n\nuser: 2+2?\n\nassistant: 4", "user: Hello\n there")]
    assert [d.tolist() for d in _load_docs(out)] == [list(w) for w in want]
    rejects = [json.loads(line) for line in (out / "rejects" / "rejects.jsonl").read_text().splitlines()]
    assert rejects == [{"path": str(corpus), "row": 1, "reason": "text field 'messages' message 1 has no 'content'"}]


@pytest.mark.parametrize("extra, message", [
    (("--text-field", "question", "--text-template", QA_TYPED), "give --text-field or --text-template, not both"),
    (("--text-template", "{question.x}"), "only plain field names"),
    (("--text-template", r"{question}\r"), "not an escape it knows"),
    (("--text-template", r"{question}\n\n{answers}"), "field 'answers': no row of"),
])
def test_prep_flag_errors_exit_2_with_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: tuple[str, ...], message: str) -> None:
    corpus = write_jsonl(tmp_path / "a.jsonl", gsm8k_rows("test")[:3])
    assert run_prep([corpus], tmp_path / "out", *extra) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_normalize_transform_takes_a_template() -> None:
    import apache_beam as beam
    from apache_beam.testing.test_pipeline import TestPipeline
    from apache_beam.testing.util import assert_that, equal_to

    from refinery.transforms.prep import Normalize

    with pytest.raises(TemplateError):
        Normalize(text_template="{a.b}")
    with pytest.raises(ValueError, match="not both"):
        Normalize("text", text_template=QA)
    rows = [{"id": "a", "question": "Q ", "answer": " A"}, {"id": "b", "question": "Q"}]
    with TestPipeline() as p:
        docs, rejected = p | beam.Create(rows) | Normalize(text_template=QA).with_rejected()
        assert_that(docs, equal_to([Document("a", "Q \n\n A", "", 0)]), label="docs")
        assert_that(rejected, equal_to([Rejected("", 0, "missing field 'answer' (text template)")]), label="rej")


# ---------------------------------------------------------------------------------------
# decon, end to end
# ---------------------------------------------------------------------------------------

def _decon(*argv: object) -> int:
    from refinery.beam_pipelines.cli import main

    return main(["decon", *map(str, argv), "--ngrams", "8", "--runner", "direct", "--no-progress"])


def _instances(out: Path) -> list[dict[str, Any]]:
    with gzip.open(out / "stats" / "overlap_instances.jsonl.gz", "rt") as f:
        return [json.loads(line) for line in f]


def test_decon_with_templates_on_both_sides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    qa = gsm8k_rows("test")[:4]
    ev = write_jsonl(tmp_path / "evals" / "gsm8k" / "test.jsonl",
                     [{"id": f"t{i}", "question": r["question"], "answer": r["answer"]} for i, r in enumerate(qa)])
    # training rows hold eval 1's ANSWER only, in fields of their own
    tr = write_jsonl(tmp_path / "train" / "t.jsonl", [
        {"id": "d0", "title": "Notes", "body": "Some words. " + qa[1]["answer"] + " More words."},
        {"id": "d1", "title": "Other", "body": "nothing to see in this training document at all, none"},
        {"id": "d2", "title": "No body"},
    ])
    train_tpl = ("--train-text-template", r"{title}\n{body}")
    by_question = tmp_path / "q"
    assert _decon("--eval", ev, "--train", tr, "--output", by_question, "--eval-text-field", "question",
                  *train_tpl) == 0
    assert _instances(by_question) == []
    by_template = tmp_path / "qa"
    assert _decon("--eval", ev, "--train", tr, "--output", by_template, "--eval-text-template", QA_TYPED,
                  *train_tpl) == 0
    [inst] = _instances(by_template)
    assert inst["instance_id"] == "t1" and inst["eval_text"] == qa[1]["question"] + "\n\n" + qa[1]["answer"]
    out = capsys.readouterr().out  # training rows: 3 read, 1 without text (no body)
    assert "training rows: read 3 = used 2 + unreadable or without text 1" in out
    assert "eval rows: read 4 = used 4" in out
    report = (by_template / "stats" / "report.html").read_text()
    assert "eval text template" in report and "train text template" in report

    # --text-template (both sides) with a side's own field: the side's flag wins
    both = tmp_path / "both"
    assert _decon("--eval", ev, "--train", tr, "--output", both, "--text-template", r"{title}\n{body}",
                  "--eval-text-template", QA_TYPED) == 0
    assert [i["instance_id"] for i in _instances(both)] == ["t1"]


@pytest.mark.parametrize("extra, message", [
    (("--text-field", "question", "--text-template", QA_TYPED), "give --text-field or --text-template, not both"),
    (("--eval-text-field", "question", "--eval-text-template", QA_TYPED),
     "give --eval-text-field or --eval-text-template, not both"),
    (("--train-text-template", "{a!r}"), "--train-text-template: '{a!r}': field {a!r}: conversions"),
    (("--eval-text-template", r"{question}\n{answers}"), "--eval-text-template '{question}\\n{answers}': "
                                                          "field 'answers': no row of"),
])
def test_decon_flag_errors_exit_2_with_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: tuple[str, ...], message: str) -> None:
    ev = write_jsonl(tmp_path / "gsm8k" / "test.jsonl", gsm8k_rows("test")[:2])
    tr = write_jsonl(tmp_path / "train.jsonl", [{"text": "a b c"}])
    assert _decon("--eval", ev, "--train", tr, "--output", tmp_path / "out", *extra) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_decon_eval_rows_and_scan_use_the_same_rule() -> None:
    from refinery.transforms.decon import ngrams as ng

    tok = ng.TOKENIZERS["default"]
    records = [("ds", "p", 0, {"messages": CHAT}), ("ds", "p", 1, {"messages": [{"role": "user"}]}),
               ("ds", "p", 2, None)]
    rows, bad = ng.eval_rows_of(records, TextSpec(field="messages"), "id", tok)
    assert [r.text for r in rows] == ["system: Be brief.\n\nuser: 2+2?\n\nassistant: 4"]
    assert bad == {"ds": {"bad_rows": 2}}


# ---------------------------------------------------------------------------------------
# prep-mixture
# ---------------------------------------------------------------------------------------

def _mixture(tmp_path: Path, source: str) -> mx.MixtureFile:
    import tomllib

    text = f"""
[mixtures.m]
total_tokens_b = 0.001
[[mixtures.m.sources]]
id = "gsm"
percent = 100.0
path = "data/"
{source}
"""
    return mx.parse_mixture_file(tomllib.loads(text), str(tmp_path / "mix.toml"))


def test_mixture_sources_take_a_text_template(tmp_path: Path) -> None:
    from refinery.transforms.loader.mixture import MixtureError

    [src] = _mixture(tmp_path, 'text_template = "{question}\\n\\n{answer}"').mixtures["m"].sources
    assert src.text_template == QA
    [src] = _mixture(tmp_path, 'text_field = "body"').mixtures["m"].sources
    assert (src.text_field, src.text_template) == ("body", None)
    with pytest.raises(MixtureError, match="text_field or text_template, not both"):
        _mixture(tmp_path, 'text_field = "a"\ntext_template = "{a}"')
    with pytest.raises(MixtureError, match="text_template: .*only plain field names"):
        _mixture(tmp_path, 'text_template = "{a.b}"')
