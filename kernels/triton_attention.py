"""gpt-oss attention in Triton: causal, optional sliding-window band, per-head sinks, GQA.

Two kernels, both flash-style (one pass over the keys with an online softmax in float32):

* :func:`attention_triton` — the ``attention`` kernel: one sequence, dense ``q``/``k``/``v``,
  explicit absolute positions. One program per (block of queries, query head); the key loop
  runs only over the keys a block can see (found with ``searchsorted``, so ``q_pos`` and
  ``k_pos`` must be ascending, as they are in the engine).
* :func:`paged_attention_triton` — the ``paged_attention`` kernel: a packed batch reading its
  keys from the paged KV pool through block tables (decode, and chunked prefill through the
  cache). One program per (tile of a sequence's queries, KV head[, key segment]); the tile's
  rows are its queries times the query heads sharing that KV head, so every loaded key serves
  the whole GQA group. The grid covers the most tiles any sequence can need and surplus
  programs exit, so no tile map is built on the host or cached between calls. Keys are
  gathered per position (``block_table[b, pos // page]``), so any page size works and freed
  (-1) blocks of a sliding layer are never read; the block table must hold every key a query
  can see (the cache guarantees it). Small decode batches split each sequence's keys into
  segments (flash-decoding) and combine them in a second launch, which adds the sink once.

Dot operands are cast to ``triton_moe.dot_dtype`` (float32 under the interpreter).

The sink ``S_h`` enters as a virtual key with logit ``S_h`` and value 0: the running max and
denominator start at ``(S_h, 1)`` instead of ``(-inf, 0)``, which also keeps rows with no
visible key finite. A key at ``kp`` is visible to a query at ``qp`` iff
``qp - window < kp <= qp``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launches import launch
from .triton_jit import jit
from .triton_moe import SM_COUNT, dot_dtype
from .triton_moe import SUPPORTED_DTYPES as SUPPORTED_DTYPES  # attention's too (ops reads it here)

LOG2E = 1.4426950408889634


@jit
def _online_softmax_step(q: tl.tensor, k: tl.tensor, v: tl.tensor, visible: tl.tensor, m_i: tl.tensor, l_i: tl.tensor,
                         acc: tl.tensor, qk_scale: tl.tensor, PRECISION: tl.constexpr,
                         DOT: tl.constexpr) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """One block of keys: k [D, N], v [N, D], visible [M, N]; returns the new (m, l, acc)."""
    s = tl.dot(q.to(DOT), k.to(DOT), input_precision=PRECISION) * qk_scale  # log2 domain
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(DOT), input_precision=PRECISION)
    return m_new, l_i, acc


@jit
def _attention_kernel(q_ptr: tl.tensor, k_ptr: tl.tensor, v_ptr: tl.tensor, sinks_ptr: tl.tensor, q_pos_ptr: tl.tensor,
                      k_pos_ptr: tl.tensor, lo_ptr: tl.tensor, hi_ptr: tl.tensor, o_ptr: tl.tensor, n_q: tl.tensor,
                      sq_n: tl.tensor, sq_h: tl.tensor, sk_n: tl.tensor, sk_h: tl.tensor, sv_n: tl.tensor,
                      sv_h: tl.tensor, so_n: tl.tensor, so_h: tl.tensor, qk_scale: tl.tensor, window: tl.tensor,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
                      DOT: tl.constexpr) -> None:
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < n_q
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + offs_m[:, None] * sq_n + head * sq_h + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = tl.load(q_pos_ptr + offs_m, mask=m_ok, other=0)
    sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
    m_i = tl.zeros([BLOCK_M], tl.float32) + sink
    l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = tl.load(lo_ptr + pid_m)
    hi = tl.load(hi_ptr + pid_m)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        k = tl.load(k_ptr + offs_n[None, :] * sk_n + kv_head * sk_h + offs_d[:, None],
                    mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_ptr + offs_n[:, None] * sv_n + kv_head * sv_h + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        k_pos = tl.load(k_pos_ptr + offs_n, mask=n_ok, other=0)
        visible = n_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = _online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, PRECISION, DOT)
    out = acc / l_i[:, None]
    tl.store(o_ptr + offs_m[:, None] * so_n + head * so_h + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


@jit(do_not_specialize=["tiles_per_seq", "window"])
def _paged_attention_kernel(q_ptr: tl.tensor, k_pool_ptr: tl.tensor, v_pool_ptr: tl.tensor, sinks_ptr: tl.tensor,
                            table_ptr: tl.tensor, query_start_ptr: tl.tensor, seq_lens_ptr: tl.tensor, o_ptr: tl.tensor,
                            m_ptr: tl.tensor, l_ptr: tl.tensor, acc_ptr: tl.tensor, tiles_per_seq: tl.tensor,
                            n_q: tl.tensor, sq_n: tl.tensor, sq_h: tl.tensor, so_n: tl.tensor, so_h: tl.tensor,
                            s_table: tl.tensor, s_block: tl.tensor, s_page: tl.tensor, s_head: tl.tensor,
                            qk_scale: tl.tensor, window: tl.tensor, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
                            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                            PAGE: tl.constexpr, HAS_WINDOW: tl.constexpr, NUM_SPLITS: tl.constexpr,
                            PRECISION: tl.constexpr, DOT: tl.constexpr) -> None:
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    b = pid // tiles_per_seq
    q_first = (pid % tiles_per_seq) * BLOCK_Q  # first query of the tile, counted within its sequence
    q_begin = tl.load(query_start_ptr + b)
    count = tl.load(query_start_ptr + b + 1) - q_begin
    if q_first >= count:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    first_pos = seq_len - count  # position of the sequence's first query

    r = tl.arange(0, BLOCK_Q * GROUP_P)
    qi = q_first + r // GROUP_P
    g = r % GROUP_P
    r_ok = (qi < count) & (g < GROUP)
    head = kv_head * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_row = (q_begin + qi).to(tl.int64)
    q = tl.load(q_ptr + q_row[:, None] * sq_n + head[:, None] * sq_h + offs_d[None, :],
                mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = first_pos + qi
    acc = tl.zeros([BLOCK_Q * GROUP_P, BLOCK_D], tl.float32)

    hi = first_pos + tl.minimum(q_first + BLOCK_Q, count)  # one past the tile's last query
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first_pos + q_first - window + 1, 0)
    if NUM_SPLITS == 1:
        # the sink: a virtual key with logit S_h and value 0
        m_i = tl.load(sinks_ptr + head, mask=r_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_Q * GROUP_P], 1.0, tl.float32)
    else:
        # one segment of the keys; the sink joins once, in _combine_splits_kernel
        seg = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = lo + split * seg
        hi = tl.minimum(lo + seg, hi)
        m_i = tl.full([BLOCK_Q * GROUP_P], -1.0e30, tl.float32)  # finite: an empty segment stays NaN-free
        l_i = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
    table_row = table_ptr + b.to(tl.int64) * s_table
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        n_ok = k_pos < hi
        block = tl.load(table_row + k_pos // PAGE, mask=n_ok, other=-1)
        n_ok = n_ok & (block >= 0)
        slot = block.to(tl.int64) * s_block + (k_pos % PAGE) * s_page + kv_head * s_head
        k = tl.load(k_pool_ptr + slot[None, :] + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_pool_ptr + slot[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        visible = n_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = _online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, PRECISION, DOT)
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(o_ptr + q_row[:, None] * so_n + head[:, None] * so_h + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])
    else:
        part = (split * n_q + q_row) * (tl.num_programs(1) * GROUP) + head  # [split, query, head] partial row
        tl.store(m_ptr + part, m_i, mask=r_ok)
        tl.store(l_ptr + part, l_i, mask=r_ok)
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=r_ok[:, None] & d_ok[None, :])


@jit(do_not_specialize=["n_q"])
def _combine_splits_kernel(m_ptr: tl.tensor, l_ptr: tl.tensor, acc_ptr: tl.tensor, sinks_ptr: tl.tensor,
                           o_ptr: tl.tensor, n_q: tl.tensor, n_heads: tl.tensor, so_n: tl.tensor, so_h: tl.tensor,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                           BLOCK_S: tl.constexpr) -> None:
    """out[n, h] from the splits' (max, denominator, unnormalised sum): the sink enters here, once."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    sp_ok = sp < NUM_SPLITS
    part = (sp * n_q + n) * n_heads + h
    m = tl.load(m_ptr + part, mask=sp_ok, other=-1.0e30)
    l = tl.load(l_ptr + part, mask=sp_ok, other=0.0)
    sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
    m_all = tl.maximum(tl.max(m, axis=0), sink)
    w = tl.exp2(m - m_all)
    denom = tl.sum(l * w, axis=0) + tl.exp2(sink - m_all)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=sp_ok[:, None] & d_ok[None, :],
                  other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / denom
    tl.store(o_ptr + n * so_n + h * so_h + offs_d, out.to(o_ptr.dtype.element_ty), mask=d_ok)


