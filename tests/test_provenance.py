"""From a token document back to its source row: each shard's ``.docs.parquet`` sidecar
(``transforms/formats/provenance.py``), written by prep's pack units (and by
``WriteTokenShards``: tests/test_one_shard_writer.py), checked by verify, read by
``refinery inspect --doc``."""
from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any, ContextManager

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import gsm8k_texts, run_prep, write_jsonl

from refinery.beam_pipelines.cli import main
from refinery.transforms.formats import provenance, shards
from refinery.transforms.formats.encoders import load_tokenizer
from refinery.transforms.formats.provenance import DocBatch
from refinery.transforms.formats.tokenizer_choice import DEFAULT
from refinery.transforms.io import storage
from refinery.transforms.io.rows import iter_rows
from refinery.transforms.prep import spill, stages
from refinery.transforms.prep.documents import Document, encode_document, normalize_row

SHARDS = 3
ARGS = ("--num-shards", SHARDS, "--dataset", "p", "--unit-mb", 0.01)  # 10 kB units: big.jsonl read by byte ranges


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """jsonl with ids and bad rows, a nested id-less jsonl, a parquet of several row groups,
    and a jsonl of ~60 kB, split by byte range at --unit-mb 0.01."""
    root = tmp_path_factory.mktemp("prov") / "in"
    texts = gsm8k_texts(150)
    write_jsonl(root / "a.jsonl", [{"id": f"a{i}", "text": t} for i, t in enumerate(texts[:20])],
                raw_lines={3: "{not json", 7: json.dumps({"id": "empty", "text": "  "})})
    write_jsonl(root / "sub" / "noid.jsonl", [{"text": t} for t in texts[20:35]])
    table = pa.table({"id": [f"p{i}" for i in range(25)], "text": texts[35:60]})
    pq.write_table(table, root / "c.parquet", row_group_size=4)
    write_jsonl(root / "d_big.jsonl", [{"id": f"d{i}", "text": t} for i, t in enumerate(texts[60:150])])
    assert (root / "d_big.jsonl").stat().st_size > 2 * 10_000
    return root


@pytest.fixture(scope="module")
def prepped(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prov-out") / "out"
    assert run_prep([corpus], out, *ARGS) == 0
    return out


def _sidecars(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.glob("shard_*/*.docs.parquet"))}


def test_every_document_maps_back_to_the_row_whose_text_makes_its_tokens(corpus: Path, prepped: Path) -> None:
    tok = load_tokenizer(DEFAULT)
    manifest = json.loads((prepped / "manifest.json").read_text())
    rows: dict[str, dict[int, dict[str, Any]]] = {}
    seen = set()
    for entry in manifest["shards"]:
        assert entry["docs_path"] == provenance.docs_path_for(entry["path"])
        sidecar = prepped / entry["docs_path"]
        assert entry["docs_sha256"] == hashlib.sha256(sidecar.read_bytes()).hexdigest()
        docs = pq.read_table(sidecar).to_pylist()
        reader = shards.ShardReader(str(prepped / entry["path"]))
        assert len(docs) == reader.num_docs == entry["num_documents"]
        for i, d in enumerate(docs):
            assert d["doc"] == i
            if d["source"] not in rows:
                rows[d["source"]] = {k: r for k, r, e in iter_rows(d["source"]) if e is None and r is not None}
            relpath = Path(d["source"]).relative_to(corpus).as_posix()
            doc = normalize_row(rows[d["source"]][d["row"]], None, "text", "id", d["source"], d["row"], relpath)
            assert isinstance(doc, Document) and doc.doc_id == d["doc_id"]
            tokens = reader.document(i)
            assert d["num_tokens"] == len(tokens)
            assert tokens.tolist() == encode_document(tok, doc.text).tolist(), (entry["path"], i, d)
            seen.add((d["source"], d["row"]))
    files = {Path(s).name for s, _ in seen}
    assert files == {"a.jsonl", "noid.jsonl", "c.parquet", "d_big.jsonl"}
    assert len(seen) == manifest["total_documents"] == 20 + 15 + 25 + 90  # every document, each its own row
    assert (str(corpus / "sub" / "noid.jsonl"), 14) in seen and (str(corpus / "d_big.jsonl"), 89) in seen
    assert (str(corpus / "a.jsonl"), 3) not in seen  # the bad line: rejected, never a document
    run = json.loads((prepped / ".refinery" / "run.json").read_text())
    assert next(s for s in run["stages"] if s["name"] == "count")["units"] >= 2  # d_big was split by byte range


