"""``refinery decon --eval-dataset-field FIELD`` (issue 50 item 4): an eval row's dataset is
its own FIELD, not its file's folder, so one file of several benchmarks (AI2 decon's reference
layout: ``{"eval_key": "gsm8k", "question": ...}``) is read as it is; a row without a good
FIELD is a bad row of its file's dataset, listed with its reason; no row having FIELD: exit 2."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from refinery.beam_pipelines import decon
from refinery.transforms.decon import ngrams as ng
from refinery.transforms.decon.ngrams.ids import dataset_name_problem, field_dataset
from refinery.transforms.decon.ngrams.index import bad_row_reasons, bad_rows_warning, make_eval_rows
from refinery.transforms.decon.stages import DeconSettings, IndexStage

DIRECT = ["--runner=DirectRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1"]

GSM8K = ["Natalia sold clips to forty eight of her friends in April and then half as many in May",
         "Weng earns twelve dollars an hour for babysitting and yesterday she did fifty minutes of it",
         "Betty is saving money for a new wallet which costs one hundred dollars in the shop"]
DROP_PASSAGE = "The Raiders played the Chiefs at home and won by a field goal in the fourth quarter."
DROP = ["How many points did the Raiders win by when they played the Chiefs at home that season",
        "Which team scored the last touchdown of the game before the half ended in the long rain"]
NOT_NAMED = "This row names no benchmark at all but it has a question that is long enough to index"


def ai2_rows() -> list[dict[str, Any]]:
    """AI2 decon's reference layout: one file, rows of two benchmarks named by ``eval_key``,
    then a row without ``eval_key`` and one whose ``eval_key`` is empty."""
    rows: list[dict[str, Any]] = [{"eval_key": "gsm8k", "question": q, "answer": "72", "doc_id": i}
                                  for i, q in enumerate(GSM8K)]
    rows += [{"eval_key": "drop", "passage": DROP_PASSAGE, "question": q, "doc_id": i} for i, q in enumerate(DROP)]
    rows += [{"question": NOT_NAMED, "doc_id": 9}, {"eval_key": "", "question": NOT_NAMED + " again", "doc_id": 10}]
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def inputs(tmp_path: Path) -> tuple[str, str]:
    ev = write_jsonl(tmp_path / "ai2ref" / "eval.jsonl", ai2_rows())
    train = [{"id": "t0", "text": "filler words here. " + GSM8K[1] + " and more filler after it."},
             {"id": "t1", "text": "Sports page: " + DROP[0] + "? Nobody knew."},
             {"id": "t2", "text": "nothing of any eval set is in this training row at all, only words."}]
    tr = write_jsonl(tmp_path / "train" / "train.jsonl", train)
    return ev, tr


def run_cli(argv: list[str]) -> int:
    args, extra = decon.build_parser().parse_known_args(argv + ["--no-progress"])
    assert not extra
    return decon.run(args, list(DIRECT))


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_one_file_of_two_benchmarks_is_read_per_benchmark(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ev, tr = inputs(tmp_path)
    out = str(tmp_path / "out")
    assert run_cli(["--eval", ev, "--train", tr, "--output", out, "--ngrams", "8", "--partitions", "2",
                    "--eval-dataset-field", "eval_key", "--eval-text-template", "{question}"]) == 0
    err = capsys.readouterr().err
    stats = {s["eval_dataset"]: s for s in read_jsonl(os.path.join(out, "stats/overlap_stats.jsonl"))}
    # the rows without a good eval_key are bad rows of their file's dataset (its folder), never silent
    assert sorted(stats) == ["ai2ref", "drop", "gsm8k"]
    assert {ds: s["num_instances"] for ds, s in stats.items()} == {"ai2ref": 0, "drop": 2, "gsm8k": 3}
    assert len(stats["gsm8k"]["instance_ids"]) == 1 and len(stats["drop"]["instance_ids"]) == 1
    summary = {e["eval_dataset"]: e for e in read_jsonl(os.path.join(out, "stats/eval_summary.jsonl"))}
    assert {ds: (e["num_rows"], e["num_bad_rows"]) for ds, e in summary.items()} == \
        {"ai2ref": (0, 2), "drop": (2, 0), "gsm8k": (3, 0)}
    metrics = read_jsonl(os.path.join(out, "stats/overlap_metrics.jsonl"))
    hit = {(m["eval_dataset"], m["eval_row"]) for m in metrics if m["binary"]}
    assert hit == {("gsm8k", 1), ("drop", 3)}  # the rows as numbered in the one file
    bad = read_jsonl(os.path.join(out, "stats/eval_bad_rows.jsonl"))
    assert bad == [
        {"eval_path": ev, "eval_row": 5, "eval_dataset": "ai2ref",
         "reason": "no field 'eval_key' (--eval-dataset-field)"},
        {"eval_path": ev, "eval_row": 6, "eval_dataset": "ai2ref",
         "reason": "field 'eval_key' (--eval-dataset-field): empty"}]
    warning = [line for line in err.splitlines() if "eval_bad_rows.jsonl" in line]
    assert len(warning) == 1 and f"{ev} row 5: no field 'eval_key'" in warning[0], err

    # the same data and output without the flag: one dataset, its file's, every row used; the list of bad
    # rows of the run before is gone (a different index: the field is in its stage's hash)
    assert run_cli(["--eval", ev, "--train", tr, "--output", out, "--ngrams", "8", "--partitions", "2",
                    "--eval-text-template", "{question}"]) == 0
    plain = read_jsonl(os.path.join(out, "stats/overlap_stats.jsonl"))
    assert [(s["eval_dataset"], s["num_instances"], len(s["instance_ids"])) for s in plain] == [("ai2ref", 7, 2)]
    assert not os.path.exists(os.path.join(out, "stats/eval_bad_rows.jsonl"))
    assert "eval_bad_rows" not in capsys.readouterr().err


def test_no_row_with_the_field_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ev = write_jsonl(tmp_path / "gsm8k" / "test.jsonl", [{"question": q} for q in GSM8K])
    tr = write_jsonl(tmp_path / "train" / "train.jsonl", [{"text": GSM8K[0]}])
    out = tmp_path / "out"
    assert run_cli(["--eval", ev, "--train", tr, "--output", str(out), "--eval-dataset-field", "eval_key",
                    "--eval-text-field", "question"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "--eval-dataset-field 'eval_key'" in err and ev in err and "question" in err  # the fields rows have
    assert not (out / ".SUCCESS").exists()


@pytest.mark.parametrize("record, named, reason", [
    ({"k": "gsm8k"}, "gsm8k", None),
    ({"k": "mmlu_pro-v2.1 test"}, "mmlu_pro-v2.1 test", None),
    ({"x": "gsm8k"}, None, "no field 'k'"),
    ({"k": None}, None, "is NoneType, not a string"),
    ({"k": 3}, None, "is int, not a string"),
    ({"k": ""}, None, "empty"),
    ({"k": "a/b"}, None, "has '/'"),
    ({"k": ".."}, None, "not a name"),
    ({"k": "x\ny"}, None, "has '\\n'"),
    ({"k": " x"}, None, "begins or ends with a space"),
])
def test_field_dataset(record: dict[str, None] | dict[str, int] | dict[str, str], named: str | None,
                       reason: str | None) -> None:
    got, why = field_dataset(record, "k")
    assert got == named
    assert (why is None) == (reason is None) and (reason is None or reason in str(why)), why


def test_dataset_names_from_paths_are_names() -> None:
    """The rule a row's name is held to is the one the path names already follow."""
    for path in ["decontamination/gsm8k-dolma-3fa9c1/test.jsonl", "x/mmlu/test.parquet", "a/b/c.jsonl.zst"]:
        assert dataset_name_problem(ng.eval_dataset_name(path)) is None


