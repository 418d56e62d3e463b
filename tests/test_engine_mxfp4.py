"""MXFP4 decode against the spec, and the MoE kernel against a dense reading of the spec."""
from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the inference extra (torch) is not installed")

from refinery.kernels import mxfp4, ops  # noqa: E402

FP4_SPEC = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def spec_value(nibble: int, scale: int) -> float:
    """Value of one element per the spec: FP4[nibble] * 2**(scale - 127); E8M0 255 is NaN."""
    if scale == 255:
        return math.nan
    return FP4_SPEC[nibble] * 2.0 ** (scale - 127)


def test_import_without_torch_side_effects() -> None:
    code = "import sys, refinery.kernels, refinery.kernels.config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_nibble_and_every_scale() -> None:
    # Row r uses scale r (0..255); its 16 groups hold all 256 byte values, i.e. every
    # (low nibble, high nibble) pair, so each nibble value is seen at even and odd k.
    byte_values = torch.arange(128, dtype=torch.int32).reshape(8, 16).to(torch.uint8)
    byte_values = torch.cat([byte_values, byte_values + 128])  # [16, 16]: all 256 bytes
    blocks = byte_values.unsqueeze(0).expand(256, 16, 16).contiguous()  # [rows, G=16, 16]
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).unsqueeze(1).expand(256, 16).contiguous()
    for dtype in (torch.float32, torch.float64):
        got = mxfp4.dequantize(blocks, scales, dtype)
        assert got.shape == (256, 16 * 32) and got.dtype == dtype
        for row in range(256):
            expected = []
            for g in range(16):
                for byte in byte_values[g].tolist():
                    expected += [spec_value(byte & 0x0F, row), spec_value(byte >> 4, row)]
            want = torch.tensor(expected, dtype=torch.float64).to(dtype)
            assert torch.equal(torch.isnan(got[row]), torch.isnan(want))
            ok = ~torch.isnan(want)
            assert torch.equal(got[row][ok], want[ok]), f"scale {row}"
            assert torch.equal(torch.signbit(got[row][ok]), torch.signbit(want[ok])), f"sign, scale {row}"


def test_bf16_decode_is_exact() -> None:
    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (8, 4, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(100, 150, (8, 4), generator=g, dtype=torch.int32).to(torch.uint8)
    wide = mxfp4.dequantize(blocks, scales, torch.float32)
    assert torch.equal(mxfp4.dequantize(blocks, scales, torch.bfloat16).float(), wide)


def test_element_order() -> None:
    # k even -> low nibble, k odd -> high nibble of byte (k % 32) // 2 of block k // 32.
    blocks = torch.zeros(1, 2, 16, dtype=torch.uint8)
    blocks[0, 1, 3] = 0x71  # low nibble 1 (0.5) -> k = 32 + 6, high nibble 7 (6.0) -> k = 32 + 7
    scales = torch.tensor([[127, 128]], dtype=torch.uint8)
    w = mxfp4.dequantize(blocks, scales)[0]
    assert w[38].item() == 1.0 and w[39].item() == 12.0
    assert w.abs().sum().item() == 13.0


def test_quantize_roundtrip() -> None:
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    blocks, scales = mxfp4.quantize(w)
    assert blocks.shape == (6, 2, 16) and scales.shape == (6, 2)
    back = mxfp4.dequantize(blocks, scales)
    assert torch.equal(mxfp4.dequantize(*mxfp4.quantize(back)), back)  # representable values are kept
    assert (back - w).abs().max() <= w.abs().max() / 4


def test_moe_kernel_matches_dense_spec() -> None:
    g = torch.Generator().manual_seed(1)
    n, h, i, e, k = 9, 64, 32, 5, 2
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    b1 = torch.randint(0, 256, (e, 2 * i, h // 32, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    s1 = torch.randint(120, 126, (e, 2 * i, h // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    b2 = torch.randint(0, 256, (e, h, i // 32, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    s2 = torch.randint(120, 126, (e, h, i // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    bias1 = torch.randn(e, 2 * i, generator=g, dtype=torch.float64)
    bias2 = torch.randn(e, h, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    wts = torch.softmax(torch.randn(n, k, generator=g, dtype=torch.float64), dim=-1)
    got = ops.moe_torch(x, idx, wts, b1, s1, bias1, b2, s2, bias2, 7.0, 1.702)
    want = torch.zeros_like(x)
    for t in range(n):
        for j in range(k):
            ex = int(idx[t, j])
            hidden = mxfp4.dequantize(b1[ex], s1[ex], torch.float64) @ x[t] + bias1[ex]
            gate, lin = hidden[0::2].clamp(max=7.0), hidden[1::2].clamp(-7.0, 7.0)
            act = gate * torch.sigmoid(1.702 * gate) * (lin + 1)
            want[t] += wts[t, j] * (mxfp4.dequantize(b2[ex], s2[ex], torch.float64) @ act + bias2[ex])
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_kernel_sets_take_replacements() -> None:
    calls: list[tuple[int, ...]] = []

    def spy_moe(*args: Any) -> Any:
        calls.append(tuple(args[0].shape))
        return ops.moe_torch(*args)

    spied = ops.TORCH.replace(moe=spy_moe)
    assert spied.moe is spy_moe and spied.attention is ops.attention_torch and spied.name == "torch+moe"
    assert ops.TORCH.moe is ops.moe_torch  # the reference set is left as it is
