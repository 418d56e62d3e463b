"""Inputs reached through symbolic links (a Hugging Face cache snapshot is a folder of links
to blobs): a file's fingerprint is its target's, whether a folder listing or a check of the
one file produced it, so prep's units do not fail as "changed", an edit of a target re-plans
decon, and decon and prep agree whichever of them went through the link."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import gsm8k_rows, run_prep, write_jsonl

from refinery.beam_pipelines.cli import main
from refinery.transforms.io import storage

OLD = 1_600_000_000  # the targets' mtime: far from the links' own


def _snapshot(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(folder of real files, folder of links to them, eval file); the links' own mtimes differ
    from their targets'. Row 5 of a.jsonl holds a test question."""
    train = gsm8k_rows("train")[:80]
    docs = [{"id": f"d{i}", "text": r["question"] + "\n\n" + r["answer"]} for i, r in enumerate(train)]
    docs[5]["text"] += " " + gsm8k_rows("test")[0]["question"]
    blobs = tmp_path / "blobs"
    write_jsonl(blobs / "a.jsonl", docs[:40])
    write_jsonl(blobs / "b.jsonl", docs[40:])
    links = tmp_path / "snapshots" / "rev" / "data"
    links.mkdir(parents=True)
    for name in ("a.jsonl", "b.jsonl"):
        os.utime(blobs / name, (OLD, OLD))
        (links / name).symlink_to(os.path.relpath(blobs / name, links))
    evals = write_jsonl(tmp_path / "eval" / "test.jsonl",
                        [{"id": f"t{i}", "text": r["question"]} for i, r in enumerate(gsm8k_rows("test")[:20])])
    return blobs, links, evals


def test_a_listing_and_a_single_file_give_the_target_fingerprint(tmp_path: Path) -> None:
    blobs, links, _ = _snapshot(tmp_path)
    (listed,) = [f for f in storage.expand_inputs([str(links)]) if f.relpath == "a.jsonl"]
    (single,) = storage.expand_inputs([str(links / "a.jsonl")])
    (target,) = storage.expand_inputs([str(blobs / "a.jsonl")])
    assert (listed.size, listed.version) == (single.size, single.version) == (target.size, target.version)
    assert float(listed.version) == OLD and listed.path == str(links / "a.jsonl")


def test_prep_through_links_runs_and_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, links, _ = _snapshot(tmp_path)
    assert run_prep([links], tmp_path / "out", "--num-shards", 2) == 0  # no unit "changed since planned"
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["total_documents"] == 80
    capsys.readouterr()
    assert run_prep([links], tmp_path / "out", "--num-shards", 2) == 0
    assert "nothing (all units already done)" in capsys.readouterr().out


def _decon(train: Path, evals: Path, out: Path) -> int:
    return main(["decon", "--eval", str(evals), "--train", str(train), "--output", str(out), "--ngrams", "13",
                 "--runner", "direct", "--no-progress"])


def test_an_edit_of_a_link_target_replans_decon(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blobs, links, evals = _snapshot(tmp_path)
    assert _decon(links, evals, tmp_path / "decon") == 0
    listed = (tmp_path / "decon" / "stats" / "contaminated_train_docs.jsonl").read_text()
    assert '"train_row": 5' in listed
    # the same size, a later mtime: the test question of row 5 is no longer there
    data = (blobs / "a.jsonl").read_text()
    question = json.dumps(gsm8k_rows("test")[0]["question"])[1:-1]  # as the JSON line spells it
    assert question in data
    (blobs / "a.jsonl").write_text(data.replace(question, "x" * len(question)))
    os.utime(blobs / "a.jsonl", (OLD + 60, OLD + 60))
    capsys.readouterr()
    assert _decon(links, evals, tmp_path / "decon") == 0
    assert "scan 2" in capsys.readouterr().out  # re-planned: the stale result is not kept
    assert (tmp_path / "decon" / "stats" / "contaminated_train_docs.jsonl").read_text() == ""


def test_exclusion_agrees_through_the_link_or_not(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blobs, links, evals = _snapshot(tmp_path)
    assert _decon(links, evals, tmp_path / "decon") == 0  # decon through the links
    assert run_prep([blobs], tmp_path / "clean", "--exclude-overlaps", tmp_path / "decon") == 0  # prep of targets
    assert json.loads((tmp_path / "clean" / "manifest.json").read_text())["rows"]["excluded"] == 1
    assert _decon(blobs, evals, tmp_path / "decon2") == 0  # and the other way round
    assert run_prep([links], tmp_path / "clean2", "--exclude-overlaps", tmp_path / "decon2") == 0
    assert json.loads((tmp_path / "clean2" / "manifest.json").read_text())["rows"]["excluded"] == 1


def test_one_file_named_several_ways_is_one_input(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Before: `--input a.jsonl train/../train/a.jsonl` read the 54 rows twice (108 documents).
    Now a file is one input however it is spelled (``..``, a link, a hard link, a folder and a
    file in it), kept under one spelling whatever the arguments' order, with one warning line."""
    a = write_jsonl(tmp_path / "train" / "a.jsonl", [{"id": f"r{i}", "text": f"row {i} of a"} for i in range(54)])
    write_jsonl(tmp_path / "train" / "sub" / "b.jsonl", [{"id": "b0", "text": "the one row of b"}])
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "a.jsonl").symlink_to(a)
    os.link(a, tmp_path / "hard.jsonl")
    spellings = [str(a), str(tmp_path / "train" / ".." / "train" / "a.jsonl"), str(tmp_path / "links"),
                 str(tmp_path / "hard.jsonl"), str(tmp_path / "train" / "sub"), str(tmp_path / "train")]
    listed = storage.expand_inputs(spellings)
    assert [(f.path, f.relpath) for f in listed] == [(str(a), "a.jsonl"), (str(tmp_path / "train" / "sub" / "b.jsonl"),
                                                                           "b.jsonl")]
    assert storage.expand_inputs(spellings[::-1]) == listed  # the same spelling kept, whatever the order
    caplog.clear()
    assert run_prep(spellings[:2], tmp_path / "out", "--num-shards", 1) == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["rows"]["read"] == manifest["total_documents"] == 54
    assert [r.getMessage() for r in caplog.records if "named more than once" in r.getMessage()] == [
        f"1 input file(s) named more than once, each read once, as its first spelling here: {a} (also {spellings[1]})"]
    capsys.readouterr()
    evals = write_jsonl(tmp_path / "eval" / "test.jsonl", [{"id": "t0", "text": "row 7 of a"}])
    assert main(["decon", "--eval", str(evals), str(tmp_path / "eval" / ".." / "eval"), "--train", *spellings[:4],
                 "--output", str(tmp_path / "decon"), "--ngrams", "3", "--min-eval-tokens", "0", "--runner", "direct",
                 "--no-progress"]) == 0
    said = capsys.readouterr()
    assert "training rows: read 54 = used 54" in said.out and "eval rows: read 1 = used 1" in said.out
    [hit] = [json.loads(line) for line in (tmp_path / "decon" / "stats" / "contaminated_train_docs.jsonl")
             .read_text().splitlines()]
    assert (hit["train_path"], hit["train_row"]) == (str(a), 7)
