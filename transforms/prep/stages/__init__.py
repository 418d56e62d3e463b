"""prep: corpora -> uint32 (or uint16) token shards (.npy + .idx) with a checksummed manifest.

Stages (each resumable, see ``refinery.transforms.resumable``)::

    tokenize  unit = an input slice (a file, or a range of parquet row groups):
              read rows -> normalize -> the tokenizer's ordinary encoding + EOS (o200k_harmony
              encode_ordinary by default; ``PrepConfig.tokenizer``) -> shard by
              md5(doc_id) -> one spill per unit, grouped by shard; rejects with reasons
    pack      unit = an output shard: read the shard's rows from every spill in unit
              (= input) order -> shard_NNNN/{dataset}-v1-shard-NNNNNN.npy + .idx, in the
              tokenizer's dtype (spills hold uint32), + .docs.parquet (each document's id,
              source file and row: ``formats.provenance``)
    manifest  one unit: rows accounting, per-shard sha256 -> manifest.json (last),
              rejects/rejects.jsonl

``--max-tokens`` keeps the documents of the input order (file, row) while their running
total stays within the budget. Tokenize units run in waves until the budget is covered,
so little is read beyond it; the cut itself happens in pack, exactly, from each
document's position recorded in the spill.

One module per stage, each with its payload, stats and Beam wiring; imports point down:

    config          PrepConfig, parse_token_count, check_unchanged (what every stage checks)
    count           the count stage (rows before each byte range of a big .jsonl)
    tokenize_rows   a tokenize unit's rows -> documents -> spill batches (UnitTally)
    tokenize        the tokenize stage, its --max-tokens waves (TokenBudget) and wiring
    merge           the merge stage (fewer spills for pack, above MERGE_ABOVE)
    pack            the pack stage (a shard's .npy + .idx + .docs.parquet)
    write_manifest  the manifest stage (rejects, then manifest.json)

and here :func:`build_stages`, THE shape of the job. The names below are this package's
public ones (``from refinery.transforms.prep.stages import PrepConfig, build_stages``).
"""
from __future__ import annotations

from typing import Any

from refinery.transforms.prep.documents import BATCH_CHARS, BATCH_DOCS
from refinery.transforms.prep.stages.config import UNIT_BYTES, PrepConfig, check_unchanged, parse_token_count
from refinery.transforms.prep.stages.count import (
    CountPayload,
    CountRowsStage,
    CountStats,
    byte_ranges,
    count_span,
    range_newlines,
    row_bases,
    split_by_range,
)
from refinery.transforms.prep.stages.merge import (
    MERGE_ABOVE,
    MERGE_GROUP_BYTES,
    MERGE_GROUP_UNITS,
    MergePayload,
    MergeSpillsStage,
    MergeSpillsWiring,
    MergeStats,
)
from refinery.transforms.prep.stages.pack import PACK_READ_THREADS, PackStage, PackStats, PackWiring, ShardPayload
from refinery.transforms.prep.stages.tokenize import (
    Piece,
    TokenBudget,
    TokenizePayload,
    TokenizeStage,
    TokenizeStats,
    TokenizeWiring,
    formed_ids_part,
    included_units,
    piece_ids_part,
    tokenize_inputs,
    tokenize_stats,
)
from refinery.transforms.prep.stages.tokenize_rows import SPAN_COUNTS, UnitTally
from refinery.transforms.prep.stages.write_manifest import (
    ManifestPayload,
    ManifestStage,
    ManifestStats,
    check_tokenize_piece_ids,
    clear_stale_manifest,
    manifest_stats,
    remove_stale_shards,
)
from refinery.transforms.resumable import Stage, short_hash

__all__ = [
    "BATCH_CHARS", "BATCH_DOCS", "MERGE_ABOVE", "MERGE_GROUP_BYTES", "MERGE_GROUP_UNITS", "PACK_READ_THREADS",
    "SPAN_COUNTS", "UNIT_BYTES", "CountPayload", "CountRowsStage", "CountStats", "ManifestPayload", "ManifestStage",
    "ManifestStats", "MergePayload", "MergeSpillsStage", "MergeSpillsWiring", "MergeStats", "PackStage", "PackStats",
    "PackWiring", "Piece", "PrepConfig", "ShardPayload", "TokenBudget", "TokenizePayload", "TokenizeStage",
    "TokenizeStats", "TokenizeWiring", "UnitTally", "build_stages", "byte_ranges", "check_tokenize_piece_ids",
    "check_unchanged", "clear_stale_manifest", "count_span", "formed_ids_part", "included_units", "manifest_stats",
    "parse_token_count", "piece_ids_part", "range_newlines", "remove_stale_shards", "row_bases", "split_by_range",
    "tokenize_inputs", "tokenize_stats",
]


def build_stages(cfg: PrepConfig) -> list[Stage[Any, Any]]:
    """THE shape of ``refinery prep``'s job, its steps in order: [count, when an input is split
    by byte range: rows per piece] -> tokenize (rows -> normalized documents -> tokens, spilled
    by shard) -> [merge, when tokenize units x shards > MERGE_ABOVE: fewer spills] -> pack
    (a shard's documents in :func:`~.documents.order_key` order -> ``.npy`` + ``.idx``) ->
    manifest (rejects, then ``manifest.json``, last)."""
    run_hash = short_hash({"dataset": cfg.dataset, "num_shards": cfg.num_shards, **cfg.text.identity(),
                           "id_field": cfg.id_field, "max_tokens": cfg.max_tokens,
                           "tokenizer": cfg.tokenizer.identity(), "source": cfg.source,
                           **({"exclude": cfg.exclude.identity()} if cfg.exclude else {})})
    tokenize = TokenizeStage(cfg)
    split = [(i, f) for i, f in enumerate(cfg.inputs) if split_by_range(f, cfg.unit_bytes)]
    count = [CountRowsStage(cfg, split)] if split else []
    merge = MergeSpillsStage(cfg, tokenize) if len(tokenize.plan()) * cfg.num_shards > MERGE_ABOVE else None
    return [*count, tokenize, *([merge] if merge else []), PackStage(cfg, tokenize, merge),
            ManifestStage(cfg, run_hash)]
