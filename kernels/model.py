"""gpt-oss in one file: the forward pass, checkpoint loading and a continuous-batching generator.

Expert weights stay MXFP4 (uint8 blocks + scales) in memory and are decoded inside the MoE
kernel. The heavy pieces (MoE, attention, KV writes, MXFP4 decode) go through
``ops.kernel(name, device)``, so GPU kernels can replace the torch reference versions.

    model = Transformer.from_checkpoint(path, device="cpu", dtype=torch.float32)
    logits = model(torch.tensor(tokens))                # [T, vocab], one sequence, no cache
    hidden = model(torch.tensor(tokens), return_hidden=[6, 12])   # {6: [T, H], 12: [T, H]}

    gen = BatchedGenerator(model, max_seq_len=512, max_batch=8)
    outputs = gen.generate_batch(prompts, max_tokens=64)  # generated tokens, one list per prompt
"""
from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from . import ops
from .checkpoint import checkpoint_files, iter_checkpoint, read_config
from .config import ModelConfig
from .decode_graph import DecodeGraphs, bucket_for
from .kv_cache import BatchView, PagedKVCache
from .step_inputs import StepUploader

# ---- building blocks ---------------------------------------------------------------------


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float32, or float64 for a float64 model."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.kernel("rmsnorm", x.device)(x, self.scale, self.eps)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + delta, self(x + delta))`` in one kernel where the device has one."""
        return ops.kernel("add_rmsnorm", x.device)(x, delta, self.scale, self.eps)


def yarn_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """YaRN-scaled inverse frequencies [head_dim/2] (float64) and the cos/sin concentration."""
    d = config.head_dim
    freq = config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    factor = config.rope_scaling_factor
    if factor <= 1.0:
        return 1.0 / freq, 1.0
    ctx, theta = config.initial_context_length, config.rope_theta
    low = d / 2 * math.log(ctx / (config.rope_ntk_beta * 2 * math.pi)) / math.log(theta)
    high = d / 2 * math.log(ctx / (config.rope_ntk_alpha * 2 * math.pi)) / math.log(theta)
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    inv_freq = ramp / (factor * freq) + (1 - ramp) / freq
    return inv_freq, 0.1 * math.log(factor) + 1.0


class Rotary(nn.Module):
    """Half-split RoPE at absolute positions, with YaRN scaling."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        inv_freq, self.concentration = yarn_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq.to(dtype), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(self.inv_freq.dtype).unsqueeze(-1) * self.inv_freq  # [N, D/2]
        return angles.cos() * self.concentration, angles.sin() * self.concentration

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [N, heads, D]``: ``[x1 cos - x2 sin, x2 cos + x1 sin]``."""
        return ops.rotate_half_split(x, cos, sin)


@dataclass
class StepContext:
    """What attention needs for one packed batch step through the paged cache."""

    cache: PagedKVCache
    views: dict[str, BatchView]


class AttentionBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.window = config.sliding_window if config.is_sliding(layer) else None
        self.sm_scale = 1.0 / math.sqrt(config.head_dim)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        qkv_dim = (self.n_heads + 2 * self.n_kv) * self.head_dim
        self.qkv = nn.Linear(config.hidden_size, qkv_dim, bias=True)
        self.sinks = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        self.out = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=True)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        step: StepContext | None = None,
    ) -> torch.Tensor:
        return x + self.delta(self.norm(x), positions, rope, step)

    def delta(
        self,
        t: torch.Tensor,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        step: StepContext | None = None,
    ) -> torch.Tensor:
        """What the block adds to the residual stream, from its normed input ``t [N, H]``."""
        n, d = t.shape[0], self.head_dim
        qkv = self.qkv(t)
        rope_qkv = ops.kernel("rope_qkv", t.device)
        if step is None:
            k = torch.empty((n, self.n_kv, d), dtype=qkv.dtype, device=qkv.device)
            v = torch.empty_like(k)
            q = rope_qkv(qkv, *rope, self.n_heads, self.n_kv, k, v, None)
            attend = ops.kernel("attention", t.device)
            o = attend(q, k, v, self.sinks, positions, positions, self.window, self.sm_scale)
        else:
            k_pool, v_pool, _ = step.cache.pools(self.layer)
            view = step.views[step.cache.kind(self.layer)]
            q = rope_qkv(qkv, *rope, self.n_heads, self.n_kv, k_pool, v_pool, view.slots)
            paged = ops.kernel("paged_attention", t.device)
            o = paged(
                q, k_pool, v_pool, self.sinks, view.block_table, view.query_start, view.seq_lens,
                self.window, self.sm_scale,
            )
        return self.out(o.reshape(n, self.n_heads * d))


