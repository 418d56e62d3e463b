"""Paged KV cache: fixed-size blocks, one block table per sequence and layer kind.

Layers come in two kinds, ``full`` and ``sliding``; each kind has its own pool of blocks
``[layers_of_kind, num_blocks, block_size, kv_heads, head_dim]`` and a block id means the same
block in every layer of that kind. A sequence's block table maps logical block ``j``
(positions ``j*block_size .. (j+1)*block_size - 1``) to a pool block, or ``-1`` when it is
not held. Sliding layers hand a block back as soon as no future query can see it, so each
sequence holds at most ``ceil((window + chunk - 1) / block_size) + 1`` of them; a per-sequence
watermark (the first logical block still held) makes each step's freeing cost only the blocks
it frees.

The block tables also live on the device, one row per admitted sequence, in
``device_table [kinds, max_batch (+1), max_blocks]`` (long, -1 where not held). The host keeps
the lists as the truth and queues every change as a (flat index, value) pair
(:meth:`take_updates`); the generator ships them with the step's other integers in one copy
and applies them with one scatter (:meth:`apply_updates`), so tables are never rebuilt.

With ``scratch=True`` each pool has one more block that no sequence ever holds, and the table
one more row pointing at it: padding rows of a fixed-size (CUDA graph) decode batch read and
write there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import ModelConfig

FULL = "full"
SLIDING = "sliding"


@dataclass
class BatchView:
    """Where one packed batch reads and writes, for one layer kind (see ``ops.paged_attention``)."""

    block_table: torch.Tensor  # [B, max_blocks] long, -1 where not held
    slots: torch.Tensor  # [N] long: flat pool slot of each new token
    query_start: torch.Tensor  # [B + 1] long
    seq_lens: torch.Tensor  # [B] long: keys in cache after this step


class PagedKVCache:
    def __init__(
        self,
        config: ModelConfig,
        max_batch: int,
        max_seq_len: int,
        max_chunk: int,
        block_size: int = 16,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        scratch: bool = False,
    ) -> None:
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        self.window = config.sliding_window
        self.layer_slot: list[tuple[str, int]] = []
        counts = {FULL: 0, SLIDING: 0}
        for layer in range(config.num_hidden_layers):
            kind = SLIDING if config.is_sliding(layer) else FULL
            self.layer_slot.append((kind, counts[kind]))
            counts[kind] += 1
        full_blocks = math.ceil(max_seq_len / block_size)
        self.max_blocks = full_blocks  # table width: logical blocks of the longest sequence
        self.blocks_per_seq = {FULL: full_blocks, SLIDING: full_blocks}
        if self.window:
            live = math.ceil((self.window + max(max_chunk, 1) - 1) / block_size) + 1
            self.blocks_per_seq[SLIDING] = min(full_blocks, live)
        shape = (config.num_key_value_heads, config.head_dim)
        self.k: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.free: dict[str, list[int]] = {}
        self.scratch_block: dict[str, int] = {}
        for kind, n_layers in counts.items():
            if n_layers == 0:
                continue
            num_blocks = max_batch * self.blocks_per_seq[kind]
            pool = (n_layers, num_blocks + int(scratch), block_size, *shape)
            self.k[kind] = torch.zeros(pool, device=device, dtype=dtype)
            self.v[kind] = torch.zeros(pool, device=device, dtype=dtype)
            self.free[kind] = list(range(num_blocks - 1, -1, -1))
            if scratch:
                self.scratch_block[kind] = num_blocks
        self.tables: dict[int, dict[str, list[int]]] = {}
        # device-resident tables: one row per admitted sequence (+ the scratch row)
        self.max_batch = max_batch
        self.scratch_row = max_batch if scratch else None
        self.device_table = torch.full(
            (len(self.k), max_batch + int(scratch), full_blocks), -1, dtype=torch.long, device=device
        )
        for i, kind in enumerate(self.kinds):
            if scratch:
                self.device_table[i, max_batch, :] = self.scratch_block[kind]
        self.row: dict[int, int] = {}
        self.free_rows = list(range(max_batch - 1, -1, -1))
        self.low: dict[int, int] = {}  # sliding watermark: logical blocks below it are freed
        # queued device_table changes, flat index -> value: the last write to an entry wins (a
        # freed row reused in the same step), so one scatter never sees an index twice
        self._updates: dict[int, int] = {}

    @property
    def kinds(self) -> list[str]:
        return list(self.k)

    def pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """(k_pool, v_pool, window) of ``layer``."""
        kind, index = self.layer_slot[layer]
        return self.k[kind][index], self.v[kind][index], self.window if kind == SLIDING else None

    def kind(self, layer: int) -> str:
        return self.layer_slot[layer][0]

    def add_sequence(self, seq_id: int) -> None:
        if not self.free_rows:
            raise RuntimeError(f"more than {self.max_batch} sequences in the cache")
        self.tables[seq_id] = {kind: [] for kind in self.kinds}
        self.row[seq_id] = self.free_rows.pop()
        self.low[seq_id] = 0

    def free_sequence(self, seq_id: int) -> None:
        row = self.row.pop(seq_id)
        self.low.pop(seq_id)
        for kind, table in self.tables.pop(seq_id).items():
            for j, b in enumerate(table):
                if b >= 0:
                    self.free[kind].append(b)
                    self._set(kind, row, j, -1)
        self.free_rows.append(row)

    def _set(self, kind: str, row: int, j: int, block: int) -> None:
        """Queue ``device_table[kind, row, j] = block``."""
        k = self.kinds.index(kind)
        self._updates[(k * self.device_table.shape[1] + row) * self.max_blocks + j] = block

    def take_updates(self) -> tuple[list[int], list[int]]:
        """The queued table changes since the last call, as (flat indices, values)."""
        updates, self._updates = self._updates, {}
        return list(updates), list(updates.values())

    def apply_updates(self, index: torch.Tensor, value: torch.Tensor) -> None:
        """Write queued changes (on the device, from :meth:`take_updates`) into ``device_table``."""
        if index.numel():
            self.device_table.view(-1).index_copy_(0, index, value)

    def blocks_held(self, seq_id: int) -> dict[str, int]:
        return {kind: sum(b >= 0 for b in table) for kind, table in self.tables[seq_id].items()}

    def reserve(self, seq_id: int, start: int, count: int) -> None:
        """Make room for positions ``start .. start+count-1``; drop sliding blocks that no query
        from ``start`` on can see (a key at ``k`` is seen by ``q`` iff ``q - window < k``)."""
        end = start + count
        if end > self.max_seq_len:
            raise ValueError(f"position {end - 1} is past max_seq_len {self.max_seq_len}")
        row = self.row[seq_id]
        for kind, table in self.tables[seq_id].items():
            if kind == SLIDING:
                first_visible = max(0, start - self.window + 1)
                stop = min(first_visible // self.block_size, len(table))
                for j in range(self.low[seq_id], stop):  # only blocks not freed before
                    self.free[kind].append(table[j])
                    table[j] = -1
                    self._set(kind, row, j, -1)
                self.low[seq_id] = max(self.low[seq_id], stop)
            while len(table) * self.block_size < end:
                if not self.free[kind]:
                    raise RuntimeError(f"KV cache out of {kind} blocks")
                table.append(self.free[kind].pop())
                self._set(kind, row, len(table) - 1, table[-1])

    def slots(self, seq_id: int, kind: str, start: int, count: int) -> list[int]:
        """Flat pool slots of positions ``start .. start+count-1`` (after :meth:`reserve`)."""
        table, bs = self.tables[seq_id][kind], self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, start + count)]

    def batch_views(
        self, seq_ids: list[int], starts: list[int], counts: list[int], device: torch.device | str
    ) -> dict[str, BatchView]:
        """Block tables and write slots of a packed batch (after :meth:`reserve`)."""
        query_start = torch.tensor([0] + list(_cumsum(counts)), dtype=torch.long)
        seq_lens = torch.tensor([s + c for s, c in zip(starts, counts)], dtype=torch.long)
        positions = torch.cat([torch.arange(s, s + c) for s, c in zip(starts, counts)])
        rows = torch.repeat_interleave(torch.arange(len(seq_ids)), torch.tensor(counts))
        # shared by every kind (and layer): one copy each to the device
        query_start, seq_lens = query_start.to(device), seq_lens.to(device)
        views = {}
        for kind in self.kinds:
            tables = [self.tables[s][kind] for s in seq_ids]
            width = max(len(t) for t in tables)
            table = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.long)
            slots = table[rows, positions // self.block_size] * self.block_size + positions % self.block_size
            views[kind] = BatchView(
                block_table=table.to(device),
                slots=slots.to(device),
                query_start=query_start,
                seq_lens=seq_lens,
            )
        return views


def _cumsum(values: list[int]) -> list[int]:
    total, out = 0, []
    for v in values:
        total += v
        out.append(total)
    return out
