"""The tokenize stage: some input (a file, a group of small ones, a byte range, parquet row
groups) -> a spill of its documents' tokens, grouped by shard; its wave policy under
``--max-tokens`` (:class:`TokenBudget`) and its Beam wiring (the count stage's row bases)."""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Mapping, TypedDict, TypeVar, cast

from refinery.transforms.formats.bpe_encoder import FastTiktokenTokenizer
from refinery.transforms.formats.encoders import load_tokenizer
from refinery.transforms.formats.failed_run import CorruptFile
from refinery.transforms.formats.tokenizer_choice import PrepTokenizer
from refinery.transforms.io import storage
from refinery.transforms.io.gc_pause import gc_paused
from refinery.transforms.io.rows import (
    parquet_row_groups,
)
from refinery.transforms.io.text import TEXT_NORMALIZATION
from refinery.transforms.prep import spill
from refinery.transforms.prep.stages.config import PrepConfig, check_unchanged
from refinery.transforms.prep.stages.count import CountRowsStage, byte_ranges, split_by_range
from refinery.transforms.prep.stages.tokenize_rows import UnitTally
from refinery.transforms.resumable import (
    Stage,
    StageConfig,
    StageRun,
    StageWiring,
    Traits,
    Unit,
    UnitContext,
    short_hash,
)
from refinery.transforms.resumable.ledger import Receipt
from refinery.transforms.resumable.progress import rate

log = logging.getLogger("refinery")


_U = TypeVar("_U", bound="Unit[Any]")


def included_units(units: list[_U], receipts: dict[str, Receipt], max_tokens: int | None,
                   wave: int = 1 << 62) -> tuple[list[_U], bool]:
    """The prefix of tokenize units that the budget needs, and whether it is final.

    Without a budget: every unit. With one: units in input order until the tokens of the
    completed ones reach the budget, asking for at most ``wave`` unknown units at a time.
    """
    if max_tokens is None:
        return units, True
    prefix: list[_U] = []
    total = unknown = 0
    for u in units:
        prefix.append(u)
        r = receipts.get(u.id)
        if r is None:
            unknown += 1
            if unknown >= wave:
                return prefix, False
            continue
        total += int(tokenize_stats(r)["tokens"])
        if total >= max_tokens:
            return prefix, unknown == 0
    return prefix, unknown == 0


class _PieceBase(TypedDict):
    path: str
    relpath: str  # the path relative to the folder the user named (fallback document ids)
    fingerprint: dict[str, Any]  # storage.InputFile.fingerprint() when planned


class Piece(_PieceBase, total=False):
    """One input of a tokenize unit: a whole file, or a part of one."""

    row_groups: list[int]  # [first, end) row groups of a parquet file
    byte_range: list[int]  # [lo, hi) bytes of a .jsonl file (its rows numbered by the count stage)
    row_base: int  # the row a byte range starts at, in a plan made before the count stage


class TokenizePayload(TypedDict):
    """A tokenize unit's payload: its inputs, in order."""

    pieces: list[Piece]


class _TokenizeStatsBase(TypedDict):
    rows_read: int
    accepted: int
    empty: int
    rejected: int
    tokens: int
    chars: int


class TokenizeStats(_TokenizeStatsBase, total=False):
    """A tokenize unit's receipt stats."""

    excluded: int  # rows dropped by --exclude-overlaps (only with it); span mode: rows listed, cut or dropped
    pieces: int  # span mode: documents cut from listed rows (counted in accepted too)
    rows_split: int  # span mode: listed rows cut into pieces
    rows_dropped: int  # span mode: listed rows dropped whole (more holes than --exclude-max-splits, unread by decon)
    pieces_too_short: int  # span mode: pieces under --exclude-min-chars (or blank once normalized), dropped
    chars_removed: int  # span mode: characters of listed rows not kept
    piece_form_ids: int  # span mode: documents of rows kept whose id has a piece's form (piece_ids.has_piece_form)
    corrupt_files: list[CorruptFile]  # files cut short or corrupt (only when there are)
    encoder_fallbacks: int  # documents the fast encoder refused, encoded by tiktoken
    without_id: int  # accepted documents whose row has no --id-field value: named relpath:row (only when there are)


