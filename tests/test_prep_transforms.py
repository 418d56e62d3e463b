"""prep's public PTransforms in a user's own pipeline: Normalize | Tokenize | AssignShard | WriteTokenShards."""
from __future__ import annotations

import json
import random
from pathlib import Path

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.test_pipeline import TestPipeline as BeamPipeline  # a Beam class: no Test* name to collect
from apache_beam.testing.util import assert_that, equal_to
from helpers import gsm8k_texts, run_prep, tree_digest, write_jsonl

from refinery.transforms.formats import manifests, shards
from refinery.transforms.formats.row_ids import content_id
from refinery.transforms.formats.tiktoken_vocab import EOS_TOKEN_ID, get_encoding
from refinery.transforms.io import storage
from refinery.transforms.io.rows import iter_rows
from refinery.transforms.prep import (
    AssignShard,
    Document,
    Normalize,
    ReadRows,
    Rejected,
    SourceRow,
    Tokenize,
    TokenizedDocument,
    WriteTokenShards,
)
from refinery.transforms.prep.documents import EMPTY, shard_of


def test_normalize_tokenize_assign_shard_on_plain_dicts() -> None:
    rows = [{"id": "a", "text": "Hello\r\nworld  "}, {"text": "  "}, {"id": 7, "text": "cafe\u0301"},
            {"id": "x", "body": "no text"}]
    enc = get_encoding()
    with BeamPipeline() as p:
        docs, rejected = p | beam.Create(rows) | Normalize().with_rejected()
        assert_that(docs, equal_to([Document("a", "Hello\nworld", "", 0), Document("7", "caf\u00e9", "", 0)]),
                    label="docs")
        assert_that(rejected, equal_to([Rejected("", 0, EMPTY, content_id({"text": "  "})),
                                        Rejected("", 0, "missing text field 'text'")]), label="rejected")
        tokenized = docs | Tokenize()
        assert_that(tokenized | beam.Map(lambda d: (d.doc_id, list(d.tokens))),
                    equal_to([("a", enc.encode_ordinary("Hello\nworld") + [EOS_TOKEN_ID]),
                              ("7", enc.encode_ordinary("caf\u00e9") + [EOS_TOKEN_ID])]), label="tokens")
        assert_that(tokenized | AssignShard(5) | beam.Map(lambda kv: (kv[0], kv[1].doc_id)),
                    equal_to([(shard_of("a", 5), "a"), (shard_of("7", 5), "7")]), label="shards")


def test_without_with_rejected_a_bad_row_fails_the_pipeline_naming_it() -> None:
    rows = [SourceRow("data/a.jsonl", 3, {"id": 1, "txt": "x"}, "a.jsonl")]
    with pytest.raises(Exception, match=r"data/a.jsonl:3: missing text field 'text'"):
        with BeamPipeline() as p:
            _ = p | beam.Create(rows) | Normalize()


def _source_rows(root: Path) -> list[SourceRow]:
    """What `refinery prep` reads: every file (sorted), every row, with relpath provenance."""
    out = []
    for f in storage.expand_inputs([str(root)]):
        for row, record, error in iter_rows(f.path):
            assert error is None and record is not None
            out.append(SourceRow(f.path, row, record, f.relpath))
    return out


def _write_with_transforms(rows: list[SourceRow], out: Path, num_shards: int,
                           runner_args: list[str] | None = None) -> None:
    opts = PipelineOptions(runner_args or ["--runner=DirectRunner"])
    with beam.Pipeline(options=opts) as p:
        docs, rejected = p | beam.Create(rows) | Normalize().with_rejected()
        _ = (docs | Tokenize() | AssignShard(num_shards)
             | WriteTokenShards(str(out), dataset="s", num_shards=num_shards, rejected=rejected))


@pytest.fixture
def corpus_with_bad_rows(tmp_path: Path) -> Path:
    texts = gsm8k_texts(70)
    root = tmp_path / "corpus"
    write_jsonl(root / "x.jsonl", [{"id": f"x{i}", "text": t} for i, t in enumerate(texts[:40])] + [{"text": " "}])
    write_jsonl(root / "sub" / "y.jsonl", [{"text": t} for t in texts[40:]] + [{"title": "no text"}])
    return root


def _shard_bytes(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.glob("shard_*/*"))}