# ---- host side --------------------------------------------------------------------------


def _check(q: torch.Tensor, name: str) -> None:
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} computes in {SUPPORTED_DTYPES}, not {q.dtype}")


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_d(head_dim: int) -> int:
    return max(16, int(triton.next_power_of_2(head_dim)))


def attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    window: int | None,
    sm_scale: float,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """The ``attention`` kernel (contract in ``ops``); ``q_pos`` and ``k_pos`` ascending."""
    _check(q, "attention_triton")
    n, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    if n_heads % n_kv:
        raise ValueError(f"{n_heads} query heads do not share {n_kv} KV heads evenly")
    out = torch.empty_like(q)
    if n == 0:
        return out
    if k.shape[0] == 0:
        return out.zero_()  # only the sink in the denominator: all weights are 0
    if k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    k_pos = k_pos.to(torch.long).contiguous()
    q_pos = q_pos.to(torch.long).contiguous()
    num_blocks = triton.cdiv(n, block_m)
    firsts = q_pos[::block_m]
    lasts = q_pos[torch.clamp(torch.arange(1, num_blocks + 1, device=q.device) * block_m, max=n) - 1]
    hi = torch.searchsorted(k_pos, lasts, right=True)
    if window:
        lo = torch.searchsorted(k_pos, firsts - window, right=True)
    else:
        lo = torch.zeros_like(hi)
    launch(
        _attention_kernel, (num_blocks, n_heads),
        q, k, v, sinks.contiguous(), q_pos, k_pos, lo, hi, out,
        n, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), float(sm_scale) * LOG2E, int(window or 0),
        GROUP=n_heads // n_kv, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim),
        BLOCK_M=block_m, BLOCK_N=block_n, HAS_WINDOW=bool(window),
        PRECISION=_precision(q.dtype), DOT=dot_dtype(q.dtype),
    )
    return out


