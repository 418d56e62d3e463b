"""The fused Triton kernels (RMSNorm, residual add + RMSNorm, RoPE with the KV-cache write)
against their torch references, in Triton's interpreter on CPU tensors."""
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

from engine_fixtures import interpreted_triton_kernels  # noqa: E402

KERNELS = interpreted_triton_kernels()  # TRITON_INTERPRET=1: the kernels run on CPU tensors

from refinery.kernels import ops, triton_norm, triton_rope  # noqa: E402

# The interpreter rounds float32 -> bfloat16 toward zero (the GPU rounds to nearest): one
# bf16 step (2**-7 relative) is the tolerance of every bf16 comparison here.
BF16_STEP = 2.0**-7


def _randn(*shape: int, seed: int, dtype: DType = torch.float32) -> Tensor:
    drawn: Tensor = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return drawn


def _close_bf16(got: Tensor, ref: Tensor) -> None:
    assert got.dtype == ref.dtype == torch.bfloat16
    err = (got.float() - ref.float()).abs()
    assert (err <= 1.01 * BF16_STEP * ref.float().abs().clamp_min(1e-3)).all(), err.max()


@pytest.mark.parametrize("n,h", [(1, 64), (7, 48), (5, 2880)])  # 48 and 2880: not powers of two
def test_rmsnorm_and_add_rmsnorm_float32(n: int, h: int) -> None:
    x, d, scale = _randn(n, h, seed=1), _randn(n, h, seed=2), _randn(h, seed=3)
    torch.testing.assert_close(triton_norm.rmsnorm_triton(x, scale, 1e-5), ops.rmsnorm_torch(x, scale, 1e-5),
                               rtol=1e-6, atol=1e-6)
    r, y = triton_norm.add_rmsnorm_triton(x, d, scale, 1e-5)
    r0, y0 = ops.add_rmsnorm_torch(x, d, scale, 1e-5)
    assert torch.equal(r, r0)  # the residual add is one float32 add either way
    torch.testing.assert_close(y, y0, rtol=1e-6, atol=1e-6)


def test_rmsnorm_bfloat16_and_registry() -> None:
    x, d = _randn(6, 96, seed=4, dtype=torch.bfloat16), _randn(6, 96, seed=5, dtype=torch.bfloat16)
    scale = _randn(96, seed=6)
    _close_bf16(KERNELS.rmsnorm(x, scale, 1e-5), ops.rmsnorm_torch(x, scale, 1e-5))
    r, y = KERNELS.add_rmsnorm(x, d, scale, 1e-5)
    r0, y0 = ops.add_rmsnorm_torch(x, d, scale, 1e-5)
    _close_bf16(r, r0)
    assert (y.float() - y0.float()).abs().max() <= 3 * BF16_STEP * y0.float().abs().max()
    # float64 takes the torch path through the registry wrapper
    x64 = x.double()
    assert torch.equal(KERNELS.rmsnorm(x64, scale, 1e-5), ops.rmsnorm_torch(x64, scale, 1e-5))
    # rows of a wider tensor (a strided view) and a 3-d input
    wide = _randn(4, 200, seed=7)
    view = wide[:, 10:106]
    torch.testing.assert_close(triton_norm.rmsnorm_triton(view, scale, 1e-5), ops.rmsnorm_torch(view, scale, 1e-5),
                               rtol=1e-6, atol=1e-6)
    x3 = _randn(2, 3, 96, seed=8)
    torch.testing.assert_close(triton_norm.rmsnorm_triton(x3, scale, 1e-5), ops.rmsnorm_torch(x3, scale, 1e-5),
                               rtol=1e-6, atol=1e-6)


def _rope_inputs(n: int, heads: int, kv: int, d: int, seed: int,
                 dtype: DType = torch.float32) -> tuple[Tensor, Tensor, Tensor]:
    qkv = _randn(n, (heads + 2 * kv) * d, seed=seed, dtype=dtype)
    angles = torch.arange(n, dtype=torch.float32)[:, None] * _randn(d // 2, seed=seed + 1).abs()
    return qkv, angles.cos() * 1.3, angles.sin() * 1.3


@pytest.mark.parametrize("heads,kv,d", [(4, 2, 16), (8, 1, 64), (6, 2, 32)])  # 6 + 2 heads: a padded tile
def test_rope_qkv_into_a_paged_pool(heads: int, kv: int, d: int) -> None:
    n = 9
    qkv, cos, sin = _rope_inputs(n, heads, kv, d, seed=heads)
    pools = [torch.zeros(5, 4, kv, d) for _ in range(4)]  # (k, v) for Triton, (k, v) for torch
    slots = torch.tensor([3, 9, 0, 19, 17, 4, 5, 12, 1])
    q = triton_rope.rope_qkv_triton(qkv, cos, sin, heads, kv, pools[0], pools[1], slots)
    q0 = ops.rope_qkv_torch(qkv, cos, sin, heads, kv, pools[2], pools[3], slots)
    torch.testing.assert_close(q, q0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pools[0], pools[2], rtol=1e-6, atol=1e-6)
    assert torch.equal(pools[1], pools[3])  # values are copied as they are
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[slots] = False
    assert not pools[0].view(20, -1)[untouched].any()


def test_rope_qkv_dense_and_bfloat16() -> None:
    heads, kv, d, n = 4, 2, 16, 11
    qkv, cos, sin = _rope_inputs(n, heads, kv, d, seed=30, dtype=torch.bfloat16)
    k, v, k0, v0 = (torch.empty(n, kv, d, dtype=torch.bfloat16) for _ in range(4))
    q = KERNELS.rope_qkv(qkv, cos, sin, heads, kv, k, v, None)
    q0 = ops.rope_qkv_torch(qkv, cos, sin, heads, kv, k0, v0, None)
    _close_bf16(q, q0)
    _close_bf16(k, k0)
    assert torch.equal(v, v0)
    # a float32 qkv into a bfloat16 pool (cast on store)
    qkv32, cos, sin = _rope_inputs(n, heads, kv, d, seed=31)
    pool_k, pool_v = torch.zeros(3, 4, kv, d, dtype=torch.bfloat16), torch.zeros(3, 4, kv, d, dtype=torch.bfloat16)
    ref_k, ref_v = pool_k.clone(), pool_v.clone()
    slots = torch.arange(n) + 1
    triton_rope.rope_qkv_triton(qkv32, cos, sin, heads, kv, pool_k, pool_v, slots)
    ops.rope_qkv_torch(qkv32, cos, sin, heads, kv, ref_k, ref_v, slots)
    assert (pool_k.float() - ref_k.float()).abs().max() <= BF16_STEP * ref_k.float().abs().max()
