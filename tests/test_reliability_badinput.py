"""Bad input: every malformed row or unreadable file is rejected with path, row and reason;
the job completes; ``read == accepted + empty + rejected``; a corrupt whole file is reported
as such (never silently skipped); a 50 MB document goes through whole; a hostile row of
gigabytes is rejected as too large with bounded memory."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from helpers import gsm8k_rows, gsm8k_texts, run_prep
from reliability_helpers import refinery_cmd, shard_texts, write_figures
from test_rows_bounded import write_huge_line_zst

from refinery.transforms.decon.ngrams.details import read_details

# (raw line, expected outcome): "accepted", "empty" or a fragment of the reject reason
JSONL_CASES = [
    (b'{"id": "ok0", "text": "hello world"}', "accepted"),
    (b'{"id": "broken", "text": ', "malformed JSON"),
    (b'{"id": "u", "text": "bad \xff utf8"}', "invalid UTF-8"),
    (b'{"id": "nul", "text": "a\\u0000b"}', "accepted"),              # NUL escape: dropped by normalize
    (b'{"id": "nul2", "text": "a\x00b"}', "malformed JSON"),          # raw NUL inside a JSON string
    (b'\x00\x00\x00', "malformed JSON"),
    (b'{"id": "m"}', "missing text field"),
    (b'{"id": "n", "text": null}', "is NoneType"),
    (b'{"id": "i", "text": 42}', "is int"),
    (b'{"id": "l", "text": ["a"]}', "is list"),
    (b'[1, 2]', "row is a JSON list"),
    (b'"just a string"', "row is a JSON str"),
    (b'', "blank line"),
    (b'{"id": "s", "text": "\\ud800 lone surrogate"}', "unpaired surrogates"),
    (b'{"id": "e", "text": "  \\t \\r\\n "}', "empty"),
    (b'{"id": "crlf", "text": "windows line"}\r', "accepted"),
    (b'{"id": "dup", "text": "x", "text": "y"}', "accepted"),
    (b'\xef\xbb\xbf{"id": "bom", "text": "utf-8 bom"}', "malformed JSON"),
    (b'{"id": 1' + b"0" * 5000 + b', "text": "x"}', "number out of range"),  # valid JSON, 5,001 digits
    (b"[" * 100_000, "row nested too deep"),
    (b'{"id": 18446744073709551616, "text": "id beyond 64 bits"}', "accepted"),
    (b'{"id": "ok1", "text": "last"}', "accepted"),
]


def _build(root: Path) -> tuple[int, str]:
    root.mkdir()
    (root / "a.jsonl").write_bytes(b"\n".join(c for c, _ in JSONL_CASES) + b"\n")
    texts = gsm8k_texts(60)
    good = b"".join(json.dumps({"id": f"g{i}", "text": t}).encode() + b"\n" for i, t in enumerate(texts[:30]))
    gz = gzip.compress(good, mtime=0)
    (root / "cut.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    zs = zstandard.ZstdCompressor().compress(good)
    (root / "cut.jsonl.zst").write_bytes(zs[: len(zs) // 2])
    (root / "empty.jsonl").write_bytes(b"")
    (root / "empty.jsonl.gz").write_bytes(gzip.compress(b"", mtime=0))
    (root / "zero-bytes.jsonl.gz").write_bytes(b"")
    (root / "bad.json").write_text('[{"id": "j0", "text": "fine"}, {"id": "j1", "te')
    (root / "notarray.json").write_text('{"text": "an object, not an array"}')
    (root / "corrupt.parquet").write_bytes(os.urandom(3000))
    pq.write_table(pa.table({"id": [f"p{i}" for i in range(30)], "text": texts[30:60]}), root / "whole.parquet",
                   row_group_size=5)
    whole = (root / "whole.parquet").read_bytes()
    (root / "truncated.parquet").write_bytes(whole[: len(whole) // 2])
    (root / "empty.parquet").write_bytes(b"")
    # a 50 MB document (ASCII text, one JSON line)
    base = "\n\n".join(t.encode("ascii", "ignore").decode() for t in gsm8k_texts(400))
    big = (base * (50_000_000 // len(base) + 1))[:50_000_000].strip()
    (root / "big.jsonl").write_text(json.dumps({"id": "big", "text": big}) + "\n")
    return len(good.splitlines()), big


def test_bad_inputs_are_rejected_with_reasons_and_counted(tmp_path: Path) -> None:
    corpus = tmp_path / "bad"
    good_rows, big = _build(corpus)
    out = tmp_path / "out"
    # corrupt or cut-short files fail the run (named), their good rows still written
    assert run_prep([corpus], out, "--num-shards", 2, "--dataset", "bad") == 1
    failed = json.loads((out / "FAILED.json").read_text())  # and no manifest: a failed run never looks finished
    assert not (out / "manifest.json").exists() and " input file(s) corrupt or cut short" in failed["failure"]
    assert run_prep([corpus], out, "--num-shards", 2, "--dataset", "bad", "--max-reject-rate", "0.9") == 0

    m = json.loads((out / "manifest.json").read_text())
    rows = m["rows"]
    assert rows["read"] == rows["accepted"] + rows["empty"] + rows["rejected"] + rows["over_budget"]
    rejects = [json.loads(line) for line in (out / "rejects" / "rejects.jsonl").read_text().splitlines()]
    assert len(rejects) == rows["rejected"]
    assert all(set(r) == {"path", "row", "reason"} and r["reason"] for r in rejects)
    by_file: dict[str, list[dict[str, Any]]] = {}
    for r in rejects:
        by_file.setdefault(os.path.basename(r["path"]), []).append(r)

    # a.jsonl: each row's fate, by row number
    got = {r["row"]: r["reason"] for r in by_file.pop("a.jsonl")}
    for row, (_, expected) in enumerate(JSONL_CASES):
        if expected in ("accepted", "empty"):
            assert row not in got, (row, got.get(row))
        else:
            assert expected in got.get(row, ""), (row, expected, got.get(row))
    # whole files that cannot be read to the end: reported as corrupt, with the row where it broke
    for name in ("cut.jsonl.gz", "cut.jsonl.zst", "bad.json", "notarray.json", "corrupt.parquet",
                 "truncated.parquet", "empty.parquet", "zero-bytes.jsonl.gz"):
        if name == "zero-bytes.jsonl.gz" and name not in by_file:
            continue  # an empty gzip stream is an empty file, not a corrupt one
        [r] = by_file.pop(name)
        assert r["reason"].startswith("corrupt file"), r
    assert by_file == {}
    corrupt = {os.path.basename(c["path"]) for c in m["corrupt_files"]}
    assert corrupt == {os.path.basename(r["path"]) for r in rejects if r["reason"].startswith("corrupt file")}
    assert corrupt == {os.path.basename(c["path"]) for c in failed["corrupt_files"]}
    cut_rows = [r for r in rejects if r["path"].endswith("cut.jsonl.gz")]
    assert 0 < cut_rows[0]["row"] < good_rows  # the rows before the cut were kept

    texts = shard_texts(out)
    assert texts[big] == 1  # the 50 MB document, whole
    assert texts["hello world"] == 1 and texts["ab"] == 1 and texts["windows line"] == 1
    assert sum(texts.values()) == m["total_documents"] == rows["accepted"]
    write_figures("bad_input", {"bad_inputs": len([c for c in JSONL_CASES if c[1] not in ("accepted",)]) + 9,
                                "rows_read": rows["read"], "rejected": rows["rejected"], "empty": rows["empty"],
                                "accepted": rows["accepted"]})


# --- hostile or huge input: bounded memory -------------------------------------------

GIB = 1 << 30
MEASURE_RSS = """
import resource, subprocess, sys
rc = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL)
print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""


