"""HYDRA's train/val/test doc-id slices of a prep output (doc ids:
:mod:`refinery.transforms.formats.docids`).

Slices: ``h = int(md5(doc_id).hexdigest()[:8], 16) % 100``; ``h < 80`` train,
``h < 90`` val, else test. ``docids_{train,val,test}.jsonl`` rows: ``{"doc_id", "source"}``,
in (shard path, document) order.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from refinery.transforms.formats.docids import find_shards, shard_doc_ids
from refinery.transforms.io import storage
from refinery.transforms.resumable import Stage, StageConfig, Traits, Unit, UnitContext

SPLITS = ("train", "val", "test")


def split_of(doc_id: str) -> str:
    h = int(hashlib.md5(doc_id.encode()).hexdigest()[:8], 16) % 100
    return "train" if h < 80 else "val" if h < 90 else "test"


class SlicesStage(Stage[dict[str, Any], dict[str, int]]):
    """One local unit: every shard under the data root -> ``docids_{train,val,test}.jsonl``."""

    name = "slices"

    def __init__(self, data_root: str) -> None:
        self.data_root = data_root.rstrip("/")
        self.shards = find_shards(self.data_root)
        if not self.shards:
            raise storage.InputError(f"{data_root}: no .npy/.idx shards found")

    def traits(self) -> Traits:
        return Traits(title="Slice shards", light=True, final_outputs=True)

    def config(self) -> StageConfig:
        return StageConfig(self._settings(), self._inputs())

    def _settings(self) -> dict[str, Any]:
        return {"format": 1, "rule": "md5[:8] % 100: <80 train, <90 val, else test"}

    def _inputs(self) -> list[dict[str, Any]]:
        out = []
        for _, rel in self.shards:
            path = storage.join(self.data_root, rel[: -len(".npy")] + ".idx")
            out.append({"path": rel, "idx_bytes": storage.file_size(path), "idx_sha256": storage.sha256_file(path)})
        return out

    def make_plan(self) -> list[Unit[dict[str, Any]]]:
        return [Unit("slices", {})]

    def run_unit(self, unit: Unit[dict[str, Any]], ctx: UnitContext) -> dict[str, int]:
        rows: dict[str, list[bytes]] = {s: [] for s in SPLITS}
        for source, rel in self.shards:
            for doc_id in shard_doc_ids(self.data_root, source, rel):
                line = json.dumps({"doc_id": doc_id, "source": source}, ensure_ascii=False).encode() + b"\n"
                rows[split_of(doc_id)].append(line)
        for split in SPLITS:
            ctx.write_bytes(ctx.output_path(f"docids_{split}.jsonl"), b"".join(rows[split]))
        return {split: len(rows[split]) for split in SPLITS}
