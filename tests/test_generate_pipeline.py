"""``refinery generate``: engine-equal outputs, per-document reproducibility, skip and resume."""
from __future__ import annotations

import argparse
import collections
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the inference extra (torch) is not installed")

from engine_fixtures import write_harmony_checkpoint  # noqa: E402
from helpers import write_jsonl  # noqa: E402

from refinery.beam_pipelines import generate  # noqa: E402
from refinery.transforms.inference import stages as gs  # noqa: E402
from refinery.transforms.inference.documents import Doc  # noqa: E402
from refinery.transforms.inference.handler import GenerationParams, GptOssEngine, decode, doc_seed  # noqa: E402
from refinery.transforms.inference.prompts import fit_prompt, load_template, render_template  # noqa: E402
from refinery.transforms.inference.tasks import GenerateTask  # noqa: E402
from refinery.transforms.resumable import bind_stages, run_stages  # noqa: E402

DIRECT = ["--runner=DirectRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1"]
TEXTS = ["Natalia sold clips to 48 of her friends in April.", "Weng earns $12 an hour for babysitting.",
         "Betty is saving money for a new wallet which costs $100.", "Julie is reading a 120-page book.",
         "James writes a 3-page letter to 2 different friends twice a week."]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_harmony_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", num_hidden_layers=2))


def _args(ckpt: str, inputs: Sequence[str | Path], out: Path, *extra: str) -> argparse.Namespace:
    argv = ["--checkpoint", ckpt, "--input", *map(str, inputs), "--output", str(out), "--max-tokens", "6",
            "--dtype", "float32", "--device", "cpu", "--max-seq-len", "256", "--max-batch", "4",
            "--docs-per-unit", "2", "--temperature", "0.8", "--seed", "7", "--no-progress", *extra]
    args, rest = generate.build_parser().parse_known_args(argv)
    assert not rest
    return args


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]


def test_fit_prompt_and_templates(tmp_path: Path) -> None:
    t = load_template("rephrase")
    doc = Doc("d", text=" ".join(["word"] * 300))
    full, text, cut = fit_prompt(lambda s: render_template(t, s), doc, 10_000)
    assert cut == 0 and text == doc.text
    short, text2, cut2 = fit_prompt(lambda s: render_template(t, s), doc, len(full) - 50)
    assert len(short) <= len(full) - 50 and cut2 >= 50 and doc.text.startswith(text2)
    assert short[-2:] == full[-2:]  # the assistant-start suffix stays
    with pytest.raises(ValueError, match="no such file"):
        load_template("nope")
    bad = tmp_path / "t.txt"
    bad.write_text("no placeholder")
    with pytest.raises(ValueError, match="placeholder"):
        load_template(str(bad))


def test_generate_equals_engine_and_rerun_skips(tmp_path: Path, ckpt: str) -> None:
    inp = write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": f"d{i}", "text": t} for i, t in enumerate(TEXTS)],
                      raw_lines={2: '{"broken'})
    out = tmp_path / "out"
    assert generate.run(_args(ckpt, [inp], out), DIRECT) == 0
    rows = _rows(out)
    assert [r["id"] for r in rows] == ["d0", "d1", "a.jsonl:2", "d2", "d3", "d4"]
    assert "malformed JSON" in rows[2]["error"] and "text" not in rows[2]
    # the same documents straight through the engine, one at a time, with their seeds
    args = _args(ckpt, [inp], out)
    task = GenerateTask(generate.engine_settings(generate.EngineFlags.from_args(args)),
                           GenerationParams(6, 0.8, 7), "rephrase")
    engine = GptOssEngine(task.engine)
    for r, (i, text) in zip([r for r in rows if "error" not in r], enumerate(TEXTS)):
        ex, meta = task.example(Doc(f"d{i}", text=text))
        assert ex["seed"] == doc_seed(7, f"d{i}") and meta["prompt"] == text
        direct = engine.generate([ex["tokens"]], [ex["seed"]], 6, 0.8, task.params.stop_tokens)[0]
        body = direct["tokens"][:-1] if direct["finish_reason"] == "stop" else direct["tokens"]
        assert r["text"] == decode(body) and r["generated_tokens"] == len(direct["tokens"])
        assert r["prompt_tokens"] == len(ex["tokens"])
    before = (out / "generations.jsonl").read_bytes()
    # rerun: every unit skipped, nothing rewritten
    stages = gs.build_stages(task, generate.document_source(generate.InputFlags.from_args(args)))
    result = run_stages(stages, str(out), DIRECT, progress=False)
    assert result.ran == {} and (out / "generations.jsonl").read_bytes() == before
    # a different batch size (batching options are not part of the plan) re-run from scratch: same bytes
    out2 = tmp_path / "out2"
    assert generate.run(_args(ckpt, [inp], out2, "--max-batch", "1", "--docs-per-unit", "5"), DIRECT) == 0
    assert (out2 / "generations.jsonl").read_bytes() == before


