"""Rows that are valid JSON but whose values the parsers cannot hold as read: a number of
5,001 digits, nesting 100,000 deep, integers beyond 64 bits. Each is one bad row (with its
reason) or read exactly, and the rows after it are read, in every JSON format."""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, Iterable

import pytest

from refinery.transforms.decon import ngrams as ng
from refinery.transforms.formats.row_ids import doc_id_for
from refinery.transforms.io import rows
from refinery.transforms.io.rows import Row

LONG_NUMBER = b'{"id": 1' + b"0" * 5000 + b', "text": "x"}'
DEEP_OPEN = b"[" * 100_000                                   # never closed: orjson and json both give up
DEEP_CLOSED = b'{"text": "t", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
DEEP_300 = b'{"text": "t", "x": ' + b"[" * 300 + b"]" * 300 + b"}"  # orjson reads it; code downstream would not
DEEP_OK = b'{"text": "t", "x": ' + b"[" * 255 + b"]" * 255 + b"}"   # 256 levels with the row: kept

BAD = [(LONG_NUMBER, "number out of range: Exceeds the limit (4300 digits) for integer string conversion"),
       (DEEP_OPEN, rows.TOO_DEEP), (DEEP_CLOSED, rows.TOO_DEEP), (DEEP_300, rows.TOO_DEEP)]


def _outcomes(got: Iterable[Row]) -> list[tuple[int, Any, str | None]]:
    return [(row, record["id"] if record else None, error) for row, record, error in got]


@pytest.mark.parametrize("bad, reason", BAD)
@pytest.mark.parametrize("name", ["a.jsonl", "a.jsonl.gz", "a.jsonl@range", "a.json"])
def test_unholdable_row_is_one_bad_row_and_the_rest_is_read(tmp_path: Path, name: str, bad: bytes,
                                                            reason: str) -> None:
    good = [json.dumps({"id": f"r{i}", "text": "one"}).encode() for i in range(4)]
    elements = [good[0], bad, good[1], good[2], good[3]]
    path = tmp_path / name.split("@")[0]
    if name.endswith(".json"):
        path.write_bytes(b"[" + b",\n".join(elements) + b"]\n")
    else:
        data = b"\n".join(elements) + b"\n"
        path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    if name.endswith("@range"):  # how a .jsonl over --unit-mb is read: two byte ranges, the bad row in the first
        mid = len(good[0]) + len(bad) + 5
        got = list(rows.iter_rows(str(path), byte_range=(0, mid)))
        got += [(row + len(got), r, e) for row, r, e in rows.iter_rows(str(path), byte_range=(mid, 1 << 30))]
    else:
        got = list(rows.iter_rows(str(path)))
    if name.endswith(".json") and bad == DEEP_OPEN:  # the array itself is never closed: a corrupt file
        assert [e for _, _, e in got] == [None, "corrupt file after 1 rows: EOFError: file ends inside the array "
                                                "(cut short)"]
        return
    assert [(row, rid) for row, rid, _ in _outcomes(got)] == [(0, "r0"), (1, None), (2, "r1"), (3, "r2"), (4, "r3")]
    assert str(got[1][2]).startswith(reason), got[1][2]
    assert [e for _, _, e in got if e] == [got[1][2]]


def test_nesting_up_to_the_limit_is_kept() -> None:
    record, error = rows.parse_json_line(DEEP_OK + b"\n")
    assert error is None and record is not None and record["text"] == "t"
    assert rows.parse_json_line(DEEP_OK) == (record, None)


BIG_IDS = [2 ** 64, 2 ** 64 + 1, -(2 ** 63) - 1, 10 ** 30, -(10 ** 40), 2 ** 64 - 1, -(2 ** 63), 10 ** 4000]


@pytest.mark.parametrize("rid", BIG_IDS)
def test_integers_beyond_64_bits_are_read_exactly(rid: int) -> None:
    line = b'{"id": ' + str(rid).encode() + b', "text": "x", "n": [1e19, 2.5, {"k": ' + str(rid).encode() + b"}]}"
    for record, error in (rows.parse_json_line(line + b"\r\n"), rows.parse_json_line(line)):
        assert error is None and record is not None
        assert type(record["id"]) is int and record["id"] == rid and record["n"] == [1e19, 2.5, {"k": rid}]
        assert doc_id_for(record, "id", "a.jsonl", 0) == ng.record_id(record) == str(rid)  # prep's, decon's id


def test_decon_eval_ids_are_exact_and_rows_after_a_long_number_kept(tmp_path: Path) -> None:
    """The eval rows decon indexes: instances after the 5,001-digit row are kept, the bad row is
    counted, ids above 2^64 stay distinct."""
    path = tmp_path / "gsm8k" / "test.jsonl"
    path.parent.mkdir()
    lines = [b'{"id": "a", "text": "one"}', LONG_NUMBER, b'{"id": 18446744073709551616, "text": "two"}',
             b'{"id": 18446744073709551617, "text": "three"}']
    path.write_bytes(b"\n".join(lines) + b"\n")
    evrows, bad = ng.make_eval_rows([str(path)], rows.iter_rows, "text", "id", ng.TOKENIZERS["default"])
    assert [r.instance_id for r in evrows] == ["a", "18446744073709551616", "18446744073709551617"]
    assert bad == {"gsm8k": {"bad_rows": 1}}
