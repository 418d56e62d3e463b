"""prep: corpora -> uint32 token shards (.npy + .idx) with a checksummed manifest.

Stages (each resumable, see ``refinery.transforms.core.stages``)::

    tokenize  unit = an input slice (a file, or a range of parquet row groups):
              read rows -> normalize -> o200k_harmony encode_ordinary + EOS -> shard by
              md5(doc_id) -> one spill per unit, grouped by shard; rejects with reasons
    pack      unit = an output shard: read the shard's rows from every spill in unit
              (= input) order -> shard_NNNN/{dataset}-v1-shard-NNNNNN.npy + .idx
    manifest  one unit: rows accounting, per-shard sha256 -> manifest.json (last),
              rejects/rejects.jsonl

``--max-tokens`` keeps the documents of the input order (file, row) while their running
total stays within the budget. Tokenize units run in waves until the budget is covered,
so little is read beyond it; the cut itself happens in pack, exactly, from each
document's position recorded in the spill.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field

import numpy as np

from refinery.transforms.core import io
from refinery.transforms.core.rows import iter_rows, parquet_row_groups
from refinery.transforms.core.stages import Stage, StageRun, Unit, UnitContext, short_hash
from refinery.transforms.formats import shards
from refinery.transforms.formats.tokenizer import get_encoding, tokenizer_identity
from refinery.transforms.prep import spill
from refinery.transforms.prep.documents import Rejected, encode_document, normalize_row, shard_of

log = logging.getLogger("refinery")


@dataclass
class PrepConfig:
    inputs: list[io.InputFile]
    output: str
    dataset: str
    num_shards: int = 8
    text_field: str = "text"
    id_field: str = "id"
    max_tokens: int | None = None
    row_groups_per_unit: int = 8
    wave_units: int = 4
    source: dict = field(default_factory=dict)  # how the inputs were named (e.g. HF dataset + revision)


# ---------------------------------------------------------------------------------------
# Pure functions
# ---------------------------------------------------------------------------------------

def parse_token_count(value: str) -> int:
    """'100M' -> 100_000_000; suffixes K, M, B, T (powers of 1000); plain integers too."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMbBtT]?)\s*", str(value))
    if not m:
        raise ValueError(f"not a token count: {value!r} (use e.g. 500K, 100M, 2B)")
    scale = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def included_units(units: list[Unit], receipts: dict[str, dict], max_tokens: int | None,
                   wave: int = 1 << 62) -> tuple[list[Unit], bool]:
    """The prefix of tokenize units that the budget needs, and whether it is final.

    Without a budget: every unit. With one: units in input order until the tokens of the
    completed ones reach the budget, asking for at most ``wave`` unknown units at a time.
    """
    if max_tokens is None:
        return units, True
    prefix: list[Unit] = []
    total = unknown = 0
    for u in units:
        prefix.append(u)
        r = receipts.get(u.id)
        if r is None:
            unknown += 1
            if unknown >= wave:
                return prefix, False
            continue
        total += int(r["stats"]["tokens"])
        if total >= max_tokens:
            return prefix, unknown == 0
    return prefix, unknown == 0


# ---------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------

