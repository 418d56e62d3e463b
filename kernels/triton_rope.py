"""RoPE fused with the KV-cache write, in Triton: one launch per attention layer.

:func:`rope_qkv_triton` is the ``rope_qkv`` kernel. From the qkv projection's output
``qkv [N, (Hq + 2 Hkv) * D]`` it

* rotates the query heads and returns them as ``q [N, Hq, D]``;
* rotates the key heads and stores them, with the value heads as they are, straight into
  ``k_dst`` / ``v_dst [S, Hkv, D]`` at row ``slots[n]`` (a paged pool seen as flat slots), or
  at row ``n`` when ``slots`` is None (a dense buffer, for the cache-free forward).

Rotation is half-split: ``[x1 cos - x2 sin, x2 cos + x1 sin]`` with ``cos``/``sin [N, D/2]``
(float32, already multiplied by YaRN's concentration), computed in float32 and stored in the
destination's dtype. One program per token covers all of its heads.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launches import launch
from .triton_jit import jit
from .triton_moe import SUPPORTED_DTYPES


@jit
def _rope_qkv_kernel(qkv_ptr: tl.tensor, cos_ptr: tl.tensor, sin_ptr: tl.tensor, slots_ptr: tl.tensor, q_ptr: tl.tensor,
                     k_ptr: tl.tensor, v_ptr: tl.tensor, stride_qkv: tl.tensor, stride_cs: tl.tensor,
                     stride_q: tl.tensor, stride_k: tl.tensor, stride_v: tl.tensor, N_HEADS: tl.constexpr,
                     N_KV: tl.constexpr, HALF: tl.constexpr, BLOCK_QK: tl.constexpr, BLOCK_KV: tl.constexpr,
                     BLOCK_HALF: tl.constexpr, HAS_SLOTS: tl.constexpr) -> None:
    n = tl.program_id(0).to(tl.int64)
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + n).to(tl.int64)
    else:
        slot = n
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    c = tl.load(cos_ptr + n * stride_cs + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + n * stride_cs + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    # query and key heads: rotate
    h = tl.arange(0, BLOCK_QK)
    h_ok = (h < N_HEADS + N_KV)[:, None] & d_ok[None, :]
    src = qkv_ptr + n * stride_qkv + h[:, None] * (2 * HALF) + d[None, :]
    x1 = tl.load(src, mask=h_ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=h_ok, other=0.0).to(tl.float32)
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    is_q = (h < N_HEADS)[:, None]
    q_dst = q_ptr + n * stride_q + h[:, None] * (2 * HALF) + d[None, :]
    tl.store(q_dst, o1.to(q_ptr.dtype.element_ty), mask=h_ok & is_q)
    tl.store(q_dst + HALF, o2.to(q_ptr.dtype.element_ty), mask=h_ok & is_q)
    k_dst = k_ptr + slot * stride_k + (h - N_HEADS)[:, None] * (2 * HALF) + d[None, :]
    tl.store(k_dst, o1.to(k_ptr.dtype.element_ty), mask=h_ok & ~is_q)
    tl.store(k_dst + HALF, o2.to(k_ptr.dtype.element_ty), mask=h_ok & ~is_q)
    # value heads: copy
    j = tl.arange(0, BLOCK_KV)
    dd = tl.arange(0, 2 * BLOCK_HALF)
    v_ok = (j < N_KV)[:, None] & (dd < 2 * HALF)[None, :]
    v = tl.load(qkv_ptr + n * stride_qkv + (N_HEADS + N_KV + j)[:, None] * (2 * HALF) + dd[None, :],
                mask=v_ok, other=0.0)
    tl.store(v_ptr + slot * stride_v + j[:, None] * (2 * HALF) + dd[None, :], v.to(v_ptr.dtype.element_ty),
             mask=v_ok)


def rope_qkv_triton(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    n_heads: int,
    n_kv: int,
    k_dst: torch.Tensor,
    v_dst: torch.Tensor,
    slots: torch.Tensor | None,
) -> torch.Tensor:
    """The ``rope_qkv`` kernel (contract in ``ops``)."""
    if qkv.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"rope_qkv_triton computes in {SUPPORTED_DTYPES}, not {qkv.dtype}")
    n = qkv.shape[0]
    head_dim = k_dst.shape[-1]
    if qkv.shape[1] != (n_heads + 2 * n_kv) * head_dim or head_dim % 2:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {n_heads}+2x{n_kv} heads of {head_dim}")
    k_rows = k_dst.view(-1, n_kv, head_dim)
    v_rows = v_dst.view(-1, n_kv, head_dim)
    if k_rows.stride()[1:] != (head_dim, 1) or v_rows.stride()[1:] != (head_dim, 1):
        raise ValueError("k_dst and v_dst need contiguous [heads, head_dim] rows")
    qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    q = torch.empty((n, n_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if n:
        half = head_dim // 2
        launch(_rope_qkv_kernel, (n,), qkv, cos, sin, slots if slots is not None else qkv, q, k_rows, v_rows,
               qkv.stride(0), cos.stride(0), q.stride(0), k_rows.stride(0), v_rows.stride(0),
               N_HEADS=n_heads, N_KV=n_kv, HALF=half, BLOCK_QK=triton.next_power_of_2(n_heads + n_kv),
               BLOCK_KV=triton.next_power_of_2(n_kv), BLOCK_HALF=triton.next_power_of_2(half),
               HAS_SLOTS=slots is not None)
    return q
