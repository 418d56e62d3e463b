"""prep end to end on DirectRunner (and once on PortableRunner): formats, determinism, resume."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from helpers import gsm8k_texts, run_prep, tree_digest, write_jsonl

from refinery.beam_pipelines.cli import main
from refinery.transforms.formats import shards
from refinery.transforms.formats.tiktoken_vocab import get_encoding
from refinery.transforms.io import rows, storage
from refinery.transforms.io.text import normalize_text
from refinery.transforms.prep.documents import shard_of

EOS = 199999


def load_docs(out: Path) -> dict[int, list[npt.NDArray[np.uint32]]]:
    manifest = json.loads((out / "manifest.json").read_text())
    docs: dict[int, list[npt.NDArray[np.uint32]]] = {}
    for s in manifest["shards"]:
        tokens = np.load(out / s["path"])
        bounds = shards.read_idx(str(out / s["index_path"]))
        docs[s["shard"]] = [tokens[a:b] for a, b in bounds]
    return docs


def expected_docs(corpus_root: Path, text_field: str = "text", id_field: str = "id") -> list[tuple[str, str]]:
    """(doc_id, normalized text) of every accepted row, straight from the inputs, in input order."""
    out = []
    for f in storage.expand_inputs([str(corpus_root)]):
        for row, rec, err in rows.iter_rows(f.path):
            if err or rec is None or not isinstance(rec.get(text_field), str):
                continue
            text = normalize_text(rec[text_field])
            if text:
                doc_id = str(rec[id_field]) if rec.get(id_field) is not None else f"{f.relpath}:{row}"
                out.append((doc_id, text))
    return out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One prep run over the multi-format corpus, shared by the read-only checks below."""
    root = tmp_path_factory.mktemp("prepared")
    corpus_root = _make_corpus(root)
    out = root / "out"
    assert run_prep([corpus_root], out, "--num-shards", 3, "--dataset", "gsm") == 0
    return corpus_root, out


