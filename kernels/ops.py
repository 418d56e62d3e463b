"""The model's compute kernels: plain-torch reference versions and the choice of a set.

A :class:`Kernels` is the set a :class:`~.model.Transformer` computes with, one field per
kernel; the model takes it once, when it is built (``Transformer(config, kernels)``,
``from_checkpoint(..., kernels=)``; :func:`kernels_for` picks by device), and calls
``self.kernels.moe(...)`` and so on. :data:`TORCH` is the reference set (any device, any
dtype); :func:`triton_kernels` the Triton set (CUDA, or CPU tensors under
``TRITON_INTERPRET=1``), whose kernels fall back to the torch ones for float64 inputs::

    model = Transformer.from_checkpoint(path, device="cuda")          # Triton unless REFINERY_KERNELS=torch
    with model.using_kernels(ops.TORCH):                               # the reference, for a comparison
        logits = model(tokens)

Kernels and their contracts:

``rmsnorm(x [N, H], scale [H] float32, eps) -> [N, H]``: ``x * rsqrt(mean(x**2) + eps) * scale``,
computed in (at least) float32, in ``x``'s dtype.

``add_rmsnorm(x [N, H], delta [N, H], scale, eps) -> (x + delta, rmsnorm(x + delta))``: a residual
add (in ``x``'s dtype) fused with the norm that follows it.

``rope_qkv(qkv [N, (Hq + 2 Hkv) * D], cos [N, D/2], sin [N, D/2], n_heads, n_kv, k_dst [S, Hkv, D]
or a paged pool, v_dst, slots [N] long or None) -> q [N, Hq, D]``: half-split RoPE on the query and
key heads of the qkv projection; rotated keys and the values are stored into ``k_dst``/``v_dst``
at flat row ``slots[n]`` (row ``n`` when ``slots`` is None; a paged pool
``[num_blocks, block_size, Hkv, D]`` has flat slot ``block * block_size + offset``), the rotated
queries returned.

``route(router_logits [N, E], k) -> (expert_indices [N, k] long, expert_weights [N, k])``: the
top-k logits, highest first, and a softmax over those k values only (in the logits' dtype).

``moe(x [N, H], expert_indices [N, k] long, expert_weights [N, k], mlp1_blocks [E, 2I, H/32, 16],
mlp1_scales, mlp1_bias [E, 2I], mlp2_blocks [E, H, I/32, 16], mlp2_scales, mlp2_bias [E, H],
swiglu_limit, swiglu_alpha) -> [N, H]``: the routed experts, weights still in MXFP4 (the torch
version decodes one expert at a time with :func:`~.mxfp4.dequantize`).

``attention(q [n, Hq, D], k [m, Hkv, D], v [m, Hkv, D], sinks [Hq], q_pos [n], k_pos [m],
window, sm_scale) -> [n, Hq, D]``: one sequence, dense keys, explicit absolute positions
(ascending: the Triton kernel bounds each query block's key loop with them).

``paged_attention(q [N, Hq, D], k_pool, v_pool, sinks, block_table [B, max_blocks] (-1 = none),
query_start [B+1], seq_lens [B], window, sm_scale) -> [N, Hq, D]``: a packed batch, sequence
``b`` owning query rows ``query_start[b]:query_start[b+1]``, which are its last positions
(``seq_lens[b]`` counts cached keys including the new ones).
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, fields
from typing import Any, Callable, TypeVar

import torch

from . import mxfp4

# ---- reference kernels (torch) -----------------------------------------------------------


def rmsnorm_torch(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension in (at least) float32, returned in ``x``'s dtype."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * scale.to(xf.dtype)).to(x.dtype)


def add_rmsnorm_torch(
    x: torch.Tensor, delta: torch.Tensor, scale: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, rmsnorm(x + delta))``."""
    r = x + delta
    return r, rmsnorm_torch(r, scale, eps)


