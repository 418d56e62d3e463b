"""The row reader's bounds: decompression bounded per read, a row-size cap (``max_row_bytes``)
for every format, ``.json`` arrays streamed, parquet read in record batches; row numbers and
the one error policy unchanged. Peak memory of a whole prep run on hostile input is measured
in ``test_reliability_badinput.py``."""
from __future__ import annotations

import gzip
import io
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable

import fsspec
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
import zstandard

from refinery.transforms.io import rows
from refinery.transforms.io.rows import Row

CAP = 100
TOO_LARGE = f"row too large: more than {CAP} bytes"


def _lines_file(path: Path, lines: list[bytes]) -> str:
    data = b"".join(lines)
    if path.name.endswith(".gz"):
        data = gzip.compress(data, mtime=0)
    elif path.name.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return str(path)


def _record(n: int) -> dict[str, str]:
    """A record whose JSON line (without its newline) is exactly ``n`` bytes."""
    base = len(json.dumps({"text": ""}))
    return {"text": "x" * (n - base)}


LINES = [json.dumps({"text": "first"}).encode() + b"\n",
         json.dumps(_record(CAP + 1)).encode() + b"\n",              # one byte over: rejected
         json.dumps(_record(CAP)).encode() + b"\n",                  # exactly the cap: kept
         json.dumps(_record(50 * CAP)).encode() + b"\n",             # far over: read in pieces, rejected
         b"not json\n",
         json.dumps(_record(CAP)).encode() + b"\r\n",                # the cap and a CRLF: one byte over
         json.dumps(_record(CAP + 1)).encode()]                      # last line, no newline, over


EXPECTED = [(0, "ok"), (1, TOO_LARGE), (2, "ok"), (3, TOO_LARGE), (4, "malformed JSON"), (5, TOO_LARGE),
            (6, TOO_LARGE)]


def _outcomes(got: Iterable[Row]) -> list[tuple[int, str]]:
    """(row, "ok", the too-large reason or another reason up to its first colon)."""
    return [(row, "ok" if err is None else err if err == TOO_LARGE else err.split(":")[0]) for row, _, err in got]


@pytest.mark.parametrize("name", ["a.jsonl", "a.jsonl.gz", "a.jsonl.zst"])
def test_jsonl_rows_over_the_cap_are_rejected_and_reading_goes_on(
        tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rows, "READ_BYTES", 7)  # a long line is skipped in many pieces
    path = _lines_file(tmp_path / name, LINES)
    got = list(rows.iter_rows(path, max_row_bytes=CAP))
    assert _outcomes(got) == EXPECTED
    assert got[2][1] == _record(CAP)
    # the default cap admits them all (but the one malformed line)
    assert [err for _, _, err in rows.iter_rows(path) if err] == [got[4][2]]


def test_jsonl_byte_ranges_skip_long_lines_and_cover_every_row_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rows, "READ_BYTES", 5)
    path = _lines_file(tmp_path / "a.jsonl", LINES)
    whole = list(rows.iter_rows(path, max_row_bytes=CAP))
    size = len(b"".join(LINES))
    shuffled = sorted({0, size, *random.Random(1).sample(range(size), 6)})
    for cuts in ([0, size], [0, 30, size], [0, 150, 151, 400, size], shuffled):
        got: list[Row] = []
        for lo, hi in zip(cuts, cuts[1:]):
            part = list(rows.iter_rows(path, byte_range=(lo, hi), max_row_bytes=CAP))
            got += [(len(got) + r, rec, err) for r, rec, err in part]
        assert got == whole, cuts


def test_remote_jsonl_lines_are_bounded_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """fsspec's remote files take no readline limit: the reader buffers them itself."""
    monkeypatch.setattr(rows, "READ_BYTES", 3)
    fs = fsspec.filesystem("memory")
    fs.pipe("/bounded/a.jsonl", b"".join(LINES))
    path = "memory://bounded/a.jsonl"
    got = list(rows.iter_rows(path, max_row_bytes=CAP))
    assert [r for r, o in _outcomes(got) if o == TOO_LARGE] == [1, 3, 5, 6]
    size = len(b"".join(LINES))
    first = list(rows.iter_rows(path, byte_range=(0, 100), max_row_bytes=CAP))
    rest = rows.iter_rows(path, byte_range=(100, size), max_row_bytes=CAP)
    assert first + [(len(first) + r, rec, err) for r, rec, err in rest] == got
    fs.rm("/bounded", recursive=True)