def tokenize_stats(receipt: Receipt) -> TokenizeStats:
    """The stats of a tokenize unit's receipt."""
    return cast(TokenizeStats, receipt["stats"])


class TokenizeStage(Stage[TokenizePayload, TokenizeStats]):
    """Unit: some input -> ``<unit>.spill`` + ``.spilldocs`` + ``.spillshards`` + ``.spillmeta`` +
    ``.spillnames`` (each document's row, id and source, for the shard's sidecar) + ``.rejects.jsonl``.

    A unit holds about :data:`UNIT_BYTES` of input, so that the cores have units to share
    whatever the layout: consecutive small files are grouped into one unit, a big local
    ``.jsonl`` is split into byte ranges (its row numbers are counted when planning), a
    parquet file into ranges of ``row_groups_per_unit`` row groups. The unit boundaries
    depend only on the inputs, never on the number of workers.
    """

    name = "tokenize"

    def __init__(self, cfg: PrepConfig):
        self.cfg = cfg

    def traits(self) -> Traits:
        return Traits(title="Tokenize units", progress_text=self._progress_text,
                      waves=None if self.cfg.max_tokens is None else TokenBudget(self.cfg.max_tokens,
                                                                                 self.cfg.wave_units),
                      wiring=TokenizeWiring())

    def config(self) -> StageConfig:
        return StageConfig(self._settings(), self._inputs(), self._identity())

    def _settings(self) -> dict[str, Any]:
        # {"text_field": F} as before templates, so outputs made with a field keep their hashes
        return {**self.cfg.text.identity(), "id_field": self.cfg.id_field,
                "num_shards": self.cfg.num_shards, "row_groups_per_unit": self.cfg.row_groups_per_unit,
                "unit_bytes": self.cfg.unit_bytes, "normalize": TEXT_NORMALIZATION, "source": self.cfg.source,
                "max_row_bytes": self.cfg.max_row_bytes,
                **({"exclude": self.cfg.exclude.identity()} if self.cfg.exclude else {}), **self._relpaths(),
                **({"piece_ids": "listed/1"} if self._span else {})}  # piece_ids: the lists piece_ids checks

    @property
    def _span(self) -> bool:
        return self.cfg.exclude is not None and self.cfg.exclude.rules is not None

    def _relpaths(self) -> dict[str, Any]:
        """The inputs' paths relative to the folder the user named (a row without an id is
        ``relpath:row``): the same files under another root are other documents, another
        plan. Only when some relpath is more than its file's name, so that the plans of
        inputs named directly, or in one flat folder, keep the hashes they had before."""
        relpaths = [f.relpath for f in self.cfg.inputs]
        if all(r == storage.basename(f.path) for r, f in zip(relpaths, self.cfg.inputs)):
            return {}
        return {"relpaths": short_hash(relpaths)}

    def _inputs(self) -> list[dict[str, Any]]:
        return [f.fingerprint() for f in self.cfg.inputs]

    def _identity(self) -> dict[str, Any]:
        return {**self.cfg.tokenizer.identity(), "spill": spill.SPILL_FORMAT}

    def _pieces(self, i: int, f: storage.InputFile) -> list[tuple[str, Piece]] | None:
        """(unit id, piece) for a file that is split into several units, else None."""
        base: Piece = {"path": f.path, "relpath": f.relpath, "fingerprint": f.fingerprint()}
        if storage.has_suffix(f.path, ".parquet"):
            try:
                groups = parquet_row_groups(f.path) if f.size else []
            except Exception as e:  # noqa: BLE001 - a corrupt file: one unit rejects it with the reason
                log.warning("%s: unreadable parquet footer (%s: %s); it is reported as a corrupt file",
                            f.path, type(e).__name__, e)
                groups = []
            step = self.cfg.row_groups_per_unit
            if len(groups) > step:
                return [(f"{i:05d}-{g:05d}", {**base, "row_groups": [g, min(g + step, len(groups))]})
                        for g in range(0, len(groups), step)]
        elif split_by_range(f, self.cfg.unit_bytes):  # rows numbered from the count stage's receipts
            return [(f"{i:05d}-r{k:04d}", {**base, "byte_range": [lo, hi]})
                    for k, (lo, hi) in enumerate(byte_ranges(f.size, self.cfg.unit_bytes))]
        return None

    def make_plan(self) -> list[Unit[TokenizePayload]]:
        units: list[Unit[TokenizePayload]] = []
        group: list[Piece] = []
        group_id, group_bytes = "", 0
        for i, f in enumerate(self.cfg.inputs):
            pieces = self._pieces(i, f)
            if pieces is not None or group_bytes >= self.cfg.unit_bytes or len(group) >= 1024:
                if group:
                    units.append(Unit(group_id, TokenizePayload(pieces=group)))
                group, group_bytes = [], 0
            if pieces is not None:
                units += [Unit(uid, TokenizePayload(pieces=[piece])) for uid, piece in pieces]
                continue
            if not group:
                group_id = f"{i:05d}"
            group.append({"path": f.path, "relpath": f.relpath, "fingerprint": f.fingerprint()})
            group_bytes += f.size
        if group:
            units.append(Unit(group_id, TokenizePayload(pieces=group)))
        return units

    @staticmethod
    def _row_base(unit: Unit[TokenizePayload], piece: Piece, ctx: UnitContext) -> int:
        """The row a piece's rows are numbered from: 0, or for a byte range the count stage's."""
        if "byte_range" not in piece or piece["byte_range"][0] == 0:
            return 0
        if "row_base" in piece:  # a plan made before the count stage
            return piece["row_base"]
        bases = ctx.side.get("row_bases")
        if bases is None:  # run without Beam
            bases = CountRowsStage.bases(ctx.upstream("count"))
        return bases[unit.id]

    def run_unit(self, unit: Unit[TokenizePayload], ctx: UnitContext) -> TokenizeStats:
        cfg = self.cfg
        enc = load_tokenizer(cfg.tokenizer, cfg.encoder)
        fast = enc if isinstance(enc, FastTiktokenTokenizer) else None  # counts what tiktoken encoded for it
        fallbacks = fast.fallbacks if fast is not None else 0
        pieces = unit.payload["pieces"]
        for p in pieces:
            check_unchanged(p)
        with ctx.writes_together():  # its files durable at once, at its end (not one fsync after another)
            return self._run_unit(unit, ctx, enc, fallbacks)

    def _run_unit(self, unit: Unit[TokenizePayload], ctx: UnitContext, enc: PrepTokenizer,
                  fallbacks: int) -> TokenizeStats:
        cfg, pieces = self.cfg, unit.payload["pieces"]
        fast = enc if isinstance(enc, FastTiktokenTokenizer) else None
        with ctx.open_write(ctx.part_path(f"{unit.id}.spill")) as tokens_out, \
                ctx.open_write(ctx.part_path(f"{unit.id}.spillnames")) as names_out, \
                ctx.open_write(ctx.part_path(f"{unit.id}.rejects.jsonl")) as rejects_out, \
                contextlib.ExitStack() as lists, gc_paused():
            tally = UnitTally(cfg, enc, spill.SpillWriter(tokens_out, names_out=names_out), ctx)
            if self._span:  # every piece's id, and the ids of a piece's form of the rows kept (piece_ids)
                tally.piece_ids = lists.enter_context(ctx.open_write(ctx.part_path(piece_ids_part(unit.id))))
                tally.formed_ids = lists.enter_context(ctx.open_write(ctx.part_path(formed_ids_part(unit.id))))
            for p in pieces:
                rg, br = p.get("row_groups"), p.get("byte_range")
                tally.read_piece(p["path"], p["relpath"], (rg[0], rg[1]) if rg else None,
                                 (br[0], br[1]) if br else None, self._row_base(unit, p, ctx), rejects_out)
            tally.encode_batch()
            table, meta, starts = spill.by_shard_with_meta(tally.writer.close(), tally.writer.meta, cfg.num_shards)
        for p in pieces:
            check_unchanged(p)  # what was read is what was planned (else the plan hash would lie)
        stats = unit_stats(tally, None if fast is None else fast.fallbacks - fallbacks)
        with ctx.open_write(ctx.part_path(f"{unit.id}.spilldocs")) as f:
            spill.write_array(f, table)
        with ctx.open_write(ctx.part_path(f"{unit.id}.spillmeta")) as f:
            spill.write_array(f, meta)
        with ctx.open_write(ctx.part_path(f"{unit.id}.spillshards")) as f:
            spill.write_array(f, starts)
        return stats

    def _progress_text(self, stats: Mapping[str, Any], seconds: float) -> str:
        tokens = stats.get("tokens", 0)
        per_s = rate(tokens, seconds, "tok", ",.0f")
        return f"docs={int(stats.get('accepted', 0)):,} tokens={int(tokens):,}" + (f" {per_s}" if per_s else "")


