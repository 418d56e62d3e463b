"""gpt-oss's routed experts in Triton, weights kept in MXFP4 end to end.

Three steps, each a plain function the registry (``ops``) can hand out:

1. :func:`route_triton` — per token, the top-k router logits (sorted, highest first) and a
   softmax over those k values only (one program per token).
2. :func:`group_by_expert` — (token, slot) pairs sorted by expert, each expert's run padded
   to a multiple of ``block_m`` rows, plus the expert of each ``block_m`` row block. Pure
   torch on the device and free of host syncs, so the launch grid is an upper bound and
   blocks past the last expert exit at once.
3. :func:`moe_triton` — two grouped matmuls. Each program owns ``block_m`` rows of one expert
   and decodes that expert's MXFP4 bytes tile by tile in registers (FP4 e2m1 nibbles times an
   e8m0 scale per 32 weights); no bf16 copy of an expert ever exists. The first matmul's
   epilogue adds the bias and applies the clamped SwiGLU to the interleaved (gate, linear)
   columns; the second's adds the bias, multiplies by the token's gate weight and writes one
   row per (token, slot), which a final sum over the k slots combines (deterministic, no
   atomics).

Layouts (see ``mxfp4``): a weight ``[rows, K]`` is ``K/2`` bytes per row, element ``k`` in
byte ``k // 2`` (low nibble for even ``k``), scale ``k // 32``. A matmul over K therefore
runs as ``x[:, even] @ W_lo + x[:, odd] @ W_hi`` over byte columns, without interleaving.

Compute dtypes: bfloat16, float16 and float32 (float32 products use IEEE fp32 dots). Under
``TRITON_INTERPRET=1``, whose ``tl.dot`` mishandles 16-bit floats, dot operands are widened
to float32 first: exact for bf16/fp16 values, so the result is what the GPU's 16-bit MMA with
float32 accumulation computes.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # what @triton.jit decides on import
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def dot_dtype(dtype: torch.dtype):
    """The ``tl`` dtype that dot operands are cast to for a ``dtype`` computation."""
    return tl.float32 if INTERPRETED else _TL_DTYPES[dtype]


# ---- MXFP4 decode (in registers) --------------------------------------------------------


@triton.jit
def _e2m1(nibble):
    """FP4 e2m1 nibble (int32, 0..15) -> float32, built from bits: exact."""
    mag = nibble & 7
    e = mag >> 1
    m = mag & 1
    bits = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22))
    bits = bits | ((nibble & 8) << 28)  # bit 3 of the nibble is the sign
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e8m0(scale):
    """E8M0 scale byte (int32) -> 2**(scale - 127) as float32; 0 -> 2**-127, 255 -> NaN."""
    bits = tl.where(scale == 0, 1 << 22, tl.where(scale == 255, 0x7FC00000, scale << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _decode_pair(byte, scale, dtype: tl.constexpr):
    """Bytes and their scales (same shape) -> (even-k weights, odd-k weights) in ``dtype``."""
    b = byte.to(tl.int32)
    s = _e8m0(scale.to(tl.int32))
    return (_e2m1(b & 15) * s).to(dtype), (_e2m1(b >> 4) * s).to(dtype)


@triton.jit
def _mxfp4_matmul(a_ptr, a_row_off, a_mask, w_blocks_ptr, w_scales_ptr, w_row, w_mask, K,
                  acc, BLOCK_KB: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr):
    """acc[m, n] += sum_k a[m, k] * W[w_row[n], k], W in MXFP4; a rows at ``a_ptr + a_row_off``
    (contiguous along k). ``w_blocks_ptr``/``w_scales_ptr`` point at the expert's first row."""
    kb_total = K // 2  # bytes per weight row
    groups = K // 32
    for kb0 in range(0, kb_total, BLOCK_KB):
        kb = kb0 + tl.arange(0, BLOCK_KB)
        k_ok = kb < kb_total
        a_lo = tl.load(a_ptr + a_row_off[:, None] + 2 * kb[None, :], mask=a_mask[:, None] & k_ok[None, :], other=0.0)
        a_hi = tl.load(a_ptr + a_row_off[:, None] + 2 * kb[None, :] + 1, mask=a_mask[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & w_mask[None, :]
        byte = tl.load(w_blocks_ptr + w_row[None, :] * kb_total + kb[:, None], mask=w_ok, other=0)
        scale = tl.load(w_scales_ptr + w_row[None, :] * groups + (kb // 16)[:, None], mask=w_ok, other=127)
        w_lo, w_hi = _decode_pair(byte, scale, DOT)
        acc = tl.dot(a_lo.to(DOT), w_lo, acc, input_precision=PRECISION)
        acc = tl.dot(a_hi.to(DOT), w_hi, acc, input_precision=PRECISION)
    return acc


# ---- kernels ----------------------------------------------------------------------------


@triton.jit
def _route_kernel(logits_ptr, idx_ptr, weight_ptr, E, stride_n,
                  TOPK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + row * stride_n + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
    kk = tl.arange(0, BLOCK_K)
    top_v = tl.full([BLOCK_K], float("-inf"), tl.float32)
    top_i = tl.zeros([BLOCK_K], tl.int32)
    for j in tl.static_range(TOPK):
        best = tl.max(x, axis=0)
        # lowest index among equal maxima
        at = tl.min(tl.where(x == best, offs, BLOCK_E), axis=0)
        top_v = tl.where(kk == j, best, top_v)
        top_i = tl.where(kk == j, at, top_i)
        x = tl.where(offs == at, float("-inf"), x)
    p = tl.exp(top_v - tl.max(top_v, axis=0))
    p = p / tl.sum(p, axis=0)
    keep = kk < TOPK
    tl.store(idx_ptr + row * TOPK + kk, top_i.to(tl.int64), mask=keep)
    tl.store(weight_ptr + row * TOPK + kk, p.to(weight_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _mlp1_kernel(x_ptr, rows_ptr, block_expert_ptr, blocks_ptr, scales_ptr, bias_ptr, act_ptr,
                 n_rows, stride_x, H, I, limit, alpha,
                 TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_KB: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr):
    """act[r, j] = swiglu(x[token(r)] @ W1_e[2j:2j+2]^T + b1_e[2j:2j+2]) for the rows r of one block."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    e = e.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row = tl.load(rows_ptr + offs_m)
    m_ok = row < n_rows
    token = tl.where(m_ok, row // TOPK, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    w_blocks = blocks_ptr + e * (2 * I) * (H // 2)
    w_scales = scales_ptr + e * (2 * I) * (H // 32)
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_lin = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    a_off = token.to(tl.int64) * stride_x
    acc_gate = _mxfp4_matmul(x_ptr, a_off, m_ok, w_blocks, w_scales, 2 * offs_n, n_ok, H, acc_gate,
                             BLOCK_KB, PRECISION, DOT)
    acc_lin = _mxfp4_matmul(x_ptr, a_off, m_ok, w_blocks, w_scales, 2 * offs_n + 1, n_ok, H, acc_lin,
                            BLOCK_KB, PRECISION, DOT)
    gate = acc_gate + tl.load(bias_ptr + e * 2 * I + 2 * offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    lin = acc_lin + tl.load(bias_ptr + e * 2 * I + 2 * offs_n + 1, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    gate = tl.minimum(gate, limit)
    lin = tl.minimum(tl.maximum(lin, -limit), limit)
    act = gate * tl.sigmoid(alpha * gate) * (lin + 1.0)
    out = act_ptr + offs_m.to(tl.int64)[:, None] * I + offs_n[None, :]
    tl.store(out, act.to(act_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _mlp2_kernel(act_ptr, rows_ptr, block_expert_ptr, gate_w_ptr, blocks_ptr, scales_ptr, bias_ptr, out_ptr,
                 n_rows, H, I,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_KB: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr):
    """out[row(r)] = w(row(r)) * (act[r] @ W2_e^T + b2_e): one output row per (token, slot)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    e = e.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row = tl.load(rows_ptr + offs_m)
    m_ok = row < n_rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc = _mxfp4_matmul(act_ptr, offs_m.to(tl.int64) * I, m_ok,
                        blocks_ptr + e * H * (I // 2), scales_ptr + e * H * (I // 32),
                        offs_n, n_ok, I, acc, BLOCK_KB, PRECISION, DOT)
    y = acc + tl.load(bias_ptr + e * H + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    w = tl.load(gate_w_ptr + row, mask=m_ok, other=0.0).to(tl.float32)
    y = y * w[:, None]
    dst = out_ptr + tl.where(m_ok, row, 0).to(tl.int64)[:, None] * H + offs_n[None, :]
    tl.store(dst, y, mask=m_ok[:, None] & n_ok[None, :])


# ---- host side --------------------------------------------------------------------------


def route_triton(router_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` experts of each row of ``router_logits [N, E]`` (highest first; ties to the lower
    index) and their softmax weights ``[N, k]`` (in the logits' dtype)."""
    n, e = router_logits.shape
    logits = router_logits.contiguous()
    idx = torch.empty((n, k), dtype=torch.long, device=logits.device)
    weights = torch.empty((n, k), dtype=logits.dtype, device=logits.device)
    if n:
        _route_kernel[(n,)](
            logits, idx, weights, e, logits.stride(0),
            TOPK=k, BLOCK_E=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(k),
        )
    return idx, weights


def group_by_expert(
    expert_indices: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, block_expert) for the grouped matmuls, computed on the device without host syncs.

    ``rows [num_blocks * block_m]``: flat (token * k + slot) indices sorted by expert, each
    expert's run padded to a multiple of ``block_m`` with the sentinel ``N * k``.
    ``block_expert [num_blocks]``: the expert of each row block, ``-1`` past the last one.
    ``num_blocks`` is the bound ``min(N*k, (N*k + E*(block_m - 1)) // block_m)``.
    """
    flat = expert_indices.reshape(-1)
    n = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    run_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n, device=device) - run_start[sorted_experts]
    num_blocks = max(1, min(n, (n + num_experts * (block_m - 1)) // block_m))
    rows = torch.full((num_blocks * block_m,), n, dtype=torch.long, device=device)
    rows[pad_start[sorted_experts] + rank] = order
    block_first_row = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(pad_end, block_first_row, right=True)
    block_expert = torch.where(block_expert >= num_experts, -1, block_expert)
    return rows, block_expert


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def moe_triton(
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
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 128,
) -> torch.Tensor:
    """The ``moe`` kernel (contract in ``ops``): routed experts with MXFP4 weights decoded inside
    the matmuls. ``block_k`` counts weights (a multiple of 32)."""
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"moe_triton computes in {SUPPORTED_DTYPES}, not {x.dtype}")
    if block_k % 32:
        raise ValueError(f"block_k {block_k} is not a multiple of 32")
    n, hidden = x.shape
    topk = expert_indices.shape[1]
    num_experts, two_i = mlp1_blocks.shape[0], mlp1_blocks.shape[1]
    inter = two_i // 2
    if n == 0:
        return torch.zeros_like(x)
    if block_m is None:
        block_m = 16 if n * topk <= 32 * num_experts else 64
    x = x.contiguous()
    rows, block_expert = group_by_expert(expert_indices, num_experts, block_m)
    num_blocks = block_expert.shape[0]
    act = torch.empty((num_blocks * block_m, inter), dtype=x.dtype, device=x.device)
    precision = _precision(x.dtype)
    _mlp1_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, rows, block_expert, mlp1_blocks, mlp1_scales, mlp1_bias, act,
        n * topk, x.stride(0), hidden, inter, float(swiglu_limit), float(swiglu_alpha),
        TOPK=topk, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KB=block_k // 2, PRECISION=precision,
        DOT=dot_dtype(x.dtype),
    )
    slots = torch.empty((n * topk, hidden), dtype=torch.float32, device=x.device)
    gate_w = expert_weights.reshape(-1).contiguous()
    _mlp2_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        act, rows, block_expert, gate_w, mlp2_blocks, mlp2_scales, mlp2_bias, slots,
        n * topk, hidden, inter,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KB=block_k // 2, PRECISION=precision,
        DOT=dot_dtype(x.dtype),
    )
    return slots.view(n, topk, hidden).sum(dim=1).to(x.dtype)
