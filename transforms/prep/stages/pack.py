"""The pack stage: an output shard's documents from every spill, in input order -> its
``.npy`` + ``.idx`` + ``.docs.parquet``."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, TypedDict

from refinery.transforms.formats import provenance, shards
from refinery.transforms.io import storage
from refinery.transforms.prep import pack, spill
from refinery.transforms.prep.stages.config import PrepConfig
from refinery.transforms.prep.stages.merge import MergeSpillsStage
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

PACK_READ_THREADS = 32        # a pack unit's table reads in flight at once on an object store


class ShardPayload(TypedDict):
    """A pack unit's payload (and a ``WriteTokenShards`` unit's): its output shard."""

    shard: int


class PackStats(pack.ShardWritten):
    """A pack unit's receipt stats (and a ``WriteTokenShards`` unit's, which adds its content's
    digest): the shard, the tokens and documents it holds."""

    shard: int


class PackStage(Stage[ShardPayload, PackStats]):
    """Unit: an output shard -> ``shard_NNNN/{dataset}-v1-shard-NNNNNN.npy`` + ``.idx`` + ``.docs.parquet``
    (its provenance sidecar: :mod:`~refinery.transforms.formats.provenance`), in one receipt."""

    name = "pack"

    def __init__(self, cfg: PrepConfig, tokenize: TokenizeStage, merge: MergeSpillsStage | None = None):
        self.cfg = cfg
        self.tokenize = tokenize
        self.merge = merge

    def traits(self) -> Traits:
        return Traits(title="Pack shards", final_outputs=True, light=True, progress_text=self._progress_text,
                      wiring=PackWiring())

    def config(self) -> StageConfig:
        return StageConfig(self._settings())

    def _settings(self) -> dict[str, Any]:
        return {"dataset": self.cfg.dataset, "num_shards": self.cfg.num_shards,
                "max_tokens": self.cfg.max_tokens, "format": shards.FORMAT_VERSION, "docs": provenance.DOCS_FORMAT}

    def make_plan(self) -> list[Unit[ShardPayload]]:
        return [Unit(f"{s:04d}", ShardPayload(shard=s)) for s in range(self.cfg.num_shards)]

    def spill_sources(self, run: StageRun) -> list[tuple[dict[str, str], int | None]]:
        """(spill files, token budget left for its documents) of every spill pack reads, in
        input order: the merge stage's groups when there is one, else every included
        tokenize unit (``run``'s upstream). Worked out once per job (reading M receipts) and
        handed to every pack unit as a side input: no pack unit reads the tokenize receipts."""
        if self.merge:
            merge = run.upstream["merge"]
            return [(spill.spill_files(merge.parts_dir, u.id), self.cfg.max_tokens) for u in self.merge.plan()]
        tokenize, budget = run.upstream["tokenize"], self.cfg.max_tokens
        return [(spill.spill_files(tokenize.parts_dir, u.id), None if budget is None else budget - before)
                for u, _, before in tokenize_inputs(tokenize, budget)]

    def run_unit(self, unit: Unit[ShardPayload], ctx: UnitContext) -> PackStats:
        shard = unit.payload["shard"]
        sources = ctx.side.get("spills") or self.spill_sources(ctx.run)

        def piece(source: tuple[dict[str, str], int | None]) -> pack.ShardPiece | None:
            return pack.read_shard_piece(source[0], shard, source[1])

        if storage.is_remote(ctx.output) and len(sources) > 1:  # small reads, tens of ms each: many in flight
            with ThreadPoolExecutor(PACK_READ_THREADS) as pool:
                found = list(pool.map(piece, sources))
        else:
            found = [piece(src) for src in sources]
        npy_rel, idx_rel = shards.shard_relpaths(self.cfg.dataset, shard)
        with ctx.writes_together():  # the shard's three files durable at once
            written = pack.write_shard_files(ctx.open_write, ctx.output_path(npy_rel), ctx.output_path(idx_rel),
                                             [p for p in found if p is not None], self.cfg.tokenizer.dtype)
        return {"shard": shard, **written}

    def _progress_text(self, stats: Mapping[str, Any], seconds: float) -> str:
        return f"docs={int(stats.get('docs', 0)):,} tokens={int(stats.get('tokens', 0)):,}"


class PackWiring(StageWiring):
    """Pack's Beam wiring: the spills every pack unit reads, once upstream is done, as a side input."""

    def side_inputs(self, run: StageRun, start: Any) -> dict[str, Any]:
        import apache_beam as beam  # lazy: Beam loads with the job, not with the command

        sources = start | "Spills" >> beam.Map(lambda _, r: r.stage.spill_sources(r), run)
        return {"spills": beam.pvalue.AsSingleton(sources, default_value=None)}
