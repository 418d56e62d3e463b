"""A failed run never looks finished (issue 58 item 2). Before: with a truncated .jsonl.gz, prep
exited 1 but wrote manifest.json, `verify --checksums` printed OK and decon over the same
folder exited 0 with a .SUCCESS that `prep --exclude-overlaps` took. Now the failed run leaves
FAILED.json and no finish marker, and every reader of a finished run refuses it, naming the
corrupt files."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from helpers import gsm8k_texts, run_prep, write_jsonl

from refinery.beam_pipelines.cli import main
from refinery.transforms.formats.failed_run import FailedRunError
from refinery.transforms.loader.deterministic import prep_output_loader


def _corpus(root: Path) -> list[Path]:
    """A good file, and a .jsonl.gz, a .jsonl.zst and a .parquet each cut in half: the damaged files."""
    texts = gsm8k_texts(120)
    write_jsonl(root / "good.jsonl", [{"id": f"g{i}", "text": t} for i, t in enumerate(texts[:40])])
    body = "".join(json.dumps({"id": f"c{i}", "text": t}) + "\n" for i, t in enumerate(texts[40:80])).encode()
    gz, zs = gzip.compress(body, mtime=0), zstandard.ZstdCompressor().compress(body)
    (root / "cut.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    (root / "cut.jsonl.zst").write_bytes(zs[: len(zs) // 2])
    buf = pa.BufferOutputStream()
    pq.write_table(pa.table({"id": [f"p{i}" for i in range(40)], "text": texts[80:]}), buf, row_group_size=5)
    whole = buf.getvalue().to_pybytes()
    (root / "cut.parquet").write_bytes(whole[: len(whole) // 2])
    return [root / name for name in ("cut.jsonl.gz", "cut.jsonl.zst", "cut.parquet")]


def _said(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    return captured.out + captured.err


def test_a_failed_prep_is_refused_by_verify_info_and_the_loader(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cut = _corpus(tmp_path / "in")
    out = tmp_path / "out"
    assert run_prep([tmp_path / "in"], out, "--num-shards", 2) == 1
    assert "refinery prep: 3 input file(s) corrupt or cut short" in _said(capsys)
    assert not (out / "manifest.json").exists()
    failed = json.loads((out / "FAILED.json").read_text())
    assert failed["command"] == "prep" and [c["path"] for c in failed["corrupt_files"]] == sorted(map(str, cut))
    assert all(c["reason"].startswith("corrupt file") for c in failed["corrupt_files"])
    for given in (out, out / "manifest.json"):
        assert main(["verify", str(given), "--checksums"]) == 1
        said = _said(capsys)
        assert f"BAD  {out}: the refinery prep run failed ({out / 'FAILED.json'})" in said and "OK " not in said
        assert all(str(c) in said for c in cut)
        assert main(["info", str(given)]) == 2
        assert f"refinery info: {out}: the refinery prep run failed" in _said(capsys)
        with pytest.raises(FailedRunError, match=f"{out}: the refinery prep run failed .*corrupt input file"):
            prep_output_loader(str(given), seq_len=8)
    assert main(["status", str(out)]) == 0
    assert f"FAILED {out}: the refinery prep run failed" in capsys.readouterr().out
    assert run_prep([tmp_path / "in"], out, "--num-shards", 2) == 1  # the same command: the same verdict
    assert not (out / "manifest.json").exists() and (out / "FAILED.json").exists()
    capsys.readouterr()
    assert run_prep([tmp_path / "in"], out, "--num-shards", 2, "--max-reject-rate", "0.5") == 0  # let through
    assert "WARNING refinery prep: " + str(cut[0]) in _said(capsys)
    assert not (out / "FAILED.json").exists() and (out / "manifest.json").exists()
    assert main(["verify", str(out), "--checksums"]) == 0
    prep_output_loader(str(out), seq_len=8)


def test_decon_fails_on_a_corrupt_training_file_and_its_drop_list_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cut = _corpus(tmp_path / "train")
    evals = write_jsonl(tmp_path / "eval" / "test.jsonl", [{"id": "t0", "text": gsm8k_texts(1)[0]}])
    dec = tmp_path / "decon"
    argv = ["decon", "--eval", str(evals), "--train", str(tmp_path / "train"), "--output", str(dec), "--ngrams", "13",
            "--runner", "direct", "--no-progress"]
    assert main(argv) == 1
    said = _said(capsys)
    assert f"refinery decon: 3 input file(s) corrupt or cut short: {cut[0]}: corrupt file after " in said
    assert f"listed in {dec / 'stats' / 'unread_train_rows.jsonl'}" in said and "decon failed after" in said
    assert not (dec / ".SUCCESS").exists()
    unread = [json.loads(line) for line in (dec / "stats" / "unread_train_rows.jsonl").read_text().splitlines()]
    assert sorted(r["train_path"] for r in unread if r["reason"].startswith("corrupt file")) == sorted(map(str, cut))
    assert [c["path"] for c in json.loads((dec / "FAILED.json").read_text())["corrupt_files"]] == sorted(map(str, cut))
    assert run_prep([tmp_path / "train"], tmp_path / "clean", "--exclude-overlaps", dec,
                    "--max-reject-rate", "0.5") == 2
    assert f"refinery prep: --exclude-overlaps {dec}: the refinery decon run failed" in _said(capsys)
    assert main(["verify", str(dec)]) == 1
    assert f"BAD  {dec}: the refinery decon run failed" in _said(capsys)
    assert main([*argv, "--max-reject-rate", "0.5"]) == 0  # let through: named, and a finished run
    assert f"WARNING refinery decon: {cut[0]}: corrupt file after" in _said(capsys)
    assert (dec / ".SUCCESS").exists() and not (dec / "FAILED.json").exists()
    assert run_prep([tmp_path / "train"], tmp_path / "clean", "--exclude-overlaps", dec,
                    "--max-reject-rate", "0.5") == 0
