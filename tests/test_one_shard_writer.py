"""One order rule and one writer: the ``WriteTokenShards`` sink over the command's documents
writes ``refinery prep``'s bytes, inputs given out of order and a file split by byte range
included: the shards and their provenance sidecars (``.docs.parquet``)."""
from __future__ import annotations

import json
from pathlib import Path

import apache_beam as beam
import pyarrow.parquet as pq
from apache_beam.options.pipeline_options import PipelineOptions
from helpers import gsm8k_rows

from refinery.beam_pipelines.cli import main
from refinery.transforms.prep import AssignShard, Normalize, ReadRows, Tokenize, WriteTokenShards
from refinery.transforms.prep.documents import Document, order_key

SHARDS = 4


def _corpus(root: Path) -> list[str]:
    rows = [{"id": f"q{i}", "text": r["question"] + "\n\n" + r["answer"]} for i, r in enumerate(gsm8k_rows("train"))]
    (root / "sub").mkdir(parents=True)
    files = {"z.jsonl": rows[:150], "a.jsonl": rows[150:300], "sub/m.jsonl": rows[300:1200]}
    for name, part in files.items():
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    # given out of path order; sub/m.jsonl (~0.4 MB) is split by byte range at --unit-mb 0.1
    return [str(root / "z.jsonl"), str(root / "a.jsonl"), str(root / "sub")]


def _shard_files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes()
            for p in sorted(out.glob("shard_*/*")) if p.name.endswith((".npy", ".idx", ".docs.parquet"))}


def test_the_sink_writes_the_commands_bytes(tmp_path: Path) -> None:
    inputs = _corpus(tmp_path / "in")
    command = tmp_path / "command"
    assert main(["prep", "--input", *inputs, "--output", str(command), "--dataset", "web",
                 "--num-shards", str(SHARDS), "--unit-mb", "0.1", "--runner", "direct"]) == 0
    run = json.loads((command / ".refinery" / "run.json").read_text())
    count = next(s for s in run["stages"] if s["name"] == "count")  # a file was split by byte range
    assert count["units"] >= 1 and next(s for s in run["stages"] if s["name"] == "tokenize")["units"] >= 4

    sink = tmp_path / "sink"
    with beam.Pipeline(options=PipelineOptions(["--runner=DirectRunner"])) as p:
        docs = p | ReadRows(inputs) | Normalize(text_field="text", id_field="id")
        _ = docs | Tokenize() | AssignShard(SHARDS) | WriteTokenShards(str(sink), dataset="web", num_shards=SHARDS)

    want = _shard_files(command)
    assert len(want) == 3 * SHARDS and _shard_files(sink) == want
    sidecar = pq.read_table(command / "shard_0001" / "web-v1-shard-000001.docs.parquet").to_pylist()
    assert {Path(d["source"]).name for d in sidecar} == {"z.jsonl", "a.jsonl", "m.jsonl"}

    def entries(out: Path) -> list[tuple[str, str, str, int]]:
        return [(s["sha256"], s["index_sha256"], s["docs_sha256"], s["num_documents"])
                for s in json.loads((out / "manifest.json").read_text())["shards"]]

    assert entries(command) == entries(sink)


def test_the_order_key_is_source_then_row_then_id() -> None:
    docs = [Document("b", "x", "f2", 0), Document("a", "x", "f1", 10), Document("c", "x", "f1", 2)]
    assert [d.doc_id for d in sorted(docs, key=order_key)] == ["c", "a", "b"]  # row 2 before row 10: numbers
