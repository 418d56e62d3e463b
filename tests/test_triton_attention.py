"""Triton attention (dense prefill and paged decode) against the torch path, run in Triton's
interpreter on CPU tensors: window edges, sinks, GQA, ragged paged caches."""
from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from torch import Tensor
    from torch import dtype as DType

torch = pytest.importorskip("torch", reason="the inference extra (torch) is not installed")
if importlib.util.find_spec("triton") is None:  # not importorskip: triton must load interpreted
    pytest.skip("triton is not installed", allow_module_level=True)

from engine_fixtures import interpreted_triton_kernels, tiny_config  # noqa: E402

KERNELS = interpreted_triton_kernels()  # TRITON_INTERPRET=1: the kernels run on CPU tensors

from refinery.kernels import ops, triton_attention  # noqa: E402
from refinery.kernels.kv_cache import PagedKVCache  # noqa: E402

SCALE = 0.25


def _qkv(n_q: int, n_k: int, heads: int, kv_heads: int, d: int, seed: int,
         dtype: DType = torch.float32) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_q, heads, d, generator=g)
    k = torch.randn(n_k, kv_heads, d, generator=g)
    v = torch.randn(n_k, kv_heads, d, generator=g)
    sinks = torch.randn(heads, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype), sinks


@pytest.mark.parametrize("window", [None, 1, 8, 37, 100])
def test_prefill_causal_window_edges(window: int | None) -> None:
    n = 37  # odd; not a multiple of any block size
    q, k, v, sinks = _qkv(n, n, heads=4, kv_heads=2, d=16, seed=1)
    pos = torch.arange(n)
    ref = ops.attention_torch(q, k, v, sinks, pos, pos, window, SCALE)
    got = triton_attention.attention_triton(q, k, v, sinks, pos, pos, window, SCALE, block_m=16, block_n=16)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    if window == 1:  # each query sees only itself: out = v * e^s / (e^s + e^S)
        s = (q * k.repeat_interleave(2, dim=1)).sum(-1) * SCALE
        w = torch.exp(s) / (torch.exp(s) + torch.exp(sinks))
        torch.testing.assert_close(got, v.repeat_interleave(2, dim=1) * w.unsqueeze(-1), rtol=1e-5, atol=1e-5)
    if window in (37, 100):  # a window covering the sequence is no window
        full = ops.attention_torch(q, k, v, sinks, pos, pos, None, SCALE)
        torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)
    if window == 8:  # the band matters at this length
        assert not torch.allclose(ref, ops.attention_torch(q, k, v, sinks, pos, pos, None, SCALE))


def test_prefill_queries_after_cached_keys_gqa4_and_bf16() -> None:
    # 9 queries at positions 30..38 over keys 0..38; 8 query heads on 2 KV heads
    q, k, v, sinks = _qkv(9, 39, heads=8, kv_heads=2, d=16, seed=2)
    q_pos, k_pos = torch.arange(30, 39), torch.arange(39)
    for window in (None, 8):
        ref = ops.attention_torch(q, k, v, sinks, q_pos, k_pos, window, SCALE)
        got = KERNELS.attention(q, k, v, sinks, q_pos, k_pos, window, SCALE)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        got16 = KERNELS.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), sinks, q_pos, k_pos, window, SCALE)
        assert got16.dtype == torch.bfloat16
        assert (got16.float() - ref).abs().max() < 3e-2


