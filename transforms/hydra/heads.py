"""HYDRA heads over a frozen gpt-oss backbone: the probe and the MTP-judge, and their training.

- Probe: mean-pooled hidden state of layer ``probe_layer`` (18 for 20b) -> one linear layer
  -> 5 scores. Loss: MSE. Role: fast triage.
- Judge: layer ``judge_layer`` (24 for 20b) states -> ``nan_to_num`` -> per-token LayerNorm
  (no affine) in fp32 -> linear projection to ``mid_dim`` -> a learned quality token
  prepended (in ``mid_dim`` space) -> one small Transformer encoder layer -> the quality
  token's output -> shared linear head -> 5 scores. Training: SmoothL1 (beta 0.5) on
  predictions and targets clamped to [0, 4] (clamp only in the loss); depth-1 teacher
  forcing: a second pass whose quality token also carries an embedding of the teacher
  scores re-predicts them with the same head, its loss added. Inference: one pass, no teacher.
- Both: AdamW (weight decay 0.01), linear warmup (``warmup_steps``, at most 20% of the
  run), gradient-norm clipping at 1.0.

Checkpoint files (``torch.save``): ``hydra_probe.pt`` / ``hydra_judge.pt`` =
``{kind, layer, hidden_size, mid_dim?, state_dict, dimensions, train: {...}}``.
"""
from __future__ import annotations

import io
import math
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from refinery.transforms.hydra.oracle import DIMENSIONS
from refinery.transforms.io import storage

NUM_SCORES = 5


def judge_preprocess(states: torch.Tensor) -> torch.Tensor:
    """[T, H] (or [B, T, H]) backbone states -> finite, per-token LayerNorm'd fp32."""
    x = torch.nan_to_num(states.float(), nan=0.0, posinf=0.0, neginf=0.0)
    return torch.nn.functional.layer_norm(x, x.shape[-1:])


def probe_features(states: torch.Tensor) -> torch.Tensor:
    """[T, H] states -> [H] mean-pooled fp32 (non-finite values zeroed)."""
    return torch.nan_to_num(states.float(), nan=0.0, posinf=0.0, neginf=0.0).mean(dim=0)


