"""Read gpt-oss checkpoints in either layout into the engine's parameter names.

* Hugging Face: ``config.json`` + ``model.safetensors`` or ``model-*.safetensors`` with
  ``model.safetensors.index.json``; ``model.layers.N.*`` names, separate q/k/v projections,
  MXFP4 experts as ``gate_up_proj_blocks``/``_scales`` and ``down_proj_blocks``/``_scales``.
* OpenAI original: ``config.json`` of ModelConfig fields + ``*.safetensors`` with
  ``block.N.*`` names (``mlp1_weight.blocks`` ...). A folder holding only ``original/`` is
  read from there.

Engine names are the original ones, except ``mlpK_weight.{blocks,scales}`` ->
``mlpK_{blocks,scales}``. Tensors are read one at a time; experts stay packed (uint8).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from .config import ModelConfig, is_hf_config

HF = "hf"
ORIGINAL = "original"

_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn.norm.scale",
    "self_attn.o_proj.weight": "attn.out.weight",
    "self_attn.o_proj.bias": "attn.out.bias",
    "self_attn.sinks": "attn.sinks",
    "post_attention_layernorm.weight": "mlp.norm.scale",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.bias": "mlp.gate.bias",
    "mlp.experts.gate_up_proj_blocks": "mlp.mlp1_blocks",
    "mlp.experts.gate_up_proj_scales": "mlp.mlp1_scales",
    "mlp.experts.gate_up_proj_bias": "mlp.mlp1_bias",
    "mlp.experts.down_proj_blocks": "mlp.mlp2_blocks",
    "mlp.experts.down_proj_scales": "mlp.mlp2_scales",
    "mlp.experts.down_proj_bias": "mlp.mlp2_bias",
}
_HF_TOP_NAMES = {
    "model.embed_tokens.weight": "embedding.weight",
    "model.norm.weight": "norm.scale",
    "lm_head.weight": "unembedding.weight",
}
_QKV = re.compile(r"self_attn\.([qkv])_proj\.(weight|bias)")


def checkpoint_files(path: str | os.PathLike[str]) -> tuple[str, Path, list[Path]]:
    """(layout, folder, safetensors files) of a checkpoint folder."""
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
        for name in names:  # an index names files of its own folder: never an absolute path or a '..' escape
            if not isinstance(name, str) or Path(name).is_absolute() or ".." in Path(name).parts or not name:
                raise ValueError(f"{index}: refusing weight file {name!r}: not a file of the checkpoint folder")
        return HF, folder, [folder / name for name in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files and (folder / "original").is_dir():
        return checkpoint_files(folder / "original")
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    with safe_open(str(files[0]), framework="pt") as f:
        keys = list(f.keys())
    hf = any(k.startswith(("model.", "lm_head.")) for k in keys)
    return (HF if hf else ORIGINAL), folder, files


def read_config(folder: Path) -> ModelConfig:
    raw = json.loads((folder / "config.json").read_text())
    return ModelConfig.from_hf_dict(raw) if is_hf_config(raw) else ModelConfig.from_dict(raw)


def _raw_tensors(files: list[Path], device: str) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt", device=device) as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def _original_name(key: str) -> str:
    return re.sub(r"\.(mlp[12])_weight\.(blocks|scales)$", r".\1_\2", key)


def iter_checkpoint(path: str | os.PathLike[str], device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(engine name, tensor)`` pairs, tensors as stored (dtype unchanged)."""
    layout, _, files = checkpoint_files(path)
    if layout == ORIGINAL:
        for key, tensor in _raw_tensors(files, device):
            yield _original_name(key), tensor
        return
    pending_qkv: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _raw_tensors(files, device):
        if key in _HF_TOP_NAMES:
            yield _HF_TOP_NAMES[key], tensor
            continue
        match = _HF_LAYER.fullmatch(key)
        if match is None:
            raise KeyError(f"unexpected tensor {key!r} in a Hugging Face gpt-oss checkpoint")
        layer, rest = match.groups()
        qkv = _QKV.fullmatch(rest)
        if qkv is not None:
            name = f"block.{layer}.attn.qkv.{qkv.group(2)}"
            parts = pending_qkv.setdefault(name, {})
            parts[qkv.group(1)] = tensor
            if len(parts) == 3:
                yield name, torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
                del pending_qkv[name]
            continue
        if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            raise NotImplementedError(
                f"{key}: this checkpoint has dequantized experts; the engine reads MXFP4 ones"
            )
        if rest not in _HF_LAYER_NAMES:
            raise KeyError(f"unexpected tensor {key!r} in a Hugging Face gpt-oss checkpoint")
        yield f"block.{layer}.{_HF_LAYER_NAMES[rest]}", tensor
    if pending_qkv:
        raise KeyError(f"incomplete q/k/v projections: {sorted(pending_qkv)}")
