"""Failures inside a run: Beam bundle retries, and units that fail and are retried next run.

- Bundle retries: the real ``RunUnit`` DoFn, made to fail on the first attempt of some
  units (before the unit, or after its receipt was written: a worker lost mid-bundle), on
  Beam's ``BundleBasedDirectRunner``, which retries failed bundles. The outputs equal an
  uninterrupted run's and no unit runs twice after its receipt was written.
- A unit that raises gets a ``failed`` receipt with the error type and message; the job
  exits 1 naming it; the next run retries only that unit.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, TypeVar

import pytest
from apache_beam.typehints.decorators import no_annotations
from helpers import run_prep
from reliability_helpers import final_digest, make_corpus, read_unit_log, recomputed_units, write_figures

from refinery.transforms import resumable as stages
from refinery.transforms.io import storage
from refinery.transforms.prep.stages import PrepConfig, build_stages
from refinery.transforms.resumable import StageFailed, StageRun, Unit, run_stages
from refinery.transforms.resumable.beam_steps import UnitResult
from refinery.transforms.resumable.orchestration import Runner
from refinery.transforms.resumable.planner import Step


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("retries")
    corpus = make_corpus(root / "corpus", files=4, docs_per_file=40)
    ref = root / "ref"
    assert run_prep([corpus], ref, "--num-shards", 3, "--dataset", "r", "--unit-mb", 0) == 0
    return corpus, final_digest(ref)


def _config(corpus: Path, out: Path) -> PrepConfig:
    return PrepConfig(inputs=storage.expand_inputs([str(corpus)]), output=str(out), dataset="r", num_shards=3,
                      unit_bytes=0)


_F = TypeVar("_F", bound=Callable[..., Any])


def _annotations_for_mypy_only(fn: _F) -> _F:
    """Beam turns a DoFn's annotations into runtime type checks: these are for mypy only (as
    RunUnitFn's own are)."""
    no_annotations(fn)
    return fn


def _flaky_runner(attempts_dir: Path, fail_before: set[str], fail_after: set[str]) -> Runner:
    """A step runner: the command's one pipeline, whose units run in the real RunUnitFn
    failing once where told, on BundleBasedDirectRunner (which retries a failed bundle up to
    4 times)."""
    from refinery.transforms.resumable import beam_steps as pipeline

    class FlakyRunUnitFn(pipeline.RunUnitFn):
        @_annotations_for_mypy_only
        def process(self, element: tuple[str, Mapping[str, Any]], upstream: Iterable[UnitResult] = (),
                    **side: Any) -> Iterator[UnitResult]:
            key = f"{self.run.name}-{element[0]}"
            marker = attempts_dir / key
            first = not marker.exists()
            with open(marker, "a") as f:
                f.write("attempt\n")
            if first and key in fail_before:
                raise ConnectionError(f"injected: worker lost before unit {key}")
            out = list(super().process(element, upstream, **side))
            if first and key in fail_after:
                raise ConnectionError(f"injected: worker lost after the receipt of {key}")
            yield from out

    def runner(steps: list[Step], beam_args: list[str], verify_checksums: bool) -> dict[str, int]:
        built = pipeline.build_pipeline(steps, ["--runner=BundleBasedDirectRunner"], verify_checksums, FlakyRunUnitFn)
        return pipeline.run_pipeline(built)

    return runner