def test_sidecars_are_byte_identical_across_runs_merged_spills_and_a_lost_sidecar(
        corpus: Path, prepped: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    want = _sidecars(prepped)
    assert len(want) == SHARDS
    again = tmp_path / "again"
    assert run_prep([corpus], again, *ARGS) == 0
    assert _sidecars(again) == want
    monkeypatch.setattr(stages, "MERGE_ABOVE", 0)  # tokenize spills merged into groups first: the same sidecars
    merged = tmp_path / "merged"
    assert run_prep([corpus], merged, *ARGS) == 0
    assert any(s["name"] == "merge" for s in json.loads((merged / ".refinery" / "run.json").read_text())["stages"])
    assert _sidecars(merged) == want
    monkeypatch.setattr(stages, "MERGE_ABOVE", 1 << 16)
    lost = again / next(iter(want))
    lost.unlink()  # the unit's receipt lists it: a rerun packs that shard again
    assert run_prep([corpus], again, *ARGS) == 0
    assert _sidecars(again) == want


def test_a_budget_cut_names_exactly_the_documents_kept(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "cut"
    assert run_prep([corpus], out, *ARGS, "--max-tokens", 9000) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert 0 < m["total_documents"] < 150
    for entry in m["shards"]:
        docs = pq.read_table(out / entry["docs_path"])
        assert docs.num_rows == entry["num_documents"]
        lengths = shards.IndexReader(str(out / entry["index_path"])).lengths()
        assert docs.column("num_tokens").to_pylist() == lengths.tolist()
    assert main(["verify", str(out / "manifest.json"), "--checksums"]) == 0


def test_verify_names_a_damaged_or_missing_sidecar(
        prepped: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(prepped, out)
    m = json.loads((out / "manifest.json").read_text())
    sidecar = out / m["shards"][1]["docs_path"]
    data = bytearray(sidecar.read_bytes())
    data[len(data) // 2] ^= 0x01  # a flipped byte inside a page
    sidecar.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["verify", str(out / "manifest.json"), "--checksums"]) == 1
    said = capsys.readouterr()
    assert f"{sidecar}: sha256 does not match the manifest" in said.out + said.err
    sidecar.write_bytes(bytes(data[:100]))  # cut short: not Parquet, named without --checksums too
    assert main(["verify", str(out / "manifest.json")]) == 1
    said = capsys.readouterr()
    assert f"{sidecar}: not a readable Parquet file" in said.out + said.err
    sidecar.unlink()
    assert main(["verify", str(out / "manifest.json")]) == 1
    said = capsys.readouterr()
    assert f"{sidecar}: missing" in said.out + said.err


def test_check_docs_compares_counts_with_the_idx(tmp_path: Path) -> None:
    path = str(tmp_path / "x.docs.parquet")

    def opened(p: str) -> ContextManager[storage.BinaryWriter]:
        return storage.atomic_open(p)

    assert provenance.write_docs(opened, path, [(["a", "b"], ["f", "f"], [0, 2], [3, 5])]) == 2
    assert provenance.check_docs(path, np.array([3, 5], np.uint64)) == []
    assert provenance.check_docs(path, np.array([3, 4], np.uint64)) == [
        f"{path}: document 1 has 5 tokens, the .idx says 4"]
    assert provenance.check_docs(path, None, 3) == [f"{path}: 2 documents, the shard holds 3"]
    assert provenance.read_doc(path, 1) == {"doc": 1, "doc_id": "b", "source": "f", "row": 2, "num_tokens": 5}
    with pytest.raises(IndexError, match="document 2 out of range"):
        provenance.read_doc(path, 2)


def test_the_sidecar_bytes_depend_on_the_documents_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Row groups of exactly ROWS_PER_GROUP documents whatever the batches (the command's
    spills, the sink's sort), and an id that is not valid Unicode written escaped."""
    monkeypatch.setattr(provenance, "ROWS_PER_GROUP", 4)
    ids = [f"id{i}" for i in range(11)] + ["bad\ud800"]
    docs = (ids, ["s"] * 12, list(range(12)), [2] * 12)

    def write(batches: list[DocBatch]) -> bytes:
        buf = io.BytesIO()
        w = provenance.DocsWriter(buf)
        for b in batches:
            w.add(b)
        assert w.close() == 12
        return buf.getvalue()

    one = write([docs])
    cuts = [0, 1, 6, 7, 12]
    ids_, sources, rows, tokens = docs
    assert write([(ids_[a:b], sources[a:b], rows[a:b], tokens[a:b]) for a, b in zip(cuts, cuts[1:])]) == one
    f = pq.ParquetFile(io.BytesIO(one))
    assert [f.metadata.row_group(g).num_rows for g in range(f.num_row_groups)] == [4, 4, 4]
    assert f.read().column("doc_id").to_pylist()[-1] == "bad\\ud800"


def test_spill_names_follow_their_documents_through_runs_and_shards() -> None:
    """Names spilled run by run and shard by shard, read back per shard (pack), and through a
    merge (each document with its own names), with a surrogate kept."""
    rng = np.random.default_rng(3)
    n = 120
    shard_ids = rng.integers(0, 4, n).astype(np.uint32)
    names = [(int(r), f"doc-{i}" + ("\udc80" if i == 5 else ""), f"/in/f{i % 3}.jsonl")
             for i, r in enumerate(rng.integers(0, 10**9, n))]
    toks, names_buf = io.BytesIO(), io.BytesIO()
    w = spill.SpillWriter(toks, run_tokens=50, names_out=names_buf)
    for lo in range(0, n, 16):  # batches, several runs
        s = shard_ids[lo:lo + 16]
        order = np.argsort(s, kind="stable")
        lengths = np.full(len(s), 3, np.uint32)
        tokens = np.repeat(np.arange(lo, lo + len(s), dtype=np.uint32)[order], 3)
        part = names[lo:lo + 16]
        w.add_batch(s, order, tokens, lengths, ([r for r, _, _ in part], [d for _, d, _ in part],
                                                 [src for _, _, src in part]))
    table, meta, starts = spill.by_shard_with_meta(w.close(), w.meta, 4)
    docs_file, meta_file = io.BytesIO(), io.BytesIO()
    spill.write_array(docs_file, table)
    spill.write_array(meta_file, meta)
    for shard in range(4):
        docs_file.seek(0)
        meta_file.seek(0)
        rows = spill.read_shard_rows(docs_file, starts, shard)
        m = spill.read_shard_rows(meta_file, starts, shard, spill.META_DTYPE)
        ids, sources = spill.read_names(names_buf, m)
        want = [names[i] for i in range(n) if shard_ids[i] == shard]
        assert list(zip(m["row"].tolist(), ids, sources)) == want
        got = np.frombuffer(b"".join(spill.iter_token_chunks(toks, spill.contiguous_ranges(rows))), "<u4")
        assert got[::3].tolist() == [i for i in range(n) if shard_ids[i] == shard]
    toks.seek(0)
    names_buf.seek(0)  # as a merge opens them
    named = list(spill.iter_named_documents(toks, names_buf, table, meta))
    assert sorted((int(t[0]), name) for _, t, _, name in named) == sorted(zip(range(n), names))


def test_inspect_doc_prints_the_document_and_its_source(
        corpus: Path, prepped: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = json.loads((prepped / "manifest.json").read_text())
    docs = pq.read_table(prepped / m["shards"][0]["docs_path"]).to_pylist()
    d = docs[3]
    capsys.readouterr()
    assert main(["inspect", "--manifest", str(prepped / "manifest.json"), "--doc", "0:3", "--chars", "40"]) == 0
    said = capsys.readouterr().out
    assert f"document 3: {d['num_tokens']:,} tokens (EOS included)" in said
    assert f"  id:     {d['doc_id']}\n" in said and f"  source: {d['source']}, row {d['row']}\n" in said
    assert "  text:   '" in said and "  row:    {" in said
    # a .npy path with --data-dir, and a row the sidecar names in the id-less file
    npy = m["shards"][1]["path"]
    assert main(["inspect", "--data-dir", str(prepped), "--doc", f"{npy}:0"]) == 0
    assert f"{prepped / npy} document 0:" in capsys.readouterr().out
    assert main(["inspect", "--manifest", str(prepped / "manifest.json"), "--doc", "7:0"]) == 2
    assert "--doc 7:0: no such shard" in capsys.readouterr().err


def test_an_id_less_training_row_has_one_id_in_prep_shards_and_decon_drop_list(tmp_path: Path) -> None:
    """prep named an id-less row `relpath:row` and decon named it by a blake2b number: one rule
    now (transforms/formats/row_ids.py), so a drop list's train_doc_id is the shard's doc_id."""
    train = tmp_path / "corpus"
    texts = gsm8k_texts(12)
    write_jsonl(train / "sub" / "noid.jsonl", [{"text": t} for t in texts])
    write_jsonl(tmp_path / "ev" / "gsm8k" / "test.jsonl", [{"question": texts[4]}, {"question": texts[9]}])
    decon = tmp_path / "decon"
    assert main(["decon", "--eval", str(tmp_path / "ev"), "--eval-text-field", "question", "--train", str(train),
                 "--output", str(decon), "--ngrams", "13", "--runner", "direct", "--no-progress"]) == 0
    listed = {(d["train_row"], d["train_doc_id"]) for d in map(json.loads, (
        decon / "stats" / "contaminated_train_docs.jsonl").read_text().splitlines())}
    assert listed == {(4, "sub/noid.jsonl:4"), (9, "sub/noid.jsonl:9")}
    out = tmp_path / "prep"
    assert run_prep([train], out, "--num-shards", "1") == 0
    m = json.loads((out / "manifest.json").read_text())
    ids = {d["row"]: d["doc_id"] for d in pq.read_table(out / m["shards"][0]["docs_path"]).to_pylist()}
    assert {(row, ids[row]) for row, _ in listed} == listed


SIDECAR_WITHOUT_PANDAS = """
import io, sys
import numpy as np
from refinery.transforms.formats import provenance
ids = ["d0", "caf\\u00e9-\\u4e2d", "lone\\udc80surrogate", "", "d4"]
sources = ["a.jsonl"] * 5
buf = io.BytesIO()
w = provenance.DocsWriter(buf)
w.add((ids, sources, np.arange(5), np.array([3, 1, 4, 1, 5])))
assert w.close() == 5
assert "pandas" not in sys.modules, "the sidecar writer imported pandas"
import pyarrow as pa, pyarrow.parquet as pq
# the same bytes as the table pa.array builds (the writer before): every batch escaped, as then
esc = [v.encode("utf-8", "backslashreplace").decode("utf-8") for v in ids]
table = pa.Table.from_arrays([pa.array(np.arange(5, dtype=np.uint64)), pa.array(esc, pa.string()),
                              pa.array(sources, pa.string()), pa.array(np.arange(5, dtype=np.uint64)),
                              pa.array(np.array([3, 1, 4, 1, 5], dtype=np.uint64))], schema=provenance.schema())
ref = io.BytesIO()
with pq.ParquetWriter(ref, provenance.schema(), **provenance.WRITER_OPTIONS) as pw:
    pw.write_table(table, row_group_size=provenance.ROWS_PER_GROUP)
assert pq.read_table(io.BytesIO(buf.getvalue())).equals(pq.read_table(io.BytesIO(ref.getvalue())))
print("ok")
# ended as every refinery command ends (runners/quick_exit.py), not by the interpreter's teardown:
# that teardown can abort in Arrow's thread pool ("terminate called without an active exception",
# apache/arrow#34314), after the work is done; it failed CI once
from refinery.runners.quick_exit import end_now
end_now(0)
"""


def test_the_sidecar_is_written_without_importing_pandas() -> None:
    """pyarrow's ``pa.array`` imports pandas (0.4 s) to ask whether its input is a pandas
    object: the writer builds its columns from buffers, the same values, without it."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", SIDECAR_WITHOUT_PANDAS], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