def _random_value(rnd: random.Random, depth: int = 0) -> Any:  # JSON: any of its value types
    r = rnd.random()
    if depth > 3 or r < 0.3:
        return rnd.choice([1, -2.5e3, True, None, 'a"b\\c]}{,[', "ü\n", "", "\\", '\\\\"', "x\\"])
    if r < 0.6:
        return [_random_value(rnd, depth + 1) for _ in range(rnd.randint(0, 3))]
    return {f'k{i}\\"': _random_value(rnd, depth + 1) for i in range(rnd.randint(0, 3))}


def _loads(element: bytes | None) -> Any:
    assert element is not None, "an element over the cap"
    return json.loads(element)


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1 << 20])
def test_json_array_elements_match_the_standard_parser(piece: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Element framing over any piece size: escapes, nesting and strings that hold brackets."""
    monkeypatch.setattr(rows, "READ_BYTES", piece)
    rnd = random.Random(piece)
    for _ in range(200):
        array = [_random_value(rnd) for _ in range(rnd.randint(0, 5))]
        data = json.dumps(array, indent=rnd.choice([None, 1]), ensure_ascii=rnd.random() < 0.5).encode()
        assert [_loads(e) for e in rows.json_array_elements(io.BytesIO(data), 1 << 20)] == array, data


@pytest.mark.parametrize("name", ["b.json", "b.json.gz", "b.json.zst"])
def test_json_array_is_streamed_with_the_cap(tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rows, "READ_BYTES", 16)
    elements = [{"text": "first"}, _record(CAP + 1), [1, 2], _record(50 * CAP), "s", _record(CAP - 10), None]
    data = ("[" + ", ".join(json.dumps(e) for e in elements) + "]\n").encode()
    path = _lines_file(tmp_path / name, [data])
    got = list(rows.iter_rows(path, max_row_bytes=CAP))
    assert _outcomes(got) == [(0, "ok"), (1, TOO_LARGE), (2, "row is a JSON list, not an object"), (3, TOO_LARGE),
                              (4, "row is a JSON str, not an object"), (5, "ok"),
                              (6, "row is a JSON NoneType, not an object")]
    assert got[5][1] == _record(CAP - 10)


@pytest.mark.parametrize("content, rows_before, reason", [
    (b'{"text": "an object"}', 0, ".json input must hold an array of objects, found '{'"),
    (b'', 0, "found an empty file"),
    (b'[{"text": "a"}, {"text": "b"', 1, "EOFError: file ends inside the array"),
    (b'[{"text": "a"}, {"text": "b"}] trailing', 2, "data after the end of the array"),
    (b'[{"text": "a"}, {"text": b}, {"text": "c"}]', 1, "JSONDecodeError"),
    (b'[{"text": "a"},, {"text": "c"}]', 1, "empty element"),
    (b'[{"text": "a"},]', 1, "empty element"),
    (b'[{"text": "a"} {"text": "c"}]', 0, "JSONDecodeError"),
    (b'[{"text": "\xff"}]', 0, "JSONDecodeError"),
])
def test_json_array_damage_is_one_corrupt_file_row_after_the_good_rows(
        tmp_path: Path, content: bytes, rows_before: int, reason: str) -> None:
    path = tmp_path / "c.json"
    path.write_bytes(content)
    got = list(rows.iter_rows(str(path)))
    assert [err for _, _, err in got[:-1]] == [None] * rows_before
    row, rec, err = got[-1]
    assert row == rows_before and rec is None and str(err).startswith(f"corrupt file after {rows_before} rows: ")
    assert reason in str(err)
    for empty in (b"[]", b" [ ]\n"):
        path.write_bytes(empty)
        assert list(rows.iter_rows(str(path))) == []


def test_parquet_reads_record_batches_with_the_cap_and_file_row_numbers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rows, "PARQUET_BATCH_ROWS", 3)
    texts = [f"text {i}" for i in range(20)]
    texts[4] = "x" * (CAP + 1)
    texts[13] = "y" * 10 * CAP
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": [f"p{i}" for i in range(20)], "text": texts, "n": list(range(20))}), path,
                   row_group_size=5)
    got = list(rows.iter_rows(str(path), max_row_bytes=CAP))
    assert [r for r, _, _ in got] == list(range(20))
    assert [r for r, _, err in got if err] == [4, 13] and {err for _, _, err in got if err} == {TOO_LARGE}
    assert got[5][1] == {"id": "p5", "text": "text 5", "n": 5}
    # a row-group range: rows still numbered from the file's start; only some columns
    part = list(rows.iter_rows(str(path), row_groups=(2, 4), columns=["text", "nosuch"], max_row_bytes=CAP))
    assert [(r, err) for r, _, err in part] == [(r, TOO_LARGE if r == 13 else None) for r in range(10, 20)]
    assert part[0][1] == {"text": "text 10"}
    assert list(rows.iter_rows(str(path), row_groups=(4, 4))) == []
    assert [err for _, _, err in rows.iter_rows(str(path))] == [None] * 20  # the default cap admits them


def test_arrow_rows_over_the_cap_are_rejected(tmp_path: Path) -> None:
    table = pa.table({"text": ["a", "b" * (CAP + 1), "c"], "id": [1, 2, 3]})
    path = tmp_path / "data-00000-of-00001.arrow"
    with ipc.new_stream(path, table.schema) as w:
        w.write_table(table, max_chunksize=2)
    assert _outcomes(rows.iter_rows(str(path), max_row_bytes=CAP)) == [(0, "ok"), (1, TOO_LARGE), (2, "ok")]


def test_zstd_frames_cut_short_or_damaged_are_reported(tmp_path: Path) -> None:
    lines = [json.dumps({"text": f"row {i} " + "w" * 50}).encode() + b"\n" for i in range(2000)]
    c = zstandard.ZstdCompressor()
    frames = c.compress(b"".join(lines[:1000])) + c.compress(b"".join(lines[1000:]))
    skippable = b"\x50\x2a\x4d\x18" + (4).to_bytes(4, "little") + b"skip"
    path = tmp_path / "z.jsonl.zst"
    path.write_bytes(skippable + frames)
    assert [err for _, _, err in rows.iter_rows(str(path))] == [None] * 2000  # every frame, skippable ones skipped
    for cut in (len(frames) - 3, len(frames) // 2 + 10, 5):
        path.write_bytes(frames[:cut])
        got = list(rows.iter_rows(str(path)))
        assert all(err is None for _, _, err in got[:-1]) and len(got) - 1 < 2000
        assert str(got[-1][2]).startswith(f"corrupt file after {len(got) - 1} rows: EOFError")
    path.write_bytes(frames + b"junk")
    assert "ZstdError" in str(list(rows.iter_rows(str(path)))[-1][2])
    path.write_bytes(b"")
    assert str(list(rows.iter_rows(str(path)))[-1][2]).startswith("corrupt file after 0 rows: EOFError")
    # a frame that asks for a 1 GiB window is refused (zstd's limit: 128 MiB), not allocated
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=30, write_content_size=False)
    with open(path, "wb") as raw, zstandard.ZstdCompressor(compression_params=params).stream_writer(raw) as w:
        w.write(b"".join(lines))
    assert "Frame requires too much memory" in str(list(rows.iter_rows(str(path)))[-1][2])


def write_huge_line_zst(path: Path, line_bytes: int, before: bytes = b'{"text": "before"}\n',
                        after: bytes = b'{"text": "after"}\n') -> None:
    """A .jsonl.zst: ``before``, one line of ``line_bytes`` bytes of ``{"text": "aaa..."}``,
    then ``after``; streamed, never held in memory (a few KB per GB on disk)."""
    with open(path, "wb") as raw, zstandard.ZstdCompressor(level=3).stream_writer(raw) as w:
        w.write(before + b'{"text": "')
        piece = b"a" * (1 << 20)
        for _ in range((line_bytes - 12) >> 20):
            w.write(piece)
        w.write(b"a" * ((line_bytes - 12) % (1 << 20)) + b'"}\n' + after)


READ_AND_MEASURE = """
import resource, sys
from refinery.transforms.io import rows
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
got = [(row, err) for row, _, err in rows.iter_rows(sys.argv[1], max_row_bytes=int(sys.argv[2]))]
print(repr(got), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)
"""


def test_decompression_is_bounded_per_read(tmp_path: Path) -> None:
    """A ~20 KB .jsonl.zst whose middle line expands to 600 MB: reading it grows the reader's
    peak memory by little more than its 8 MiB cap (measured in a fresh process)."""
    path = tmp_path / "huge.jsonl.zst"
    write_huge_line_zst(path, 600 << 20)
    assert path.stat().st_size < 100_000
    out = subprocess.run([sys.executable, "-c", READ_AND_MEASURE, str(path), str(8 << 20)], capture_output=True,
                         text=True, check=True).stdout
    got, grown_mib = out.rsplit(" ", 1)
    assert got == repr([(0, None), (1, f"row too large: more than {8 << 20} bytes"), (2, None)])
    assert int(grown_mib) < 48, grown_mib


def test_prep_max_row_bytes_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from helpers import run_prep

    from refinery.beam_pipelines.cli import main

    corpus = tmp_path / "c"
    corpus.mkdir()
    _lines_file(corpus / "a.jsonl", [json.dumps({"id": "s", "text": "short"}).encode() + b"\n",
                                     json.dumps({"id": "l", "text": "long " * 40}).encode() + b"\n",
                                     json.dumps({"id": "t", "text": "tail"}).encode() + b"\n"])
    out = tmp_path / "out"
    assert run_prep([corpus], out, "--max-row-bytes", CAP, "--num-shards", 1) == 0
    [reject] = [json.loads(line) for line in (out / "rejects" / "rejects.jsonl").read_text().splitlines()]
    assert reject == {"path": str(corpus / "a.jsonl"), "row": 1, "reason": TOO_LARGE}
    assert json.loads((out / "manifest.json").read_text())["rows"]["accepted"] == 2
    assert run_prep([corpus], tmp_path / "out0", "--max-row-bytes", 0) == 2
    assert "--max-row-bytes must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["prep", "--help"])
    assert f"(default: {64 << 20} = 64 MiB)" in " ".join(capsys.readouterr().out.split())


def test_blank_lines_that_end_a_file_are_not_rows_and_other_blank_lines_still_are(tmp_path: Path) -> None:
    """An editor's final empty line was counted as a rejected row ("blank line"). Now the blank
    lines that end a JSONL file are not rows; one with a row after it still is (row numbers stay
    the file's lines), read whole or by any byte range."""
    from refinery.transforms.io.rows import iter_rows

    ending = tmp_path / "ending.jsonl"
    ending.write_bytes(b'{"text": "a"}\n{"text": "b"}\n\n  \r\n')
    inside = tmp_path / "inside.jsonl"
    inside.write_bytes(b'{"text": "a"}\n\n{"text": "b"}\n\n')
    assert list(iter_rows(str(ending))) == [(0, {"text": "a"}, None), (1, {"text": "b"}, None)]
    assert list(iter_rows(str(inside))) == [(0, {"text": "a"}, None), (1, None, "blank line"),
                                            (2, {"text": "b"}, None)]
    for path in (ending, inside):
        whole = [r[1:] for r in iter_rows(str(path))]
        size = path.stat().st_size
        for cut in range(size + 1):
            parts = [r[1:] for lo, hi in ((0, cut), (cut, size)) for r in iter_rows(str(path), byte_range=(lo, hi))]
            assert parts == whole, (path.name, cut)
