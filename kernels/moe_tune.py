"""A tuning sweep for the MoE kernel's tiling, keyed on (rows per expert, shapes).

For each token count, random routing and random MXFP4 experts of the given shapes are built
on the device, every candidate :class:`~refinery.kernels.triton_moe.MoEConfig` is checked
against the heuristic's output and timed, and the fastest per (rows-per-expert bucket,
hidden, intermediate) is kept. The result is JSON that :func:`triton_moe.load_tuned_configs`
reads (``TUNED`` is consulted before the heuristic)::

    from refinery.kernels import moe_tune
    best = moe_tune.sweep(hidden=2880, inter=2880, num_experts=32, topk=4,
                          token_counts=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 4096, 8192])
    moe_tune.write(best, "moe_20b_h100.json")

Meant for a GPU (timings with CUDA events after a warm-up); on the CPU it runs under the
interpreter for testing only, its timings meaningless. Not yet run on a GPU.
"""
from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import asdict
from typing import Any, Callable, Iterable

import torch

from . import triton_moe
from .triton_moe import MoEConfig


def candidates(block_ms: Iterable[int] = (16, 32, 64), block_ns: Iterable[int] = (32, 64, 128),
               block_ks: Iterable[int] = (64, 128, 256), split_ks: Iterable[int] = (1, 2, 4, 8),
               num_warps: Iterable[int] = (4, 8), num_stages: Iterable[int] = (2, 3, 4)) -> list[MoEConfig]:
    """The cross product of the given tile sizes."""
    return [MoEConfig(m, n, k, s, w, st) for m, n, k, s, w, st in
            itertools.product(block_ms, block_ns, block_ks, split_ks, num_warps, num_stages)]


# an MoE layer's expert weights: mlp1 blocks, scales, bias, mlp2 blocks, scales, bias
Experts = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _problem(n: int, hidden: int, inter: int, num_experts: int, topk: int, device: torch.device,
             dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Experts]:
    g = torch.Generator(device=device).manual_seed(seed)

    def u8(*shape: int, lo: int = 0, hi: int = 256) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=g, device=device, dtype=torch.int32).to(torch.uint8)

    x = (torch.randn(n, hidden, generator=g, device=device) * 0.5).to(dtype)
    logits = torch.randn(n, num_experts, generator=g, device=device)
    w, idx = torch.topk(logits, topk, dim=-1)
    w = torch.softmax(w, dim=-1).to(dtype)
    experts: Experts = (
        u8(num_experts, 2 * inter, hidden // 32, 16), u8(num_experts, 2 * inter, hidden // 32, lo=118, hi=123),
        torch.zeros(num_experts, 2 * inter, device=device, dtype=dtype),
        u8(num_experts, hidden, inter // 32, 16), u8(num_experts, hidden, inter // 32, lo=118, hi=123),
        torch.zeros(num_experts, hidden, device=device, dtype=dtype))
    return x, idx, w, experts


def _time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()  # compile
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        timing_event: Callable[..., torch.cuda.Event] = torch.cuda.Event  # torch's, unannotated
        start, end = timing_event(enable_timing=True), timing_event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3 / repeats
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def sweep(hidden: int, inter: int, num_experts: int, topk: int, token_counts: Iterable[int],
          configs: list[MoEConfig] | None = None, device: torch.device | str = "cuda",
          dtype: torch.dtype = torch.bfloat16, repeats: int = 20, seed: int = 0) -> list[dict[str, Any]]:
    """The fastest config per rows-per-expert bucket (entries for ``load_tuned_configs``, each
    with its time and the heuristic's time for comparison). A candidate that fails to compile
    or launch, or disagrees with the heuristic's output, is skipped."""
    device = torch.device(device)
    configs = configs if configs is not None else candidates()
    best: dict[int, dict[str, Any]] = {}
    for n in token_counts:
        bucket = triton_moe.rows_per_expert_bucket(n, topk, num_experts)
        x, idx, w, experts = _problem(n, hidden, inter, num_experts, topk, device, dtype, seed + n)
        default = triton_moe.moe_config(n, topk, num_experts, hidden, inter)
        ref = triton_moe.moe_triton(x, idx, w, *experts, 7.0, 1.702, config=default)
        base_s = _time(lambda: triton_moe.moe_triton(x, idx, w, *experts, 7.0, 1.702, config=default), device, repeats)
        scale = ref.float().abs().max().item() or 1.0
        for cfg in configs:
            if cfg.block_k % 32 or (inter // cfg.split_k) < cfg.block_k:
                continue
            try:
                out = triton_moe.moe_triton(x, idx, w, *experts, 7.0, 1.702, config=cfg)
                if (out.float() - ref.float()).abs().max().item() > 2e-2 * scale:
                    continue
                seconds = _time(lambda: triton_moe.moe_triton(x, idx, w, *experts, 7.0, 1.702, config=cfg),
                                device, repeats)
            except Exception:  # noqa: BLE001 - a config that does not fit (shared memory, registers)
                continue
            entry = best.get(bucket)
            if entry is None or seconds < entry["seconds"]:
                best[bucket] = {"bucket": bucket, "hidden": hidden, "inter": inter, "config": asdict(cfg),
                                "seconds": seconds, "heuristic_seconds": base_s, "tokens": n}
    return [best[b] for b in sorted(best)]


def write(entries: list[dict[str, Any]], path: str | os.PathLike[str]) -> None:
    """Save a sweep for :func:`triton_moe.load_tuned_configs`."""
    with open(path, "w") as f:
        json.dump(entries, f, indent=1)
