"""Arrow columns built from their buffers, without ``pa.array``.

``pa.array`` first asks whether its input is a pandas object, which imports pandas: 0.4 s in
each process that writes Parquet (a prep worker's first shard sidecar, a decon worker's first
details part), now that Beam's import no longer brings pandas (``beam_import``). These give
the same arrays as ``pa.array(values, type)`` for the values refinery writes (ints, bools,
strings); for anything else (a None, an int out of the type's range) they hand the values
to ``pa.array`` itself, which decides as before.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa

_INTS: dict[str, type[np.integer[Any]]] = {"int32": np.int32, "int64": np.int64, "uint64": np.uint64}


def int_column(values: Sequence[Any] | np.ndarray, kind: str = "int64") -> pa.Array:
    """``pa.array(values, <kind>)`` for ``kind`` in int32, int64, uint64."""
    import pyarrow as pa

    arrow_type = getattr(pa, kind)()
    dtype = _INTS[kind]
    try:
        source = values if isinstance(values, np.ndarray) else np.asarray(values)
        if source.dtype.kind not in "iub" and len(source):
            raise TypeError(source.dtype)
        if len(source):
            info = np.iinfo(dtype)
            lo, hi = int(source.min()), int(source.max())
            if lo < info.min or hi > info.max:
                raise OverflowError(f"{lo}..{hi} past {kind}")
        data = np.ascontiguousarray(source, dtype=dtype)
    except (TypeError, ValueError, OverflowError):  # not plain ints: pyarrow converts (or refuses) them
        return pa.array(values, arrow_type)
    return pa.Array.from_buffers(arrow_type, len(data), [None, pa.py_buffer(data)])


def bool_column(values: Sequence[Any] | np.ndarray) -> pa.Array:
    """``pa.array(values, pa.bool_())``."""
    import pyarrow as pa

    source = np.asarray(values)
    if source.dtype != np.bool_ and len(source):  # a None, or not bools: pyarrow converts (or refuses) them
        return pa.array(values, pa.bool_())
    bits = np.packbits(source.astype(np.bool_), bitorder="little")
    return pa.Array.from_buffers(pa.bool_(), len(values), [None, pa.py_buffer(bits)])


def string_column(values: Sequence[str], errors: str = "backslashreplace") -> pa.Array:
    """``pa.array(values, pa.string())``; when a value has an unpaired surrogate (not valid
    UTF-8), every value is encoded with ``errors`` (the same for the others)."""
    import pyarrow as pa

    try:
        text = "".join(values)
    except TypeError:  # a None, or not strings: pyarrow converts (or refuses) them
        return pa.array(values, pa.string())
    if text.isascii():  # a character is a byte
        data = text.encode("ascii")
        sizes = np.fromiter(map(len, values), np.int64, len(values))
    else:
        try:
            encoded = [v.encode("utf-8") for v in values]
        except UnicodeEncodeError:
            encoded = [v.encode("utf-8", errors) for v in values]
        data = b"".join(encoded)
        sizes = np.fromiter(map(len, encoded), np.int64, len(encoded))
    if len(data) >= 1 << 31:  # past a string column's offsets: pyarrow makes a chunked array of it, as before
        return pa.array([v.encode("utf-8", errors).decode("utf-8") for v in values], pa.string())
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum(sizes, out=offsets[1:])
    return pa.StringArray.from_buffers(len(values), pa.py_buffer(offsets), pa.py_buffer(data))
