"""Document ids and their deterministic shard assignment.

doc_id = ``str(record[id_field])`` when present and not None, else ``"{relpath}:{row}"``.
shard = ``int(md5(doc_id.encode()).hexdigest()[:16], 16) % num_shards``: it depends on
nothing but the id, never on workers or input splits.
"""
from __future__ import annotations

import hashlib


def doc_id_for(record: dict, id_field: str, relpath: str, row: int) -> str:
    value = record.get(id_field)
    return str(value) if value is not None else f"{relpath}:{row}"


def shard_of(doc_id: str, num_shards: int) -> int:
    return int(hashlib.md5(doc_id.encode("utf-8", "surrogatepass")).hexdigest()[:16], 16) % num_shards


def shard_dirname(shard: int) -> str:
    return f"shard_{shard:04d}"


def shard_basename(dataset: str, shard: int, version: str = "v1") -> str:
    return f"{dataset}-{version}-shard-{shard:06d}"
