"""kill -9 on ``refinery hydra grade`` and ``refinery hydra oracle-label``: resumed runs give
byte-identical outputs.

Both steps run on the infer -> merge stages of :mod:`refinery.transforms.inference.stages`
(only the task differs), so they get the same kill loop as ``refinery generate``
(``test_reliability_generate.py``): the real command (``--runner direct``, forked from a
server that has imported torch, Beam and the inference modules once), killed with SIGKILL
to its whole process group at points chosen from the run's own progress events (the unit
log, ``$REFINERY_UNIT_LOG``, with the driver's phase marks), never from the time since the
launch: in start-up (at a driver phase: the plan written, the job about to be made or run;
the model load and first wave follow), between infer units or during the next wave's
inference (a completed unit plus a jitter under the reference run's shortest wave), inside
an infer unit's write (its start), and inside the merge unit's write (its start). Rerun
after each kill until a run exits 0. A busy machine makes each step slower, not the kills
land elsewhere: the loops stop after a number of cycles, not of seconds.

The chain is built once on a tiny random 2-layer gpt-oss: prep of 40 GSM8K documents ->
slices -> stand-in labels -> calibrate -> probe and judge heads. The doc-id inputs are the
three slices plus a file whose middle doc id points at a shard that does not exist (it must
come out as an error / unreadable row, never dropped). oracle-label samples at temperature
0.8 with a fixed seed (per-document RNG).

After every attempt: no completed receipt changed or vanished, no unit started after its
completed receipt (unit log), and every final file present under its final name is the
finished one. When a run exits 0: the sha256 of every final file equals the uninterrupted
run's, every input doc id is in the outputs exactly once (grade: in plan order, i.e. the
doc-id files sorted by path, then their rows), and no temp file is left. Kills per command:
6 (start-up 1, infer 4 of which one inside a unit's write, merge 1), one cycle (about 8 s on
an idle machine), a few more when a kill aimed at the merge came after it ended.
"""
from __future__ import annotations

import collections
import json
import random
import time
from pathlib import Path
from typing import Any, Iterator, TypedDict

import pytest

pytest.importorskip("torch", reason="the inference extra (torch) is not installed")

from engine_fixtures import write_harmony_checkpoint  # noqa: E402
from helpers import gsm8k_texts, run_prep, write_jsonl  # noqa: E402
from reliability_helpers import (  # noqa: E402
    STARTUP_PHASES,
    ForkServer,
    child_env,
    final_digest,
    kill_cycle,
    planned_units,
    read_unit_log,
    run_attempt,
    stage_progress,
    temp_files,
    write_figures,
)

from refinery.beam_pipelines import hydra  # noqa: E402
from refinery.transforms.formats.docids import read_doc_tokens  # noqa: E402
from refinery.transforms.hydra.oracle import DIMENSIONS  # noqa: E402

SEED = 11
MIN_KILLS = {"grade": 6, "oracle": 6}
WAVE_UNITS = 2
MAX_CYCLES = 5  # per command: runs to completion; the kills of one usually suffice (a merge kill may miss)
ENGINE = ["--dtype", "float32", "--device", "cpu", "--max-batch", "4"]
# torch._dynamo: imported on first use of the meta device (building the model), ~1.5 s per run
PRELOAD = ("torch", "torch._dynamo", "apache_beam.ml.inference.base", "refinery.transforms.inference.handler",
           "refinery.transforms.inference.stages", "refinery.transforms.hydra.heads",
           "refinery.transforms.hydra.grade", "refinery.transforms.hydra.oracle",
           "refinery.beam_pipelines.generate", "refinery.beam_pipelines.hydra")


