"""gpt-oss in one file: the forward pass and checkpoint loading (the continuous-batching
scheduler that drives it is :mod:`.batching`).

Each block is ``x = x + attention(norm(x))`` then ``x = x + moe(norm(x))``. Expert weights
stay MXFP4 (uint8 blocks + scales) in memory and are decoded inside the MoE kernel. The
kernels are chosen once, when the model is built: ``ops.kernels_for(device)`` gives the
Triton set on CUDA and the torch reference set elsewhere (:mod:`.ops`); every module calls
its model's set by name (``self.kernels.moe(...)``).

    model = Transformer.from_checkpoint(path, device="cpu", dtype=torch.float32)
    logits = model(torch.tensor(tokens))                # [T, vocab], one sequence, no cache
    hidden = model(torch.tensor(tokens), return_hidden=[6, 12])   # {6: [T, H], 12: [T, H]}
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from . import ops
from .checkpoint import checkpoint_files, iter_checkpoint, read_config
from .config import ModelConfig
from .kv_cache import BatchView, PagedKVCache

# ---- building blocks ---------------------------------------------------------------------


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float32, or float64 for a float64 model."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: ops.Kernels) -> None:
        super().__init__()
        self.eps, self.kernels = eps, kernels
        self.scale = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rmsnorm(x, self.scale, self.eps)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + delta, self(x + delta))`` in one kernel."""
        return self.kernels.add_rmsnorm(x, delta, self.scale, self.eps)


class Residual:
    """The residual stream between blocks, ``x``, with the last block's output not yet added.

    ``stream.add(delta)`` is ``x = x + delta``; the add is done by the norm that reads the
    stream next (``stream.normed(norm)``, one ``add_rmsnorm`` launch for both), or by
    :meth:`value`. So a block reads as ``stream.add(f(stream.normed(norm)))``.
    """

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self.delta: torch.Tensor | None = None

    def add(self, delta: torch.Tensor) -> None:
        if self.delta is not None:
            self.x = self.x + self.delta
        self.delta = delta

    def normed(self, norm: RMSNorm) -> torch.Tensor:
        """``norm(x)``, first adding the pending output into ``x``."""
        if self.delta is None:
            normed: torch.Tensor = norm(self.x)
            return normed
        self.x, t = norm.add_forward(self.x, self.delta)
        self.delta = None
        return t

    def value(self) -> torch.Tensor:
        """The stream itself (``x`` plus any pending output), leaving the stream as it is."""
        return self.x if self.delta is None else self.x + self.delta

    def rows(self, rows: torch.Tensor) -> "Residual":
        """The stream at some token rows only."""
        out = Residual(self.x[rows])
        out.delta = None if self.delta is None else self.delta[rows]
        return out


def yarn_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """YaRN-scaled inverse frequencies [head_dim/2] (float64) and the cos/sin concentration."""
    d = config.head_dim
    freq = config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    factor = config.rope_scaling_factor
    if factor <= 1.0:
        return 1.0 / freq, 1.0
    ctx, theta = config.initial_context_length, config.rope_theta
    low = d / 2 * math.log(ctx / (config.rope_ntk_beta * 2 * math.pi)) / math.log(theta)
    high = d / 2 * math.log(ctx / (config.rope_ntk_alpha * 2 * math.pi)) / math.log(theta)
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    inv_freq = ramp / (factor * freq) + (1 - ramp) / freq
    return inv_freq, 0.1 * math.log(factor) + 1.0


class Rotary(nn.Module):
    """Half-split RoPE at absolute positions, with YaRN scaling (the rotation: :func:`ops.rotate_half_split`)."""

    inv_freq: torch.Tensor  # a buffer

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        inv_freq, self.concentration = yarn_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq.to(dtype), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(self.inv_freq.dtype).unsqueeze(-1) * self.inv_freq  # [N, D/2]
        return angles.cos() * self.concentration, angles.sin() * self.concentration



@dataclass
class StepContext:
    """What attention needs for one packed batch step through the paged cache."""

    cache: PagedKVCache
    views: dict[str, BatchView]


