"""The receipt's schema is written in one place, the TypedDict ``Receipt``; the docs quote what
it gives, and the receipts a run writes have exactly its keys; a stage's typed stats drop nothing."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from refinery.transforms.prep.stages import manifest_stats
from refinery.transforms.resumable import Stage, StageConfig, Unit, UnitContext, run_in_driver, run_stages
from refinery.transforms.resumable.ledger import NEVER_STORED, STORED_ALWAYS, Receipt, receipt_schema

ROOT = Path(__file__).resolve().parents[1]


class _Two(Stage[dict[str, int], dict[str, int]]):
    name = "two"

    def config(self) -> StageConfig:
        return StageConfig({"v": 1})

    def make_plan(self) -> list[Unit[dict[str, int]]]:
        return [Unit(f"u{k}", {"k": k}) for k in range(2)]

    def run_unit(self, unit: Unit[dict[str, int]], ctx: UnitContext) -> dict[str, int]:
        if unit.payload["k"] == 1:
            raise ValueError("the second unit fails")
        ctx.write_bytes(ctx.output_path("a.txt"), b"a")
        return {"k": unit.payload["k"]}


def test_the_docs_quote_the_schema_the_typeddict_gives() -> None:
    assert f"`{receipt_schema()}`" in (ROOT / "docs/FORMATS.md").read_text()
    assert "Receipt schema" not in (ROOT / "transforms/resumable/base.py").read_text()  # not copied there again


def test_stored_receipts_have_the_schemas_keys_in_its_order(tmp_path: Path) -> None:
    out = str(tmp_path)
    try:
        run_stages([_Two()], out, [], progress=False, runner=run_in_driver)
    except Exception:  # noqa: BLE001 - the failed unit fails the run; its receipt is what we read
        pass
    folder = next((tmp_path / ".refinery" / "two").iterdir()) / "receipts"
    done: dict[str, Any] = json.loads((folder / "u0.json").read_text())
    failed: dict[str, Any] = json.loads((folder / "u1.json").read_text())
    keys = [k for k in Receipt.__annotations__ if k not in NEVER_STORED]
    optional = set(Receipt.__optional_keys__) - set(STORED_ALWAYS)
    assert set(done) == {k for k in keys if k not in optional}  # (stored with sorted keys)
    assert set(failed) == {k for k in keys if k not in optional or k == "error"}
    assert failed["status"] == "failed" and set(failed["error"]) == {"type", "message", "traceback"}
    assert set(done["files"][0]) == {"path", "bytes", "sha256"}


def test_the_manifest_stats_keep_every_row_count_and_refuse_an_unknown_one() -> None:
    """The manifest unit's stats are typed key by key: a row count the accounting adds later is
    refused with its name, never dropped from the receipt."""
    rows = {"read": 9, "accepted": 6, "empty": 1, "rejected": 1, "over_budget": 1}
    assert manifest_stats(50, 6, rows) == {"tokens": 50, "docs": 6, "rows_read": 9, "rows_accepted": 6,
                                           "rows_empty": 1, "rows_rejected": 1, "rows_over_budget": 1}
    assert manifest_stats(50, 6, {**rows, "excluded": 2})["rows_excluded"] == 2
    with pytest.raises(ValueError, match=r"\['duplicates'\] have no place"):
        manifest_stats(50, 6, {**rows, "duplicates": 3})
