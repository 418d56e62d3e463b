"""Inputs that change under a run: the plan hash changes, old outputs are not reused for the
changed part, and the user is told why (which stage, which file, what changed)."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping

import pytest
from helpers import run_prep, write_jsonl
from reliability_helpers import expected_texts, make_corpus, read_unit_log, shard_texts

from refinery.transforms.io import storage
from refinery.transforms.prep.stages import PrepConfig, build_stages, clear_stale_manifest
from refinery.transforms.resumable import StageFailed, StageRun, Unit, run_stages


def _hashes(out: Path) -> dict[str, str]:
    return {s["name"]: s["stage_hash"] for s in json.loads((out / ".refinery/run.json").read_text())["stages"]}


def test_input_edited_or_added_under_a_finished_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    corpus = make_corpus(tmp_path / "corpus", files=3, docs_per_file=30)
    out, log = tmp_path / "out", tmp_path / "units.log"
    monkeypatch.setenv("REFINERY_UNIT_LOG", str(log))
    assert run_prep([corpus], out, "--num-shards", 2, "--dataset", "ch", "--unit-mb", 0) == 0
    before = _hashes(out)

    edited = corpus / "part-01.jsonl"
    edited.write_bytes(edited.read_bytes() + json.dumps({"id": "new-1", "text": "an edited file"}).encode() + b"\n")
    added = write_jsonl(corpus / "part-09.jsonl", [{"id": "new-2", "text": "a new file"}])
    mark = len(read_unit_log(log))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="refinery"):
        assert run_prep([corpus], out, "--num-shards", 2, "--dataset", "ch", "--unit-mb", 0) == 0
    after = _hashes(out)
    assert all(after[k] != before[k] for k in ("tokenize", "pack", "manifest"))
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert f"stage tokenize: plan {before['tokenize']} -> {after['tokenize']} because inputs changed" in said
    assert f"1 changed: {edited} (size " in said and f"1 added: {added}" in said
    assert "stage pack" in said and "stage tokenize before it changed" in said
    # nothing of the old plan reused: every tokenize unit ran again under the new hash
    started = [e for e in read_unit_log(log)[mark:] if e["event"] == "start" and e["stage"] == "tokenize"]
    assert len(started) == 4 and {e["stage_hash"] for e in started} == {after["tokenize"]}
    assert shard_texts(out) == expected_texts(corpus)

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="refinery"):
        assert run_prep([corpus], out, "--num-shards", 3, "--dataset", "ch", "--unit-mb", 0) == 0
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "config changed: num_shards 2 -> 3" in said


def test_input_edited_during_a_run_fails_its_unit_then_replans(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    corpus = make_corpus(tmp_path / "corpus", files=3, docs_per_file=30)
    out = tmp_path / "out"
    victim = corpus / "part-02.jsonl"

    def edit_after_planning(runs: list[StageRun], plans: list[list[Unit[Mapping[str, Any]]]]) -> None:
        clear_stale_manifest(runs, plans)
        late = json.dumps({"id": "late", "text": "written during the run"}).encode() + b"\n"
        victim.write_bytes(victim.read_bytes() + late)

    cfg = PrepConfig(inputs=storage.expand_inputs([str(corpus)]), output=str(out), dataset="ch", num_shards=2,
                     unit_bytes=0)
    with pytest.raises(StageFailed) as e:
        run_stages(build_stages(cfg), str(out), ["--runner=DirectRunner"], progress=False, on_plan=edit_after_planning)
    assert "changed since this job was planned" in str(e.value) and "00002" in str(e.value)
    assert not (out / "manifest.json").exists()
    with caplog.at_level(logging.WARNING, logger="refinery"):
        assert run_prep([corpus], out, "--num-shards", 2, "--dataset", "ch", "--unit-mb", 0) == 0
    assert f"1 changed: {victim}" in "\n".join(r.getMessage() for r in caplog.records)
    assert shard_texts(out) == expected_texts(corpus)  # the late document is in, exactly once
