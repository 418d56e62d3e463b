"""Benchmark: gpt-oss inference on one GPU, Triton kernels vs the dequantize-to-bf16 torch path.

Builds a model with gpt-oss-20b's (or -120b's) exact shapes and random MXFP4 expert weights
directly on the GPU (no download, no checkpoint on disk), then in one run measures, with the
engine's ``BatchedGenerator`` (paged KV cache, continuous batching):

1. per batch size (default 1, 32, 128, 256; 1024-token prompts, 256 new tokens):
   prefill tokens/s (prompt tokens / time until every sequence has its first token; decodes
   are held back meanwhile), decode tokens/s (all sequences decoding together) and peak GPU
   memory. Each batch is first run untimed with the same shapes (prompt length, batch, a few
   decode steps), so every kernel variant the timed run needs is compiled beforehand; the
   number of Triton compilations inside the timed regions is printed (it should be 0);
2. the same model's decode through the torch reference kernels (``ops.moe_torch`` decodes
   each routed expert to bf16, ``ops.paged_attention_torch`` gathers keys per sequence) at
   ``--baseline-batches`` with ``--baseline-tokens`` new tokens, and the Triton / torch ratio;
3. the batch-1 fraction of the memory-bandwidth roofline: bytes of active weights and KV read
   per decode step / measured step time, against the H100's peak (``--peak-tbps``, 3.35 TB/s)
   and against the measured device-to-device copy bandwidth; the goal is 50% of the peak;
4. batch-128 decode tokens/s against the 10,000 tok/s goal and vLLM's about 19,000;
5. launches per decode step (Triton launches plus torch operators that launch a kernel), in
   all and per layer, for the Triton path and the torch path (``refinery.kernels.launches``).

    .venv/bin/python bench/inference.py                       # 20b shapes, the full run
    .venv/bin/python bench/inference.py --model 120b          # must fit one H200 (141 GB)
    .venv/bin/python bench/inference.py --batches 1,32 --new-tokens 64
    .venv/bin/python bench/inference.py --cuda-graph          # decode steps as CUDA graphs
    .venv/bin/python bench/inference.py --tiny --json out.json  # CPU smoke run of the procedure

Without a CUDA device it exits with status 2 and says so (``--tiny`` runs on the CPU with a
tiny config and the torch kernels: it checks the procedure, its timings mean nothing; its
launch counts are real: the Triton path's are counted with the kernels run in Triton's
interpreter, which launches exactly what the GPU would).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from refinery.kernels import launches, ops
from refinery.kernels.batching import BatchedGenerator, sample
from refinery.kernels.config import ModelConfig
from refinery.kernels.model import Rotary, Transformer

SHAPES: dict[str, dict[str, Any]] = {
    "20b": dict(num_hidden_layers=24, num_experts=32),
    "120b": dict(num_hidden_layers=36, num_experts=128),
    # the engine tests' tiny model (tests/engine_fixtures.py), for --tiny
    "tiny": dict(num_hidden_layers=3, num_experts=4, experts_per_token=2, vocab_size=160, hidden_size=64,
                 intermediate_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
                 sliding_window=8),
}
GB = 1e9
H100_PEAK_TBPS = 3.35  # H100 SXM HBM3
BATCH128_GOAL, VLLM_BATCH128 = 10_000, 19_000  # decode tok/s at batch 128 (20b, one H100)


def model_config(name: str) -> ModelConfig:
    """gpt-oss-20b / -120b (``ModelConfig``'s other defaults are the shared ones) or ``tiny``."""
    if name not in SHAPES:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(SHAPES)}")
    return ModelConfig(**SHAPES[name])


# ---- byte counts ----------------------------------------------------------------------------


def expert_bytes(config: ModelConfig, dtype_bytes: int = 2) -> int:
    """One expert of one layer: MXFP4 blocks and scales of mlp1 and mlp2, plus their biases."""
    h, i = config.hidden_size, config.intermediate_size
    mlp1 = 2 * i * h // 2 + 2 * i * h // 32 + 2 * i * dtype_bytes
    mlp2 = h * i // 2 + h * i // 32 + h * dtype_bytes
    return mlp1 + mlp2


