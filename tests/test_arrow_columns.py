"""Columns built from buffers equal what ``pa.array`` builds, and import no pandas."""
from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from refinery.transforms.io.arrow_columns import bool_column, int_column, string_column


@pytest.mark.parametrize("kind", ["int32", "int64", "uint64"])
def test_int_columns_equal_pa_array(kind: str) -> None:
    for values in ([], [0, 1, 2], np.arange(5, dtype=np.int64), np.arange(3, dtype=np.int32), [7]):
        got = int_column(values, kind)
        assert got.type == getattr(pa, kind)() and got.equals(pa.array(values, getattr(pa, kind)()))
    assert int_column([1, None, 3], kind).to_pylist() == [1, None, 3]  # handed to pa.array


def test_out_of_range_ints_are_refused_as_pyarrow_refuses_them() -> None:
    with pytest.raises(pa.ArrowInvalid):
        int_column(np.array([0, 1 << 40], dtype=np.int64), "int32")
    with pytest.raises((pa.ArrowInvalid, OverflowError)):
        int_column([-1], "uint64")


def test_bool_and_string_columns_equal_pa_array() -> None:
    for flags in ([], [True], [True, False, True, True, False, False, False, True, True], np.zeros(3, bool)):
        assert bool_column(flags).equals(pa.array(flags, pa.bool_()))
    assert bool_column([True, None]).to_pylist() == [True, None]
    for texts in ([], ["a", "", "bc"], ["caf\u00e9", "\u4e2d\u6587", "x"]):
        assert string_column(texts).equals(pa.array(texts, pa.string()))
    escaped = string_column(["ok", "lone\udc80", "\u00e9"])  # every value escaped, as before
    assert escaped.to_pylist() == ["ok", "lone\\udc80", "\u00e9"]
    with_none: list[Any] = ["a", None]  # handed to pa.array
    assert string_column(with_none).to_pylist() == ["a", None]


def test_no_pandas_is_imported() -> None:
    code = ("import sys, numpy as np\n"
            "from refinery.transforms.io.arrow_columns import bool_column, int_column, string_column\n"
            "int_column([1, 2]); int_column(np.arange(3), 'uint64'); bool_column([True]); string_column(['\\u00e9'])\n"
            "assert 'pandas' not in sys.modules\nprint('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
