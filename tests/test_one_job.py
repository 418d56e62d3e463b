"""One Beam pipeline per command, and the command's flow as one composite for a user's pipeline.

- Each command runs exactly one ``beam.Pipeline`` (counted by wrapping ``Pipeline.run``),
  whose top-level steps are its stages, with every unit of every stage inside.
- A failed unit blocks the steps after it inside that one job: nothing downstream runs,
  the command exits 1 naming it, and a rerun runs only what was left.
- ``PrepPipeline`` / ``DeconPipeline`` in a user's own pipeline write the same bytes as
  ``refinery prep`` / ``refinery decon``, and each resumes the other.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import apache_beam as beam
import pytest
from apache_beam.runners.runner import PipelineResult
from helpers import gsm8k_texts, run_prep, tree_digest, write_jsonl

from refinery.runners.translate import runner_api, step_names

DIRECT = ["--runner=DirectRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1"]


@pytest.fixture
def pipelines_run(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The step names of every Beam pipeline run in this process, in order."""
    runs: list[list[str]] = []
    real = beam.Pipeline.run

    def counted(self: beam.Pipeline, *args: Any, **kwargs: Any) -> PipelineResult:
        runs.append(step_names(self.to_runner_api()))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(beam.Pipeline, "run", counted)
    return runs


def _decon_inputs(root: Path) -> tuple[Path, Path]:
    evals = write_jsonl(root / "eval" / "gsm8k" / "test.jsonl",
                        [{"id": f"e{i}", "text": t} for i, t in enumerate(gsm8k_texts(6))])
    train = write_jsonl(root / "train" / "t.jsonl",
                        [{"id": f"t{i}", "text": t} for i, t in enumerate(gsm8k_texts(30, offset=3))])
    return evals.parent.parent, train.parent


def _decon(inputs: tuple[Path, Path], out: Path, runner: str = "direct", *extra: str) -> int:
    from refinery.beam_pipelines.cli import main

    evals, train = inputs
    return main(["decon", "--eval", str(evals), "--train", str(train), "--output", str(out), "--ngrams", "8",
                 "--runner", runner, "--no-progress", *map(str, extra)])


def test_prep_and_decon_are_one_pipeline_each_on_the_local_runner(
        small_corpus: Path, tmp_path: Path, pipelines_run: list[list[str]]) -> None:
    assert run_prep([small_corpus], tmp_path / "prep", "--num-shards", 3, "--unit-mb", 0, runner="local") == 0
    assert pipelines_run == [["Tokenize units", "Pack shards", "Write manifest"]]
    receipts = list((tmp_path / "prep" / ".refinery").glob("*/*/receipts/*.json"))
    assert len(receipts) == 2 + 3 + 1  # every unit of every stage ran inside that one job

    pipelines_run.clear()
    assert _decon(_decon_inputs(tmp_path), tmp_path / "decon", "local") == 0
    assert pipelines_run == [["Read eval sets", "Index eval sets", "Scan training data", "Reduce partitions",
                              "Merge reports"]]

    pipelines_run.clear()  # a rerun with everything done runs no job at all
    assert run_prep([small_corpus], tmp_path / "prep", "--num-shards", 3, "--unit-mb", 0, runner="local") == 0
    assert pipelines_run == []


