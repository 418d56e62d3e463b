"""A command's Beam job does not grow with the corpus: the driver writes each stage's plan,
and the units each step runs, into the output (``core.plans``); the job carries where they
are, and its DoFns carry configuration, not input lists, plans or drop-list rows."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from helpers import run_prep, tree_digest, write_jsonl

from refinery.beam_pipelines.cli import main
from refinery.runners.translate import command_pipeline, runner_api
from refinery.transforms.io import storage
from refinery.transforms.prep.stages import PrepConfig, build_stages
from refinery.transforms.resumable import Unit, bind_stages, unit_lists, write_plans


def _files(root: Path, n: int) -> Path:
    for i in range(n):
        write_jsonl(root / f"{i // 100:03d}" / f"f{i:05d}.jsonl", [{"id": f"d{i}", "text": f"document {i}"}])
    return root


def _prep_proto_bytes(folder: Path, out: Path) -> int:
    cfg = PrepConfig(inputs=storage.expand_inputs([str(folder)]), output=str(out), dataset="s", num_shards=4,
                     unit_bytes=2000)
    pipeline = command_pipeline(build_stages(cfg), str(out), ["--runner=DirectRunner"])
    assert pipeline is not None  # the plan has units
    return len(runner_api(pipeline).SerializeToString())


def test_the_prep_job_is_the_same_size_for_10x_the_files(tmp_path: Path) -> None:
    small = _prep_proto_bytes(_files(tmp_path / "small", 100), tmp_path / "o1")
    big = _prep_proto_bytes(_files(tmp_path / "big", 1000), tmp_path / "o2")
    assert big < 1.02 * small, (small, big)  # grows by the digits of counts, not per file


def test_a_worker_reads_the_plan_from_the_output_and_carries_no_input_list(tmp_path: Path) -> None:
    folder = _files(tmp_path / "in", 30)
    out = str(tmp_path / "out")
    cfg = PrepConfig(inputs=storage.expand_inputs([str(folder)]), output=out, dataset="s", num_shards=2,
                     unit_bytes=200)
    runs = bind_stages(build_stages(cfg), out)
    tokenize = runs[0]
    want = tokenize.stage.plan()
    assert len(want) > 1
    worker = pickle.loads(pickle.dumps(tokenize))
    assert worker.stage.cfg.inputs is None and worker.stage.cfg.num_inputs == 30 and worker.stage._units is None
    with pytest.raises(ValueError, match="missing .the plan written by the driver"):
        worker.stage.plan()
    write_plans(runs, [])
    worker = pickle.loads(pickle.dumps(tokenize))
    assert worker.stage.plan() == want


def test_plan_parts_are_written_once_and_a_lost_or_cut_part_again(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _files(tmp_path / "in", 40)
    out = tmp_path / "out"
    assert run_prep([folder], out, "--num-shards", 2, "--unit-mb", 0.0005) == 0
    first = tree_digest(out)
    (part,) = out.glob(".refinery/tokenize/*/plan/part-00000.jsonl")
    units = [json.loads(line) for line in part.read_text().splitlines()]
    assert len(units) > 1 and all(isinstance(uid, str) and "pieces" in payload for uid, payload in units)
    ref = unit_lists.PlanRef(str(part.parent), len(units))
    assert unit_lists.write_units(ref, [Unit(uid, payload) for uid, payload in units])[1] == 0  # already there

    # a unit lost, and its plan part cut: the next run writes the part again and redoes the unit
    part.write_text(part.read_text()[:-20])
    next(out.glob(".refinery/pack/*/receipts/0001.json")).unlink()
    next(out.glob("shard_0001/*.npy")).unlink()
    assert run_prep([folder], out, "--num-shards", 2, "--unit-mb", 0.0005) == 0
    assert [json.loads(line) for line in part.read_text().splitlines()] == units
    assert tree_digest(out) == first


def test_the_dry_run_says_how_big_the_job_is(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _files(tmp_path / "in", 20)
    capsys.readouterr()
    assert main(["prep", "--input", str(folder), "--output", str(tmp_path / "out"), "--dry-run"]) == 0
    said = capsys.readouterr().out
    assert "job size: 0.0" in said and "MB (its runner-API proto" in said
    assert not (tmp_path / "out").exists()
