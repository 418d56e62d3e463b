"""tiny-checkpoint: write a tiny random gpt-oss checkpoint, to try generate and hydra on a laptop.

``refinery tiny-checkpoint DIR`` writes a 3-layer gpt-oss with random weights (MXFP4 experts,
the full o200k_harmony vocabulary) in OpenAI's original layout: what ``--checkpoint`` takes.
Its text is noise; every code path of the engine and the pipelines runs, in seconds, on a CPU.
"""
from __future__ import annotations

import argparse
import sys

from refinery.beam_pipelines.checks import missing_extra


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", metavar="DIR", help="where to write the checkpoint (created)")
    parser.add_argument("--layers", type=int, default=3, help="transformer blocks (default: 3)")
    parser.add_argument("--layout", choices=["original", "hf"], default="original",
                        help="OpenAI's original layout (default) or Hugging Face's")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the weights (default: 0)")


def run(args: argparse.Namespace, beam_args: list[str]) -> int:
    """Write the checkpoint (its flags are :mod:`refinery.kernels.tiny`'s, passed on); exit 2 without torch."""
    if (missing := missing_extra("torch", "inference")) is not None:
        print(f"refinery tiny-checkpoint: needs torch; {missing}", file=sys.stderr)
        return 2
    from refinery.kernels.tiny import main  # lazy: it imports torch, checked just above

    return main([args.folder, "--layers", str(args.layers), "--layout", args.layout, "--seed", str(args.seed)])
