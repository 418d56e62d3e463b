"""HYDRA grading: probe triage, judge for the rest, calibrated aggregate, decision.

Per document (its tokens from the prep shard, cut to ``max_ctx``), one backbone pass gives
the probe layer and the judge layer states. Probe scores -> aggregate with the calibrated
weights; below ``tau_drop`` the document is dropped on the probe alone. Otherwise the judge
scores it, and the judge's aggregate decides: ``drop`` (< tau_drop), ``keep`` (>= tau_keep)
or ``band``. Scores are clamped to [0, 4].

Runs through RunInference (``HydraGradeHandler``: the engine plus both heads is the model,
loaded once per machine) on the infer -> merge stages of
:mod:`refinery.transforms.inference.stages`. Outputs: ``quality_scores.jsonl`` (``{doc_id,
scores: {dim: s}, aggregated, probe_aggregated, judged, decision}``, input order) and
``summary.json`` (counts per decision, keep rate, thresholds).
"""
from __future__ import annotations

import json
import threading
from typing import Any, Iterator, Mapping, Sequence, TypedDict

import numpy as np
import torch

from refinery.transforms.hydra.calibrate import Thresholds, decide, load_calibration
from refinery.transforms.hydra.heads import judge_preprocess, load_head, probe_features
from refinery.transforms.hydra.oracle import DIMENSIONS
from refinery.transforms.inference.documents import Doc, JsonObject
from refinery.transforms.inference.handler import (
    BatchingOptions,
    EngineSettings,
    GptOssEngine,
    cached_engine,
    validate_layers,
)
from refinery.transforms.inference.model_handler import EngineModelHandler
from refinery.transforms.inference.tasks import HandlerOptions, Task, checkpoint_fingerprint
from refinery.transforms.io import storage
from refinery.transforms.resumable import UnitContext
from refinery.transforms.resumable.progress import rate


class HydraGrader:
    """Backbone + probe + judge + calibration. Methods take/return plain Python values."""

    def __init__(self, settings: EngineSettings, heads_dir: str, calibration: Thresholds, max_ctx: int = 4096,
                 engine: GptOssEngine | None = None) -> None:
        self.engine = engine or GptOssEngine(settings)
        self.probe, self.probe_meta = load_head(storage.join(heads_dir, "hydra_probe.pt"))
        self.judge, self.judge_meta = load_head(storage.join(heads_dir, "hydra_judge.pt"))
        depth = self.engine.info()["num_hidden_layers"]
        validate_layers([self.probe_meta["layer"], self.judge_meta["layer"]], depth)
        hidden = self.engine.info()["hidden_size"]
        for meta in (self.probe_meta, self.judge_meta):
            if meta["hidden_size"] != hidden:
                raise ValueError(f"{meta['kind']} head was trained on hidden size {meta['hidden_size']}, "
                                 f"the backbone has {hidden}")
        self.weights = np.asarray([calibration["weights"][d] for d in DIMENSIONS], dtype=np.float64)
        self.tau_drop, self.tau_keep = float(calibration["tau_drop"]), float(calibration["tau_keep"])
        self.max_ctx = max_ctx
        self._lock = threading.Lock()

    def grade(self, prompts: Sequence[Sequence[int]]) -> list[Grade]:
        pl, jl = self.probe_meta["layer"], self.judge_meta["layer"]
        out: list[Grade] = []
        with self._lock, torch.no_grad():
            for tokens in prompts:
                hidden = self.engine.hidden_states([tokens], sorted({pl, jl}), self.max_ctx)[0]
                probe = self.probe(probe_features(torch.from_numpy(hidden[pl])).unsqueeze(0))[0].clamp(0, 4)
                probe_agg = float(probe.double().numpy() @ self.weights)
                probe_scores = [float(x) for x in probe]
                prompt_tokens = min(len(tokens), self.max_ctx)
                if probe_agg < self.tau_drop:
                    scores, agg, judged, decision = probe_scores, probe_agg, False, "drop"
                else:
                    states = judge_preprocess(torch.from_numpy(hidden[jl])).unsqueeze(0)
                    judge = self.judge(states)[0].clamp(0, 4)
                    agg = float(judge.double().numpy() @ self.weights)
                    scores, judged = [float(x) for x in judge], True
                    decision = decide(agg, self.tau_drop, self.tau_keep)
                out.append(Grade(probe_scores=probe_scores, probe_aggregated=probe_agg, prompt_tokens=prompt_tokens,
                                 generated_tokens=0, scores=scores, aggregated=agg, judged=judged, decision=decision))
        return out


class Grade(TypedDict):
    """What HYDRA made of one document (a ``PredictionResult``'s ``inference``)."""

    scores: list[float]  # the five 0-4 scores: the judge's, or the probe's for a document it dropped
    aggregated: float
    probe_scores: list[float]
    probe_aggregated: float
    judged: bool
    decision: str  # keep | band | drop
    prompt_tokens: int
    generated_tokens: int


