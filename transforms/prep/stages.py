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
"""
from __future__ import annotations

import contextlib
import logging
import re
from array import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Mapping, TypedDict, TypeVar, cast

import numpy as np

from refinery.transforms.formats import manifests, provenance, shards
from refinery.transforms.formats.bpe_encoder import FastTiktokenTokenizer
from refinery.transforms.formats.encoders import load_tokenizer
from refinery.transforms.formats.failed_run import CorruptFile
from refinery.transforms.formats.row_ids import doc_id_for
from refinery.transforms.formats.tokenizer_choice import DEFAULT, PrepTokenizer, TokenizerSpec
from refinery.transforms.io import storage
from refinery.transforms.io.gc_pause import gc_paused
from refinery.transforms.io.jsonl import json_line
from refinery.transforms.io.rows import (
    CORRUPT,
    DEFAULT_MAX_ROW_BYTES,
    RowBlock,
    iter_row_blocks,
    parquet_row_groups,
    plain_json_lines,
)
from refinery.transforms.io.text import TEXT_NORMALIZATION, TextSpec, normalize_text
from refinery.transforms.prep import pack, spill
from refinery.transforms.prep.documents import (
    BATCH_CHARS,
    BATCH_DOCS,
    Document,
    Rejected,
    encode_by_shard,
    extract_text,
    row_normalizer,
    shard_of,
    shards_of,
)
from refinery.transforms.prep.exclusion import Exclusion
from refinery.transforms.prep.piece_ids import check_piece_ids, has_piece_form, id_line
from refinery.transforms.prep.span_cut import cut_row, piece_id
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

UNIT_BYTES = 16 << 20  # default input bytes per tokenize unit: small files are grouped, big .jsonl files split


@dataclass
class PrepConfig:
    inputs: list[storage.InputFile]
    output: str
    dataset: str
    num_shards: int = 8
    text_field: str = "text"
    id_field: str = "id"
    max_tokens: int | None = None
    row_groups_per_unit: int = 8
    unit_bytes: int = UNIT_BYTES  # 0: one unit per file (no grouping, no byte ranges)
    wave_units: int = 4
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES  # a larger row is rejected as too large, never held whole
    source: dict[str, Any] = field(default_factory=dict)  # how the inputs were named (e.g. HF dataset + revision)
    exclude: Exclusion | None = None  # training rows left out: decon drop lists (--exclude-overlaps)
    text_template: str | None = None  # set: the text is this template over the rows' fields (text_field unused)
    tokenizer: TokenizerSpec = DEFAULT  # resolved in the driver (formats.tokenizer_choice.resolve_tokenizer)
    encoder: str = "fast"  # "fast", "bpe-openai", "tiktoken": the same tokens (formats.encoders.ENCODERS)
    num_inputs: int = -1  # len(inputs); kept when a job carries the config without its input list

    def __post_init__(self) -> None:
        self.num_inputs = len(self.inputs)

    @property
    def text(self) -> TextSpec:
        """Where each row's text comes from: the template when set, else the text field."""
        return TextSpec.from_options(None, self.text_template, self.text_field)

    def __getstate__(self) -> dict[str, Any]:
        """What a job carries: the settings, not the input list (the driver's: it made the plan,
        which the workers read from the output), so that the job does not grow with the corpus."""
        return {**self.__dict__, "inputs": None}


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


# ---------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------



def range_newlines(path: str, lo: int, hi: int, chunk: int = 1 << 24) -> int:
    """The newlines in bytes ``[lo, hi)`` of a local file."""
    count = 0
    with open(path, "rb") as f:
        f.seek(lo)
        left = hi - lo
        while left > 0 and (data := f.read(min(chunk, left))):
            count += data.count(b"\n")
            left -= len(data)
    return count


def byte_ranges(size: int, step: int) -> list[tuple[int, int]]:
    """The byte ranges a big ``.jsonl`` of ``size`` bytes is split into: ``step`` bytes each."""
    return [(lo, min(lo + step, size)) for lo in range(0, size, step)]


def count_span(ranges: list[tuple[int, int]], k: int) -> tuple[int, int]:
    """The bytes whose newlines range ``k`` contributes to the row numbers of the ranges after
    it: ``[lo - 1, next lo - 1)`` (``[0, ...)`` for the first). A range's rows are numbered
    from :func:`row_bases`: 0 for the first, else 1 + the newlines before its ``lo - 1``, the
    lines that start before it (a line starts at 0 and after each newline)."""
    lo, hi = ranges[k]
    return max(lo - 1, 0), hi - 1