def test_sink_gives_the_cli_bytes_verifies_and_is_idempotent(tmp_path: Path, corpus_with_bad_rows: Path) -> None:
    from refinery.beam_pipelines.cli import main

    cli_out, tf_out = tmp_path / "cli", tmp_path / "tf"
    assert run_prep([corpus_with_bad_rows], cli_out, "--num-shards", 4, "--dataset", "s") == 0
    rows = _source_rows(corpus_with_bad_rows)
    random.Random(1).shuffle(rows)  # arrival order must not matter: the sink orders by (source, row)
    _write_with_transforms(rows, tf_out, 4)

    assert _shard_bytes(tf_out) == _shard_bytes(cli_out) and len(_shard_bytes(tf_out)) == 12  # npy, idx, docs
    assert (tf_out / "rejects/rejects.jsonl").read_bytes() == (cli_out / "rejects/rejects.jsonl").read_bytes()
    cli_m, tf_m = (json.loads((d / "manifest.json").read_text()) for d in (cli_out, tf_out))
    assert tf_m["rows"] == cli_m["rows"] == {"read": 72, "accepted": 70, "empty": 1, "rejected": 1, "over_budget": 0}
    assert tf_m["shards"] == cli_m["shards"] and tf_m["total_tokens"] == cli_m["total_tokens"]
    assert tf_m["created_at"] and all(s["checksum"] == s["sha256"] for s in tf_m["shards"])
    assert main(["verify", str(tf_out), "--checksums"]) == 0

    # a rerun rewrites nothing: same files, same mtimes, receipts untouched
    stamps = {p: p.stat().st_mtime_ns for p in tf_out.rglob("*") if p.is_file()}
    _write_with_transforms(list(reversed(rows)), tf_out, 4)
    assert {p: p.stat().st_mtime_ns for p in tf_out.rglob("*") if p.is_file()} == stamps

    # a deleted .npy and a truncated .idx come back byte-identical; nothing else is rewritten
    before = tree_digest(tf_out)
    npy = next(tf_out.glob("shard_0001/*.npy"))
    idx = next(tf_out.glob("shard_0002/*.idx"))
    npy.unlink()
    idx.write_bytes(idx.read_bytes()[:40])
    untouched = tf_out / "shard_0003"
    untouched_stamps = {p: p.stat().st_mtime_ns for p in untouched.iterdir()}
    _write_with_transforms(rows, tf_out, 4)
    assert tree_digest(tf_out) == before
    assert {p: p.stat().st_mtime_ns for p in untouched.iterdir()} == untouched_stamps


def test_changed_input_rewrites_only_the_shards_it_touches(tmp_path: Path, corpus_with_bad_rows: Path) -> None:
    out = tmp_path / "tf"
    rows = _source_rows(corpus_with_bad_rows)
    _write_with_transforms(rows, out, 4)
    k = next(i for i, r in enumerate(rows) if "id" in r.record)
    changed = rows[k]._replace(record={**rows[k].record, "text": "a different first document"})
    hit = shard_of(changed.record["id"], 4)
    stamps = {p.parent.name: p.stat().st_mtime_ns for p in out.glob("shard_*/*.npy")}
    _write_with_transforms(rows[:k] + [changed] + rows[k + 1:], out, 4)
    after = {p.parent.name: p.stat().st_mtime_ns for p in out.glob("shard_*/*.npy")}
    assert [k for k in stamps if stamps[k] != after[k]] == [f"shard_{hit:04d}"]
    docs = [shards.ShardReader(str(p)) for p in sorted(out.glob("shard_*/*.npy"))]
    texts = [get_encoding().decode(list(d.document(i))[:-1]) for d in docs for i in range(len(d))]
    assert "a different first document" in texts


def test_read_rows_with_rejected_and_empty_shards(tmp_path: Path) -> None:
    root = tmp_path / "in"
    write_jsonl(root / "a.jsonl", [{"id": "1", "text": "one"}], raw_lines={1: "{broken"})
    out = tmp_path / "out"
    with BeamPipeline() as p:
        rows, bad = p | ReadRows([str(root)]).with_rejected()
        docs, rejected = rows | Normalize().with_rejected()
        manifest = (docs | Tokenize() | AssignShard(3)
                    | WriteTokenShards(str(out), "tiny", 3, rejected=(bad, rejected) | beam.Flatten()))
        assert_that(manifest, equal_to([str(out / "manifest.json")]))
    m = json.loads((out / "manifest.json").read_text())
    assert m["rows"] == {"read": 2, "accepted": 1, "empty": 0, "rejected": 1, "over_budget": 0}
    assert [s["num_documents"] for s in m["shards"]].count(0) == 2 and len(m["shards"]) == 3
    reject = json.loads((out / "rejects/rejects.jsonl").read_text())
    assert reject["path"].endswith("a.jsonl") and reject["row"] == 1 and reject["reason"].startswith("malformed JSON")
    for s in m["shards"]:
        tokens = np.load(out / s["path"])
        assert tokens.dtype == np.dtype("<u4") and len(tokens) == s["num_tokens"]