class ProbeHead(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.hidden_size = hidden_size
        self.linear = nn.Linear(hidden_size, NUM_SCORES)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        scores: torch.Tensor = self.linear(pooled.float())
        return scores


class JudgeHead(nn.Module):
    def __init__(self, hidden_size: int, mid_dim: int = 256, heads: int = 4):
        super().__init__()
        if mid_dim % heads:
            raise ValueError(f"mid_dim {mid_dim} must be a multiple of heads {heads}")
        self.hidden_size, self.mid_dim, self.heads = hidden_size, mid_dim, heads
        self.proj = nn.Linear(hidden_size, mid_dim)
        self.quality = nn.Parameter(torch.randn(mid_dim) * 0.02)
        self.teacher = nn.Linear(NUM_SCORES, mid_dim)
        self.encoder = nn.TransformerEncoderLayer(mid_dim, heads, dim_feedforward=2 * mid_dim, dropout=0.0,
                                                  batch_first=True, norm_first=True)
        self.head = nn.Linear(mid_dim, NUM_SCORES)

    def forward(self, states: torch.Tensor, mask: torch.Tensor | None = None,
                teacher: torch.Tensor | None = None) -> torch.Tensor:
        """``states [B, T, H]`` (preprocessed), ``mask [B, T]`` True at real tokens,
        ``teacher [B, 5]`` scores for the teacher-forced pass -> scores [B, 5]."""
        b, t, _ = states.shape
        x = self.proj(states)
        q = self.quality.expand(b, 1, self.mid_dim)
        if teacher is not None:
            q = q + self.teacher(teacher.float() / 4.0).unsqueeze(1)
        x = torch.cat([q, x], dim=1)
        if mask is None:
            mask = torch.ones(b, t, dtype=torch.bool, device=states.device)
        pad = ~torch.cat([torch.ones(b, 1, dtype=torch.bool, device=states.device), mask], dim=1)
        y = self.encoder(x, src_key_padding_mask=pad)
        scores: torch.Tensor = self.head(y[:, 0])
        return scores


def judge_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.smooth_l1_loss(pred.clamp(0, 4), target.clamp(0, 4), beta=0.5)


def pad_states(seqs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """[T_i, H] tensors -> ([B, T, H] zero-padded, mask [B, T])."""
    t = max(s.shape[0] for s in seqs)
    h = seqs[0].shape[1]
    out = torch.zeros(len(seqs), t, h)
    mask = torch.zeros(len(seqs), t, dtype=torch.bool)
    for i, s in enumerate(seqs):
        out[i, : s.shape[0]] = s
        mask[i, : s.shape[0]] = True
    return out, mask


@dataclass
class TrainConfig:
    epochs: int = 1
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 500
    clip: float = 1.0
    seed: int = 0


def _optimizer(model: nn.Module, cfg: TrainConfig, total_steps: int
               ) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    warm = max(1, min(cfg.warmup_steps, total_steps // 5))  # short runs: warm up over 20% of the steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warm))
    return opt, sched


def _batches(n: int, batch_size: int, epochs: int, seed: int) -> Iterator[list[int]]:
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(n, generator=g).tolist()
        for i in range(0, n, batch_size):
            yield order[i:i + batch_size]


def _step(head: nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
          loss: torch.Tensor, clip: float) -> float:
    """One optimizer step: backward, grad-norm clip, AdamW and warmup schedule; returns the loss."""
    opt.zero_grad()
    torch.autograd.backward(loss)  # loss.backward(), typed
    nn.utils.clip_grad_norm_(head.parameters(), clip)
    opt.step()
    sched.step()
    return float(loss.detach())


def train_probe(features: torch.Tensor, targets: torch.Tensor, cfg: TrainConfig) -> tuple[ProbeHead, list[float]]:
    """features [N, H] (pooled), targets [N, 5] -> (trained head, loss per step)."""
    torch.manual_seed(cfg.seed)
    head = ProbeHead(features.shape[1])
    steps = cfg.epochs * math.ceil(len(features) / cfg.batch_size)
    opt, sched = _optimizer(head, cfg, steps)
    losses = []
    for idx in _batches(len(features), cfg.batch_size, cfg.epochs, cfg.seed):
        loss = nn.functional.mse_loss(head(features[idx]), targets[idx].float())
        losses.append(_step(head, opt, sched, loss, cfg.clip))
    return head.eval(), losses


def train_judge(states: Sequence[torch.Tensor], targets: torch.Tensor, cfg: TrainConfig, mid_dim: int = 256,
                heads: int = 4) -> tuple[JudgeHead, list[float]]:
    """states: per document [T_i, H] (preprocessed), targets [N, 5] -> (trained head, loss per step)."""
    torch.manual_seed(cfg.seed)
    head = JudgeHead(states[0].shape[1], mid_dim, heads)
    steps = cfg.epochs * math.ceil(len(states) / cfg.batch_size)
    opt, sched = _optimizer(head, cfg, steps)
    losses = []
    head.train()
    for idx in _batches(len(states), cfg.batch_size, cfg.epochs, cfg.seed):
        x, mask = pad_states([states[i] for i in idx])
        y = targets[idx].float()
        loss = judge_loss(head(x, mask), y) + judge_loss(head(x, mask, teacher=y), y)
        losses.append(_step(head, opt, sched, loss, cfg.clip))
    return head.eval(), losses


def save_head(path: str, head: nn.Module, kind: str, layer: int, train: dict[str, Any]) -> None:
    blob = {"kind": kind, "layer": int(layer), "hidden_size": head.hidden_size,
            "mid_dim": getattr(head, "mid_dim", None), "heads": getattr(head, "heads", None),
            "state_dict": head.state_dict(), "dimensions": list(DIMENSIONS), "train": train}
    buf = io.BytesIO()
    torch.save(blob, buf)
    storage.atomic_write_bytes(path, buf.getvalue())


def load_head(path: str) -> tuple[nn.Module, dict[str, Any]]:
    try:
        blob = torch.load(io.BytesIO(storage.read_bytes(path)), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no HYDRA head (run `refinery hydra train`)") from None
    head: ProbeHead | JudgeHead
    if blob.get("kind") == "probe":
        head = ProbeHead(blob["hidden_size"])
    elif blob.get("kind") == "judge":
        head = JudgeHead(blob["hidden_size"], blob["mid_dim"], blob["heads"])
    else:
        raise ValueError(f"{path}: unknown head kind {blob.get('kind')!r}")
    head.load_state_dict(blob["state_dict"])
    return head.eval(), blob


def train_config_dict(cfg: TrainConfig) -> dict[str, Any]:
    return asdict(cfg)