def row_bases(newlines: list[int]) -> list[int]:
    """Each range's first row number, from the newlines each range but the last counted
    (:func:`count_span`)."""
    out, seen = [0], 0
    for n in newlines:
        seen += n
        out.append(1 + seen)
    return out


def split_by_range(f: storage.InputFile, unit_bytes: int) -> bool:
    """Whether tokenize splits ``f`` into byte ranges: a local ``.jsonl`` over twice ``unit_bytes``."""
    return storage.has_suffix(f.path, ".jsonl") and not storage.is_remote(f.path) and 0 < 2 * unit_bytes < f.size


class CountPayload(TypedDict):
    """A count unit's payload: its file (as planned) and the bytes whose newlines it counts."""

    path: str
    fingerprint: dict[str, Any]  # storage.InputFile.fingerprint() when planned
    span: list[int]  # [lo, hi) bytes: count_span of the unit's byte range


class CountStats(TypedDict):
    """A count unit's receipt stats."""

    newlines: int


class CountRowsStage(Stage[CountPayload, CountStats]):
    """Unit: a byte range of a big local ``.jsonl`` (all but the last of its file) -> the
    newlines of its :func:`count_span`, in its receipt's stats (no file).

    The rows of a byte range are numbered from the lines before it, which the driver would
    otherwise read the whole file to count; these units count them in parallel, inside the
    job, and tokenize takes the row bases from their receipts (a side input). Present only
    when some input is split by byte range. The counts are a pure function of the input files,
    which tokenize's hash covers: this stage does not enter the hashes after it (``chained``),
    so plans made before it existed keep theirs.
    """

    name = "count"

    def __init__(self, cfg: PrepConfig, files: list[tuple[int, storage.InputFile]]):
        self.cfg = cfg
        self.files = files  # (input index, file) of the inputs split by byte range

    def traits(self) -> Traits:
        return Traits(title="Count rows", chained=False, driver_only=("files",))

    def config(self) -> StageConfig:
        return StageConfig(self._settings(), self._inputs())

    def _settings(self) -> dict[str, Any]:
        return {"unit_bytes": self.cfg.unit_bytes}

    def _inputs(self) -> list[dict[str, Any]]:
        return [f.fingerprint() for _, f in self.files]

    def make_plan(self) -> list[Unit[CountPayload]]:
        units: list[Unit[CountPayload]] = []
        for i, f in self.files:
            ranges = byte_ranges(f.size, self.cfg.unit_bytes)
            units += [Unit(f"{i:05d}-r{k:04d}", CountPayload(path=f.path, fingerprint=f.fingerprint(),
                                                             span=list(count_span(ranges, k))))
                      for k in range(len(ranges) - 1)]
        return units

    def run_unit(self, unit: Unit[CountPayload], ctx: UnitContext) -> CountStats:
        check_unchanged(unit.payload)
        lo, hi = unit.payload["span"]
        newlines = range_newlines(unit.payload["path"], lo, hi)
        check_unchanged(unit.payload)
        return {"newlines": newlines}

    @staticmethod
    def bases(run: StageRun) -> dict[str, int]:
        """Tokenize unit id -> the row its byte range starts at, from the receipts of ``run``
        (this stage, bound): read once per job and handed to every tokenize unit."""
        receipts = run.completed_receipts()
        counts: dict[str, list[int]] = {}
        for u in run.stage.plan():
            if u.id not in receipts:
                raise RuntimeError(f"count unit {u.id} is not complete")
            counts.setdefault(u.id.split("-r")[0], []).append(int(receipts[u.id]["stats"]["newlines"]))
        return {f"{i}-r{k:04d}": base for i, newlines in counts.items() for k, base in enumerate(row_bases(newlines))}


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


SPAN_COUNTS = ("pieces", "rows_split", "rows_dropped", "pieces_too_short", "chars_removed")  # span mode's stats


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
            tally = _UnitTally(cfg, enc, spill.SpillWriter(tokens_out, names_out=names_out), ctx)
            if self._span:  # every piece's id, and the ids of a piece's form of the rows kept (piece_ids)
                tally.piece_ids = lists.enter_context(ctx.open_write(ctx.part_path(piece_ids_part(unit.id))))
                tally.formed_ids = lists.enter_context(ctx.open_write(ctx.part_path(formed_ids_part(unit.id))))
            for p in pieces:
                tally.read_piece(p, self._row_base(unit, p, ctx), rejects_out)
            tally.encode_batch()
            table, meta, starts = spill.by_shard_with_meta(tally.writer.close(), tally.writer.meta, cfg.num_shards)
        for p in pieces:
            check_unchanged(p)  # what was read is what was planned (else the plan hash would lie)
        stats = tally.stats(None if fast is None else fast.fallbacks - fallbacks)
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


