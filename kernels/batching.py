"""Continuous batching over a paged KV cache: the scheduler that drives :class:`~.model.Transformer`.

    gen = BatchedGenerator(model, max_seq_len=512, max_batch=8)
    outputs = gen.generate_batch(prompts, max_tokens=64)  # generated tokens, one list per prompt
"""
from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import torch

from .decode_graph import DecodeGraphs, bucket_for
from .kv_cache import BatchView, PagedKVCache
from .model import StepContext, Transformer
from .step_inputs import StepUploader


@dataclass
class _Sequence:
    seq_id: int
    tokens: list[int]
    max_tokens: int
    cached: int = 0  # tokens whose keys/values are in the cache
    generated: int = 0
    order: int = 0
    awaiting: bool = False  # logits handed out, waiting for update()


class BatchedGenerator:
    """Continuous batching over a paged KV cache.

    ``add`` queues a prompt; ``step`` runs the model on every active sequence (one token for
    decoding ones, chunks of at most ``prefill_chunk`` prompt tokens in all for the others)
    until at least one sequence has consumed all of its input, and returns the next-token
    logits of those; ``update`` feeds each chosen token back. Sequences beyond ``max_batch``
    wait and join as others finish.

    Each step is device-resident: its integers go to the device in one copy
    (:class:`~refinery.kernels.step_inputs.StepUploader`), block tables stay on the device and
    change by the step's queued updates only, and sliding-window blocks are freed by a
    watermark. With ``cuda_graph=True`` decode-only steps run at a fixed batch bucket from
    static buffers and, on CUDA, are captured and replayed as CUDA graphs (see
    ``decode_graph``; off by default: not yet run on a GPU). Logits are the same either way.
    """

    def __init__(
        self,
        checkpoint_or_model: "str | os.PathLike[str] | Transformer",
        max_seq_len: int = 4096,
        max_batch: int = 16,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
        block_size: int = 16,
        prefill_chunk: int = 512,
        cuda_graph: bool = False,
    ) -> None:
        if isinstance(checkpoint_or_model, Transformer):
            self.model = checkpoint_or_model
            if device is not None and torch.device(device) != self.model.device:
                raise ValueError(f"the model is on {self.model.device}, not {device}")
        else:
            self.model = Transformer.from_checkpoint(checkpoint_or_model, device=device or "cpu", dtype=dtype)
        self.config = self.model.config
        self.device = self.model.device
        self.max_seq_len, self.max_batch = max_seq_len, max_batch
        self.prefill_chunk = max(1, prefill_chunk)
        if cuda_graph and self.device.type == "cuda" and self.model.kernels.name != "triton":
            raise ValueError("cuda_graph needs the Triton kernels on CUDA (the torch ones sync with the host)")
        self.cuda_graph = cuda_graph
        self.cache = PagedKVCache(
            self.config, max_batch, max_seq_len, self.prefill_chunk, block_size, self.device, self.model.dtype,
            scratch=cuda_graph,
        )
        self.uploader = StepUploader(self.device, self._input_capacity())
        self.graphs = DecodeGraphs(self.device)
        self.active: dict[int, _Sequence] = {}
        self.waiting: deque[_Sequence] = deque()
        self._next_id = 0

    @property
    def idle(self) -> bool:
        """No sequence is running or waiting."""
        return not self.active and not self.waiting

    def add(self, tokens: Sequence[int], max_tokens: int) -> int:
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("empty prompt")
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if len(tokens) > self.max_seq_len:
            raise ValueError(f"prompt of {len(tokens)} tokens exceeds max_seq_len {self.max_seq_len}")
        seq = _Sequence(self._next_id, tokens, max_tokens, order=self._next_id)
        self._next_id += 1
        self.waiting.append(seq)
        self._admit()
        return seq.seq_id

    def _admit(self) -> None:
        while self.waiting and len(self.active) < self.max_batch:
            seq = self.waiting.popleft()
            self.active[seq.seq_id] = seq
            self.cache.add_sequence(seq.seq_id)

    def _schedule(self) -> list[tuple[_Sequence, int]]:
        """(sequence, tokens to run) for this step: every decode, then prompt chunks."""
        plan, budget = [], self.prefill_chunk
        for seq in sorted(self.active.values(), key=lambda s: s.order):
            pending = len(seq.tokens) - seq.cached
            if pending <= 0 or seq.awaiting:
                continue
            if pending == 1:
                plan.append((seq, 1))
            elif budget > 0:
                n = min(pending, budget)
                budget -= n
                plan.append((seq, n))
        return plan

    def _input_capacity(self) -> int:
        """Integers one step can ship: tokens, positions and slots per kind (decodes plus a
        prefill chunk), per-sequence fields, and the worst case of block-table changes."""
        kinds = len(self.cache.kinds)
        tokens = self.prefill_chunk + self.max_batch
        per_seq = 4 * (self.max_batch + 1)
        blocks_touched = 2 * (tokens // self.cache.block_size + self.max_batch)
        changes = kinds * (self.max_batch * self.cache.max_blocks + blocks_touched)
        return (2 + kinds) * tokens + per_seq + 2 * changes

    def step(self) -> tuple[torch.Tensor, list[int]] | None:
        """Next-token logits ``[B, vocab]`` and their sequence ids; None when nothing can run."""
        self._admit()
        while True:
            plan = self._schedule()
            if not plan:
                return None
            seqs = [s for s, _ in plan]
            starts = [s.cached for s in seqs]
            counts = [n for _, n in plan]
            for seq, start, n in zip(seqs, starts, counts):
                self.cache.reserve(seq.seq_id, start, n)
            ready = [b for b, (s, st, n) in enumerate(zip(seqs, starts, counts)) if st + n == len(s.tokens)]
            if self.cuda_graph and len(ready) == len(seqs) and all(n == 1 for n in counts):
                logits = self._decode_fixed(seqs, starts)
            else:
                logits = self._forward(seqs, starts, counts, ready)
            for seq, n in plan:
                seq.cached += n
            if ready:
                for b in ready:
                    seqs[b].awaiting = True
                return logits, [seqs[b].seq_id for b in ready]

    def _upload(
        self,
        tokens: list[int],
        positions: list[int],
        query_start: list[int],
        seq_lens: list[int],
        rows: list[int],
        logit_rows: list[int],
        slots: dict[str, list[int]],
    ) -> list[torch.Tensor]:
        """Ship a step's integers and the queued table changes in one copy and apply the changes;
        returns the device views [tokens, positions, query_start, seq_lens, rows, logit_rows,
        slots of each kind...]."""
        upd_index, upd_value = self.cache.take_updates()
        parts = [tokens, positions, query_start, seq_lens, rows, logit_rows, *(slots[k] for k in self.cache.kinds),
                 upd_index, upd_value]
        dev = self.uploader.upload(parts)
        self.cache.apply_updates(dev[-2], dev[-1])
        return dev[:-2]

    def _run_uploaded(self, dev: list[torch.Tensor]) -> torch.Tensor:
        """The forward step on uploaded inputs; gathers the batch's block-table rows first (so a
        captured step gathers them again on every replay)."""
        tokens, positions, query_start, seq_lens, rows, logit_rows, *slots = dev
        views = {
            kind: BatchView(
                block_table=self.cache.device_table[i].index_select(0, rows),
                slots=slots[i],
                query_start=query_start,
                seq_lens=seq_lens,
            )
            for i, kind in enumerate(self.cache.kinds)
        }
        return self.model.forward_step(tokens, positions, StepContext(self.cache, views), logit_rows)

    def _forward(self, seqs: list[_Sequence], starts: list[int], counts: list[int], ready: list[int]) -> torch.Tensor:
        """A step of any shape: the packed sequences' new tokens, logits of the ``ready`` ones."""
        tokens = [t for s, st, n in zip(seqs, starts, counts) for t in s.tokens[st : st + n]]
        positions = [p for st, n in zip(starts, counts) for p in range(st, st + n)]
        query_start = [0]
        for n in counts:
            query_start.append(query_start[-1] + n)
        slots = {
            kind: [x for s, st, n in zip(seqs, starts, counts) for x in self.cache.slots(s.seq_id, kind, st, n)]
            for kind in self.cache.kinds
        }
        dev = self._upload(
            tokens, positions, query_start, [st + n for st, n in zip(starts, counts)],
            [self.cache.row[s.seq_id] for s in seqs], [query_start[b + 1] - 1 for b in ready], slots,
        )
        return self._run_uploaded(dev)

    def _decode_fixed(self, seqs: list[_Sequence], starts: list[int]) -> torch.Tensor:
        """A decode-only step padded to its batch bucket, from fixed buffers (a CUDA graph on CUDA)."""
        batch = len(seqs)
        bucket = bucket_for(batch, self.max_batch)
        pad = bucket - batch
        scratch_row = self.cache.scratch_row
        if pad and scratch_row is None:
            raise RuntimeError("a padded decode step needs the KV cache's scratch row (a cache built with scratch)")
        bs = self.cache.block_size
        slots = {
            kind: [self.cache.slots(s.seq_id, kind, st, 1)[0] for s, st in zip(seqs, starts)]
            + [self.cache.scratch_block[kind] * bs] * pad
            for kind in self.cache.kinds
        }
        dev = self._upload(
            [s.tokens[st] for s, st in zip(seqs, starts)] + [0] * pad,
            list(starts) + [0] * pad,
            list(range(bucket + 1)),
            [st + 1 for st in starts] + [1] * pad,
            [self.cache.row[s.seq_id] for s in seqs] + ([scratch_row] * pad if scratch_row is not None else []),
            list(range(bucket)),
            slots,
        )
        logits = self.graphs.run(bucket, lambda: self._run_uploaded(dev), self.uploader.device_buffer.data_ptr(),
                                 self.uploader.generation)
        return logits[:batch].clone()  # the graph's output buffer is rewritten by the next replay

    def update(self, seq_id: int, token: int, finished: bool = False) -> None:
        """Append the chosen ``token``; the sequence ends when ``finished``, at ``max_tokens``
        generated tokens, or at ``max_seq_len``."""
        seq = self.active[seq_id]
        seq.tokens.append(int(token))
        seq.generated += 1
        seq.awaiting = False
        if finished or seq.generated >= seq.max_tokens or len(seq.tokens) >= self.max_seq_len:
            self.cache.free_sequence(seq_id)
            del self.active[seq_id]
            self._admit()

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int,
        temperature: float = 0.0,
        stop_tokens: Sequence[int] | None = None,
        seed: int | None = None,
    ) -> list[list[int]]:
        """Generated tokens (a stop token, when hit, is kept as the last one), in prompt order."""
        if not self.idle:
            raise RuntimeError("generate_batch needs an idle generator")
        stops = set(int(t) for t in (stop_tokens or ()))
        rng = torch.Generator(device="cpu")
        rng.manual_seed(0 if seed is None else seed)
        ids = [self.add(p, max_tokens) for p in prompts]
        out: dict[int, list[int]] = {i: [] for i in ids}
        while not self.idle:
            result = self.step()
            if result is None:
                break
            logits, seq_ids = result
            chosen = sample(logits, temperature, rng)
            for seq_id, token in zip(seq_ids, chosen):
                out[seq_id].append(token)
                self.update(seq_id, token, finished=token in stops or len(out[seq_id]) >= max_tokens)
        return [out[i] for i in ids]


def sample(logits: torch.Tensor, temperature: float, rng: torch.Generator | None = None) -> list[int]:
    """Greedy for ``temperature <= 0``, else a draw from ``softmax(logits / temperature)``."""
    if temperature <= 0:
        return logits.argmax(dim=-1).tolist()
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=rng).squeeze(-1).tolist()
