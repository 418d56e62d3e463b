"""One row reader (issue 62): ``refinery clean`` copies the lines of ``iter_rows(path,
lines=True)``, the reader that numbers every pipeline's rows, with each line's bytes as an
option of it; its rows are iter_rows' rows, number for number, on the input that row
numbering must get right: blank and all-space lines, CRLF, a last line cut short or without
a newline, invalid UTF-8, a row over the cap, blank lines that end the file, and damage (a
gzip or zstd stream cut short, a gzip whose header is not one)."""
from __future__ import annotations

import gzip
import io
import json
from pathlib import Path
from typing import Any

import pytest
import zstandard

from refinery.transforms.clean.stages import RowPlan, UnitLists, copy_file, copy_jsonl
from refinery.transforms.io.rows import iter_rows, jsonl_lines, open_lines

CAP = 120
BODY = [b'{"id": "0", "text": "zero"}\n', b"\n", b'{"id": "2", "text": "two"}\r\n', b" \t\n",
        b'{"id": "4", "text": "' + b"x" * 300 + b'"}\n', b'{"id": "5", "text": "caf\xe9"}\n',
        b'{"id": "6", "text": "\xc3\xa9t\xc3\xa9"}\r\n', b"not json\n", b'{"id": "8", "text": "eight"}\n']
MANY = [json.dumps({"id": str(i), "text": f"row {i} of {i * 7919 % 10007}"}).encode() + b"\n" for i in range(3000)]
PLAIN = {  # the uncompressed content of each case
    "end.jsonl": b"".join(BODY) + b'{"id": "9", "text": "no newline"}',
    "cut-line.jsonl": b"".join(BODY) + b'{"id": "9", "text": "cut sh',
    "trailing.jsonl": b"".join(BODY) + b"\n \r\n\n",
    "blank-then-row.jsonl": b"\n\n" + b"".join(BODY) + b"\n\n",
    "crlf.jsonl.gz": b"".join(BODY).replace(b"\n", b"\r\n"),
    "many.jsonl.zst": b"".join(BODY + MANY) + b"\n",
}
DAMAGED = {  # the file's bytes
    "cut.jsonl.gz": gzip.compress(b"".join(BODY + MANY), mtime=0)[:9000],
    "cut.jsonl.zst": zstandard.ZstdCompressor().compress(b"".join(BODY + MANY))[:9000],
    "not-gzip.jsonl.gz": b"\x1f\x8b\x08\x00 this is no gzip stream at all\n",
}


def _write(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    if name in DAMAGED:
        path.write_bytes(DAMAGED[name])
    elif name.endswith(".gz"):
        path.write_bytes(gzip.compress(PLAIN[name], mtime=0))
    elif name.endswith(".zst"):
        path.write_bytes(zstandard.ZstdCompressor().compress(PLAIN[name]))
    else:
        path.write_bytes(PLAIN[name])
    return path


@pytest.mark.parametrize("name", [*PLAIN, *DAMAGED])
def test_the_lines_are_the_rows_of_iter_rows_with_their_bytes(tmp_path: Path, name: str) -> None:
    path = str(_write(tmp_path, name))
    rows = list(iter_rows(path, max_row_bytes=CAP))
    lines = list(iter_rows(path, max_row_bytes=CAP, lines=True))
    assert [(x.row, x.record, x.error) for x in lines if x.row is not None] == rows
    assert [row for row, _, _ in rows] == list(range(len(rows)))  # every line before the last row is one
    assert all(x.record is None and x.error is None for x in lines if x.row is None)  # the end's blank lines
    if name in PLAIN:  # every line's bytes, in order, but the one over the cap (not held)
        long_line = BODY[4] if name != "crlf.jsonl.gz" else BODY[4].replace(b"\n", b"\r\n")
        assert b"".join(x.line for x in lines if x.line is not None) == PLAIN[name].replace(long_line, b"")
        assert sum(x.line is None for x in lines) == 1
        errors = {error for _, _, error in rows if error}
        assert {"blank line", f"row too large: more than {CAP} bytes"} <= errors
        assert any("utf-8" in e.lower() or "unicode" in e.lower() for e in errors), errors  # caf\xe9
    else:  # the damage is the last row, after the rows read before it
        assert str(rows[-1][2]).startswith("corrupt file after"), rows[-1]
    with open_lines(path, compression="infer") as f:  # the lines of the file opened by hand: the same
        assert list(jsonl_lines(f, CAP)) == lines


@pytest.mark.parametrize("name", [*PLAIN, *DAMAGED])
def test_clean_copies_the_same_bytes_as_from_the_open_file(tmp_path: Path, name: str) -> None:
    """copy_file (through iter_rows(lines=True)) writes what copy_jsonl of the lines of the file
    opened by hand writes, listed rows left out."""
    path = str(_write(tmp_path, name))
    last = max(row for row, _, _ in iter_rows(path, max_row_bytes=CAP))
    plan = RowPlan(frozenset({1, 2, 3, 4, 7, last}))  # the bad rows and the last listed: a damaged file copies
    got, got_rejects = io.BytesIO(), io.BytesIO()
    stats = copy_file(path, got, plan, CAP, UnitLists(got_rejects))
    want, want_rejects = io.BytesIO(), io.BytesIO()
    with open_lines(path, compression="infer") as f:
        want_w: Any = _compressed_like(want, path)
        want_stats = copy_jsonl(jsonl_lines(f, CAP), want_w, plan, path, UnitLists(want_rejects))
        want_w.close()
    assert stats == want_stats
    assert _plain(got.getvalue(), path) == _plain(want.getvalue(), path)
    assert got_rejects.getvalue() == want_rejects.getvalue()
    assert ("corrupt" in stats) == (name in DAMAGED)


def test_lines_are_of_a_whole_json_lines_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "end.jsonl")
    with pytest.raises(ValueError, match="whole JSON lines file"):
        whole_files_only: Any = iter_rows  # (the overloads say so to a type checker too)
        whole_files_only(str(path), lines=True, byte_range=(0, 10))
    (tmp_path / "x.json").write_text("[]")
    with pytest.raises(ValueError, match="whole JSON lines file"):
        iter_rows(str(tmp_path / "x.json"), lines=True)


def _compressed_like(out: io.BytesIO, path: str) -> Any:
    """A writer of the same framing clean's copy has (the bytes compared decompressed)."""
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=out, mode="wb", mtime=0)
    if path.endswith(".zst"):
        return zstandard.ZstdCompressor().stream_writer(out, closefd=False)
    return _Keep(out)


class _Keep:
    def __init__(self, out: io.BytesIO) -> None:
        self.out = out

    def write(self, data: bytes) -> int:
        return self.out.write(data)

    def close(self) -> None:
        pass


def _plain(data: bytes, path: str) -> bytes:
    if path.endswith(".gz"):
        return gzip.decompress(data)
    if path.endswith(".zst"):
        return zstandard.ZstdDecompressor().decompressobj().decompress(data)
    return data
