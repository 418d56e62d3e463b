"""The progress display moves while a unit runs: running units publish their counts so far
(``progress/<unit>.json``), the driver's poll adds them to the finished units' stats."""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Mapping

import pytest
from helpers import gsm8k_rows

from refinery.transforms.io import storage
from refinery.transforms.resumable import Stage, StageRun, Traits, Unit, UnitContext, bind_stages, execute_unit
from refinery.transforms.resumable import base as stages  # where the Stage API lives
from refinery.transforms.resumable.progress import Progress


class Counting(Stage[dict[str, Any], dict[str, int]]):
    """Each unit reports ``docs`` as it goes, then waits until the test lets it finish."""

    name = "counting"

    def __init__(self) -> None:
        self.reported = {u: threading.Event() for u in ("a", "b")}
        self.finish = {u: threading.Event() for u in ("a", "b")}

    def traits(self) -> Traits:
        return Traits(progress_text=self._progress_text)

    def make_plan(self) -> list[Unit[dict[str, Any]]]:
        return [Unit("a", {}), Unit("b", {})]

    def run_unit(self, unit: Unit[dict[str, Any]], ctx: UnitContext) -> dict[str, int]:
        for docs in (10, 20, 30):
            counts: dict[str, Any] = {"docs": docs, "label": "not a number"}  # a stage may report a non-number
            ctx.report_progress(counts)
        self.reported[unit.id].set()
        assert self.finish[unit.id].wait(30)
        return {"docs": 100}

    def _progress_text(self, stats: Mapping[str, Any], seconds: float) -> str:
        return f"docs={int(stats.get('docs', 0))}"


def _start(run: StageRun, unit: Unit[dict[str, Any]]) -> threading.Thread:
    t = threading.Thread(target=execute_unit, args=(run, unit))
    t.start()
    return t


def test_running_units_counts_show_before_they_finish_and_their_files_go(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stages, "PROGRESS_EVERY_S", 0.0)  # every report is written
    stage = Counting()
    [run] = bind_stages([stage], str(tmp_path / "out"))
    progress = Progress([(run, 2)], interval=1.0, enabled=False)
    a, b = _start(run, Unit("a", {})), _start(run, Unit("b", {}))
    assert stage.reported["a"].wait(30) and stage.reported["b"].wait(30)
    assert progress._poll(run, 2) == (0, "docs=60")  # both units' last counts, none finished
    stage.finish["a"].set()
    a.join(30)
    assert [p.name for p in (tmp_path / "out").glob("**/progress/*.json")] == ["b.json"]
    assert progress._poll(run, 2) == (1, "docs=130")  # a from its receipt, b so far
    stage.finish["b"].set()
    b.join(30)
    assert list((tmp_path / "out").glob("**/progress/*.json")) == []
    assert progress._poll(run, 2) == (2, "docs=200")


def test_a_file_left_by_a_killed_run_is_not_counted(tmp_path: Path) -> None:
    [run] = bind_stages([Counting()], str(tmp_path / "out"))
    from refinery.transforms.io import storage

    storage.atomic_write_json(run.progress_path("a"), {"unit": "a", "stats": {"docs": 7},
                                                       "updated_at": "2020-01-01T00:00:00.000+00:00"})
    progress = Progress([(run, 2)], interval=1.0, enabled=False)
    assert progress._poll(run, 2) == (0, "")


def test_a_short_unit_writes_no_progress_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first write waits PROGRESS_EVERY_S: a unit quicker than that costs no request."""
    stage = Counting()
    stage.finish["a"].set()
    [run] = bind_stages([stage], str(tmp_path / "out"))
    writes: list[str] = []
    real = storage.atomic_write_json  # the module the Stage API writes through

    def spy_write(path: str, obj: Any) -> None:
        writes.append(path)
        real(path, obj)

    monkeypatch.setattr(storage, "atomic_write_json", spy_write)
    execute_unit(run, Unit("a", {}))
    assert [w for w in writes if "/progress/" in w] == []
    assert json.loads(next((tmp_path / "out").glob("**/receipts/a.json")).read_text())["stats"] == {"docs": 100}


def test_prep_tokenize_reports_documents_and_tokens_while_it_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """prep's tokenize unit publishes its documents and tokens batch by batch."""
    from refinery.beam_pipelines.cli import main

    monkeypatch.setattr(stages, "PROGRESS_EVERY_S", 0.0)
    from refinery.transforms.prep.stages import tokenize_rows

    monkeypatch.setattr(tokenize_rows, "BATCH_DOCS", 16)  # where a unit's rows are batched
    seen: list[tuple[str, dict[str, Any]]] = []
    real = stages.UnitContext.report_progress

    def spy(self: UnitContext, counts: dict[str, int | float]) -> None:
        seen.append((self.run.name, dict(counts)))
        real(self, counts)

    monkeypatch.setattr(stages.UnitContext, "report_progress", spy)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": r["question"]}) + "\n" for r in gsm8k_rows("test")[:100]))
    assert main(["prep", "--input", str(src), "--output", str(tmp_path / "out"), "--num-shards", "2",
                 "--runner", "direct"]) == 0
    docs = [c["accepted"] for name, c in seen if name == "tokenize"]
    assert docs[:3] == [16, 32, 48] and docs[-1] == 100
    assert all(c["tokens"] > 0 for name, c in seen if name == "tokenize")
    assert list((tmp_path / "out").glob("**/progress/*.json")) == []  # each removed with its receipt


