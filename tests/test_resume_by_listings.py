"""Resume by listings (issue 35, item 3): a run with work to do reads, in the driver, only the
receipts of the stages with user-facing files; every other unit is checked by the worker that
would run it (the same ``check_receipt``), and the driver learns the outcome from listings."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, TypedDict

import pytest

from refinery.transforms import resumable as stages
from refinery.transforms.resumable import Stage, StageFailed, Traits, Unit, UnitContext, run_in_driver, run_stages
from refinery.transforms.resumable import ledger as stage_api
from refinery.transforms.resumable.ledger import Completion
from refinery.transforms.resumable.orchestration import JobResult, Runner
from refinery.transforms.resumable.planner import Step

N_PARTS = 40


class Counted(TypedDict):
    """What the ``counted`` fixture sees: per stage, the receipts the driver judged; the
    units the job ran and skipped; and the runner that counts them."""

    driver: dict[str, int]
    ran: list[str]
    skipped: list[str]
    runner: Runner


class Parts(Stage[dict[str, int], dict[str, int]]):
    """Intermediate: one small file per unit."""

    name = "parts"

    def __init__(self, fail_on: Iterable[str] = ()) -> None:
        self.fail_on = set(fail_on)

    def make_plan(self) -> list[Unit[dict[str, int]]]:
        return [Unit(f"p{i:03d}", {"i": i}) for i in range(N_PARTS)]

    def run_unit(self, unit: Unit[dict[str, int]], ctx: UnitContext) -> dict[str, int]:
        if unit.id in self.fail_on:
            raise ValueError(f"cannot do {unit.id}")
        ctx.write_bytes(ctx.part_path(f"{unit.id}.txt"), f"part {unit.payload['i']}\n".encode())
        return {"n": 1}


class Sums(Stage[dict[str, int], dict[str, int]]):
    """User-facing: 4 files, each the concatenation of a quarter of the parts."""

    name = "sums"

    def traits(self) -> Traits:
        return Traits(final_outputs=True)

    def make_plan(self) -> list[Unit[dict[str, int]]]:
        return [Unit(f"s{k}", {"k": k}) for k in range(4)]

    def run_unit(self, unit: Unit[dict[str, int]], ctx: UnitContext) -> dict[str, int]:
        parts = ctx.upstream("parts")
        k = unit.payload["k"]
        text = b"".join(open(f"{parts.parts_dir}/p{i:03d}.txt", "rb").read()
                        for i in range(N_PARTS) if i % 4 == k)
        ctx.write_bytes(ctx.output_path(f"sum-{k}.txt"), text)
        return {"bytes": len(text)}


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Counted:
    """Per stage, the receipts the driver judged (``check_receipt`` calls outside the job) and
    the units the job ran or skipped (``execute_unit`` in the runner)."""
    in_job = [False]
    real_check = stage_api.check_receipt

    def check(output: str, path: str, *args: Any, **kwargs: Any) -> Completion:
        if not in_job[0]:
            stage = path.split("/.refinery/")[1].split("/")[0]
            seen["driver"][stage] = seen["driver"].get(stage, 0) + 1
        return real_check(output, path, *args, **kwargs)

    def runner(steps: list[Step], beam_args: list[str], verify_checksums: bool) -> dict[str, int]:
        in_job[0] = True
        counters: dict[str, int] = {}
        try:
            for step in steps:  # a step runs all its units; a failure blocks the steps after it
                statuses: list[str] = []
                for u in step.units:
                    r = stages.execute_unit(step.run, u, verify_checksums)
                    (seen["skipped"] if r.get("skipped") else seen["ran"]).append(f"{step.run.name}/{u.id}")
                    for k, v in stages.unit_counters(step.run.name, r).items():
                        counters[k] = counters.get(k, 0) + v
                    statuses.append(r["status"])
                if set(statuses) != {"completed"}:
                    break
            return counters
        finally:
            in_job[0] = False

    monkeypatch.setattr(stage_api, "check_receipt", check)  # what Ledger.check calls
    seen: Counted = {"driver": {}, "ran": [], "skipped": [], "runner": runner}
    return seen


def _run(out: Path, counted: Counted, parts: Parts | None = None, **kw: Any) -> JobResult:
    counted["driver"] = {}
    counted["ran"], counted["skipped"] = [], []
    return run_stages([parts or Parts(), Sums()], str(out), [], runner=counted["runner"], progress=False, **kw)


def test_a_resumed_run_reads_no_intermediate_receipt_in_the_driver(tmp_path: Path, counted: Counted) -> None:
    out = tmp_path / "out"
    _run(out, counted)
    assert len(counted["ran"]) == N_PARTS + 4
    want = {k: (out / f"sum-{k}.txt").read_bytes() for k in range(4)}

    (out / "sum-2.txt").unlink()  # a user-facing file deleted: its unit runs again, nothing else
    result = _run(out, counted)
    assert counted["ran"] == ["sums/s2"]
    assert len(counted["skipped"]) == N_PARTS + 3  # the workers checked every other receipt
    # the driver read the 4 final receipts before the job, and after it only the unit with no
    # receipt or a recorded failure (none here): no receipt of the 40 parts units
    assert counted["driver"] == {"sums": 4}, counted["driver"]
    assert result.ran == {"parts": 0, "sums": 1}
    assert {k: (out / f"sum-{k}.txt").read_bytes() for k in range(4)} == want

    _run(out, counted)  # finished: a no-op that reads the final receipts only
    assert counted["ran"] == counted["skipped"] == [] and counted["driver"] == {"sums": 4}


def test_damage_found_by_a_worker_is_repaired_and_what_was_built_from_it_redone(
        tmp_path: Path, counted: Counted) -> None:
    out = tmp_path / "out"
    _run(out, counted)
    part = next(out.glob(".refinery/parts/*/parts/p005.txt"))
    part.write_bytes(b"damaged, and longer than before\n")  # wrong size: a repair
    (out / "sum-0.txt").unlink()  # gives the run work to do; p005 feeds sum-1
    _run(out, counted)
    assert sorted(counted["ran"]) == ["parts/p005", "sums/s0", "sums/s1", "sums/s2", "sums/s3"]
    assert part.read_bytes() == b"part 5\n"
    token = next(out.glob(".refinery/parts/*/repairs/p005")).read_text()
    for k in range(4):  # each final unit was built after the repair, and records it
        receipt = json.loads(next(out.glob(f".refinery/sums/*/receipts/s{k}.json")).read_text())
        assert receipt["upstream_repairs"] == {"parts/p005": token}
    assert b"part 5\n" in (out / "sum-1.txt").read_bytes()
    _run(out, counted)
    assert counted["ran"] == []


def test_a_failed_unit_is_named_from_the_failures_listing_and_cleared_once_it_completes(
        tmp_path: Path, counted: Counted) -> None:
    out = tmp_path / "out"
    with pytest.raises(StageFailed) as e:
        _run(out, counted, Parts(fail_on={"p007"}))
    assert e.value.stage == "parts" and list(e.value.failures) == ["p007"]
    assert "ValueError cannot do p007" in e.value.failures["p007"]
    marker = next(out.glob(".refinery/parts/*/failures/p007"))
    assert marker.read_text() == "ValueError: cannot do p007"
    assert not list(out.glob("sum-*.txt"))  # the stage after it did not run

    _run(out, counted)  # the cause fixed: the unit runs, its failure record goes
    assert "parts/p007" in counted["ran"] and not marker.exists()
    assert len(list(out.glob("sum-*.txt"))) == 4


def test_a_failure_record_left_by_a_kill_after_its_unit_completed_is_not_a_failure(
        tmp_path: Path, counted: Counted) -> None:
    out = tmp_path / "out"
    _run(out, counted)
    failures = next(out.glob(".refinery/parts/*")) / "failures"
    failures.mkdir()
    (failures / "p003").write_text("ValueError: an old failure")
    (out / "sum-3.txt").unlink()
    _run(out, counted)
    assert counted["ran"] == ["sums/s3"] and not (failures / "p003").exists()
    assert counted["driver"] == {"sums": 4, "parts": 1}  # the one unit the listing flagged


def test_the_same_flow_through_a_beam_job(tmp_path: Path) -> None:
    """The workers of a real Beam job (the in-process DirectRunner) check the receipts."""
    out = tmp_path / "out"
    run_stages([Parts(), Sums()], str(out), ["--runner=DirectRunner"], progress=False)
    want = {k: (out / f"sum-{k}.txt").read_bytes() for k in range(4)}
    next(out.glob(".refinery/parts/*/parts/p001.txt")).write_bytes(b"xx")
    (out / "sum-3.txt").unlink()
    result = run_stages([Parts(), Sums()], str(out), ["--runner=DirectRunner"], progress=False)
    assert result.ran == {"parts": 1, "sums": 4}  # the repair invalidates every final unit here
    assert {k: (out / f"sum-{k}.txt").read_bytes() for k in range(4)} == want
    assert run_stages([Parts(), Sums()], str(out), [], runner=run_in_driver, progress=False).ran == {}


def test_progress_counts_receipts_found_at_the_start_as_resumed_without_reading_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from refinery.transforms.io import storage
    from refinery.transforms.resumable.progress import Progress

    out = tmp_path / "out"
    runs = run_stages([Parts(), Sums()], str(out), [], runner=run_in_driver, progress=False).runs
    parts = runs[0]
    (next(out.glob(".refinery/parts/*")) / "failures").mkdir()
    (next(out.glob(".refinery/parts/*")) / "failures" / "p001").write_text("ValueError: x")
    progress = Progress([(parts, N_PARTS)], interval=1.0, enabled=False)
    reads: list[str] = []
    real = storage.read_json

    def read_json(path: str) -> Any:
        reads.append(path)
        return real(path)

    monkeypatch.setattr(storage, "read_json", read_json)
    progress._seed()
    done, post = progress._poll(parts, N_PARTS)
    # p001's last attempt is recorded as failed: read (and found completed here), not assumed done
    assert done == N_PARTS and [p.rsplit("/", 1)[-1] for p in reads] == ["p001.json"]
    assert post == f"resumed={N_PARTS}"  # work done before this run: no docs=0, no stats of it