class AttentionBlock(nn.Module):
    """Grouped-query attention with per-head sinks, RoPE, and a sliding window on every other layer."""

    def __init__(self, config: ModelConfig, layer: int, kernels: ops.Kernels) -> None:
        super().__init__()
        self.layer, self.kernels = layer, kernels
        self.n_heads, self.n_kv, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.window = config.sliding_window if config.is_sliding(layer) else None
        self.sm_scale = 1.0 / math.sqrt(config.head_dim)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        qkv_dim = (self.n_heads + 2 * self.n_kv) * self.head_dim
        self.qkv = nn.Linear(config.hidden_size, qkv_dim, bias=True)
        self.sinks = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        self.out = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=True)

    def forward(
        self,
        t: torch.Tensor,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        step: StepContext | None = None,
    ) -> torch.Tensor:
        """What the block adds to the residual stream, from its normed input ``t [N, H]``: one
        sequence from position 0 (``step`` None), or a packed batch through the paged cache."""
        n, d = t.shape[0], self.head_dim
        qkv = self.qkv(t)
        if step is None:
            k = torch.empty((n, self.n_kv, d), dtype=qkv.dtype, device=qkv.device)
            v = torch.empty_like(k)
            q = self.kernels.rope_qkv(qkv, *rope, self.n_heads, self.n_kv, k, v, None)
            o = self.kernels.attention(q, k, v, self.sinks, positions, positions, self.window, self.sm_scale)
        else:
            k_pool, v_pool, _ = step.cache.pools(self.layer)
            view = step.views[step.cache.kind(self.layer)]
            q = self.kernels.rope_qkv(qkv, *rope, self.n_heads, self.n_kv, k_pool, v_pool, view.slots)
            o = self.kernels.paged_attention(
                q, k_pool, v_pool, self.sinks, view.block_table, view.query_start, view.seq_lens,
                self.window, self.sm_scale,
            )
        out: torch.Tensor = self.out(o.reshape(n, self.n_heads * d))
        return out