def test_coders_are_deterministic_and_round_trip() -> None:
    from array import array

    from refinery.transforms.prep.beam import DocumentCoder, RejectedCoder, TokenizedDocumentCoder

    pairs: list[tuple[beam.coders.Coder, object]] = [
        (DocumentCoder(), Document("d", "tëxt", "f.jsonl", 3)), (RejectedCoder(), Rejected("f", 1, "why", "")),
        (TokenizedDocumentCoder(), TokenizedDocument("d", array("I", [1, 2, 199999]), "f", 2))]
    for coder, value in pairs:
        assert coder.is_deterministic()
        assert coder.decode(coder.encode(value)) == value
        assert coder.encode(value) == coder.encode(coder.decode(coder.encode(value)))


def test_sink_through_portable_runner(tmp_path: Path, corpus_with_bad_rows: Path) -> None:
    """One run through the job API that Flink's job server speaks (embedded, LOOPBACK)."""
    direct, portable = tmp_path / "direct", tmp_path / "portable"
    rows = _source_rows(corpus_with_bad_rows)
    _write_with_transforms(rows, direct, 3)
    _write_with_transforms(rows, portable, 3, ["--runner=PortableRunner", "--job_endpoint=embed",
                                               "--environment_type=LOOPBACK"])
    assert tree_digest(portable) == tree_digest(direct)


def test_rejects_a_dataset_name_that_would_escape_the_output() -> None:
    with pytest.raises(ValueError, match="dataset"):
        WriteTokenShards("out", dataset="../escape", num_shards=2)


def test_building_the_sink_logs_no_beam_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Beam warns at construction about a DoFn whose process() both yields and returns."""
    from refinery.transforms.prep.beam import _WriteShardFn

    with caplog.at_level("WARNING", logger="apache_beam"):  # the CLI raises it to ERROR
        beam.ParDo(_WriteShardFn("out", "d", 2, "v1"))
    assert caplog.records == []


def test_one_row_accounting_and_one_manifest_entry_for_sink_and_command(tmp_path: Path) -> None:
    """WriteTokenShards and prep's manifest stage build rows and entries with the same two
    functions: the accounting refuses counts that do not add up, and an entry is read
    from a receipt, so the sink's and the command's receipts are interchangeable."""
    rows = manifests.row_accounting(read=10, accepted=7, empty=2, rejected=1, written=5)
    assert rows == {"read": 10, "accepted": 5, "empty": 2, "rejected": 1, "over_budget": 2}
    with pytest.raises(ValueError, match="do not add up"):
        manifests.row_accounting(read=10, accepted=7, empty=2, rejected=0, written=7)
    receipt = {"files": [{"path": "shard_0003/d-v1-shard-000003.idx", "bytes": 24, "sha256": "i" * 64},
                         {"path": "shard_0003/d-v1-shard-000003.npy", "bytes": 200, "sha256": "n" * 64}],
               "stats": {"tokens": 40, "docs": 2}}
    assert manifests.entry_from_receipt(3, receipt) == {
        "shard": 3, "path": "shard_0003/d-v1-shard-000003.npy", "index_path": "shard_0003/d-v1-shard-000003.idx",
        "num_tokens": 40, "num_documents": 2, "sha256": "n" * 64, "checksum": "n" * 64, "index_sha256": "i" * 64}


def test_tokenize_encodes_in_batches_and_keeps_every_documents_tokens_and_window() -> None:
    from apache_beam.transforms import window

    texts = [f"doc {i} " + "word " * (i % 50) + ("x\U000332dby" if i % 97 == 0 else "") for i in range(700)]
    docs = [Document(str(i), t, "src", i) for i, t in enumerate(texts)]
    enc = get_encoding()
    expected = [(str(i), i // 100, enc.encode_ordinary(t) + [EOS_TOKEN_ID]) for i, t in enumerate(texts)]
    for encoder in ("fast", "tiktoken"):
        with BeamPipeline() as p:
            out = (p | beam.Create([window.TimestampedValue(d, d.row) for d in docs])
                   | beam.WindowInto(window.FixedWindows(100)) | Tokenize(encoder=encoder)
                   | beam.Map(lambda d, w=beam.DoFn.WindowParam: (d.doc_id, int(w.start) // 100, list(d.tokens))))
            assert_that(out, equal_to(expected))
