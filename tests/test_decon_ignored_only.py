"""``--max-train-count`` never hides a contaminated instance in silence (issue 58, item 6).

One test question copied into 40 training rows with ``--max-train-count 3``: its n-grams are
each in more than 3 training documents, so they are ignored and the drop list is empty (what
the limit is for: boilerplate). Before, nothing but ``report.md``'s count of ignored n-grams
said so, and ``prep --exclude-overlaps`` kept all 40 rows. Now the console, the stats line of
its dataset and n, and the report name the instance.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import gsm8k_rows, gsm8k_texts, write_jsonl

from refinery.beam_pipelines import cli


def _run(tmp_path: Path, *extra: str) -> Path:
    question = gsm8k_rows("test")[0]["question"]
    other = gsm8k_rows("test")[1]["question"]
    write_jsonl(tmp_path / "eval/gsm8k/test.jsonl", [{"id": "q-copied", "text": question},
                                                     {"id": "q-once", "text": other},
                                                     {"id": "q-clean", "text": gsm8k_rows("test")[2]["question"]}])
    rows = [{"text": f"Copy {i}. {question} Done."} for i in range(40)]
    rows += [{"text": f"Once: {other}"}] + [{"text": t} for t in gsm8k_texts(20)]
    write_jsonl(tmp_path / "train/t.jsonl", rows)
    out = tmp_path / f"out{len(extra)}"
    assert cli.main(["decon", "--eval", str(tmp_path / "eval"), "--train", str(tmp_path / "train"), "--output",
                     str(out), "--ngrams", "13", "--runner", "direct", "--no-progress", *extra]) == 0
    return out


def _stats(out: Path) -> dict[str, object]:
    line, = [json.loads(x) for x in (out / "stats/overlap_stats.jsonl").read_text().splitlines()]
    assert isinstance(line, dict)
    return line


def test_an_instance_only_ignored_n_grams_overlap_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(tmp_path, "--max-train-count", "3")
    said = capsys.readouterr().err
    stats = _stats(out)
    assert stats["instance_ids"] == ["q-once"]  # the copied question is not contaminated at n: its grams are ignored
    assert stats["instance_ids_ignored_only"] == ["q-copied"] and stats["num_instances_ignored_only"] == 1
    drop = [json.loads(x) for x in (out / "stats/contaminated_train_docs.jsonl").read_text().splitlines()]
    assert [d["train_row"] for d in drop] == [40]  # "Once: ...": the 40 copies are not listed
    assert "WARNING refinery decon: instances that overlap training rows only through n-grams ignored by " \
           "--max-train-count 3" in said
    assert "gsm8k at n = 13: 1 (q-copied)" in said
    report = (out / "stats/report.md").read_text()
    assert "gsm8k at n = 13: 1 instance(s) overlap the training data only through ignored n-grams" in report
    assert "q-copied" in report


def test_without_the_limit_the_stats_are_as_before(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(tmp_path)
    stats = _stats(out)
    assert stats["instance_ids"] == ["q-copied", "q-once"]
    assert "instance_ids_ignored_only" not in stats and "num_instances_ignored_only" not in stats
    assert "ignored by --max-train-count" not in capsys.readouterr().err
