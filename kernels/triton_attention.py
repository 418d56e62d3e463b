"""gpt-oss attention in Triton: causal, optional sliding-window band, per-head sinks, GQA.

Two kernels, both flash-style (one pass over the keys with an online softmax in float32):

* :func:`attention_triton` — the ``attention`` kernel: one sequence, dense ``q``/``k``/``v``,
  explicit absolute positions. One program per (block of queries, query head); the key loop
  runs only over the keys a block can see (found with ``searchsorted``, so ``q_pos`` and
  ``k_pos`` must be ascending, as they are in the engine).
* :func:`paged_attention_triton` — the ``paged_attention`` kernel: a packed batch reading its
  keys from the paged KV pool through block tables (decode, and chunked prefill through the
  cache). One program per (tile of a sequence's queries, KV head); the tile's rows are its
  queries times the query heads sharing that KV head, so every loaded key serves the whole
  GQA group. Keys are gathered per position (``block_table[b, pos // page]``), so any page
  size works and freed (-1) blocks of a sliding layer are never read; the block table must
  hold every key a query can see (the cache guarantees it).

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

from .triton_moe import SUPPORTED_DTYPES, dot_dtype

LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale,
                         PRECISION: tl.constexpr, DOT: tl.constexpr):
    """One block of keys: k [D, N], v [N, D], visible [M, N]; returns the new (m, l, acc)."""
    s = tl.dot(q.to(DOT), k.to(DOT), input_precision=PRECISION) * qk_scale  # log2 domain
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(DOT), input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, sinks_ptr, q_pos_ptr, k_pos_ptr, lo_ptr, hi_ptr, o_ptr,
                      n_q, sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, so_n, so_h, qk_scale, window,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                      PRECISION: tl.constexpr, DOT: tl.constexpr):
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


@triton.jit
def _paged_attention_kernel(q_ptr, k_pool_ptr, v_pool_ptr, sinks_ptr, table_ptr, query_start_ptr,
                            seq_lens_ptr, tile_seq_ptr, tile_q0_ptr, o_ptr,
                            sq_n, sq_h, so_n, so_h, s_table, s_block, s_page, s_head,
                            qk_scale, window,
                            GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                            PAGE: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
                            DOT: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = tl.load(tile_seq_ptr + tile)
    if b < 0:
        return
    q_first = tl.load(tile_q0_ptr + tile)  # first query of the tile, counted within its sequence
    q_begin = tl.load(query_start_ptr + b)
    count = tl.load(query_start_ptr + b + 1) - q_begin
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
    sink = tl.load(sinks_ptr + head, mask=r_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    m_i = sink
    l_i = tl.full([BLOCK_Q * GROUP_P], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P, BLOCK_D], tl.float32)

    hi = first_pos + tl.minimum(q_first + BLOCK_Q, count)  # one past the tile's last query
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first_pos + q_first - window + 1, 0)
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
    out = acc / l_i[:, None]
    tl.store(o_ptr + q_row[:, None] * so_n + head[:, None] * so_h + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])


# ---- host side --------------------------------------------------------------------------


def _check(q: torch.Tensor, name: str) -> None:
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} computes in {SUPPORTED_DTYPES}, not {q.dtype}")


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


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
    _attention_kernel[(num_blocks, n_heads)](
        q, k, v, sinks.contiguous(), q_pos, k_pos, lo, hi, out,
        n, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), float(sm_scale) * LOG2E, int(window or 0),
        GROUP=n_heads // n_kv, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim),
        BLOCK_M=block_m, BLOCK_N=block_n, HAS_WINDOW=bool(window),
        PRECISION=_precision(q.dtype), DOT=dot_dtype(q.dtype),
    )
    return out


def query_tiles(query_start: torch.Tensor, block_q: int, total_queries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile_seq, tile_q0): for each tile of at most ``block_q`` queries of one sequence, the
    sequence (``-1`` past the last tile) and its first query within the sequence. Computed on
    the device; the tile count is the bound ``min(N, (N + B*(block_q - 1)) // block_q)``."""
    batch = query_start.shape[0] - 1
    counts = query_start[1:] - query_start[:-1]
    tiles = (counts + block_q - 1) // block_q
    tile_end = torch.cumsum(tiles, 0)
    num_tiles = max(1, min(total_queries, (total_queries + batch * (block_q - 1)) // block_q))
    t = torch.arange(num_tiles, device=query_start.device)
    seq = torch.searchsorted(tile_end, t, right=True)
    valid = seq < batch
    seq_c = seq.clamp(max=batch - 1)
    q0 = (t - (tile_end - tiles)[seq_c]) * block_q
    return torch.where(valid, seq, -1), torch.where(valid, q0, 0)


_last_tiles: tuple | None = None  # (query_start, its _version, block_q, N, tile_seq, tile_q0)


def _tiles(query_start: torch.Tensor, block_q: int, total_queries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`query_tiles`, computed once per step: every layer of a step passes the same
    ``query_start`` tensor (an in-place change bumps its ``_version`` and recomputes)."""
    global _last_tiles
    key = (query_start, query_start._version, block_q, total_queries)
    cached = _last_tiles
    if cached is not None and cached[0] is key[0] and cached[1:4] == key[1:]:
        return cached[4], cached[5]
    tile_seq, tile_q0 = query_tiles(query_start.to(torch.long).contiguous(), block_q, total_queries)
    _last_tiles = (*key, tile_seq, tile_q0)
    return tile_seq, tile_q0


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
) -> torch.Tensor:
    """The ``paged_attention`` kernel (contract in ``ops``)."""
    _check(q, "paged_attention_triton")
    n, n_heads, head_dim = q.shape
    n_kv = k_pool.shape[2]
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
    if block_q is None:
        rows = 16 if n <= 2 * batch else 64  # decode: few queries per sequence
        block_q = max(1, rows // group_p)
    tile_seq, tile_q0 = _tiles(query_start, block_q, n)
    query_start = query_start.to(torch.long).contiguous()
    table = block_table.to(torch.long).contiguous()
    _paged_attention_kernel[(tile_seq.shape[0], n_kv)](
        q, k_pool, v_pool, sinks.contiguous(), table, query_start, seq_lens.to(torch.long).contiguous(),
        tile_seq, tile_q0, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        table.stride(0), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        float(sm_scale) * LOG2E, int(window or 0),
        GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim),
        BLOCK_Q=block_q, BLOCK_N=block_n, PAGE=k_pool.shape[1], HAS_WINDOW=bool(window),
        PRECISION=_precision(q.dtype), DOT=dot_dtype(q.dtype),
    )
    return out
