"""prep as a user runs it: interruption, HF dataset resolution, no torch, runner options."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import gsm8k_texts, tree_digest, write_jsonl

from refinery.runners import RunnerOptionsError, pipeline_args
from refinery.transforms.io.hf import resolve_hf_parquet


def _prep_cmd(corpus: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "refinery.beam_pipelines.cli", "prep", "--input", str(corpus), "--output", str(out),
            "--num-shards", "2", "--workers", "1", "--no-progress", *extra]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_cleanly_and_resumes(tmp_path: Path, sig: signal.Signals) -> None:
    """The signal is sent when the second of 20 tokenize units starts (the unit log says so),
    so the run cannot have finished first: this test has no way to skip itself."""
    corpus = tmp_path / "c"
    texts = gsm8k_texts(400)
    for k in range(20):  # 20 small units so the signal lands mid-stage
        write_jsonl(corpus / f"f{k:02d}.jsonl", [{"text": t * 60} for t in texts[k * 20:(k + 1) * 20]])  # ~0.1 s a unit
    out, log = tmp_path / "out", tmp_path / "units.log"
    env = {**os.environ, "REFINERY_UNIT_LOG": str(log)}
    one_unit_per_file = ("--unit-mb", "0")  # else the 20 small files are one unit
    proc = subprocess.Popen(_prep_cmd(corpus, out, *one_unit_per_file), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 120
    while time.time() < deadline and (not log.exists() or log.read_text().count('"event": "start"') < 2):
        time.sleep(0.01)
    proc.send_signal(sig)
    t0 = time.time()
    _, err = proc.communicate(timeout=30)
    assert time.time() - t0 < 10
    assert proc.returncode == 130, err
    assert "Resume with:" in err and "refinery prep --input" in err and "Traceback" not in err
    # no half-written file under a final name
    assert not (out / "manifest.json").exists() or json.loads((out / "manifest.json").read_text())
    subprocess.run(_prep_cmd(corpus, out, *one_unit_per_file), check=True, capture_output=True)
    ref = tmp_path / "ref"
    subprocess.run(_prep_cmd(corpus, ref, *one_unit_per_file), check=True, capture_output=True)
    assert tree_digest(out) == tree_digest(ref)
    assert not list(out.rglob(".*.tmp-*"))


def test_prep_and_cli_do_not_import_torch() -> None:
    code = ("import sys, refinery.beam_pipelines.cli, refinery.transforms.prep.stages, refinery.transforms.resumable;"
            "refinery.beam_pipelines.cli.build_parser();"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


class FakeHub:
    """Stands in for huggingface_hub's HfFileSystem/HfApi (the hub is unreachable here)."""

    def __init__(self, files: list[str]) -> None:
        self.files = files
        self.asked: list[str] = []

    def glob(self, pattern: str) -> list[str]:
        import fnmatch
        self.asked.append(pattern)
        return [f for f in self.files if fnmatch.fnmatch(f, pattern)]

    def dataset_info(self, name: str, revision: str | None = None) -> object:
        class Info:
            sha = "a" * 40
        return Info()


def test_hf_dataset_resolves_to_pinned_parquet_files() -> None:
    sha = "a" * 40
    hub = FakeHub([f"datasets/org/web@{sha}/sample-10BT/000_00000.parquet",
                   f"datasets/org/web@{sha}/sample-10BT/001_00000.parquet",
                   f"datasets/org/web@{sha}/data/train-00000-of-00001.parquet"])
    src = resolve_hf_parquet("org/web", "sample-10BT", "train", fs=hub, api=hub)
    assert src.revision == sha
    assert src.files == (f"hf://datasets/org/web@{sha}/sample-10BT/000_00000.parquet",
                         f"hf://datasets/org/web@{sha}/sample-10BT/001_00000.parquet")
    assert src.describe()["hf_revision"] == sha
    plain = resolve_hf_parquet("org/web", None, "train", revision=sha, fs=hub, api=hub)
    assert plain.files == (f"hf://datasets/org/web@{sha}/data/train-00000-of-00001.parquet",)
    with pytest.raises(ValueError, match="no parquet files"):
        resolve_hf_parquet("org/web", "missing", "test", fs=hub, api=hub)


def test_runner_options() -> None:
    assert pipeline_args("local", 3) == ["--runner=DirectRunner", "--direct_running_mode=multi_processing",
                                         "--direct_num_workers=3", "--beam_plugins=refinery.runners.worker_exit"]
    assert "--direct_running_mode=in_memory" in pipeline_args("local", 1)
    portable = pipeline_args("portable", None, ["--environment_type=DOCKER"])
    assert portable == ["--environment_type=DOCKER", "--runner=PortableRunner", "--job_endpoint=embed"]
    dataflow = pipeline_args("dataflow", 10, ["--project=p"])
    assert "--runner=DataflowRunner" in dataflow and "--max_num_workers=10" in dataflow
    assert any(a.startswith("--setup_file=") and a.endswith("setup.py") for a in dataflow)
    assert pipeline_args("PrismRunner") == ["--runner=PrismRunner"]  # Beam's own runners pass through
    with pytest.raises(RunnerOptionsError, match="--runner SomeRunner: not a runner"):
        pipeline_args("SomeRunner")


def test_prep_on_an_object_store_path(small_corpus: Path) -> None:
    """Remote code paths (spooled atomic uploads, listings, receipts) on fsspec's memory://.

    Regression: a listing spelled memory:///x while joined paths were memory://x, and the
    manifest stage deleted the shards it had just written as if they were another plan's.
    """
    import fsspec

    from refinery.beam_pipelines.cli import main
    from refinery.transforms.resumable import stage_status

    out = "memory://bucket/prep-out"
    args = ["prep", "--input", str(small_corpus), "--output", out, "--runner", "direct", "--no-progress",
            "--num-shards", "3", "--dataset", "m"]
    try:
        assert main(args) == 0
        assert main(["verify", f"{out}/manifest.json", "--checksums"]) == 0
        fs = fsspec.filesystem("memory")
        assert len([p for p in fs.find("/bucket/prep-out") if p.endswith(".npy")]) == 3
        assert [r["done"] for r in stage_status(out)] == [1, 3, 1]  # the 2 small files: one tokenize unit
        before = {p: fs.info(p)["created"] for p in fs.find("/bucket/prep-out") if ".refinery" not in p}
        assert main(args) == 0
        assert {p: fs.info(p)["created"] for p in fs.find("/bucket/prep-out") if ".refinery" not in p} == before
    finally:
        fsspec.filesystem("memory").rm("/bucket/prep-out", recursive=True)
