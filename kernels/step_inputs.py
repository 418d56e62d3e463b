"""One decode/prefill step's host integers, moved to the device in a single copy.

Everything a step needs from the host (tokens, positions, query starts, sequence lengths,
table rows, logit rows, KV write slots, block-table changes) is a list of integers. The
:class:`StepUploader` packs them into one int64 host buffer (pinned on CUDA) and issues one
non-blocking host-to-device copy into one device buffer, then hands out views of it. Both
buffers are allocated once and reused, so their addresses stay fixed: a captured CUDA graph
can read its inputs from the same place on every replay.

The host buffers are double-buffered: before a buffer is refilled, the copy that last read it
is waited for (an event, long since complete in practice), so a non-blocking copy never reads
half-rewritten memory.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch


class StepUploader:
    def __init__(self, device: torch.device | str, capacity: int) -> None:
        self.device = torch.device(device)
        self.capacity = 0
        self.copies = 0  # host-to-device copies issued (tests count them)
        self.generation = 0  # bumped when the buffers are reallocated (device addresses change)
        self._allocate(max(1, capacity))

    def _allocate(self, capacity: int) -> None:
        pin = self.device.type == "cuda"
        self.capacity = capacity
        self._host = [torch.empty(capacity, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._host_np = [h.numpy() for h in self._host]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self.device_buffer = torch.empty(capacity, dtype=torch.long, device=self.device)
        self.generation += 1

    def upload(self, parts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Copy ``parts`` (lists of ints) to the device in one transfer; returns a 1-d int64
        device view per part, laid out back to back from offset 0."""
        sizes = [len(p) for p in parts]
        total = sum(sizes)
        if total > self.capacity:
            self._allocate(max(total, 2 * self.capacity))
        turn = self._turn
        self._turn ^= 1
        event = self._events[turn]
        if event is not None:
            event.synchronize()
        host = self._host_np[turn]
        offset = 0
        for part, size in zip(parts, sizes):
            host[offset : offset + size] = np.asarray(part, dtype=np.int64) if size else 0
            offset += size
        self.device_buffer[:total].copy_(self._host[turn][:total], non_blocking=True)
        self.copies += 1
        if self.device.type == "cuda":
            new_event: Callable[[], torch.cuda.Event] = torch.cuda.Event  # torch's, unannotated
            recorded = new_event()
            self._events[turn] = recorded
            recorded.record()
        views, offset = [], 0
        for size in sizes:
            views.append(self.device_buffer[offset : offset + size])
            offset += size
        return views
