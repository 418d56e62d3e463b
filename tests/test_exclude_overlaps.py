"""Closing the loop: decon's drop list, prep --exclude-overlaps, and DropOverlaps.

A corpus of GSM8K train problems with GSM8K test questions planted in some documents: decon
lists every planted row, prep with ``--exclude-overlaps`` leaves them out, decon of the
shards' own text finds nothing at that n, and every other document's tokens are the bytes a
plain prep of the same rows writes.
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.testing.test_pipeline import TestPipeline as BeamPipeline  # a Beam class: no Test* name to collect
from apache_beam.testing.util import assert_that, equal_to
from helpers import gsm8k_rows, run_prep, write_jsonl

from refinery.beam_pipelines.cli import main
from refinery.transforms.decon import BuildNgramIndex, DropOverlaps, FindOverlaps
from refinery.transforms.decon.ngrams.details import read_details
from refinery.transforms.formats.droplist import ReadSpec
from refinery.transforms.formats.tiktoken_vocab import get_encoding
from refinery.transforms.io.rows import DEFAULT_MAX_ROW_BYTES, SourceRow, iter_rows
from refinery.transforms.io.text import TEXT_NORMALIZATION

ROOT = Path(__file__).resolve().parents[1]
PREP_SPEC = ReadSpec({"text_field": "text"}, TEXT_NORMALIZATION, DEFAULT_MAX_ROW_BYTES)  # a plain prep's
PLANTED = (3, 40, 77, 150, 151, 260, 333, 420, 555, 598)  # corpus rows that get a test question


def _corpus(tmp_path: Path) -> tuple[Path, Path, set[tuple[str, int]]]:
    """(corpus folder, eval file, planted (file, row)); two files, the first split in units."""
    train, test = gsm8k_rows("train")[:600], gsm8k_rows("test")[:120]
    docs = [{"id": f"doc-{i}", "text": r["question"] + "\n\n" + r["answer"]} for i, r in enumerate(train)]
    for k, i in enumerate(PLANTED):  # the question inside other text, at the start, middle or end
        q = test[k]["question"]
        docs[i]["text"] = (q + "\n" + docs[i]["text"], docs[i]["text"] + " " + q + " More.", q)[k % 3]
    corpus = tmp_path / "corpus"
    write_jsonl(corpus / "a.jsonl", docs[:400])
    write_jsonl(corpus / "b.jsonl", docs[400:])
    evals = write_jsonl(tmp_path / "eval" / "gsm8k" / "test.jsonl",
                        [{"id": f"test-{i}", "text": r["question"]} for i, r in enumerate(test)])
    planted = {(str(corpus / ("a.jsonl" if i < 400 else "b.jsonl")), i if i < 400 else i - 400) for i in PLANTED}
    return corpus, evals, planted


def _decon(train: Path, evals: Path, out: Path, *extra: object) -> int:
    return main(["decon", "--eval", str(evals), "--train", str(train), "--output", str(out), "--ngrams", "8", "13",
                 "--runner", "direct", "--no-progress", "--slice-mb", "0.05", *map(str, extra)])


def _drop_list(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "stats/contaminated_train_docs.jsonl").read_text().splitlines()]


def _shard_texts(output: Path) -> list[str]:
    """Every document of a prep output, decoded (EOS removed), shard by shard."""
    enc, texts = get_encoding(), []
    manifest = json.loads((output / "manifest.json").read_text())
    for s in manifest["shards"]:
        tokens = np.load(output / s["path"])
        ends = np.flatnonzero(tokens == manifest["eos_token_id"])
        start = 0
        for end in ends.tolist():
            texts.append(enc.decode(tokens[start:end].tolist()))
            start = end + 1
    return texts


def test_planted_leaks_are_listed_dropped_and_gone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus, evals, planted = _corpus(tmp_path)
    assert _decon(corpus, evals, tmp_path / "decon") == 0
    listed = _drop_list(tmp_path / "decon")
    at13 = {(str(Path(d["train_path"])), d["train_row"]) for d in listed if 13 in d["ns"]}
    assert planted <= at13  # every planted leak found at n = 13, with its provenance
    by_row = {(d["train_path"], d["train_row"]): d for d in listed}
    # the instances each row overlaps are in decon's details, not repeated in the drop list
    pairs = {(d["train_path"], d["train_row"], d["instance_id"]) for d in read_details(str(tmp_path / "decon"))
             if d["n"] == 13}
    for k, i in enumerate(PLANTED):
        where = (str(corpus / ("a.jsonl" if i < 400 else "b.jsonl")), i % 400 if i < 400 else i - 400)
        d = by_row[where]
        assert d["train_doc_id"] == f"doc-{i}" and 13 in d["ns"] and set(d) == {"train_path", "train_row",
                                                                                  "train_doc_id", "ns", "max_coverage"}
        assert (*where, f"test-{k}") in pairs

    capsys.readouterr()
    assert run_prep([corpus], tmp_path / "clean", "--num-shards", 3, "--unit-mb", 0.02,
                    "--exclude-overlaps", tmp_path / "decon") == 0
    said = capsys.readouterr().out
    manifest = json.loads((tmp_path / "clean" / "manifest.json").read_text())
    rows = manifest["rows"]
    assert rows["excluded"] == len(at13) and rows["read"] == 600
    assert rows["read"] == rows["accepted"] + rows["empty"] + rows["rejected"] + rows["over_budget"] + rows["excluded"]
    assert manifest["excluded_overlaps"]["documents"] == len(at13)
    (run,) = manifest["excluded_overlaps"]["decon_runs"]
    assert run["n"] == 13 and run["listed"] == len(at13) and run["path"] == str((tmp_path / "decon").resolve())
    assert re.search(rf"excluded {len(at13)}\b", said)
    assert main(["verify", str(tmp_path / "clean"), "--checksums"]) == 0
    capsys.readouterr()
    assert main(["info", str(tmp_path / "clean")]) == 0
    assert f"rows overlapping at n=13 in decon {(tmp_path / 'decon').resolve()}" in capsys.readouterr().out

    # no leak is left: decon of the shards' own text finds nothing at 13
    texts = _shard_texts(tmp_path / "clean")
    assert len(texts) == 600 - len(at13)
    write_jsonl(tmp_path / "shard_text" / "docs.jsonl", [{"id": str(i), "text": t} for i, t in enumerate(texts)])
    assert _decon(tmp_path / "shard_text", evals, tmp_path / "decon2") == 0
    assert not [d for d in _drop_list(tmp_path / "decon2") if 13 in d["ns"]]

    # every other document is byte-identical to a plain prep of the same rows
    kept = tmp_path / "kept"
    for name in ("a.jsonl", "b.jsonl"):
        lines = (corpus / name).read_text().splitlines(keepends=True)
        drop = {row for path, row in at13 if path == str(corpus / name)}
        (kept / name).parent.mkdir(exist_ok=True)
        (kept / name).write_text("".join(line for i, line in enumerate(lines) if i not in drop))
    assert run_prep([kept], tmp_path / "plain", "--num-shards", 3) == 0
    plain = json.loads((tmp_path / "plain" / "manifest.json").read_text())
    for got, want in zip(manifest["shards"], plain["shards"], strict=True):
        assert (got["sha256"], got["index_sha256"]) == (want["sha256"], want["index_sha256"])
    print(f"planted {len(PLANTED)}, found {len(planted & at13)}, dropped {rows['excluded']}, left 0")


def test_the_exclusion_resumes_and_a_new_decon_output_replans(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    corpus, evals, _ = _corpus(tmp_path)
    assert _decon(corpus, evals, tmp_path / "decon") == 0
    args = ("--num-shards", 2, "--exclude-overlaps", tmp_path / "decon")
    assert run_prep([corpus], tmp_path / "clean", *args) == 0
    capsys.readouterr()
    assert run_prep([corpus], tmp_path / "clean", *args) == 0
    assert "nothing (all units already done)" in capsys.readouterr().out
    assert run_prep([corpus], tmp_path / "clean", *args, "--exclude-n", 8) == 0  # another n: re-planned
    out = capsys.readouterr().out
    assert "tokenize 1 " in out, out
    at8 = sum(1 for d in _drop_list(tmp_path / "decon") if 8 in d["ns"])
    assert json.loads((tmp_path / "clean" / "manifest.json").read_text())["rows"]["excluded"] == at8


def test_unusable_drop_lists_are_refused_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus, evals, _ = _corpus(tmp_path)
    assert _decon(corpus, evals, tmp_path / "decon") == 0
    capsys.readouterr()

    def refused(*extra: object) -> str:
        assert run_prep([corpus], tmp_path / "out", *extra) == 2
        return capsys.readouterr().err

    assert "not a finished decon output (no .SUCCESS)" in refused("--exclude-overlaps", tmp_path / "nowhere")
    assert "the decon run" in refused("--exclude-overlaps", tmp_path / "decon", "--exclude-n", 5)
    assert "--exclude-n needs --exclude-overlaps" in refused("--exclude-n", 13)
    old = tmp_path / "old"
    old.mkdir()
    (old / ".SUCCESS").write_text("")
    assert "run the same decon command again" in refused("--exclude-overlaps", old)
    with (corpus / "b.jsonl").open("a") as f:  # changed since decon scanned it: row numbers may lie
        f.write(json.dumps({"id": "late", "text": "a new row"}) + "\n")
    err = refused("--exclude-overlaps", tmp_path / "decon")
    assert "b.jsonl: changed since the decon run" in err and "run decon again" in err


def test_drop_overlaps_in_a_pipeline_matches_the_drop_list(tmp_path: Path) -> None:
    corpus, evals, planted = _corpus(tmp_path)
    path = str(corpus / "a.jsonl")
    rows = [SourceRow(path, row, record) for row, record, _ in iter_rows(path) if record is not None]
    eval_rows = [json.loads(line) for line in evals.read_text().splitlines()]
    leaked = {row for p, row in planted if p == path}
    with BeamPipeline() as p:
        train = p | "Train" >> beam.Create(rows)
        index = p | "Eval" >> beam.Create(eval_rows) | BuildNgramIndex(ngrams=[13], eval_dataset="gsm8k")
        kept = train | DropOverlaps(train | FindOverlaps(index))
        assert_that(kept | beam.Map(lambda r: r.row), equal_to([r.row for r in rows if r.row not in leaked]))
        # plain dicts are matched by id
        dicts = p | "Dicts" >> beam.Create([r.record for r in rows])
        kept_dicts = dicts | "DropDicts" >> DropOverlaps(dicts | "FindDicts" >> FindOverlaps(index), ngrams=13)
        assert_that(kept_dicts | beam.Map(lambda r: r["id"]),
                    equal_to([r.record["id"] for r in rows if r.row not in leaked]), label="ByIds")


def test_the_readme_loop_runs_as_printed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    readme = (ROOT / "README.md").read_text().replace("\\\n", " ")
    commands = [shlex.split(line)[1:] for line in readme.splitlines()
                if line.startswith("refinery ") and re.search(r"--output \S+-loop\b", line)]  # the loop's own
    assert [c[0] for c in commands] == ["decon", "prep"]
    monkeypatch.chdir(ROOT)  # the bundled inputs, named as the README names them
    for command in commands:
        command = [str(tmp_path / a) if a.startswith("out/") else a for a in command]
        assert main([*command, "--runner", "direct", "--no-progress"]) == 0
    said = capsys.readouterr().out
    found = re.search(r"rows: read .*excluded \d+", readme)
    assert found is not None, "README shows no prep summary line"
    shown = found.group(0)
    assert shown in said  # the README's figure is what the commands print
    manifest = json.loads((tmp_path / "out/clean-loop/manifest.json").read_text())
    listed = _drop_list(tmp_path / "out/decon-loop")
    at13 = [d for d in listed if 13 in d["ns"]]
    # and the malformed row of edge_cases.jsonl, which decon could not read: excluded too, counted
    unread = (tmp_path / "out/decon-loop/stats/unread_train_rows.jsonl").read_text().splitlines()
    assert [json.loads(line)["train_row"] for line in unread] == [5]
    assert manifest["rows"]["excluded"] == len(at13) + 1 and len(at13) > 0
    assert manifest["excluded_overlaps"]["decon_runs"][0]["unread"] == 1
    # the drop list says what the detail records say, row by row (228 rows, many instances each at n = 5)
    details: dict[tuple[str, int], dict[str, Any]] = {}
    for d in read_details(str(tmp_path / "out/decon-loop")):
        assert "same_text" not in d
        row = details.setdefault((d["train_path"], d["train_row"]), {"doc": d["train_doc_id"], "hits": set()})
        row["hits"].add((d["eval_dataset"], d["n"], d["instance_id"]))
    assert len(listed) == len(details) > 100
    for d in listed:
        want = details[(d["train_path"], d["train_row"])]
        assert d["train_doc_id"] == want["doc"] and "overlaps" not in d  # the instances: in the details only
        assert d["ns"] == sorted({n for _, n, _ in want["hits"]})


def _planted_corpus(tmp_path: Path) -> tuple[Path, Path]:
    """:func:`_corpus` plus ``clean.jsonl``, a file without listed rows, scanned by decon."""
    corpus, evals, _ = _corpus(tmp_path)
    write_jsonl(corpus / "clean.jsonl", [{"id": f"clean-{i}", "text": t} for i, t in
                                         enumerate(r["question"] for r in gsm8k_rows("train")[700:720])])
    assert _decon(corpus, evals, tmp_path / "decon") == 0
    return corpus, evals


def test_inputs_decon_did_not_scan_as_they_are_are_refused_never_used_in_silence(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus, evals = _planted_corpus(tmp_path)
    decon = tmp_path / "decon"
    capsys.readouterr()

    def refused(inputs: list[Path], *extra: object) -> str:
        assert run_prep(inputs, tmp_path / "out", "--exclude-overlaps", decon, *extra) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        return err

    # a file without listed rows, changed after decon (a test question appended): refused, named
    question = gsm8k_rows("test")[50]["question"]
    with (corpus / "clean.jsonl").open("a") as f:
        f.write(json.dumps({"id": "late", "text": question}) + "\n")
    err = refused([corpus])
    assert "1 input file(s) are not what decon scanned" in err and "clean.jsonl: changed since the decon run" in err
    assert "--allow-unscanned-inputs" in err
    # accepted only when asked, loudly, and recorded
    assert run_prep([corpus], tmp_path / "loud", "--exclude-overlaps", decon, "--allow-unscanned-inputs") == 0
    said = capsys.readouterr()
    assert "WARNING: 1 input file(s) not scanned by decon are kept WITHOUT an overlap check" in said.err
    assert "clean.jsonl" in said.err
    manifest = json.loads((tmp_path / "loud" / "manifest.json").read_text())
    assert manifest["excluded_overlaps"]["unscanned_inputs"] == 1
    assert manifest["rows"]["excluded"] == manifest["excluded_overlaps"]["decon_runs"][0]["listed"] > 0

    # a renamed file, or another copy of the corpus: its listed rows would match no input
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (copy / name).write_bytes((corpus / name).read_bytes())
    err = refused([copy])
    assert "2 input file(s) are not what decon scanned" in err and "not scanned by the decon run" in err
    err = refused([copy], "--allow-unscanned-inputs")  # even then: the listed rows would be kept
    assert "contaminated row(s) in 2 file(s) this prep does not read" in err
    (corpus / "b.jsonl").rename(corpus / "b2.jsonl")
    err = refused([corpus / "a.jsonl", corpus / "b2.jsonl"], "--allow-unscanned-inputs")
    assert "in 1 file(s) this prep does not read" in err and "b.jsonl" in err
    # prep of a subset: the rows listed in the other file match no input either
    err = refused([corpus / "a.jsonl"])
    assert "this prep does not read" in err
    assert not (tmp_path / "out").exists()


def _rewrite_recorded(decon: Path, relpath: str, data: bytes) -> None:
    """Replace a decon output file and forge its merge receipt to match (a consistent but wrong record)."""
    import hashlib

    (decon / relpath).write_bytes(data)
    (receipt,) = (decon / ".refinery" / "merge").glob("*/receipts/merge.json")
    r = json.loads(receipt.read_text())
    for f in r["files"]:
        if f["path"] == relpath:
            f["bytes"], f["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    receipt.write_text(json.dumps(r))


def test_an_edited_drop_list_is_refused_and_verify_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus, _ = _planted_corpus(tmp_path)
    decon = tmp_path / "decon"
    docs = decon / "stats" / "contaminated_train_docs.jsonl"
    original = docs.read_bytes()
    capsys.readouterr()
    assert main(["verify", str(decon), "--checksums"]) == 0  # a decon output is accepted by verify
    assert "a refinery decon output" in capsys.readouterr().out

    lines = original.decode().splitlines(keepends=True)
    bumped = re.sub(r'"train_row": (\d)', lambda m: f'"train_row": {(int(m[1]) + 1) % 10}', lines[0], count=1)
    edits = {"a deleted line": "".join(lines[1:]),
             "a changed row number": "".join([bumped, *lines[1:]])}  # the same size: only the sha256 tells
    for what, text in edits.items():
        docs.write_text(text)
        assert run_prep([corpus], tmp_path / "out", "--exclude-overlaps", decon) == 2, what
        err = capsys.readouterr().err
        assert "contaminated_train_docs.jsonl" in err and "edited after decon wrote it" in err, (what, err)
        assert main(["verify", str(decon), "--checksums"]) == 1, what
        assert "mismatch for stats/contaminated_train_docs.jsonl" in capsys.readouterr().out  # size or checksum
    docs.write_bytes(original)
    files = decon / "stats" / "train_files.jsonl"
    files.write_text(files.read_text().replace('"size": ', '"size": 1', 1))  # the scanned sizes: trusted no more
    assert run_prep([corpus], tmp_path / "out", "--exclude-overlaps", decon) == 2
    err = capsys.readouterr().err
    assert "train_files.jsonl" in err and "edited after decon wrote it" in err
    assert not (tmp_path / "out").exists()


def test_a_listed_row_no_input_holds_fails_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A drop list consistent with its receipt that names a row past its file's end (a decon bug,
    or a forged record): the rows met and excluded differ from the rows listed, exit 1."""
    corpus, _ = _planted_corpus(tmp_path)
    decon = tmp_path / "decon"
    docs = decon / "stats" / "contaminated_train_docs.jsonl"
    first = json.loads(docs.read_text().splitlines()[0])
    extra = {**first, "train_row": 99_999}
    forged = docs.read_bytes() + (json.dumps(extra) + "\n").encode()
    _rewrite_recorded(decon, "stats/contaminated_train_docs.jsonl", forged)
    assert run_prep([corpus], tmp_path / "out", "--exclude-overlaps", decon) == 1
    out = capsys.readouterr()
    assert "a listed row matches no row read" in out.out + out.err
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_job_carries_where_the_drop_lists_are_not_their_rows(tmp_path: Path) -> None:
    """The exclusion a job pickles holds the decon outputs and their sha256, not the rows
    (which grow with the contamination) nor what decon scanned; a worker reads the rows back,
    the same ones, and refuses a drop list that changed since the job was planned."""
    import pickle

    from refinery.transforms.io import storage
    from refinery.transforms.prep import exclusion

    corpus, _ = _planted_corpus(tmp_path)
    ex = exclusion.load_exclusion([str(tmp_path / "decon")], read_spec=PREP_SPEC)
    ex.check_inputs(storage.expand_inputs([str(corpus)]))
    worker = pickle.loads(pickle.dumps(ex))
    assert ex.expected is not None
    assert worker.rows is None and worker.scanned == {} and worker.expected == ex.expected > 0
    for f in storage.expand_inputs([str(corpus)]):
        assert worker.rows_of(f.path) == ex.rows_of(f.path)
    exclusion._source_rows.cache_clear()
    docs = tmp_path / "decon" / "stats" / "contaminated_train_docs.jsonl"
    docs.write_text(docs.read_text().replace('"train_row": ', '"train_row": 1', 1))
    late = pickle.loads(pickle.dumps(ex))
    with pytest.raises(storage.InputError, match="changed since this job was planned"):
        late.rows_of(str(corpus / "a.jsonl"))
