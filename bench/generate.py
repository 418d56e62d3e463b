"""Beam overhead of the gpt-oss ModelHandler: tokens/s inside RunInference vs the engine alone.

    .venv/bin/python bench/generate.py                       # CPU, tiny random model
    .venv/bin/python bench/generate.py --checkpoint CKPT --device cuda --dtype bfloat16 --prompts 256

Both sides generate the same prompts with the same batch limit (``--max-batch``) and the
same number of new tokens (no stop tokens, so every sequence runs to ``--max-tokens``):

- engine: ``GptOssEngine.generate`` on all prompts (continuous batching), timed after a warm-up;
- pipeline: DirectRunner (in-process) ``Create | RunInference(KeyedGptOssModelHandler(handler))``,
  timed from pipeline start to finish, the engine already loaded (shared model, warm-up run
  first with the same ``model_identifier``).

Prints tokens/s of both and the ratio (the issue's target on a GPU: >= 0.8). Without
``--checkpoint`` a tiny random model is built in a temporary folder: the figure is then a CPU
figure for a toy model, where per-step Python overhead dominates, not a GPU figure.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="gpt-oss checkpoint (default: a tiny random one, CPU)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="alternating runs of each; the best is kept")
    args = p.parse_args()

    import apache_beam as beam
    import torch
    from apache_beam.ml.inference.base import RunInference
    from apache_beam.options.pipeline_options import PipelineOptions

    from refinery.transforms.inference.handler import EngineSettings, GenerationParams, GptOssEngine
    from refinery.transforms.inference.model_handler import GptOssModelHandler, KeyedGptOssModelHandler

    ckpt = args.checkpoint
    label = "given checkpoint"
    if ckpt is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from engine_fixtures import write_harmony_checkpoint

        ckpt = str(write_harmony_checkpoint(Path(tempfile.mkdtemp()) / "tiny", num_hidden_layers=2))
        label = "tiny random model (2 layers, hidden 64), CPU"
    seq_len = args.prompt_len + args.max_tokens + 16
    settings = EngineSettings(ckpt, device=args.device, dtype=args.dtype, max_batch=args.max_batch,
                              max_seq_len=seq_len)
    params = GenerationParams(max_tokens=args.max_tokens, temperature=0.0, stop_tokens=())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 199000, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    total = args.prompts * args.max_tokens

    engine = GptOssEngine(settings)
    engine.generate(prompts[: args.max_batch], [0] * args.max_batch, 2)  # warm-up

    def run_engine() -> float:
        t = time.perf_counter()
        engine.generate(prompts, [0] * len(prompts), args.max_tokens)
        return time.perf_counter() - t

    handler = GptOssModelHandler(settings, params, share_across_processes=True)
    # one batch of all prompts, as the engine got (the engine batches max_batch at a time inside)
    handler.batching.batch_tokens = args.prompts * args.prompt_len
    handler.batching.max_seq_len = args.prompts * args.prompt_len
    options = PipelineOptions(["--runner=DirectRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1"])
    tag = "refinery-bench-generate"

    def run_pipeline(n: int) -> float:
        t = time.perf_counter()
        with beam.Pipeline(options=options) as pipe:
            _ = (pipe | beam.Create([(str(i), {"tokens": pr}) for i, pr in enumerate(prompts[:n])])
                 | RunInference(KeyedGptOssModelHandler(handler), model_identifier=tag))
        return time.perf_counter() - t

    run_pipeline(args.max_batch)  # warm-up: loads the shared engine
    engine_s, pipe_s = [], []
    for _ in range(args.repeats):  # alternate, keep the best of each: shared machines are noisy
        engine_s.append(run_engine())
        pipe_s.append(run_pipeline(args.prompts))
    engine_tps, pipe_tps = total / min(engine_s), total / min(pipe_s)
    print(f"model: {label}; {args.prompts} prompts x {args.prompt_len} tokens, {args.max_tokens} new tokens each, "
          f"max_batch {args.max_batch}, device {args.device}")
    print(f"engine alone:           {engine_tps:10.1f} tok/s  (runs: {', '.join(f'{x:.2f}s' for x in engine_s)})")
    print(f"RunInference pipeline:  {pipe_tps:10.1f} tok/s  (runs: {', '.join(f'{x:.2f}s' for x in pipe_s)})")
    print(f"ratio pipeline/engine:  {pipe_tps / engine_tps:10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
