"""The forward pass against transformers' GptOssForCausalLM, and checkpoint layouts."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import pytest

torch = pytest.importorskip("torch", reason="the inference extra (torch) is not installed")
if TYPE_CHECKING:
    from torch import Tensor
pytest.importorskip("safetensors", reason="the inference extra (safetensors) is not installed")

from engine_fixtures import random_weights, tiny_config, write_hf, write_original  # noqa: E402

from refinery.kernels import mxfp4  # noqa: E402
from refinery.kernels.config import ModelConfig, load_config  # noqa: E402
from refinery.kernels.model import Transformer, TransformerBlock  # noqa: E402


class Checkpoints(TypedDict):
    """One tiny model's config and weights, written in each layout."""

    config: ModelConfig
    weights: dict[str, Tensor]
    hf: Path
    hf_single: Path
    original: Path


SEQ_LEN = 40  # 5x the tiny model's sliding window of 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    config = tiny_config()
    weights = random_weights(config, seed=0)
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "config": config,
        "weights": weights,
        "hf": write_hf(root / "hf", config, weights, shards=3),
        "hf_single": write_hf(root / "hf_single", config, weights, shards=1),
        "original": write_original(root / "original", config, weights),
    }


@pytest.fixture(scope="module")
def tokens(checkpoints: Checkpoints) -> Tensor:
    g = torch.Generator().manual_seed(7)
    out: Tensor = torch.randint(0, checkpoints["config"].vocab_size, (SEQ_LEN,), generator=g)
    return out


def test_matches_transformers(checkpoints: Checkpoints, tokens: Tensor) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers", reason="transformers (test extra) is not installed")
    config = checkpoints["config"]
    assert SEQ_LEN >= 3 * config.sliding_window
    # On a CPU transformers only runs MXFP4 checkpoints dequantized; with dtype=float32 its
    # decode (a lookup table and ldexp) is exact, so both sides see the same weights; checked below.
    ref = transformers.GptOssForCausalLM.from_pretrained(
        str(checkpoints["hf"]),
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32,
        attn_implementation="eager",
    ).eval()
    ours = Transformer.from_checkpoint(checkpoints["hf"], device="cpu", dtype=torch.float32)
    weights = checkpoints["weights"]
    for n in range(config.num_hidden_layers):
        experts = ref.model.layers[n].mlp.experts
        gate_up = mxfp4.dequantize(
            weights[f"block.{n}.mlp.mlp1_weight.blocks"], weights[f"block.{n}.mlp.mlp1_weight.scales"]
        )
        down = mxfp4.dequantize(
            weights[f"block.{n}.mlp.mlp2_weight.blocks"], weights[f"block.{n}.mlp.mlp2_weight.scales"]
        )
        assert torch.equal(experts.gate_up_proj, gate_up.transpose(1, 2))
        assert torch.equal(experts.down_proj, down.transpose(1, 2))
        assert torch.equal(experts.gate_up_proj_bias, weights[f"block.{n}.mlp.mlp1_bias"].float())
        assert ref.model.layers[n].self_attn.sinks.abs().min() > 0
    assert ref.config.layer_types == config.layer_types

    with torch.no_grad():
        want = ref(tokens.unsqueeze(0)).logits[0]
    got = ours(tokens)
    assert got.shape == (SEQ_LEN, config.vocab_size) and got.dtype == torch.float32
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= 1e-4 * scale, f"max abs diff {err:.3g} vs logits scale {scale:.3g}"

    # The window matters on this sequence: without it the logits move far beyond the tolerance.
    wide = Transformer.from_checkpoint(checkpoints["hf"], dtype=torch.float32)
    for block in wide.block:
        assert isinstance(block, TransformerBlock)
        block.attn.window = None
    assert (wide(tokens) - want).abs().max().item() > 1e-2 * scale


def test_layouts_give_identical_logits(checkpoints: Checkpoints, tokens: Tensor) -> None:
    logits = [
        Transformer.from_checkpoint(path, dtype=torch.float32)(tokens)
        for path in (checkpoints["hf"], checkpoints["hf_single"], checkpoints["original"])
    ]
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])


def test_configs_agree(checkpoints: Checkpoints) -> None:
    hf, orig = load_config(checkpoints["hf"]), load_config(checkpoints["original"])
    assert hf == orig == checkpoints["config"]
    raw = json.loads((checkpoints["hf"] / "config.json").read_text())
    # Newer transformers write rope_parameters (with rope_theta inside) instead of rope_scaling.
    rope = dict(raw.pop("rope_scaling"), rope_theta=raw.pop("rope_theta"))
    assert ModelConfig.from_hf_dict({**raw, "rope_parameters": rope}) == hf


def test_real_model_configs() -> None:
    c20 = ModelConfig.from_dict({
        "num_hidden_layers": 24, "num_experts": 32, "experts_per_token": 4, "vocab_size": 201088,
        "hidden_size": 2880, "intermediate_size": 2880, "swiglu_limit": 7.0, "head_dim": 64,
        "num_attention_heads": 64, "num_key_value_heads": 8, "sliding_window": 128,
        "initial_context_length": 4096, "rope_theta": 150000, "rope_scaling_factor": 32.0,
        "rope_ntk_alpha": 1, "rope_ntk_beta": 32,
    })
    assert [c20.is_sliding(i) for i in range(4)] == [True, False, True, False]
    from refinery.kernels.model import yarn_inv_freq

    inv_freq, concentration = yarn_inv_freq(c20)
    assert abs(concentration - 1.3465735902799727) < 1e-12
    assert inv_freq.shape == (32,)
    assert inv_freq[0] == 1.0  # highest frequency: extrapolated, untouched
    assert abs(inv_freq[-1].item() * 32 * 150000 ** (62 / 64) - 1) < 1e-12  # lowest: interpolated


def test_experts_stay_packed(checkpoints: Checkpoints) -> None:
    model = Transformer.from_checkpoint(checkpoints["original"], dtype=torch.bfloat16)
    first = model.block[0]
    assert isinstance(first, TransformerBlock)
    mlp = first.mlp
    assert mlp.mlp1_blocks.dtype == torch.uint8 and mlp.mlp2_scales.dtype == torch.uint8
    assert first.attn.qkv.weight.dtype == torch.bfloat16
    floats = [n for n, t in model.state_dict().items() if t.is_floating_point() and "mlp" in n and t.dim() > 2]
    assert floats == []
    logits = model(torch.arange(12))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_hidden_states(checkpoints: Checkpoints, tokens: Tensor) -> None:
    model = Transformer.from_checkpoint(checkpoints["original"], dtype=torch.float32)
    logits = model(tokens)
    hidden = model(tokens, return_hidden=[0, 1, 3])
    assert sorted(hidden) == [0, 1, 3]
    assert torch.equal(hidden[0], model.embedding(tokens))
    assert torch.allclose(model.unembedding(model.norm(hidden[3])), logits, atol=1e-5)

    ran = []
    hooks = [b.register_forward_hook(lambda m, i, o, n=n: ran.append(n)) for n, b in enumerate(model.block)]
    calls = []
    hooks.append(model.unembedding.register_forward_hook(lambda *a: calls.append(1)))
    only = model.hidden_states(tokens, [1])
    for h in hooks:
        h.remove()
    assert ran == [0] and calls == [] and torch.equal(only[1], hidden[1])
