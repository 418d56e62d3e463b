"""The engine with its Triton kernels forced in (Triton's interpreter, CPU tensors) against
the torch path: full forward, hidden states and continuous-batching generation."""
from __future__ import annotations

import importlib.util
from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch", reason="the inference extra (torch) is not installed")
pytest.importorskip("safetensors", reason="the inference extra (safetensors) is not installed")
if importlib.util.find_spec("triton") is None:  # not importorskip: triton must load interpreted
    pytest.skip("triton is not installed", allow_module_level=True)

from engine_fixtures import interpreted_triton_kernels, random_weights, tiny_config, write_original  # noqa: E402

KERNELS = interpreted_triton_kernels()  # TRITON_INTERPRET=1: the kernels run on CPU tensors

from refinery.kernels import launches, ops  # noqa: E402
from refinery.kernels.batching import BatchedGenerator, sample  # noqa: E402
from refinery.kernels.model import Transformer, TransformerBlock  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Transformer:
    config = tiny_config(num_hidden_layers=2)  # one sliding, one full layer
    path = write_original(tmp_path_factory.mktemp("triton_engine"), config, random_weights(config, seed=3))
    return Transformer.from_checkpoint(path, dtype=torch.float32)


def _tokens(n: int, seed: int) -> list[int]:
    tokens: list[int] = torch.randint(0, 160, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return tokens


NAMES = ("rmsnorm", "add_rmsnorm", "rope_qkv", "route", "moe", "attention", "paged_attention")


def _counting(kernels: ops.Kernels) -> tuple[ops.Kernels, dict[str, int]]:
    calls = {name: 0 for name in NAMES}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)
        return run

    return kernels.replace(None, **{name: wrap(name, getattr(kernels, name)) for name in NAMES}), calls


def test_forward_and_hidden_states_match_torch(model: Transformer) -> None:
    tokens = torch.tensor(_tokens(5 * model.config.sliding_window, seed=1))  # several windows long
    ref = model(tokens)
    ref_hidden = model.hidden_states(tokens, [1, -1])
    kernels, calls = _counting(KERNELS)
    with model.using_kernels(kernels):
        got = model(tokens)
        got_hidden = model.hidden_states(tokens, [1, -1])
    layers = model.config.num_hidden_layers
    assert calls["moe"] == calls["route"] == 2 * layers and calls["attention"] == 2 * layers
    assert calls["rope_qkv"] == 2 * layers and calls["rmsnorm"] > 0 and calls["add_rmsnorm"] >= 2 * layers
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() <= 1e-4 * scale
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    for key in (1, layers):
        torch.testing.assert_close(got_hidden[key], ref_hidden[key], rtol=1e-4, atol=1e-4)
    first = model.block[0]
    assert isinstance(first, TransformerBlock)
    assert model.kernels is ops.TORCH and first.mlp.kernels is ops.TORCH  # restored on exit


def test_generation_matches_torch(model: Transformer) -> None:
    prompts = [_tokens(n, seed=10 + n) for n in (3, 17, 11)]

    def run() -> list[list[int]]:
        gen = BatchedGenerator(model, max_seq_len=48, max_batch=2, block_size=4, prefill_chunk=7)
        return gen.generate_batch(prompts, max_tokens=5)

    ref = run()
    kernels, calls = _counting(KERNELS)
    with model.using_kernels(kernels):
        got = run()
    assert calls["paged_attention"] > 0 and calls["attention"] == 0
    assert calls["rope_qkv"] == calls["paged_attention"] and calls["add_rmsnorm"] > 0
    assert got == ref and [len(t) for t in got] == [5, 5, 5]


def test_fixed_shape_decode_with_triton_matches_torch(model: Transformer) -> None:
    # the CUDA-graph-ready decode (buckets, padding rows on the scratch block) with every Triton
    # kernel forced in gives the torch path's greedy tokens
    prompts = [_tokens(n, seed=20 + n) for n in (3, 17, 11, 6)]

    def run(cuda_graph: bool) -> list[list[int]]:
        gen = BatchedGenerator(model, max_seq_len=48, max_batch=3, block_size=4, prefill_chunk=7,
                               cuda_graph=cuda_graph)
        return gen.generate_batch(prompts, max_tokens=6)

    ref = run(False)
    with model.using_kernels(KERNELS):
        assert run(True) == ref


def test_launches_per_decode_step(model: Transformer) -> None:
    # Triton path, decode of 3 sequences: at most 12 launches per layer (13 where flash-decoding
    # splits the keys), one host-to-device copy and one block-table scatter per step
    gen = BatchedGenerator(model, max_seq_len=64, max_batch=3, block_size=4, prefill_chunk=64)
    with model.using_kernels(KERNELS):
        for n in (5, 9, 12):
            gen.add(_tokens(n, seed=n), max_tokens=8)
        prefill = gen.step()
        assert prefill is not None
        logits, ids = prefill
        for sid, token in zip(ids, sample(logits, 0.0)):
            gen.update(sid, token)
        (logits, ids), count, per_layer = launches.per_layer(model, gen.step)
    assert len(ids) == 3 and per_layer == [12] * model.config.num_hidden_layers
    assert count.by_name["aten.copy_"] == 1 and count.by_name.get("aten.index_copy_", 0) <= 1
    assert count.total <= 12 * model.config.num_hidden_layers + 16
    assert count.triton >= 9 * model.config.num_hidden_layers


def test_kernels_chosen_once_per_device(monkeypatch: pytest.MonkeyPatch, model: Transformer) -> None:
    assert model.kernels is ops.TORCH  # a CPU model
    assert ops.kernels_for("cpu") is ops.TORCH
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("REFINERY_KERNELS", raising=False)
    assert ops.triton_on_cuda()
    monkeypatch.setenv("REFINERY_KERNELS", "torch")
    assert not ops.triton_on_cuda()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("REFINERY_KERNELS")
    assert not ops.triton_on_cuda()
    assert ops.kernels_for("cuda") is ops.TORCH  # no CUDA
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    chosen = ops.kernels_for("cuda")  # a CUDA model gets the Triton set, a CPU one keeps torch
    assert chosen.name == "triton" and ops.kernels_for("cpu") is ops.TORCH
    for name in NAMES:
        assert getattr(chosen, name).__name__.endswith("_triton")
        assert getattr(ops.TORCH, name).__name__.endswith("_torch")
