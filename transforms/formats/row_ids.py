"""THE id of an input row, one rule for every command that names training rows: prep's shards
(and their ``.docs.parquet`` sidecars) and decon's drop list and detail records.

A row's id is its id field (``--id-field``, default ``id``) when present and not null, as
``str()``; else ``relpath:row``, its file's path relative to the input the user named and its
0-based row in the file; else (a row with no file, given to a Beam transform as a bare
``dict``) :func:`content_id` of the row.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any


def content_id(record: dict[str, Any]) -> str:
    """``"sha256:"`` + 32 hex digits of the row's canonical JSON (sorted keys, no spaces,
    UTF-8; values JSON cannot hold, such as a parquet timestamp, written as ``str()``)."""
    canonical = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def doc_id_for(record: dict[str, Any], id_field: str, relpath: str | None, row: int | None) -> str:
    """A row's id: the id field, else ``relpath:row``, else :func:`content_id`."""
    value = record.get(id_field)
    if value is not None:
        return str(value)
    if relpath:
        return f"{relpath}:{row}"
    return content_id(record)
