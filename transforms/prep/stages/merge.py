"""The merge stage: runs of consecutive tokenize spills -> one spill per group, so that pack
opens fewer files (present only above :data:`MERGE_ABOVE` spill x shard pairs)."""
from __future__ import annotations

from typing import Any, TypedDict

import numpy as np

from refinery.transforms.io import storage
from refinery.transforms.prep import spill
from refinery.transforms.prep.stages.config import PrepConfig
from refinery.transforms.prep.stages.tokenize import TokenizeStage, tokenize_inputs
from refinery.transforms.resumable import (
    Stage,
    StageConfig,
    StageRun,
    StageWiring,
    Traits,
    Unit,
    UnitContext,
)

# A pack unit reads 3 files of every spill it draws from: 3 x M x N requests for M spills and
# N shards. Above this many (spill, shard) pairs a merge stage first combines consecutive
# tokenize spills into groups, so that pack reads 3 x G x N (see docs/SCALE.md).
MERGE_ABOVE = 1 << 16
MERGE_GROUP_BYTES = 1 << 30   # input bytes per merge group (bounds a merge unit's local disk)
MERGE_GROUP_UNITS = 4096


class MergePayload(TypedDict):
    """A merge unit's payload: its tokenize units, in input order."""

    units: list[str]


class MergeStats(TypedDict):
    """A merge unit's receipt stats: the tokenize units it read, the documents and tokens it wrote."""

    units: int
    docs: int
    tokens: int


class MergeSpillsStage(Stage[MergePayload, MergeStats]):
    """Unit: a run of consecutive tokenize units -> one spill for the group, grouped by shard.

    Present only when tokenize units x shards exceeds :data:`MERGE_ABOVE`. A merge unit reads
    each of its tokenize spills once, sequentially (2 requests per unit), and writes one spill
    whose shards are contiguous; each document keeps its position in the whole input order
    (``cum_end`` counted from the first tokenize unit), so pack's ``--max-tokens`` cut is the
    same as without merging and the shards come out byte-identical.
    """

    name = "merge"

    def __init__(self, cfg: PrepConfig, tokenize: TokenizeStage):
        self.cfg = cfg
        self.tokenize = tokenize

    def traits(self) -> Traits:
        return Traits(title="Merge spills", light=True, wiring=MergeSpillsWiring())

    def config(self) -> StageConfig:
        return StageConfig(self._settings())

    def _settings(self) -> dict[str, Any]:
        return {"group_bytes": MERGE_GROUP_BYTES, "group_units": MERGE_GROUP_UNITS, "num_shards": self.cfg.num_shards,
                "max_tokens": self.cfg.max_tokens}

    def make_plan(self) -> list[Unit[MergePayload]]:
        sizes = {f.path: f.size for f in self.cfg.inputs}
        groups: list[list[str]] = [[]]
        size = 0
        for u in self.tokenize.plan():
            if groups[-1] and (size >= MERGE_GROUP_BYTES or len(groups[-1]) >= MERGE_GROUP_UNITS):
                groups.append([])
                size = 0
            groups[-1].append(u.id)
            size += sum(p["byte_range"][1] - p["byte_range"][0] if "byte_range" in p else sizes.get(p["path"], 0)
                        for p in u.payload["pieces"])
        return [Unit(f"g{k:05d}", MergePayload(units=ids)) for k, ids in enumerate(groups) if ids]

    def included(self, run: StageRun) -> list[tuple[str, int]]:
        """(tokenize unit id, tokens before it) of the units the output includes, from the
        receipts of ``run``'s upstream tokenize: read once per job and handed to every unit
        (a side input)."""
        return [(u.id, before) for u, _, before in tokenize_inputs(run.upstream["tokenize"], self.cfg.max_tokens)]

    def run_unit(self, unit: Unit[MergePayload], ctx: UnitContext) -> MergeStats:
        import tempfile

        tk = ctx.upstream("tokenize")
        mine = set(unit.payload["units"])
        included = ctx.side.get("included") or self.included(ctx.run)
        chosen = [(uid, before) for uid, before in included if uid in mine]
        with tempfile.TemporaryFile(prefix="refinery-merge-") as local, \
                tempfile.TemporaryFile(prefix="refinery-merge-names-") as local_names:
            writer = spill.SpillWriter(local, names_out=local_names)
            for uid, before in chosen:  # units in input order; each spill read once, front to back
                files = spill.spill_files(tk.parts_dir, uid)
                with storage.open_read(files["docs"]) as f:
                    table = spill.read_table(f)
                with storage.open_read(files["meta"]) as f:
                    meta = spill.read_table(f, spill.META_DTYPE)
                with storage.open_read(files["tokens"]) as f, storage.open_read(files["names"]) as names:
                    for doc_shard, tokens, cum_end, name in spill.iter_named_documents(f, names, table, meta):
                        writer.add(doc_shard, tokens, before + cum_end, name)
            table, meta, starts = spill.by_shard_with_meta(writer.close(), writer.meta, self.cfg.num_shards)
            out = spill.spill_files(ctx.parts_dir, unit.id)
            with ctx.open_write(out["tokens"]) as f:
                table = spill.write_contiguous(local, table, f)
            with ctx.open_write(out["names"]) as f:
                meta = spill.write_contiguous_names(local_names, meta, f)
        with ctx.open_write(out["docs"]) as f:
            spill.write_array(f, table)
        with ctx.open_write(out["meta"]) as f:
            spill.write_array(f, meta)
        with ctx.open_write(out["shards"]) as f:
            spill.write_array(f, starts)
        return {"units": len(chosen), "docs": int(len(table)), "tokens": int(table["length"].sum(dtype=np.uint64))}


class MergeSpillsWiring(StageWiring):
    """Merge's Beam wiring: the included tokenize units, once tokenize is done, as a side input."""

    def side_inputs(self, run: StageRun, start: Any) -> dict[str, Any]:
        import apache_beam as beam  # lazy: Beam loads with the job, not with the command

        included = start | "Included" >> beam.Map(lambda _, r: r.stage.included(r), run)
        return {"included": beam.pvalue.AsSingleton(included, default_value=None)}