class Chain(TypedDict):
    """What the ``chain`` fixture made: paths (as the commands take them), doc ids per input."""

    ckpt: str
    data: str
    cal: str
    heads: str
    root: Path
    files: dict[str, str]
    split: dict[str, list[str]]
    missing: str


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def hydra_forks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    """A fork server that has also imported torch and the hydra modules."""
    server = ForkServer(tmp_path_factory.mktemp("hydraforks"), preload=PRELOAD)
    yield server
    server.close()


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Chain:
    """Checkpoint, prep data, doc-id files (input order of ids), calibration and heads."""
    root = tmp_path_factory.mktemp("hydra")
    ckpt = str(write_harmony_checkpoint(root / "ckpt", num_hidden_layers=2))
    corpus = root / "corpus"
    write_jsonl(corpus / "x.jsonl", [{"id": f"x{i}", "text": t} for i, t in enumerate(gsm8k_texts(40))])
    data = root / "prep"
    assert run_prep(corpus, data, "--num-shards", "2") == 0
    slices = root / "slices"
    assert hydra.main(["slices", "--data-root", str(data), "--output", str(slices)]) == 0
    split = {s: [r["doc_id"] for r in _jsonl(slices / f"docids_{s}.jsonl")] for s in ("train", "val", "test")}
    assert all(split.values())
    # two readable ids around one whose shard does not exist: an error row, not a dropped one
    missing = split["val"][0].replace("shard_000", "shard_999")
    assert missing != split["val"][0]
    extra = [split["test"][0], missing, split["val"][0]]
    (root / "extra.jsonl").write_text("".join(json.dumps({"doc_id": d}) + "\n" for d in extra))

    labels = root / "labels.jsonl"  # stand-in oracle labels: a function of the tokens
    rows = []
    for d in split["train"] + split["val"]:
        q = min(4, len(read_doc_tokens(str(data), d)) // 40)
        rows.append({"doc_id": d, "scores": {k: float(max(0, min(4, q - (i % 2)))) for i, k in enumerate(DIMENSIONS)}})
    labels.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cal, heads = root / "cal", root / "heads"
    assert hydra.main(["calibrate", "--labels", str(labels), "--output", str(cal), "--target-keep", "0.5"]) == 0
    common = ["--labels", str(labels), "--data-root", str(data), "--output", str(heads), "--checkpoint", ckpt,
              "--max-ctx", "64", "--epochs", "1", "--batch-size", "16", "--warmup-steps", "1", *ENGINE]
    assert hydra.main(["train", "probe", "--layer", "1", *common]) == 0
    assert hydra.main(["train", "judge", "--layer", "2", "--mid-dim", "32", *common]) == 0
    return {"ckpt": ckpt, "data": str(data), "cal": str(cal), "heads": str(heads), "root": root,
            "files": {s: str(slices / f"docids_{s}.jsonl") for s in split} | {"extra": str(root / "extra.jsonl")},
            "split": split | {"extra": extra}, "missing": missing}


def _grade_job(chain: Chain) -> tuple[list[str], list[str], list[str]]:
    """(argv without --output/--runner, input doc ids in order, final files)."""
    order = sorted(("train", "val", "test", "extra"), key=lambda s: chain["files"][s])  # plan order: files by path
    argv = ["hydra", "grade", "--checkpoint", chain["ckpt"], "--heads-dir", chain["heads"],
            "--calibration", chain["cal"], "--input-docids", *[chain["files"][s] for s in order],
            "--data-root", chain["data"], "--max-ctx", "64", "--docs-per-unit", "4", "--wave-units", str(WAVE_UNITS),
            "--no-progress", *ENGINE]
    return argv, [d for s in order for d in chain["split"][s]], ["quality_scores.jsonl", "summary.json"]


def _oracle_job(chain: Chain) -> tuple[list[str], list[str], list[str]]:
    order = sorted(("val", "test", "extra"), key=lambda s: chain["files"][s])
    argv = ["hydra", "oracle-label", "--checkpoint", chain["ckpt"], "--input-docids",
            *[chain["files"][s] for s in order], "--data-root", chain["data"], "--max-tokens", "4",
            "--max-seq-len", "512", "--temperature", "0.8", "--seed", "7", "--docs-per-unit", "1",
            "--wave-units", str(WAVE_UNITS), "--no-progress", *ENGINE]
    return argv, [d for s in order for d in chain["split"][s]], ["labels.jsonl", "failures.jsonl", "summary.json"]


def _output_ids(out: Path, step: str) -> list[str]:
    if step == "grade":
        return [r["doc_id"] for r in _jsonl(out / "quality_scores.jsonl")]
    return [r["doc_id"] for r in _jsonl(out / "labels.jsonl") + _jsonl(out / "failures.jsonl")]


class Picker:
    """Where the next kill of one output lands, from the run's progress (its receipts) and the
    reference run's plan and unit log, never from the time since the launch: first at one of
    the driver's phases in start-up, then at most ``infer_cap`` kills in infer (none once only
    the last wave is left: merge's turn, a kill aimed there could miss a run that finishes),
    then one at the merge unit's start."""

    def __init__(self, plan: list[tuple[str, int]], wave_units: int, wave_s: float, infer_cap: int = 4) -> None:
        self.plan, self.wave_units, self.wave_s, self.infer_cap = plan, wave_units, wave_s, infer_cap
        self.aimed: collections.Counter[str] = collections.Counter()

    def __call__(self, rng: random.Random, out: Path) -> tuple[int | None, float, str | None, str]:
        if not self.aimed["startup"]:
            self.aimed["startup"] += 1
            return 1, 0.0, None, rng.choice(STARTUP_PHASES)  # planning / model load / first wave follow
        progress = {name: (done, units) for name, done, units in stage_progress(out, self.plan)}
        infer_done, infer_units = progress["infer"]
        left = infer_units - infer_done
        if left > self.wave_units and self.aimed["infer"] < self.infer_cap:
            self.aimed["infer"] += 1
            if self.aimed["infer"] == 2:  # inside a unit's write (it starts after the wave's inference)
                return 1, 0.0, "infer", "start"
            # the units of a wave end together (after the wave's inference): between them, or in the next
            # wave (a jitter under the shortest wave of the reference run: the next wave is still running)
            return 1, rng.uniform(0.0, self.wave_s), "infer", "end-completed"
        if not self.aimed["merge"]:
            self.aimed["merge"] += 1
            return 1, 0.0, "merge", "start"
        return None, 0.0, None, "start"


def _shortest_wave(events: list[dict[str, Any]]) -> float:
    """Half the shortest time between two waves' ends in a run's unit log (the infer units of a
    wave end together): a jitter after a completed unit that still lands in the next wave."""
    ends = sorted(e["t"] for e in events if e["event"] == "end-completed" and e["stage"] == "infer")
    gaps = [b - a for a, b in zip(ends, ends[1:]) if b - a > 0.01]  # the units of one wave: ms apart
    return min(gaps) / 2 if gaps else 0.0


def _reference(forks: ForkServer, argv: list[str], root: Path,
               name: str) -> tuple[Path, dict[str, str], collections.Counter[str], float]:
    """The uninterrupted run: its output, digest, completed units per stage, and the jitter
    of :func:`_shortest_wave` measured on it."""
    out, log = root / f"ref-{name}", root / f"ref-{name}.log"
    a = run_attempt(lambda: forks.start([*argv, "--output", str(out), "--runner", "direct"], child_env(log)), log)
    assert a.returncode == 0, a.stderr[-3000:]
    events = read_unit_log(log)
    units = collections.Counter(e["stage"] for e in events if e["event"] == "end-completed")
    return out, final_digest(out), units, _shortest_wave(events)


def _kill_loop(tmp_path: Path, forks: ForkServer, argv: list[str], ids: list[str], outputs: list[str],
               want: dict[str, str], step: str, ref: Path,
               wave_s: float) -> tuple[collections.Counter[str], int, float]:
    t0 = time.time()
    rng = random.Random(SEED)
    where: collections.Counter[str] = collections.Counter()
    kills = cycles = 0
    plan = planned_units(ref)
    while (kills < MIN_KILLS[step] or not any(w.startswith("merge") for w in where)) and cycles < MAX_CYCLES:
        out, log = tmp_path / f"{step}{cycles}", tmp_path / f"{step}{cycles}.log"
        run_argv = [*argv, "--output", str(out), "--runner", "direct"]
        got = kill_cycle(rng, lambda env: forks.start(run_argv, env), out, log, want, outputs, 6,
                         Picker(plan, WAVE_UNITS, wave_s))
        assert temp_files(out) == []
        assert final_digest(out) == want
        assert collections.Counter(_output_ids(out, step)) == collections.Counter(ids)  # each exactly once
        kills += len(got)
        where.update(got)
        cycles += 1
    return where, cycles, time.time() - t0


def _check_coverage(where: collections.Counter[str], step: str) -> int:
    phases = collections.Counter(w.split(":")[0] for w in where.elements())
    assert sum(where.values()) >= MIN_KILLS[step], where
    assert phases["startup"] >= 1 and phases["infer"] >= MIN_KILLS[step] - 3 and phases["merge"] >= 1, (step, where)
    return sum(where.values())


def test_hydra_grade_kill9_loop(tmp_path: Path, hydra_forks: ForkServer, chain: Chain) -> None:
    argv, ids, outputs = _grade_job(chain)
    ref, want, units, wave_s = _reference(hydra_forks, argv, tmp_path, "grade")
    assert set(want) == set(outputs)
    rows = _jsonl(ref / "quality_scores.jsonl")
    assert [r["doc_id"] for r in rows] == ids  # every input doc id once, in input order
    errors = [r for r in rows if "error" in r]
    assert [r["doc_id"] for r in errors] == [chain["missing"]] and "not found" in errors[0]["error"]
    summary = json.loads((ref / "summary.json").read_text())
    assert summary["documents"] == len(ids) and summary["errors"] == 1
    assert summary["drop"] + summary["band"] + summary["keep"] == len(ids) - 1
    assert units["infer"] >= 10 and units["merge"] == 1

    where, cycles, seconds = _kill_loop(tmp_path, hydra_forks, argv, ids, outputs, want, "grade", ref, wave_s)
    kills = _check_coverage(where, "grade")
    assert [r["doc_id"] for r in _jsonl(tmp_path / f"grade{cycles - 1}" / "quality_scores.jsonl")] == ids
    write_figures("hydra_grade_kill9", {"kills_direct": kills, "cycles": cycles, "where": dict(where),
                                        "documents": len(ids), "infer_units": units["infer"], "documents_lost": 0,
                                        "seconds": round(seconds, 1)})
    print(f"hydra grade kill -9: {kills} kills in {cycles} cycles, where {dict(where)}")


def test_hydra_oracle_label_kill9_loop(tmp_path: Path, hydra_forks: ForkServer, chain: Chain) -> None:
    argv, ids, outputs = _oracle_job(chain)
    ref, want, units, wave_s = _reference(hydra_forks, argv, tmp_path, "oracle")
    assert set(want) == set(outputs)
    failures = _jsonl(ref / "failures.jsonl")
    summary = json.loads((ref / "summary.json").read_text())
    assert summary["documents"] == len(ids) and summary["unreadable"] == 1
    assert summary["parsed"] + summary["failed"] + summary["unreadable"] == len(ids)
    assert [f for f in failures if f["doc_id"] == chain["missing"]][0]["error"]
    assert units["infer"] == len(ids) and units["merge"] == 1

    where, cycles, seconds = _kill_loop(tmp_path, hydra_forks, argv, ids, outputs, want, "oracle", ref, wave_s)
    kills = _check_coverage(where, "oracle")
    write_figures("hydra_oracle_kill9", {"kills_direct": kills, "cycles": cycles, "where": dict(where),
                                         "documents": len(ids), "infer_units": units["infer"],
                                         "documents_lost": 0, "seconds": round(seconds, 1)})
    print(f"hydra oracle-label kill -9: {kills} kills in {cycles} cycles, where {dict(where)}")
