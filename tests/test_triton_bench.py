"""bench/inference.py's CPU-checkable parts: model shapes, byte counts, the memory plan, the
random model, the --tiny smoke run and the no-GPU exit."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the inference extra (torch) is not installed")

BENCH = Path(__file__).resolve().parents[1] / "bench" / "inference.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_inference", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_model_shapes(bench):
    c20, c120 = bench.model_config("20b"), bench.model_config("120b")
    assert (c20.num_hidden_layers, c20.num_experts, c120.num_hidden_layers, c120.num_experts) == (24, 32, 36, 128)
    for c in (c20, c120):
        assert (c.hidden_size, c.intermediate_size, c.vocab_size, c.experts_per_token) == (2880, 2880, 201088, 4)
        assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.sliding_window) == (64, 8, 64, 128)
        assert c.is_sliding(0) and not c.is_sliding(1)
    with pytest.raises(ValueError):
        bench.model_config("7b")


def test_byte_counts(bench):
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


def test_memory_plan_120b_fits_one_h200(bench):
    c120 = bench.model_config("120b")
    plan = bench.memory_plan(c120, batch=256, max_seq_len=1024 + 256, prefill_chunk=8192)
    assert plan["total"] < 141e9 and plan["weights"] > 60e9
    assert bench.memory_plan(c120, 1, 1280, 8192)["total"] > 40e9  # no 40 GB card holds it


def test_kv_cache_bytes_match_the_cache(bench):
    from refinery.kernels.kv_cache import PagedKVCache

    config = bench.model_config("tiny")
    cache = PagedKVCache(config, max_batch=3, max_seq_len=50, max_chunk=7, block_size=4, dtype=torch.bfloat16)
    allocated = sum(t.numel() * t.element_size() for pools in (cache.k, cache.v) for t in pools.values())
    assert bench.kv_cache_bytes(config, 3, 50, 7, block_size=4) == allocated


def test_random_model_runs(bench):
    config = bench.model_config("tiny")
    model = bench.random_model(config, "cpu", torch.float32, seed=1)
    assert model.block[0].mlp.mlp1_blocks.dtype == torch.uint8
    scales = model.block[0].mlp.mlp1_scales
    assert 118 <= int(scales.min()) and int(scales.max()) <= 121
    logits = model(torch.arange(20))
    assert logits.shape == (20, config.vocab_size) and torch.isfinite(logits).all()
    again = bench.random_model(config, "cpu", torch.float32, seed=1)
    assert torch.equal(again(torch.arange(20)), logits)


def test_tiny_smoke_run(bench, tmp_path, capsys):
    out = tmp_path / "figures.json"
    assert bench.main(["--tiny", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "batch    3: prefill" in printed and "of roofline" in printed and "speed-up" in printed
    figures = json.loads(out.read_text())
    runs = figures["runs"]
    assert [(r["path"], r["batch"]) for r in runs] == [("torch", 1), ("torch", 3), ("torch", 1)]
    assert all(r["decode_steps"] == r["new_tokens"] - 1 and r["decode_tokens_per_s"] > 0 for r in runs)
    assert 0 < figures["roofline_batch1"]["fraction"]


def test_exits_without_cuda(bench, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--batches", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
