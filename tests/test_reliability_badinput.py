"""Bad input: every malformed row or unreadable file is rejected with path, row and reason;
the job completes; ``read == accepted + empty + rejected``; a corrupt whole file is reported
as such (never silently skipped); a 50 MB document goes through whole."""
from __future__ import annotations

import gzip
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from conftest import gsm8k_texts, run_prep
from reliability_helpers import shard_texts, write_figures

# (raw line, expected outcome): "accepted", "empty" or a fragment of the reject reason
JSONL_CASES = [
    (b'{"id": "ok0", "text": "hello world"}', "accepted"),
    (b'{"id": "broken", "text": ', "malformed JSON"),
    (b'{"id": "u", "text": "bad \xff utf8"}', "invalid UTF-8"),
    (b'{"id": "nul", "text": "a\\u0000b"}', "accepted"),              # NUL escape: dropped by normalize
    (b'{"id": "nul2", "text": "a\x00b"}', "malformed JSON"),          # raw NUL inside a JSON string
    (b'\x00\x00\x00', "malformed JSON"),
    (b'{"id": "m"}', "missing text field"),
    (b'{"id": "n", "text": null}', "is NoneType"),
    (b'{"id": "i", "text": 42}', "is int"),
    (b'{"id": "l", "text": ["a"]}', "is list"),
    (b'[1, 2]', "row is a JSON list"),
    (b'"just a string"', "row is a JSON str"),
    (b'', "blank line"),
    (b'{"id": "s", "text": "\\ud800 lone surrogate"}', "unpaired surrogates"),
    (b'{"id": "e", "text": "  \\t \\r\\n "}', "empty"),
    (b'{"id": "crlf", "text": "windows line"}\r', "accepted"),
    (b'{"id": "dup", "text": "x", "text": "y"}', "accepted"),
    (b'\xef\xbb\xbf{"id": "bom", "text": "utf-8 bom"}', "malformed JSON"),
    (b'{"id": "ok1", "text": "last"}', "accepted"),
]


def _build(root):
    root.mkdir()
    (root / "a.jsonl").write_bytes(b"\n".join(c for c, _ in JSONL_CASES) + b"\n")
    texts = gsm8k_texts(60)
    good = b"".join(json.dumps({"id": f"g{i}", "text": t}).encode() + b"\n" for i, t in enumerate(texts[:30]))
    gz = gzip.compress(good, mtime=0)
    (root / "cut.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    zs = zstandard.ZstdCompressor().compress(good)
    (root / "cut.jsonl.zst").write_bytes(zs[: len(zs) // 2])
    (root / "empty.jsonl").write_bytes(b"")
    (root / "empty.jsonl.gz").write_bytes(gzip.compress(b"", mtime=0))
    (root / "zero-bytes.jsonl.gz").write_bytes(b"")
    (root / "bad.json").write_text('[{"id": "j0", "text": "fine"}, {"id": "j1", "te')
    (root / "notarray.json").write_text('{"text": "an object, not an array"}')
    (root / "corrupt.parquet").write_bytes(os.urandom(3000))
    pq.write_table(pa.table({"id": [f"p{i}" for i in range(30)], "text": texts[30:60]}), root / "whole.parquet",
                   row_group_size=5)
    whole = (root / "whole.parquet").read_bytes()
    (root / "truncated.parquet").write_bytes(whole[: len(whole) // 2])
    (root / "empty.parquet").write_bytes(b"")
    # a 50 MB document (ASCII text, one JSON line)
    base = "\n\n".join(t.encode("ascii", "ignore").decode() for t in gsm8k_texts(400))
    big = (base * (50_000_000 // len(base) + 1))[:50_000_000].strip()
    (root / "big.jsonl").write_text(json.dumps({"id": "big", "text": big}) + "\n")
    return len(good.splitlines()), big


def test_bad_inputs_are_rejected_with_reasons_and_counted(tmp_path):
    corpus = tmp_path / "bad"
    good_rows, big = _build(corpus)
    out = tmp_path / "out"
    assert run_prep([corpus], out, "--num-shards", 2, "--dataset", "bad") == 0

    m = json.loads((out / "manifest.json").read_text())
    rows = m["rows"]
    assert rows["read"] == rows["accepted"] + rows["empty"] + rows["rejected"] + rows["over_budget"]
    rejects = [json.loads(line) for line in (out / "rejects" / "rejects.jsonl").read_text().splitlines()]
    assert len(rejects) == rows["rejected"]
    assert all(set(r) == {"path", "row", "reason"} and r["reason"] for r in rejects)
    by_file: dict[str, list[dict]] = {}
    for r in rejects:
        by_file.setdefault(os.path.basename(r["path"]), []).append(r)

    # a.jsonl: each row's fate, by row number
    got = {r["row"]: r["reason"] for r in by_file.pop("a.jsonl")}
    for row, (_, expected) in enumerate(JSONL_CASES):
        if expected in ("accepted", "empty"):
            assert row not in got, (row, got.get(row))
        else:
            assert expected in got.get(row, ""), (row, expected, got.get(row))
    # whole files that cannot be read to the end: reported as corrupt, with the row where it broke
    for name in ("cut.jsonl.gz", "cut.jsonl.zst", "bad.json", "notarray.json", "corrupt.parquet",
                 "truncated.parquet", "empty.parquet", "zero-bytes.jsonl.gz"):
        if name == "zero-bytes.jsonl.gz" and name not in by_file:
            continue  # an empty gzip stream is an empty file, not a corrupt one
        [r] = by_file.pop(name)
        assert r["reason"].startswith("corrupt file"), r
    assert by_file == {}
    cut_rows = [r for r in rejects if r["path"].endswith("cut.jsonl.gz")]
    assert 0 < cut_rows[0]["row"] < good_rows  # the rows before the cut were kept

    texts = shard_texts(out)
    assert texts[big] == 1  # the 50 MB document, whole
    assert texts["hello world"] == 1 and texts["ab"] == 1 and texts["windows line"] == 1
    assert sum(texts.values()) == m["total_documents"] == rows["accepted"]
    write_figures("bad_input", {"bad_inputs": len([c for c in JSONL_CASES if c[1] not in ("accepted",)]) + 9,
                                "rows_read": rows["read"], "rejected": rows["rejected"], "empty": rows["empty"],
                                "accepted": rows["accepted"]})
