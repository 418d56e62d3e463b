"""RMSNorm in Triton, alone or fused with the residual add before it: one launch each.

* :func:`rmsnorm_triton` — the ``rmsnorm`` kernel: ``y = x * rsqrt(mean(x**2) + eps) * scale``
  computed in float32, stored in ``x``'s dtype.
* :func:`add_rmsnorm_triton` — the ``add_rmsnorm`` kernel: ``r = x + delta`` (rounded to
  ``x``'s dtype, as the torch path's residual add is), then ``(r, rmsnorm(r))``. In the model
  it joins a block's residual add to the next block's norm, so the residual stream makes one
  trip through memory per sublayer instead of three.

One program per row; the row (``hidden_size`` values, at most a few thousand) is held in
registers. Shapes: ``x [N, H]``, ``delta [N, H]`` (any float dtype), ``scale [H]`` (float32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launches import launch
from .triton_jit import jit
from .triton_moe import SUPPORTED_DTYPES


@jit(do_not_specialize=["n_cols"])
def _rmsnorm_kernel(x_ptr: tl.tensor, delta_ptr: tl.tensor, scale_ptr: tl.tensor, res_ptr: tl.tensor, y_ptr: tl.tensor,
                    n_cols: tl.tensor, stride_x: tl.tensor, stride_d: tl.tensor, stride_r: tl.tensor,
                    stride_y: tl.tensor, eps: tl.tensor, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr) -> None:
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_d + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(res_ptr + row * stride_r + offs, x, mask=ok)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / n_cols
    xf = xf * tl.rsqrt(mean_sq + eps)
    scale = tl.load(scale_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, (xf * scale).to(y_ptr.dtype.element_ty), mask=ok)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _norm(x: torch.Tensor, delta: torch.Tensor | None, scale: torch.Tensor, eps: float
          ) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"rmsnorm_triton computes in {SUPPORTED_DTYPES}, not {x.dtype}")
    shape = x.shape
    x2 = _rows(x)
    n, h = x2.shape
    y = torch.empty((n, h), dtype=x.dtype, device=x.device)
    res = torch.empty((n, h), dtype=x.dtype, device=x.device) if delta is not None else y
    d2 = _rows(delta) if delta is not None else x2
    if n:
        launch(_rmsnorm_kernel, (n,), x2, d2, scale.contiguous(), res, y, h, x2.stride(0), d2.stride(0),
               res.stride(0), y.stride(0), float(eps),
               HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(h), num_warps=4 if h <= 4096 else 8)
    return res.view(shape), y.view(shape)


def rmsnorm_triton(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """The ``rmsnorm`` kernel (contract in ``ops``)."""
    return _norm(x, None, scale, eps)[1]


def add_rmsnorm_triton(
    x: torch.Tensor, delta: torch.Tensor, scale: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``add_rmsnorm`` kernel (contract in ``ops``): ``(x + delta, rmsnorm(x + delta))``."""
    if delta.shape != x.shape:
        raise ValueError(f"delta {tuple(delta.shape)} does not match x {tuple(x.shape)}")
    return _norm(x, delta, scale, eps)
