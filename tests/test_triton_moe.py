"""The Triton MXFP4 MoE (routing, grouping, fused grouped matmuls) against the torch path,
run in Triton's interpreter on CPU tensors."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

import pytest

if TYPE_CHECKING:
    from torch import Tensor

torch = pytest.importorskip("torch", reason="the inference extra (torch) is not installed")
if importlib.util.find_spec("triton") is None:  # not importorskip: triton must load interpreted
    pytest.skip("triton is not installed", allow_module_level=True)

from engine_fixtures import interpreted_triton_kernels  # noqa: E402

KERNELS = interpreted_triton_kernels()  # TRITON_INTERPRET=1: the kernels run on CPU tensors

from refinery.kernels import mxfp4, ops, triton_moe  # noqa: E402


def _experts(e: int, h: int, i: int, seed: int, scale_lo: int = 119, scale_hi: int = 125) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)

    def u8(*shape: int, lo: int = 0, hi: int = 256) -> Tensor:
        drawn: Tensor = torch.randint(lo, hi, shape, generator=g, dtype=torch.int32).to(torch.uint8)
        return drawn

    return dict(
        mlp1_blocks=u8(e, 2 * i, h // 32, 16),
        mlp1_scales=u8(e, 2 * i, h // 32, lo=scale_lo, hi=scale_hi),
        mlp1_bias=torch.randn(e, 2 * i, generator=g) * 0.2,
        mlp2_blocks=u8(e, h, i // 32, 16),
        mlp2_scales=u8(e, h, i // 32, lo=119, hi=125),
        mlp2_bias=torch.randn(e, h, generator=g) * 0.2,
    )


def _routing(n: int, e: int, k: int, seed: int, skip: Iterable[int] = ()) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, e, generator=g)
    for expert in skip:
        logits[:, expert] -= 1000.0  # never chosen: an empty expert
    routed: Tensor = logits
    return routed


def _moe(fn: Callable[..., Tensor], x: Tensor, idx: Tensor, w: Tensor, experts: dict[str, Tensor],
         limit: float = 7.0, **kw: int) -> Tensor:
    return fn(x, idx, w, experts["mlp1_blocks"], experts["mlp1_scales"], experts["mlp1_bias"],
              experts["mlp2_blocks"], experts["mlp2_scales"], experts["mlp2_bias"], limit, 1.702, **kw)


@pytest.mark.parametrize("n,e,k", [(1, 4, 2), (7, 5, 3), (19, 32, 4), (3, 130, 4)])
def test_route_matches_topk_softmax(n: int, e: int, k: int) -> None:
    logits = _routing(n, e, k, seed=n + e)
    idx, w = triton_moe.route_triton(logits, k)
    ref_idx, ref_w = ops.route_torch(logits, k)
    assert idx.dtype == torch.long and idx.shape == (n, k)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-6)
    assert torch.allclose(w.sum(-1), torch.ones(n))


@pytest.mark.parametrize("group", [triton_moe.group_by_expert, triton_moe.group_by_expert_triton])
def test_group_by_expert_layout(group: Callable[..., tuple[Tensor, Tensor]]) -> None:
    idx = torch.tensor([[2, 0], [2, 4], [0, 2], [4, 2], [2, 0]])  # experts 1 and 3 empty
    rows, block_expert = group(idx, num_experts=5, block_m=2)
    n = idx.numel()
    assert block_expert.shape[0] * 2 == rows.shape[0] == 2 * min(n, (n + 5) // 2)
    flat = idx.reshape(-1)
    seen = []
    for b, expert in enumerate(block_expert.tolist()):
        block_rows = [r for r in rows[2 * b : 2 * b + 2].tolist() if r < n]
        if expert < 0:
            assert block_rows == []
            continue
        assert block_rows and all(int(flat[r]) == expert for r in block_rows)
        seen += block_rows
    assert sorted(seen) == list(range(n))  # every (token, slot) exactly once
    assert [e for e in block_expert.tolist() if e >= 0] == [0, 0, 2, 2, 2, 4]


@pytest.mark.parametrize("n", [1, 7, 33])
def test_moe_odd_token_counts_and_empty_experts(n: int) -> None:
    e, h, i, k = 6, 64, 96, 2
    experts = _experts(e, h, i, seed=n)
    idx, w = ops.route_torch(_routing(n, e, k, seed=100 + n, skip=(1, 4)), k)
    assert not bool(((idx == 1) | (idx == 4)).any())
    x = torch.randn(n, h, generator=torch.Generator().manual_seed(n))
    ref = _moe(ops.moe_torch, x, idx, w, experts)
    got = _moe(triton_moe.moe_triton, x, idx, w, experts, block_k=64)  # 96 % 64: a ragged K tile
    assert got.shape == (n, h) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())
    # block_m 64 (the prefill tiling) and wider K steps agree too
    got64 = _moe(triton_moe.moe_triton, x, idx, w, experts, block_m=64, block_n=32, block_k=128)
    torch.testing.assert_close(got64, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # sigmoid of a huge unclamped gate
def test_moe_decodes_every_nibble_and_extreme_scales() -> None:
    e, h, i, k, n = 3, 64, 64, 2, 5
    experts = _experts(e, h, i, seed=3, scale_lo=0, scale_hi=140)  # includes scale byte 0 (2**-127)
    idx = torch.tensor([[0, 2], [2, 0], [0, 2], [2, 0], [0, 2]])  # expert 1 empty
    w = torch.softmax(torch.randn(n, k, generator=torch.Generator().manual_seed(4)), -1)
    x = torch.randn(n, h, generator=torch.Generator().manual_seed(5))
    ref = _moe(ops.moe_torch, x, idx, w, experts)
    got = _moe(triton_moe.moe_triton, x, idx, w, experts)
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # the limit matters here: the same weights without the clamp give another answer
    unclamped = _moe(triton_moe.moe_triton, x, idx, w, experts, limit=1e30)
    assert not torch.allclose(unclamped, got)
    torch.testing.assert_close(unclamped, _moe(ops.moe_torch, x, idx, w, experts, limit=1e30),
                               rtol=1e-5, atol=1e-5 * unclamped.abs().max().item())


def test_moe_bfloat16_and_registry_wrapper() -> None:
    e, h, i, k, n = 4, 64, 64, 2, 9
    experts = {name: (t.to(torch.bfloat16) if t.is_floating_point() else t)
               for name, t in _experts(e, h, i, seed=9).items()}
    x = torch.randn(n, h, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    idx, w = KERNELS.route(_routing(n, e, k, seed=9).to(torch.bfloat16), k)
    assert w.dtype == torch.bfloat16
    ref = _moe(ops.moe_torch, x.float(), idx, w.float(),
               {n_: (t.float() if t.is_floating_point() else t) for n_, t in experts.items()})
    got = _moe(KERNELS.moe, x, idx, w, experts)
    assert got.dtype == torch.bfloat16
    rel = (got.float() - ref).abs().max() / ref.abs().max()
    assert rel < 2e-2, rel
    # float64 is not a Triton dtype: the registry wrapper takes the torch path
    x64 = x.double()
    e64 = {n_: (t.double() if t.is_floating_point() else t) for n_, t in experts.items()}
    torch.testing.assert_close(_moe(KERNELS.moe, x64, idx, w.double(), e64),
                               _moe(ops.moe_torch, x64, idx, w.double(), e64))
    with pytest.raises(TypeError):
        _moe(triton_moe.moe_triton, x64, idx, w.double(), e64)


def test_mxfp4_layout_assumption() -> None:
    # the kernel reads element k from byte k // 2 (low nibble for even k) and scale k // 32
    blocks = torch.tensor([[[0x21] + [0] * 15]], dtype=torch.uint8)  # k=0 -> 0.5, k=1 -> 1.0
    scales = torch.tensor([[128]], dtype=torch.uint8)
    row = mxfp4.dequantize(blocks, scales)[0]
    assert row[0].item() == 1.0 and row[1].item() == 2.0 and not row[2:].any()


@pytest.mark.parametrize("n,e,k,block_m", [(1, 32, 4, 16), (37, 5, 2, 16), (150, 32, 4, 16), (300, 130, 4, 64),
                                           (9, 128, 4, 32), (513, 8, 2, 64)])
def test_group_kernel_equals_torch_grouping(n: int, e: int, k: int, block_m: int) -> None:
    # several chunks of the single-program kernel (CHUNK is 16..128 rows), skewed routing
    g = torch.Generator().manual_seed(n + e)
    idx = torch.multinomial(torch.rand(e, generator=g) ** 4 + 1e-3, n * k, replacement=True, generator=g).view(n, k)
    ref = triton_moe.group_by_expert(idx, e, block_m)
    got = triton_moe.group_by_expert_triton(idx, e, block_m)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@pytest.mark.parametrize("block_m,split_k", [(16, 1), (16, 2), (32, 3), (64, 2)])
def test_moe_tilings_and_split_k(block_m: int, split_k: int) -> None:
    e, h, i, k, n = 5, 64, 192, 2, 23
    experts = _experts(e, h, i, seed=block_m + split_k)
    idx, w = ops.route_torch(_routing(n, e, k, seed=7), k)
    x = torch.randn(n, h, generator=torch.Generator().manual_seed(8))
    ref = _moe(ops.moe_torch, x, idx, w, experts)
    got = _moe(triton_moe.moe_triton, x, idx, w, experts, block_m=block_m, block_n=32, block_k=64, split_k=split_k)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("decode", ["scaled_dot", "bits"])
def test_moe_bfloat16_both_decode_paths(decode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # bf16/fp16 activations go to tl.dot_scaled (e2m1 x e8m0); REFINERY_MXFP4_DECODE=bits keeps
    # the in-register decode. Both against the float32 torch path on the same bf16 values.
    if decode == "bits":
        monkeypatch.setenv("REFINERY_MXFP4_DECODE", "bits")
    # Triton 3.7's interpreter has no dot_scaled: there the kernel must fall back to the bit decode
    # (and still be right); compiled, or with an interpreter that has it, the scaled path runs.
    want_scaled = decode == "scaled_dot" and triton_moe.scaled_dot_available()
    assert triton_moe.uses_scaled_dot(torch.bfloat16) == want_scaled
    e, h, i, k, n = 4, 64, 128, 2, 19
    experts = {name: (t.to(torch.bfloat16) if t.is_floating_point() else t)
               for name, t in _experts(e, h, i, seed=19).items()}
    x = torch.randn(n, h, generator=torch.Generator().manual_seed(19)).to(torch.bfloat16)
    idx, w = ops.route_torch(_routing(n, e, k, seed=19).to(torch.bfloat16), k)
    ref = _moe(ops.moe_torch, x.float(), idx, w.float(),
               {n_: (t.float() if t.is_floating_point() else t) for n_, t in experts.items()})
    for split_k in (1, 2):
        got = _moe(triton_moe.moe_triton, x, idx, w, experts, block_k=64, split_k=split_k)
        assert got.dtype == torch.bfloat16
        assert (got.float() - ref).abs().max() / ref.abs().max() < 2e-2


def test_moe_config_heuristic_and_tuned_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = triton_moe.moe_config
    # 20b shapes (32 experts, top-4): block_m from the rows each expert gets
    assert cfg(1, 4, 32, 2880, 2880).block_m == 16
    assert cfg(128, 4, 32, 2880, 2880).block_m == 16  # 16 rows per expert
    assert cfg(256, 4, 32, 2880, 2880).block_m == 32
    assert cfg(8192, 4, 32, 2880, 2880).block_m == 64  # prefill
    # split-K only while the batch is too small to fill the GPU
    assert cfg(1, 4, 32, 2880, 2880).split_k == 2
    assert cfg(128, 4, 32, 2880, 2880).split_k == 1
    assert cfg(1, 2, 4, 64, 64).split_k == 1  # K too short to split
    configs = triton_moe.engine_configs(2880, 2880, 4, 32)
    assert {c.block_m for c in configs} == {16, 32, 64}
    # a tuning sweep's table takes over for its (bucket, shapes)
    monkeypatch.setattr(triton_moe, "TUNED", {})
    path = tmp_path / "tuned.json"
    path.write_text('[{"bucket": 1, "hidden": 2880, "inter": 2880, "config": {"block_m": 16, "block_n": 32, '
                    '"block_k": 256, "split_k": 4}}]')
    assert triton_moe.load_tuned_configs(path) == 1
    assert cfg(1, 4, 32, 2880, 2880) == triton_moe.MoEConfig(16, 32, 256, 4)
    assert cfg(2, 4, 32, 2880, 2880) == triton_moe.MoEConfig(16, 32, 256, 4)  # same bucket
    assert cfg(64, 4, 32, 2880, 2880).split_k == 1


def test_tuning_sweep_runs_and_its_table_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # functional only (timings under the interpreter mean nothing): two candidates, two buckets
    from refinery.kernels import moe_tune

    cands = [triton_moe.MoEConfig(16, 32, 64, 1), triton_moe.MoEConfig(16, 32, 64, 2)]
    best = moe_tune.sweep(hidden=64, inter=128, num_experts=4, topk=2, token_counts=[1, 9], configs=cands,
                          device="cpu", dtype=torch.float32, repeats=1)
    assert [e["bucket"] for e in best] == [1, 8] and all(e["config"] in [vars(c) for c in cands] for e in best)
    path = tmp_path / "tuned.json"
    moe_tune.write(best, path)
    monkeypatch.setattr(triton_moe, "TUNED", {})
    assert triton_moe.load_tuned_configs(path) == 2
    assert triton_moe.moe_config(9, 2, 4, 64, 128) == triton_moe.MoEConfig(**best[1]["config"])