def _write_huge_json_zst(path: Path, element_bytes: int) -> None:
    """``[{"id": "j0", ...}, {"id": "huge", "text": "aaa..."} (element_bytes), {"id": "j2", ...}]``, streamed."""
    with open(path, "wb") as raw, zstandard.ZstdCompressor(level=3).stream_writer(raw) as w:
        w.write(b'[{"id": "j0", "text": "json element before"},\n{"id": "huge", "text": "')
        piece = b"a" * (1 << 20)
        for _ in range(element_bytes >> 20):
            w.write(piece)
        w.write(b'"},\n{"id": "j2", "text": "json element after"}]\n')


def test_hostile_huge_rows_are_rejected_with_bounded_memory(tmp_path: Path) -> None:
    """A 40 KB .jsonl.zst whose one line decompresses to 1.2 GB, a .json.zst array with a
    1.2 GB element and a parquet file with a 200 MB text value: prep exits 0, keeps every other
    row (before and after the huge ones), rejects each huge row as too large with its path
    and row, and its peak RSS (driver and workers) stays under 1.5 GiB. The 1.2 GB line alone,
    by hand (from tests/)::

        python -c 'from test_rows_bounded import *; write_huge_line_zst("/tmp/h/huge.jsonl.zst", 1_200_000_000)'
        /usr/bin/time -v refinery prep --input /tmp/h --output /tmp/h-out --runner direct
    """
    corpus = tmp_path / "hostile"
    corpus.mkdir()
    before = b"".join(json.dumps({"id": f"b{i}", "text": f"line {i} before"}).encode() + b"\n" for i in range(3))
    after = b"".join(json.dumps({"id": f"a{i}", "text": f"line {i} after"}).encode() + b"\n" for i in range(3))
    write_huge_line_zst(corpus / "huge.jsonl.zst", 1_200_000_000, before, after)
    assert (corpus / "huge.jsonl.zst").stat().st_size < 100_000
    _write_huge_json_zst(corpus / "huge.json.zst", 1_200_000_000)
    pq.write_table(pa.table({"id": ["p0", "p1", "p2", "p3"],
                             "text": ["parquet row 0", "b" * 200_000_000, "parquet row 2", "parquet row 3"]}),
                   corpus / "huge.parquet", row_group_size=2)
    out = tmp_path / "out"
    cmd = refinery_cmd("prep", "--input", corpus, "--output", out, "--dataset", "hostile", "--num-shards", 2,
                       "--runner", "direct", "--no-progress")
    rc, peak = subprocess.run([sys.executable, "-c", MEASURE_RSS, *cmd], capture_output=True, text=True,
                              check=True).stdout.split()
    assert rc == "0"
    assert int(peak) < 1.5 * GIB, f"peak RSS {int(peak) / GIB:.2f} GiB"

    rejects = [json.loads(line) for line in (out / "rejects" / "rejects.jsonl").read_text().splitlines()]
    too_large = f"row too large: more than {64 << 20} bytes"
    assert sorted((os.path.basename(r["path"]), r["row"], r["reason"]) for r in rejects) == [
        ("huge.json.zst", 1, too_large), ("huge.jsonl.zst", 3, too_large), ("huge.parquet", 1, too_large)]
    texts = shard_texts(out)
    assert set(texts) == {*(f"line {i} before" for i in range(3)), *(f"line {i} after" for i in range(3)),
                          "json element before", "json element after", "parquet row 0", "parquet row 2",
                          "parquet row 3"}
    m = json.loads((out / "manifest.json").read_text())
    assert m["rows"]["read"] == 7 + 3 + 4 and m["rows"]["rejected"] == 3
    write_figures("hostile_input", {"peak_rss_bytes": int(peak), "huge_row_bytes": 1_200_000_000,
                                    "rows_read": m["rows"]["read"], "rejected": m["rows"]["rejected"]})


