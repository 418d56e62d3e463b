"""Fixed-shape decode steps, captured as CUDA graphs (opt-in: ``BatchedGenerator(cuda_graph=True)``).

A decode step whose batch is padded up to a bucket size has the same shapes, the same kernel
configurations and the same input addresses every time (inputs sit at fixed offsets of the
:class:`~refinery.kernels.step_inputs.StepUploader` device buffer; block tables are gathered
into the step from the cache's device-resident table inside the step), so it can be captured
once per bucket and replayed: one graph launch instead of a few hundred kernel launches.

Padding rows decode token 0 at position 0 through the cache's scratch row and scratch block,
so they never touch a real sequence's keys and values; their logits are dropped.

On CUDA the first step of each bucket runs twice eagerly on a side stream (compiling and
warming the kernels; both runs write the same keys and values the replay will), is captured,
then replayed. Elsewhere (CPU, tests) the same fixed-shape step just runs eagerly, which is
how its padding and layout are checked without a GPU. Capture has NOT been run on a GPU yet.
"""
from __future__ import annotations

from typing import Callable

import torch


def bucket_sizes(max_batch: int) -> list[int]:
    """Decode batch sizes that get their own graph: powers of two below ``max_batch``, and it."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


def bucket_for(batch: int, max_batch: int) -> int:
    """The smallest bucket holding ``batch`` sequences."""
    for size in bucket_sizes(max_batch):
        if size >= batch:
            return size
    raise ValueError(f"batch {batch} exceeds max_batch {max_batch}")


class DecodeGraphs:
    """One captured step per bucket (CUDA), or the same step run eagerly (any other device)."""

    def __init__(self, device: torch.device) -> None:
        self.capture = device.type == "cuda"
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, int, int]] = {}
        self._pool: torch.cuda._POOL_HANDLE | None = None
        self.replays = 0
        self.captures = 0

    def reset(self) -> None:
        """Forget every graph (their input addresses are gone)."""
        self._graphs.clear()

    def run(self, bucket: int, step: Callable[[], torch.Tensor], input_ptr: int, generation: int) -> torch.Tensor:
        """The logits of ``step()`` for this bucket; ``input_ptr``/``generation`` identify the
        input buffer the step reads (a capture is only valid for the buffer it saw)."""
        if not self.capture:
            return step()
        entry = self._graphs.get(bucket)
        if entry is not None and entry[2:] == (input_ptr, generation):
            entry[0].replay()
            self.replays += 1
            return entry[1]
        new_stream: Callable[[], torch.cuda.Stream] = torch.cuda.Stream  # torch's, unannotated
        side = new_stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = step()
        self._graphs[bucket] = (graph, logits, input_ptr, generation)
        self.captures += 1
        graph.replay()
        self.replays += 1
        return logits
