"""The manifest stage: the receipts -> ``rejects/rejects.jsonl``, then ``manifest.json`` (last);
the shards of an earlier plan removed, and a stale manifest before a run (:func:`clear_stale_manifest`)."""
from __future__ import annotations

import logging
from typing import Any, Mapping, TypedDict

from refinery.transforms.formats import manifests, shards
from refinery.transforms.formats.failed_run import CorruptFile
from refinery.transforms.io import storage
from refinery.transforms.prep.piece_ids import check_piece_ids
from refinery.transforms.prep.stages.config import PrepConfig
from refinery.transforms.prep.stages.tokenize import formed_ids_part, piece_ids_part, tokenize_inputs
from refinery.transforms.prep.stages.tokenize_rows import SPAN_COUNTS
from refinery.transforms.resumable import (
    Stage,
    StageConfig,
    StageRun,
    Traits,
    Unit,
    UnitContext,
)

log = logging.getLogger("refinery")


class ManifestPayload(TypedDict):
    """The manifest unit's payload: nothing (one unit, ``manifest``)."""


class _ManifestStatsBase(TypedDict):
    tokens: int
    docs: int
    rows_read: int
    rows_accepted: int
    rows_empty: int
    rows_rejected: int
    rows_over_budget: int


class ManifestStats(_ManifestStatsBase, total=False):
    """The manifest unit's receipt stats: the totals and the manifest's ``rows``, each ``rows_<key>``."""

    rows_excluded: int  # with --exclude-overlaps only
    rows_pieces: int  # with --exclude-mode span only


def manifest_stats(tokens: int, docs: int, rows: Mapping[str, int]) -> ManifestStats:
    """The manifest unit's stats from its totals and its row accounting (``rows``:
    :func:`~refinery.transforms.formats.manifests.row_accounting`'s keys; an unknown one raises,
    never left out)."""
    known = {"read", "accepted", "empty", "rejected", "over_budget", "excluded", "pieces"}
    if not known.issuperset(rows):
        raise ValueError(f"row accounting keys {sorted(set(rows) - known)} have no place in the manifest's stats")
    stats: ManifestStats = {"tokens": tokens, "docs": docs, "rows_read": rows["read"],
                            "rows_accepted": rows["accepted"], "rows_empty": rows["empty"],
                            "rows_rejected": rows["rejected"], "rows_over_budget": rows["over_budget"]}
    if "excluded" in rows:
        stats["rows_excluded"] = rows["excluded"]
    if "pieces" in rows:
        stats["rows_pieces"] = rows["pieces"]
    return stats


class ManifestStage(Stage[ManifestPayload, ManifestStats]):
    """One unit: receipts -> ``rejects/rejects.jsonl`` then ``manifest.json`` (last)."""

    name = "manifest"

    def __init__(self, cfg: PrepConfig, run_hash: str):
        self.cfg = cfg
        self.run_hash = run_hash

    def traits(self) -> Traits:
        return Traits(title="Write manifest", light=True, final_outputs=True)

    def config(self) -> StageConfig:
        return StageConfig(self._settings())

    def _settings(self) -> dict[str, Any]:
        return {"manifest": 1}

    def make_plan(self) -> list[Unit[ManifestPayload]]:
        return [Unit("manifest", ManifestPayload())]

    def run_unit(self, unit: Unit[ManifestPayload], ctx: UnitContext) -> ManifestStats:
        cfg = self.cfg
        tk, pk = ctx.upstream("tokenize"), ctx.upstream("pack")
        counts = {"rows_read": 0, "accepted": 0, "empty": 0, "rejected": 0, "excluded": 0, "without_id": 0,
                  **dict.fromkeys(SPAN_COUNTS, 0)}
        corrupt: list[CorruptFile] = []
        if cfg.exclude is not None and cfg.exclude.rules is not None:
            check_tokenize_piece_ids(tk, cfg.max_tokens)
        with ctx.open_write(ctx.output_path("rejects/rejects.jsonl")) as out:
            for u, receipt, _ in tokenize_inputs(tk, cfg.max_tokens):
                s = receipt["stats"]
                for k in counts:
                    counts[k] += s.get(k, 0)
                corrupt += s.get("corrupt_files", [])
                if s["rejected"]:
                    with storage.open_read(storage.join(tk.parts_dir, f"{u.id}.rejects.jsonl")) as f:
                        while block := f.read(1 << 20):
                            out.write(block)
        entries = []
        for shard_unit in pk.stage.plan():
            c = pk.check(shard_unit.id)
            if not c.done:
                raise RuntimeError(f"pack unit {shard_unit.id} is not complete: {c.reason}")
            entries.append(manifests.entry_from_receipt(shard_unit.payload["shard"], c.done_receipt()))
        written = sum(s["num_documents"] for s in entries)
        expected = cfg.exclude.expected if cfg.exclude else None
        if expected is not None and cfg.max_tokens is None and counts["excluded"] != expected:
            raise RuntimeError(f"the drop lists name {expected:,} row(s) of these inputs, but {counts['excluded']:,} "
                               "were met and excluded: a listed row matches no row read (a row number past its "
                               "file's end?); the drop list and the inputs disagree")
        span = cfg.exclude is not None and cfg.exclude.rules is not None
        rows = manifests.row_accounting(read=counts["rows_read"], accepted=counts["accepted"], empty=counts["empty"],
                                     rejected=counts["rejected"], written=written,
                                     excluded=counts["excluded"] if cfg.exclude else None,
                                     pieces=counts["pieces"] if span else None)
        extra: dict[str, Any] = {"max_tokens": cfg.max_tokens, "run_hash": self.run_hash,
                                 "plan_hash": ctx.run.stage_hash, "source": cfg.source or {"inputs": cfg.num_inputs}}
        if cfg.exclude:
            extra["excluded_overlaps"] = cfg.exclude.manifest(
                counts["excluded"], {k: counts[k] for k in SPAN_COUNTS} if span else None)
        if corrupt:  # each also counted as a rejected row (the rows before the damage were read)
            extra["corrupt_files"] = sorted(corrupt, key=lambda c: c["path"])
        if counts["without_id"]:  # said, not an error: such a row is named relpath:row (formats.row_ids)
            extra["documents_without_id"] = {"id_field": cfg.id_field, "documents": counts["without_id"],
                                             "named": "relpath:row"}
        manifest = manifests.build_manifest(
            dataset=cfg.dataset, entries=entries, rows=rows, num_shards=cfg.num_shards,
            created_at=manifests.keep_created_at(storage.join(ctx.run.dir, "created_at")), tokenizer=cfg.tokenizer,
            extra=extra)
        remove_stale_shards(cfg.output, {s[k] for s in entries for k in ("path", "index_path", "docs_path")})
        ctx.write_bytes(ctx.output_path(manifests.MANIFEST), manifests.manifest_json(manifest))
        return manifest_stats(manifest["total_tokens"], written, rows)