# --- the same bad input given to decon and generate ------------------------------------

HUGE_LINE = 70_000_000  # over the default 64 MiB row cap


def _bad_in_a_jsonl(takes_surrogates: bool) -> int:
    """How many JSONL_CASES rows are bad for decon or generate: no JSON object or no string text.
    decon takes text with unpaired surrogates (prep rejects it, and generate's prompt cannot hold it)."""
    good = {"accepted", "empty", "unpaired surrogates"} if takes_surrogates else {"accepted", "empty"}
    return sum(expected not in good for _, expected in JSONL_CASES)


def _write_bad_files(root: Path, good: list[dict[str, Any]]) -> dict[str, int]:
    """Every kind of bad row and damaged file of the prep matrix, plus ``good`` rows in the
    readable files; returns the number of bad rows per file, but for ``a.jsonl`` (the
    JSONL_CASES rows: see :func:`_bad_in_a_jsonl`)."""
    root.mkdir(parents=True)
    lines = [json.dumps(r).encode() for r in good[:2]] + [c for c, _ in JSONL_CASES] + [json.dumps(good[2]).encode()]
    (root / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    body = b"".join(json.dumps(r).encode() + b"\n" for r in good[3:] * 20)
    gz, zs = gzip.compress(body, mtime=0), zstandard.ZstdCompressor().compress(body)
    (root / "cut.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    (root / "cut.jsonl.zst").write_bytes(zs[: len(zs) // 2])
    (root / "bad.json").write_text(json.dumps(good[:1])[:-1] + ', {"id": "j1", "te')
    (root / "notarray.json").write_text('{"text": "an object, not an array"}')
    (root / "corrupt.parquet").write_bytes(os.urandom(3000))
    buf = pa.BufferOutputStream()
    pq.write_table(pa.table({"id": [r["id"] for r in good], "text": [r["text"] for r in good]}), buf,
                   row_group_size=2)
    whole = buf.getvalue().to_pybytes()
    (root / "truncated.parquet").write_bytes(whole[: len(whole) // 2])
    (root / "empty.jsonl").write_bytes(b"")
    write_huge_line_zst(root / "huge.jsonl.zst", HUGE_LINE, json.dumps(good[0]).encode() + b"\n",
                        json.dumps(good[1]).encode() + b"\n")
    return {"a.jsonl": 0, "cut.jsonl.gz": 1, "cut.jsonl.zst": 1,
            "bad.json": 1, "notarray.json": 1, "corrupt.parquet": 1, "truncated.parquet": 1, "empty.jsonl": 0,
            "huge.jsonl.zst": 1}


def test_decon_bad_eval_and_training_rows_are_counted(tmp_path: Path) -> None:
    """decon on eval and training folders holding the matrix: the run completes (and fails on its
    corrupt training files, naming them), bad eval rows
    are counted in ``stats/eval_summary.jsonl`` ``num_bad_rows``, bad training rows in the scan
    units' stats, and overlaps are still found in the good rows, at their right row numbers
    (also right after a 70 MB line rejected as too large)."""
    from refinery.beam_pipelines import decon

    questions = [r["question"] for r in gsm8k_rows("test")[:8]]
    ev = tmp_path / "eval" / "gsm8k"
    eval_bad = _write_bad_files(ev, [{"id": f"q{i}", "text": q} for i, q in enumerate(questions)])
    tr = tmp_path / "train"
    train_bad = _write_bad_files(tr, [{"id": f"t{i}", "text": f"Training notes {i}. {q} End."}
                                      for i, q in enumerate(questions)])
    out = tmp_path / "out"
    args = decon.build_parser().parse_args(["--eval", str(ev), "--train", str(tr), "--output", str(out),
                                            "--ngrams", "8", "--partitions", "2", "--no-progress"])
    # the corrupt training files fail the run, by name, as prep fails (its counts are written all the same)
    assert decon.run(args, ["--runner=DirectRunner", "--direct_running_mode=in_memory"]) == 1
    failed = json.loads((out / "FAILED.json").read_text())
    assert {os.path.basename(c["path"]) for c in failed["corrupt_files"]} >= {"cut.jsonl.gz", "cut.jsonl.zst"}

    [summary] = [json.loads(line) for line in (out / "stats" / "eval_summary.jsonl").read_text().splitlines()]
    assert summary["eval_dataset"] == "gsm8k"
    assert summary["num_bad_rows"] == sum(eval_bad.values()) + _bad_in_a_jsonl(takes_surrogates=True)
    receipts = list((out / ".refinery" / "scan").glob("*/receipts/*.json"))
    stats = [json.loads(p.read_text())["stats"] for p in receipts]
    assert sum(s["bad_rows"] for s in stats) == sum(train_bad.values()) + _bad_in_a_jsonl(takes_surrogates=True)
    found = {(os.path.basename(d["train_path"]), d["train_row"], d["instance_id"]) for d in read_details(str(out))}
    assert {("a.jsonl", 0, "q0"), ("a.jsonl", 1, "q1"), ("a.jsonl", 2 + len(JSONL_CASES), "q2"),
            ("huge.jsonl.zst", 0, "q0"), ("huge.jsonl.zst", 2, "q1"), ("bad.json", 0, "q0")} <= found
    assert not {f for f, _, _ in found} - {"a.jsonl", "huge.jsonl.zst", "bad.json", "cut.jsonl.gz", "cut.jsonl.zst"}


def test_generate_bad_rows_become_error_rows(tmp_path: Path) -> None:
    """generate on the matrix: every row of every file gives one row of ``generations.jsonl``;
    a bad row (or damaged file, or too-large row) an error row with its reason, never a crash."""
    pytest.importorskip("torch", reason="the inference extra (torch) is not installed")
    from engine_fixtures import write_harmony_checkpoint

    from refinery.transforms.io import rows

    ckpt = write_harmony_checkpoint(tmp_path / "ckpt", num_hidden_layers=1)
    inp = tmp_path / "in"
    bad = _write_bad_files(inp, [{"id": f"g{i}", "text": t} for i, t in enumerate(gsm8k_texts(4))])
    out = tmp_path / "out"
    cmd = refinery_cmd("generate", "--checkpoint", ckpt, "--input", inp, "--output", out, "--max-tokens", 4,
                       "--dtype", "float32", "--device", "cpu", "--max-seq-len", 256, "--max-batch", 8,
                       "--docs-per-unit", 40, "--runner", "direct", "--no-progress")
    run = subprocess.run(cmd, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]

    got = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert len(got) == sum(1 for f in bad for _ in rows.iter_rows(str(inp / f)))  # one per row read
    errors = [r for r in got if "error" in r]
    assert len(errors) == sum(bad.values()) + _bad_in_a_jsonl(takes_surrogates=False)
    assert all(set(r) == {"id", "error"} and r["error"].startswith(f"{inp}/") for r in errors)  # path:line: reason
    reasons = " | ".join(r["error"] for r in errors)
    for fragment in ("malformed JSON", "invalid UTF-8", "row is a JSON list", "blank line", "missing or not a string",
                     "corrupt file after", f"row too large: more than {64 << 20} bytes"):
        assert fragment in reasons, fragment
    assert {r["id"] for r in got if "error" not in r} >= {"g0", "g1", "g2"}
