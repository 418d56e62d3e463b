"""GptOssModelHandler: the gpt-oss engine as a Beam RunInference ModelHandler.

    handler = GptOssModelHandler(EngineSettings("ckpt/"), GenerationParams(max_tokens=256))
    keyed = KeyedModelHandler(handler)
    (doc_id, {"tokens": [...], "seed": 7}) | RunInference(keyed) -> (doc_id, PredictionResult)

Importing this module imports Beam's ML package, and with it torch (when installed); the
engine, its settings and the sampling are in :mod:`.handler`, which imports neither.
"""
from __future__ import annotations

import time
from typing import Any, Iterable, Mapping, Sequence

from apache_beam.metrics import Metrics
from apache_beam.ml.inference.base import ModelHandler, PredictionResult

from refinery.transforms.inference.handler import (
    METRICS_NAMESPACE,
    BatchingOptions,
    EngineSettings,
    GenerationParams,
    GptOssEngine,
    example_length,
    run_generation,
    secure_model_sharing,
    sharing_secret,
)

DEFAULT_PARAMS = GenerationParams()  # frozen: one shared default is safe


class GptOssModelHandler(ModelHandler[Any, PredictionResult, GptOssEngine]):
    """RunInference handler for the gpt-oss engine.

    Input: examples (token list, ``{"tokens"}`` or ``{"messages"}``, optional ``"seed"``).
    Output: ``PredictionResult(example, inference)``, inference a :class:`Generation`
    ``{tokens, text, final, finish_reason, prompt_tokens, generated_tokens}``.

    ``share_across_processes`` (default True): the engine is loaded once per machine (one
    per accelerator) and served to every worker process; ``model_copies`` engines are
    loaded when given. The serving is private to the run (:func:`secure_model_sharing`: the
    driver's random key, carried by the pickled handler; a 0700 folder). Batches are formed
    by prompt length (see :class:`BatchingOptions`); the engine's continuous batching runs
    inside each batch.
    """

    def __init__(self, settings: EngineSettings, params: GenerationParams = DEFAULT_PARAMS,
                 *, share_across_processes: bool = True, model_copies: int | None = None,
                 batching: BatchingOptions | None = None):
        super().__init__(model_copies=model_copies)
        self.settings = settings
        self.params = params
        self._share_across_processes = bool(share_across_processes or model_copies)
        self._model_copies = model_copies
        self._sharing_secret = sharing_secret()  # pickled with the handler: known to this run's workers only
        self.batching = batching or BatchingOptions(settings.max_seq_len, max(1, settings.max_batch) * 512)
        self._counters = None

    def load_model(self) -> GptOssEngine:
        return GptOssEngine(self.settings)

    def share_model_across_processes(self) -> bool:
        """Called by RunInference in each worker before it shares the model: secure it first."""
        if self._share_across_processes:
            secure_model_sharing(self._sharing_secret)
        return self._share_across_processes

    def batch_elements_kwargs(self) -> Mapping[str, Any]:
        return self.batching.kwargs()

    def get_num_bytes(self, batch: Sequence[Any]) -> int:
        return sum(4 * example_length(e) for e in batch)

    def get_metrics_namespace(self) -> str:
        return METRICS_NAMESPACE

    def _metrics(self):
        if self._counters is None:
            ns = METRICS_NAMESPACE
            self._counters = {
                "prompts": Metrics.counter(ns, "prompts"),
                "prompt_tokens": Metrics.counter(ns, "prompt_tokens"),
                "generated_tokens": Metrics.counter(ns, "generated_tokens"),
                "tokens_per_second": Metrics.distribution(ns, "generated_tokens_per_second"),
                "batch_size": Metrics.distribution(ns, "batch_size"),
            }
        return self._counters

    def infer(self, batch: Sequence[Any], model: GptOssEngine) -> list[dict]:
        """The inference of each example of ``batch`` (subclasses grade instead of generate)."""
        return run_generation(model, batch, self.params)

    def run_inference(self, batch: Sequence[Any], model: GptOssEngine, inference_args=None
                      ) -> Iterable[PredictionResult]:
        t0 = time.perf_counter()
        results = self.infer(batch, model)
        seconds = max(time.perf_counter() - t0, 1e-9)
        m = self._metrics()
        generated = sum(int(r.get("generated_tokens", 0)) for r in results)
        m["prompts"].inc(len(batch))
        m["prompt_tokens"].inc(sum(int(r.get("prompt_tokens", 0)) for r in results))
        m["generated_tokens"].inc(generated)
        m["tokens_per_second"].update(int(generated / seconds))
        m["batch_size"].update(len(batch))
        return [PredictionResult(e, r, self.settings.checkpoint) for e, r in zip(batch, results)]

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_counters"] = None
        return state