def decode_splits(programs: int, max_keys: int, block_n: int) -> int:
    """Key segments per (query tile, KV head) for flash-decoding: a power of two (few compiled
    variants), enough for about two waves of programs over :data:`SM_COUNT` multiprocessors,
    each segment at least two key blocks, at most 16; 1 (no split) when ``programs`` already
    fill the GPU."""
    if programs >= SM_COUNT:
        return 1
    cap: int = max(1, min(int(triton.cdiv(2 * SM_COUNT, programs)), max_keys // (2 * block_n), 16))
    return 1 << (cap.bit_length() - 1)


def paged_attention_triton(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    sinks: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int | None,
    sm_scale: float,
    block_n: int = 64,
    block_q: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """The ``paged_attention`` kernel (contract in ``ops``).

    The grid is ``(B * tiles_per_seq, Hkv, num_splits)`` with ``tiles_per_seq`` the tiles the
    longest possible sequence needs (``N - B + 1`` queries); tiles past a sequence's queries exit
    at once, so nothing is computed on the host from the device's query counts. Decode
    batches too small to fill the GPU split each sequence's keys into ``num_splits`` segments
    (flash-decoding; default :func:`decode_splits`, judged from the block table's width), and a
    second launch combines them and adds the sink.
    """
    _check(q, "paged_attention_triton")
    n, n_heads, head_dim = q.shape
    n_kv = k_pool.shape[2]
    page = k_pool.shape[1]
    if n_heads % n_kv:
        raise ValueError(f"{n_heads} query heads do not share {n_kv} KV heads evenly")
    if k_pool.stride() != v_pool.stride() or k_pool.stride(-1) != 1:
        raise ValueError("k_pool and v_pool must share a layout with contiguous head_dim")
    out = torch.empty_like(q)
    batch = block_table.shape[0]
    if n == 0 or batch == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    group = n_heads // n_kv
    group_p = triton.next_power_of_2(group)
    decode = n <= 2 * batch  # few queries per sequence
    if block_q is None:
        block_q = max(1, (16 if decode else 64) // group_p)
    tiles_per_seq = triton.cdiv(max(1, n - batch + 1), block_q)
    if num_splits is None:
        max_keys = block_table.shape[1] * page
        if window:
            max_keys = min(max_keys, window + block_q - 1)
        num_splits = decode_splits(batch * tiles_per_seq * n_kv, max_keys, block_n) if decode else 1
    table = block_table if block_table.dtype in (torch.int32, torch.int64) else block_table.long()
    table = table if table.stride(-1) == 1 else table.contiguous()
    if num_splits > 1:
        m_part = torch.empty((num_splits, n, n_heads), dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty((num_splits, n, n_heads, head_dim), dtype=torch.float32, device=q.device)
    else:
        m_part = l_part = acc_part = out  # unused
    launch(_paged_attention_kernel, (batch * tiles_per_seq, n_kv, num_splits),
           q, k_pool, v_pool, sinks, table, query_start, seq_lens, out, m_part, l_part, acc_part,
           tiles_per_seq, n,
           q.stride(0), q.stride(1), out.stride(0), out.stride(1),
           table.stride(0), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
           float(sm_scale) * LOG2E, int(window or 0),
           GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim),
           BLOCK_Q=block_q, BLOCK_N=block_n, PAGE=page, HAS_WINDOW=bool(window), NUM_SPLITS=num_splits,
           PRECISION=_precision(q.dtype), DOT=dot_dtype(q.dtype))
    if num_splits > 1:
        launch(_combine_splits_kernel, (n, n_heads), m_part, l_part, acc_part, sinks, out, n, n_heads,
               out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim),
               NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits))
    return out
