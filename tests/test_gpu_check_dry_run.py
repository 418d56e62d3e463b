"""bench/gpu_check.py, the script a lent GPU runs (issue 45): its CPU dry run passes every
step with Beam and pyarrow blocked (the device has neither), and its pure parts (divergence,
ties, pytest's counts, the bandwidth table) are right."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the inference extra (torch) is not installed")
pytest.importorskip("safetensors", reason="the inference extra (safetensors) is not installed")
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"
BLOCKED = ("apache_beam", "pyarrow")

# imported by every Python process started with PYTHONPATH=<its folder>: the dry run and the
# pytest it starts for step 1 both see no Beam and no pyarrow, as on the device; each attempt
# to import them is logged with the process's script (tests/conftest.py tries Beam's stager
# and goes on without it: an optional import is allowed in pytest, none in the engine)
SITECUSTOMIZE = textwrap.dedent('''
    import os, sys

    class _DeviceHasNoBeam:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in {blocked!r}:
                with open(os.environ["GPU_CHECK_BLOCK_LOG"], "a") as log:
                    log.write(name + " " + os.path.basename(sys.argv[0] if sys.argv else "") + "\\n")
                raise ModuleNotFoundError(f"{{name}} is blocked: the GPU machine has no Beam and no pyarrow", name=name)
            return None

    sys.meta_path.insert(0, _DeviceHasNoBeam())
''').format(blocked=BLOCKED)


@pytest.fixture(scope="module")
def blocked_env(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], Path]:
    folder = tmp_path_factory.mktemp("no_beam")
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in __import__("os").environ.items()
           if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT", "TRITON_INTERPRET"))}
    env["PYTHONPATH"] = str(folder)
    env["GPU_CHECK_BLOCK_LOG"] = str(folder / "blocked.log")
    return env, folder / "blocked.log"


# the dry run's process, its figures by (step, name), the figures file and the blocker's log
DryRun = tuple[subprocess.CompletedProcess[str], dict[tuple[int, str], dict[str, Any]], Path, Path]


@pytest.fixture(scope="module")
def dry_run(blocked_env: tuple[dict[str, str], Path], tmp_path_factory: pytest.TempPathFactory) -> DryRun:
    env, log = blocked_env
    out = tmp_path_factory.mktemp("gpu_check") / "figures.jsonl"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--budget-s", "900"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return proc, {(r["step"], r["name"]): r for r in records}, out, log


def test_blocker_blocks_and_the_engine_imports_without_beam(blocked_env: tuple[dict[str, str], Path]) -> None:
    env, log = blocked_env
    probe = subprocess.run([sys.executable, "-c", "import pyarrow"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "is blocked" in probe.stderr  # the blocker is live in a child
    log.unlink()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--imports-only"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    modules = json.loads(proc.stdout.strip().splitlines()[-1])["modules"]
    for name in ("batching", "model", "ops", "launches", "moe_tune", "interpret", "triton_moe", "triton_attention",
                 "triton_norm", "triton_rope"):
        assert f"refinery.kernels.{name}" in modules
    assert not log.exists(), f"the engine's imports tried {log.read_text().split()}"


def test_dry_run_passes_every_cpu_step(dry_run: DryRun) -> None:
    proc, by, out, log = dry_run
    assert proc.returncode == 0, (proc.stderr[-3000:], proc.stdout[-3000:])
    assert "every record passed" in proc.stderr
    tried = log.read_text().splitlines() if log.exists() else []
    assert not [line for line in tried if line.endswith("gpu_check.py")], f"the dry run tried to import {tried}"
    summary = by[(5, "summary")]
    assert summary["status"] == "ok" and summary["failed"] == [] and summary["dry_run"] is True
    assert by[(0, "machine")]["device"] == "cpu" and by[(0, "machine")]["torch"] == torch.__version__
    # every record is one JSON line on stdout too
    assert len([line for line in proc.stdout.splitlines() if line.startswith("{")]) == len(by)

    tests = by[(1, "kernel_tests")]
    assert tests["status"] == "ok" and tests["passed"] > 0 and tests["failed"] == tests["errors"] == 0
    assert not tests["timed_out"] and tests["first_failure"] is None

    logits = by[(2, "logits_rel_error")]
    assert logits["status"] == "ok" and len(logits["per_layer"]) == 2
    assert 0 <= logits["max"] < 1e-4 and logits["argmax_agreement"] == 1.0  # float32 in the interpreter
    assert by[(2, "greedy_tokens")]["identical"] is True and by[(2, "greedy_tokens")]["status"] == "ok"
    fixed = by[(2, "fixed_shape_tokens")]
    assert fixed["status"] == "ok" and fixed["identical"] is True
    graph_tokens = by[(2, "cuda_graph_tokens")]
    assert graph_tokens["status"] == "skipped" and "CUDA" in graph_tokens["reason"]  # not passing: never run

    for batch in (1, 2):
        run = by[(3, f"decode_eager_batch{batch}")]
        assert run["status"] == "ok" and run["path"] == "triton" and run["batch"] == batch
        assert run["decode_tokens_per_s"] > 0 and run["prefill_tokens_per_s"] > 0
        assert run["decode_steps"] == run["new_tokens"] - 1
        graph = by[(3, f"decode_graph_batch{batch}")]
        assert graph["status"] == "skipped" and "CUDA" in graph["reason"]  # not passing: never run
        launches = by[(3, f"launches_triton_batch{batch}")]
        assert launches["per_layer_max"] <= 13 and launches["triton"] > 0  # docs/ENGINE.md: 12, 13 split
    assert set(by[(3, "prefill")]["tokens_per_s"]) == {"1", "2"}
    roof = by[(3, "roofline_batch1_eager")]
    assert roof["fraction"] > 0 and roof["step_bytes"] > 0 and roof["goal_met"] is False
    assert by[(3, "decode_torch_batch1")]["path"] == "torch"
    assert by[(3, "triton_torch_ratio_batch1")]["ratio"] > 0
    assert by[(3, "launches_torch_batch1")]["per_layer_max"] > by[(3, "launches_triton_batch1")]["per_layer_max"]

    sweep = by[(4, "moe_sweep_tokens2")]
    assert sweep["status"] == "ok" and sweep["best"] and sweep["best"][0]["hidden"] == 64
    tuned = json.loads(Path(by[(4, "moe_tuned_file")]["path"]).read_text())
    assert tuned == sweep["best"] and Path(by[(4, "moe_tuned_file")]["path"]).parent == out.parent

    statuses = {r["status"] for r in by.values()}
    assert statuses <= {"ok", "skipped"}
    skipped = {name for (_, name), r in by.items() if r["status"] == "skipped"}
    assert skipped == {"cuda_graph_tokens", "decode_graph_batch1", "decode_graph_batch2"}  # the GPU-only ones


# ---- the pure parts, in this process ---------------------------------------------------------


@pytest.fixture(scope="module")
def gc() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("bench_gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None, SCRIPT
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_first_divergence_and_ties(gc: ModuleType) -> None:
    assert gc.first_divergence([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) is None
    assert gc.first_divergence([[1, 2, 3], [4, 5, 6]], [[1, 2, 9], [4, 7, 6]]) == (1, 1)  # the earliest step
    assert gc.first_divergence([[1, 2, 3]], [[1, 2]]) == (0, 2)  # a shorter run diverges where it ends
    with pytest.raises(ValueError):
        gc.first_divergence([[1]], [[1], [2]])
    ref = torch.tensor([0.0, 5.0, 4.999, 1.0])
    close = gc.tie_figures(ref, ref + torch.tensor([0.0, -0.001, 0.001, 0.0]), ref_token=1, got_token=2)
    assert close["explained_by_tie"] is True and close["ref_margin"] == pytest.approx(0.001, abs=1e-6)
    wrong = gc.tie_figures(ref, ref + 1e-4, ref_token=1, got_token=3)  # margin 4, paths agree to 1e-4
    assert wrong["explained_by_tie"] is False
    ok, figures = gc.compare_tokens([[7, 1]], [[7, 2]], [[ref, ref]], [[ref, ref + 1e-4]])
    assert not ok and figures["first_divergence"] == {"prompt": 0, "step": 1} and figures["matching_prefix"] == [1]
    assert gc.rel_error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0])) == 0.5
    assert gc.rel_error(torch.zeros(2), torch.zeros(2)) == 0.0


def test_pytest_counts_from_junit_and_from_progress(gc: ModuleType) -> None:
    junit = ('<testsuites><testsuite tests="5" failures="1" errors="1" skipped="1">'
             '<testcase classname="tests.test_triton_moe" name="test_a"/>'
             '<testcase classname="tests.test_triton_moe" name="test_b"><failure message="assert 1 == 2"/></testcase>'
             '</testsuite></testsuites>')
    counts = gc.pytest_counts(junit, "")
    assert counts == {"passed": 2, "failed": 1, "errors": 1, "skipped": 1,
                      "first_failure": "tests.test_triton_moe::test_b: assert 1 == 2"}
    cut_off = "tests/test_triton_moe.py ..F.s  [ 40%]\n..Es\n"  # killed at its time limit: no XML
    assert gc.pytest_counts(None, "..F.s [ 40%]\n..E\nsome other line\n") == {
        "passed": 5, "failed": 1, "errors": 1, "skipped": 1, "first_failure": None}
    assert gc.pytest_counts(None, cut_off)["passed"] == 2  # a line naming its file is not a progress line


def test_peak_bandwidth_by_gpu_name(gc: ModuleType) -> None:
    assert gc.peak_bandwidth("NVIDIA H200", None) == (4.8e12, "H200 datasheet")
    assert gc.peak_bandwidth("NVIDIA H100 80GB HBM3", None)[0] == 3.35e12
    assert gc.peak_bandwidth("NVIDIA H100 PCIe", None)[0] == 2.0e12
    assert gc.peak_bandwidth("NVIDIA H100 80GB HBM3", 3.0)[0] == 3.0e12
    assert "unknown GPU" in gc.peak_bandwidth("NVIDIA A100", None)[1]


def test_budget_skips_are_recorded_and_fail_a_dry_run(gc: ModuleType, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # a unit the budget cannot hold is recorded as skipped, not run; on the GPU that is a figure
    # left out, in a dry run (which must run every step) a failure
    record = gc.Recorder(tmp_path / "x.jsonl", {"dry_run": False})
    plan = gc.make_plan(gc.parse_args(["--out", str(tmp_path / "x.jsonl")]))
    ctx = gc.Context(gc.parse_args([]), plan, torch.device("cpu"), gc.ops.TORCH, record, gc.Budget(10))
    ran = []
    gc.run_unit(ctx, 3, "too_big", 60, lambda: ran.append(1))
    gc.run_unit(ctx, 3, "fits", 1, lambda: ran.append(2))
    gc.run_unit(ctx, 3, "raises", 1, lambda: 1 / 0)
    record.close()
    assert ran == [2]
    rows = [json.loads(line) for line in (tmp_path / "x.jsonl").read_text().splitlines()]
    assert [(r["name"], r["status"]) for r in rows] == [("too_big", "skipped"), ("raises", "error")]
    assert rows[0]["reason"] == "budget" and rows[1]["error"].startswith("ZeroDivisionError")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gc.main(["--out", str(tmp_path / "y.jsonl")]) == 2  # no GPU, no dry run: says so, measures nothing