class _UnitTally:
    """A tokenize unit's rows read into its spill: its counts, and the batch of documents
    waiting for one encoder call (in input order, with their shards and provenance)."""

    def __init__(self, cfg: PrepConfig, enc: PrepTokenizer, writer: spill.SpillWriter, ctx: UnitContext):
        self.cfg, self.enc, self.writer, self.ctx = cfg, enc, writer, ctx
        self.normalize = row_normalizer(cfg.text, cfg.id_field)
        self.field = cfg.text.field if cfg.text.template is None else None  # the text field, or None (a template)
        self.rows_read = self.accepted = self.empty = self.rejected = self.excluded = 0
        self.cut = dict.fromkeys(SPAN_COUNTS, 0)
        self.tokens = self.chars = self.without_id = 0
        self.corrupt: list[CorruptFile] = []  # files cut short or corrupt
        self.piece_ids: storage.BinaryWriter | None = None  # span mode: each piece's id (piece_ids)
        self.formed_ids: storage.BinaryWriter | None = None  # span mode: each kept row's id of a piece's form
        self.formed = 0
        self._new_batch()

    def _new_batch(self) -> None:
        self.texts: list[str] = []
        self.forced: dict[int, int] = {}  # position in the batch -> its shard, where not its id's (a piece)
        self.plain: list[bool] = []
        self.rows = array("Q")  # the batch's provenance (the shard's sidecar): rows, ids, source paths
        self.ids: list[str] = []
        self.sources: list[str] = []
        self.batch_chars = 0

    def read_piece(self, piece: Piece, row_base: int, rejects_out: storage.BinaryWriter) -> None:
        """Read one input piece's rows (numbered from ``row_base``): each a document of the
        batch, excluded, empty or rejected (its line to ``rejects_out``)."""
        cfg, path = self.cfg, piece["path"]
        columns = [*cfg.text.fields(), cfg.id_field] if storage.has_suffix(path, ".parquet") else None
        rg, br = piece.get("row_groups"), piece.get("byte_range")
        row_groups = (rg[0], rg[1]) if rg else None
        byte_range = (br[0], br[1]) if br else None
        drop = cfg.exclude.rows_of(path) if cfg.exclude else frozenset()
        spans = cfg.exclude.spans_of(path) if cfg.exclude and cfg.exclude.rules else None
        for block in iter_row_blocks(path, row_groups, columns, byte_range, cfg.max_row_bytes):
            self.rows_read += len(block.records)
            if drop or self.formed_ids is not None or self.field is None or block.lines is None:
                for k, record in enumerate(block.records):
                    self._read_row(record, block.errors[k], path, row_base + block.first + k, piece["relpath"],
                                   drop, spans, rejects_out)
            else:
                self._read_block(block, path, row_base, piece["relpath"], rejects_out)

    def _read_block(self, block: RowBlock, path: str, row_base: int, relpath: str,
                    rejects_out: storage.BinaryWriter) -> None:
        """A block of JSON lines, no row listed to exclude, the text one field: a row whose line
        holds plain ASCII strings only (:func:`~refinery.transforms.io.rows.plain_json_lines`)
        and whose text is a string is a document of its text stripped, its id as
        :func:`~refinery.transforms.formats.row_ids.doc_id_for` names it (the same rule as
        :func:`~.documents.normalize_row`: tests compare them); any other row is read by
        :meth:`_read_row`."""
        field, id_field = self.field or "", self.cfg.id_field
        texts, ids, rows, plain, sources = self.texts, self.ids, self.rows, self.plain, self.sources
        first = row_base + block.first
        errors = block.errors
        for k, (record, is_plain) in enumerate(zip(block.records, plain_json_lines(block.lines or []))):
            if is_plain and type(record) is dict and type(text := record.get(field)) is str:
                text = text.strip()
                if not text:
                    self.empty += 1
                    continue
                value = record.get(id_field)
                if value is None:
                    self.without_id += 1
                texts.append(text)
                ids.append(str(value) if value is not None else doc_id_for(record, id_field, relpath, first + k))
                rows.append(first + k)
                plain.append(True)
                sources.append(path)
                self.batch_chars += len(text)
                if self.batch_chars >= BATCH_CHARS or len(texts) >= BATCH_DOCS:
                    self.encode_batch()
                    texts, ids, rows, plain, sources = self.texts, self.ids, self.rows, self.plain, self.sources
            else:  # (which may encode the batch: a new one then)
                self._read_row(record, errors[k], path, first + k, relpath, frozenset(), None, rejects_out)
                texts, ids, rows, plain, sources = self.texts, self.ids, self.rows, self.plain, self.sources

    def _read_row(self, record: dict[str, Any] | None, error: str | None, path: str, row: int, relpath: str,
                  drop: frozenset[int] | Any, spans: Any, rejects_out: storage.BinaryWriter) -> None:
        """One row: a document of the batch, excluded, empty or rejected (its line to ``rejects_out``)."""
        if drop and row in drop:
            self.excluded += 1
            if spans is not None:
                self._cut(record, path, row, relpath, spans.get(row))
            return
        doc = self.normalize(record, error, path, row, relpath)
        if isinstance(doc, Rejected):
            self._reject(doc, path, error, rejects_out)
            return
        if record is not None and record.get(self.cfg.id_field) is None:  # (a document is of a dict row)
            self.without_id += 1
        if self.formed_ids is not None and has_piece_form(doc.doc_id):
            self.formed_ids.write(id_line(doc.doc_id, path, row))
            self.formed += 1
        self._add(doc)

    def _cut(self, record: dict[str, Any] | None, path: str, row: int, relpath: str,
             spans: np.ndarray | None) -> None:
        """Span mode: a listed row's pieces (:func:`~.span_cut.cut_row` of its text as read),
        each normalized, a document ``ROW_ID@START`` in the row's shard; the row dropped whole
        when decon listed no span for it (it could not read it) or its text cannot be read."""
        rules = self.cfg.exclude.rules if self.cfg.exclude else None
        assert rules is not None
        text = extract_text(record, self.cfg.text)[0] if record is not None and spans is not None else None
        if text is None or spans is None:
            self.cut["rows_dropped"] += 1
            self.cut["chars_removed"] += len(text or "")
            return
        try:
            cut = cut_row(len(text), spans, rules)
        except ValueError as e:
            raise storage.InputError(f"{path}: row {row}: {e}") from None
        self.cut["chars_removed"] += cut.removed_chars
        if cut.dropped:
            self.cut["rows_dropped"] += 1
            return
        self.cut["rows_split"] += 1
        self.cut["pieces_too_short"] += cut.too_short
        row_id = doc_id_for(record, self.cfg.id_field, relpath, row) if record is not None else ""
        shard = shard_of(row_id, self.cfg.num_shards)
        for a, b in cut.pieces:
            piece_text = normalize_text(text[a:b])
            if not piece_text:  # blank once normalized: nothing to train on
                self.cut["pieces_too_short"] += 1
                continue
            self.cut["pieces"] += 1
            self.normalize.plain = False
            doc_id = piece_id(row_id, a)
            if self.piece_ids is not None:
                self.piece_ids.write(id_line(doc_id, path, row))
            self._add(Document(doc_id, piece_text, path, row), shard)

    def _reject(self, doc: Rejected, path: str, error: str | None, rejects_out: storage.BinaryWriter) -> None:
        if doc.empty:
            self.empty += 1
            return
        self.rejected += 1
        rejects_out.write(json_line(doc.to_json(), sort_keys=True))
        if error is not None and error.startswith(CORRUPT):  # the file's last row read
            self.corrupt.append({"path": path, "reason": error})

    def _add(self, doc: Document, shard: int | None = None) -> None:
        """``doc`` into the batch, in its shard (default: its id's; a piece: its row's)."""
        if shard is not None:
            self.forced[len(self.texts)] = shard
        self.texts.append(doc.text)
        self.plain.append(self.normalize.plain)
        self.rows.append(doc.row)
        self.ids.append(doc.doc_id)
        self.sources.append(doc.source)
        self.batch_chars += len(doc.text)
        if self.batch_chars >= BATCH_CHARS or len(self.texts) >= BATCH_DOCS:
            self.encode_batch()

    def encode_batch(self) -> None:
        """Encode the batch (one encoder call), spill it, report the unit's progress."""
        if not self.texts:
            return
        doc_shards = shards_of(self.ids, self.cfg.num_shards)
        for at, shard in self.forced.items():
            doc_shards[at] = shard
        order, tokens, lengths = encode_by_shard(self.enc, self.texts, doc_shards, self.plain)
        self.writer.add_batch(doc_shards, order, tokens, lengths, (self.rows, self.ids, self.sources))
        self.accepted += len(self.texts)
        self.tokens += len(tokens)
        self.chars += self.batch_chars
        self._new_batch()
        self.ctx.report_progress({"rows_read": self.rows_read, "accepted": self.accepted, "tokens": self.tokens,
                                  "chars": self.chars})

    def stats(self, encoder_fallbacks: int | None) -> TokenizeStats:
        """The unit's receipt stats; ``encoder_fallbacks``: documents the fast encoder refused
        (None: no fast encoder)."""
        stats: TokenizeStats = {"rows_read": self.rows_read, "accepted": self.accepted, "empty": self.empty,
                                "rejected": self.rejected, "tokens": self.tokens, "chars": self.chars}
        if self.cfg.exclude:
            stats["excluded"] = self.excluded
            if self.cfg.exclude.rules is not None:
                c = self.cut
                stats["pieces"], stats["rows_split"], stats["rows_dropped"] = \
                    c["pieces"], c["rows_split"], c["rows_dropped"]
                stats["pieces_too_short"], stats["chars_removed"] = c["pieces_too_short"], c["chars_removed"]
                stats["piece_form_ids"] = self.formed
        if self.corrupt:
            stats["corrupt_files"] = self.corrupt
        if encoder_fallbacks is not None:  # documents the fast encoder refused, encoded by tiktoken
            stats["encoder_fallbacks"] = encoder_fallbacks
        if self.without_id:
            stats["without_id"] = self.without_id
        return stats