class MLPBlock(nn.Module):
    """Top-k routed MoE; expert weights are MXFP4 buffers, decoded inside the ``moe`` kernel."""

    def __init__(self, config: ModelConfig, kernels: ops.Kernels) -> None:
        super().__init__()
        self.kernels = kernels
        e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
        self.experts_per_token = config.experts_per_token
        self.swiglu_limit, self.swiglu_alpha = config.swiglu_limit, config.swiglu_alpha
        self.norm = RMSNorm(h, config.rms_norm_eps, kernels)
        self.gate = nn.Linear(h, e, bias=True)
        self.register_buffer("mlp1_blocks", torch.zeros(e, 2 * i, h // 32, 16, dtype=torch.uint8))
        self.register_buffer("mlp1_scales", torch.zeros(e, 2 * i, h // 32, dtype=torch.uint8))
        self.mlp1_bias = nn.Parameter(torch.zeros(e, 2 * i))
        self.register_buffer("mlp2_blocks", torch.zeros(e, h, i // 32, 16, dtype=torch.uint8))
        self.register_buffer("mlp2_scales", torch.zeros(e, h, i // 32, dtype=torch.uint8))
        self.mlp2_bias = nn.Parameter(torch.zeros(e, h))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """What the block adds to the residual stream, from its normed input ``t [N, H]``."""
        indices, weights = self.kernels.route(self.gate(t), self.experts_per_token)
        return self.kernels.moe(
            t, indices, weights,
            self.mlp1_blocks, self.mlp1_scales, self.mlp1_bias,
            self.mlp2_blocks, self.mlp2_scales, self.mlp2_bias,
            self.swiglu_limit, self.swiglu_alpha,
        )


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, kernels: ops.Kernels) -> None:
        super().__init__()
        self.attn = AttentionBlock(config, layer, kernels)
        self.mlp = MLPBlock(config, kernels)

    def forward(
        self,
        stream: Residual,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        step: StepContext | None = None,
    ) -> None:
        """``x = x + attn(norm(x))``, then ``x = x + mlp(norm(x))``, on the residual stream."""
        stream.add(self.attn(stream.normed(self.attn.norm), positions, rope, step))
        stream.add(self.mlp(stream.normed(self.mlp.norm)))


# ---- the model ---------------------------------------------------------------------------

# Kept in float32 whatever the compute dtype: small, and used in float32 math.
_FP32_SUFFIXES = ("norm.scale", "attn.sinks")


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, kernels: ops.Kernels = ops.TORCH) -> None:
        super().__init__()
        self.config, self.kernels = config, kernels
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.block = nn.ModuleList(TransformerBlock(config, i, kernels) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.unembedding = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = Rotary(config)

    @property
    def device(self) -> torch.device:
        return self.embedding.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding.weight.dtype

    def set_kernels(self, kernels: ops.Kernels) -> ops.Kernels:
        """Compute with ``kernels`` from now on; returns the set used until now."""
        previous = self.kernels
        for module in self.modules():
            if hasattr(module, "kernels"):  # one of ours: its kernels are an ops.Kernels, not a Tensor or Module
                ours: Any = module
                ours.kernels = kernels
        return previous

    @contextlib.contextmanager
    def using_kernels(self, kernels: ops.Kernels) -> Iterator["Transformer"]:
        """Compute with ``kernels`` inside the block (a comparison with the reference, a spy)."""
        previous = self.set_kernels(kernels)
        try:
            yield self
        finally:
            self.set_kernels(previous)

    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike[str],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        kernels: ops.Kernels | None = None,
    ) -> "Transformer":
        """Load either checkpoint layout. ``dtype`` is the compute dtype (experts stay MXFP4);
        ``kernels`` defaults to ``ops.kernels_for(device)``."""
        device = torch.device(device)
        _, folder, _ = checkpoint_files(path)
        config = read_config(folder)
        with torch.device("meta"):
            model = cls(config, kernels or ops.kernels_for(device))
        expected = model.state_dict()
        state: dict[str, torch.Tensor] = {}
        for name, tensor in iter_checkpoint(folder, device="cpu"):
            if name not in expected:
                raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
            if tuple(tensor.shape) != tuple(expected[name].shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}")
            if tensor.dtype == torch.uint8:
                target = torch.uint8
            elif name.endswith(_FP32_SUFFIXES):
                target = torch.float32
            else:
                target = dtype
            state[name] = tensor.to(device=device, dtype=target)
        missing = sorted(set(expected) - set(state))
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")
        model.load_state_dict(state, strict=True, assign=True)
        model.rotary = Rotary(config, _acc(dtype)).to(device)
        return model.eval().requires_grad_(False)

    def _run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        step: StepContext | None,
        last_layer: int,
        keep: set[int],
    ) -> tuple[Residual, dict[int, torch.Tensor]]:
        """(the residual stream after ``last_layer`` blocks, the streams asked for in ``keep``)."""
        stream = Residual(self.embedding(tokens))
        rope = self.rotary.cos_sin(positions)
        hidden = {0: stream.value()} if 0 in keep else {}
        for i, block in enumerate(self.block[:last_layer]):
            block(stream, positions, rope, step)
            if i + 1 in keep:
                hidden[i + 1] = stream.value()
        return stream, hidden

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, return_hidden: Sequence[int] | None = None
    ) -> torch.Tensor | dict[int, torch.Tensor]:
        """Logits ``[T, vocab]`` of one sequence ``tokens [T]`` from position 0, no cache.

        With ``return_hidden``, returns ``{i: [T, hidden]}`` instead: the residual stream after
        ``i`` blocks (0 = embeddings, ``num_hidden_layers`` or -1 = last block, before the
        final norm; keys are the non-negative indices); blocks past the deepest one asked for
        are not run, logits never computed.
        """
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        if tokens.dim() != 1:
            raise ValueError("tokens must be one sequence, shape [T]")
        positions = torch.arange(tokens.shape[0], device=self.device)
        if return_hidden is not None:
            n = self.config.num_hidden_layers
            keep = {int(i) + (n + 1 if int(i) < 0 else 0) for i in return_hidden}  # -1 -> n
            if any(not 0 <= i <= n for i in keep):
                raise ValueError(f"hidden state indices run from 0 to {n} (or -{n + 1} to -1)")
            _, hidden = self._run(tokens, positions, None, max(keep, default=0), keep)
            return hidden
        stream, _ = self._run(tokens, positions, None, self.config.num_hidden_layers, set())
        logits: torch.Tensor = self.unembedding(stream.normed(self.norm))
        return logits

    def hidden_states(self, tokens: torch.Tensor, layers: Sequence[int]) -> dict[int, torch.Tensor]:
        """Shorthand for ``model(tokens, return_hidden=layers)``."""
        hidden: dict[int, torch.Tensor] = self(tokens, return_hidden=layers)
        return hidden

    @torch.inference_mode()
    def forward_step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        step: StepContext,
        logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        """A packed multi-sequence step through the paged cache; logits of ``logit_rows`` only."""
        stream, _ = self._run(tokens, positions, step, self.config.num_hidden_layers, set())
        logits: torch.Tensor = self.unembedding(stream.rows(logit_rows).normed(self.norm))
        return logits