def test_make_eval_rows_names_datasets_by_field_and_lists_bad_rows() -> None:
    rows_of = {"x/ref/eval.jsonl": [(i, r, None) for i, r in enumerate(ai2_rows())]
               + [(7, None, "row over --max-row-bytes"), (8, {"eval_key": "drop", "passage": "p"}, None)]}
    rows, bad = make_eval_rows(list(rows_of), rows_of.__getitem__, "question", "id", ng.TOKENIZERS["default"],
                               dataset_field="eval_key")
    assert [(r.eval_dataset, r.eval_row) for r in rows] == [("gsm8k", 0), ("gsm8k", 1), ("gsm8k", 2),
                                                            ("drop", 3), ("drop", 4)]
    assert [r.eval_idx for r in rows] == list(range(5))
    assert {ds: c["bad_rows"] for ds, c in bad.items()} == {"gsm8k": 0, "drop": 1, "ref": 3}
    assert [(r["eval_row"], r["eval_dataset"], r["reason"]) for r in bad_row_reasons(bad)] == [
        (5, "ref", "no field 'eval_key' (--eval-dataset-field)"),
        (6, "ref", "field 'eval_key' (--eval-dataset-field): empty"),
        (7, "ref", "row over --max-row-bytes"),
        (8, "drop", "missing text field 'question'")]
    warning = bad_rows_warning(bad)
    assert warning is not None and warning.startswith("4 eval row(s) left out") and "x/ref/eval.jsonl row 8" in warning
    # without the field: every dataset its file's, and the counts as before (no reasons listed)
    rows, bad = make_eval_rows(list(rows_of), rows_of.__getitem__, "question", "id", ng.TOKENIZERS["default"])
    assert {r.eval_dataset for r in rows} == {"ref"} and len(rows) == 7
    assert bad == {"ref": {"bad_rows": 2}} and bad_rows_warning(bad) is None


def test_the_field_enters_the_index_hash_only_when_given() -> None:
    def config(field: str | None) -> dict[str, Any]:
        return dict(IndexStage(DeconSettings(["e"], ["t"], [13], eval_dataset_field=field), []).config().settings)

    assert "dataset_field" not in config(None)  # outputs made before the flag keep their hashes
    assert config("eval_key")["dataset_field"] == "eval_key"
    assert config("eval_key") != config("benchmark")
