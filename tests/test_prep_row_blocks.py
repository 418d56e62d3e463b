"""Rows read and tokenized many at a time give what rows read and tokenized one by one gave.

The JSON lines reader reads blocks (``rows.line_blocks``: a ``read1`` at a time, split at
``\\n``) and parses them in one loop (``rows.parse_json_lines``); prep's tokenize unit takes a
block's plain ASCII lines (``rows.plain_json_lines``) through a short path and computes the
shards of a batch at once (``documents.shards_of``). Each is compared here, on seeded fuzz,
with the rule as the reader stated it line by line (``readline`` and ``parse_json_line``)
and with ``normalize_row`` and ``encode_document`` row by row."""
from __future__ import annotations

import gzip
import json
import random
from io import BufferedIOBase
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from refinery.transforms.formats import provenance, shards
from refinery.transforms.formats.encoders import load_tokenizer
from refinery.transforms.io import rows, storage
from refinery.transforms.io.text import _ASCII_CLEAN
from refinery.transforms.prep import documents
from refinery.transforms.prep.documents import Document, encode_document, normalize_row, shard_of, shards_of
from refinery.transforms.prep.stages import PrepConfig, build_stages
from refinery.transforms.resumable import bind_stages, execute_unit

CAP = 40


def _reference_rows(f: BufferedIOBase, cap: int) -> list[tuple[int | None, bytes | None, rows.Row | None]]:
    """(row or None, line with its end, the row) of each line, as the reader read them before
    blocks: ``readline(cap + 1)``, a longer line skipped, the blank lines that end the file no rows."""
    items: list[bytes | None] = []
    while line := f.readline(cap + 1):
        if len(line) <= cap or line.endswith(b"\n"):
            items.append(line)
        else:
            while not line.endswith(b"\n") and (line := f.readline(7)):
                pass
            items.append(None)
    last = len(items)
    while last and (end := items[last - 1]) is not None and not end.strip(b" \t\n\r"):
        last -= 1
    out: list[tuple[int | None, bytes | None, rows.Row | None]] = []
    for i, item in enumerate(items):
        if i >= last:
            out.append((None, item, None))
            continue
        record, error = (None, rows.too_large(cap)) if item is None else rows.parse_json_line(item)
        out.append((i, item, (i, record, error)))
    return out


def _fuzz_lines(rnd: random.Random) -> list[bytes]:
    pieces = [b'{"text": "a"}', b'{"text": "' + b"x" * CAP + b'"}', b"", b"  ", b"\t", b"\r", b"not json",
              b'{"text": "\\u00e9", "id": 1}', b'[1, 2]', b'{"a": {"b": [1]}}', b'{"n": 1e400}',
              b'{"id": 123456789012345678901234, "text": "big"}', b'{"text": "caf\xc3\xa9"}', b"\xff\xfe",
              b'{"text": "' + b"y" * (3 * CAP) + b'"}', b'{"t": "\x7f"}', b'{"a": 1, "a": 2}']
    lines = [rnd.choice(pieces) + rnd.choice([b"\n", b"\r\n"]) for _ in range(rnd.randint(0, 30))]
    if lines and rnd.random() < 0.5:
        lines[-1] = lines[-1].rstrip(b"\r\n")  # no newline at the end
    return lines + [rnd.choice([b"\n", b" \n", b"\r\n"]) for _ in range(rnd.randint(0, 2))]


