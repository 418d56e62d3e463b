"""bench/inference.py's CPU-checkable parts: model shapes, byte counts, the memory plan, the
random model, the --tiny smoke run and the no-GPU exit."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

import pytest

torch = pytest.importorskip("torch", reason="the inference extra (torch) is not installed")

BENCH = Path(__file__).resolve().parents[1] / "bench" / "inference.py"


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("bench_inference", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_model_shapes(bench: ModuleType) -> None:
    c20, c120 = bench.model_config("20b"), bench.model_config("120b")
    assert (c20.num_hidden_layers, c20.num_experts, c120.num_hidden_layers, c120.num_experts) == (24, 32, 36, 128)
    for c in (c20, c120):
        assert (c.hidden_size, c.intermediate_size, c.vocab_size, c.experts_per_token) == (2880, 2880, 201088, 4)
        assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.sliding_window) == (64, 8, 64, 128)
        assert c.is_sliding(0) and not c.is_sliding(1)
    with pytest.raises(ValueError):
        bench.model_config("7b")


def test_byte_counts(bench: ModuleType) -> None:
    c20, c120 = bench.model_config("20b"), bench.model_config("120b")
    # published checkpoint sizes: about 13.8 GB and 65.3 GB
    assert 13.5e9 < bench.weight_bytes(c20)["total"] < 14.0e9
    assert 65.0e9 < bench.weight_bytes(c120)["total"] < 65.5e9
    # GPT_OSS.md: 20b batch-1 decode reads about 3.7 GB per token
    step = bench.decode_step_bytes(c20, context=1152)
    assert 3.6e9 < step < 3.9e9
    # one more token of context adds one KV row to each full layer only (sliding ones are capped)
    kv_row = 2 * 8 * 64 * 2
    assert bench.decode_step_bytes(c20, 1153) - step == 12 * kv_row
    # batch 256 touches every expert once
    assert bench.decode_step_bytes(c20, 1, batch=256) > bench.decode_step_bytes(c20, 1, batch=8)
    assert bench.decode_step_bytes(c20, 1, batch=256) == bench.decode_step_bytes(c20, 1, batch=512) - 256 * (
        2880 * 2 + 24 * kv_row)


def test_memory_plan_120b_fits_one_h200(bench: ModuleType) -> None:
    c120 = bench.model_config("120b")
    plan = bench.memory_plan(c120, batch=256, max_seq_len=1024 + 256, prefill_chunk=8192)
    assert plan["total"] < 141e9 and plan["weights"] > 60e9
    assert bench.memory_plan(c120, 1, 1280, 8192)["total"] > 40e9  # no 40 GB card holds it


def test_kv_cache_bytes_match_the_cache(bench: ModuleType) -> None:
    from refinery.kernels.kv_cache import PagedKVCache

    config = bench.model_config("tiny")
    cache = PagedKVCache(config, max_batch=3, max_seq_len=50, max_chunk=7, block_size=4, dtype=torch.bfloat16)
    allocated = sum(t.numel() * t.element_size() for pools in (cache.k, cache.v) for t in pools.values())
    assert bench.kv_cache_bytes(config, 3, 50, 7, block_size=4) == allocated


def test_random_model_runs(bench: ModuleType) -> None:
    config = bench.model_config("tiny")
    model = bench.random_model(config, "cpu", torch.float32, seed=1)
    assert model.block[0].mlp.mlp1_blocks.dtype == torch.uint8
    scales = model.block[0].mlp.mlp1_scales
    assert 118 <= int(scales.min()) and int(scales.max()) <= 121
    logits = model(torch.arange(20))
    assert logits.shape == (20, config.vocab_size) and torch.isfinite(logits).all()
    again = bench.random_model(config, "cpu", torch.float32, seed=1)
    assert torch.equal(again(torch.arange(20)), logits)


def test_tiny_smoke_run(bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "figures.json"
    assert bench.main(["--tiny", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "batch    3: prefill" in printed and "of roofline" in printed and "speed-up" in printed
    figures = json.loads(out.read_text())
    runs = figures["runs"]
    assert [(r["path"], r["batch"]) for r in runs] == [("torch", 1), ("torch", 3), ("torch", 1)]
    assert all(r["decode_steps"] == r["new_tokens"] - 1 and r["decode_tokens_per_s"] > 0 for r in runs)
    roof = figures["roofline_batch1"]
    assert 0 < roof["fraction"] and roof["peak_bytes_per_s"] == 3.35e12
    assert roof["fraction_of_copy_bandwidth"] == roof["achieved_bytes_per_s"] / roof["copy_bandwidth_bytes_per_s"]
    assert "of the measured copy bandwidth" in printed and "goal 50%" in printed
    assert figures["compiles_in_timed_runs"] == 0
    # launches per decode step: the Triton path (interpreted on the CPU) and the torch path
    launches = figures["launches_per_decode_step"]
    assert [c["batch"] for c in launches["triton"]] == [c["batch"] for c in launches["torch"]] == [1, 3]
    for c in launches["triton"]:
        assert c["per_layer_max"] <= 12 and c["triton"] > 0 and c["by_name"]["aten.copy_"] == 1
    assert all(c["per_layer_max"] > 50 for c in launches["torch"])
    assert "[triton] launches per decode step at batch 3" in printed


def test_batch128_judged_against_the_goals(
        bench: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # the batch-128 line and figures, from a stubbed run (no GPU here)
    fake = bench.RunResult("triton", 128, 24, 6, 1.0, 1.0, 5, 1.0, 12_000.0, 1.0, None)
    monkeypatch.setattr(bench, "run_batch", lambda model, batch, *a, **k: fake if batch == 128 else
                        bench.RunResult("torch", batch, 24, 6, 1.0, 1.0, 5, 1.0, 100.0, 1.0, None))
    monkeypatch.setattr(bench, "count_decode_launches", lambda *a, **k: {
        "batch": 1, "total": 1, "triton": 0, "aten": 1, "per_layer_max": 0, "per_layer_mean": 0.0,
        "outside_layers": 1, "by_name": {}})
    assert bench.main(["--tiny", "--batches", "1,128"]) == 0
    printed = capsys.readouterr().out
    assert "batch-128 aggregate decode: 12,000 tok/s = 120% of the 10,000 tok/s goal (met), 63% of vLLM" in printed


def test_exits_without_cuda(
        bench: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--batches", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