def unit_stats(tally: UnitTally, encoder_fallbacks: int | None) -> TokenizeStats:
    """A tokenize unit's receipt stats, from its ``tally``; ``encoder_fallbacks``: documents
    the fast encoder refused (None: no fast encoder)."""
    stats: TokenizeStats = {"rows_read": tally.rows_read, "accepted": tally.accepted, "empty": tally.empty,
                            "rejected": tally.rejected, "tokens": tally.tokens, "chars": tally.chars}
    if tally.cfg.exclude:
        stats["excluded"] = tally.excluded
        if tally.cfg.exclude.rules is not None:
            c = tally.cut
            stats["pieces"], stats["rows_split"], stats["rows_dropped"] = \
                c["pieces"], c["rows_split"], c["rows_dropped"]
            stats["pieces_too_short"], stats["chars_removed"] = c["pieces_too_short"], c["chars_removed"]
            stats["piece_form_ids"] = tally.formed
    if tally.corrupt:
        stats["corrupt_files"] = tally.corrupt
    if encoder_fallbacks is not None:  # documents the fast encoder refused, encoded by tiktoken
        stats["encoder_fallbacks"] = encoder_fallbacks
    if tally.without_id:
        stats["without_id"] = tally.without_id
    return stats


def piece_ids_part(unit_id: str) -> str:
    """Span mode: a tokenize unit's list of its pieces' ids (:func:`~.piece_ids.id_line` each)."""
    return f"{unit_id}.piece_ids.jsonl"


