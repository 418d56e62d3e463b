"""gs:// correctness against a local GCS emulator (``gcp-storage-emulator``, see gcs_emulator.py).

- io on GCS: atomic writes (nothing under the final name after a failed writer), fresh
  state seen after another process wrote or deleted objects (no stale listing cache).
- prep end to end with inputs and outputs on gs:// on the multi-process local runner (the
  emulator's address reaches the worker processes through the environment), shards
  byte-identical to a local run, ``refinery verify --checksums`` on the gs:// manifest,
  a rerun that runs 0 units, and a deleted shard rebuilt alone.
- decon end to end on gs:// through PortableRunner (LOOPBACK), stats equal to a local run,
  and a rerun that runs 0 units.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fsspec
import pytest
from helpers import gsm8k_texts, write_jsonl

from refinery.beam_pipelines.cli import main
from refinery.transforms.io import storage
from refinery.transforms.resumable import stage_status

if TYPE_CHECKING:
    from _pytest.capture import CaptureResult  # what capsys.readouterr() returns (not exported by pytest)

pytest_plugins = ["gcs_emulator"]  # the gcs_bucket fixture (tests/gcs_emulator.py)


def _fresh_fs() -> Any:  # an fsspec filesystem (fsspec is untyped)
    """A second client, as another process would have: no shared instance or cache."""
    return fsspec.filesystem("gs", skip_instance_cache=True)


def _upload_tree(local_root: Path, remote_root: str) -> None:
    for path in sorted(local_root.rglob("*")):
        if path.is_file():
            storage.atomic_write_bytes(f"{remote_root}/{path.relative_to(local_root).as_posix()}", path.read_bytes())


def _units_run(captured: CaptureResult[str]) -> str:
    """What the command said it ran ("units run: ..."; prep prints it to stdout, decon to stderr)."""
    text = captured.out + captured.err
    m = re.search(r"units run: (.*)", text)
    assert m, text
    return m.group(1)


def _receipts(output: str) -> dict[str, bytes]:
    fs = _fresh_fs()
    root = output[len("gs://"):]
    return {p: fs.cat_file(p) for p in fs.find(f"{root}/.refinery") if "/receipts/" in p}


def test_io_on_gcs_atomic_and_fresh(gcs_bucket: str) -> None:
    d = f"{gcs_bucket}/dir"
    assert storage.listdir(d) == [] and storage.file_size(f"{d}/a.json") is None
    assert storage.atomic_write_json(f"{d}/a.json", {"a": 1})[0] == len(b'{\n "a": 1\n}\n')
    assert storage.listdir(d) == [f"{d}/a.json"]  # listing of d now seen by this process
    other = _fresh_fs()
    other.pipe_file(f"{d[5:]}/b.json", b"{}")  # another process writes ...
    assert storage.exists(f"{d}/b.json") and storage.file_size(f"{d}/b.json") == 2
    assert storage.read_json(f"{d}/b.json") == {}
    assert storage.listdir(d) == [f"{d}/a.json", f"{d}/b.json"]
    other.rm_file(f"{d[5:]}/a.json")  # ... and deletes
    assert not storage.exists(f"{d}/a.json") and storage.file_size(f"{d}/a.json") is None
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(f"{d}/a.json")
    # a writer that fails leaves nothing under the final name (and an old object intact)
    with pytest.raises(RuntimeError, match="boom"):
        with storage.atomic_open(f"{d}/b.json") as f:
            f.write(b"partial")
            raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        with storage.atomic_open(f"{d}/c.bin") as f:
            f.write(b"partial")
            raise RuntimeError("boom")
    assert storage.read_bytes(f"{d}/b.json") == b"{}" and not storage.exists(f"{d}/c.bin")
    # a large object goes up as one resumable upload and is whole, with the recorded hash
    big = bytes(range(256)) * (6 * 4096 + 7)  # > 5 MiB: gcsfs's multi-request path
    with storage.atomic_open(f"{d}/big.bin") as f:
        f.write(big)
    assert (f.bytes_written, f.sha256) == (len(big), hashlib.sha256(big).hexdigest())
    assert storage.sha256_file(f"{d}/big.bin") == hashlib.sha256(big).hexdigest()
    # inputs on gs:// carry the object generation as their version
    [inp] = storage.expand_inputs([f"{d}/b.json"])
    assert inp.size == 2 and inp.version == str(other.info(f"{d[5:]}/b.json")["generation"])


def test_nested_runs_on_gcs_are_found_above_and_below(gcs_bucket: str) -> None:
    """prep's check for an --output inside or holding another run, on an object store (prefixes)."""
    from refinery.beam_pipelines.checks import nested_run_problem

    storage.atomic_write_bytes(f"{gcs_bucket}/out/manifest.json", b"{}")
    storage.atomic_write_bytes(f"{gcs_bucket}/out/shard_0000/x.npy", b"")
    storage.atomic_write_bytes(f"{gcs_bucket}/decon/.refinery/run.json", b"{}")
    assert storage.runs_above(f"{gcs_bucket}/out/web/sub") == [f"{gcs_bucket}/out"]
    assert f"lies inside {gcs_bucket}/out, the output of another run ({gcs_bucket}/out/manifest.json)" in \
        str(nested_run_problem(f"{gcs_bucket}/out/web"))
    assert storage.folders_holding(gcs_bucket) == [f"{gcs_bucket}/decon", f"{gcs_bucket}/out"]
    assert nested_run_problem(f"{gcs_bucket}") == (f"holds the output of another run below it: {gcs_bucket}/decon, "
                                                   f"{gcs_bucket}/out; give a folder beside it (runs are siblings), "
                                                   "or move that run out first")
    assert nested_run_problem(f"{gcs_bucket}/web") is None
    assert nested_run_problem(f"{gcs_bucket}/out") is None  # a rerun in place


