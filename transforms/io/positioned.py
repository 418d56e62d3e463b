"""A byte writer that knows its position: what pyarrow asks of a Python file it writes
Parquet to (``pa.PythonFile(PositionedWriter(out), mode="w")``: the writer calls ``tell()``)."""
from __future__ import annotations

from typing import Any

from refinery.transforms.io import storage


class PositionedWriter:
    """Write-only, not seekable; closing it leaves ``out`` open (its owner closes it)."""

    closed = False

    def __init__(self, out: storage.BinaryWriter):
        self._out, self._pos = out, 0

    def write(self, data: Any) -> int:
        n = self._out.write(data)
        self._pos += n
        return n

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False
