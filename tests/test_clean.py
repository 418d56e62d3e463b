"""``refinery clean``: a decontaminated copy of training files in their own format.

A corpus in every format clean copies (``.jsonl`` with the lines row numbering must get
right, ``.jsonl.gz``, ``.jsonl.zst``, ``.parquet`` with several row groups and schema
metadata), GSM8K test questions planted in some rows, one decon run: ``refinery prep`` of
the copy tokenizes the documents ``refinery prep --exclude-overlaps`` of the original
does; kept JSON lines are the original bytes, parquet keeps its schema; reruns and failed
runs finished write the same bytes; what cannot be trusted is refused.
"""
from __future__ import annotations

import gzip
import io
import json
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from helpers import gsm8k_rows, run_prep, tree_digest, write_jsonl
from test_exclude_overlaps import _decon, _rewrite_recorded

from refinery.beam_pipelines.cli import main
from refinery.transforms.clean import stages
from refinery.transforms.clean.stages import RowPlan, UnitLists, copy_jsonl
from refinery.transforms.formats import shards
from refinery.transforms.io import storage
from refinery.transforms.io.rows import iter_rows, jsonl_lines, open_lines

PLANTED = {"a.jsonl": (5, 30), "b.jsonl.gz": (2, 44), "c.jsonl.zst": (17,), "d.parquet": (0, 21, 47)}
BAD_LINES = (3, 9, 12)  # a.jsonl's blank, malformed and all-space lines: unread by decon, so listed
PLANTED_ROWS = {**PLANTED, "a.jsonl": (6, 33)}  # a.jsonl's planted rows once the bad lines are in
JSONL = ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst")
MANIFEST = "_clean_manifest.json"
SCHEMA_META = {b"origin": b"test_clean"}


@dataclass(frozen=True)
class Planted:
    root: Path
    corpus: Path
    evals: Path
    decon: Path


def _docs(rows: list[dict[str, Any]], offset: int, planted: tuple[int, ...],
          questions: list[str]) -> list[dict[str, Any]]:
    """Rows of GSM8K train text, a test question inside each planted row (after a few sentences,
    so that span mode keeps text on both sides)."""
    docs = [{"id": f"doc-{offset + i}", "text": r["question"] + "\n\n" + r["answer"]} for i, r in enumerate(rows)]
    for i in planted:
        docs[i]["text"] = docs[i]["text"] + "\n" + questions.pop() + " That was the question; now the rest."
    return docs


