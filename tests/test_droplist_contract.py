"""The drop list's contract with prep (issue 46, items 3 and 6, F13).

- decon records how it read the training text (text field or template, normalization
  version, row cap) in ``stats/train_files.jsonl``; ``prep --exclude-overlaps`` refuses a
  drop list read otherwise than it reads, in one line naming both sides;
- a training row decon could not read is listed (``stats/unread_train_rows.jsonl``) and
  excluded by prep, counted;
- the drop list names the row and its n only (not the eval instances), and prep reads it a
  line at a time: both stay small when thousands of eval rows share an n-gram;
- ``--verify-inputs-by-content``: a training file whose rows were swapped with its size and
  mtime kept is refused.
"""
from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import pytest
from helpers import gsm8k_rows, run_prep, write_jsonl

from refinery.beam_pipelines.cli import main
from refinery.transforms.formats.droplist import (
    CONTAMINATED_DOCS,
    TRAIN_FILES,
    UNREAD_ROWS,
    ReadSpec,
    drop_rows,
    read_spec_mismatch,
)
from refinery.transforms.io import storage
from refinery.transforms.io.rows import DEFAULT_MAX_ROW_BYTES
from refinery.transforms.io.text import TEXT_NORMALIZATION
from refinery.transforms.prep import exclusion


def _decon(evals: Path, train: Path, out: Path, *extra: object) -> int:
    return main(["decon", "--eval", str(evals), "--train", str(train), "--output", str(out), "--ngrams", "13",
                 "--partitions", "2", "--runner", "direct", "--no-progress", *map(str, extra)])