@pytest.mark.parametrize("piece", [1, 2, 5, 13, 64, 1 << 20])
def test_line_blocks_give_the_rows_and_lines_readline_gave(tmp_path: Path, piece: int,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    rnd = random.Random(piece)
    for n in range(60):
        data = b"".join(_fuzz_lines(rnd))
        path = tmp_path / (f"f{n}.jsonl.gz" if n % 3 == 0 else f"f{n}.jsonl")
        path.write_bytes(gzip.compress(data, mtime=0) if n % 3 == 0 else data)
        with rows.open_lines(str(path), "infer") as f:
            expected = _reference_rows(f, CAP)
        monkeypatch.setattr(rows, "READ_BYTES", piece)
        assert list(rows.iter_rows(str(path), max_row_bytes=CAP)) == [r for _, _, r in expected if r], data
        with rows.open_lines(str(path), "infer") as f:
            got = [(x.row, x.line, x.record, x.error) for x in rows.jsonl_lines(f, CAP)]
        assert got == [(row, line, *(r[1:] if r else (None, None))) for row, line, r in expected], data
        if n % 3:  # byte ranges: every row once, numbered on
            cuts = sorted({0, len(data), *rnd.sample(range(len(data) + 1), min(3, len(data) + 1))})
            joined: list[rows.Row] = []
            for lo, hi in zip(cuts, cuts[1:]):
                joined += [(len(joined) + r, rec, err) for r, rec, err in
                           rows.iter_rows(str(path), byte_range=(lo, hi), max_row_bytes=CAP)]
            assert joined == [r for _, _, r in expected if r], (data, cuts)
        monkeypatch.undo()


def test_a_truncated_gzip_keeps_every_row_it_completed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = b"".join(json.dumps({"text": f"row {i} " + "w" * (i % 50)}).encode() + b"\n" for i in range(3000))
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(gzip.compress(data, mtime=0)[:-2000])
    with rows.open_lines(str(path), "infer") as f:  # readline: the rows before the damage
        before = 0
        try:
            while f.readline(1 << 20).endswith(b"\n"):
                before += 1
        except EOFError:
            pass
    for piece in (1 << 20, 4096, 7):
        monkeypatch.setattr(rows, "READ_BYTES", piece)
        got = list(rows.iter_rows(str(path)))
        assert [e for _, _, e in got[:-1]] == [None] * before and len(got) == before + 1
        assert str(got[-1][2]).startswith(f"corrupt file after {before} rows: EOFError")


def test_plain_json_lines_hold_only_text_normalize_text_only_strips() -> None:
    rnd = random.Random(3)
    alphabet = ["a", " ", "\n", "\t", "\r", "\x00", "\x7f", "\x85", "\u00e9", "\\", '"', "/", "\b", "\f", "\ud800"]
    for _ in range(5000):
        value = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 8)))
        line = json.dumps({"text": value, "id": value}, ensure_ascii=rnd.random() < 0.5).encode(
            "utf-8", "surrogatepass")
        plain = rows.plain_json_lines([line])[0]
        holds_plain = value.isascii() and not value.encode("ascii").translate(None, _ASCII_CLEAN)
        assert plain == holds_plain, line
    assert rows.plain_json_lines([None, b'{"t": "a\\\\u"}', b'{"t": "a\\\\\\u00e9"}', b'{"t": "\\r"}']) == \
        [False, True, False, False]


def test_shards_of_is_shard_of_each() -> None:
    ids = ["", "a", "\u00e9", "\ud800x", *(f"doc-{i}" for i in range(500))]
    for n in (1, 3, 8, 1 << 20):
        assert shards_of(ids, n).tolist() == [shard_of(i, n) for i in ids]
    assert shards_of([], 8).tolist() == []


def _corpus_rows(rnd: random.Random) -> list[bytes]:
    texts = ["plain text", "  padded\tand\nnewlines  ", "", "   ", "caf\u00e9", "e\u0301", "tab\there", "a\x7fb",
             "cr\r\nlf", "nul\x00", "\u4e2d\u6587", "\U0001f600 emoji", "back\\slash", 'quote"d', "sl/ash", "\x85x"]
    out = []
    for i in range(400):
        record: dict[str, Any] = {"text": rnd.choice(texts) + f" {i}" * rnd.randint(0, 3)}
        r = rnd.random()
        if r < 0.6:
            record["id"] = f"d{i}"
        elif r < 0.7:
            record["id"] = i
        elif r < 0.75:
            record["id"] = None
        elif r < 0.8:
            record["text"] = 5
        out.append(json.dumps(record, ensure_ascii=rnd.random() < 0.5).encode() + b"\n")
        if rnd.random() < 0.03:
            out.append(rnd.choice([b"\n", b"bad json\n", b'{"text": "' + b"z" * 600 + b'"}\n']))
    return out


