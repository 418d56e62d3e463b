"""MXFP4 (OCP microscaling FP4, E2M1 values with one E8M0 scale per 32 weights).

A weight ``W[rows, K]`` is stored as ``blocks`` uint8 ``[rows, K/32, 16]`` and ``scales``
uint8 ``[rows, K/32]``. Element ``k`` lives in block ``k // 32``, byte ``(k % 32) // 2``:
the low nibble for even ``k``, the high nibble for odd ``k``. Its value is
``FP4[nibble] * 2**(scale - 127)``. Scale 255 is E8M0's NaN encoding and decodes to NaN.

Decoding is exact in float32 and bfloat16 (a power-of-two multiple of a 2-bit mantissa).
"""
from __future__ import annotations

import functools
import math

import torch

FP4_VALUES: tuple[float, ...] = (
    +0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)
BLOCK = 32  # weights per scale
SCALE_BIAS = 127


@functools.lru_cache(maxsize=None)
def _tables(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(byte -> [low value, high value] [256, 2], scale byte -> multiplier [256]) in ``dtype``."""
    fp4 = torch.tensor(FP4_VALUES, dtype=torch.float32)
    byte = torch.arange(256)
    pair = torch.stack([fp4[byte & 0x0F], fp4[byte >> 4]], dim=-1)
    mult = torch.tensor(
        [math.ldexp(1.0, s - SCALE_BIAS) for s in range(255)] + [math.nan], dtype=torch.float64
    )  # 2**-127 is a float32 subnormal, still exact
    return pair.to(device, dtype), mult.to(device, dtype)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode ``blocks [..., G, 16]`` and ``scales [..., G]`` into ``[..., G * 32]`` of ``dtype``."""
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    pair, mult = _tables(blocks.device, torch.promote_types(dtype, torch.float32))
    values = pair[blocks.long()]  # [..., G, 16, 2]
    values = values.flatten(-2) * mult[scales.long()].unsqueeze(-1)  # [..., G, 32]
    return values.flatten(-2).to(dtype)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round ``weight [..., K]`` to MXFP4 (nearest FP4 value, shared power-of-two scale).

    Only for building test checkpoints: it is simple, not the best possible rounding.
    """
    *prefix, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"last dimension {k} is not a multiple of {BLOCK}")
    w = weight.detach().to(torch.float32).reshape(*prefix, k // BLOCK, BLOCK)
    amax = w.abs().amax(dim=-1).clamp_min(2.0**-120)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = w / torch.exp2(exponent).unsqueeze(-1)
    fp4 = torch.tensor(FP4_VALUES, dtype=torch.float32)
    nibble = (scaled.unsqueeze(-1) - fp4).abs().argmin(dim=-1).to(torch.uint8)  # [..., G, 32]
    packed = nibble[..., 0::2] | (nibble[..., 1::2] << 4)
    return packed.contiguous(), (exponent + SCALE_BIAS).to(torch.uint8)
