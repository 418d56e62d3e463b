"""Train a HYDRA head: oracle labels + frozen-backbone features -> ``hydra_probe.pt`` / ``hydra_judge.pt``.

Features come from the engine's ``hidden_states`` (no logits computed): the residual stream
after block ``layer`` of each labelled document's tokens (read by doc id from the prep
shards, cut to ``max_ctx`` tokens). Layers are validated against the backbone's depth.
Writes the head and ``train_{kind}.json`` (config, number of documents, first/last loss).
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from refinery.transforms.formats.docids import read_doc_tokens
from refinery.transforms.hydra.calibrate import read_labels
from refinery.transforms.hydra.heads import (
    JudgeHead,
    ProbeHead,
    TrainConfig,
    judge_preprocess,
    probe_features,
    save_head,
    train_config_dict,
    train_judge,
    train_probe,
)
from refinery.transforms.inference.handler import EngineSettings, GptOssEngine, cached_engine, validate_layers
from refinery.transforms.io import storage


@dataclass
class HeadJob:
    kind: str  # probe | judge
    labels: list[str]
    data_root: str
    out_dir: str
    layer: int
    max_ctx: int = 4096
    mid_dim: int = 256
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        if self.kind not in ("probe", "judge"):
            raise ValueError(f"unknown head {self.kind!r} (probe or judge)")


def backbone_features(engine: GptOssEngine, data_root: str, doc_ids: list[str], layer: int, max_ctx: int,
                      pooled: bool, progress: bool = True) -> list[torch.Tensor]:
    """Per document: pooled [H] (probe) or preprocessed [T, H] (judge) features of ``layer``."""
    validate_layers([layer], engine.info()["num_hidden_layers"])
    out = []
    t0 = time.time()
    for i, doc_id in enumerate(doc_ids):
        tokens = read_doc_tokens(data_root, doc_id)
        if not tokens:
            raise ValueError(f"doc {doc_id}: no tokens")
        states = torch.from_numpy(engine.hidden_states([tokens], [layer], max_ctx)[0][layer])
        out.append(probe_features(states) if pooled else judge_preprocess(states))
        if progress and (i + 1) % 100 == 0:
            print(f"  features: {i + 1}/{len(doc_ids)} documents ({time.time() - t0:.0f}s)", file=sys.stderr)
    return out


def run_head_job(job: HeadJob, engine_settings: EngineSettings, progress: bool = True) -> dict[str, Any]:
    engine = cached_engine(engine_settings)
    validate_layers([job.layer], engine.info()["num_hidden_layers"])
    doc_ids, scores = read_labels(job.labels)
    if not doc_ids:
        raise ValueError(f"no labels in {', '.join(job.labels)}")
    feats = backbone_features(engine, job.data_root, doc_ids, job.layer, job.max_ctx, job.kind == "probe", progress)
    targets = torch.from_numpy(scores).float()
    t0 = time.time()
    head: ProbeHead | JudgeHead
    if job.kind == "probe":
        head, losses = train_probe(torch.stack(feats), targets, job.train)
    else:
        head, losses = train_judge(feats, targets, job.train, mid_dim=job.mid_dim)
    summary: dict[str, Any] = {"kind": job.kind, "layer": job.layer, "documents": len(doc_ids), "steps": len(losses),
               "first_loss": losses[0], "last_loss": losses[-1], "train_seconds": time.time() - t0,
               "config": train_config_dict(job.train), "mid_dim": job.mid_dim if job.kind == "judge" else None,
               "checkpoint": engine_settings.checkpoint, "max_ctx": job.max_ctx}
    save_head(storage.join(job.out_dir, f"hydra_{job.kind}.pt"), head, job.kind, job.layer, summary)
    storage.atomic_write_bytes(storage.join(job.out_dir, f"train_{job.kind}.json"),
                          json.dumps({**summary, "losses": losses}, indent=1).encode())
    return summary
