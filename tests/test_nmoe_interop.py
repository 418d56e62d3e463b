"""nmoe's data tools read our outputs (github modal-projects/nmoe, ``nmoe/data/``).

Two tests. The contract test always runs: it checks what nmoe's ``load_manifest``,
``verify_manifest``, ``IndexReader`` and ``regenerate_index_from_shard`` rely on (the field
names of ``ManifestInfo.from_dict``, ``checksum`` = sha256 of the ``.npy``, the ``.idx``
header ``<8sQQQ`` with ``NMOEIDX\\0`` and version 1). The second runs nmoe's own code on our
output when nmoe is importable (``pip install`` of an nmoe checkout, or
``REFINERY_NMOE_SRC=/path/to/nmoe`` holding ``nmoe/data/{sinks,index}.py``); nmoe is not on
PyPI and needs Python >= 3.12 with CUDA packages, so CI runs the contract test only.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import run_prep

# what nmoe.data.sinks.ManifestInfo.from_dict reads (a KeyError there otherwise)
NMOE_MANIFEST_KEYS = ("dataset", "version", "tokenizer", "vocab_size", "eos_token_id", "dtype", "created_at",
                      "total_tokens", "total_documents", "num_shards", "shards")
NMOE_SHARD_KEYS = ("path", "index_path", "num_tokens", "num_documents", "checksum")


@pytest.fixture
def prep_output(tmp_path: Path, small_corpus: Path) -> Path:
    out = tmp_path / "out"
    assert run_prep([small_corpus], out, "--num-shards", 3, "--dataset", "s") == 0
    return out


def test_manifest_and_index_meet_nmoe_contract(prep_output: Path) -> None:
    m = json.loads((prep_output / "manifest.json").read_text())
    assert all(k in m for k in NMOE_MANIFEST_KEYS)
    assert isinstance(m["created_at"], str) and m["created_at"].endswith("Z")
    for s in m["shards"]:
        assert all(k in s for k in NMOE_SHARD_KEYS)
        npy, idx = prep_output / s["path"], prep_output / s["index_path"]
        assert s["checksum"] == hashlib.sha256(npy.read_bytes()).hexdigest()
        assert idx == npy.with_suffix(".idx")          # nmoe's index_path_for_shard
        data = idx.read_bytes()
        magic, version, num_docs, reserved = struct.unpack("<8sQQQ", data[:32])
        assert (magic, version, reserved) == (b"NMOEIDX\x00", 1, 0) and num_docs == s["num_documents"]
        bounds = np.frombuffer(data[32:], dtype=np.uint64).reshape(-1, 2)
        tokens = np.load(npy)
        assert tokens.dtype == np.uint32 and (len(bounds) == 0 or bounds[-1, 1] == len(tokens))
    # the manifest keeps its bytes on a rerun (created_at is the plan's first run)
    before = (prep_output / "manifest.json").read_bytes()
    (prep_output / "manifest.json").unlink()
    assert run_prep([prep_output.parent / "small"], prep_output, "--num-shards", 3, "--dataset", "s") == 0
    assert (prep_output / "manifest.json").read_bytes() == before


def _nmoe() -> tuple[Any, Any]:  # nmoe's modules: not typed
    src = os.environ.get("REFINERY_NMOE_SRC")
    if src and src not in sys.path:
        sys.path.insert(0, src)
    try:
        from nmoe.data import index, sinks
    except ImportError:
        pytest.skip("nmoe is not importable (not on PyPI; set REFINERY_NMOE_SRC to a checkout to run this)")
    return sinks, index


def test_nmoe_reads_our_output(prep_output: Path, tmp_path: Path) -> None:
    sinks, index = _nmoe()
    manifest = sinks.load_manifest(prep_output / "manifest.json")
    assert manifest.total_documents == json.loads((prep_output / "manifest.json").read_text())["total_documents"]
    ok, errors = sinks.verify_manifest(prep_output / "manifest.json", check_checksums=True)
    assert ok, errors
    for shard in manifest.shards:
        npy = prep_output / shard.path
        reader = index.IndexReader(prep_output / shard.index_path)
        assert reader.num_docs == shard.num_documents
        tokens = np.load(npy)
        for i in range(reader.num_docs):
            s, e = reader.get_document(i)
            assert tokens[e - 1] == 199999 and 199999 not in tokens[s:e - 1]
        copy = tmp_path / npy.name
        copy.write_bytes(npy.read_bytes())
        regenerated = index.regenerate_index_from_shard(copy, eos_token_id=199999)
        assert regenerated.read_bytes() == (prep_output / shard.index_path).read_bytes()