def check_tokenize_piece_ids(tk: StageRun, max_tokens: int | None) -> None:
    """Span mode: no piece's id is the id of a row kept as a document
    (:func:`~.piece_ids.check_piece_ids` over the lists of the tokenize units the output
    includes); :class:`RuntimeError` naming both rows."""
    pieces: list[str] = []
    formed: list[str] = []
    piece_count = formed_count = 0
    for u, receipt, _ in tokenize_inputs(tk, max_tokens):
        s = receipt["stats"]
        if s.get("pieces"):
            pieces.append(storage.join(tk.parts_dir, piece_ids_part(u.id)))
            piece_count += int(s["pieces"])
        if s.get("piece_form_ids"):
            formed.append(storage.join(tk.parts_dir, formed_ids_part(u.id)))
            formed_count += int(s["piece_form_ids"])
    check_piece_ids(pieces, piece_count, formed, formed_count)


def remove_stale_shards(output: str, listed: set[str]) -> list[str]:
    """Remove the shard files under ``output`` not in ``listed`` (paths relative to it: the new
    manifest's), and their folders left empty; one warning line says what was replaced.
    Returns the files removed."""
    root = output.rstrip("/") + "/"
    stale = [p for p in shards.shard_files(output) if p.startswith(root) and p[len(root):] not in listed]
    for path in stale:
        storage.remove(path, root=output)
    folders = sorted({storage.dirname(p) for p in stale})
    emptied = [f for f in folders if storage.remove_empty_folder(f, root=output)]
    if stale:
        names = [storage.basename(f) for f in folders]
        shown = ", ".join(names[:3]) + (f" ... {names[-1]}" if len(names) > 3 else "")
        log.warning("replaced the shards of an earlier plan: removed %d file(s) in %d shard folder(s) not part of "
                    "this one (%s)%s", len(stale), len(folders), shown,
                    f"; {len(emptied)} folder(s) left empty were removed" if emptied else "")
    return stale


def clear_stale_manifest(runs: list[StageRun], plans: list[list[Unit[Any]]]) -> None:
    """A manifest of another plan must not sit beside shards being rewritten: remove it."""
    manifest_run = runs[-1]
    if manifest_run.check("manifest").done:
        return
    path = storage.join(manifest_run.output, "manifest.json")
    try:
        if storage.read_json(path).get("plan_hash") != manifest_run.stage_hash:
            log.warning("removing %s: it describes a different plan; a new one is written at the end", path)
            storage.remove(path, root=manifest_run.output)
    except (FileNotFoundError, ValueError):
        if storage.exists(path):
            storage.remove(path, root=manifest_run.output)