class TokenizeStage(Stage):
    """Unit: an input slice -> ``<unit>.spill`` + ``.spilldocs`` + ``.spillshards`` + ``.rejects.jsonl``."""

    name = "tokenize"

    def __init__(self, cfg: PrepConfig):
        self.cfg = cfg
        self._plan: list[Unit] | None = None

    def config(self) -> dict:
        return {"text_field": self.cfg.text_field, "id_field": self.cfg.id_field,
                "num_shards": self.cfg.num_shards, "row_groups_per_unit": self.cfg.row_groups_per_unit,
                "normalize": "nfc-crlf-cc-strip/1", "source": self.cfg.source}

    def fingerprints(self) -> list:
        return [f.fingerprint() for f in self.cfg.inputs]

    def identity(self) -> dict:
        return tokenizer_identity()

    def plan(self) -> list[Unit]:
        if self._plan is None:
            units = []
            for i, f in enumerate(self.cfg.inputs):
                base = {"path": f.path, "relpath": f.relpath, "fingerprint": f.fingerprint()}
                if f.path.endswith(".parquet"):
                    try:
                        groups = parquet_row_groups(f.path) if f.size else []
                    except Exception as e:  # noqa: BLE001 - a corrupt file: one unit rejects it with the reason
                        log.warning("%s: unreadable parquet footer (%s: %s); it is reported as a corrupt file",
                                    f.path, type(e).__name__, e)
                        groups = []
                    step = self.cfg.row_groups_per_unit
                    if len(groups) > step:
                        for g in range(0, len(groups), step):
                            units.append(Unit(f"{i:05d}-{g:05d}", {**base, "row_groups": [g, min(g + step, len(groups))]}))
                        continue
                units.append(Unit(f"{i:05d}", base))
            self._plan = units
        return self._plan

    def needed(self, units, receipts):
        return included_units(units, receipts, self.cfg.max_tokens, self.cfg.wave_units)

    def run_unit(self, unit: Unit, ctx: UnitContext) -> dict:
        cfg = self.cfg
        enc = get_encoding()
        p = unit.payload
        rows_read = accepted = empty = rejected = tokens_total = chars = 0
        columns = [cfg.text_field, cfg.id_field] if p["path"].endswith(".parquet") else None
        row_groups = tuple(p["row_groups"]) if p.get("row_groups") else None
        num_shards, text_field, id_field, relpath = cfg.num_shards, cfg.text_field, cfg.id_field, p["relpath"]
        check_unchanged(p)
        with ctx.open_write(ctx.part_path(f"{unit.id}.spill")) as tokens_out, \
                ctx.open_write(ctx.part_path(f"{unit.id}.rejects.jsonl")) as rejects_out:
            writer = spill.SpillWriter(tokens_out)
            for row, record, error in iter_rows(p["path"], row_groups, columns):
                rows_read += 1
                doc = normalize_row(record, error, text_field, id_field, p["path"], row, relpath)
                if type(doc) is Rejected:
                    if doc.empty:
                        empty += 1
                    else:
                        rejected += 1
                        rejects_out.write((io_json(doc.to_json()) + "\n").encode())
                    continue
                tokens = encode_document(enc, doc.text)
                writer.add(shard_of(doc.doc_id, num_shards), tokens)
                accepted += 1
                tokens_total += len(tokens)
                chars += len(doc.text)
            table, starts = spill.by_shard(writer.close(), num_shards)
        check_unchanged(p)  # what was read is what was planned (else the plan hash would lie)
        stats = {"rows_read": rows_read, "accepted": accepted, "empty": empty, "rejected": rejected,
                 "tokens": tokens_total, "chars": chars}
        with ctx.open_write(ctx.part_path(f"{unit.id}.spilldocs")) as f:
            spill.write_array(f, table)
        with ctx.open_write(ctx.part_path(f"{unit.id}.spillshards")) as f:
            spill.write_array(f, starts)
        return stats

    def describe_progress(self, stats: dict, seconds: float) -> str:
        return (f"docs={int(stats.get('accepted', 0)):,} tokens={int(stats.get('tokens', 0)):,} "
                f"tok/s={stats.get('tokens', 0) / max(seconds, 1e-9):,.0f}")


def check_unchanged(payload: dict) -> None:
    """Raise :class:`io.InputError` if the unit's input file is gone or changed (size, mtime
    or generation) since the job was planned: its stage hash names the planned version."""
    planned = payload.get("fingerprint")
    if planned is None:
        return
    now = io.expand_inputs([payload["path"]])[0].fingerprint()
    if io.is_remote(payload["path"]):  # object listings and single-object info may spell the version differently
        now, planned = now["size"], planned["size"]
    if now != planned:
        raise io.InputError(f"{payload['path']}: changed since this job was planned (now {now}, planned "
                            f"{planned}); run the same command again to plan with the new version")


def io_json(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, sort_keys=True)


def _tokenize_inputs(upstream: StageRun, max_tokens: int | None) -> list[tuple[Unit, dict, int]]:
    """(unit, receipt, tokens before this unit) for the tokenize units the output includes.

    Uses the one completion check; the stage barrier already made every needed unit complete.
    """
    units = upstream.stage.plan()
    receipts = {}
    for u in units:
        c = upstream.check(u.id)
        if c.done:
            receipts[u.id] = c.receipt
    chosen, final = included_units(units, receipts, max_tokens)
    missing = [u.id for u in chosen if u.id not in receipts]
    if missing or not final:
        raise RuntimeError(f"tokenize units not completed: {missing[:10]}")
    out, before = [], 0
    for u in chosen:
        out.append((u, receipts[u.id], before))
        before += int(receipts[u.id]["stats"]["tokens"])
    return out


class PackStage(Stage):
    """Unit: an output shard -> ``shard_NNNN/{dataset}-v1-shard-NNNNNN.npy`` + ``.idx``."""

    name = "pack"
    final_outputs = True

    def __init__(self, cfg: PrepConfig):
        self.cfg = cfg

    def config(self) -> dict:
        return {"dataset": self.cfg.dataset, "num_shards": self.cfg.num_shards,
                "max_tokens": self.cfg.max_tokens, "format": shards.FORMAT_VERSION}

    def plan(self) -> list[Unit]:
        return [Unit(f"{s:04d}", {"shard": s}) for s in range(self.cfg.num_shards)]

    def run_unit(self, unit: Unit, ctx: UnitContext) -> dict:
        shard = unit.payload["shard"]
        tk = ctx.upstream("tokenize")
        budget = self.cfg.max_tokens
        pieces = []  # (spill path, doc rows)
        for u, _, before in _tokenize_inputs(tk, budget):
            with io.open_read(io.join(tk.parts_dir, f"{u.id}.spillshards")) as f:
                starts = np.load(f, allow_pickle=False)
            with io.open_read(io.join(tk.parts_dir, f"{u.id}.spilldocs")) as f:
                rows = spill.read_shard_rows(f, starts, shard)
            rows = spill.within_budget(rows, None if budget is None else budget - before)
            if len(rows):
                pieces.append((io.join(tk.parts_dir, f"{u.id}.spill"), rows))
        lengths = np.concatenate([r["length"] for _, r in pieces]) if pieces else np.zeros(0, np.uint32)

        def chunks():
            for spill_path, rows in pieces:
                with io.open_read(spill_path) as f:
                    yield from spill.iter_token_chunks(f, spill.contiguous_ranges(rows))

        npy_rel, idx_rel = shards.shard_relpaths(self.cfg.dataset, shard)
        written = shards.write_shard(ctx.open_write, ctx.output_path(npy_rel), ctx.output_path(idx_rel), lengths, chunks())
        return {"shard": shard, **written}

    def describe_progress(self, stats: dict, seconds: float) -> str:
        return f"docs={int(stats.get('docs', 0)):,} tokens={int(stats.get('tokens', 0)):,}"