def test_sink_effect() -> None:
    # The sink is a value-free key: with sinks S the output is the sink-free output scaled by
    # Z / (Z + e^S), Z = sum of the visible e^s. Checked against the reference both ways.
    n = 21
    q, k, v, sinks = _qkv(n, n, heads=2, kv_heads=1, d=16, seed=3)
    sinks = torch.tensor([2.0, -1.0])
    pos = torch.arange(n)
    no_sink = torch.full((2,), -1e4)
    base = triton_attention.attention_triton(q, k, v, no_sink, pos, pos, 5, SCALE, block_m=16, block_n=16)
    with_sink = triton_attention.attention_triton(q, k, v, sinks, pos, pos, 5, SCALE, block_m=16, block_n=16)
    torch.testing.assert_close(with_sink, ops.attention_torch(q, k, v, sinks, pos, pos, 5, SCALE), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(base, ops.attention_torch(q, k, v, no_sink, pos, pos, 5, SCALE), rtol=1e-5, atol=1e-5)
    scores = torch.einsum("qhd,khd->hqk", q, k.expand(n, 2, 16)) * SCALE
    visible = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 5)
    z = torch.exp(scores).masked_fill(~visible, 0).sum(-1)  # [H, n]
    shrink = (z / (z + torch.exp(sinks)[:, None])).T.unsqueeze(-1)  # [n, H, 1]
    torch.testing.assert_close(with_sink, base * shrink, rtol=1e-5, atol=1e-5)
    assert (shrink[:, 0] < shrink[:, 1]).all()  # the bigger sink takes more of the mass


def _ragged_cache(lens: list[int], block_size: int, n_blocks: int, heads_kv: int, d: int,
                  seed: int) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(n_blocks, block_size, heads_kv, d, generator=g)
    v_pool = torch.randn(n_blocks, block_size, heads_kv, d, generator=g)
    perm = torch.randperm(n_blocks, generator=g).tolist()
    width = max(-(-n // block_size) for n in lens) + 1  # a spare -1 column
    table = torch.full((len(lens), width), -1, dtype=torch.long)
    for b, n in enumerate(lens):
        need = -(-n // block_size)
        table[b, :need] = torch.tensor([perm.pop() for _ in range(need)])
    return k_pool, v_pool, table


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2), (2, 2)])  # GQA 2, 3 (padded), 1
def test_paged_ragged_decode_and_chunks(heads: int, kv_heads: int) -> None:
    lens = [13, 1, 22, 7, 16]
    counts = [1, 1, 6, 7, 1]  # decodes, a chunk after cached keys, a whole prompt
    k_pool, v_pool, table = _ragged_cache(lens, 4, 40, kv_heads, 16, seed=heads)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(sum(counts), heads, 16, generator=g)
    sinks = torch.randn(heads, generator=g)
    query_start = torch.tensor([0] + torch.cumsum(torch.tensor(counts), 0).tolist())
    seq_lens = torch.tensor(lens)
    for window in (None, 5):
        t = table.clone()
        if window:
            t[2, 0] = t[0, 0] = -1  # blocks a sliding layer has already handed back
        ref = ops.paged_attention_torch(q, k_pool, v_pool, sinks, t, query_start, seq_lens, window, SCALE)
        for block_q in (None, 1, 4):
            got = triton_attention.paged_attention_triton(
                q, k_pool, v_pool, sinks, t, query_start, seq_lens, window, SCALE, block_n=16, block_q=block_q
            )
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 5, 12])
def test_flash_decoding_splits_match(window: int | None) -> None:
    # decode: one query per sequence; keys split into segments, combined with the sink once
    lens = [13, 1, 40, 7, 16, 33]
    k_pool, v_pool, table = _ragged_cache(lens, 4, 60, 2, 16, seed=21)
    if window:
        table[2, :5] = -1  # blocks a sliding layer has handed back (no query sees them)
    g = torch.Generator().manual_seed(22)
    q = torch.randn(len(lens), 4, 16, generator=g)
    sinks = torch.randn(4, generator=g) * 3
    query_start, seq_lens = torch.arange(len(lens) + 1), torch.tensor(lens)
    ref = ops.paged_attention_torch(q, k_pool, v_pool, sinks, table, query_start, seq_lens, window, SCALE)
    for splits in (1, 2, 3, 7, 16, None):  # 16 segments of 40 keys: several segments are empty
        got = triton_attention.paged_attention_triton(q, k_pool, v_pool, sinks, table, query_start, seq_lens,
                                                      window, SCALE, block_n=16, num_splits=splits)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_flash_decoding_adds_the_sink_once() -> None:
    # one key per sequence: out = v * e^s / (e^s + e^S) whatever the split count
    k_pool, v_pool, table = _ragged_cache([1], 4, 4, 1, 16, seed=23)
    g = torch.Generator().manual_seed(24)
    q = torch.randn(1, 2, 16, generator=g)
    sinks = torch.tensor([1.5, -0.5])
    args = (q, k_pool, v_pool, sinks, table, torch.tensor([0, 1]), torch.tensor([1]), None, SCALE)
    slot = int(table[0, 0]) * 4
    k, v = k_pool.view(-1, 1, 16)[slot], v_pool.view(-1, 1, 16)[slot]
    s = (q[0] * k).sum(-1) * SCALE
    expected = (v * (torch.exp(s) / (torch.exp(s) + torch.exp(sinks))).unsqueeze(-1)).unsqueeze(0)
    for splits in (1, 4):
        got = triton_attention.paged_attention_triton(*args, block_n=16, num_splits=splits)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_decode_split_heuristic() -> None:
    # batch 1 at 20b shapes (8 KV heads, 1280 keys): about two waves of programs
    assert triton_attention.decode_splits(8, 1280, 64) == 8  # 10 rounded down to a power of two
    assert triton_attention.decode_splits(8, 8192, 64) == 16
    assert triton_attention.decode_splits(8, 128, 64) == 1  # a sliding window: too few keys
    assert triton_attention.decode_splits(128 * 8, 4096, 64) == 1  # batch 128 fills the GPU


