"""A tokenize unit's rows read into its spill (:class:`UnitTally`): each row a document of the
batch waiting for one encoder call, excluded, cut into pieces (span mode), empty or rejected;
the unit's counts. The tokenize stage (:mod:`.tokenize`) drives it, a piece at a time."""
from __future__ import annotations

from array import array
from typing import Any

import numpy as np

from refinery.transforms.formats.failed_run import CorruptFile
from refinery.transforms.formats.row_ids import doc_id_for
from refinery.transforms.formats.tokenizer_choice import PrepTokenizer
from refinery.transforms.io import storage
from refinery.transforms.io.jsonl import json_line
from refinery.transforms.io.rows import (
    CORRUPT,
    RowBlock,
    iter_row_blocks,
    plain_json_lines,
)
from refinery.transforms.io.text import normalize_text
from refinery.transforms.prep import spill
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
from refinery.transforms.prep.piece_ids import has_piece_form, id_line
from refinery.transforms.prep.span_cut import cut_row, piece_id
from refinery.transforms.prep.stages.config import PrepConfig
from refinery.transforms.resumable import (
    UnitContext,
)

SPAN_COUNTS = ("pieces", "rows_split", "rows_dropped", "pieces_too_short", "chars_removed")  # span mode's stats


class UnitTally:
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

    def read_piece(self, path: str, relpath: str, row_groups: tuple[int, int] | None,
                   byte_range: tuple[int, int] | None, row_base: int, rejects_out: storage.BinaryWriter) -> None:
        """Read one input piece's rows (numbered from ``row_base``): the file ``path`` (named
        ``relpath`` under the folder the user named), or its ``[first, end)`` parquet row groups,
        or its ``[lo, hi)`` bytes; each row a document of the batch, excluded, empty or
        rejected (its line to ``rejects_out``)."""
        cfg = self.cfg
        columns = [*cfg.text.fields(), cfg.id_field] if storage.has_suffix(path, ".parquet") else None
        drop = cfg.exclude.rows_of(path) if cfg.exclude else frozenset()
        spans = cfg.exclude.spans_of(path) if cfg.exclude and cfg.exclude.rules else None
        for block in iter_row_blocks(path, row_groups, columns, byte_range, cfg.max_row_bytes):
            self.rows_read += len(block.records)
            if drop or self.formed_ids is not None or self.field is None or block.lines is None:
                for k, record in enumerate(block.records):
                    self._read_row(record, block.errors[k], path, row_base + block.first + k, relpath,
                                   drop, spans, rejects_out)
            else:
                self._read_block(block, path, row_base, relpath, rejects_out)

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