def _make_corpus(root: Path) -> tuple[Path, Path]:
    train, test = gsm8k_rows("train"), gsm8k_rows("test")[:40]
    questions = [r["question"] for r in test]
    corpus = root / "corpus"
    a = _docs(train[:40], 0, PLANTED["a.jsonl"], questions)
    # what row numbering must get right: a blank line (a row, unread: left out), a malformed line,
    # a CRLF line, a line of spaces, and blank lines after the last row (not rows)
    write_jsonl(corpus / "a.jsonl", a, raw_lines={3: "", 9: '{"id": "broken", "text": ', 12: "  \t "})
    lines = (corpus / "a.jsonl").read_bytes().split(b"\n")
    lines[20] += b"\r"
    (corpus / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n\n")
    write_jsonl(corpus / "sub" / "b.jsonl.gz", _docs(train[40:90], 40, PLANTED["b.jsonl.gz"], questions))
    write_jsonl(corpus / "sub" / "c.jsonl.zst", _docs(train[90:120], 90, PLANTED["c.jsonl.zst"], questions))
    d = _docs(train[120:180], 120, PLANTED["d.parquet"], questions)
    table = pa.table({"id": [r["id"] for r in d], "n": pa.array(range(len(d)), pa.int32()),
                      "text": [r["text"] for r in d]}).replace_schema_metadata(SCHEMA_META)
    pq.write_table(table, corpus / "d.parquet", row_group_size=16, compression="zstd")
    evals = write_jsonl(root / "eval" / "gsm8k" / "test.jsonl",
                        [{"id": f"test-{i}", "text": r["question"]} for i, r in enumerate(test)])
    return corpus, evals


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Planted:
    root = tmp_path_factory.mktemp("clean")
    corpus, evals = _make_corpus(root)
    assert _decon(corpus, evals, root / "decon") == 0
    return Planted(root, corpus, evals, root / "decon")


def _clean(train: Path, decon: Path, out: Path, *extra: object) -> int:
    return main(["clean", "--train", str(train), "--exclude-overlaps", str(decon), "--output", str(out),
                 "--runner", "direct", "--no-progress", *map(str, extra)])


def _listed(decon: Path) -> dict[str, set[int]]:
    """The rows a decon run lists at its largest n (13), and those it could not read, by file name."""
    out: dict[str, set[int]] = {}
    for name in ("contaminated_train_docs.jsonl", "unread_train_rows.jsonl"):
        for line in (decon / "stats" / name).read_text().splitlines():
            d = json.loads(line)
            if "ns" not in d or 13 in d["ns"]:
                out.setdefault(Path(d["train_path"]).name, set()).add(d["train_row"])
    return out


def _token_docs(out: Path) -> Counter[tuple[int, ...]]:
    """Every document of a prep output as its token sequence (a multiset)."""
    manifest = json.loads((out / "manifest.json").read_text())
    docs: Counter[tuple[int, ...]] = Counter()
    for s in manifest["shards"]:
        tokens = np.load(out / s["path"])
        for a, b in shards.read_idx(str(out / s["index_path"])).tolist():
            docs[tuple(tokens[a:b].tolist())] += 1
    return docs


def _read(path: Path) -> bytes:
    data = path.read_bytes()
    if path.name.endswith(".gz"):
        return gzip.decompress(data)
    if path.name.endswith(".zst"):
        return zstandard.ZstdDecompressor().decompressobj().decompress(data)
    return data


def _lines(data: bytes) -> list[bytes]:
    """``data``'s lines with their ends (``\\r\\n`` one line)."""
    parts = data.split(b"\n")
    return [p + b"\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _relpath(name: str) -> str:
    return name if name in ("a.jsonl", "d.parquet") else f"sub/{name}"


def test_row_mode_copy_tokenizes_to_what_prep_exclude_overlaps_keeps(planted: Planted, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    listed = _listed(planted.decon)
    for name, rows in PLANTED_ROWS.items():
        assert set(rows) <= listed[name], name  # decon found every planted row
    assert set(BAD_LINES) <= listed["a.jsonl"]
    out = tmp_path / "clean"
    capsys.readouterr()
    assert _clean(planted.corpus, planted.decon, out) == 0
    said = capsys.readouterr()
    assert "clean: 4 training file(s) ->" in said.err and "excluding" in said.err
    total = sum(map(len, listed.values()))
    assert f"left out {total} + rejected 0\n" in said.out and f"manifest: {out / MANIFEST}" in said.out
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["mode"] == "row" and manifest["totals"]["rows_left_out"] == total
    assert manifest["excluded_overlaps"]["documents"] == total
    by_file = {Path(f["train_path"]).name: f for f in manifest["files"]}
    for name, f in by_file.items():
        assert f["output_path"] == _relpath(name) and f["rows_left_out"] == len(listed[name])
        assert f["rows_read"] == f["rows_kept"] + f["rows_left_out"]
    assert (out / ".SUCCESS").exists()

    # kept JSON lines are the original bytes, in order; the listed rows are gone
    for name in JSONL:
        original = _lines(_read(planted.corpus / _relpath(name)))
        want = b"".join(line for i, line in enumerate(original) if i not in listed[name])
        assert _read(out / _relpath(name)) == want, name
    assert b"\r\n" in _read(out / "a.jsonl") and _read(out / "a.jsonl").endswith(b"\n\n")
    # parquet: the same schema (order, types, metadata), the kept rows in order
    src, copy = pq.ParquetFile(planted.corpus / "d.parquet"), pq.ParquetFile(out / "d.parquet")
    assert copy.schema_arrow.equals(src.schema_arrow, check_metadata=True)
    assert copy.schema_arrow.metadata[b"origin"] == b"test_clean"
    assert copy.metadata.row_group(0).column(0).compression == "ZSTD"
    rows = src.read().to_pylist()
    assert copy.read().to_pylist() == [r for i, r in enumerate(rows) if i not in listed["d.parquet"]]

    # prep of the copy: the documents prep --exclude-overlaps keeps of the original
    assert run_prep([out], tmp_path / "prep_clean", "--num-shards", 2) == 0
    assert run_prep([planted.corpus], tmp_path / "prep_excl", "--num-shards", 2,
                    "--exclude-overlaps", planted.decon) == 0
    docs, excluded = _token_docs(tmp_path / "prep_clean"), _token_docs(tmp_path / "prep_excl")
    assert docs == excluded and sum(excluded.values()) == 180 - total + len(BAD_LINES)


SPAN = ("--exclude-mode", "span", "--exclude-window", 5, "--exclude-min-chars", 10)


def test_span_mode_copy_tokenizes_to_what_prep_span_mode_keeps(planted: Planted, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    listed = _listed(planted.decon)
    out = tmp_path / "clean"
    capsys.readouterr()
    assert _clean(planted.corpus, planted.decon, out, *SPAN) == 0
    said = capsys.readouterr()
    assert "cutting the overlapping passages (\u00b15 characters) out of" in said.err
    manifest = json.loads((out / MANIFEST).read_text())
    t = manifest["totals"]
    assert manifest["mode"] == "span" and t["rows_left_out"] == sum(map(len, listed.values()))
    assert t["rows_split"] == sum(map(len, PLANTED.values())) and t["pieces"] >= t["rows_split"]
    assert t["rows_dropped"] == len(BAD_LINES) and t["chars_removed"] > 0
    assert f"split {t['rows_split']} into {t['pieces']} piece(s)" in said.out
    assert manifest["excluded_overlaps"]["mode"] == "span" and manifest["excluded_overlaps"]["window"] == 5

    # each piece is its row with the text cut and the id ID@START; every other line as it was
    for name in JSONL:
        original = _lines(_read(planted.corpus / _relpath(name)))
        copy = _lines(_read(out / _relpath(name)))
        kept = [line for i, line in enumerate(original) if i not in listed[name]]
        assert [line for line in copy if line in kept] == kept
        pieces = [json.loads(line) for line in copy if line not in kept]
        by_id = {json.loads(original[row])["id"]: json.loads(original[row]) for row in PLANTED_ROWS[name]}
        assert pieces and all(p["id"].split("@")[0] in by_id for p in pieces)
        for p in pieces:
            row_id, start = p["id"].split("@")
            assert by_id[row_id]["text"][int(start):].startswith(p["text"]) and set(p) == {"id", "text"}
    src, copy_pq = pq.ParquetFile(planted.corpus / "d.parquet"), pq.ParquetFile(out / "d.parquet")
    assert copy_pq.schema_arrow.equals(src.schema_arrow, check_metadata=True)
    ids = [r["id"] for r in copy_pq.read().to_pylist()]
    assert [i for i in ids if "@" in i] and all(f"doc-{120 + r}" not in ids for r in PLANTED["d.parquet"])

    assert run_prep([out], tmp_path / "prep_clean", "--num-shards", 2) == 0
    assert run_prep([planted.corpus], tmp_path / "prep_span", "--num-shards", 2,
                    "--exclude-overlaps", planted.decon, *SPAN) == 0
    assert _token_docs(tmp_path / "prep_clean") == _token_docs(tmp_path / "prep_span")


def test_rerun_is_a_no_op_and_a_failed_run_finished_writes_the_same_bytes(
        planted: Planted, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    first = tmp_path / "first"
    assert _clean(planted.corpus, planted.decon, first) == 0
    digest = tree_digest(first)
    capsys.readouterr()
    assert _clean(planted.corpus, planted.decon, first) == 0
    assert "nothing (all units already done)" in capsys.readouterr().out
    assert tree_digest(first) == digest

    real = stages.copy_file

    def lost_mount(path: str, *args: Any) -> Any:
        if path.endswith("c.jsonl.zst"):
            raise OSError(f"{path}: injected: the mount went away")
        return real(path, *args)

    second = tmp_path / "second"
    monkeypatch.setattr(stages, "copy_file", lost_mount)
    assert _clean(planted.corpus, planted.decon, second) == 1
    err = capsys.readouterr().err
    assert "injected: the mount went away" in err and "run the same command again" in err
    assert not (second / MANIFEST).exists() and not (second / ".SUCCESS").exists()
    assert not (second / "sub" / "c.jsonl.zst").exists() and (second / "d.parquet").exists()
    monkeypatch.setattr(stages, "copy_file", real)
    assert _clean(planted.corpus, planted.decon, second) == 0
    assert "clean 1 " in capsys.readouterr().out  # only the failed unit ran again
    assert tree_digest(second) == digest


def _numbered(path: str, max_row_bytes: int) -> list[tuple[int, Any]]:
    """(row, record or reason) as iter_rows reads ``path``."""
    return [(row, record if error is None else error)
            for row, record, error in iter_rows(path, max_row_bytes=max_row_bytes)]


def _cut_short(data: bytes) -> bytes:
    return data[:len(data) // 2]


def test_jsonl_lines_are_the_rows_of_iter_rows_with_their_bytes(tmp_path: Path) -> None:
    """clean copies the lines of the one JSON lines reader, whose rows iter_rows gives (decon's
    and prep's numbering): blank and all-space lines, CRLF, a line over the row cap, a last line
    without a newline, blank lines at the end (no rows, but lines), a gzip cut short."""
    cap = 120
    body = [b'{"id": "0", "text": "zero"}\n', b"\n", b'{"id": "2", "text": "two"}\r\n', b" \t\n",
            b'{"id": "4", "text": "' + b"x" * 300 + b'"}\n', b"not json\n", b'{"id": "6", "text": "six"}\n']
    many = [json.dumps({"id": str(i), "text": f"row {i} of {i * 7919 % 10007}"}).encode() + b"\n"
            for i in range(2000)]
    cases = {"end.jsonl": b"".join(body) + b'{"id": "7", "text": "no newline"}',
             "trailing.jsonl": b"".join(body) + b"\n \n",
             "cut.jsonl.gz": _cut_short(gzip.compress(b"".join(body + many), mtime=0))}
    for name, data in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        with open_lines(str(path), compression="infer") as f:
            lines = list(jsonl_lines(f, cap))
        assert [(r.row, r.record if r.error is None else r.error) for r in lines if r.row is not None] == \
            _numbered(str(path), cap), name
        whole = [r.line for r in lines if r.line is not None]
        if name != "cut.jsonl.gz":  # every line's bytes but the long one's, in order
            assert b"".join(whole) == data.replace(body[4], b""), name
    assert [r.line for r in lines[:3]] == body[:3] and str(lines[-1].error).startswith("corrupt file after")

    # the copy: a kept line is its bytes; a listed line is left out; a line decon read no text of (the
    # all-space line, the one over the cap) is left out and listed with its reason
    path = tmp_path / "end.jsonl"
    buf, rejects = io.BytesIO(), io.BytesIO()
    with open_lines(str(path)) as f:
        stats = copy_jsonl(jsonl_lines(f, cap), buf, RowPlan(frozenset({1, 2, 5})), str(path), UnitLists(rejects))
    original = _lines(cases["end.jsonl"])
    assert buf.getvalue() == b"".join(line for i, line in enumerate(original) if i not in {1, 2, 3, 4, 5})
    assert stats == {"rows_read": 8, "rows_kept": 3, "rows_left_out": 3, "rows_rejected": 2,
                     "rejected_reasons": {"blank line": 1, f"row too large: more than {cap} bytes": 1}}
    assert [json.loads(line)["row"] for line in rejects.getvalue().splitlines()] == [3, 4]

    # a file cut short: copied up to the damage when decon listed it (its last row), else refused
    cut = tmp_path / "cut.jsonl.gz"
    last, reason = _numbered(str(cut), cap)[-1]
    with open_lines(str(cut), compression="infer") as f:
        buf = io.BytesIO()
        stats = copy_jsonl(jsonl_lines(f, cap), buf, RowPlan(frozenset({1, 3, 4, 5, last})), str(cut))
    assert stats["corrupt"] == reason and stats["rows_left_out"] == 5 and stats["rows_read"] == last + 1
    assert _lines(buf.getvalue()) == [line for i, line in enumerate(_lines(b"".join(body + many))[:last])
                                      if i not in {1, 3, 4, 5}]
    with open_lines(str(cut), compression="infer") as f, pytest.raises(storage.InputError, match="decon did not list"):
        copy_jsonl(jsonl_lines(f, cap), io.BytesIO(), RowPlan(frozenset({1, 3, 4, 5})), str(cut))


def test_what_cannot_be_trusted_is_refused(planted: Planted, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    def refused(*args: object) -> str:
        assert main(["clean", *map(str, args), "--runner", "direct", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        return err

    out = tmp_path / "out"
    base = ("--train", planted.corpus, "--exclude-overlaps", planted.decon, "--output", out)
    capsys.readouterr()
    assert "--exclude-mode span takes --text-field, not --text-template" in refused(
        *base, "--exclude-mode", "span", "--text-template", "{text}")
    assert "give --exclude-overlaps" in refused("--train", planted.corpus, "--output", out)
    assert "is inside the input" in refused(*base[:4], "--output", planted.corpus / "clean")
    # an input clean cannot copy in its own format
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "x.json").write_text('[{"id": "1", "text": "a"}]')
    assert "x.json: clean writes a copy in the file's own format" in refused(
        "--train", odd, "--exclude-overlaps", planted.decon, "--output", out)

    # a decon output edited after decon wrote it, and an input changed since decon scanned it
    decon = tmp_path / "decon"
    shutil.copytree(planted.decon, decon)
    docs = decon / "stats" / "contaminated_train_docs.jsonl"
    docs.write_text("".join(docs.read_text().splitlines(keepends=True)[1:]))
    err = refused("--train", planted.corpus, "--exclude-overlaps", decon, "--output", out)
    assert "contaminated_train_docs.jsonl" in err and "edited after decon wrote it" in err
    corpus = tmp_path / "corpus"
    shutil.copytree(planted.corpus, corpus)
    assert _decon(corpus, planted.evals, tmp_path / "decon2") == 0

    # a listed row no input holds (a drop list consistent with its receipt): the run fails, no manifest
    shutil.copytree(tmp_path / "decon2", tmp_path / "forged")
    drop = tmp_path / "forged" / "stats" / "contaminated_train_docs.jsonl"
    first = json.loads(drop.read_text().splitlines()[0])
    _rewrite_recorded(tmp_path / "forged", "stats/contaminated_train_docs.jsonl",
                      drop.read_bytes() + (json.dumps({**first, "train_row": 99_999}) + "\n").encode())
    capsys.readouterr()
    assert _clean(corpus, tmp_path / "forged", out) == 1
    said = capsys.readouterr()
    assert "a listed row matches no row read" in said.out + said.err
    assert not (out / MANIFEST).exists() and not (out / ".SUCCESS").exists()

    with (corpus / "sub" / "c.jsonl.zst").open("ab") as f:
        f.write(zstandard.ZstdCompressor().compress(b'{"id": "late", "text": "added after decon"}\n'))
    err = refused("--train", corpus, "--exclude-overlaps", tmp_path / "decon2", "--output", tmp_path / "out2")
    assert "c.jsonl.zst: changed since the decon run" in err
    assert not (tmp_path / "out2").exists()



# ---------------------------------------------------------------------------------------
# Rows decon read no text of are left out, counted and listed (issue 58, item 4)
# ---------------------------------------------------------------------------------------

UNREADABLE = {  # a.jsonl row -> why decon (and prep) read no text of it; each row holds a test question
    2: "text field 'text' is dict, not a string",
    4: "text field 'text' is list, not a string",
    6: "text field 'text' is NoneType, not a string",
    8: "missing text field 'text'",
    10: "text field 'text' message 0 'content' is list, not a string",
}
STRUCT = "text field 'text' is dict, not a string"


def _unreadable_corpus(root: Path) -> tuple[Path, Path, list[str]]:
    """A JSON lines file whose rows 2, 4, 6, 8, 10 hold a test question where decon reads no
    text (an object, a list, null, beside the text field, multi-part chat content) and whose
    row 12 is a readable chat; a parquet file whose text column is a struct (no row readable,
    one holding a test question)."""
    train, test = gsm8k_rows("train")[200:240], gsm8k_rows("test")[50:56]
    questions = [r["question"] for r in test]
    rows: list[dict[str, Any]] = [{"id": f"u-{i}", "text": r["question"] + "\n\n" + r["answer"]}
                                  for i, r in enumerate(train[:20])]
    rows[2]["text"] = {"en": questions[0]}
    rows[4]["text"] = [questions[1], "and more"]
    rows[6] = {"id": "u-6", "text": None, "body": questions[2]}
    rows[8] = {"id": "u-8", "question": questions[3]}
    rows[10]["text"] = [{"role": "user", "content": [{"type": "text", "text": questions[4]}]}]
    rows[12]["text"] = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there"}]
    corpus = root / "corpus"
    write_jsonl(corpus / "a.jsonl", rows)
    structs = [{"en": r["question"]} for r in train[20:40]]
    structs[7] = {"en": questions[5]}
    pq.write_table(pa.table({"id": [f"p-{i}" for i in range(20)], "text": structs}), corpus / "s.parquet")
    evals = write_jsonl(root / "eval" / "gsm8k" / "test.jsonl",
                        [{"id": f"test-{i}", "text": q} for i, q in enumerate(questions)])
    return corpus, evals, questions


def test_rows_decon_read_no_text_of_are_left_out_counted_and_listed(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    corpus, evals, questions = _unreadable_corpus(tmp_path)
    assert _decon(corpus, evals, tmp_path / "decon") == 0
    listed = _listed(tmp_path / "decon")
    assert not listed.get("s.parquet") and not set(UNREADABLE) & listed.get("a.jsonl", set())  # counted, not listed
    out = tmp_path / "clean"
    capsys.readouterr()
    assert _clean(corpus, tmp_path / "decon", out) == 0
    said = capsys.readouterr()
    left = len(listed.get("a.jsonl", ()))
    assert f"rows read 40 = kept {15 - left} + left out {left} + rejected 25\n" in said.out, said.out
    assert f"25 row(s) decon read no text of (--text-field text): listed in {out / '_clean_rejects.jsonl'}" \
        in said.out
    manifest = json.loads((out / MANIFEST).read_text())
    by_file = {Path(f["train_path"]).name: f for f in manifest["files"]}
    assert (by_file["a.jsonl"]["rows_rejected"], by_file["a.jsonl"]["rows_kept"]) == (5, 15 - left)
    assert (by_file["s.parquet"]["rows_rejected"], by_file["s.parquet"]["rows_kept"]) == (20, 0)
    assert by_file["a.jsonl"]["rejected_reasons"] == {why: 1 for why in UNREADABLE.values()}
    assert by_file["s.parquet"]["rejected_reasons"] == {STRUCT: 20}
    assert manifest["totals"]["rows_rejected"] == 25 and manifest["rejects"] == {
        "path": "_clean_rejects.jsonl", "rows": 25, "reasons": {STRUCT: 21, **{why: 1 for why in UNREADABLE.values()
                                                                               if why != STRUCT}}}
    rejects = [json.loads(line) for line in (out / "_clean_rejects.jsonl").read_text().splitlines()]
    want = [{"path": str(corpus / "a.jsonl"), "row": i, "reason": why} for i, why in UNREADABLE.items()]
    assert rejects == want + [{"path": str(corpus / "s.parquet"), "row": i, "reason": STRUCT} for i in range(20)]
    # the copy holds no test question, and only rows decon read: the readable chat row is kept
    copy = (out / "a.jsonl").read_text()
    assert not any(q in copy for q in questions) and '"u-12"' in copy
    table = pq.read_table(out / "s.parquet")
    assert table.num_rows == 0 and table.schema.equals(pq.read_schema(corpus / "s.parquet"))
    # prep of the copy: the documents prep --exclude-overlaps keeps of the original, and nothing rejected
    assert run_prep([out], tmp_path / "prep_clean", "--num-shards", 2) == 0
    assert json.loads((tmp_path / "prep_clean" / "manifest.json").read_text())["rows"]["rejected"] == 0
    assert run_prep([corpus], tmp_path / "prep_excl", "--num-shards", 2, "--exclude-overlaps",
                    tmp_path / "decon", "--max-reject-rate", 1) == 0
    assert _token_docs(tmp_path / "prep_clean") == _token_docs(tmp_path / "prep_excl")


def test_a_decon_output_that_read_no_training_text_is_refused(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Multi-part chat content only: decon used 0 of the rows (and exits 1, its run failed, or 0
    with --max-reject-rate 1); clean refuses its output, naming it, instead of copying every row."""
    corpus = write_jsonl(tmp_path / "chat" / "c.jsonl", [
        {"id": f"c-{i}", "text": [{"role": "user", "content": [{"type": "text", "text": r["question"]}]}]}
        for i, r in enumerate(gsm8k_rows("train")[:6])]).parent
    evals = write_jsonl(tmp_path / "eval" / "test.jsonl", [{"id": "t", "text": gsm8k_rows("test")[0]["question"]}])
    assert _decon(corpus, evals, tmp_path / "failed") == 1
    assert _decon(corpus, evals, tmp_path / "passed", "--max-reject-rate", 1) == 0
    capsys.readouterr()
    for decon in ("failed", "passed"):
        assert _clean(corpus, tmp_path / decon, tmp_path / f"out-{decon}") == 2
        err = capsys.readouterr().err
        assert f"--exclude-overlaps {tmp_path / decon}: " in err and len(err.strip().splitlines()) == 1, err
        assert decon == "failed" or "decon used 0 of the 6 training row(s) it read" in err, err
        assert not (tmp_path / f"out-{decon}").exists()


# ---------------------------------------------------------------------------------------
# The output folder holds the copy and nothing else (issue 58, item 5)
# ---------------------------------------------------------------------------------------

def test_an_output_holding_other_files_or_an_input_is_refused(planted: Planted, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    def refused(train: Path, decon: Path, out: Path, *extra: object) -> str:
        assert _clean(train, decon, out, *extra) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        return err

    capsys.readouterr()
    # a raw contaminated file in the folder: a tokenizer pointed at it would read it with the copy
    raw = tmp_path / "raw" / "leak.jsonl"
    raw.parent.mkdir()
    shutil.copy(planted.corpus / "a.jsonl", raw)
    err = refused(planted.corpus, planted.decon, raw.parent)
    assert f"--output {raw.parent} holds {raw}, which is not a file of a clean run of these inputs" in err, err
    assert not (raw.parent / MANIFEST).exists()
    # the inputs themselves as a subfolder of the output
    nested = tmp_path / "nested"
    shutil.copytree(planted.corpus, nested / "corpus")
    err = refused(planted.corpus, planted.decon, nested)
    assert f"--output {nested} holds {nested / 'corpus' / 'a.jsonl'}, which is not a file of a clean run" in err
    assert "(and 3 more)" in err

    # an output that contains an input (decon scanned it there): clean would write beside, or over, its inputs
    inside = tmp_path / "inside"
    shutil.copytree(planted.corpus, inside / "corpus")
    assert _decon(inside / "corpus", planted.evals, tmp_path / "decon-inside") == 0
    capsys.readouterr()
    err = refused(inside / "corpus", tmp_path / "decon-inside", inside)
    assert f"--output {inside} holds the input {inside / 'corpus' / 'a.jsonl'}" in err, err
    assert sorted(p.name for p in inside.iterdir()) == ["corpus"]
    err = refused(inside / "corpus" / "a.jsonl", tmp_path / "decon-inside", inside / "corpus")
    assert f"--output {inside / 'corpus'} holds the input {inside / 'corpus' / 'a.jsonl'}" in err, err

    # an earlier clean run of the same inputs is no problem (a rerun, a killed run finished); of other
    # inputs, its files are others (--force takes the record's place, not the files')
    out = tmp_path / "out"
    assert _clean(planted.corpus, planted.decon, out) == 0
    assert _clean(planted.corpus, planted.decon, out) == 0
    (out / "sub" / (".b.jsonl.gz.tmp-host-123-" + "0" * 32)).write_bytes(b"")  # a killed writer's temp file
    assert _clean(planted.corpus, planted.decon, out) == 0
    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(planted.corpus / "d.parquet", one / "d.parquet")
    assert _decon(one, planted.evals, tmp_path / "decon-one") == 0
    capsys.readouterr()
    err = refused(one, tmp_path / "decon-one", out, "--force")
    assert f"--output {out} holds {out / 'a.jsonl'}, which is not a file of a clean run of these inputs" in err
