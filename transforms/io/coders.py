"""Beam coders for refinery's small record types (NamedTuples of strings and numbers)."""
from __future__ import annotations

from typing import Any

import apache_beam as beam
import msgpack


class TupleCoder(beam.coders.Coder):
    """A NamedTuple as the msgpack of its fields, in order: compact and deterministic (the
    same value always gives the same bytes, so it can key a GroupByKey). Nested sequences
    come back as tuples. Subclasses set :attr:`cls`."""

    cls: type = tuple

    def encode(self, value: Any) -> bytes:
        data: bytes = msgpack.packb(tuple(value), use_bin_type=True, unicode_errors="surrogatepass")
        return data

    def decode(self, encoded: bytes) -> Any:
        return self.cls(*msgpack.unpackb(encoded, raw=False, unicode_errors="surrogatepass", use_list=False))

    def is_deterministic(self) -> bool:
        return True

    def to_type_hint(self) -> type:
        return self.cls
