"""The gpt-oss ModelHandler: seeded sampling, engine equivalence, and a real RunInference pipeline."""
from __future__ import annotations

import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

torch = pytest.importorskip("torch", reason="the inference extra (torch) is not installed")
if TYPE_CHECKING:
    from torch import Generator

import apache_beam as beam  # noqa: E402
from apache_beam.ml.inference.base import PredictionResult, RunInference  # noqa: E402
from apache_beam.options.pipeline_options import PipelineOptions  # noqa: E402
from apache_beam.testing.util import assert_that  # noqa: E402
from engine_fixtures import write_harmony_checkpoint  # noqa: E402

from refinery.kernels.batching import BatchedGenerator  # noqa: E402
from refinery.transforms.inference.handler import (  # noqa: E402
    EngineSettings,
    GenerationParams,
    GptOssEngine,
    doc_seed,
    example_length,
    prompt_tokens,
    sample_rows,
)

DIRECT = ["--runner=DirectRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1"]


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> EngineSettings:
    ckpt = write_harmony_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", num_hidden_layers=2)
    return EngineSettings(str(ckpt), dtype="float32", max_batch=3, max_seq_len=128, block_size=8, prefill_chunk=32)


@pytest.fixture(scope="module")
def engine(settings: EngineSettings) -> GptOssEngine:
    return GptOssEngine(settings)


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 200000, (int(k),), generator=g).tolist() for k in (5, 17, 9, 30, 2)[:n]]


def test_import_does_not_import_torch() -> None:
    code = ("import sys, refinery.transforms.inference, refinery.transforms.inference.handler, "
            "refinery.transforms.inference.stages; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_doc_seed_and_examples() -> None:
    assert doc_seed(0, "a") == doc_seed(0, "a") != doc_seed(1, "a") != doc_seed(0, "b")
    # fixed values: a document's sampling seed must not change between releases (reruns of a
    # unit after an upgrade would otherwise sample different tokens)
    assert doc_seed(0, "a") == 8348787342930090591 and doc_seed(7, "d3") == 2679320810214725082
    assert prompt_tokens([1, 2]) == [1, 2] and prompt_tokens({"tokens": (3,)}) == [3]
    conv = prompt_tokens({"messages": [{"role": "user", "content": "hi"}]})
    assert conv[:1] == [200006] and len(conv) > 10  # <|start|> ... <|start|>assistant
    assert example_length(("k", {"tokens": [1, 2, 3]})) == 3 and example_length([1, 2]) == 2
    with pytest.raises(ValueError, match="neither"):
        prompt_tokens({"text": "x"})


def test_sample_rows_uses_each_rows_own_generator() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    def gens() -> list[Generator]:
        return [torch.Generator().manual_seed(s) for s in (1, 2, 3)]

    together = sample_rows(logits, 1.0, gens())
    alone = [sample_rows(logits[i:i + 1], 1.0, [gens()[i]])[0] for i in range(3)]
    assert together == alone
    assert sample_rows(logits, 0.0, gens()) == logits.argmax(-1).tolist()
    draws = {sample_rows(logits[:1], 1.0, [torch.Generator().manual_seed(s)])[0] for s in range(40)}
    assert len(draws) > 5  # it really samples


def test_engine_greedy_equals_batched_generator(engine: GptOssEngine, settings: EngineSettings) -> None:
    prompts = _prompts(5)
    ours = engine.generate(prompts, [0] * 5, max_tokens=6, temperature=0.0)
    ref = BatchedGenerator(engine.model, max_seq_len=128, max_batch=3, block_size=8, prefill_chunk=32)
    theirs = ref.generate_batch(prompts, max_tokens=6)
    assert [r["tokens"] for r in ours] == theirs
    assert all(r["finish_reason"] == "length" for r in ours)
    assert engine.generator.idle


def test_engine_sampling_is_per_document(engine: GptOssEngine) -> None:
    prompts, seeds = _prompts(4), [11, 22, 33, 44]
    together = engine.generate(prompts, seeds, max_tokens=8, temperature=0.9)
    alone = [engine.generate([p], [s], max_tokens=8, temperature=0.9)[0] for p, s in zip(prompts, seeds)]
    assert together == alone
    other = engine.generate(prompts, [s + 1 for s in seeds], max_tokens=8, temperature=0.9)
    assert other != together


def test_engine_stop_and_context_limits(engine: GptOssEngine) -> None:
    prompt = _prompts(1)[0]
    first = engine.generate([prompt], [0], max_tokens=3)[0]["tokens"]
    stopped = engine.generate([prompt], [0], max_tokens=8, stop_tokens=[first[1]])[0]
    assert stopped == {"tokens": first[:2], "finish_reason": "stop"}
    near_limit = engine.generate([[7] * 125], [0], max_tokens=50)[0]
    assert near_limit["finish_reason"] == "context" and len(near_limit["tokens"]) == 3
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.generate([[7] * 128], [0], max_tokens=2)
    assert engine.generator.idle


def test_handler_in_keyed_runinference_pipeline(engine: GptOssEngine, settings: EngineSettings) -> None:
    from refinery.transforms.inference.model_handler import GptOssModelHandler, KeyedGptOssModelHandler

    params = GenerationParams(max_tokens=5, temperature=0.7, seed=3)
    docs = {f"doc{i}": p for i, p in enumerate(_prompts(5))}
    examples = [(k, {"tokens": p, "seed": doc_seed(3, k)}) for k, p in docs.items()]
    expected = {k: r["tokens"] for k, r in zip(docs, engine.generate(
        list(docs.values()), [doc_seed(3, k) for k in docs], 5, 0.7, params.stop_tokens))}
    handler = GptOssModelHandler(settings, params, share_across_processes=True)
    assert handler.share_model_across_processes() and handler.model_copies() == 1
    assert handler.batch_elements_kwargs()["min_batch_size"] == settings.max_seq_len

    def check(outputs: list[tuple[str, PredictionResult]]) -> None:
        got: dict[str, list[int]] = {}
        for key, pred in outputs:
            assert isinstance(pred, PredictionResult)
            inf = pred.inference
            assert isinstance(inf, dict)
            assert set(inf) == {"tokens", "text", "final", "finish_reason", "prompt_tokens", "generated_tokens"}
            assert inf["prompt_tokens"] == len(docs[key]) and inf["generated_tokens"] == len(inf["tokens"])
            got[key] = inf["tokens"]
        assert got == expected

    p = beam.Pipeline(options=PipelineOptions(DIRECT))
    out = p | beam.Create(examples) | RunInference(KeyedGptOssModelHandler(handler),
                                                  model_identifier="refinery-test-handler")
    assert_that(out, check)
    result = p.run()
    result.wait_until_finish()
    counters = {c.key.metric.name: c.committed for c in result.metrics().query()["counters"]
                if c.key.metric.namespace == "refinery_inference"}
    assert counters["prompts"] == 5
    assert counters["generated_tokens"] == sum(len(t) for t in expected.values())