def dense_layer_bytes(config: ModelConfig, dtype_bytes: int = 2) -> int:
    """One layer without its experts: norms (fp32), qkv, sinks (fp32), out, router."""
    h, d = config.hidden_size, config.head_dim
    nq, nkv, e = config.num_attention_heads, config.num_key_value_heads, config.num_experts
    qkv = (nq + 2 * nkv) * d
    attn = h * 4 + qkv * (h + 1) * dtype_bytes + nq * 4 + h * (nq * d + 1) * dtype_bytes
    mlp = h * 4 + e * (h + 1) * dtype_bytes
    return attn + mlp


def weight_bytes(config: ModelConfig, dtype_bytes: int = 2) -> dict[str, int]:
    """Bytes of the whole model in the engine's layout (experts MXFP4, the rest ``dtype_bytes``)."""
    layers = config.num_hidden_layers
    experts = layers * config.num_experts * expert_bytes(config, dtype_bytes)
    dense = layers * dense_layer_bytes(config, dtype_bytes)
    embed = 2 * config.vocab_size * config.hidden_size * dtype_bytes + config.hidden_size * 4
    return {"experts": experts, "dense": dense + embed, "total": experts + dense + embed}


def kv_visible(config: ModelConfig, layer: int, context: int) -> int:
    """Keys a query at position ``context - 1`` reads in ``layer``."""
    return min(context, config.sliding_window) if config.is_sliding(layer) else context


def decode_step_bytes(config: ModelConfig, context: int, batch: int = 1, dtype_bytes: int = 2) -> int:
    """Bytes one decode step must read: every dense weight, the routed experts (``k`` per token,
    at most all of them), the unembedding, and each sequence's visible keys and values at
    ``context`` cached tokens."""
    layers = config.num_hidden_layers
    active_experts = min(config.num_experts, batch * config.experts_per_token)
    weights = layers * (dense_layer_bytes(config, dtype_bytes) + active_experts * expert_bytes(config, dtype_bytes))
    weights += config.vocab_size * config.hidden_size * dtype_bytes + batch * config.hidden_size * dtype_bytes
    kv_row = 2 * config.num_key_value_heads * config.head_dim * dtype_bytes
    kv = batch * kv_row * sum(kv_visible(config, layer, context) for layer in range(layers))
    return weights + kv


def kv_cache_bytes(
    config: ModelConfig, batch: int, max_seq_len: int, prefill_chunk: int, block_size: int = 16, dtype_bytes: int = 2
) -> int:
    """What ``PagedKVCache`` allocates for these settings (same block arithmetic)."""
    full_blocks = math.ceil(max_seq_len / block_size)
    sliding_blocks = min(full_blocks, math.ceil((config.sliding_window + prefill_chunk - 1) / block_size) + 1)
    per_block = 2 * block_size * config.num_key_value_heads * config.head_dim * dtype_bytes
    total = 0
    for layer in range(config.num_hidden_layers):
        blocks = sliding_blocks if config.is_sliding(layer) else full_blocks
        total += batch * blocks * per_block
    return total


def prefill_activation_bytes(config: ModelConfig, prefill_chunk: int, dtype_bytes: int = 2) -> int:
    """A generous bound on one prefill step's transient tensors (qkv, MoE rows, fp32 slots)."""
    h, k = config.hidden_size, config.experts_per_token
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    rows = prefill_chunk * k
    per_token = (4 * h + qkv) * dtype_bytes + k * config.intermediate_size * dtype_bytes + k * h * 4
    return prefill_chunk * per_token + rows * 64 + config.vocab_size * 4 * 256


def memory_plan(config: ModelConfig, batch: int, max_seq_len: int, prefill_chunk: int) -> dict[str, int]:
    """Estimated peak bytes of a run: weights + KV cache + prefill transients."""
    plan = {
        "weights": weight_bytes(config)["total"],
        "kv_cache": kv_cache_bytes(config, batch, max_seq_len, prefill_chunk),
        "activations": prefill_activation_bytes(config, prefill_chunk),
    }
    plan["total"] = sum(plan.values())
    return plan


# ---- the model ------------------------------------------------------------------------------