def test_beam_bundle_retries_give_the_same_outputs(
        reference: tuple[Path, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    corpus, want = reference
    out, attempts = tmp_path / "out", tmp_path / "attempts"
    attempts.mkdir()
    log = tmp_path / "units.log"
    monkeypatch.setenv("REFINERY_UNIT_LOG", str(log))
    fail_before, fail_after = {"tokenize-00001", "pack-0000"}, {"tokenize-00002", "pack-0002"}
    run_stages(build_stages(_config(corpus, out)), str(out), [], progress=False,
               runner=_flaky_runner(attempts, fail_before, fail_after))
    assert final_digest(out) == want
    retried = {p.name for p in attempts.iterdir() if len(p.read_text().splitlines()) > 1}
    assert fail_before | fail_after <= retried  # Beam did retry those bundles
    events = read_unit_log(log)
    assert recomputed_units(events) == []
    skipped = {f"{e['stage']}-{e['unit']}" for e in events if e["event"] == "skip"}
    assert fail_after <= skipped  # the retry found the receipt and did not redo the unit
    write_figures("bundle_retries", {"injected_failures": len(fail_before | fail_after),
                                     "bundles_retried": len(retried)})


def test_failed_unit_is_recorded_and_retried_next_run(
        reference: tuple[Path, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    corpus, want = reference
    work = tmp_path / "corpus"
    shutil.copytree(corpus, work)  # copytree keeps mtimes: same fingerprints, paths differ
    victim = work / "part-02.jsonl"
    st = os.stat(victim)
    hidden = tmp_path / "hidden.jsonl"
    out = tmp_path / "out"
    log = tmp_path / "units.log"
    monkeypatch.setenv("REFINERY_UNIT_LOG", str(log))

    def vanish(runs: list[StageRun], plans: list[list[Unit[Mapping[str, Any]]]]) -> None:
        # the input disappears after planning (a flaky mount)
        os.replace(victim, hidden)

    with pytest.raises(StageFailed) as e:
        run_stages(build_stages(_config(work, out)), str(out), ["--runner=DirectRunner"], progress=False,
                   on_plan=vanish)
    assert "00002" in str(e.value) and "InputError" in str(e.value)
    run = json.loads((out / ".refinery/run.json").read_text())
    receipts = out / ".refinery" / "tokenize" / run["stages"][0]["stage_hash"] / "receipts"
    failed = json.loads((receipts / "00002.json").read_text())
    assert failed["status"] == "failed" and failed["error"]["type"] == "InputError"
    assert "no such file" in failed["error"]["message"]
    assert "part-02.jsonl" in failed["error"]["message"] and failed["error"]["traceback"]
    assert sorted(json.loads(p.read_text())["status"] for p in receipts.glob("*.json")) == \
        ["completed", "completed", "completed", "failed"]

    os.replace(hidden, victim)
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))  # the same file again: the same plan
    mark = len(read_unit_log(log))
    assert run_prep([work], out, "--num-shards", 3, "--dataset", "r", "--unit-mb", 0) == 0
    started = [(e["stage"], e["unit"]) for e in read_unit_log(log)[mark:] if e["event"] == "start"]
    assert [u for u in started if u[0] == "tokenize"] == [("tokenize", "00002")]
    # the shards are identical; rejects.jsonl, the manifest's plan hash and the shards'
    # provenance sidecars (.docs.parquet) name the input paths, which differ here (a copy of the corpus)
    def shards(d: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in d.items() if k.startswith("shard_") and not k.endswith(".docs.parquet")}
    assert shards(final_digest(out)) == shards(want) and len(shards(want)) == 6


def test_beam_counters_come_back_equal_to_the_receipts(reference: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    corpus, want = reference
    out = tmp_path / "out"
    result = run_stages(build_stages(_config(corpus, out)), str(out),
                        ["--runner=DirectRunner", "--direct_running_mode=in_memory"], progress=False)
    assert final_digest(out) == want
    tokenize, pack = result.metrics["tokenize"], result.metrics["pack"]
    receipts = [json.loads(p.read_text()) for p in (out / ".refinery" / "tokenize").glob("*/receipts/*.json")]
    assert tokenize["tokenize_units_completed"] == len(receipts) == 4
    assert tokenize["tokenize_tokens"] == sum(r["stats"]["tokens"] for r in receipts) > 0
    assert tokenize["tokenize_accepted"] == sum(r["stats"]["accepted"] for r in receipts) == 160
    assert pack["pack_units_completed"] == 3 and pack["pack_docs"] == 160
    assert result.metrics["manifest"]["manifest_units_completed"] == 1  # a step of the same job


def test_a_failed_beam_job_is_one_error_and_keeps_finished_units(
        reference: tuple[Path, dict[str, str]], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import contextlib

    from refinery import runners
    from refinery.beam_pipelines import command

    # the "cluster" here is the fake runner below: no Flink job server is started for it
    monkeypatch.setattr(runners, "job_service", contextlib.nullcontext)

    corpus, want = reference
    out = tmp_path / "out"

    def lost_cluster(steps: list[Step], beam_args: list[str], verify_checksums: bool) -> None:
        # the job's tokenize step ran; then the job dies with its cluster
        stages.run_in_driver([s for s in steps if s.run.name == "tokenize"], beam_args, verify_checksums)
        raise RuntimeError("Pipeline BeamApp-x failed in state FAILED: java.lang.Exception: "
                           "TaskManager lost\n\tat org.apache.flink...")

    with pytest.raises(stages.JobFailed, match=r"^stage pack: the Beam job failed: RuntimeError: Pipeline BeamApp-x "
                                               r"failed in state FAILED: java.lang.Exception: TaskManager lost$"):
        run_stages(build_stages(_config(corpus, out)), str(out), [], progress=False, runner=lost_cluster)
    assert len(list((out / ".refinery" / "tokenize").glob("*/receipts/*.json"))) == 4  # kept

    # the rerun hint repeats the command line: give the one a user typed, not pytest's own
    monkeypatch.setattr(sys, "argv", ["refinery", "prep", "--input", str(corpus), "--output", str(out), "--force"])
    p = command.Pipeline("prep", str(out), build_stages(_config(corpus, out)), runner=lost_cluster)
    assert command.run_and_report(p, command.RunFlags(no_progress=True), ["--runner=FlinkRunner"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("refinery prep: stage pack: the Beam job failed: RuntimeError: Pipeline BeamApp-x")
    assert err[1].startswith("Finished units are kept (-v shows FlinkRunner's whole error); fix the cause and run")
    assert err[2] == f"  refinery prep --input {corpus} --output {out}" and len(err) == 3  # --force left out
    assert run_stages(build_stages(_config(corpus, out)), str(out), [], progress=False).ran == \
        {"tokenize": 0, "pack": 3, "manifest": 1}
    assert final_digest(out) == want
