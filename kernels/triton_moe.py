"""gpt-oss's routed experts in Triton, weights kept in MXFP4 end to end.

Plain functions that ``ops.triton_kernels`` puts in the Triton kernel set:

1. :func:`route_triton` — per token, the top-k router logits (sorted, highest first) and a
   softmax over those k values only (one program per token).
2. :func:`group_by_expert_triton` — (token, slot) pairs sorted by expert, each expert's run
   padded to a multiple of ``block_m`` rows, plus the expert of each ``block_m`` row block, in
   one single-program launch free of host syncs (:func:`group_by_expert` is the torch
   reference). The launch grid is an upper bound; blocks past the last expert exit at once.
3. :func:`moe_triton` — two grouped matmuls. Each program owns ``block_m`` rows of one expert
   and decodes that expert's MXFP4 bytes tile by tile in registers; no bf16 copy of an expert
   ever exists. bf16/fp16 activations use ``tl.dot_scaled`` (e2m1 weights, e8m0 scales: the
   compiler's own upcast, native on GPUs with MX tensor cores); float32 ones decode the nibbles
   with bit moves, one scale per 32 weights broadcast (:func:`_decode_tile`). mlp1 computes gate
   and linear columns in one pass and applies the clamped SwiGLU in its epilogue; mlp2 adds the
   bias, multiplies by the token's gate weight and writes one row per (token, slot) and K split
   (split-K when the batch is small); a last launch sums them (deterministic, no atomics).

Tiling (:class:`MoEConfig`) comes from :func:`moe_config`: ``block_m`` from the mean rows per
expert, split-K from how many programs the batch gives, or a tuned table keyed on (rows per
expert bucket, hidden, intermediate) that a GPU sweep fills (``moe_tune``).

Layouts (see ``mxfp4``): a weight ``[rows, K]`` is ``K/2`` bytes per row, element ``k`` in
byte ``k // 2`` (low nibble for even ``k``), scale ``k // 32``. The bit-decode path therefore
runs as ``x[:, even] @ W_lo + x[:, odd] @ W_hi`` over byte columns, without interleaving;
``tl.dot_scaled`` takes the bytes as they are (``[K/2, N]``, low nibble first).

Compute dtypes: bfloat16, float16 and float32 (float32 products use IEEE fp32 dots). Under
``TRITON_INTERPRET=1``, whose ``tl.dot`` mishandles 16-bit floats, dot operands are widened
to float32 first: exact for bf16/fp16 values, so the result is what the GPU's 16-bit MMA with
float32 accumulation computes.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from .launches import launch
from .triton_jit import jit

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # what @triton.jit decides on import
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The ``tl`` dtype that dot operands are cast to for a ``dtype`` computation."""
    return tl.float32 if INTERPRETED else _TL_DTYPES[dtype]


# ---- MXFP4 decode (in registers) --------------------------------------------------------


@jit
def _e8m0(scale: tl.tensor) -> tl.tensor:
    """E8M0 scale byte (int32) -> 2**(scale - 127) as float32; 0 -> 2**-127, 255 -> NaN."""
    bits = tl.where(scale == 0, 1 << 22, tl.where(scale == 255, 0x7FC00000, scale << 23))
    return bits.to(tl.float32, bitcast=True)


