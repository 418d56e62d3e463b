"""One packer: ``refinery prep``'s pack units and the ``WriteTokenShards`` sink write a shard's
files with the same function (``prep.pack.write_shard_files``) from spills of the same format;
the sink's spill puts a shard's documents in the order key's order, and its content digest
is the one earlier sinks recorded (their shards are skipped, not rewritten)."""
from __future__ import annotations

import hashlib
import json
import random
from array import array
from pathlib import Path
from typing import Any

import apache_beam as beam
import msgpack
import numpy as np
import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from refinery.beam_pipelines.cli import main
from refinery.transforms.formats import shards
from refinery.transforms.io.arrow_columns import Utf8Column
from refinery.transforms.prep import AssignShard, Normalize, ReadRows, Tokenize, WriteTokenShards, pack, spill
from refinery.transforms.prep.documents import TokenizedDocument, order_key

SHARDS = 3


def _docs() -> list[TokenizedDocument]:
    rng = random.Random(7)
    docs = [TokenizedDocument(f"d{i}", array("I", [rng.randrange(200_000) for _ in range(rng.randrange(1, 9))]),
                              f"f{i % 3}.jsonl", rng.randrange(40)) for i in range(60)]
    twin = docs[5]  # same (source, row, id), other tokens: ordered by the tokens' sha1
    docs.append(TokenizedDocument(twin.doc_id, array("I", [1, 2, 3]), twin.source, twin.row))
    rng.shuffle(docs)
    return docs


def _before_digest(docs: list[TokenizedDocument]) -> str:
    """The content digest the sink recorded before it packed through spills (``_SortedShard``)."""
    ordered = sorted(docs, key=lambda d: (*order_key(d), hashlib.sha1(shards.u32_bytes(d.tokens)).digest()))
    h = hashlib.sha256(np.array([len(d.tokens) for d in ordered], "<u8").tobytes())
    for d in ordered:
        h.update(shards.u32_bytes(d.tokens))
    for d in ordered:
        h.update(msgpack.packb((d.source, d.row, d.doc_id), use_bin_type=True, unicode_errors="surrogatepass"))
    return h.hexdigest()


def test_the_sinks_spill_holds_a_shard_in_order_key_order_with_the_earlier_digest(tmp_path: Path) -> None:
    docs = _docs()
    pieces = pack.sorted_spill([None, *docs, None], spill.spill_files(str(tmp_path), "s"))
    ordered = sorted(docs, key=lambda d: (*order_key(d), hashlib.sha1(shards.u32_bytes(d.tokens)).digest()))
    assert b"".join(pack.token_chunks(pieces)) == b"".join(shards.u32_bytes(d.tokens) for d in ordered)
    assert pack.shard_lengths(pieces).tolist() == [len(d.tokens) for d in ordered]
    names = [(i, s, int(r)) for ids, sources, rows, _ in pack.doc_batches(pieces)  # (their bytes: Utf8Column)
             for i, s, r in zip(Utf8Column.of(ids).strings(), Utf8Column.of(sources).strings(), rows)]
    assert names == [(d.doc_id, d.source, d.row) for d in ordered]
    assert pack.content_digest(pieces) == _before_digest(docs)
    assert pack.sorted_spill([None], spill.spill_files(str(tmp_path), "empty")) == []


def test_the_command_and_the_sink_write_shards_with_one_function(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [{"id": f"r{i}", "text": f"row {i} " + "word " * (i % 17)} for i in range(90)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    calls: list[str] = []
    write = pack.write_shard_files

    def recorded(*args: Any, **kwargs: Any) -> pack.ShardWritten:
        calls.append(Path(args[1]).name)
        return write(*args, **kwargs)

    monkeypatch.setattr(pack, "write_shard_files", recorded)
    command, sink = tmp_path / "command", tmp_path / "sink"
    assert main(["prep", "--input", str(tmp_path / "in.jsonl"), "--output", str(command), "--dataset", "web",
                 "--num-shards", str(SHARDS), "--runner", "direct"]) == 0
    names = [f"web-v1-shard-{s:06d}.npy" for s in range(SHARDS)]
    assert sorted(calls) == names
    with beam.Pipeline(options=PipelineOptions(["--runner=DirectRunner"])) as p:
        _ = (p | ReadRows([str(tmp_path / "in.jsonl")]) | Normalize() | Tokenize() | AssignShard(SHARDS)
             | WriteTokenShards(str(sink), dataset="web", num_shards=SHARDS))
    assert sorted(calls) == sorted(names * 2)
    for s in range(SHARDS):
        rel = f"shard_{s:04d}/web-v1-shard-{s:06d}"
        for ext in (".npy", ".idx", ".docs.parquet"):
            assert (sink / (rel + ext)).read_bytes() == (command / (rel + ext)).read_bytes()
