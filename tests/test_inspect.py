"""`refinery inspect` on clean shards (from real prep) and deliberately broken ones."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import run_prep

from refinery.beam_pipelines.cli import main
from refinery.transforms.formats import shards
from refinery.transforms.formats.inspect import ShardRef, inspect_shard

EOS = 199999


def _write(npy: Path, tokens: list[int], lengths: list[int]) -> ShardRef:
    npy.parent.mkdir(parents=True, exist_ok=True)
    np.save(npy, np.asarray(tokens, dtype="<u4"))
    with open(npy.with_suffix(".idx"), "wb") as f:
        shards.write_idx(f, lengths)
    return ShardRef(str(npy), str(npy.with_suffix(".idx")))


def test_clean_prep_output_passes_with_stats_histogram_and_sample(
        tmp_path: Path, small_corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert run_prep(small_corpus, out, "--num-shards", "2") == 0
    m = json.loads((out / "manifest.json").read_text())
    png = tmp_path / "hist" / "lengths.png"
    rc = main(["inspect", "--manifest", str(out / "manifest.json"), "--all", "--stats", "--histogram", str(png),
               "--sample", "12", "-v"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert text.count("OK  ") == 2 and "BAD" not in text
    assert f"total: {m['total_tokens']:,} tokens, {m['total_documents']:,} EOS, {m['total_documents']:,} documents" \
        in text
    assert "vocab coverage" in text and "doc length: min" in text
    assert "decoded: '" in text  # --sample decodes with the o200k tokenizer
    # the PNG is a real image of the configured size
    from PIL import Image
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as im:
        assert im.size == (800, 450)
        assert len(np.unique(np.asarray(im.convert("L")))) > 2  # not a blank canvas
    # --data-dir finds the same shards through **/*.npy (skipping .refinery)
    assert main(["inspect", "--data-dir", str(out), "--eos-token-id", str(EOS), "--num-shards", "5"]) == 0
    said = capsys.readouterr().out
    assert "inspecting 2 of 2 shard(s)" in said and "only the first" not in said
    # without --all, the output says that shards were left out: an OK over one shard is not an OK over all
    assert main(["inspect", "--manifest", str(out / "manifest.json")]) == 0
    assert "note: only the first 1 of 2 shard(s) were inspected; the other 1 were not (--all" \
        in capsys.readouterr().out


def test_double_eos_and_empty_documents_are_issues(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a document emptied by a preprocessing bug: EOS EOS, recorded in the idx as a 1-token document
    ref = _write(tmp_path / "d" / "shard_0000" / "x-v1-shard-000000.npy",
                 [5, 6, EOS, EOS, 7, EOS], [3, 1, 2])
    r = inspect_shard(ref, EOS, 201088)
    assert r.double_eos == 1 and r.double_eos_positions == [3]
    assert r.empty_docs == 1 and r.empty_doc_indices == [1]
    assert any("double EOS" in i for i in r.issues) and any("empty document" in i for i in r.issues)
    assert main(["inspect", "--data-dir", str(tmp_path / "d"), "--eos-token-id", str(EOS), "-v"]) == 1
    out = capsys.readouterr().out
    assert "BAD" in out and "1 double EOS" in out and "double EOS at token(s) [3]" in out


def test_idx_npy_mismatch_out_of_vocab_and_unterminated_tail(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # ShardWriter-style bug: EOS appended twice, but the idx written from the clean lengths
    ref = _write(tmp_path / "m" / "a.npy", [5, EOS, EOS, 6, 7, EOS], [2, 3])
    r = inspect_shard(ref, EOS)
    assert r.double_eos == 1
    assert any("not contiguous" in i or "EOS positions do not match" in i for i in r.issues), r.issues
    ref2 = _write(tmp_path / "v" / "b.npy", [5, 300000, EOS, 9, 9], [3])
    r2 = inspect_shard(ref2, EOS, vocab_size=201088)
    assert r2.out_of_vocab == 1
    assert any("follow no EOS" in i and "last 2 token(s)" in i for i in r2.issues), r2.issues
    # a clean hand-made shard has no issue at all, also scanned in tiny chunks (chunk edges)
    ref3 = _write(tmp_path / "c" / "c.npy", [1, EOS, 2, 3, EOS, 4, EOS], [2, 3, 2])
    r3 = inspect_shard(ref3, EOS, 201088, stats=True, chunk=2)
    assert r3.issues == [] and r3.num_eos == 3 and r3.num_docs == 3 and r3.stats is not None
    assert r3.stats["doc_length"]["max"] == 3 and r3.stats["distinct_tokens"] == 5
    assert r3.stats["top_tokens"][0] == (EOS, 3)
    r4 = inspect_shard(_write(tmp_path / "c2" / "c.npy", [1, EOS, EOS, 4, EOS], [2, 1, 2]), EOS, chunk=2)
    assert r4.double_eos == 1 and r4.double_eos_positions == [2]  # found across a chunk edge
    assert main(["inspect", "--data-dir", str(tmp_path / "m"), "--eos-token-id", str(EOS)]) == 1
    assert main(["inspect", "--data-dir", str(tmp_path / "nothing"), "--eos-token-id", str(EOS)]) == 1
    assert "no shards found" in capsys.readouterr().err


def test_manifest_counts_are_checked(tmp_path: Path, small_corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert run_prep(small_corpus, out, "--num-shards", "1") == 0
    mpath = out / "manifest.json"
    m = json.loads(mpath.read_text())
    m["shards"][0]["num_documents"] += 1
    mpath.write_text(json.dumps(m))
    assert main(["inspect", "--manifest", str(mpath)]) == 1
    assert "manifest says" in capsys.readouterr().out
