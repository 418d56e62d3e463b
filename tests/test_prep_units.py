"""Pure functions of prep and of the stage machinery, without Beam."""
from __future__ import annotations

import gzip
import hashlib
import io
import json
from pathlib import Path
from typing import Any, Iterable, TypedDict, cast

import numpy as np
import pytest

from refinery.transforms import resumable as stages
from refinery.transforms.formats import shards
from refinery.transforms.formats import tiktoken_vocab as tokenizer
from refinery.transforms.formats.row_ids import doc_id_for
from refinery.transforms.io import rows, storage
from refinery.transforms.io.text import TextSpec, normalize_text
from refinery.transforms.prep import spill
from refinery.transforms.prep.documents import (
    encode_document,
    extract_text,
    normalize_row,
    row_normalizer,
    shard_of,
)
from refinery.transforms.prep.stages import included_units, parse_token_count
from refinery.transforms.resumable import Stage, StageRun, Unit, UnitContext, execute_unit
from refinery.transforms.resumable import ledger as receipts
from refinery.transforms.resumable.ledger import Completion, Receipt, check_receipt

# --- tokenizer -------------------------------------------------------------------------

def test_vocab_resolves_offline_and_is_verified(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("REFINERY_VOCAB_FILE", raising=False)
    source = tokenizer.resolve_vocab()
    assert source.endswith("o200k_base.tiktoken.gz")  # from bpe-openai, not the network
    cached = tokenizer.tiktoken_cache_path()
    assert cached is not None
    data = cached.read_bytes()
    assert hashlib.sha256(data).hexdigest() == tokenizer.VOCAB_SHA256
    assert tokenizer.resolve_vocab() == str(tokenizer.tiktoken_cache_path())  # second time: the cache


def test_bad_vocab_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "o200k_base.tiktoken"
    bad.write_bytes(b"aGVsbG8= 0\n")
    with pytest.raises(tokenizer.VocabError, match="sha256"):
        tokenizer.resolve_vocab(str(bad))


def test_parsed_vocab_cache_gives_tiktokens_own_encoding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("REFINERY_VOCAB_FILE", raising=False)
    tokenizer.get_encoding.cache_clear()
    try:
        enc = tokenizer.get_encoding()
        [parsed] = (tmp_path / "cache").glob("*.ranks")
        import tiktoken
        reference = tiktoken.get_encoding("o200k_harmony")  # tiktoken parsing the same verified file
        text = "Café <|endoftext|> naïve 日本語 code(){}\n\t  end"
        assert enc.encode_ordinary(text) == reference.encode_ordinary(text)
        assert enc.encode("<|return|>", allowed_special="all") == [200002] and enc.n_vocab == 201088
        # a damaged cache is not trusted: the vocab is parsed again and the cache rewritten
        parsed.write_bytes(parsed.read_bytes()[:-100] + b"x" * 100)
        tokenizer.get_encoding.cache_clear()
        assert tokenizer.get_encoding().encode_ordinary(text) == reference.encode_ordinary(text)
        data = parsed.read_bytes()
        assert hashlib.sha256(data[32:]).digest() == data[:32]
    finally:
        tokenizer.get_encoding.cache_clear()


def test_identity_has_no_network_parts() -> None:
    assert tokenizer.tokenizer_identity() == {"encoding": "o200k_harmony", "vocab_sha256": tokenizer.VOCAB_SHA256}


def test_special_token_text_is_ordinary() -> None:
    enc = tokenizer.get_encoding()
    toks = np.asarray(encode_document(enc, "before <|endoftext|> after <|start|>"), dtype=np.uint64)
    assert encode_document(enc, "x").itemsize == 4
    assert list(toks).count(tokenizer.EOS_TOKEN_ID) == 1 and toks[-1] == tokenizer.EOS_TOKEN_ID
    assert 200006 not in toks  # <|start|>
    assert enc.decode(toks[:-1].tolist()) == "before <|endoftext|> after <|start|>"


# --- normalize / ids / shards ----------------------------------------------------------

@pytest.mark.parametrize("raw, expected", [
    ("  a\r\nb\rc  ", "a\nb\nc"),
    ("x\x00y\x07z\x85w\x9f", "xyzw"),           # C0, C1 (incl. NEL) controls dropped
    ("tab\tand\nnewline", "tab\tand\nnewline"),   # \t and \n kept
    ("Cafe\u0301", "Caf\u00e9"),                  # NFC
    ("e\x81\u0301", "\u00e9"),                    # controls dropped first: the mark composes with its base
    ("\u1100\x00\u1161\x9f\u11a8", "\uac01"),       # Hangul jamo split by controls: one syllable
    ("zero\u200bwidth", "zero\u200bwidth"),       # Cf, not Cc: kept
    (" \r\n\t ", ""),
])
def test_normalize(raw: str, expected: str) -> None:
    assert normalize_text(raw) == expected


def test_doc_id_and_shard() -> None:
    assert doc_id_for({"id": 7}, "id", "a.jsonl", 3) == "7"
    assert doc_id_for({"id": None}, "id", "sub/a.jsonl", 3) == "sub/a.jsonl:3"
    assert doc_id_for({}, "id", "a.jsonl", 0) == "a.jsonl:0"
    expected = int(hashlib.md5(b"doc-1").hexdigest()[:16], 16) % 13
    assert shard_of("doc-1", 13) == expected == 1  # a literal: shard assignment is an on-disk contract
    assert doc_id_for({"text": "x", "b": 1}, "id", None, None) == "sha256:4fb4086135469d26aae08793e0368464"
    counts = np.bincount([shard_of(f"d{i}", 8) for i in range(8000)], minlength=8)
    assert counts.min() > 850  # spread evenly


# (record, error): what a reader yields, every path of the normalize rule
ROWS: list[tuple[dict[str, Any] | None, str | None]] = [
    ({"id": "a", "text": "  plain ASCII  \n"}, None), ({"id": 7, "text": "x"}, None), ({"id": None, "text": "y"}, None),
    ({"text": "no id"}, None), ({"id": "b", "text": "   "}, None), ({"id": "c", "text": ""}, None),
    ({"id": "d", "text": "ctl\x07 and \r\n ends\r"}, None), ({"id": "e", "text": "tab\there\x7f"}, None),
    ({"id": "f", "text": "Cafe\u0301 \u00e9t\u00e9 \x85 \u4e2d\u6587"}, None), ({"id": "g", "text": "a\ud800b"}, None),
    ({"id": "h", "text": 3}, None), ({"id": "i", "body": "x"}, None), ({"id": "j", "text": None}, None),
    ({"id": "k", "text": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, None),
    ({"id": "l", "text": [{"role": "user"}]}, None), (None, "malformed JSON: Expecting value at column 1"),
    ({"id": "m", "text": "q", "answer": "a"}, None), ({"id": 1.5, "text": "\u00a0nbsp\u00a0"}, None),
    ({"id": "n", "text": " Cafe\u0301 na\u0308ive \u4e2d\u6587\n\tx "}, None),  # clean, not NFC
    ({"id": "o", "text": "\u00e9t\u00e9 \ud55c\uad6d\uc5b4"}, None), ({"id": "p", "text": "\u00e9\r\nx\r"}, None),
    ({"id": "q", "text": "\u00e9\x00\x9f"}, None), ({"id": "r", "text": "\u2003\u00e9\u3000"}, None),
]


@pytest.mark.parametrize("spec", ["text", TextSpec(template="{text}\n\n{answer}")])
def test_row_normalizer_is_normalize_row(spec: str | TextSpec) -> None:
    normalize = row_normalizer(spec, "id")
    for row, (record, error) in enumerate(ROWS):
        for relpath in ("sub/a.jsonl", None):
            assert normalize(record, error, "/in/a.jsonl", row, relpath) \
                == normalize_row(record, error, spec, "id", "/in/a.jsonl", row, relpath), (record, relpath)


def test_row_normalizer_is_normalize_row_on_seeded_fuzz() -> None:
    import random

    rnd = random.Random(7)
    alphabet = ["a", "Z", " ", "\n", "\t", "\r", "\x00", "\x1f", "\x7f", "\x85", "\x9f", "\u00a0", "\u0301", "e",
                "\u00e9", "\u1100", "\u1161", "\uac00", "\u4e2d", "\u3000", "\u2028", "\ud800", "\udfff",
                "\U0001f600", "\u212b", "\ufb01", "\u0958"]
    normalize = row_normalizer("text", "id")
    for row in range(3000):
        text = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 12)))
        record = {"id": f"d{row}", "text": text} if row % 5 else {"text": text}
        assert normalize(record, None, "/in/a.jsonl", row, "a.jsonl") \
            == normalize_row(record, None, "text", "id", "/in/a.jsonl", row, "a.jsonl"), repr(text)