class HydraGradeHandler(EngineModelHandler[HydraGrader]):
    """RunInference handler for HYDRA grading. Input: ``{"tokens": [...]}`` examples.
    Output: ``PredictionResult(example, inference)``, inference a :class:`Grade`."""

    def __init__(self, settings: EngineSettings, heads_dir: str, calibration: Thresholds, max_ctx: int, *,
                 share_across_processes: bool = True, model_copies: int | None = None,
                 batching: BatchingOptions | None = None) -> None:
        super().__init__(settings, share_across_processes=share_across_processes, model_copies=model_copies,
                         batching=batching)
        self.heads_dir, self.calibration, self.max_ctx = heads_dir, calibration, max_ctx

    # RunInference hands the model build_model made back to infer: here a HydraGrader (over the engine)
    def build_model(self) -> HydraGrader:
        return HydraGrader(self.settings, self.heads_dir, self.calibration, self.max_ctx)

    def infer(self, batch: Sequence[Any], model: HydraGrader) -> list[Grade]:
        return model.grade([list(e["tokens"]) for e in batch])


class GradeTask(Task):
    name = "grade"

    def __init__(self, engine: EngineSettings, heads_dir: str, calibration_path: str, max_ctx: int = 4096,
                 handler_options: HandlerOptions | None = None) -> None:
        self.engine = engine
        self.heads_dir = heads_dir.rstrip("/")
        self.calibration = load_calibration(calibration_path)
        self.max_ctx = max_ctx
        self.options = handler_options or HandlerOptions()
        for kind in ("probe", "judge"):
            if not storage.exists(storage.join(self.heads_dir, f"hydra_{kind}.pt")):
                raise FileNotFoundError(f"{self.heads_dir}: no hydra_{kind}.pt (run `refinery hydra train {kind}`)")

    def config(self) -> JsonObject:
        cal = self.calibration
        return {"task": self.name, "calibration": {"weights": cal["weights"], "tau_drop": cal["tau_drop"],
                                                   "tau_keep": cal["tau_keep"]},
                "dtype": self.engine.dtype, "max_ctx": self.max_ctx}

    def identity(self) -> JsonObject:
        heads = [{"file": f"hydra_{k}.pt", "sha256": storage.sha256_file(storage.join(self.heads_dir, f"hydra_{k}.pt"))}
                 for k in ("probe", "judge")]
        return {"checkpoint": checkpoint_fingerprint(self.engine.checkpoint), "heads": heads}

    def example(self, doc: Doc) -> tuple[JsonObject, JsonObject]:
        tokens = doc.get_tokens()
        if not tokens:
            raise ValueError("empty document")
        return {"tokens": tokens[: self.max_ctx]}, {}

    def handler(self) -> HydraGradeHandler:
        return HydraGradeHandler(self.engine, self.heads_dir, self.calibration, self.max_ctx,
                                 share_across_processes=self.options.share_across_processes,
                                 model_copies=self.options.model_copies,
                                 batching=BatchingOptions(self.max_ctx, self.options.batch_tokens or 8 * self.max_ctx))

    def infer_local(self, examples: list[JsonObject]) -> list[Grade]:
        key = (self.engine, self.heads_dir, json.dumps(self.calibration, sort_keys=True), self.max_ctx)
        grader = _GRADERS.get(key)
        if grader is None:
            grader = _GRADERS[key] = HydraGrader(self.engine, self.heads_dir, self.calibration, self.max_ctx,
                                                 engine=cached_engine(self.engine))
        return grader.grade([e["tokens"] for e in examples])

    def record(self, doc_id: str, meta: JsonObject, inference: Mapping[str, Any]) -> JsonObject:
        return {"doc_id": doc_id, "scores": dict(zip(DIMENSIONS, inference["scores"])),
                "aggregated": inference["aggregated"], "probe_aggregated": inference["probe_aggregated"],
                "judged": inference["judged"], "decision": inference["decision"],
                "prompt_tokens": inference["prompt_tokens"]}

    def merge(self, rows: Iterator[JsonObject], ctx: UnitContext) -> dict[str, float]:
        stats: dict[str, float] = {"documents": 0, "drop": 0, "band": 0, "keep": 0, "errors": 0, "judged": 0}
        with ctx.open_write(ctx.output_path("quality_scores.jsonl")) as f:
            for row in rows:
                stats["documents"] += 1
                if "decision" in row:
                    stats[row["decision"]] += 1
                    stats["judged"] += bool(row["judged"])
                else:
                    stats["errors"] += 1
                    row = {"doc_id": row.get("id"), "error": row.get("error")}
                f.write(json.dumps(row, ensure_ascii=False).encode() + b"\n")
        graded = stats["documents"] - stats["errors"]
        stats["keep_rate"] = stats["keep"] / graded if graded else 0.0
        stats.update(tau_drop=self.calibration["tau_drop"], tau_keep=self.calibration["tau_keep"])
        ctx.write_bytes(ctx.output_path("summary.json"), json.dumps(stats, indent=1).encode())
        return stats

    def progress(self, stats: Mapping[str, Any], seconds: float) -> str:
        docs = stats.get("documents", 0)
        per_s = rate(docs, seconds, "docs")
        return f"{docs:,.0f} docs" + (f", {per_s}" if per_s else "")


_GRADERS: dict[tuple[EngineSettings, str, str, int], HydraGrader] = {}