def test_grid_needs_no_host_tile_map() -> None:
    # a sequence with no query in the middle, chunks longer than a tile: every query once
    lens = [9, 5, 12, 3]
    counts = [1, 0, 11, 3]
    k_pool, v_pool, table = _ragged_cache(lens, 4, 16, 2, 16, seed=11)
    g = torch.Generator().manual_seed(12)
    q = torch.randn(sum(counts), 4, 16, generator=g)
    sinks = torch.randn(4, generator=g)
    query_start = torch.tensor([0] + torch.cumsum(torch.tensor(counts), 0).tolist())
    args = (q, k_pool, v_pool, sinks, table, query_start, torch.tensor(lens), None, SCALE)
    assert not hasattr(triton_attention, "_last_tiles")  # no module-level state a CUDA graph would freeze
    for block_q in (1, 2, 4):
        torch.testing.assert_close(triton_attention.paged_attention_triton(*args, block_n=16, block_q=block_q),
                                   ops.paged_attention_torch(*args), rtol=1e-5, atol=1e-5)


def test_paged_through_the_real_cache_with_sliding_blocks_freed() -> None:
    config = tiny_config(sliding_window=6)
    cache = PagedKVCache(config, max_batch=3, max_seq_len=40, max_chunk=5, block_size=4)
    g = torch.Generator().manual_seed(7)
    for kind in cache.kinds:
        cache.k[kind].normal_(generator=g)
        cache.v[kind].normal_(generator=g)
    ids, starts, counts = [0, 1, 2], [29, 0, 17], [1, 5, 3]
    for sid, start, count in zip(ids, starts, counts):
        cache.add_sequence(sid)
        if start:
            cache.reserve(sid, 0, start)
        cache.reserve(sid, start, count)
    views = cache.batch_views(ids, starts, counts, "cpu")
    assert (views["sliding"].block_table == -1).any()  # some sliding blocks were handed back
    heads = config.num_attention_heads
    q = torch.randn(sum(counts), heads, config.head_dim, generator=g)
    sinks = torch.randn(heads, generator=g)
    for layer in (0, 1):  # layer 0 slides, layer 1 is full
        k_pool, v_pool, window = cache.pools(layer)
        view = views[cache.kind(layer)]
        args = (q, k_pool, v_pool, sinks, view.block_table, view.query_start, view.seq_lens, window, SCALE)
        torch.testing.assert_close(KERNELS.paged_attention(*args), ops.paged_attention_torch(*args),
                                   rtol=1e-5, atol=1e-5)
