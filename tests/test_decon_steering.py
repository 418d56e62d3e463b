"""Steering decon at a low n (issue 61, item 3).

At ``--ngrams 8`` boilerplate an eval question shares with many training rows ("what was the
original price of the item before the discount", in 150 training rows here) filled the drop
list, and nothing said so: no n-gram was named, nothing suggested ``--max-train-count``, and
there was no rule "exclude a row only for instances mostly covered". Now:

- decon's console summary and ``report.md`` name the n-grams that hit more than a tenth of the
  training rows overlapping at their n, with the ``--max-train-count K`` that ignores exactly
  them (and a rerun with that K lists only the rows behind the other n-grams);
- each drop-list line names, per n, the largest coverage (HELM's token metric) of the
  instances its row overlaps (drop list 4), checked here against ``overlap_metrics.jsonl``
  and the detail records;
- ``prep --exclude-overlaps`` and ``clean`` take ``--exclude-min-coverage F``: a listed row is
  left out only for instances with at least F of their tokens overlapping; the rows kept are
  counted in the summary and the manifest, F enters the stage hash, and a drop list older
  than 4 is refused in one line.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from helpers import gsm8k_rows, gsm8k_texts, write_jsonl

from refinery.beam_pipelines.cli import main
from refinery.transforms.decon.ngrams.details import read_details
from refinery.transforms.formats.droplist import ReadSpec
from refinery.transforms.io import storage
from refinery.transforms.io.rows import DEFAULT_MAX_ROW_BYTES
from refinery.transforms.io.text import TEXT_NORMALIZATION
from refinery.transforms.prep import exclusion

BOILER = "What was the original price of the item before the discount?"
BOILER_ROWS = 150
SPEC = ReadSpec({"text_field": "text"}, TEXT_NORMALIZATION, DEFAULT_MAX_ROW_BYTES)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The corpus, and decon of it at n = 8 and 13: three eval questions, one opening with the
    boilerplate (which 150 training rows end with), one copied whole into two training rows."""
    root = tmp_path_factory.mktemp("steer")
    test = gsm8k_rows("test")
    boiler_q = f"{BOILER} {test[5]['question']} {test[6]['question']}"  # the boilerplate covers little of it
    write_jsonl(root / "eval/bench/test.jsonl", [{"id": "q-boiler", "text": boiler_q},
                                                 {"id": "q-leak", "text": test[0]["question"]},
                                                 {"id": "q-clean", "text": test[1]["question"]}])
    texts = gsm8k_texts(BOILER_ROWS + 20)
    rows = [{"id": f"b{i}", "text": f"{t}\n\n{BOILER}"} for i, t in enumerate(texts[:BOILER_ROWS])]
    rows += [{"id": f"leak{i}", "text": f"Copied: {test[0]['question']}"} for i in range(2)]
    rows += [{"id": f"p{i}", "text": t} for i, t in enumerate(texts[BOILER_ROWS:])]
    write_jsonl(root / "train/t.jsonl", rows)
    out = root / "decon"
    assert main(["decon", "--eval", str(root / "eval"), "--train", str(root / "train"), "--output", str(out),
                 "--ngrams", "8", "13", "--runner", "direct", "--no-progress"]) == 0
    return {"root": root, "train": root / "train", "decon": out}


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_summary_and_the_report_name_the_boilerplate_and_a_max_train_count(
        runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = runs["decon"]
    drop = _jsonl(out / "stats/contaminated_train_docs.jsonl")
    assert sum(8 in d["ns"] for d in drop) == BOILER_ROWS + 2  # the boilerplate rows fill the drop list at 8
    receipt = json.loads(next((out / ".refinery/merge").glob("*/receipts/merge.json")).read_text())
    steer = receipt["stats"]["steering"]
    assert [h[2:4] for h in steer["heavy"]] == [[BOILER_ROWS, 1]] * 4  # each in 150 training rows, 1 eval row
    assert {h[0] for h in steer["heavy"]} == {8} and all("original price" in h[1] for h in steer["heavy"])
    k = steer["max_train_count"]
    assert k == BOILER_ROWS - 1 and steer["heavy_total"] == 4  # the 4 8-grams of the 11-token phrase
    report = (out / "stats/report.md").read_text()
    assert f"rerun decon with --max-train-count {k}" in report and "what was the original price" in report
    # the console says the same (the summary is made from the receipt: a rerun of the finished run prints it)
    assert main(["decon", "--eval", str(runs["root"] / "eval"), "--train", str(runs["train"]), "--output", str(out),
                 "--ngrams", "8", "13", "--runner", "direct", "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert "4 n-gram(s) hit more than 10% of the training rows overlapping at their n" in said
    assert f'"what was the original price of the item" (n = 8: {BOILER_ROWS} training rows' in said
    assert f"rerun decon with --max-train-count {k} (it ignores the n-grams in more than {k} training rows: " \
           "4 at n = 8, 0 at n = 13)" in said
    # ... and that K does what it says: only the rows behind the other n-grams are listed
    again = tmp_path / "k"
    assert main(["decon", "--eval", str(runs["root"] / "eval"), "--train", str(runs["train"]), "--output",
                 str(again), "--ngrams", "8", "13", "--max-train-count", str(k), "--runner", "direct",
                 "--no-progress"]) == 0
    assert [d["train_doc_id"] for d in _jsonl(again / "stats/contaminated_train_docs.jsonl")] == ["leak0", "leak1"]
    assert "n-gram(s) hit more than" not in capsys.readouterr().out


def test_each_drop_list_line_names_the_largest_coverage_of_its_instances(runs: dict[str, Path]) -> None:
    out = runs["decon"]
    coverage = {(m["instance_id"], m["n"]): m["coverage"] for m in _jsonl(out / "stats/overlap_metrics.jsonl")}
    overlapped: dict[tuple[str, int], dict[int, set[str]]] = {}
    for d in read_details(str(out)):
        overlapped.setdefault((d["train_path"], d["train_row"]), {}).setdefault(d["n"], set()).add(d["instance_id"])
    drop = _jsonl(out / "stats/contaminated_train_docs.jsonl")
    assert len(drop) == len(overlapped) == BOILER_ROWS + 2
    for d in drop:
        by_n = overlapped[(d["train_path"], d["train_row"])]
        assert d["ns"] == sorted(by_n)
        assert d["max_coverage"] == [max(coverage[(i, n)] for i in by_n[n]) for n in d["ns"]]
    boiler, leak = coverage[("q-boiler", 8)], coverage[("q-leak", 8)]
    assert 0 < boiler < 0.5 and leak == 1.0


def test_exclude_min_coverage_keeps_rows_whose_instances_are_covered_less_and_says_so(
        runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    decon, train = str(runs["decon"]), str(runs["train"])
    out = tmp_path / "prep"
    assert main(["prep", "--input", train, "--output", str(out), "--exclude-overlaps", decon, "--exclude-n", "8",
                 "--exclude-min-coverage", "0.5", "--runner", "direct", "--no-progress"]) == 0
    said = capsys.readouterr()
    assert "rows: read 172 = accepted 170 + empty 0 + rejected 0 + excluded 2" in said.out
    assert (f"kept {BOILER_ROWS} listed row(s): every instance they overlap at n has under 0.5 of its tokens "
            "overlapping (--exclude-min-coverage;") in said.out
    assert "for instances with at least 0.5 of their tokens overlapping (--exclude-min-coverage; " \
           f"{BOILER_ROWS} more listed row(s) kept)" in said.err
    run, = json.loads((out / "manifest.json").read_text())["excluded_overlaps"]["decon_runs"]
    assert run["min_coverage"] == 0.5 and run["kept_below_min_coverage"] == BOILER_ROWS and run["listed"] == 2
    # F is in the hash like every other rule; without it the identity is as before
    at = {f: exclusion.load_exclusion([decon], 8, read_spec=SPEC, min_coverage=f) for f in (None, 0.5, 0.1)}
    assert "min_coverage" not in at[None].identity()[0] and at[0.5].identity()[0]["min_coverage"] == 0.5
    assert len({json.dumps(e.identity()) for e in at.values()}) == 3
    assert sum(len(r) for r in (at[0.1].rows or {}).values()) == BOILER_ROWS + 2  # 0.1 is under the boilerplate's
    # clean, span mode: the rows kept are copied byte for byte, only the leaks are cut
    copy = tmp_path / "copy"
    assert main(["clean", "--train", train, "--output", str(copy), "--exclude-overlaps", decon, "--exclude-n", "8",
                 "--exclude-min-coverage", "0.5", "--exclude-mode", "span", "--exclude-min-chars", "5",
                 "--runner", "direct", "--no-progress"]) == 0
    assert f"kept {BOILER_ROWS} listed row(s)" in capsys.readouterr().out
    lines = (runs["train"] / "t.jsonl").read_text().splitlines()
    kept = (copy / "t.jsonl").read_text().splitlines()
    assert kept[:BOILER_ROWS] == lines[:BOILER_ROWS] and not any("leak" in line for line in kept)


def test_a_drop_list_older_than_coverage_and_a_bad_f_are_refused(
        runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = tmp_path / "old"
    shutil.copytree(runs["decon"], old)
    record = json.loads((old / ".refinery/run.json").read_text())
    record["stages"][-1]["config"]["drop_list"] = 3  # as a decon of drop list 3 recorded it
    (old / ".refinery/run.json").write_text(json.dumps(record))
    base = ["prep", "--input", str(runs["train"]), "--output", str(tmp_path / "p"), "--runner", "direct"]
    assert main([*base, "--exclude-overlaps", str(old), "--exclude-min-coverage", "0.5"]) == 2
    assert f"--exclude-min-coverage: the decon run {old} wrote drop list 3" in capsys.readouterr().err
    with pytest.raises(storage.InputError, match="wrote drop list 3, whose lines do not name their instances' "
                                                 "coverage .drop list 4 does.: run the same decon command again"):
        exclusion.load_exclusion([str(old)], 8, read_spec=SPEC, min_coverage=0.5)
    assert exclusion.load_exclusion([str(old)], 8, read_spec=SPEC).sources[0].listed == BOILER_ROWS + 2  # without F
    for f in ("1.5", "-0.1", "nan"):
        assert main([*base, "--exclude-overlaps", str(runs["decon"]), "--exclude-min-coverage", f]) == 2
        assert f"--exclude-min-coverage {f}: a share of an instance's tokens, from 0 to 1" in capsys.readouterr().err
    assert main([*base, "--exclude-min-coverage", "0.5"]) == 2
    assert "--exclude-min-coverage needs --exclude-overlaps DECON_OUTPUT" in capsys.readouterr().err
