"""``refinery status``: per stage of a recorded run, its units done, failed and pending."""
from __future__ import annotations

from typing import TypedDict

from refinery.transforms.io import storage
from refinery.transforms.resumable.ledger import META_DIR, check_recorded_run
from refinery.transforms.resumable.planner import demanded
from refinery.transforms.resumable.run_record import RunRecord


class StageStatus(TypedDict):
    """One row of ``refinery status``: a stage's units done, failed and pending."""

    stage: str
    stage_hash: str
    units: int
    done: int
    failed: int
    pending: int
    final: bool
    needed: bool  # False: a next run would not run it (the stages after it are complete)


def stage_status(output: str, verify_checksums: bool = False) -> list[StageStatus]:
    """Per stage of the run recorded in OUTPUT: units done/failed/pending, each receipt judged
    by :func:`check_receipt` (a receipt whose files are missing or truncated is pending)."""
    run_json = storage.join(output, META_DIR, "run.json")
    try:
        info: RunRecord = storage.read_json(run_json)
    except FileNotFoundError:
        raise FileNotFoundError(f"{output}: no refinery run here ({run_json} not found)") from None
    rows: list[StageStatus] = []
    for st, _, checks in check_recorded_run(output, info, verify_checksums):
        done = failed = 0
        for c in checks:
            done += c.done
            failed += c.failed
        rows.append({"stage": st["name"], "stage_hash": st["stage_hash"], "units": st["units"],
                     "done": done, "failed": failed, "pending": max(0, st["units"] - done - failed),
                     "final": bool(st.get("final", st is info["stages"][-1])), "needed": True})
    last = demanded([r["final"] for r in rows], [r["done"] < r["units"] for r in rows])
    for i, r in enumerate(rows):
        r["needed"] = i <= last
    return rows