@jit
def _decode_tile(byte: tl.tensor, scale: tl.tensor, BLOCK_KB: tl.constexpr, BLOCK_N: tl.constexpr,
                 DOT: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    """``byte [BLOCK_KB, BLOCK_N]`` (uint8, 2 weights each) and ``scale [BLOCK_KB // 16, BLOCK_N]``
    (uint8, one per 32 weights) -> (even-k weights, odd-k weights), each ``[BLOCK_KB, BLOCK_N]``.

    Each scale is decoded once and broadcast over its 16 bytes. A nibble ``s e1 e0 m`` becomes
    float32 by moving its bits into place, ``s`` to bit 31 and ``e1 e0 m`` to bits 24..22: that
    is the e2m1 value times 2**-126 (0.5 lands on a subnormal, exact), which the scale, premultiplied
    by 2**126 in two exact steps, corrects. Five integer operations and two multiplies a weight.
    """
    b = byte.to(tl.int32)
    lo = (((b & 0x08) << 28) | ((b & 0x07) << 22)).to(tl.float32, bitcast=True)
    hi = (((b & 0x80) << 24) | ((b & 0x70) << 18)).to(tl.float32, bitcast=True)
    s = _e8m0(scale.to(tl.int32))  # [BLOCK_KB // 16, BLOCK_N]
    s = tl.reshape(tl.broadcast_to(s[:, None, :], (BLOCK_KB // 16, 16, BLOCK_N)), (BLOCK_KB, BLOCK_N))
    lo = (lo * 8.507059173023462e37) * s  # 2**126: exact, then the block's scale
    hi = (hi * 8.507059173023462e37) * s
    return lo.to(DOT), hi.to(DOT)


@jit
def _mxfp4_matmul(a_ptr: tl.tensor, a_row_off: tl.tensor, a_mask: tl.tensor, w_blocks_ptr: tl.tensor,
                  w_scales_ptr: tl.tensor, w_row: tl.tensor, w_mask: tl.tensor, k_lo: tl.tensor, k_hi: tl.tensor,
                  K: tl.tensor, acc: tl.tensor, BLOCK_KB: tl.constexpr, BLOCK_N: tl.constexpr, SCALED_DOT: tl.constexpr,
                  A_FORMAT: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr) -> tl.tensor:
    """acc[m, n] += sum_{k_lo <= k < k_hi} a[m, k] * W[w_row[n], k], W in MXFP4 with ``K`` columns.

    ``a`` rows at ``a_ptr + a_row_off`` (contiguous along k); ``w_blocks_ptr``/``w_scales_ptr``
    point at the expert's first row; ``k_lo`` is a multiple of ``2 * BLOCK_KB``. With
    ``SCALED_DOT`` the tile goes to ``tl.dot_scaled`` (e2m1 weights, e8m0 scales; activations as
    loaded, in ``A_FORMAT`` "bf16" or "fp16"), else it is decoded by :func:`_decode_tile` and
    multiplied as even and odd k.
    """
    kb_total = K // 2  # bytes per weight row
    groups = K // 32
    kb_end = k_hi // 2
    for kb0 in range(k_lo // 2, kb_end, BLOCK_KB):
        kb = kb0 + tl.arange(0, BLOCK_KB)
        k_ok = kb < kb_end
        w_ok = k_ok[:, None] & w_mask[None, :]
        byte = tl.load(w_blocks_ptr + w_row[None, :] * kb_total + kb[:, None], mask=w_ok, other=0)
        g = kb0 // 16 + tl.arange(0, BLOCK_KB // 16)
        g_ok = g < kb_end // 16
        if SCALED_DOT:
            k = 2 * kb0 + tl.arange(0, 2 * BLOCK_KB)
            a = tl.load(a_ptr + a_row_off[:, None] + k[None, :], mask=a_mask[:, None] & (k < k_hi)[None, :],
                        other=0.0)
            scale = tl.load(w_scales_ptr + w_row[:, None] * groups + g[None, :],
                            mask=w_mask[:, None] & g_ok[None, :], other=127)  # [N, BLOCK_KB // 16]
            # tl.constexpr(...) around the formats: compiled code wraps them already, but Triton
            # 3.7's interpreter hands dot_scaled bare strings, which it cannot read.
            acc = tl.dot_scaled(a, None, tl.constexpr(A_FORMAT), byte, scale, tl.constexpr("e2m1"), acc)
        else:
            a_lo = tl.load(a_ptr + a_row_off[:, None] + 2 * kb[None, :], mask=a_mask[:, None] & k_ok[None, :],
                           other=0.0)
            a_hi = tl.load(a_ptr + a_row_off[:, None] + 2 * kb[None, :] + 1, mask=a_mask[:, None] & k_ok[None, :],
                           other=0.0)
            scale = tl.load(w_scales_ptr + w_row[None, :] * groups + g[:, None],
                            mask=g_ok[:, None] & w_mask[None, :], other=127)  # [BLOCK_KB // 16, N]
            w_lo, w_hi = _decode_tile(byte, scale, BLOCK_KB, BLOCK_N, DOT)
            acc = tl.dot(a_lo.to(DOT), w_lo, acc, input_precision=PRECISION)
            acc = tl.dot(a_hi.to(DOT), w_hi, acc, input_precision=PRECISION)
    return acc


# ---- kernels ----------------------------------------------------------------------------


@jit
def _route_kernel(logits_ptr: tl.tensor, idx_ptr: tl.tensor, weight_ptr: tl.tensor, E: tl.tensor, stride_n: tl.tensor,
                  TOPK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr) -> None:
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


@jit(do_not_specialize=["n_rows", "num_rows"])
def _group_kernel(idx_ptr: tl.tensor, rows_ptr: tl.tensor, block_expert_ptr: tl.tensor, n_rows: tl.tensor,
                  num_rows: tl.tensor, E: tl.tensor, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                  CHUNK: tl.constexpr) -> None:
    """One program: :func:`group_by_expert`'s layout from the flat expert ids ``idx [n_rows]``.

    Pass 1 counts rows per expert; pass 2 puts row ``r`` at ``pad_start[e] + (rows of e before
    r)``, chunk by chunk (a running count per expert plus a rank within the chunk); pass 3
    writes the sentinel ``n_rows`` into every padding slot and the expert of each row block.
    Passes 2 and 3 write disjoint slots, so no barrier is needed between them.
    """
    ex = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, n_rows, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        e = tl.load(idx_ptr + offs, mask=offs < n_rows, other=BLOCK_E).to(tl.int32)
        counts += tl.sum((e[:, None] == ex[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, axis=0)
    pad_start = pad_end - padded
    seen = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, n_rows, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        ok = offs < n_rows
        e = tl.load(idx_ptr + offs, mask=ok, other=BLOCK_E).to(tl.int32)
        hit = (e[:, None] == ex[None, :]).to(tl.int32)  # [CHUNK, BLOCK_E] one-hot
        before = tl.cumsum(hit, axis=0) - hit  # rows of the same expert earlier in the chunk
        dest = tl.sum(hit * (pad_start + seen)[None, :] + hit * before, axis=1)
        tl.store(rows_ptr + dest, offs.to(tl.int64), mask=ok)
        seen += tl.sum(hit, axis=0)
    for r0 in range(0, num_rows, CHUNK):
        r = r0 + tl.arange(0, CHUNK)
        # the expert whose padded run holds slot r (E or more: past the last run)
        er = tl.sum((pad_end[None, :] <= r[:, None]).to(tl.int32), axis=1)
        at = (er[:, None] == ex[None, :]).to(tl.int32)
        within = r - tl.sum(at * pad_start[None, :], axis=1)
        live = (er < E) & (within < tl.sum(at * counts[None, :], axis=1))
        tl.store(rows_ptr + r, tl.full([CHUNK], 0, tl.int64) + n_rows, mask=(r < num_rows) & ~live)
        first = (r % BLOCK_M == 0) & (r < num_rows)
        tl.store(block_expert_ptr + r // BLOCK_M, tl.where(er < E, er, -1).to(tl.int64), mask=first)


@jit(do_not_specialize=["n_rows"])
def _mlp1_kernel(x_ptr: tl.tensor, rows_ptr: tl.tensor, block_expert_ptr: tl.tensor, blocks_ptr: tl.tensor,
                 scales_ptr: tl.tensor, bias_ptr: tl.tensor, act_ptr: tl.tensor, n_rows: tl.tensor, stride_x: tl.tensor,
                 H: tl.tensor, I: tl.tensor, limit: tl.tensor, alpha: tl.tensor, TOPK: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr, SCALED_DOT: tl.constexpr,
                 A_FORMAT: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr) -> None:
    """act[r, j] = swiglu(x[token(r)] @ W1_e[2j:2j+2]^T + b1_e[2j:2j+2]) for the rows r of one block.

    Gate and linear in one pass: the program's ``2 * BLOCK_N`` weight rows are consecutive
    (interleaved gate, linear), multiplied in one matmul and split apart in registers.
    """
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
    w_row = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)  # gate at even, linear at odd
    w_ok = w_row < 2 * I
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], tl.float32)
    acc = _mxfp4_matmul(x_ptr, token.to(tl.int64) * stride_x, m_ok,
                        blocks_ptr + e * (2 * I) * (H // 2), scales_ptr + e * (2 * I) * (H // 32),
                        w_row, w_ok, 0, H, H, acc, BLOCK_KB, 2 * BLOCK_N, SCALED_DOT, A_FORMAT, PRECISION, DOT)
    acc = acc + tl.load(bias_ptr + e * 2 * I + w_row, mask=w_ok, other=0.0).to(tl.float32)[None, :]
    gate, lin = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
    gate = tl.minimum(gate, limit)
    lin = tl.minimum(tl.maximum(lin, -limit), limit)
    act = gate * tl.sigmoid(alpha * gate) * (lin + 1.0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out = act_ptr + offs_m.to(tl.int64)[:, None] * I + offs_n[None, :]
    tl.store(out, act.to(act_ptr.dtype.element_ty), mask=m_ok[:, None] & (offs_n < I)[None, :])


@jit(do_not_specialize=["n_rows"])
def _mlp2_kernel(act_ptr: tl.tensor, rows_ptr: tl.tensor, block_expert_ptr: tl.tensor, gate_w_ptr: tl.tensor,
                 blocks_ptr: tl.tensor, scales_ptr: tl.tensor, bias_ptr: tl.tensor, out_ptr: tl.tensor,
                 n_rows: tl.tensor, H: tl.tensor, I: tl.tensor, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_KB: tl.constexpr, SPLIT_K: tl.constexpr, SCALED_DOT: tl.constexpr, A_FORMAT: tl.constexpr,
                 PRECISION: tl.constexpr, DOT: tl.constexpr) -> None:
    """out[split, row(r)] = w(row(r)) * (act[r, K-range of split] @ W2_e[:, K-range]^T (+ b2_e on
    split 0)): one output row per (token, slot) and K split, summed afterwards."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    e = e.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row = tl.load(rows_ptr + offs_m)
    m_ok = row < n_rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    step = 2 * BLOCK_KB
    k_per = tl.cdiv(tl.cdiv(I, SPLIT_K), step) * step
    k_lo = split * k_per
    k_hi = tl.minimum(k_lo + k_per, I)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc = _mxfp4_matmul(act_ptr, offs_m.to(tl.int64) * I, m_ok,
                        blocks_ptr + e * H * (I // 2), scales_ptr + e * H * (I // 32),
                        offs_n, n_ok, k_lo, k_hi, I, acc, BLOCK_KB, BLOCK_N, SCALED_DOT, A_FORMAT, PRECISION, DOT)
    if split == 0:
        acc += tl.load(bias_ptr + e * H + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    w = tl.load(gate_w_ptr + row, mask=m_ok, other=0.0).to(tl.float32)
    y = acc * w[:, None]
    dst = out_ptr + (split * n_rows + tl.where(m_ok, row, 0)).to(tl.int64)[:, None] * H + offs_n[None, :]
    tl.store(dst, y, mask=m_ok[:, None] & n_ok[None, :])


@jit(do_not_specialize=["n_tok"])
def _sum_slots_kernel(slots_ptr: tl.tensor, out_ptr: tl.tensor, n_tok: tl.tensor, H: tl.tensor, PARTS: tl.constexpr,
                      TOPK: tl.constexpr, BLOCK: tl.constexpr) -> None:
    """out[t] = sum over split s and slot j of slots[s, t * TOPK + j] (float32), in out's dtype."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(PARTS):
        for j in tl.static_range(TOPK):
            acc += tl.load(slots_ptr + ((s * n_tok + t) * TOPK + j) * H + offs, mask=ok, other=0.0)
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


# ---- configurations -----------------------------------------------------------------------


@dataclass(frozen=True)
class MoEConfig:
    """Tiling of one MoE call. ``block_m``: rows of one expert per program; ``block_n``: SwiGLU
    outputs per mlp1 program (``2 * block_n`` weight rows) and outputs per mlp2 program;
    ``block_k``: weights along K per step (a multiple of 32); ``split_k``: K splits of mlp2."""

    block_m: int
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


SM_COUNT = 132  # an H100 SXM; only sizes split-K, so a close guess is enough
# (bucket of rows per expert, hidden, intermediate) -> config, from a tuning sweep on the GPU
# (``moe_tune.sweep``); empty until one has been run and loaded with :func:`load_tuned_configs`.
TUNED: dict[tuple[int, int, int], MoEConfig] = {}


def rows_per_expert_bucket(n_tokens: int, topk: int, num_experts: int) -> int:
    """Mean (token, slot) rows per expert, rounded up to a power of two (the tuning key)."""
    return int(triton.next_power_of_2(max(1, -(-n_tokens * topk // num_experts))))


def moe_config(n_tokens: int, topk: int, num_experts: int, hidden: int, inter: int) -> MoEConfig:
    """The tiling for a call, from the rows each expert gets on average and the shapes: a tuned
    entry when there is one, else the heuristic below.

    * ``block_m``: 16 up to 16 rows per expert, 32 up to 32, else 64, so the weights an expert
      decodes serve as many of its rows as possible (prefill: 64).
    * ``split_k`` (mlp2): doubled, up to 8, while fewer than two waves of programs would run
      and each split keeps at least two ``block_k`` steps; batch 1 at 20b shapes gets 2.
    """
    bucket = rows_per_expert_bucket(n_tokens, topk, num_experts)
    tuned = TUNED.get((bucket, hidden, inter))
    if tuned is not None:
        return tuned
    block_m = 16 if bucket <= 16 else 32 if bucket <= 32 else 64
    block_n, block_k = 64, 128 if block_m <= 32 else 64
    busy_experts = min(num_experts, n_tokens * topk)
    row_blocks = busy_experts * max(1, -(-bucket // block_m))
    programs = row_blocks * -(-hidden // block_n)
    split_k = 1
    while split_k < 8 and programs * split_k < 2 * SM_COUNT and inter // (2 * split_k) >= 2 * block_k:
        split_k *= 2
    return MoEConfig(block_m, block_n, block_k, split_k, num_warps=4 if block_m <= 32 else 8)


def engine_configs(hidden: int, inter: int, topk: int, num_experts: int, max_tokens: int = 8192) -> list[MoEConfig]:
    """Every config :func:`moe_config` can pick for these shapes, token counts 1..``max_tokens``
    (for compile checks and warm-ups)."""
    seen: dict[MoEConfig, None] = {}
    n = 1
    while n <= max_tokens:
        seen[moe_config(n, topk, num_experts, hidden, inter)] = None
        n *= 2
    return list(seen)


def load_tuned_configs(path: str | os.PathLike[str]) -> int:
    """Add a sweep's results (JSON ``[{"bucket", "hidden", "inter", "config": {...}}]``) to
    :data:`TUNED`; returns how many entries were read."""
    entries = json.loads(Path(path).read_text())
    for entry in entries:
        TUNED[(int(entry["bucket"]), int(entry["hidden"]), int(entry["inter"]))] = MoEConfig(**entry["config"])
    return len(entries)


# ---- host side --------------------------------------------------------------------------


def route_triton(router_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` experts of each row of ``router_logits [N, E]`` (highest first; ties to the lower
    index) and their softmax weights ``[N, k]`` (in the logits' dtype)."""
    n, e = router_logits.shape
    logits = router_logits.contiguous()
    idx = torch.empty((n, k), dtype=torch.long, device=logits.device)
    weights = torch.empty((n, k), dtype=logits.dtype, device=logits.device)
    if n:
        launch(_route_kernel, (n,), logits, idx, weights, e, logits.stride(0),
               TOPK=k, BLOCK_E=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(k))
    return idx, weights


def num_row_blocks(n_rows: int, num_experts: int, block_m: int) -> int:
    """Row blocks :func:`group_by_expert` lays out: ``min(n_rows, (n_rows + E*(block_m - 1)) // block_m)``
    bounds the blocks the experts' padded runs can fill (at least 1)."""
    return max(1, min(n_rows, (n_rows + num_experts * (block_m - 1)) // block_m))


def group_by_expert(
    expert_indices: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, block_expert) for the grouped matmuls, in torch (the reference for
    :func:`group_by_expert_triton`, which makes the same layout in one launch).

    ``rows [num_blocks * block_m]``: flat (token * k + slot) indices sorted by expert (stable),
    each expert's run padded to a multiple of ``block_m`` with the sentinel ``N * k``.
    ``block_expert [num_blocks]``: the expert of each row block, ``-1`` past the last one.
    ``num_blocks`` is :func:`num_row_blocks`.
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
    num_blocks = num_row_blocks(n, num_experts, block_m)
    rows = torch.full((num_blocks * block_m,), n, dtype=torch.long, device=device)
    rows[pad_start[sorted_experts] + rank] = order
    block_first_row = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(pad_end, block_first_row, right=True)
    block_expert = torch.where(block_expert >= num_experts, -1, block_expert)
    return rows, block_expert


def group_by_expert_triton(
    expert_indices: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`group_by_expert` in one launch (one program; no host sync)."""
    flat = expert_indices.reshape(-1).contiguous()
    n = flat.numel()
    num_blocks = num_row_blocks(n, num_experts, block_m)
    rows = torch.empty((num_blocks * block_m,), dtype=torch.long, device=flat.device)
    block_expert = torch.empty((num_blocks,), dtype=torch.long, device=flat.device)
    block_e = triton.next_power_of_2(num_experts + 1)  # one spare bin past the last expert
    launch(_group_kernel, (1,), flat, rows, block_expert, n, rows.shape[0], num_experts,
           BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=max(16, min(128, 4096 // block_e)), num_warps=4)
    return rows, block_expert


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def scaled_dot_available() -> bool:
    """Whether ``tl.dot_scaled`` can run here: always when compiled; under ``TRITON_INTERPRET=1``
    only if the interpreter implements it (Triton 3.7's does not)."""
    if os.environ.get("TRITON_INTERPRET", "") not in ("1", "true", "True"):
        return True
    from triton.runtime import interpreter
    return hasattr(interpreter.InterpreterBuilder, "create_dot_scaled")


def uses_scaled_dot(dtype: torch.dtype) -> bool:
    """Whether MXFP4 tiles go to ``tl.dot_scaled`` (bf16/fp16 activations; ``REFINERY_MXFP4_DECODE=bits``
    forces the bit-decode path) rather than being decoded in registers (float32, or wherever
    :func:`scaled_dot_available` says no)."""
    return (dtype in (torch.bfloat16, torch.float16) and os.environ.get("REFINERY_MXFP4_DECODE", "") != "bits"
            and scaled_dot_available())


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
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    config: MoEConfig | None = None,
) -> torch.Tensor:
    """The ``moe`` kernel (contract in ``ops``): routed experts with MXFP4 weights decoded inside
    the matmuls. Five launches: grouping, mlp1 (with SwiGLU), mlp2 (split over K when the
    batch is small), and the sum over slots and splits. The tiling comes from ``config``, else
    :func:`moe_config`; the ``block_*``/``split_k`` arguments override single fields
    (``block_k`` counts weights, a multiple of 32)."""
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"moe_triton computes in {SUPPORTED_DTYPES}, not {x.dtype}")
    n, hidden = x.shape
    topk = expert_indices.shape[1]
    num_experts, two_i = mlp1_blocks.shape[0], mlp1_blocks.shape[1]
    inter = two_i // 2
    cfg = config or moe_config(n, topk, num_experts, hidden, inter)
    cfg = dataclasses.replace(cfg, **{name: value for name, value in (
        ("block_m", block_m), ("block_n", block_n), ("block_k", block_k), ("split_k", split_k)) if value is not None})
    if cfg.block_k % 32:
        raise ValueError(f"block_k {cfg.block_k} is not a multiple of 32")
    if n == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    rows, block_expert = group_by_expert_triton(expert_indices, num_experts, cfg.block_m)
    num_blocks = block_expert.shape[0]
    act = torch.empty((num_blocks * cfg.block_m, inter), dtype=x.dtype, device=x.device)
    common = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_KB=cfg.block_k // 2,
                  SCALED_DOT=uses_scaled_dot(x.dtype), A_FORMAT="fp16" if x.dtype == torch.float16 else "bf16",
                  PRECISION=_precision(x.dtype), DOT=dot_dtype(x.dtype),
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    launch(_mlp1_kernel, (num_blocks, triton.cdiv(inter, cfg.block_n)),
           x, rows, block_expert, mlp1_blocks, mlp1_scales, mlp1_bias, act,
           n * topk, x.stride(0), hidden, inter, float(swiglu_limit), float(swiglu_alpha), TOPK=topk, **common)
    slots = torch.empty((cfg.split_k, n * topk, hidden), dtype=torch.float32, device=x.device)
    gate_w = expert_weights.reshape(-1).contiguous()
    launch(_mlp2_kernel, (num_blocks, triton.cdiv(hidden, cfg.block_n), cfg.split_k),
           act, rows, block_expert, gate_w, mlp2_blocks, mlp2_scales, mlp2_bias, slots,
           n * topk, hidden, inter, SPLIT_K=cfg.split_k, **common)
    out = torch.empty_like(x)
    block = min(1024, triton.next_power_of_2(hidden))
    launch(_sum_slots_kernel, (n, triton.cdiv(hidden, block)), slots, out, n, hidden,
           PARTS=cfg.split_k, TOPK=topk, BLOCK=block)
    return out