def test_extract_text_reasons() -> None:
    assert extract_text({"text": "hi"}, "text") == ("hi", None)
    assert extract_text({"body": "hi"}, "text")[1] == "missing text field 'text'"
    assert "is int" in str(extract_text({"text": 3}, "text")[1])
    assert "is NoneType" in str(extract_text({"text": None}, "text")[1])
    assert "surrogates" in str(extract_text({"text": "a\ud800b"}, "text")[1])


@pytest.mark.parametrize("value, expected", [("100M", 100_000_000), ("2B", 2_000_000_000), ("1.5K", 1500),
                                              ("42", 42), ("3t", 3 * 10**12)])
def test_parse_token_count(value: str, expected: int) -> None:
    assert parse_token_count(value) == expected


def test_parse_token_count_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="token count"):
        parse_token_count("10 apples")


def test_included_units_budget_waves() -> None:
    units: list[Unit[dict[str, Any]]] = [Unit(f"{i}", {}) for i in range(6)]

    def rec(t: int) -> Receipt:
        return cast(Receipt, {"stats": {"tokens": t}})  # only its stats count here
    assert included_units(units, {}, None) == (units, True)
    # nothing known yet: ask for a wave of 2
    assert included_units(units, {}, 250, wave=2) == (units[:2], False)
    # first two known (100 each): not enough, next wave
    got, final = included_units(units, {"0": rec(100), "1": rec(100)}, 250, wave=2)
    assert [u.id for u in got] == ["0", "1", "2", "3"] and not final
    # budget reached inside unit 2: final, nothing after it is needed
    got, final = included_units(units, {"0": rec(100), "1": rec(100), "2": rec(100), "3": rec(5)}, 250, wave=2)
    assert [u.id for u in got] == ["0", "1", "2"] and final