def test_interrupted_run_resumes(tmp_path: Path, ckpt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": f"d{i}", "text": t} for i, t in enumerate(TEXTS)])
    out = tmp_path / "out"
    real = gs.WriteUnitFn.process
    calls: list[str] = []

    def write_then_crash(self: gs.WriteUnitFn, element: tuple[str, Mapping[str, Iterable[Any]]]
                         ) -> Iterator[Any]:  # the job dies once the first wave is written
        if calls:
            raise RuntimeError("killed")
        calls.append(element[0])
        yield from real(self, element)

    monkeypatch.setattr(gs.WriteUnitFn, "process", write_then_crash)
    assert generate.run(_args(ckpt, [inp], out, "--wave-units", "1"), DIRECT) == 1
    assert not (out / "generations.jsonl").exists()
    monkeypatch.setattr(gs.WriteUnitFn, "process", real)
    args = _args(ckpt, [inp], out, "--wave-units", "1")
    task = GenerateTask(generate.engine_settings(generate.EngineFlags.from_args(args)),
                           GenerationParams(6, 0.8, 7), "rephrase")
    stages = gs.build_stages(task, generate.document_source(generate.InputFlags.from_args(args)), 1)
    done = [u.id for u in stages[0].plan() if bind_stages(stages, str(out))[0].check(u.id).done]
    assert done == calls == ["f00000-d00000000"]
    result = run_stages(stages, str(out), DIRECT, progress=False)
    assert result.ran == {"infer": 2, "merge": 1}  # only the two units the crash left
    resumed = (out / "generations.jsonl").read_bytes()
    fresh = tmp_path / "fresh"
    assert generate.run(_args(ckpt, [inp], fresh), DIRECT) == 0
    assert (fresh / "generations.jsonl").read_bytes() == resumed


def test_generate_is_one_pipeline_with_its_waves_inside(tmp_path: Path, ckpt: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """3 units in waves of 1: one Beam pipeline (Infer with 3 waves, then Merge outputs),
    each wave's receipts written before the next wave starts."""
    import apache_beam as beam

    from refinery.runners.translate import step_names

    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": f"d{i}", "text": t} for i, t in enumerate(TEXTS)])
    runs, real = [], beam.Pipeline.run

    def counted(self: beam.Pipeline, *args: Any, **kwargs: Any) -> Any:  # Beam's PipelineResult
        proto = self.to_runner_api()
        runs.append((step_names(proto), sorted(t.unique_name for t in proto.components.transforms.values()
                                               if t.unique_name.endswith("/Write"))))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(beam.Pipeline, "run", counted)
    log = tmp_path / "units.log"
    monkeypatch.setenv("REFINERY_UNIT_LOG", str(log))
    assert generate.run(_args(ckpt, [inp], tmp_path / "out", "--wave-units", "1"), DIRECT) == 0
    assert runs == [(["Infer", "Merge outputs"], ["Infer/Wave 1/Write", "Infer/Wave 2/Write", "Infer/Wave 3/Write"])]
    events = [e for line in log.read_text().splitlines() if (e := json.loads(line))["event"] != "phase"]
    infer = [(e["event"], e["unit"]) for e in events if e["stage"] == "infer"]
    assert [e for e, _ in infer] == ["start", "end-completed"] * 3  # one wave after the other
    assert [e["stage"] for e in events][-2:] == ["merge", "merge"]


def test_generate_portable_runner(tmp_path: Path, ckpt: str) -> None:
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": f"p{i}", "text": t} for i, t in enumerate(TEXTS[:3])])
    out = tmp_path / "out"
    from refinery.runners import pipeline_args

    assert generate.run(_args(ckpt, [inp], out, "--no-share-model"), pipeline_args("portable")) == 0
    direct = tmp_path / "direct"
    assert generate.run(_args(ckpt, [inp], direct), DIRECT) == 0
    assert (out / "generations.jsonl").read_bytes() == (direct / "generations.jsonl").read_bytes()
    assert len(_rows(out)) == 3


def test_the_generate_job_does_not_grow_with_the_documents(tmp_path: Path, ckpt: str) -> None:
    """The infer waves read their units from the plan in the output, and a job has at most
    MAX_WAVES of them: 10x the documents, the same job (up to the digits of counts)."""
    from refinery.runners.translate import command_pipeline, runner_api, step_names

    assert gs.wave_spans(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert gs.wave_spans(1000, 1, max_waves=64)[:2] == [(0, 16), (16, 32)] and len(gs.wave_spans(1000, 1, 64)) == 63
    sizes = []
    for n in (2000, 20000):  # 1,000 and 10,000 units of 2 documents, asked in waves of 1: 16 waves of 63 and of 625
        inp = write_jsonl(tmp_path / f"in{n}.jsonl", [{"id": f"d{i}", "text": f"text {i}"} for i in range(n)])
        out = tmp_path / f"out{n}"
        stages = generate.generate_stages(generate.settings_from_args(_args(ckpt, [inp], out, "--wave-units", "1")))
        pipeline = command_pipeline(stages, str(out), DIRECT)
        assert pipeline is not None
        proto = runner_api(pipeline)
        steps = [t.unique_name for t in proto.components.transforms.values() if not t.subtransforms]
        per_wave = collections.Counter(s.split("/")[1] for s in steps if s.startswith("Infer/Wave "))
        assert len(per_wave) == gs.MAX_WAVES and step_names(proto) == ["Infer", "Merge outputs"]
        # every wave the same steps, its dead letter (FailedByUnit) among them: nothing per wave outside the waves
        assert set(per_wave.values()) == {per_wave["Wave 1"]} and "Infer/Wave 16/FailedByUnit" in steps
        assert [s for s in steps if s.startswith("Infer/") and not s.startswith("Infer/Wave ")] == ["Infer/AllWaves"]
        sizes.append(len(proto.SerializeToString()))
    assert sizes[1] < 1.02 * sizes[0] and sizes[1] < 1_000_000, sizes


def test_a_batch_that_raises_fails_its_units_and_the_rest_of_the_wave_completes(
        tmp_path: Path, ckpt: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """RunInference's dead letter: the engine raises on the batch holding document d3 (one
    document per batch here). Its unit gets a failed receipt with the error, the other units
    of the wave complete, the command exits 1 naming the unit; the rerun redoes only it."""
    from refinery.transforms.inference.model_handler import GptOssModelHandler

    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": f"d{i}", "text": t} for i, t in enumerate(TEXTS)])
    out = tmp_path / "out"
    bad_seed, real_infer = doc_seed(7, "d3"), GptOssModelHandler.infer

    def faulty(self: GptOssModelHandler, batch: Sequence[Any], model: GptOssEngine) -> Sequence[Mapping[str, Any]]:
        if any(e["seed"] == bad_seed for e in batch):
            raise ValueError("injected fault on d3")
        return real_infer(self, batch, model)

    monkeypatch.setattr(GptOssModelHandler, "infer", faulty)
    monkeypatch.setattr(GptOssModelHandler, "batch_elements_kwargs", lambda self: {"min_batch_size": 1,
                                                                                   "max_batch_size": 1})
    capsys.readouterr()
    assert generate.run(_args(ckpt, [inp], out), DIRECT) == 1  # 3 units of 2 documents, one wave
    err = capsys.readouterr().err
    assert "stage infer: 1 unit(s) not completed:\n  f00000-d00000002: failed: InferenceFailed " in err
    assert "InferenceFailed RunInference failed on a batch of 1 document(s) with d3: ValueError: injected fault" in err
    assert not (out / "generations.jsonl").exists()

    args = _args(ckpt, [inp], out)
    stages = generate.generate_stages(generate.settings_from_args(args))
    infer = bind_stages(stages, str(out))[0]
    failed = infer.check("f00000-d00000002")
    assert failed.receipt is not None
    assert failed.receipt["status"] == "failed" and failed.receipt["error"]["type"] == "InferenceFailed"
    assert failed.receipt["error"]["message"].endswith("ValueError: injected fault on d3")
    assert infer.ledger.listed_failures() == {"f00000-d00000002"}
    for unit in ("f00000-d00000000", "f00000-d00000004"):  # the rest of the wave: done, their files verify
        assert infer.check(unit, verify_checksums=True).done
    assert [json.loads(line)["id"] for line in (Path(infer.parts_dir) / "f00000-d00000000.jsonl").read_text()
            .splitlines()] == ["d0", "d1"]

    monkeypatch.setattr(GptOssModelHandler, "infer", real_infer)  # the fault fixed: only that unit runs again
    result = run_stages(stages, str(out), DIRECT, progress=False)
    assert result.ran == {"infer": 1, "merge": 1} and infer.ledger.listed_failures() == set()
    fresh = tmp_path / "fresh"
    assert generate.run(_args(ckpt, [inp], fresh), DIRECT) == 0
    assert (out / "generations.jsonl").read_bytes() == (fresh / "generations.jsonl").read_bytes()


def test_the_dead_letter_names_each_unit_of_a_failed_batch() -> None:
    batch = [(("u1", 0), {"tokens": [1]}), (("u2", 3), {"tokens": [2]}), (("u1", 2), {"tokens": [3]})]
    tb = ["Traceback (most recent call last):\n", '  File "x.py", line 1, in f\n',
          "torch.OutOfMemoryError: CUDA out of memory.\nTried to allocate 2 GiB\n"]
    oom = type("OutOfMemoryError", (RuntimeError,), {})
    error = "OutOfMemoryError: CUDA out of memory.\nTried to allocate 2 GiB"
    got = dict(gs.failed_batch_units((batch, (oom, "OutOfMemoryError('CUDA out of memory.')", tb))))
    assert got == {"u1": ((0, 2), 3, error), "u2": ((3,), 3, error)}
    ids = ["a", "b", "c", "d"]
    assert gs.inference_failure(ids, [got["u1"], ((1,), 2, "ValueError: bad")]) == (
        f"RunInference failed on a batch of 3 document(s) with a, c: {error}; "
        "RunInference failed on a batch of 2 document(s) with b: ValueError: bad")
