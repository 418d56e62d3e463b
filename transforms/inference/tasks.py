"""What an inference pipeline does with each document (:class:`Task`: its example, its
handler, its output row, its merge), and generate's task (:class:`GenerateTask`)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

from refinery.transforms.inference.documents import Doc, JsonObject
from refinery.transforms.inference.handler import (
    BatchingOptions,
    EngineSettings,
    Generation,
    GenerationParams,
    cached_engine,
    doc_seed,
    run_generation,
)
from refinery.transforms.inference.prompts import fit_prompt, load_template, render_template, template_user
from refinery.transforms.io import storage
from refinery.transforms.resumable import UnitContext, short_hash
from refinery.transforms.resumable.progress import rate

if TYPE_CHECKING:  # importing model_handler imports Beam's ML package and torch: only a worker's RunInference needs it
    from refinery.transforms.inference.model_handler import EngineModelHandler, GptOssModelHandler


@dataclass
class HandlerOptions:
    """How RunInference holds the engine: shared across processes, copies, batch token budget."""

    share_across_processes: bool = True
    model_copies: int | None = None
    batch_tokens: int | None = None


class Task:
    """What an inference pipeline does with each document. Subclasses implement the hooks."""

    name = "task"

    def config(self) -> JsonObject:
        raise NotImplementedError

    def identity(self) -> JsonObject:
        return {}

    def example(self, doc: Doc) -> tuple[JsonObject, JsonObject]:
        """(example for the handler, metadata kept for the output row)."""
        raise NotImplementedError

    def handler(self) -> EngineModelHandler[Any]:
        """The RunInference handler: a :class:`~refinery.transforms.inference.model_handler.EngineModelHandler`."""
        raise NotImplementedError

    def model_identifier(self) -> str:
        return f"refinery-{self.name}-{short_hash(self.config(), 12)}-{os.getpid()}"

    def infer_local(self, examples: list[JsonObject]) -> Sequence[Mapping[str, Any]]:
        """The handler's inference dicts without Beam (same engine code)."""
        raise NotImplementedError

    def record(self, doc_id: str, meta: JsonObject, inference: Mapping[str, Any]) -> JsonObject:
        raise NotImplementedError

    def merge(self, rows: Iterator[JsonObject], ctx: UnitContext) -> Mapping[str, Any]:
        raise NotImplementedError

    def progress(self, stats: Mapping[str, Any], seconds: float) -> str:
        docs, toks = stats.get("documents", 0), stats.get("generated_tokens", 0)
        rates = ", ".join(filter(None, [rate(docs, seconds, "docs"), rate(toks, seconds, "tok")]))
        return f"{docs:,.0f} docs, {toks:,.0f} tokens" + (f", {rates}" if rates else "")


def checkpoint_fingerprint(checkpoint: str) -> list[JsonObject]:
    files = storage.expand_inputs([checkpoint], suffixes=(".safetensors", ".json"))
    return [{"path": f.relpath, "size": f.size, "version": f.version} for f in files]


class GenerateTask(Task):
    """Template-filled harmony prompts -> generated text (``generations.jsonl``)."""

    name = "generate"
    OUTPUT = "generations.jsonl"

    def __init__(self, engine: EngineSettings, params: GenerationParams, template: str = "rephrase",
                 handler_options: HandlerOptions | None = None) -> None:
        self.engine = engine
        self.params = params
        self.template_name = template
        self.template = load_template(template)
        self.options = handler_options or HandlerOptions()
        if params.max_tokens >= engine.max_seq_len:
            raise ValueError(f"--max-tokens {params.max_tokens} leaves no room for a prompt under "
                             f"--max-seq-len {engine.max_seq_len}")

    def config(self) -> JsonObject:
        return {"task": self.name, "template": self.template, "params": self.params.to_dict(),
                "dtype": self.engine.dtype, "max_seq_len": self.engine.max_seq_len}

    def identity(self) -> JsonObject:
        return {"checkpoint": checkpoint_fingerprint(self.engine.checkpoint)}

    def example(self, doc: Doc) -> tuple[JsonObject, JsonObject]:
        budget = self.engine.max_seq_len - self.params.max_tokens
        prompt, text, cut = fit_prompt(lambda t: render_template(self.template, t), doc, budget)
        example = {"tokens": prompt, "seed": doc_seed(self.params.seed, doc.id)}
        return example, {"prompt": template_user(self.template).replace("{text}", text), "truncated_tokens": cut}

    def handler(self) -> GptOssModelHandler:
        from refinery.transforms.inference.model_handler import GptOssModelHandler  # lazy: Beam's ML package, torch

        batching = BatchingOptions(self.engine.max_seq_len, self.options.batch_tokens or self.engine.max_batch * 512)
        return GptOssModelHandler(self.engine, self.params, share_across_processes=self.options.share_across_processes,
                                  model_copies=self.options.model_copies, batching=batching)

    def infer_local(self, examples: list[JsonObject]) -> list[Generation]:
        return run_generation(cached_engine(self.engine), examples, self.params)

    def record(self, doc_id: str, meta: JsonObject, inference: Mapping[str, Any]) -> JsonObject:
        return {"id": doc_id, "prompt": meta["prompt"], "text": inference["text"], "final": inference["final"],
                "finish_reason": inference["finish_reason"], "prompt_tokens": inference["prompt_tokens"],
                "generated_tokens": inference["generated_tokens"], "truncated_tokens": meta["truncated_tokens"]}

    def merge(self, rows: Iterator[JsonObject], ctx: UnitContext) -> dict[str, float]:
        stats: dict[str, float] = {"documents": 0, "errors": 0, "generated_tokens": 0, "prompt_tokens": 0}
        with ctx.open_write(ctx.output_path(self.OUTPUT)) as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False).encode() + b"\n")
                stats["documents"] += 1
                stats["errors"] += "error" in row
                stats["generated_tokens"] += row.get("generated_tokens", 0)
                stats["prompt_tokens"] += row.get("prompt_tokens", 0)
        return stats
