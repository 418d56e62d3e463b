"""GptOssModelHandler: the gpt-oss engine as a Beam RunInference ModelHandler.

    handler = GptOssModelHandler(EngineSettings("ckpt/"), GenerationParams(max_tokens=256))
    keyed = KeyedGptOssModelHandler(handler)
    (doc_id, {"tokens": [...], "seed": 7}) | RunInference(keyed) -> (doc_id, PredictionResult)

Importing this module imports Beam's ML package, and with it torch (when installed); the
engine, its settings and the sampling are in :mod:`.handler`, which imports neither.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Generic, Iterable, Mapping, Sequence, TypedDict, TypeVar

from apache_beam.metrics.metric import Metrics
from apache_beam.metrics.metricbase import Counter, Distribution
from apache_beam.ml.inference.base import KeyedModelHandler, ModelHandler, PredictionResult

from refinery.transforms.inference.handler import (
    METRICS_NAMESPACE,
    BatchingOptions,
    EngineSettings,
    GenerationParams,
    GptOssEngine,
    example_length,
    run_generation,
    secure_model_sharing,
    sharing_is_secured,
    sharing_secret,
)

DEFAULT_PARAMS = GenerationParams()  # frozen: one shared default is safe


class HandlerMetrics(TypedDict):
    """The handler's Beam metrics (namespace :data:`METRICS_NAMESPACE`)."""

    prompts: Counter
    prompt_tokens: Counter
    generated_tokens: Counter
    tokens_per_second: Distribution
    batch_size: Distribution


Model = TypeVar("Model")
"""What a handler's RunInference holds: the engine, or a model over it (HYDRA's grader)."""


class EngineModelHandler(ModelHandler[Any, PredictionResult, Model], Generic[Model]):
    """RunInference handler for a model over the gpt-oss engine: the :class:`GptOssModelHandler`
    without its model (:meth:`build_model`) and what it does with a batch (:meth:`infer`),
    which subclasses give.

    ``share_across_processes`` (default True): the engine is loaded once per machine (one
    per accelerator) and served to every worker process; ``model_copies`` engines are
    loaded when given. The serving is private to the run (:func:`secure_model_sharing`: the
    driver's random key, carried by the pickled handler; a 0700 folder): RunInference's
    worker setup calls :meth:`set_environment_vars` before it starts or reaches the
    shared-model server, and that secures it, once per process; :meth:`load_model` refuses
    to load a shared engine in a process where it was not secured. Keyed, it goes through
    :class:`KeyedGptOssModelHandler` (Beam's ``KeyedModelHandler`` does not pass that
    setup on). Batches are formed by prompt length (see :class:`BatchingOptions`); the
    engine's continuous batching runs inside each batch.
    """

    def build_model(self) -> Model:
        """The model RunInference holds (subclasses load theirs)."""
        raise NotImplementedError

    def infer(self, batch: Sequence[Any], model: Model) -> Sequence[Mapping[str, Any]]:
        """The inference of each example of ``batch``."""
        raise NotImplementedError

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
        self._counters: HandlerMetrics | None = None

    def set_environment_vars(self) -> None:
        """Beam's per-worker setup (``_RunInferenceDoFn.setup`` calls it first, before it starts
        or connects to a shared-model server): makes the sharing private to this run, once per
        process (:func:`secure_model_sharing`; the model server's key and folder are fixed
        when it starts, before :meth:`load_model` runs in it)."""
        beams_setup: Callable[[], None] = super().set_environment_vars  # Beam's (untyped): the env vars it was given
        beams_setup()
        if self._share_across_processes:
            secure_model_sharing(self._sharing_secret)

    def load_model(self) -> Model:
        self.check_sharing()
        return self.build_model()

    def check_sharing(self) -> None:
        """Raise unless this process's shared-model server is this run's (when the model is shared):
        a shared engine is never served behind Beam's fixed key."""
        if self._share_across_processes and not sharing_is_secured(self._sharing_secret):
            raise RuntimeError("the shared model server of this process is not private to the run: RunInference "
                               "must call the handler's set_environment_vars() first (wrap it in "
                               "KeyedGptOssModelHandler, not Beam's KeyedModelHandler)")

    def share_model_across_processes(self) -> bool:
        return self._share_across_processes

    def batch_elements_kwargs(self) -> Mapping[str, Any]:
        return self.batching.kwargs()

    def get_num_bytes(self, batch: Sequence[Any]) -> int:
        return sum(4 * example_length(e) for e in batch)

    def get_metrics_namespace(self) -> str:
        return METRICS_NAMESPACE

    def _metrics(self) -> HandlerMetrics:
        if self._counters is None:
            ns = METRICS_NAMESPACE
            self._counters = HandlerMetrics(
                prompts=Metrics.counter(ns, "prompts"),
                prompt_tokens=Metrics.counter(ns, "prompt_tokens"),
                generated_tokens=Metrics.counter(ns, "generated_tokens"),
                tokens_per_second=Metrics.distribution(ns, "generated_tokens_per_second"),
                batch_size=Metrics.distribution(ns, "batch_size"),
            )
        return self._counters

    def run_inference(self, batch: Sequence[Any], model: Model, inference_args: dict[str, Any] | None = None
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

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_counters"] = None
        return state


class GptOssModelHandler(EngineModelHandler[GptOssEngine]):
    """RunInference handler for the gpt-oss engine (see :class:`EngineModelHandler`).

    Input: examples (token list, ``{"tokens"}`` or ``{"messages"}``, optional ``"seed"``).
    Output: ``PredictionResult(example, inference)``, inference a :class:`Generation`
    ``{tokens, text, final, finish_reason, prompt_tokens, generated_tokens}``."""

    def build_model(self) -> GptOssEngine:
        return GptOssEngine(self.settings)

    def infer(self, batch: Sequence[Any], model: GptOssEngine) -> Sequence[Mapping[str, Any]]:
        return run_generation(model, batch, self.params)


class KeyedGptOssModelHandler(KeyedModelHandler[Any, Any, PredictionResult, Any]):
    """Beam's ``KeyedModelHandler`` over one :class:`GptOssModelHandler` that also passes the
    worker setup (:meth:`GptOssModelHandler.set_environment_vars`) on to it, which Beam's does
    not. Input: ``(key, example)``; output: ``(key, PredictionResult)``. ``on_batch`` (picklable),
    when given, is called with each batch's results as it is done."""

    def __init__(self, unkeyed: EngineModelHandler[Any],
                 on_batch: Callable[[Sequence[tuple[Any, PredictionResult]]], None] | None = None) -> None:
        super().__init__(unkeyed)
        self.unkeyed = unkeyed
        self.on_batch = on_batch  # told each batch's results as they come (progress while a long unit runs)

    def set_environment_vars(self) -> None:
        beams_setup: Callable[[], None] = super().set_environment_vars  # Beam's (untyped): the env vars it was given
        beams_setup()
        self.unkeyed.set_environment_vars()

    def run_inference(self, batch: Sequence[tuple[Any, Any]], model: Any,
                      inference_args: dict[str, Any] | None = None) -> Iterable[tuple[Any, PredictionResult]]:
        results = super().run_inference(batch, model, inference_args)
        if self.on_batch is not None:
            results = list(results)
            self.on_batch(results)
        return results
