"""JSON lines as refinery writes them: UTF-8, non-ASCII kept as is, one object a line.

A lone surrogate (text decoded with ``surrogateescape`` or ``surrogatepass`` from a file that
was not valid UTF-8) cannot be encoded as UTF-8; it is written as its ``\\uXXXX`` escape
(:data:`JSON_ERRORS`), so such a row is kept, not a crash."""
from __future__ import annotations

import json
from typing import Any, Iterable

JSON_ERRORS = "backslashreplace"


def json_line(obj: object, *, sort_keys: bool = False) -> bytes:
    """One JSON line (with its newline) of ``obj``."""
    return json.dumps(obj, ensure_ascii=False, sort_keys=sort_keys).encode("utf-8", JSON_ERRORS) + b"\n"


def jsonl(rows: Iterable[Any], *, sort_keys: bool = False) -> bytes:
    """The JSON lines of ``rows``."""
    return b"".join(json_line(r, sort_keys=sort_keys) for r in rows)