def random_model(config: ModelConfig, device: torch.device | str, dtype: torch.dtype, seed: int = 0) -> Transformer:
    """A ``Transformer`` with random weights made directly on ``device``: MXFP4 experts with
    random nibbles and scales around 2**-7 (weights of about 1/sqrt(hidden)), N(0, 0.02) dense
    weights, unit norm gains, zero sinks."""
    device = torch.device(device)
    with torch.device("meta"):
        model = Transformer(config, ops.kernels_for(device))
    g = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, meta in model.state_dict().items():
        shape = tuple(meta.shape)
        if meta.dtype == torch.uint8:
            lo, hi = (118, 122) if name.endswith("_scales") else (0, 256)
            state[name] = torch.randint(lo, hi, shape, generator=g, device=device, dtype=torch.uint8)
        elif name.endswith("norm.scale"):
            state[name] = torch.ones(shape, device=device, dtype=torch.float32)
        elif name.endswith("attn.sinks"):
            state[name] = torch.zeros(shape, device=device, dtype=torch.float32)
        else:
            state[name] = (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary = Rotary(config, torch.promote_types(dtype, torch.float32)).to(device)
    return model.eval().requires_grad_(False)


# ---- measurements ---------------------------------------------------------------------------


@dataclass
class RunResult:
    path: str  # "triton" or "torch"
    batch: int
    prompt_len: int
    new_tokens: int
    prefill_s: float
    prefill_tokens_per_s: float
    decode_steps: int
    decode_s: float
    decode_tokens_per_s: float
    step_ms: float
    peak_gb: float | None
    compiles_in_timed: int = 0  # Triton compilations inside the timed prefill and decode


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CompileCounter:
    """Counts Triton JIT compilations (in-process cache misses) while active."""

    def __init__(self) -> None:
        self.count = 0
        self._knobs = None
        self._saved = None

    def __enter__(self) -> "CompileCounter":
        try:
            from triton import knobs
        except ImportError:  # no triton: nothing compiles
            return self
        self._knobs, self._saved = knobs, knobs.runtime.jit_post_compile_hook

        def hook(**kwargs: Any) -> Any:
            self.count += 1
            return self._saved(**kwargs) if self._saved else None

        knobs.runtime.jit_post_compile_hook = hook
        return self

    def __exit__(self, *exc: object) -> None:
        if self._knobs is not None:
            self._knobs.runtime.jit_post_compile_hook = self._saved


def prefill_first_tokens(gen: BatchedGenerator, batch: int) -> dict[int, int]:
    """Step ``gen`` until each of its ``batch`` sequences has its first (greedy) token, holding
    them back so no decode mixes in; {sequence id: first token}, not yet given to ``gen``."""
    first: dict[int, int] = {}
    while len(first) < batch:
        result = gen.step()
        if result is None:
            raise RuntimeError("the generator stalled during prefill")
        logits, ids = result
        first.update(zip(ids, sample(logits, 0.0)))
    return first


def greedy_decode(gen: BatchedGenerator, max_steps: int | None = None) -> tuple[int, int]:
    """Decode greedily until ``gen`` is idle or ``max_steps`` steps ran; (steps, tokens decoded)."""
    steps = decoded = 0
    while not gen.idle and (max_steps is None or steps < max_steps):
        result = gen.step()
        if result is None:
            break
        logits, ids = result
        for sid, token in zip(ids, sample(logits, 0.0)):
            gen.update(sid, token)
        steps += 1
        decoded += len(ids)
    return steps, decoded


def run_batch(
    model: Transformer, batch: int, prompt_len: int, new_tokens: int, prefill_chunk: int, path: str, seed: int = 0,
    cuda_graph: bool = False, decode_steps: int | None = None,
) -> RunResult:
    """Prefill ``batch`` random prompts, then decode ``new_tokens`` each (greedy), timing both;
    ``decode_steps`` stops the decode early (a warm-up with the same cache and table shapes)."""
    device = model.device
    gen = BatchedGenerator(model, max_seq_len=prompt_len + new_tokens, max_batch=batch,
                           prefill_chunk=prefill_chunk, cuda_graph=cuda_graph)
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g).tolist()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for p in prompts:
        gen.add(p, max_tokens=new_tokens)
    _sync(device)
    compiles = CompileCounter()
    compiles.__enter__()
    t0 = time.perf_counter()
    first = prefill_first_tokens(gen, batch)
    _sync(device)
    t1 = time.perf_counter()
    for sid, token in first.items():
        gen.update(sid, token)
    steps, decoded = greedy_decode(gen, decode_steps)
    _sync(device)
    t2 = time.perf_counter()
    compiles.__exit__(None, None, None)
    peak = torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else None
    decode_s = max(t2 - t1, 1e-9)
    return RunResult(
        path=path, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
        prefill_s=t1 - t0, prefill_tokens_per_s=batch * prompt_len / max(t1 - t0, 1e-9),
        decode_steps=steps, decode_s=decode_s, decode_tokens_per_s=decoded / decode_s,
        step_ms=1e3 * decode_s / max(steps, 1), peak_gb=peak, compiles_in_timed=compiles.count,
    )


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    _sync(device)
    return 2 * nbytes * repeats / (time.perf_counter() - t0)