def test_decon_scan_reports_rows_and_bytes_while_it_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """decon's scan publishes rows and text bytes every 1,024 rows, hits or none."""
    from refinery.beam_pipelines.cli import main

    monkeypatch.setattr(stages, "PROGRESS_EVERY_S", 0.0)
    seen: list[tuple[str, dict[str, Any]]] = []
    real = stages.UnitContext.report_progress

    def spy(self: UnitContext, counts: dict[str, int | float]) -> None:
        seen.append((self.run.name, dict(counts)))
        real(self, counts)

    monkeypatch.setattr(stages.UnitContext, "report_progress", spy)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"text": f"row {i} of a corpus with no overlap " * 30}) + "\n"
                             for i in range(3000)))
    evalset = tmp_path / "eval.jsonl"
    evalset.write_text("".join(json.dumps({"id": f"q{i}", "text": r["question"]}) + "\n"
                               for i, r in enumerate(gsm8k_rows("test")[:20])))
    assert main(["decon", "--eval", str(evalset), "--train", str(train), "--output", str(tmp_path / "out"),
                 "--ngrams", "13", "--runner", "direct"]) == 0
    scan = [c for name, c in seen if name == "scan"]
    assert [c["rows"] for c in scan] == [0, 1024, 2048]
    assert scan[-1]["text_bytes"] > 0


def test_progress_lines_never_show_a_rate_over_nothing() -> None:
    """`scan: 3/3 units, 0s, 0 MB, 2121.8 MB/s` was printed: a rate over a few ms, and a size
    rounded to 0. A rate needs an amount and at least a second; a size is in its own unit."""
    from refinery.transforms.decon.stages import ScanStage
    from refinery.transforms.prep.stages import TokenizeStage
    from refinery.transforms.resumable.progress import human_bytes, rate

    assert rate(0, 30.0, "MB") == "" and rate(5.0, 0.004, "MB") == "" and rate(5.0, 2.0, "MB") == "2.5 MB/s"
    assert [human_bytes(n) for n in (0, 812, 4_100, 3_200_000, 1.5e9)] == ["0 B", "812 B", "4.1 KB", "3.2 MB",
                                                                           "1.5 GB"]
    scan = ScanStage.__new__(ScanStage)  # its progress text reads only its arguments: no settings needed
    tokenize = TokenizeStage.__new__(TokenizeStage)
    assert scan._progress_text({"text_bytes": 8_500}, 0.004) == "8.5 KB"
    assert scan._progress_text({"text_bytes": 8_500_000}, 2.0) == "8.5 MB, 4.2 MB/s"
    assert tokenize._progress_text({"accepted": 3, "tokens": 90}, 0.01) == "docs=3 tokens=90"


def test_a_finished_steps_time_ends_with_its_last_unit_not_with_the_poll(tmp_path: Path) -> None:
    """`tokenize: 1/1 units, 7s` then `prep done in 6.8s`: the step's time ran until the poll
    that saw it end, and was rounded differently. Now it ends at its last unit's finish."""
    import time

    stage = Counting()
    stage.finish["a"].set()
    stage.finish["b"].set()
    [run] = bind_stages([stage], str(tmp_path / "out"))
    progress = Progress([(run, 2)], interval=1.0, enabled=False)
    execute_unit(run, Unit("a", {}))
    execute_unit(run, Unit("b", {}))
    finished = time.time()
    time.sleep(1.2)  # the poll comes later than the end
    shown = []
    progress._update(lambda i, done, post, ended: shown.append((done, ended, progress._seconds(ended))), final=True)
    (done, ended, seconds), = shown
    assert done == 2 and ended and seconds <= finished - progress._step_start + 0.05


def test_a_running_step_says_its_time_left_from_the_units_this_run_finished() -> None:
    from refinery.transforms.resumable.progress import _eta

    assert _eta(30.0, 3, 1) == "ETA 1m30s" and _eta(10.0, 1, 4) == "ETA 2s" and _eta(3600.0, 2, 1) == "ETA 2h00m"
    assert _eta(30.0, 3, 0) == "" and _eta(30.0, 0, 5) == ""  # nothing finished yet, or nothing left: no guess


def test_inference_units_publish_documents_and_tokens_while_they_run(tmp_path: Path) -> None:
    """`infer: 0/2 units, 151s` said nothing while a unit ran: RunInference's batches now count
    each unit's documents and tokens (UnitProgress), which the display adds up with rates."""
    import pytest

    pytest.importorskip("apache_beam")
    from apache_beam.ml.inference.base import PredictionResult

    from refinery.transforms.inference import stages as inference
    from refinery.transforms.inference import tasks

    stage = Counting()
    [run] = bind_stages([stage], str(tmp_path / "out"))
    progress = Progress([(run, 2)], interval=1.0, enabled=False)
    counts = inference.UnitProgress(run)
    batch = [(("a", i), PredictionResult(None, {"generated_tokens": 5})) for i in range(3)]
    counts(batch + [(("b", 0), PredictionResult(None, {"generated_tokens": 7}))])
    running = sorted(progress._running(run, set()), key=lambda c: c["documents"])  # what the display adds up
    assert running == [{"documents": 1, "generated_tokens": 7}, {"documents": 3, "generated_tokens": 15}]
    published = {p.name: json.loads(p.read_text())["stats"] for p in (tmp_path / "out").glob("**/progress/*.json")}
    assert published == {"a.json": {"documents": 3, "generated_tokens": 15},
                         "b.json": {"documents": 1, "generated_tokens": 7}}
    task = tasks.GenerateTask.__new__(tasks.GenerateTask)
    assert task.progress({"documents": 4, "generated_tokens": 22}, 2.0) == "4 docs, 22 tokens, 2.0 docs/s, 11.0 tok/s"
    assert task.progress({"documents": 4, "generated_tokens": 22}, 0.2) == "4 docs, 22 tokens"