def test_prep_on_gcs_matches_local_and_resumes(
        gcs_bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "corpus"
    write_jsonl(corpus / "a.jsonl", [{"id": f"a{i}", "text": t} for i, t in enumerate(gsm8k_texts(30))])
    write_jsonl(corpus / "sub" / "b.jsonl.gz", [{"text": t} for t in gsm8k_texts(20, offset=30)] + [{"x": 1}])
    _upload_tree(corpus, f"{gcs_bucket}/corpus")
    out = f"{gcs_bucket}/tokens"
    common = ["--num-shards", "3", "--dataset", "g", "--no-progress", "--unit-mb", "0"]  # 2 tokenize units
    gs_args = ["prep", "--input", f"{gcs_bucket}/corpus", "--output", out, *common]

    # multi-process local runner: workers reach the emulator through the inherited env
    assert main([*gs_args, "--runner", "local", "--workers", "2"]) == 0
    assert main(["prep", "--input", str(corpus), "--output", str(tmp_path / "local"), *common,
                 "--runner", "direct"]) == 0
    capsys.readouterr()
    remote = json.loads(storage.read_bytes(f"{out}/manifest.json"))
    local = json.loads((tmp_path / "local" / "manifest.json").read_text())
    assert remote["rows"] == local["rows"] == {"read": 51, "accepted": 50, "empty": 0, "rejected": 1, "over_budget": 0}
    assert [(s["path"], s["sha256"], s["index_sha256"]) for s in remote["shards"]] == \
           [(s["path"], s["sha256"], s["index_sha256"]) for s in local["shards"]]
    for s in remote["shards"]:
        assert storage.read_bytes(f"{out}/{s['path']}") == (tmp_path / "local" / s["path"]).read_bytes()
    assert b"missing text field" in storage.read_bytes(f"{out}/rejects/rejects.jsonl")
    assert main(["verify", f"{out}/manifest.json", "--checksums"]) == 0
    assert "OK" in capsys.readouterr().out
    assert [(r["stage"], r["done"], r["pending"]) for r in stage_status(out)] == \
           [("tokenize", 2, 0), ("pack", 3, 0), ("manifest", 1, 0)]

    # rerun: every receipt on GCS verifies, nothing runs, nothing is rewritten
    receipts = _receipts(out)
    assert len(receipts) == 6
    pids = {json.loads(r)["pid"] for p, r in receipts.items() if "/tokenize/" in p}
    assert os.getpid() not in pids  # tokenize ran in worker processes, which found the emulator (pack is light:
    #                                 it runs in this process on the local runner)
    assert main([*gs_args, "--runner", "direct"]) == 0
    assert _units_run(capsys.readouterr()) == "nothing (all units already done)"
    assert _receipts(out) == receipts

    # a shard deleted behind our back (another client): only its pack unit re-runs (byte-identical,
    # so the manifest that lists its sha256 stays valid and is not rewritten)
    shard = remote["shards"][1]["path"]
    _fresh_fs().rm_file(f"{out[5:]}/{shard}")
    assert main([*gs_args, "--runner", "direct"]) == 0
    ran = _units_run(capsys.readouterr())
    # every stage is in the job (its workers check the receipts); only the pack unit ran
    assert re.fullmatch(r"tokenize 0 \([\d.]+s\), pack 1 \([\d.]+s\), manifest 0 \([\d.]+s\)", ran), ran
    assert storage.read_bytes(f"{out}/{shard}") == (tmp_path / "local" / shard).read_bytes()
    assert main(["verify", f"{out}/manifest.json", "--checksums"]) == 0
    # a broken shard is named by verify, on GCS too
    storage.atomic_write_bytes(f"{out}/{shard}", b"truncated")
    assert main(["verify", f"{out}/manifest.json"]) == 1
    assert shard in capsys.readouterr().out


def test_decon_on_gcs_portable_matches_local_and_resumes(
        gcs_bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    texts = gsm8k_texts(12)
    write_jsonl(data / "eval" / "gsm8k" / "test.jsonl", [{"id": f"e{i}", "text": t} for i, t in enumerate(texts[:4])])
    write_jsonl(data / "train" / "t1.jsonl", [{"id": f"t{i}", "text": t} for i, t in enumerate(texts[2:8])])
    write_jsonl(data / "train" / "t2.jsonl", [{"id": f"u{i}", "text": t} for i, t in enumerate(texts[8:])])
    _upload_tree(data, f"{gcs_bucket}/data")
    out = f"{gcs_bucket}/decon"
    method = ["--ngrams", "5", "13", "--partitions", "2", "--no-progress"]
    gs_args = ["decon", "--eval", f"{gcs_bucket}/data/eval", "--train", f"{gcs_bucket}/data/train",
               "--output", out, *method]

    assert main([*gs_args, "--runner", "portable"]) == 0
    assert main(["decon", "--eval", str(data / "eval"), "--train", str(data / "train"),
                 "--output", str(tmp_path / "local"), *method, "--runner", "direct"]) == 0
    capsys.readouterr()
    stats = [json.loads(line) for line in storage.read_bytes(f"{out}/stats/overlap_stats.jsonl").splitlines()]
    local = [json.loads(line) for line in (tmp_path / "local/stats/overlap_stats.jsonl").read_text().splitlines()]
    assert stats == local
    assert sorted(r["n"] for r in stats) == [5, 13] and all(len(r["instance_ids"]) == 2 for r in stats)
    assert storage.exists(f"{out}/.SUCCESS")

    receipts = _receipts(out)
    assert main([*gs_args, "--runner", "direct"]) == 0
    assert _units_run(capsys.readouterr()) == "nothing (all units already done)"
    assert _receipts(out) == receipts