def roofline(config: ModelConfig, batch1: RunResult, bandwidth: float, peak: float = H100_PEAK_TBPS * 1e12
             ) -> dict[str, float]:
    """Batch-1 decode against the bandwidth roofline, at the decode's mean context length: the
    achieved bytes/s as a fraction of the GPU's peak (``fraction``, the goal's measure) and of
    the measured copy bandwidth (what a perfect kernel could reach in practice)."""
    context = batch1.prompt_len + batch1.new_tokens // 2
    step_bytes = decode_step_bytes(config, context, batch=1)
    achieved = step_bytes / (batch1.step_ms / 1e3)
    return {
        "step_bytes": step_bytes,
        "achieved_bytes_per_s": achieved,
        "peak_bytes_per_s": peak,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "roofline_tokens_per_s": peak / step_bytes,
        "copy_roofline_tokens_per_s": bandwidth / step_bytes,
        "fraction": achieved / peak,
        "fraction_of_copy_bandwidth": achieved / bandwidth,
    }


def count_decode_launches(
    model: Transformer, batch: int, prompt_len: int, prefill_chunk: int, kernels: ops.Kernels
) -> dict[str, object]:
    """Launches of one decode step of ``batch`` sequences at ``prompt_len`` context, run with
    ``kernels`` (the prefill before it uses the model's own set): in all,
    per layer, outside the layers, by name."""
    gen = BatchedGenerator(model, max_seq_len=prompt_len + 2, max_batch=batch, prefill_chunk=prefill_chunk)
    g = torch.Generator().manual_seed(batch)
    for p in torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g).tolist():
        gen.add(p, max_tokens=2)
    first: dict[int, int] = {}
    while len(first) < batch:
        stepped = gen.step()
        if stepped is None:
            raise RuntimeError(f"the generator stopped with {len(first)} of {batch} first tokens")
        logits, ids = stepped
        first.update(zip(ids, sample(logits, 0.0)))
    for sid, token in first.items():
        gen.update(sid, token)
    with model.using_kernels(kernels):
        _, counter, per_layer = launches.per_layer(model, gen.step)
    _sync(model.device)
    return {
        "batch": batch,
        "total": counter.total,
        "triton": counter.triton,
        "aten": counter.aten,
        "per_layer_max": max(per_layer),
        "per_layer_mean": sum(per_layer) / len(per_layer),
        "outside_layers": counter.total - sum(per_layer),
        "by_name": dict(sorted(counter.by_name.items())),
    }


def _fmt_launches(path: str, c: dict[str, object]) -> str:
    return (f"[{path:6s}] launches per decode step at batch {c['batch']}: {c['total']} "
            f"({c['triton']} Triton + {c['aten']} torch), {c['per_layer_max']} per layer at most "
            f"(mean {c['per_layer_mean']:.1f}), {c['outside_layers']} outside the layers")


