"""Arrow columns built from their buffers, without ``pa.array``.

``pa.array`` first asks whether its input is a pandas object, which imports pandas: 0.4 s in
each process that writes Parquet (a prep worker's first shard sidecar, a decon worker's first
details part), now that Beam's import no longer brings pandas (``beam_import``). These give
the same arrays as ``pa.array(values, type)`` for the values refinery writes (ints, bools,
strings); for anything else (a None, an int out of the type's range) they hand the values
to ``pa.array`` itself, which decides as before.
"""
from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class Utf8Column:
    """Strings as their bytes: ``data`` (uint8) holds each one's UTF-8, unpaired surrogates
    passed (``surrogatepass``), back to back; string ``i`` is ``data[offsets[i]:offsets[i + 1]]``
    (``offsets``: int64, one more than the strings)."""

    data: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @classmethod
    def of(cls, values: Sequence[str] | Utf8Column) -> Utf8Column:
        """``values`` as a column (encoded, if they are strings)."""
        if isinstance(values, Utf8Column):
            return values
        encoded = [v.encode("utf-8", "surrogatepass") for v in values]
        offsets = np.zeros(len(encoded) + 1, np.int64)
        np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded)), out=offsets[1:])
        return cls(np.frombuffer(b"".join(encoded), np.uint8), offsets)

    @classmethod
    def concat(cls, columns: Sequence[Utf8Column]) -> Utf8Column:
        if len(columns) == 1:
            return columns[0]
        offsets = [np.zeros(1, np.int64)]
        base = 0
        for c in columns:
            offsets.append(c.offsets[1:] - c.offsets[0] + base)
            base += int(c.offsets[-1] - c.offsets[0])
        data = [c.data[int(c.offsets[0]):int(c.offsets[-1])] for c in columns]
        return cls(np.concatenate(data) if data else np.zeros(0, np.uint8), np.concatenate(offsets))

    def slice(self, lo: int, hi: int) -> Utf8Column:
        return Utf8Column(self.data, self.offsets[lo:hi + 1])

    def strings(self) -> list[str]:
        """The strings (``surrogatepass``: a lone surrogate as it was)."""
        raw, offsets = self.data.tobytes(), self.offsets.tolist()
        return [raw[a:b].decode("utf-8", "surrogatepass") for a, b in zip(offsets, offsets[1:])]

    def has_surrogates(self) -> bool:
        """Whether a string holds an unpaired surrogate (ED A0-BF: never in valid UTF-8)."""
        d = self.data[int(self.offsets[0]):int(self.offsets[-1])]
        return bool(np.any((d[:-1] == 0xED) & (d[1:] >= 0xA0)))


def string_column(values: Sequence[str] | Utf8Column, errors: str = "backslashreplace") -> pa.Array:
    """``pa.array(values, pa.string())``; when a value has an unpaired surrogate (not valid
    UTF-8), every value is encoded with ``errors`` (the same for the others). A
    :class:`Utf8Column` is made into the array from its buffers, without a string per value
    (but one holding a surrogate, or 2 GiB or more: its strings, as above)."""
    import pyarrow as pa

    if isinstance(values, Utf8Column):
        lo, hi = int(values.offsets[0]), int(values.offsets[-1])
        if hi - lo >= 1 << 31 or values.has_surrogates():
            return string_column(values.strings(), errors)
        offsets = (values.offsets - lo).astype(np.int32)
        return pa.StringArray.from_buffers(len(values), pa.py_buffer(offsets),
                                           pa.py_buffer(np.ascontiguousarray(values.data[lo:hi])))
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