def rotate_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [N, heads, D]`` by ``cos``/``sin [N, D/2]``: ``[x1 cos - x2 sin, x2 cos + x1 sin]``
    in (at least) float32, returned in ``x``'s dtype."""
    x1, x2 = x.to(torch.promote_types(x.dtype, torch.float32)).chunk(2, dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def rope_qkv_torch(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    n_heads: int,
    n_kv: int,
    k_dst: torch.Tensor,
    v_dst: torch.Tensor,
    slots: torch.Tensor | None,
) -> torch.Tensor:
    """Split ``qkv``, rotate queries and keys, store keys and values (``write_kv`` for slots)."""
    n, d = qkv.shape[0], k_dst.shape[-1]
    q = qkv[:, : n_heads * d].reshape(n, n_heads, d)
    k = qkv[:, n_heads * d : (n_heads + n_kv) * d].reshape(n, n_kv, d)
    v = qkv[:, (n_heads + n_kv) * d :].reshape(n, n_kv, d)
    q, k = rotate_half_split(q, cos, sin), rotate_half_split(k, cos, sin)
    if slots is None:
        k_dst.view(-1, n_kv, d)[:n] = k
        v_dst.view(-1, n_kv, d)[:n] = v
    else:
        write_kv_torch(k_dst, v_dst, k, v, slots)
    return q


def swiglu(h: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU on interleaved ``[gate, linear]`` columns of ``h [N, 2I]``."""
    gate, lin = h[..., 0::2], h[..., 1::2]
    gate = gate.clamp(max=limit)
    lin = lin.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (lin + 1)


def route_torch(router_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` experts per row (sorted, highest first) and a softmax over their logits."""
    top = torch.topk(router_logits, k=k, dim=-1, sorted=True)
    acc = torch.promote_types(router_logits.dtype, torch.float32)
    return top.indices, torch.softmax(top.values.to(acc), dim=-1).to(router_logits.dtype)


def moe_torch(
    x: torch.Tensor,
    expert_indices: torch.Tensor,
    expert_weights: torch.Tensor,
    mlp1_blocks: torch.Tensor,
    mlp1_scales: torch.Tensor,
    mlp1_bias: torch.Tensor,
    mlp2_blocks: torch.Tensor,
    mlp2_scales: torch.Tensor,
    mlp2_bias: torch.Tensor,
    swiglu_limit: float,
    swiglu_alpha: float,
) -> torch.Tensor:
    """Routed experts, one expert at a time: each expert's weights are dequantized only while
    its tokens are multiplied, so at most one expert is ever materialised."""
    out = torch.zeros_like(x)
    flat_experts = expert_indices.reshape(-1)
    order = torch.argsort(flat_experts, stable=True)
    counts = torch.bincount(flat_experts, minlength=mlp1_blocks.shape[0]).tolist()
    token_of = order // expert_indices.shape[1]
    weight_of = expert_weights.reshape(-1)[order]
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        tokens = token_of[start : start + count]
        weights = weight_of[start : start + count]
        start += count
        w1 = mxfp4.dequantize(mlp1_blocks[e], mlp1_scales[e], x.dtype)  # [2I, H]
        h = torch.nn.functional.linear(x[tokens], w1, mlp1_bias[e])
        del w1
        a = swiglu(h, swiglu_limit, swiglu_alpha)
        w2 = mxfp4.dequantize(mlp2_blocks[e], mlp2_scales[e], x.dtype)  # [H, I]
        y = torch.nn.functional.linear(a, w2, mlp2_bias[e])
        del w2
        out.index_put_((tokens,), y * weights.unsqueeze(-1).to(y.dtype), accumulate=True)
    return out


def attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    window: int | None,
    sm_scale: float,
    query_chunk: int = 1024,
) -> torch.Tensor:
    """Causal (optionally banded) attention with per-head sink logits, computed in (at least) float32.

    A key at ``kp`` is visible to a query at ``qp`` iff ``qp - window < kp <= qp``. The sink
    ``S_h`` only enlarges the softmax denominator by ``exp(S_h)``.
    """
    n_heads, n_kv = q.shape[1], k.shape[1]
    group = n_heads // n_kv
    acc = torch.promote_types(q.dtype, torch.float32)  # float32, or float64 for a float64 model
    kf = k.to(acc).repeat_interleave(group, dim=1)  # [m, Hq, D]
    vf = v.to(acc).repeat_interleave(group, dim=1)
    sink = sinks.to(acc).reshape(n_heads, 1, 1)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for s in range(0, q.shape[0], query_chunk):
        qc, qp = q[s : s + query_chunk].to(acc), q_pos[s : s + query_chunk]
        scores = torch.einsum("qhd,khd->hqk", qc, kf) * sm_scale  # [Hq, n, m]
        visible = k_pos.unsqueeze(0) <= qp.unsqueeze(1)
        if window:
            visible &= k_pos.unsqueeze(0) > (qp.unsqueeze(1) - window)
        scores = scores.masked_fill(~visible, float("-inf"))
        scores = torch.cat([scores, sink.expand(-1, scores.shape[1], 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :-1]
        out[s : s + query_chunk] = torch.einsum("hqk,khd->qhd", probs, vf).to(q.dtype)
    return out


def write_kv_torch(
    k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Scatter ``k``/``v`` rows into the paged pools at flat ``slots``."""
    k_pool.view(-1, *k_pool.shape[2:]).index_copy_(0, slots, k.to(k_pool.dtype))
    v_pool.view(-1, *v_pool.shape[2:]).index_copy_(0, slots, v.to(v_pool.dtype))


def paged_attention_torch(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    sinks: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int | None,
    sm_scale: float,
) -> torch.Tensor:
    """Gather each sequence's live keys from its blocks, then run :func:`attention_torch`."""
    block_size = k_pool.shape[1]
    flat_k = k_pool.view(-1, *k_pool.shape[2:])
    flat_v = v_pool.view(-1, *v_pool.shape[2:])
    out = torch.empty_like(q)
    starts, lens = query_start.tolist(), seq_lens.tolist()
    for b in range(len(lens)):
        q0, q1, total = starts[b], starts[b + 1], lens[b]
        if q1 == q0:
            continue
        first_q = total - (q1 - q0)
        lo = max(0, first_q - window + 1) if window else 0
        k_pos = torch.arange(lo, total, device=q.device)
        blocks = block_table[b, k_pos // block_size]
        if bool((blocks < 0).any()):
            raise RuntimeError("paged attention reached a freed or unallocated KV block")
        slots = blocks * block_size + k_pos % block_size
        q_pos = torch.arange(first_q, total, device=q.device)
        out[q0:q1] = attention_torch(q[q0:q1], flat_k[slots], flat_v[slots], sinks, q_pos, k_pos, window, sm_scale)
    return out


# ---- the sets ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Kernels:
    """The kernels a model computes with (contracts above); ``name`` says which set."""

    name: str
    rmsnorm: Callable[..., torch.Tensor]
    add_rmsnorm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rope_qkv: Callable[..., torch.Tensor]
    route: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    moe: Callable[..., torch.Tensor]
    attention: Callable[..., torch.Tensor]
    paged_attention: Callable[..., torch.Tensor]

    def replace(self, name: str | None = None, **kernels: Callable[..., Any]) -> "Kernels":
        """This set with some kernels replaced (a spy, an experiment)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return Kernels(**{**values, **kernels, "name": name or f"{self.name}+{','.join(sorted(kernels))}"})


TORCH = Kernels(
    name="torch",
    rmsnorm=rmsnorm_torch,
    add_rmsnorm=add_rmsnorm_torch,
    rope_qkv=rope_qkv_torch,
    route=route_torch,
    moe=moe_torch,
    attention=attention_torch,
    paged_attention=paged_attention_torch,
)


_Out = TypeVar("_Out")


def _with_fallback(fast: Callable[..., _Out], reference: Callable[..., _Out], supported: tuple[torch.dtype, ...]
                   ) -> Callable[..., _Out]:
    """``fast`` for inputs in ``supported`` dtypes (judged by the first argument), else ``reference``."""

    def run(first: torch.Tensor, *args: Any, **kwargs: Any) -> _Out:
        fn = fast if first.dtype in supported else reference
        return fn(first, *args, **kwargs)

    run.__name__ = run.__qualname__ = getattr(fast, "__name__", "kernel")
    run.__doc__ = fast.__doc__
    return run


def triton_kernels() -> Kernels:
    """The Triton set (imports triton); float64 inputs, which they do not compute in, take the
    torch kernels. Set ``TRITON_INTERPRET=1`` before the first call to run them on CPU tensors
    (:func:`~.interpret.interpreted_triton_kernels` does that)."""
    from . import triton_attention, triton_moe, triton_norm, triton_rope  # lazy: triton (the torch set needs none)

    moe_dtypes, attention_dtypes = triton_moe.SUPPORTED_DTYPES, triton_attention.SUPPORTED_DTYPES
    return Kernels(
        name="triton",
        rmsnorm=_with_fallback(triton_norm.rmsnorm_triton, rmsnorm_torch, moe_dtypes),
        add_rmsnorm=_with_fallback(triton_norm.add_rmsnorm_triton, add_rmsnorm_torch, moe_dtypes),
        rope_qkv=_with_fallback(triton_rope.rope_qkv_triton, rope_qkv_torch, moe_dtypes),
        route=_with_fallback(triton_moe.route_triton, route_torch, moe_dtypes),
        moe=_with_fallback(triton_moe.moe_triton, moe_torch, moe_dtypes),
        attention=_with_fallback(triton_attention.attention_triton, attention_torch, attention_dtypes),
        paged_attention=_with_fallback(triton_attention.paged_attention_triton, paged_attention_torch,
                                       attention_dtypes),
    )


def triton_on_cuda() -> bool:
    """Whether CUDA tensors get the Triton set: a CUDA device, triton installed and no
    ``REFINERY_KERNELS=torch``."""
    return (
        torch.cuda.is_available()
        and importlib.util.find_spec("triton") is not None
        and os.environ.get("REFINERY_KERNELS", "triton") != "torch"
    )


def kernels_for(device: torch.device | str) -> Kernels:
    """The set for a model on ``device``: Triton on CUDA (see :func:`triton_on_cuda`), else :data:`TORCH`."""
    return triton_kernels() if torch.device(device).type == "cuda" and triton_on_cuda() else TORCH
