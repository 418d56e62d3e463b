"""Tiny random gpt-oss checkpoints: to try generate and hydra on a laptop, and for the tests.

    refinery tiny-checkpoint /tmp/tiny-gpt-oss            # or: python -m refinery.kernels.tiny DIR

writes a 3-layer gpt-oss (hidden 64, 4 experts, MXFP4 expert weights, the full o200k_harmony
vocabulary so real harmony prompts work) with random weights, in OpenAI's original layout
(``config.json`` + ``model.safetensors``; ``--layout hf`` for the Hugging Face one). Its output
is noise; it exercises every code path of the engine and the pipelines in seconds on a CPU.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from refinery.kernels.config import ModelConfig

TINY = dict(
    num_hidden_layers=3,
    num_experts=4,
    experts_per_token=2,
    vocab_size=160,
    hidden_size=64,
    intermediate_size=64,
    head_dim=16,
    num_attention_heads=4,
    num_key_value_heads=2,
    sliding_window=8,
)


def tiny_config(**overrides: Any) -> ModelConfig:
    return ModelConfig(**{**TINY, **overrides})


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Original-layout tensors: bf16 dense weights, random MXFP4 experts (all nibbles, varied
    scales), random biases, sinks and norm gains."""
    g = torch.Generator().manual_seed(seed)
    h, i, e = config.hidden_size, config.intermediate_size, config.num_experts
    nq, nkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    def gain(n: int) -> torch.Tensor:
        return (1.0 + 0.2 * torch.randn(n, generator=g)).to(torch.bfloat16)

    def blocks(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)

    def scales(*shape: int) -> torch.Tensor:
        return torch.randint(119, 125, shape, generator=g, dtype=torch.int32).to(torch.uint8)

    w: dict[str, torch.Tensor] = {
        "embedding.weight": normal(config.vocab_size, h, std=1.0),
        "norm.scale": gain(h),
        "unembedding.weight": normal(config.vocab_size, h, std=0.3),
    }
    for n in range(config.num_hidden_layers):
        p = f"block.{n}"
        w[f"{p}.attn.norm.scale"] = gain(h)
        w[f"{p}.attn.qkv.weight"] = normal((nq + 2 * nkv) * d, h, std=0.3)
        w[f"{p}.attn.qkv.bias"] = normal((nq + 2 * nkv) * d, std=0.2)
        w[f"{p}.attn.sinks"] = normal(nq, std=1.0)
        w[f"{p}.attn.out.weight"] = normal(h, nq * d, std=0.1)
        w[f"{p}.attn.out.bias"] = normal(h, std=0.1)
        w[f"{p}.mlp.norm.scale"] = gain(h)
        w[f"{p}.mlp.gate.weight"] = normal(e, h, std=0.5)
        w[f"{p}.mlp.gate.bias"] = normal(e, std=0.2)
        w[f"{p}.mlp.mlp1_weight.blocks"] = blocks(e, 2 * i, h // 32, 16)
        w[f"{p}.mlp.mlp1_weight.scales"] = scales(e, 2 * i, h // 32)
        w[f"{p}.mlp.mlp1_bias"] = normal(e, 2 * i, std=0.2)
        w[f"{p}.mlp.mlp2_weight.blocks"] = blocks(e, h, i // 32, 16)
        w[f"{p}.mlp.mlp2_weight.scales"] = scales(e, h, i // 32)
        w[f"{p}.mlp.mlp2_bias"] = normal(e, h, std=0.2)
    return w


def write_original(folder: Path, config: ModelConfig, weights: dict[str, torch.Tensor]) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config.to_dict(), indent=1))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    return folder


def hf_tensors(config: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same weights under Hugging Face names (q/k/v split, experts renamed)."""
    nq, nkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    out = {
        "model.embed_tokens.weight": weights["embedding.weight"],
        "model.norm.weight": weights["norm.scale"],
        "lm_head.weight": weights["unembedding.weight"],
    }
    expert_names = {
        "mlp1_weight.blocks": "gate_up_proj_blocks",
        "mlp1_weight.scales": "gate_up_proj_scales",
        "mlp1_bias": "gate_up_proj_bias",
        "mlp2_weight.blocks": "down_proj_blocks",
        "mlp2_weight.scales": "down_proj_scales",
        "mlp2_bias": "down_proj_bias",
    }
    for n in range(config.num_hidden_layers):
        p, q = f"block.{n}", f"model.layers.{n}"
        out[f"{q}.input_layernorm.weight"] = weights[f"{p}.attn.norm.scale"]
        for kind in ("weight", "bias"):
            qkv = weights[f"{p}.attn.qkv.{kind}"]
            out[f"{q}.self_attn.q_proj.{kind}"] = qkv[: nq * d]
            out[f"{q}.self_attn.k_proj.{kind}"] = qkv[nq * d : (nq + nkv) * d]
            out[f"{q}.self_attn.v_proj.{kind}"] = qkv[(nq + nkv) * d :]
            out[f"{q}.self_attn.o_proj.{kind}"] = weights[f"{p}.attn.out.{kind}"]
        out[f"{q}.self_attn.sinks"] = weights[f"{p}.attn.sinks"]
        out[f"{q}.post_attention_layernorm.weight"] = weights[f"{p}.mlp.norm.scale"]
        out[f"{q}.mlp.router.weight"] = weights[f"{p}.mlp.gate.weight"]
        out[f"{q}.mlp.router.bias"] = weights[f"{p}.mlp.gate.bias"]
        for ours, theirs in expert_names.items():
            out[f"{q}.mlp.experts.{theirs}"] = weights[f"{p}.mlp.{ours}"]
    return {k: v.contiguous() for k, v in out.items()}


def write_hf(
    folder: Path, config: ModelConfig, weights: dict[str, torch.Tensor], shards: int = 2
) -> Path:
    """Hugging Face layout: config.json (mxfp4 quantization_config) + sharded safetensors + index."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=1))
    tensors = hf_tensors(config, weights)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"))
        return folder
    weight_map = {}
    for s in range(shards):
        file = f"model-{s:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[s::shards]}
        save_file(part, str(folder / file))
        weight_map.update({k: file for k in part})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return folder


def write_harmony_checkpoint(folder: Path, num_hidden_layers: int = 3, seed: int = 0) -> Path:
    """A tiny random checkpoint (original layout) with the full o200k_harmony vocab (201088),
    so that real harmony prompts and the o200k tokenizer can drive it (pipelines, HYDRA)."""
    config = tiny_config(vocab_size=201088, num_hidden_layers=num_hidden_layers)
    return write_original(folder, config, random_weights(config, seed=seed))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m refinery.kernels.tiny", description=__doc__.splitlines()[0])
    p.add_argument("folder", help="where to write the checkpoint (created)")
    p.add_argument("--layers", type=int, default=3, help="transformer blocks (default: 3)")
    p.add_argument("--layout", choices=["original", "hf"], default="original")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    config = tiny_config(vocab_size=201088, num_hidden_layers=args.layers)
    weights = random_weights(config, seed=args.seed)
    folder = (write_hf if args.layout == "hf" else write_original)(Path(args.folder), config, weights)
    print(f"wrote a tiny random gpt-oss ({args.layers} layers, {args.layout} layout) to {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