# ---- command line ---------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", choices=["20b", "120b"], default="20b", help="shapes to build (default 20b)")
    p.add_argument("--batches", type=_ints, help="batch sizes (default 1,32,128,256; --tiny: 1,3)")
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens per sequence (default 1024)")
    p.add_argument("--new-tokens", type=int, default=256, help="generated tokens per sequence (default 256)")
    p.add_argument("--prefill-chunk", type=int, default=8192, help="prompt tokens per step (default 8192)")
    p.add_argument("--baseline-batches", type=_ints, default=[1, 32],
                   help="batch sizes for the torch-path baseline (default 1,32)")
    p.add_argument("--baseline-tokens", type=int, default=32,
                   help="generated tokens per sequence in the baseline (default 32; it is slow)")
    p.add_argument("--copy-gb", type=float, default=2.0, help="buffer size for the bandwidth probe (default 2)")
    p.add_argument("--peak-tbps", type=float, default=H100_PEAK_TBPS,
                   help=f"the GPU's peak memory bandwidth for the roofline (default {H100_PEAK_TBPS}, H100 SXM)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="run decode steps as CUDA graphs (BatchedGenerator(cuda_graph=True); not yet validated)")
    p.add_argument("--launch-context", type=int,
                   help="cached tokens per sequence when counting launches per decode step (default: --prompt-len)")
    p.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true",
                   help="CPU smoke run: tiny model, torch kernels, small batches (checks the procedure only)")
    args = p.parse_args(argv)
    if args.tiny:
        if args.cuda_graph:
            p.error("--cuda-graph needs a GPU; --tiny runs on the CPU")
        args.model, args.baseline_batches = "tiny", [1]
        args.batches = args.batches or [1, 3]
        args.prompt_len, args.new_tokens, args.baseline_tokens = 24, 6, 4
        args.prefill_chunk, args.copy_gb = 32, 0.05
    args.batches = args.batches or [1, 32, 128, 256]
    for name in ("prompt_len", "new_tokens", "prefill_chunk", "baseline_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.new_tokens < 2 or args.baseline_tokens < 2:
        p.error("--new-tokens and --baseline-tokens must be at least 2 (the first comes from prefill)")
    return args


def _fmt(r: RunResult) -> str:
    peak = f"{r.peak_gb:.1f} GB" if r.peak_gb is not None else "n/a"
    return (f"[{r.path:6s}] batch {r.batch:4d}: prefill {r.prefill_tokens_per_s:12,.0f} tok/s   "
            f"decode {r.decode_tokens_per_s:10,.1f} tok/s ({r.step_ms:8.2f} ms/step)   peak {peak}   "
            f"compiles in timed runs {r.compiles_in_timed}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tiny:
        device, dtype = torch.device("cpu"), torch.float32
    else:
        if not torch.cuda.is_available():
            print("bench/inference.py needs a CUDA GPU and torch.cuda.is_available() is False here; "
                  "nothing was measured. (--tiny runs the procedure on the CPU with a tiny model.)",
                  file=sys.stderr)
            return 2
        device, dtype = torch.device("cuda"), torch.bfloat16
    config = model_config(args.model)
    max_seq = args.prompt_len + args.new_tokens
    kernels_path = ops.kernels_for(device).name
    print(f"model {args.model}: {config.num_hidden_layers} layers, {config.num_experts} experts, "
          f"{weight_bytes(config)['total'] / GB:.2f} GB of weights; device {device} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}); kernels: {kernels_path}")
    if device.type == "cuda":
        capacity = torch.cuda.get_device_properties(device).total_memory
        plan = memory_plan(config, max(args.batches), max_seq, args.prefill_chunk)
        print(f"memory plan at batch {max(args.batches)}: " + ", ".join(f"{k} {v / GB:.1f} GB" for k, v in plan.items())
              + f" of {capacity / GB:.1f} GB")
        if plan["total"] > capacity:
            print("the largest batch does not fit this GPU; lower --batches or --prefill-chunk", file=sys.stderr)
            return 3
    t = time.perf_counter()
    model = random_model(config, device, dtype, seed=args.seed)
    _sync(device)
    print(f"built the random model in {time.perf_counter() - t:.1f} s")

    results: list[RunResult] = []
    for batch in args.batches:
        # untimed, with the timed run's shapes: compiles every kernel variant it will need
        run_batch(model, batch, args.prompt_len, args.new_tokens, args.prefill_chunk, "warmup", args.seed + 1,
                  args.cuda_graph, decode_steps=3)
        r = run_batch(model, batch, args.prompt_len, args.new_tokens, args.prefill_chunk, kernels_path, args.seed,
                      args.cuda_graph)
        results.append(r)
        print(_fmt(r), flush=True)
    baseline: list[RunResult] = []
    with model.using_kernels(ops.TORCH):
        for batch in args.baseline_batches:
            r = run_batch(model, batch, args.prompt_len, args.baseline_tokens, args.prefill_chunk, "torch", args.seed)
            baseline.append(r)
            print(_fmt(r), flush=True)

    summary: dict[str, object] = {"model": args.model, "device": str(device), "kernels": kernels_path,
                                  "cuda_graph": args.cuda_graph}
    by_batch = {r.batch: r for r in results}
    for b in baseline:
        if b.batch in by_batch:
            ratio = by_batch[b.batch].decode_tokens_per_s / b.decode_tokens_per_s
            summary[f"decode_ratio_batch{b.batch}"] = ratio
            print(f"decode speed-up over the torch path at batch {b.batch}: {ratio:.1f}x")
    if 1 in by_batch:
        bw = copy_bandwidth(device, int(args.copy_gb * GB))
        roof = roofline(config, by_batch[1], bw, args.peak_tbps * 1e12)
        summary["roofline_batch1"] = roof
        print(f"batch-1 decode reads {roof['step_bytes'] / GB:.2f} GB per step, achieved "
              f"{roof['achieved_bytes_per_s'] / GB:.0f} GB/s = {100 * roof['fraction']:.1f}% of roofline at the "
              f"{args.peak_tbps:.2f} TB/s peak ({roof['roofline_tokens_per_s']:.0f} tok/s; goal 50%: "
              f"{'met' if roof['fraction'] >= 0.5 else 'NOT met'}) and "
              f"{100 * roof['fraction_of_copy_bandwidth']:.1f}% of the measured copy bandwidth {bw / GB:.0f} GB/s "
              f"({roof['copy_roofline_tokens_per_s']:.0f} tok/s)")
    for r in results:
        if r.batch == 128:
            tps = r.decode_tokens_per_s
            summary["batch128"] = {"decode_tokens_per_s": tps, "goal": BATCH128_GOAL, "vllm": VLLM_BATCH128,
                                   "goal_met": tps >= BATCH128_GOAL}
            print(f"batch-128 aggregate decode: {tps:,.0f} tok/s = {100 * tps / BATCH128_GOAL:.0f}% of the "
                  f"{BATCH128_GOAL:,} tok/s goal ({'met' if tps >= BATCH128_GOAL else 'NOT met'}), "
                  f"{100 * tps / VLLM_BATCH128:.0f}% of vLLM's about {VLLM_BATCH128:,}")
    timed_compiles = sum(r.compiles_in_timed for r in results + baseline)
    summary["compiles_in_timed_runs"] = timed_compiles
    if kernels_path == "triton" or args.tiny:
        print(f"Triton compilations inside timed regions: {timed_compiles}")
    peaks = [r.peak_gb for r in results if r.peak_gb is not None]
    if peaks:
        print(f"peak GPU memory over the runs: {max(peaks):.1f} GB")

    # launches per decode step, Triton path and torch path (on the CPU: Triton interpreted)
    counts: dict[str, list[dict[str, object]]] = {"triton": [], "torch": []}
    context = args.launch_context or args.prompt_len
    triton_kernels = None
    if device.type == "cpu":
        from refinery.kernels.interpret import interpreted_triton_kernels

        triton_kernels = interpreted_triton_kernels()
    elif kernels_path == "triton":
        triton_kernels = model.kernels
    for path, kernels in (("triton", triton_kernels), ("torch", ops.TORCH)):
        if kernels is None:
            continue
        for batch in args.batches:
            c = count_decode_launches(model, batch, context, args.prefill_chunk, kernels)
            counts[path].append(c)
            print(_fmt_launches(path, c), flush=True)
    summary["launches_per_decode_step"] = counts
    summary["runs"] = [asdict(r) for r in results + baseline]
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
