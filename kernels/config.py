"""gpt-oss model configuration, read from either checkpoint layout.

No torch here: pipelines may read a checkpoint's configuration without the inference extra.

* OpenAI's original layout: ``config.json`` holds exactly the :class:`ModelConfig` fields.
* Hugging Face layout: ``config.json`` is a ``GptOssConfig`` (``num_local_experts``,
  ``num_experts_per_tok``, ``rope_scaling`` or, in newer transformers, ``rope_parameters``).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass
class ModelConfig:
    """The fields of OpenAI's original ``config.json`` plus a few the HF config carries."""

    num_hidden_layers: int = 36
    num_experts: int = 128
    experts_per_token: int = 4
    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880
    swiglu_limit: float = 7.0
    head_dim: int = 64
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    sliding_window: int = 128
    initial_context_length: int = 4096
    rope_theta: float = 150000.0
    rope_scaling_factor: float = 32.0
    rope_ntk_alpha: float = 1.0
    rope_ntk_beta: float = 32.0
    rms_norm_eps: float = 1e-5
    swiglu_alpha: float = 1.702
    # One entry per layer, SLIDING or FULL. Empty means the original rule: even layers slide.
    layer_types: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = [SLIDING if i % 2 == 0 else FULL for i in range(self.num_hidden_layers)]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"{len(self.layer_types)} layer_types for {self.num_hidden_layers} layers")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_size % 32 or self.intermediate_size % 32:
            raise ValueError("MXFP4 experts need hidden_size and intermediate_size divisible by 32")

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends to a banded window of ``sliding_window`` keys."""
        return bool(self.sliding_window) and self.layer_types[layer] == SLIDING

    # ---- original layout ----------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Build from an original-layout ``config.json`` (unknown keys are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        """The original-layout ``config.json`` (without the HF-only ``layer_types``)."""
        out = dataclasses.asdict(self)
        default_types = [SLIDING if i % 2 == 0 else FULL for i in range(self.num_hidden_layers)]
        if out["layer_types"] == default_types:
            del out["layer_types"]
        for key in ("rms_norm_eps", "swiglu_alpha"):
            if out[key] == getattr(ModelConfig, key):
                del out[key]
        return out

    # ---- Hugging Face layout --------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face ``GptOssConfig`` ``config.json``."""
        rope = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
        theta: Any = raw.get("rope_theta", rope.get("rope_theta", 150000.0))
        rope_type = rope.get("rope_type", rope.get("type", "yarn" if rope else "default"))
        yarn = rope_type == "yarn"
        return cls(
            num_hidden_layers=raw["num_hidden_layers"],
            num_experts=raw.get("num_local_experts", raw.get("num_experts", 128)),
            experts_per_token=raw.get("num_experts_per_tok", raw.get("experts_per_token", 4)),
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            swiglu_limit=raw.get("swiglu_limit", 7.0),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            sliding_window=raw.get("sliding_window") or 0,
            initial_context_length=rope.get(
                "original_max_position_embeddings", raw.get("initial_context_length", 4096)
            ),
            rope_theta=float(theta),
            rope_scaling_factor=float(rope.get("factor", 1.0)) if yarn else 1.0,
            rope_ntk_alpha=float(rope.get("beta_slow", 1.0)),
            rope_ntk_beta=float(rope.get("beta_fast", 32.0)),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            swiglu_alpha=raw.get("swiglu_alpha", 1.702),
            layer_types=list(raw.get("layer_types") or []),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A Hugging Face ``config.json`` for these weights (MXFP4 experts)."""
        return {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "num_hidden_layers": self.num_hidden_layers,
            "num_local_experts": self.num_experts,
            "num_experts_per_tok": self.experts_per_token,
            "experts_per_token": self.experts_per_token,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "swiglu_limit": self.swiglu_limit,
            "head_dim": self.head_dim,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types),
            "initial_context_length": self.initial_context_length,
            "max_position_embeddings": 131072,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": self.rope_scaling_factor,
                "beta_fast": self.rope_ntk_beta,
                "beta_slow": self.rope_ntk_alpha,
                "truncate": False,
                "original_max_position_embeddings": self.initial_context_length,
            },
            "attention_bias": True,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
            "quantization_config": {
                "quant_method": "mxfp4",
                "modules_to_not_convert": [
                    "model.layers.*.self_attn",
                    "model.layers.*.mlp.router",
                    "model.embed_tokens",
                    "lm_head",
                ],
            },
        }


def is_hf_config(raw: dict[str, Any]) -> bool:
    """Whether a parsed ``config.json`` is a Hugging Face one (vs. OpenAI's original)."""
    return "model_type" in raw or "num_local_experts" in raw or "architectures" in raw


def load_config(path: str | os.PathLike[str]) -> ModelConfig:
    """Read ``config.json`` from a checkpoint folder (either layout)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    raw = json.loads(path.read_text())
    return ModelConfig.from_hf_dict(raw) if is_hf_config(raw) else ModelConfig.from_dict(raw)