class ManifestStage(Stage):
    """One unit, in the driver: receipts -> ``rejects/rejects.jsonl`` then ``manifest.json`` (last)."""

    name = "manifest"
    local = True
    final_outputs = True

    def __init__(self, cfg: PrepConfig, run_hash: str):
        self.cfg = cfg
        self.run_hash = run_hash

    def config(self) -> dict:
        return {"manifest": 1}

    def plan(self) -> list[Unit]:
        return [Unit("manifest")]

    def run_unit(self, unit: Unit, ctx: UnitContext) -> dict:
        cfg = self.cfg
        tk, pk = ctx.upstream("tokenize"), ctx.upstream("pack")
        rows = {"read": 0, "accepted": 0, "empty": 0, "rejected": 0, "over_budget": 0}
        with ctx.open_write(ctx.output_path("rejects/rejects.jsonl")) as out:
            for u, receipt, _ in _tokenize_inputs(tk, cfg.max_tokens):
                s = receipt["stats"]
                rows["read"] += s["rows_read"]
                rows["empty"] += s["empty"]
                rows["rejected"] += s["rejected"]
                rows["accepted"] += s["accepted"]
                if s["rejected"]:
                    with io.open_read(io.join(tk.parts_dir, f"{u.id}.rejects.jsonl")) as f:
                        while block := f.read(1 << 20):
                            out.write(block)
        entries = []
        for u in pk.stage.plan():
            c = pk.check(u.id)
            if not c.done:
                raise RuntimeError(f"pack unit {u.id} is not complete: {c.reason}")
            by_ext = {f["path"].rsplit(".", 1)[1]: f for f in c.receipt["files"]}
            entries.append(shards.shard_entry(u.payload["shard"], by_ext["npy"], by_ext["idx"],
                                              c.receipt["stats"]["tokens"], c.receipt["stats"]["docs"]))
        written = sum(s["num_documents"] for s in entries)
        rows["over_budget"] = rows["accepted"] - written
        rows["accepted"] = written
        manifest = shards.build_manifest(
            dataset=cfg.dataset, entries=entries, rows=rows, num_shards=cfg.num_shards,
            created_at=shards.keep_created_at(io.join(ctx.run.dir, "created_at")),
            extra={"max_tokens": cfg.max_tokens, "run_hash": self.run_hash, "plan_hash": ctx.run.stage_hash,
                   "source": cfg.source or {"inputs": len(cfg.inputs)}})
        listed = {s[k] for s in entries for k in ("path", "index_path")}
        root = cfg.output.rstrip("/") + "/"
        for stale in shards.shard_files(cfg.output):
            if stale.startswith(root) and stale[len(root):] not in listed:
                log.warning("removing %s: a shard of an earlier plan, not part of this one", stale)
                io.remove(stale)
        ctx.write_bytes(ctx.output_path(shards.MANIFEST), shards.manifest_json(manifest))
        return {"tokens": manifest["total_tokens"], "docs": written, **{f"rows_{k}": v for k, v in rows.items()}}


def build_stages(cfg: PrepConfig) -> list[Stage]:
    run_hash = short_hash({"dataset": cfg.dataset, "num_shards": cfg.num_shards, "text_field": cfg.text_field,
                           "id_field": cfg.id_field, "max_tokens": cfg.max_tokens,
                           "tokenizer": tokenizer_identity(), "source": cfg.source})
    return [TokenizeStage(cfg), PackStage(cfg), ManifestStage(cfg, run_hash)]


def clear_stale_manifest(runs: list[StageRun], plans: list[list[Unit]]) -> None:
    """A manifest of another plan must not sit beside shards being rewritten: remove it."""
    manifest_run = runs[-1]
    if manifest_run.check("manifest").done:
        return
    path = io.join(manifest_run.output, "manifest.json")
    try:
        if io.read_json(path).get("plan_hash") != manifest_run.stage_hash:
            log.warning("removing %s: it describes a different plan; a new one is written at the end", path)
            io.remove(path)
    except (FileNotFoundError, ValueError):
        if io.exists(path):
            io.remove(path)