def _make_corpus(root: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    c = root / "corpus"
    texts = gsm8k_texts(200)
    write_jsonl(c / "a.jsonl", [{"id": f"a{i}", "text": t} for i, t in enumerate(texts[:50])],
                raw_lines={5: '{"id": "broken", "text": ', 9: "[1]"})
    write_jsonl(c / "b.jsonl.gz", [{"text": t + "\r\nwith CRLF\x00"} for t in texts[50:90]] + [{"text": " \t "}])
    write_jsonl(c / "c.jsonl.zst",
                [{"id": i, "text": t} for i, t in enumerate(texts[90:120])] + [{"id": "s", "text": 5}])
    (c / "d.json").write_text(json.dumps([{"id": f"d{i}", "text": t} for i, t in enumerate(texts[120:140])]
                                         + [{"id": "special", "text": "x <|endoftext|> y <|return|>"}]))
    pq.write_table(pa.table({"id": [f"p{i}" for i in range(60)], "text": texts[140:200]}), c / "e.parquet",
                   row_group_size=5)
    return c


def test_round_trip_and_assignment(prepared: tuple[Path, Path]) -> None:
    corpus_root, out = prepared
    enc = get_encoding()
    want = expected_docs(corpus_root)
    docs = load_docs(out)
    # every document exactly once, in its md5 shard, in input order, decoding to its normalized text
    for shard, shard_docs in docs.items():
        mine = [(i, t) for i, t in want if shard_of(i, 3) == shard]
        assert len(mine) == len(shard_docs)
        for (doc_id, text), toks in zip(mine, shard_docs):
            assert toks[-1] == EOS and EOS not in toks[:-1]
            assert enc.decode(toks[:-1].tolist()) == text, doc_id
    assert sum(len(d) for d in docs.values()) == len(want)


def test_formats_and_manifest(prepared: tuple[Path, Path]) -> None:
    _, out = prepared
    m = json.loads((out / "manifest.json").read_text())
    assert m["tokenizer"] == "o200k_harmony" and m["eos_token_id"] == EOS and m["dtype"] == "uint32"
    assert m["vocab_sha256"].startswith("446a9538") and m["vocab_size"] == 201088
    assert m["num_shards"] == 3 and len(m["shards"]) == 3
    # 6 bad rows: broken JSON, a list, blank text (empty), non-string text; parquet/json fine
    assert m["rows"] == {"read": 205, "accepted": 201, "empty": 1, "rejected": 3, "over_budget": 0}
    assert m["total_documents"] == 201
    for s in m["shards"]:
        npy, idx = out / s["path"], out / s["index_path"]
        assert s["path"] == f"shard_{s['shard']:04d}/gsm-v1-shard-{s['shard']:06d}.npy"
        arr = np.load(npy)
        assert arr.dtype == np.dtype("<u4") and arr.ndim == 1 and len(arr) == s["num_tokens"]
        raw = idx.read_bytes()
        magic, version, ndocs, reserved = struct.unpack_from("<8sQQQ", raw)
        assert (magic, version, ndocs, reserved) == (b"NMOEIDX\x00", 1, s["num_documents"], 0)
        assert shards.idx_bytes(shards.eos_document_lengths(arr, EOS)[0]) == raw  # regenerable byte for byte
        assert storage.sha256_file(str(npy)) == s["sha256"] and storage.sha256_file(str(idx)) == s["index_sha256"]
    # nothing else under OUTPUT ends in .npy/.idx (hidden folders included)
    stray = [p for p in out.rglob("*") if p.suffix in (".npy", ".idx") and not p.parent.name.startswith("shard_")]
    assert stray == []
    rejects = [json.loads(line) for line in (out / "rejects/rejects.jsonl").read_text().splitlines()]
    assert sorted((os.path.basename(r["path"]), r["row"]) for r in rejects) == [
        ("a.jsonl", 5), ("a.jsonl", 9), ("c.jsonl.zst", 30)]
    assert all(r["reason"] for r in rejects)


def test_verify_info_status_cli(prepared: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    _, out = prepared
    assert main(["verify", str(out / "manifest.json"), "--checksums"]) == 0
    assert main(["info", str(out / "manifest.json")]) == 0
    assert main(["status", str(out)]) == 0
    text = capsys.readouterr().out
    assert "OK" in text and "total_tokens" in text
    assert "tokenize" in text and "manifest" in text


def test_info_reads_as_text_and_version(prepared: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    from refinery.beam_pipelines.info import readable

    _, out = prepared
    m = json.loads((out / "manifest.json").read_text())
    assert main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "{" not in text and "None" not in text  # no raw Python values
    lines = dict(readable(m))
    assert lines["total_tokens"] == f"{m['total_tokens']:,}" and "," in lines["total_tokens"]
    assert lines["eos_token_id"] == str(m["eos_token_id"])  # an id, not a count
    r = m["rows"]
    assert lines["rows"] == (f"read {r['read']:,} = accepted {r['accepted']:,} + empty {r['empty']:,} + "
                             f"rejected {r['rejected']:,}")
    assert lines["max_tokens"] == "no budget"
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("refinery 0.1.0 (apache-beam ")


def test_rerun_skips_everything(prepared: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    corpus_root, out = prepared
    before = {p: (p.stat().st_mtime_ns, p.stat().st_ino) for p in out.rglob("*") if p.is_file()
              and "run.json" not in p.name}
    assert run_prep([corpus_root], out, "--num-shards", 3, "--dataset", "gsm") == 0
    assert "nothing (all units already done)" in capsys.readouterr().out
    after = {p: (p.stat().st_mtime_ns, p.stat().st_ino) for p in out.rglob("*") if p.is_file()
             and "run.json" not in p.name}
    assert before == after  # no file rewritten


def test_determinism_across_workers_and_repair(small_corpus: Path, tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    assert run_prep([small_corpus], one, "--num-shards", 4, "--dataset", "s") == 0
    assert run_prep([small_corpus], two, "--num-shards", 4, "--dataset", "s", "--workers", 2, runner="local") == 0
    assert tree_digest(one) == tree_digest(two)
    reference = tree_digest(one)

    # deleted shard, truncated index, deleted manifest: regenerated byte-identically
    npy = next(one.glob("shard_0001/*.npy"))
    npy.unlink()
    idx = next(one.glob("shard_0002/*.idx"))
    idx.write_bytes(idx.read_bytes()[:40])
    (one / "manifest.json").unlink()
    assert main(["verify", str(two / "manifest.json")]) == 0
    assert run_prep([small_corpus], one, "--num-shards", 4, "--dataset", "s") == 0
    assert tree_digest(one) == reference

    # intermediate parts deleted after a finished run: nothing needs them, nothing reruns
    storage.remove_tree(str(one / ".refinery" / "tokenize"))
    npy_mtime = next(one.glob("shard_0000/*.npy")).stat().st_mtime_ns
    assert run_prep([small_corpus], one, "--num-shards", 4, "--dataset", "s") == 0
    assert next(one.glob("shard_0000/*.npy")).stat().st_mtime_ns == npy_mtime


def _stage_hashes(out: Path) -> dict[str, str]:
    return {s["name"]: s["stage_hash"] for s in json.loads((out / ".refinery/run.json").read_text())["stages"]}


def test_config_change_semantics(small_corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_prep([small_corpus], out, "--num-shards", 2, "--dataset", "first") == 0
    h1 = _stage_hashes(out)
    spill_mtimes = {p: p.stat().st_mtime_ns for p in out.glob(".refinery/tokenize/*/parts/*")}

    # a later-stage change (dataset name): tokenize receipts stay valid and are reused
    assert run_prep([small_corpus], out, "--num-shards", 2, "--dataset", "second") == 0
    h2 = _stage_hashes(out)
    assert h2["tokenize"] == h1["tokenize"] and h2["pack"] != h1["pack"]
    assert {p: p.stat().st_mtime_ns for p in out.glob(".refinery/tokenize/*/parts/*")} == spill_mtimes
    names = sorted(p.name for p in out.glob("shard_*/*"))
    assert names == ["second-v1-shard-000000.docs.parquet", "second-v1-shard-000000.idx", "second-v1-shard-000000.npy",
                     "second-v1-shard-000001.docs.parquet", "second-v1-shard-000001.idx",
                     "second-v1-shard-000001.npy"]  # old names removed
    assert main(["verify", str(out / "manifest.json"), "--checksums"]) == 0

    # an earlier-stage change (num_shards) invalidates everything after it
    assert run_prep([small_corpus], out, "--num-shards", 3, "--dataset", "second") == 0
    h3 = _stage_hashes(out)
    assert all(h3[k] != h2[k] for k in ("tokenize", "pack", "manifest"))
    assert len(list(out.glob("shard_*/*.npy"))) == 3
    assert main(["verify", str(out / "manifest.json"), "--checksums"]) == 0

    # an input edited under a finished run changes the plan
    f = small_corpus / "y.jsonl"
    f.write_text(f.read_text() + json.dumps({"text": "one more document"}) + "\n")
    assert run_prep([small_corpus], out, "--num-shards", 3, "--dataset", "second") == 0
    h4 = _stage_hashes(out)
    assert h4["tokenize"] != h3["tokenize"]
    assert json.loads((out / "manifest.json").read_text())["total_documents"] == 71


def test_max_tokens_keeps_input_order_prefix(tmp_path: Path) -> None:
    root = tmp_path / "c"
    texts = gsm8k_texts(120)
    for k in range(6):  # 6 files of 20 docs: 6 tokenize units
        rows = [{"id": f"{k}-{i}", "text": t} for i, t in enumerate(texts[k * 20:(k + 1) * 20])]
        write_jsonl(root / f"f{k}.jsonl", rows)
    enc = get_encoding()
    lengths = [len(enc.encode_ordinary(normalize_text(t))) + 1 for t in texts]
    budget = sum(lengths[:33]) + 5  # inside the second file
    out = tmp_path / "out"
    assert run_prep([root], out, "--num-shards", 2, "--max-tokens", budget, "--workers", 1, "--unit-mb", 0) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["total_documents"] == 33 and m["total_tokens"] == sum(lengths[:33])
    assert m["rows"]["over_budget"] == 7 and m["rows"]["read"] == 40  # read only 2 of 6 files
    run = json.loads((out / ".refinery/run.json").read_text())
    tokenize_hash = run["stages"][0]["stage_hash"]
    assert len(list(out.glob(f".refinery/tokenize/{tokenize_hash}/receipts/*.json"))) == 2
    kept = {enc.decode(d[:-1].tolist()) for ds in load_docs(out).values() for d in ds}
    assert kept == {normalize_text(t) for t in texts[:33]}


def test_bad_arguments_are_explained(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prep", "--input", str(tmp_path / "nope"), "--output", str(tmp_path / "o"), "--no-progress"]) == 2
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["prep", "--help"])
    assert "--max-tokens" in capsys.readouterr().out


def test_verify_names_each_problem(small_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert run_prep([small_corpus], out, "--num-shards", 3, "--dataset", "v") == 0
    npy0 = next(out.glob("shard_0000/*.npy"))
    raw = bytearray(npy0.read_bytes())
    raw[-3] ^= 0xFF
    npy0.write_bytes(bytes(raw))
    next(out.glob("shard_0001/*.idx")).unlink()
    (out / "shard_0002" / f".x.npy.tmp-otherhost-123-{'ab' * 16}").write_bytes(b"")
    capsys.readouterr()
    assert main(["verify", str(out / "manifest.json"), "--checksums"]) == 1
    text = capsys.readouterr().out
    assert "shard_0000" in text and "sha256" in text
    assert "shard_0001" in text and "missing" in text
    assert ".tmp-" in text
    # --verify-checksums repairs exactly the damaged shards
    other = {p: p.stat().st_mtime_ns for p in out.glob("shard_0002/*.npy")}
    assert run_prep([small_corpus], out, "--num-shards", 3, "--dataset", "v", "--verify-checksums") == 0
    assert {p: p.stat().st_mtime_ns for p in out.glob("shard_0002/*.npy")} == other
    (out / "shard_0002" / f".x.npy.tmp-otherhost-123-{'ab' * 16}").unlink()
    assert main(["verify", str(out / "manifest.json"), "--checksums"]) == 0


def test_portable_runner(small_corpus: Path, tmp_path: Path) -> None:
    direct, portable = tmp_path / "direct", tmp_path / "portable"
    assert run_prep([small_corpus], direct, "--num-shards", 2, "--dataset", "p") == 0
    assert run_prep([small_corpus], portable, "--num-shards", 2, "--dataset", "p", runner="portable") == 0
    assert tree_digest(direct) == tree_digest(portable)