def test_a_failed_unit_blocks_the_steps_after_it_in_the_same_job(
        small_corpus: Path, tmp_path: Path, pipelines_run: list[list[str]], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One tokenize unit fails inside the job: pack and manifest run none of their units
    (no receipt), the command exits 1 naming the unit; the rerun runs that unit and the
    stages after it, and no other tokenize unit."""
    from refinery.transforms.prep.stages import check_unchanged as real
    from refinery.transforms.prep.stages import tokenize as prep_tokenize  # where a tokenize unit checks

    log = tmp_path / "units.log"
    monkeypatch.setenv("REFINERY_UNIT_LOG", str(log))
    out = tmp_path / "out"

    def mount_gone(piece: Mapping[str, Any]) -> None:
        if piece["path"].endswith("y.jsonl"):
            raise OSError(f"{piece['path']}: injected: the mount went away")
        return real(piece)

    monkeypatch.setattr(prep_tokenize, "check_unchanged", mount_gone)
    assert run_prep([small_corpus], out, "--num-shards", 3, "--unit-mb", 0) == 1
    monkeypatch.setattr(prep_tokenize, "check_unchanged", real)
    err = capsys.readouterr().err
    assert "stage tokenize: 1 unit(s) not completed" in err and "injected: the mount went away" in err
    assert pipelines_run == [["Tokenize units", "Pack shards", "Write manifest"]]
    meta = out / ".refinery"
    assert not list(meta.glob("pack/*/receipts/*.json")) and not list(meta.glob("manifest/*/receipts/*.json"))
    assert not (out / "manifest.json").exists()

    first = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted(e["stage"] for e in first if e["event"] == "start") == ["tokenize", "tokenize"]
    [failed_unit] = [e["unit"] for e in first if e["event"] == "end-failed"]
    pipelines_run.clear()
    assert run_prep([small_corpus], out, "--num-shards", 3, "--unit-mb", 0) == 0
    assert pipelines_run == [["Tokenize units", "Pack shards", "Write manifest"]]
    again = [json.loads(line) for line in log.read_text().splitlines()][len(first):]
    started = sorted((e["stage"], e["unit"]) for e in again if e["event"] == "start")
    assert started == [("manifest", "manifest"), ("pack", "0000"), ("pack", "0001"), ("pack", "0002"),
                       ("tokenize", failed_unit)]
    ref = tmp_path / "ref"
    assert run_prep([small_corpus], ref, "--num-shards", 3, "--unit-mb", 0) == 0
    assert tree_digest(out) == tree_digest(ref)


def test_prep_pipeline_in_a_users_pipeline_writes_what_the_command_writes(
        small_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from refinery.transforms.io import storage
    from refinery.transforms.prep import PrepPipeline
    from refinery.transforms.prep.stages import PrepConfig

    out = tmp_path / "mine"
    cfg = PrepConfig(inputs=storage.expand_inputs([str(small_corpus)]), output=str(out), dataset="small", num_shards=3,
                     unit_bytes=0)
    with beam.Pipeline(options=beam.options.pipeline_options.PipelineOptions(DIRECT)) as p:
        done = p | PrepPipeline(cfg)
        assert step_names(runner_api(p)) == ["PrepPipeline"]
        _ = done | beam.Map(lambda r: r)  # the manifest step's results: a user can go on from them
    ref = tmp_path / "ref"
    assert run_prep([small_corpus], ref, "--num-shards", 3, "--unit-mb", 0) == 0
    assert tree_digest(out) == tree_digest(ref) and (out / "manifest.json").exists()
    # the command resumes from the composite's receipts: nothing left to run
    log = tmp_path / "units.log"
    monkeypatch.setenv("REFINERY_UNIT_LOG", str(log))
    assert run_prep([small_corpus], out, "--num-shards", 3, "--unit-mb", 0) == 0
    assert "units run: nothing (all units already done)" in capsys.readouterr().out
    events = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    assert [e for e in events if e["event"] != "phase"] == []  # the planner found every receipt valid: no unit ran


def test_decon_pipeline_in_a_users_pipeline_writes_what_the_command_writes(tmp_path: Path) -> None:
    from refinery.beam_pipelines import decon
    from refinery.transforms.decon import DeconPipeline

    out = tmp_path / "mine"
    evals, train = _decon_inputs(tmp_path)
    args = decon.build_parser().parse_args(["--eval", str(evals), "--train", str(train), "--output", str(out),
                                            "--ngrams", "8"])
    settings = decon.settings_from_args(args)
    with beam.Pipeline(options=beam.options.pipeline_options.PipelineOptions(DIRECT)) as p:
        _ = p | DeconPipeline(settings, str(out))
    ref = tmp_path / "ref"
    assert _decon((evals, train), ref) == 0
    assert tree_digest(out) == tree_digest(ref) and (out / "stats" / "overlap_stats.jsonl").exists()