def test_tokenize_by_blocks_writes_the_documents_of_normalize_row_one_by_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small blocks and batches (a batch encoded mid-block, by a plain row and by another)."""
    monkeypatch.setattr(rows, "READ_BYTES", 257)
    monkeypatch.setattr("refinery.transforms.prep.stages.tokenize_rows.BATCH_CHARS", 90)
    lines = _corpus_rows(random.Random(11))
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(b"".join(lines))
    cfg = PrepConfig(storage.expand_inputs([str(folder)]), str(tmp_path / "out"), "t", num_shards=3,
                     max_row_bytes=500)
    for run in bind_stages(build_stages(cfg), cfg.output):
        for unit in run.stage.plan():
            assert execute_unit(run, unit)["status"] == "completed"
    tok = load_tokenizer(cfg.tokenizer, cfg.encoder)
    expected: dict[int, list[tuple[str, int, list[int]]]] = {s: [] for s in range(3)}
    path = str(folder / "a.jsonl")
    for row, line in enumerate(b"".join(lines).splitlines(keepends=True)):
        record, error = (None, "too large") if len(line) > 501 else rows.parse_json_line(line)
        doc = normalize_row(record, error, "text", "id", path, row, "a.jsonl")
        if isinstance(doc, Document):
            expected[shard_of(doc.doc_id, 3)].append((doc.doc_id, row, encode_document(tok, doc.text).tolist()))
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["rows"]["accepted"] == sum(map(len, expected.values())) > 250
    for entry in manifest["shards"]:
        reader = shards.ShardReader(str(tmp_path / "out" / entry["path"]))
        names = [provenance.read_doc(str(tmp_path / "out" / entry["docs_path"]), i) for i in range(len(reader))]
        got = [(n["doc_id"], n["row"], reader.document(i).tolist()) for i, n in enumerate(names)]
        assert got == expected[entry["shard"]]


def _blocks(path: str) -> Iterator[rows.RowBlock]:
    return rows.iter_row_blocks(path, max_row_bytes=CAP)


def test_row_blocks_of_other_formats_are_their_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rows, "BLOCK_ROWS", 3)
    path = tmp_path / "a.json"
    path.write_text(json.dumps([{"text": str(i)} for i in range(8)] + [5]))
    blocks = list(_blocks(str(path)))
    assert [b.first for b in blocks] == [0, 3, 6] and all(b.lines is None for b in blocks)
    assert [x for b in blocks for x in zip(range(b.first, b.first + 9), b.records, b.errors)] == \
        list(rows.iter_rows(str(path), max_row_bytes=CAP))
    assert np.array_equal([len(b.records) for b in blocks], [3, 3, 3])
    assert documents.BATCH_CHARS == 1 << 20  # (the module's own, untouched by the test above)


@pytest.mark.parametrize("kind", ["ascii", "unicode", "surrogate"])
def test_a_batch_of_names_is_spilled_as_documents_one_by_one_spill_them(kind: str) -> None:
    import io

    from refinery.transforms.prep import spill

    rnd = np.random.default_rng(5)
    n = 300
    odd = {"ascii": "x", "unicode": "\u00e9\u4e2d", "surrogate": "\ud800"}[kind]
    ids = [f"id-{i}" + (odd if i % 7 == 0 else "") for i in range(n)]
    sources = [f"/in/{'b' if i > 150 else 'a'}{odd if i % 11 == 0 else ''}.jsonl" for i in range(n)]
    doc_shards = rnd.integers(0, 4, n).astype(np.uint32)
    lengths = rnd.integers(1, 5, n).astype(np.uint32)
    outs = {}
    for how in ("one by one", "batches"):
        tokens_out, names_out = io.BytesIO(), io.BytesIO()
        w = spill.SpillWriter(tokens_out, names_out=names_out)  # (runs flushed at the end only)
        for lo in range(0, n, 64):
            hi = min(lo + 64, n)
            if how == "one by one":
                for i in range(lo, hi):
                    w.add(int(doc_shards[i]), np.full(int(lengths[i]), i, np.uint32), name=(i, ids[i], sources[i]))
                continue
            order = np.argsort(doc_shards[lo:hi], kind="stable")
            toks = np.concatenate([np.full(int(lengths[lo + j]), lo + j, np.uint32) for j in order.tolist()])
            w.add_batch(doc_shards[lo:hi], order, toks, lengths[lo:hi][order],
                        (list(range(lo, hi)), ids[lo:hi], sources[lo:hi]))
        table = w.close()
        outs[how] = (tokens_out.getvalue(), names_out.getvalue(), table.tobytes(), w.meta.tobytes())
    assert outs["batches"] == outs["one by one"]


@pytest.mark.parametrize("kind", ["ascii", "unicode", "surrogate"])
def test_a_sidecar_from_the_names_bytes_is_the_sidecar_from_their_strings(kind: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """pack reads the names as bytes (spill.read_name_columns) and builds the sidecar's
    columns from them: the same ids, and the same .docs.parquet bytes, as from the strings."""
    import io

    from refinery.transforms.io.arrow_columns import Utf8Column, string_column
    from refinery.transforms.prep import spill

    odd = {"ascii": "x", "unicode": "\u00e9\u4e2d", "surrogate": "\ud800"}[kind]
    n = 500
    ids = [f"id-{i}" + (odd if i % 9 == 0 else "") for i in range(n)]
    sources = [f"/in/{i // 200}{odd if i % 13 == 0 else ''}.jsonl" for i in range(n)]
    doc_shards = np.random.default_rng(1).integers(0, 3, n).astype(np.uint32)
    names_out = io.BytesIO()
    w = spill.SpillWriter(io.BytesIO(), run_tokens=50, names_out=names_out)  # several runs: ranges to coalesce
    for i in range(n):
        w.add(int(doc_shards[i]), np.ones(3, np.uint32), name=(i, ids[i], sources[i]))
    table = w.close()
    table, meta, starts = spill.by_shard_with_meta(table, w.meta, 3)
    names = io.BytesIO(names_out.getvalue())
    for shard in range(3):
        part = meta[int(starts[shard]):int(starts[shard + 1])]
        strings = spill.read_names(names, part)
        columns = spill.read_name_columns(names, part)
        assert [c.strings() for c in columns] == list(strings)
        for column, values in zip(columns, strings):
            assert string_column(column).equals(string_column(values))
            assert string_column(column.slice(3, 40)).equals(string_column(values[3:40]))
        monkeypatch.setattr(provenance, "ROWS_PER_GROUP", 64)
        files = []
        for how in (strings, columns):
            out = io.BytesIO()
            writer = provenance.DocsWriter(out)
            for lo in range(0, len(part), 100):
                hi = min(lo + 100, len(part))
                cut = [x[lo:hi] if isinstance(x, list) else x.slice(lo, hi) for x in how]
                writer.add((cut[0], cut[1], part["row"][lo:hi], np.full(hi - lo, 3)))
            writer.close()
            files.append(out.getvalue())
        assert files[0] == files[1]
    assert Utf8Column.concat([Utf8Column.of(["a", "b"]), Utf8Column.of(["\u00e9"]).slice(0, 1)]).strings() == \
        ["a", "b", "\u00e9"]


def test_files_written_together_appear_at_the_groups_end_or_not_at_all(tmp_path: Path) -> None:
    paths = [tmp_path / "a" / "x.bin", tmp_path / "a" / "y.bin", tmp_path / "b" / "z.bin"]
    with storage.atomic_group() as group:
        for k, p in enumerate(paths):
            with storage.atomic_open(str(p), group) as f:
                f.write(bytes([k]) * 1000)
            assert not p.exists()  # not before the group commits
    assert [p.read_bytes() for p in paths] == [bytes([k]) * 1000 for k in range(3)]
    with pytest.raises(RuntimeError), storage.atomic_group() as group:
        with storage.atomic_open(str(tmp_path / "a" / "new.bin"), group) as f:
            f.write(b"never")
        with storage.atomic_open(str(paths[0]), group) as f:
            f.write(b"nor this")
        raise RuntimeError("the unit failed")
    assert not (tmp_path / "a" / "new.bin").exists() and paths[0].read_bytes() == bytes(1000)
    assert storage.find_temp_files(str(tmp_path)) == []