def formed_ids_part(unit_id: str) -> str:
    """Span mode: a tokenize unit's list of the ids of a piece's form of the rows it kept."""
    return f"{unit_id}.formed_ids.jsonl"


def tokenize_inputs(upstream: StageRun, max_tokens: int | None) -> list[tuple[Unit[TokenizePayload], Receipt, int]]:
    """(unit, receipt, tokens before this unit) for the tokenize units the output includes.

    Uses the one completion check; the stage barrier already made every needed unit complete.
    """
    units = upstream.stage.plan()
    receipts: dict[str, Receipt] = {}
    for u in units:
        c = upstream.check(u.id)
        if c.done and c.receipt is not None:
            receipts[u.id] = c.receipt
    chosen, final = included_units(units, receipts, max_tokens)
    missing = [u.id for u in chosen if u.id not in receipts]
    if missing or not final:
        raise RuntimeError(f"tokenize units not completed: {missing[:10]}")
    out: list[tuple[Unit[TokenizePayload], Receipt, int]] = []
    before = 0
    for u in chosen:
        out.append((u, receipts[u.id], before))
        before += int(tokenize_stats(receipts[u.id])["tokens"])
    return out


@dataclass(frozen=True)
class TokenBudget:
    """Prep's wave policy under ``--max-tokens``: the tokenize units the output includes, in
    waves of ``wave_units`` until the budget is met (:func:`included_units`)."""

    max_tokens: int
    wave_units: int

    def needed(self, units: list[Unit[Any]], done: dict[str, Receipt]) -> tuple[list[Unit[Any]], bool]:
        return included_units(units, done, self.max_tokens, self.wave_units)


class TokenizeWiring(StageWiring):
    """Tokenize's Beam wiring: the count stage's row bases, once it is done, as a side input."""

    def side_inputs(self, run: StageRun, start: Any) -> dict[str, Any]:
        import apache_beam as beam  # lazy: Beam loads with the job, not with the command

        if "count" not in run.upstream:
            return {}
        bases = start | "RowBases" >> beam.Map(lambda _, r: CountRowsStage.bases(r), run.upstream["count"])
        return {"row_bases": beam.pvalue.AsSingleton(bases, default_value=None)}