def _planted(tmp_path: Path, field: str = "text", n: int = 40) -> tuple[Path, Path, list[str]]:
    """(eval file, training folder, the questions planted in training rows 3, 10, 20)."""
    test = [r["question"] for r in gsm8k_rows("test")[:5]]
    evals = write_jsonl(tmp_path / "eval" / "gsm8k" / "test.jsonl",
                        [{"id": f"t{i}", "text": q} for i, q in enumerate(test)])
    docs = [{"id": f"d{i}", field: r["question"]} for i, r in enumerate(gsm8k_rows("train")[:n])]
    for k, i in enumerate((3, 10, 20)):
        docs[i][field] = f"Intro. {test[k]} Outro."
    write_jsonl(tmp_path / "train" / "t.jsonl", docs)
    return evals, tmp_path / "train", test[:3]


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_prep_refuses_a_drop_list_read_from_another_text_field(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    # before: decon --train-text-field text, prep --text-field body: 0 excluded, every planted row kept, exit 0
    evals, train, _ = _planted(tmp_path)
    rows = [json.loads(line) for line in (train / "t.jsonl").read_text().splitlines()]
    write_jsonl(train / "t.jsonl", [{**r, "body": r["text"]} for r in rows])  # the same text under two fields
    assert _decon(evals, train, tmp_path / "decon", "--train-text-field", "text") == 0
    files = [json.loads(line) for line in (tmp_path / "decon" / TRAIN_FILES).read_text().splitlines()]
    assert [(f["text"], f["normalization"], f["max_row_bytes"]) for f in files] == [
        ({"text_field": "text"}, TEXT_NORMALIZATION, DEFAULT_MAX_ROW_BYTES)]
    capsys.readouterr()
    assert run_prep([train], tmp_path / "out", "--text-field", "body", "--exclude-overlaps", tmp_path / "decon") == 2
    err = _one_line_error(capsys)
    assert ("decon read the training text from field 'text'; this prep reads field 'body': rerun decon with "
            "--train-text-field body, or prep with --text-field text") in err, err
    assert not (tmp_path / "out" / "manifest.json").exists()
    # the same field: accepted, the planted rows excluded
    assert run_prep([train], tmp_path / "ok", "--text-field", "text", "--exclude-overlaps", tmp_path / "decon") == 0
    assert json.loads((tmp_path / "ok" / "manifest.json").read_text())["rows"]["excluded"] == 3


def test_read_spec_mismatches_name_both_sides_and_the_flags() -> None:
    plain = ReadSpec({"text_field": "text"}, TEXT_NORMALIZATION, DEFAULT_MAX_ROW_BYTES)
    assert read_spec_mismatch(plain, plain) is None
    template = ReadSpec({"text_template": "{q}\n\n{a}"}, TEXT_NORMALIZATION, DEFAULT_MAX_ROW_BYTES)
    assert read_spec_mismatch(template, plain) == (
        "decon read the training text from template '{q}\\\\n\\\\n{a}'; this prep reads field 'text': rerun decon "
        "with --train-text-field text, or prep with --text-template '{q}\\n\\n{a}'")
    old = ReadSpec({"text_field": "text"}, "raw", DEFAULT_MAX_ROW_BYTES)
    assert (f"normalized as 'raw'; this prep normalizes it as {TEXT_NORMALIZATION!r}"
            in str(read_spec_mismatch(old, plain)))
    capped = ReadSpec({"text_field": "text"}, TEXT_NORMALIZATION, 1000)
    assert read_spec_mismatch(capped, plain) == (
        f"decon read training rows of up to 1,000 bytes; this prep reads rows of up to {DEFAULT_MAX_ROW_BYTES:,}: "
        f"rerun decon with --max-row-bytes {DEFAULT_MAX_ROW_BYTES}, or prep with --max-row-bytes 1000")
    # a decon output that records nothing (an older decon): refused, never taken as equal
    with pytest.raises(storage.InputError, match="does not record how decon read the training text.*run the same "
                                                 "decon command again"):
        exclusion.check_read_spec("old", [{"train_path": "t.jsonl", "resolved": "/t.jsonl", "size": 1,
                                           "version": "1"}], plain)


def test_a_row_decon_could_not_read_is_never_kept_by_prep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # before: decon had no --max-row-bytes (a 65 MiB row was unreadable to it and kept by prep); here a
    # contaminated row of 2,000 bytes against decon --max-row-bytes 1000
    evals, train, planted = _planted(tmp_path)
    rows = [json.loads(line) for line in (train / "t.jsonl").read_text().splitlines()]
    rows[30]["text"] = f"{planted[0]} " + "padding " * 250  # ~2,100 bytes, contaminated
    write_jsonl(train / "t.jsonl", rows)
    assert _decon(evals, train, tmp_path / "decon", "--max-row-bytes", 1000) == 0
    unread = [json.loads(line) for line in (tmp_path / "decon" / UNREAD_ROWS).read_text().splitlines()]
    assert unread == [{"train_path": str(train / "t.jsonl"), "train_row": 30,
                       "reason": "row too large: more than 1000 bytes"}]
    capsys.readouterr()
    # prep's own cap is larger: refused, both caps named
    assert run_prep([train], tmp_path / "out", "--exclude-overlaps", tmp_path / "decon") == 2
    err = _one_line_error(capsys)
    assert f"decon read training rows of up to 1,000 bytes; this prep reads rows of up to {DEFAULT_MAX_ROW_BYTES:,}" \
        in err
    # the same cap: the unread row excluded (with the 3 listed), counted
    assert run_prep([train], tmp_path / "ok", "--max-row-bytes", 1000, "--exclude-overlaps", tmp_path / "decon") == 0
    manifest = json.loads((tmp_path / "ok" / "manifest.json").read_text())
    assert manifest["rows"]["excluded"] == 4 and manifest["rows"]["rejected"] == 0
    (run,) = manifest["excluded_overlaps"]["decon_runs"]
    assert (run["listed"], run["unread"]) == (3, 1)
    said = capsys.readouterr()
    assert "and 1 it could not read" in said.out + said.err


def test_many_eval_rows_sharing_an_ngram_keep_the_drop_list_and_its_reading_small(tmp_path: Path) -> None:
    # before: each line listed every instance it overlaps (50,000 eval rows x 600 rows: 263 MB, prep at 2.8 GB)
    common = "the quick brown fox jumps over the lazy dog near the quiet river bank today"
    write_jsonl(tmp_path / "eval" / "ds" / "test.jsonl",
                [{"id": f"e{i}", "text": f"{common} variant {i}"} for i in range(5000)])
    write_jsonl(tmp_path / "train" / "t.jsonl", [{"id": f"d{j}", "text": f"doc {j}: {common}"} for j in range(600)])
    assert _decon(tmp_path / "eval", tmp_path / "train", tmp_path / "decon") == 0
    data = (tmp_path / "decon" / CONTAMINATED_DOCS).read_bytes()
    lines = data.splitlines()
    assert len(lines) == 600 and len(data) / len(lines) < 200, len(data)
    assert json.loads(lines[0]) == {"train_path": str(tmp_path / "train" / "t.jsonl"), "train_row": 0,
                                    "train_doc_id": "d0", "ns": [13],
                                    "max_coverage": [15 / 17]}  # the common 15 of each instance's 17 tokens
    spec = ReadSpec({"text_field": "text"}, TEXT_NORMALIZATION, DEFAULT_MAX_ROW_BYTES)
    tracemalloc.start()
    try:
        ex = exclusion.load_exclusion([str(tmp_path / "decon")], read_spec=spec)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ex.rows == {str((tmp_path / "train" / "t.jsonl").resolve()): frozenset(range(600))}
    assert peak < 1 << 20, peak  # a line at a time and 600 row numbers (the old drop list alone: ~30 MB)


def test_an_old_drop_list_with_instances_is_read_a_line_at_a_time() -> None:
    lines = [json.dumps({"train_path": "/t.jsonl", "train_row": r, "train_doc_id": str(r), "ns": [13],
                         "overlaps": [{"eval_dataset": "ds", "n": 13, "instance_ids": [f"e{i}" for i in range(5000)]}]}
                        ).encode() + b"\n" for r in range(50)]
    files = [{"train_path": "/t.jsonl", "resolved": "/t.jsonl"}]
    tracemalloc.start()
    try:
        rows = drop_rows("d.jsonl", iter(lines), files, 13)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert rows == {"/t.jsonl": set(range(50))}
    assert peak < 4 * len(lines[0]) + (1 << 20), peak  # about one line's objects, not 50


def _swap_rows_keeping_size_and_mtime(path: Path, a: int, b: int) -> None:
    st = path.stat()
    lines = path.read_text().splitlines(keepends=True)
    assert len(lines[a]) == len(lines[b])
    lines[a], lines[b] = lines[b], lines[a]
    path.write_text("".join(lines))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def test_verify_inputs_by_content_refuses_rows_swapped_with_size_and_mtime_kept(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    evals, train, planted = _planted(tmp_path)
    rows = [{"id": f"d{i:02d}", "text": f"row {i:02d} " + "x" * 20} for i in range(12)]
    rows[5]["text"] = f"row 05 {planted[0]}"
    rows[7]["text"] = "row 07 " + "y" * (len(json.dumps(rows[5]["text"])) - 9)  # the same line length
    write_jsonl(train / "t.jsonl", rows)
    assert _decon(evals, train, tmp_path / "decon", "--verify-inputs-by-content") == 0
    files = [json.loads(line) for line in (tmp_path / "decon" / TRAIN_FILES).read_text().splitlines()]
    assert len(files[0]["sha256"]) == 64
    assert _decon(evals, train, tmp_path / "plain") == 0  # without the flag: no sha256 recorded
    _swap_rows_keeping_size_and_mtime(train / "t.jsonl", 5, 7)
    capsys.readouterr()
    # the documented limit: size and mtime match, so the check by size passes and row 7 (now the leak) is kept
    assert run_prep([train], tmp_path / "leaky", "--exclude-overlaps", tmp_path / "decon") == 0
    capsys.readouterr()
    # by content: refused, naming the file
    assert run_prep([train], tmp_path / "out", "--exclude-overlaps", tmp_path / "decon",
                    "--verify-inputs-by-content") == 2
    err = _one_line_error(capsys)
    assert f"{train / 't.jsonl'}: its content is not what the decon run" in err and "run decon again" in err, err
    # a decon output without sha256: refused, saying how to get them
    assert run_prep([train], tmp_path / "out", "--exclude-overlaps", tmp_path / "plain",
                    "--verify-inputs-by-content") == 2
    assert "recorded no sha256" in _one_line_error(capsys)
    # the flag without a drop list is a usage error
    assert run_prep([train], tmp_path / "out", "--verify-inputs-by-content") == 2
    assert "--verify-inputs-by-content needs --exclude-overlaps" in _one_line_error(capsys)