def piece_ids_part(unit_id: str) -> str:
    """Span mode: a tokenize unit's list of its pieces' ids (:func:`~.piece_ids.id_line` each)."""
    return f"{unit_id}.piece_ids.jsonl"


def formed_ids_part(unit_id: str) -> str:
    """Span mode: a tokenize unit's list of the ids of a piece's form of the rows it kept."""
    return f"{unit_id}.formed_ids.jsonl"


def check_unchanged(payload: Mapping[str, Any]) -> None:
    """Raise :class:`storage.InputError` if the unit's input file is gone or changed (size, mtime
    or generation) since the job was planned: its stage hash names the planned version."""
    planned = payload.get("fingerprint")
    if planned is None:
        return
    now = storage.expand_inputs([payload["path"]])[0].fingerprint()
    if storage.is_remote(payload["path"]):  # object listings and single-object info may spell the version differently
        now, planned = now["size"], planned["size"]
    if now != planned:
        raise storage.InputError(f"{payload['path']}: changed since this job was planned (now {now}, planned "
                            f"{planned}); run the same command again to plan with the new version")


def _tokenize_inputs(upstream: StageRun, max_tokens: int | None) -> list[tuple[Unit[TokenizePayload], Receipt, int]]:
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


# A pack unit reads 3 files of every spill it draws from: 3 x M x N requests for M spills and
# N shards. Above this many (spill, shard) pairs a merge stage first combines consecutive
# tokenize spills into groups, so that pack reads 3 x G x N (see docs/SCALE.md).
MERGE_ABOVE = 1 << 16
MERGE_GROUP_BYTES = 1 << 30   # input bytes per merge group (bounds a merge unit's local disk)
MERGE_GROUP_UNITS = 4096
PACK_READ_THREADS = 32        # a pack unit's table reads in flight at once on an object store


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
        return [(u.id, before) for u, _, before in _tokenize_inputs(run.upstream["tokenize"], self.cfg.max_tokens)]

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
                for u, _, before in _tokenize_inputs(tokenize, budget)]

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
            for u, receipt, _ in _tokenize_inputs(tk, cfg.max_tokens):
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
    for u, receipt, _ in _tokenize_inputs(tk, max_tokens):
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


class MergeSpillsWiring(StageWiring):
    """Merge's Beam wiring: the included tokenize units, once tokenize is done, as a side input."""

    def side_inputs(self, run: StageRun, start: Any) -> dict[str, Any]:
        import apache_beam as beam  # lazy: Beam loads with the job, not with the command

        included = start | "Included" >> beam.Map(lambda _, r: r.stage.included(r), run)
        return {"included": beam.pvalue.AsSingleton(included, default_value=None)}


class PackWiring(StageWiring):
    """Pack's Beam wiring: the spills every pack unit reads, once upstream is done, as a side input."""

    def side_inputs(self, run: StageRun, start: Any) -> dict[str, Any]:
        import apache_beam as beam  # lazy: Beam loads with the job, not with the command

        sources = start | "Spills" >> beam.Map(lambda _, r: r.stage.spill_sources(r), run)
        return {"spills": beam.pvalue.AsSingleton(sources, default_value=None)}