class MLPBlock(nn.Module):
    """Top-k routed MoE; expert weights are MXFP4 buffers, decoded inside the ``moe`` kernel."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
        self.experts_per_token = config.experts_per_token
        self.swiglu_limit, self.swiglu_alpha = config.swiglu_limit, config.swiglu_alpha
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.gate = nn.Linear(h, e, bias=True)
        self.register_buffer("mlp1_blocks", torch.zeros(e, 2 * i, h // 32, 16, dtype=torch.uint8))
        self.register_buffer("mlp1_scales", torch.zeros(e, 2 * i, h // 32, dtype=torch.uint8))
        self.mlp1_bias = nn.Parameter(torch.zeros(e, 2 * i))
        self.register_buffer("mlp2_blocks", torch.zeros(e, h, i // 32, 16, dtype=torch.uint8))
        self.register_buffer("mlp2_scales", torch.zeros(e, h, i // 32, dtype=torch.uint8))
        self.mlp2_bias = nn.Parameter(torch.zeros(e, h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.delta(self.norm(x))

    def delta(self, t: torch.Tensor) -> torch.Tensor:
        """What the block adds to the residual stream, from its normed input ``t [N, H]``."""
        indices, weights = ops.kernel("route", t.device)(self.gate(t), self.experts_per_token)
        moe = ops.kernel("moe", t.device)
        return moe(
            t, indices, weights,
            self.mlp1_blocks, self.mlp1_scales, self.mlp1_bias,
            self.mlp2_blocks, self.mlp2_scales, self.mlp2_bias,
            self.swiglu_limit, self.swiglu_alpha,
        )


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn = AttentionBlock(config, layer)
        self.mlp = MLPBlock(config)

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        step: StepContext | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream before this block is ``x + delta`` (``delta`` None: just ``x``);
        returns ``(x', delta')`` whose sum is the stream after it. Each residual add is done by
        the norm kernel that follows it (``add_rmsnorm``), so one launch does both."""
        if delta is None:
            t = self.attn.norm(x)
        else:
            x, t = self.attn.norm.add_forward(x, delta)
        x, t = self.mlp.norm.add_forward(x, self.attn.delta(t, positions, rope, step))
        return x, self.mlp.delta(t)


# ---- the model ---------------------------------------------------------------------------

# Kept in float32 whatever the compute dtype: small, and used in float32 math.
_FP32_SUFFIXES = ("norm.scale", "attn.sinks")


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.block = nn.ModuleList(TransformerBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.unembedding = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = Rotary(config)

    @property
    def device(self) -> torch.device:
        return self.embedding.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding.weight.dtype

    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
    ) -> "Transformer":
        """Load either checkpoint layout. ``dtype`` is the compute dtype (experts stay MXFP4)."""
        device = torch.device(device)
        _, folder, _ = checkpoint_files(path)
        config = read_config(folder)
        with torch.device("meta"):
            model = cls(config)
        expected = model.state_dict()
        state: dict[str, torch.Tensor] = {}
        for name, tensor in iter_checkpoint(folder, device="cpu"):
            if name not in expected:
                raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
            if tuple(tensor.shape) != tuple(expected[name].shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}")
            if tensor.dtype == torch.uint8:
                target = torch.uint8
            elif name.endswith(_FP32_SUFFIXES):
                target = torch.float32
            else:
                target = dtype
            state[name] = tensor.to(device=device, dtype=target)
        missing = sorted(set(expected) - set(state))
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")
        model.load_state_dict(state, strict=True, assign=True)
        model.rotary = Rotary(config, _acc(dtype)).to(device)
        return model.eval().requires_grad_(False)

    def _run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        step: StepContext | None,
        last_layer: int,
        keep: set[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[int, torch.Tensor]]:
        """(x, delta, hidden): the residual stream after ``last_layer`` blocks is ``x + delta``
        (``delta`` None after no block); ``hidden`` holds the streams asked for in ``keep``."""
        x = self.embedding(tokens)
        delta = None
        rope = self.rotary.cos_sin(positions)
        hidden = {0: x} if 0 in keep else {}
        for i, block in enumerate(self.block[:last_layer]):
            x, delta = block(x, delta, positions, rope, step)
            if i + 1 in keep:
                hidden[i + 1] = x + delta
        return x, delta, hidden

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, return_hidden: Sequence[int] | None = None
    ) -> torch.Tensor | dict[int, torch.Tensor]:
        """Logits ``[T, vocab]`` of one sequence ``tokens [T]`` from position 0, no cache.

        With ``return_hidden``, returns ``{i: [T, hidden]}`` instead: the residual stream after
        ``i`` blocks (0 = embeddings, ``num_hidden_layers`` or -1 = last block, before the
        final norm; keys are the non-negative indices); blocks past the deepest one asked for
        are not run, logits never computed.
        """
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        if tokens.dim() != 1:
            raise ValueError("tokens must be one sequence, shape [T]")
        positions = torch.arange(tokens.shape[0], device=self.device)
        if return_hidden is not None:
            n = self.config.num_hidden_layers
            keep = {int(i) + (n + 1 if int(i) < 0 else 0) for i in return_hidden}  # -1 -> n
            if any(not 0 <= i <= n for i in keep):
                raise ValueError(f"hidden state indices run from 0 to {n} (or -{n + 1} to -1)")
            _, _, hidden = self._run(tokens, positions, None, max(keep, default=0), keep)
            return hidden
        x, delta, _ = self._run(tokens, positions, None, self.config.num_hidden_layers, set())
        return self.unembedding(self._final_norm(x, delta))

    def hidden_states(self, tokens: torch.Tensor, layers: Sequence[int]) -> dict[int, torch.Tensor]:
        """Shorthand for ``model(tokens, return_hidden=layers)``."""
        return self(tokens, return_hidden=layers)

    @torch.inference_mode()
    def forward_step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        step: StepContext,
        logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        """A packed multi-sequence step through the paged cache; logits of ``logit_rows`` only."""
        x, delta, _ = self._run(tokens, positions, step, self.config.num_hidden_layers, set())
        return self.unembedding(self._final_norm(x[logit_rows], delta[logit_rows] if delta is not None else None))

    def _final_norm(self, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        return self.norm(x) if delta is None else self.norm.add_forward(x, delta)[1]


# ---- continuous batching -----------------------------------------------------------------


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
        checkpoint_or_model: "str | os.PathLike | Transformer",
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
        if cuda_graph and self.device.type == "cuda" and not ops.triton_on_cuda():
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
            [self.cache.row[s.seq_id] for s in seqs] + [self.cache.scratch_row] * pad,
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