# --- io --------------------------------------------------------------------------------

def test_iter_rows_reports_every_bad_row(tmp_path: Path) -> None:
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"text": "ok"}\n{"text": "bad\n\xff\xfe\n\n[1]\n{"text": "last"}')
    got = list(rows.iter_rows(str(p)))
    assert [r[0] for r in got] == [0, 1, 2, 3, 4, 5]
    assert got[0][1] == {"text": "ok"} and got[5][1] == {"text": "last"}
    assert str(got[1][2]).startswith("malformed JSON")
    assert got[2][2] == "invalid UTF-8 at byte 0"
    assert got[3][2] == "blank line"
    assert got[4][2] == "row is a JSON list, not an object"


def test_malformed_json_reasons_say_at_once() -> None:
    """json's own messages may end in "at"; the reason adds "at column N" without doubling it."""
    assert rows.parse_json_line(b'{"text": "cut\n') == (
        None, "malformed JSON: Unterminated string starting at column 10")
    assert rows.parse_json_line(b'{"text": "a\tb"}') == (None, "malformed JSON: Invalid control character at column 12")
    assert rows.parse_json_line(b'{"text": 1,}') == (
        None, "malformed JSON: Expecting property name enclosed in double quotes at column 12")


def test_truncated_gzip_is_reported_not_dropped(tmp_path: Path) -> None:
    data = gzip.compress(b"".join(b'{"text": "row %d"}\n' % i for i in range(2000)))
    p = tmp_path / "cut.jsonl.gz"
    p.write_bytes(data[: len(data) // 2])
    got = list(rows.iter_rows(str(p)))
    assert got[-1][1] is None and str(got[-1][2]).startswith("corrupt file after")
    assert all(r[2] is None for r in got[:-1])


def test_expand_inputs(corpus: Path) -> None:
    files = storage.expand_inputs([str(corpus)])
    assert [f.relpath for f in files] == ["a.jsonl", "d.json", "e.parquet", "sub/b.jsonl.gz", "sub/c.jsonl.zst"]
    found = storage.expand_inputs([str(corpus / "sub" / "*.jsonl.*")])
    assert [f.relpath for f in found] == ["b.jsonl.gz", "c.jsonl.zst"]
    with pytest.raises(storage.InputError, match="no such file"):
        storage.expand_inputs([str(corpus / "missing")])
    with pytest.raises(storage.InputError, match="not a supported data file"):
        storage.expand_inputs([str(corpus / "notes.txt")])


def test_expand_inputs_names_what_it_skips_and_matches_extensions_in_any_case(tmp_path: Path) -> None:
    """Nothing vanishes in silence: files of a folder or glob without a data extension are
    returned in ``skipped``; ``C.JSONL`` / ``D.Jsonl.GZ`` are data files, read as such."""
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.jsonl").write_bytes(b'{"text": "a"}\n')
    (d / "c.JSONL").write_bytes(b'{"text": "c"}\n')
    (d / "D.Jsonl.GZ").write_bytes(gzip.compress(b'{"text": "d"}\n'))
    (d / "b.jsonl.bz2").write_bytes(b"BZh9")
    (d / "readme.txt").write_text("notes")
    (d / ".hidden.txt").write_text("x")  # hidden names stay unmentioned
    (d / "_SUCCESS").write_text("")
    skipped: list[str] = []
    files = storage.expand_inputs([str(d)], skipped=skipped)
    assert [f.relpath for f in files] == ["D.Jsonl.GZ", "a.jsonl", "c.JSONL"]
    assert skipped == [str(d / "b.jsonl.bz2"), str(d / "readme.txt")]
    assert storage.skipped_note(skipped) == \
        f"skipped 2 file(s) with unsupported extensions: {d}/b.jsonl.bz2, {d}/readme.txt"
    note = storage.skipped_note([f"f{i}.txt" for i in range(7)])
    assert note.endswith(": f0.txt, f1.txt, f2.txt, f3.txt, f4.txt and 2 more")
    glob_skipped: list[str] = []
    globbed = storage.expand_inputs([str(d / "*")], skipped=glob_skipped)
    assert [f.relpath for f in globbed] == [f.relpath for f in files]
    assert glob_skipped == skipped
    assert [(record or {}).get("text") for f in files for _, record, _ in rows.iter_rows(f.path)] == ["d", "a", "c"]


def test_atomic_open_leaves_nothing_on_error(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    with pytest.raises(RuntimeError):
        with storage.atomic_open(str(target)) as f:
            f.write(b"partial")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    n, sha = storage.atomic_write_bytes(str(target), b"whole")
    assert target.read_bytes() == b"whole" and n == 5 and sha == hashlib.sha256(b"whole").hexdigest()


# --- spill / pack formats --------------------------------------------------------------

def test_spill_round_trip_bounded_runs() -> None:
    rng = np.random.default_rng(0)
    docs = [(int(rng.integers(0, 4)), rng.integers(0, 1000, size=int(rng.integers(1, 50))).astype(np.uint32))
            for _ in range(200)]
    buf = io.BytesIO()
    w = spill.SpillWriter(buf, run_tokens=300)  # many runs
    for s, t in docs:
        w.add(s, t)
    table, starts = spill.by_shard(w.close(), 4)
    assert int(table["cum_end"].max()) == sum(len(t) for _, t in docs)
    docs_buf = io.BytesIO()
    spill.write_array(docs_buf, table)
    for shard in range(4):
        docs_buf.seek(0)
        rows = spill.read_shard_rows(docs_buf, starts, shard)
        got = b"".join(spill.iter_token_chunks(buf, spill.contiguous_ranges(rows), chunk_tokens=7))
        want = b"".join(t.astype("<u4").tobytes() for s, t in docs if s == shard)
        assert got == want


def test_spill_writer_takes_arrays_numpy_and_lists_alike() -> None:
    from array import array

    rng = np.random.default_rng(1)
    docs = [(int(rng.integers(0, 5)), [int(x) for x in rng.integers(0, 200_000, size=int(rng.integers(1, 30)))])
            for _ in range(100)]
    written = []
    for kind in (lambda t: array("I", t), lambda t: np.array(t, np.uint32), lambda t: np.array(t, np.int64),
                 lambda t: np.array(t, ">u4"), list):
        buf = io.BytesIO()
        w = spill.SpillWriter(buf, run_tokens=200)
        for s, t in docs:
            w.add(s, kind(t))
        table = w.close()
        written.append((buf.getvalue(), table.tobytes()))
    assert all(w == written[0] for w in written)
    tokens = np.frombuffer(written[0][0], "<u4")
    table = np.frombuffer(written[0][1], spill.DOC_DTYPE)
    for (s, t), row in zip(docs, table):  # the table in input order, each document where it says
        assert row["shard"] == s and tokens[row["offset"]:row["offset"] + row["length"]].tolist() == t


def test_spill_writer_batches_write_what_documents_one_by_one_write() -> None:
    from refinery.transforms.formats.encoders import load_tokenizer
    from refinery.transforms.formats.tokenizer_choice import DEFAULT
    from refinery.transforms.prep.documents import encode_by_shard, encode_document, encode_documents

    tok = load_tokenizer(DEFAULT, "fast")
    texts = [f"document {i}: " + "word " * (i % 17) + "<|endoftext|>" * (i % 3) for i in range(300)]
    shards = np.random.default_rng(2).integers(0, 5, size=len(texts)).astype(np.uint32)
    one, batched = io.BytesIO(), io.BytesIO()
    w = spill.SpillWriter(one)
    for s, t in zip(shards.tolist(), texts):
        w.add(s, encode_document(tok, t))
    table_one = w.close()
    w = spill.SpillWriter(batched)
    for lo in range(0, len(texts), 64):  # batches, as a tokenize unit adds them
        order, tokens, lengths = encode_by_shard(tok, texts[lo:lo + 64], shards[lo:lo + 64])
        assert np.array_equal(order, np.argsort(shards[lo:lo + 64], kind="stable"))
        w.add_batch(shards[lo:lo + 64], order, tokens, lengths)
    table_batched = w.close()
    assert batched.getvalue() == one.getvalue() and table_batched.tobytes() == table_one.tobytes()
    all_tokens, all_lengths = encode_documents(tok, texts)
    assert int(table_one["cum_end"][-1]) == len(all_tokens) == int(all_lengths.sum())

    for run_tokens in (50, 1000):  # runs flushed between batches: every document where the table says
        buf = io.BytesIO()
        w = spill.SpillWriter(buf, run_tokens=run_tokens)
        for lo in range(0, len(texts), 64):
            w.add_batch(shards[lo:lo + 64], *encode_by_shard(tok, texts[lo:lo + 64], shards[lo:lo + 64]))
        table = w.close()
        got = np.frombuffer(buf.getvalue(), "<u4")
        assert table["shard"].tolist() == shards.tolist()
        for t, row in zip(texts, table):
            assert got[row["offset"]:row["offset"] + row["length"]].tolist() == encode_document(tok, t).tolist()


def test_npy_header_matches_numpy_save() -> None:
    arr = np.arange(12345, dtype=np.uint32)
    ref = io.BytesIO()
    np.save(ref, arr)
    assert shards.npy_header(len(arr)) + arr.tobytes() == ref.getvalue()


def test_idx_write_read_and_regenerate() -> None:
    lengths = np.array([3, 1, 5], dtype=np.uint64)
    buf = io.BytesIO()
    shards.write_idx(buf, lengths)
    data = buf.getvalue()
    assert data[:8] == b"NMOEIDX\x00" and len(data) == 32 + 16 * 3
    assert shards.read_idx(data).tolist() == [[0, 3], [3, 4], [4, 9]]
    tokens = np.array([5, 6, 199999, 199999, 1, 2, 3, 4, 199999], dtype=np.uint32)
    assert shards.idx_bytes(shards.eos_document_lengths(tokens, 199999)[0]) == data
    with pytest.raises(ValueError, match="magic"):
        shards.read_idx(b"X" * 32)


# --- stage machinery -------------------------------------------------------------------

class _EchoPayload(TypedDict):
    v: int


class _Echo(Stage[_EchoPayload, dict[str, int]]):
    name = "echo"

    def __init__(self, fail_on: Iterable[str] = ()) -> None:
        self.fail_on = set(fail_on)
        self.calls: list[str] = []

    def make_plan(self) -> list[Unit[_EchoPayload]]:
        return [Unit("u0", {"v": 0}), Unit("u1", {"v": 1})]

    def run_unit(self, unit: Unit[_EchoPayload], ctx: UnitContext) -> dict[str, int]:
        self.calls.append(unit.id)
        if unit.id in self.fail_on:
            raise ValueError(f"cannot do {unit.id}")
        ctx.write_bytes(ctx.part_path(f"{unit.id}.txt"), f"value {unit.payload['v']}".encode())
        return {"v": unit.payload["v"]}


def test_receipt_with_missing_files_is_pending_everywhere(tmp_path: Path) -> None:
    """Regression: planner and worker must agree that missing outputs = pending."""
    stage = _Echo()
    run = StageRun(stage, str(tmp_path), stages.compute_stage_hash(stage, None))
    r = execute_unit(run, Unit("u0", {"v": 0}))
    assert r["status"] == "completed" and stage.calls == ["u0"]
    assert execute_unit(run, Unit("u0", {"v": 0}))["skipped"] and stage.calls == ["u0"]
    (tmp_path / r["files"][0]["path"]).unlink()
    assert run.pending(stage.plan()) == stage.plan()                  # the planner sees it
    assert check_receipt(str(tmp_path), run.receipt_path("u0"), run.stage_hash).reason.startswith("missing output")
    execute_unit(run, Unit("u0", {"v": 0}))                            # the worker redoes it
    assert stage.calls == ["u0", "u0"] and (tmp_path / r["files"][0]["path"]).read_bytes() == b"value 0"


def test_an_interpreter_glitch_runs_the_unit_again_once_and_other_errors_fail_it(tmp_path: Path) -> None:
    class Glitchy(_Echo):
        glitches = 0
        message = ""

        def run_unit(self, unit: Unit[_EchoPayload], ctx: UnitContext) -> dict[str, int]:
            if not self.calls:  # the first attempt wrote something before it broke
                ctx.write_bytes(ctx.part_path(f"{unit.id}-first.txt"), b"x")
            if len(self.calls) < self.glitches:
                self.calls.append(unit.id)
                raise SystemError(self.message)
            return super().run_unit(unit, ctx)

    for glitches, message, status in ((1, "AST constructor recursion depth mismatch (before=33, after=30)",
                                       "completed"),
                                      (2, "AST constructor recursion depth mismatch (before=1, after=0)", "failed"),
                                      (1, "error return without exception set", "failed")):
        stage = Glitchy()
        stage.glitches, stage.message = glitches, message
        run = StageRun(stage, str(tmp_path / f"{glitches}-{status}"), "h")
        r = execute_unit(run, Unit("u0", {"v": 0}))
        assert r["status"] == status, (message, r.get("error"))
        if status == "completed":  # the second attempt's files only
            assert [f["path"].rsplit("/", 1)[-1] for f in r["files"]] == ["u0.txt"] and stage.calls == ["u0", "u0"]
        else:
            assert r["error"]["type"] == "SystemError" and len(stage.calls) == min(glitches, 2)


def test_check_receipt_cases(tmp_path: Path) -> None:
    stage = _Echo()
    run = StageRun(stage, str(tmp_path), "h1")
    assert check_receipt(str(tmp_path), run.receipt_path("u1"), "h1").reason == "no receipt"
    r = execute_unit(run, Unit("u1", {"v": 1}))
    out = tmp_path / r["files"][0]["path"]
    assert check_receipt(str(tmp_path), run.receipt_path("u1"), "h2").reason == "receipt from another plan"
    out.write_bytes(b"value 9")  # same size, other bytes
    assert check_receipt(str(tmp_path), run.receipt_path("u1"), "h1").done
    checked = check_receipt(str(tmp_path), run.receipt_path("u1"), "h1", verify_checksums=True)
    assert checked.reason.startswith("checksum")
    out.write_bytes(b"v")
    assert "size mismatch" in check_receipt(str(tmp_path), run.receipt_path("u1"), "h1").reason
    receipt_path = tmp_path / run.receipt_path("u1")
    receipt_path.write_text(receipt_path.read_text()[:20])
    assert check_receipt(str(tmp_path), run.receipt_path("u1"), "h1").reason.startswith("unreadable receipt")


def test_failed_unit_is_recorded_and_retried(tmp_path: Path) -> None:
    stage = _Echo(fail_on={"u1"})
    with pytest.raises(stages.StageFailed, match="u1: failed: ValueError cannot do u1"):
        stages.run_stages([stage], str(tmp_path), [], progress=False, runner=stages.run_in_driver)
    receipt = json.loads((tmp_path / ".refinery/echo").glob("*/receipts/u1.json").__next__().read_text())
    assert receipt["status"] == "failed" and receipt["error"]["type"] == "ValueError"
    [run] = stages.bind_stages([stage], str(tmp_path))
    assert run.check("u1").failed and not run.check("u0").failed and not run.check("u9").failed
    assert [(r["done"], r["failed"], r["pending"]) for r in stages.stage_status(str(tmp_path))] == [(1, 1, 0)]
    stage.fail_on.clear()
    stage.calls.clear()
    stages.run_stages([stage], str(tmp_path), [], progress=False, runner=stages.run_in_driver)
    assert stage.calls == ["u1"]  # only the failed unit runs again


def test_a_repair_invalidates_what_was_built_after_it_and_only_a_repair_does(tmp_path: Path) -> None:
    """A unit redone over damaged files gets a repair token, and every unit of later stages
    built before that repair is pending (planner, worker and verify agree); a unit redone
    because its file went missing is rebuilt identically and invalidates nothing."""
    class _Later(_Echo):
        name = "later"

    first, later = _Echo(), _Later()
    out = str(tmp_path)
    runs = stages.run_stages([first, later], out, [], progress=False, runner=stages.run_in_driver).runs
    u1 = tmp_path / json.loads(open(runs[0].receipt_path("u1")).read())["files"][0]["path"]

    u1.unlink()  # an intermediate file gone while the stage after it is complete: not needed, not rebuilt
    result = stages.run_stages([first, later], out, [], progress=False, runner=stages.run_in_driver)
    assert result.ran == {} and not u1.exists()
    assert [(s["pending"], s["needed"]) for s in stages.stage_status(out)] == [(1, False), (0, False)]
    (tmp_path / runs[1].receipt_path("u0")).unlink()  # the later stage needs it again: rebuilt, identically
    result = stages.run_stages([first, later], out, [], progress=False, runner=stages.run_in_driver)
    assert result.ran == {"echo": 1, "later": 1} and u1.exists()
    assert "repair" not in json.loads(open(runs[0].receipt_path("u1")).read())

    tokens = []
    for _ in range(2):  # a second repair of the same unit is a new repair
        u1.write_bytes(b"value 9")  # same size, other bytes
        first.calls.clear()
        later.calls.clear()
        result = stages.run_stages([first, later], out, [], progress=False, runner=stages.run_in_driver,
                                   verify_checksums=True)
        assert result.ran == {"echo": 1, "later": 2} and first.calls == ["u1"] and later.calls == ["u0", "u1"]
        tokens.append(json.loads(open(runs[0].receipt_path("u1")).read())["repair"])
        assert json.loads(open(runs[1].receipt_path("u0")).read())["upstream_repairs"] == {"echo/u1": tokens[-1]}
        assert receipts.verify_receipts(out, checksums=True) == []
    assert tokens[0] != tokens[1]

    later_receipt = runs[1].receipt_path("u0")
    stale = json.loads(open(later_receipt).read())
    stale.pop("upstream_repairs")  # as if built before the repair
    open(later_receipt, "w").write(json.dumps(stale))
    assert receipts.verify_receipts(out) == [
        f"{later_receipt}: built before a repair of echo/u1 (damaged files rebuilt since)"]
    assert [s["pending"] for s in stages.stage_status(out)] == [0, 1]
    later.calls.clear()
    again = stages.run_stages([first, later], out, [], progress=False, runner=stages.run_in_driver)
    assert again.ran == {"echo": 0, "later": 1}
    assert later.calls == ["u0"]


def test_stage_hash_chain() -> None:
    a1, a2 = _Echo(), _Echo()
    h1 = stages.compute_stage_hash(a1, None)
    assert h1 == stages.compute_stage_hash(a2, None)
    assert stages.compute_stage_hash(a1, "x") != stages.compute_stage_hash(a1, "y")


def test_encode_document_is_encode_ordinary_token_for_token() -> None:
    """prep encodes through tiktoken's uint32 buffer; it must equal ``encode_ordinary`` + EOS,
    special-token text and any Unicode included."""
    import random

    enc = tokenizer.get_encoding()
    rng = random.Random(14)
    specials = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>",
                "<|reserved_200000|>", "<|endofprompt|>"]
    words = ["The", " answer", " is", " 42", ".\n\n", "  ", "\t", "naïve", " 東京", " 🙂", "#### 7", "x" * 50]
    for _ in range(2000):
        parts = [rng.choice(words) for _ in range(rng.randint(0, 12))]
        if rng.random() < 0.5:
            parts.insert(rng.randint(0, len(parts)), rng.choice(specials))
        parts.append("".join(chr(rng.randint(0x20, 0x2FFFF)) for _ in range(rng.randint(0, 8))))
        text = "".join(parts).encode("utf-8", "ignore").decode("utf-8")
        got = encode_document(enc, text)
        assert list(got) == enc.encode_ordinary(text) + [tokenizer.EOS_TOKEN_ID], text


def test_normalize_text_fast_paths_equal_the_definition() -> None:
    """The definition: CR LF and lone CR to LF; every Cc code point but TAB and LF dropped; NFC; stripped."""
    import random
    import unicodedata

    def reference(text: str) -> str:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        text = "".join(c for c in text if unicodedata.category(c) != "Cc" or c in "\t\n")
        return unicodedata.normalize("NFC", text).strip()

    rng = random.Random(3)
    alphabet = [chr(cp) for cp in range(0xA0)] + list("éèe\u0301ÅA\u030a東🙂\u2028\u00a0")
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))
        assert normalize_text(text) == reference(text), repr(text)
    assert normalize_text("  plain ascii\n") == "plain ascii"


def test_a_text_of_unflagged_utf16_units_is_nfc_with_nothing_to_drop() -> None:
    """row_normalizer's fast path skips the exact scans for a text none of whose UTF-16 units
    is flagged: every such text must be NFC and free of surrogates and Cc but \\t \\n. Checked
    for every unflagged BMP character after every starter that begins a canonical composition
    (and some Hangul), the pairs NFC looks at."""
    import unicodedata

    from refinery.transforms.io.text import _CC_TO_DROP
    from refinery.transforms.prep.documents import _SURROGATE, _unit_flags

    flags = _unit_flags()
    plain = "".join(chr(c) for c in range(0x10000) if flags[c] == 0)
    assert not _SURROGATE.search(plain) and not _CC_TO_DROP.search(plain)
    firsts = {int(d.split()[0], 16) for d in map(unicodedata.decomposition, map(chr, range(0x10000)))
              if d and d[0] != "<" and len(d.split()) == 2}
    firsts |= {*range(0x1100, 0x1113), *range(0xAC00, 0xD7A4, 27)}  # Hangul leading consonants, syllables
    for a in sorted(c for c in firsts if flags[c] == 0):
        assert unicodedata.is_normalized("NFC", chr(a) + chr(a).join(plain)), hex(a)
    assert flags[0x0301] and flags[0x1161] and flags[0x00C5] == 0 and flags[0x212B] and flags[ord("\r")]


def test_a_finished_run_replans_from_its_final_stages_and_recorded_repairs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A no-op re-plan reads the receipts of the stages with user-facing files (here the last)
    and one listing of each earlier stage's recorded repairs, never a receipt per earlier
    unit; a repair made outside a planned run is still seen, and its later units redone."""
    class _Later(_Echo):
        name = "later"

    first, later = _Echo(), _Later()
    out = str(tmp_path)
    runs = stages.run_stages([first, later], out, [], progress=False, runner=stages.run_in_driver).runs
    checked: list[str] = []
    real = stages.StageRun.check_all

    def check_all(self: StageRun, ids: list[str], *a: Any, **k: Any) -> dict[str, Completion]:
        checked.append(self.name)
        return real(self, ids, *a, **k)

    monkeypatch.setattr(stages.StageRun, "check_all", check_all)
    again = stages.run_stages([first, later], out, [], progress=False, runner=stages.run_in_driver)
    assert again.ran == {} and checked == ["later"]

    # a unit of the first stage rebuilt over damage outside a planned run: its token is recorded
    u1 = tmp_path / json.loads(open(runs[0].receipt_path("u1")).read())["files"][0]["path"]
    u1.write_bytes(b"value 9")
    assert execute_unit(runs[0], Unit("u1", {"v": 1}), verify_checksums=True)["repair"]
    assert list(runs[0].ledger.recorded_repairs()) == ["echo/u1"]
    later.calls.clear()
    checked.clear()
    third = stages.run_stages([first, later], out, [], progress=False, runner=stages.run_in_driver)
    assert third.ran == {"echo": 0, "later": 2} and later.calls == ["u0", "u1"]
    assert checked[0] == "later" and "echo" in checked  # not all done: the full plan, every stage checked


def test_row_normalizer_says_plain_only_of_texts_without_unassigned_code_points() -> None:
    """``normalize.plain`` lets gigatoken's encoder skip its own look for code points unassigned
    in Unicode 14.0: it must never be True of a document that holds one."""
    from encoder_fuzz import fuzz_texts

    from refinery.transforms.formats.unassigned import has_unassigned
    from refinery.transforms.prep.documents import Document, row_normalizer

    normalize = row_normalizer("text", "id")
    texts = fuzz_texts(seed=21, n=3000) + fuzz_texts(seed=22, n=1000, assigned=True) + [
        "plain ascii", "naïve café 日本語", "x\u1acfy", "\U000332db", "e\u0301\u1acf", "\ud800 lone"]
    plain_seen = 0
    for i, text in enumerate(texts):
        doc = normalize({"id": str(i), "text": text}, None, "p", i, "r")
        if type(doc) is Document:
            assert not (normalize.plain and has_unassigned(doc.text)), repr(text[:80])
            plain_seen += normalize.plain
        else:
            assert not normalize.plain
    assert plain_seen > 100
    normalize({"id": "a", "text": "naïve café"}, None, "p", 0, "r")
    assert normalize.plain
    normalize({"id": "b", "text": "x\u1acfy"}, None, "p", 1, "r")
    assert not normalize.plain
