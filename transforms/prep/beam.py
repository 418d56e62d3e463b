"""prep's public PTransforms: drop refinery's steps into your own Beam pipeline.

::

    docs, rejected = rows | Normalize(text_field="text").with_rejected()
    manifest = (docs | Tokenize() | AssignShard(16)
                | WriteTokenShards("out/", dataset="web", num_shards=16, rejected=rejected))

``Tokenize(tokenizer)`` and ``WriteTokenShards(..., tokenizer=...)`` take the same tokenizer
(default ``o200k_harmony``; a tiktoken encoding name, a ``tokenizer.json`` path or folder, or
a :class:`~refinery.transforms.formats.tokenizer_choice.TokenizerSpec`): the sink writes its dtype
and EOS into the manifest.

======================  ===================================  =====================================
transform               input element                        output element
======================  ===================================  =====================================
``ReadRows(paths)``     (pipeline root)                      :class:`SourceRow` (+ ``Rejected``)
``Normalize()``         ``dict`` or :class:`SourceRow`       :class:`Document`
``Tokenize()``          :class:`Document`                    :class:`TokenizedDocument`
``AssignShard(n)``      :class:`TokenizedDocument`           ``(shard: int, TokenizedDocument)``
``WriteTokenShards``    ``(shard, TokenizedDocument)``       ``str``: the manifest's path (one)
======================  ===================================  =====================================

Each step calls the same per-element code as ``refinery prep``
(:mod:`refinery.transforms.prep.documents`); the sink writes with the same packer
(:mod:`refinery.transforms.prep.pack`: a shard's documents spilled in the command's spill
format, then one function writes its files) and manifest builder. So the same rows with the same
order keys give byte-identical shards either way, and ``refinery verify --checksums``
accepts the sink's output.

Rejected rows are never dropped silently: ``Normalize()`` fails the pipeline on the first
row it cannot use (naming file, row and reason), while ``Normalize().with_rejected()``
returns ``(documents, rejected)`` as Beam's ``with_exception_handling`` does. Documents that
normalize to nothing are not errors: they are counted (Beam metric ``empty``) and, in the
``rejected`` output, carry the reason :data:`~refinery.transforms.prep.documents.EMPTY`.

Beam metrics (namespace ``refinery_prep``): ``rows``, ``documents``, ``empty``, ``rejected``,
``tokens``, ``encoder_fallbacks``, ``shards_written``, ``shards_skipped``: they show in the Dataflow UI.
"""
from __future__ import annotations

import tempfile
from array import array
from typing import Any, Iterable, Iterator, Mapping, Tuple, Union

import apache_beam as beam
import msgpack
import numpy as np
from apache_beam.coders import typecoders
from apache_beam.metrics.metric import Metrics
from apache_beam.pvalue import PBegin, PCollection, TaggedOutput
from apache_beam.transforms import combiners
from apache_beam.transforms.window import BoundedWindow
from apache_beam.utils.timestamp import Timestamp
from apache_beam.utils.windowed_value import WindowedValue

from refinery.transforms.formats import manifests, provenance, shards
from refinery.transforms.formats.encoders import load_tokenizer
from refinery.transforms.formats.tokenizer_choice import DEFAULT, PrepTokenizer, TokenizerSpec, resolve_tokenizer
from refinery.transforms.io import storage
from refinery.transforms.io.coders import TupleCoder
from refinery.transforms.io.jsonl import jsonl
from refinery.transforms.io.rows import SourceRow, iter_rows
from refinery.transforms.io.text import TextSpec
from refinery.transforms.prep import pack, spill
from refinery.transforms.prep.documents import (
    BATCH_CHARS,
    BATCH_DOCS,
    Document,
    Rejected,
    TokenizedDocument,
    row_normalizer,
    shard_of,
    tokenize_documents,
)
from refinery.transforms.prep.stages import PackStats, PrepConfig, ShardPayload, build_stages
from refinery.transforms.resumable import (
    Stage,
    StageConfig,
    StageRun,
    Unit,
    UnitContext,
    compute_stage_hash,
    execute_unit,
)
from refinery.transforms.resumable.beam_steps import RunAllStages, UnitResult, _mypy_only

NAMESPACE = "refinery_prep"
REJECTED = "rejected"


# ---------------------------------------------------------------------------------------
# Coders: deterministic, compact (msgpack of the tuple's fields; tokens as little-endian bytes)
# ---------------------------------------------------------------------------------------

class DocumentCoder(TupleCoder):
    cls = Document


class RejectedCoder(TupleCoder):
    cls = Rejected


class TokenizedDocumentCoder(TupleCoder):
    cls = TokenizedDocument

    def encode(self, value: TokenizedDocument) -> bytes:
        data: bytes = msgpack.packb((value.doc_id, shards.u32_bytes(value.tokens), value.source, value.row),
                                    use_bin_type=True, unicode_errors="surrogatepass")
        return data

    def decode(self, encoded: bytes) -> TokenizedDocument:
        doc_id, raw, source, row = msgpack.unpackb(encoded, raw=False, unicode_errors="surrogatepass")
        tokens = array("I")
        tokens.frombytes(raw)
        if not np.little_endian:
            tokens.byteswap()
        return TokenizedDocument(doc_id, tokens, source, row)


for _cls, _coder in ((Document, DocumentCoder), (Rejected, RejectedCoder), (TokenizedDocument, TokenizedDocumentCoder)):
    typecoders.registry.register_coder(_cls, _coder)


# ---------------------------------------------------------------------------------------
# ReadRows
# ---------------------------------------------------------------------------------------

class RejectedRowError(ValueError):
    """A row ``Normalize()`` (without ``with_rejected()``) could not turn into a document."""


class _ReadFileFn(beam.DoFn):
    def __init__(self) -> None:  # typed, as DoFn's is not (called by name: mypy's exclusion of Beam misses super())
        beam.DoFn.__init__(self)

    @_mypy_only
    def process(self, f: storage.InputFile) -> Iterator[SourceRow | TaggedOutput[str, Rejected]]:
        for row, record, error in iter_rows(f.path):
            if error is None:
                assert record is not None  # iter_rows: a record, or else an error
                yield SourceRow(f.path, row, record, f.relpath)
            else:
                yield beam.pvalue.TaggedOutput(REJECTED, Rejected(f.path, row, error))


class ReadRows(beam.PTransform[PBegin, Union[PCollection[SourceRow],
                                               tuple[PCollection[SourceRow], PCollection[Rejected]]]]):
    """Rows of data files with their provenance. Input: the pipeline root. Output:
    :class:`SourceRow` ``(path, row, record, relpath)`` per good row.

    ``paths``: files, folders (recursive) or globs, local or ``gs://``, in the formats of
    ``refinery prep`` (read by the same reader). One file is read by one worker, in row
    order. A row that cannot be parsed fails the pipeline naming file, row and reason;
    ``ReadRows(paths).with_rejected()`` returns ``(rows, rejected)`` instead, with each
    :class:`Rejected` ready for ``WriteTokenShards(..., rejected=...)``.
    """

    def __init__(self, paths: list[str] | str, with_rejected: bool = False):
        super().__init__()
        self.paths = [paths] if isinstance(paths, str) else list(paths)
        self._with_rejected = with_rejected

    def with_rejected(self) -> "ReadRows":
        return ReadRows(self.paths, with_rejected=True)

    @_mypy_only
    def expand(self, pbegin: PBegin) -> PCollection[SourceRow] | tuple[PCollection[SourceRow], PCollection[Rejected]]:
        files = storage.expand_inputs(self.paths)
        out = (pbegin
               | "Files" >> beam.Create(files, reshuffle=False)
               | "Spread" >> beam.Reshuffle()
               | "Read" >> beam.ParDo(_ReadFileFn()).with_outputs(REJECTED, main="rows"))
        rows: PCollection[SourceRow] = out.rows
        rejected: PCollection[Rejected] = out[REJECTED]
        if self._with_rejected:
            return rows, rejected
        _ = rejected | "FailOnBadRow" >> beam.Map(_fail_on_reject)
        return rows


def _fail_on_reject(r: Rejected) -> None:
    raise RejectedRowError(f"{r.path or '(row)'}:{r.row}: {r.reason} (use .with_rejected() to keep going)")


# ---------------------------------------------------------------------------------------
# Normalize, Tokenize, AssignShard
# ---------------------------------------------------------------------------------------

class _NormalizeFn(beam.DoFn):
    def __init__(self, text: TextSpec, id_field: str, strict: bool):
        self.text, self.id_field, self.strict = text, id_field, strict
        self.rows = Metrics.counter(NAMESPACE, "rows")
        self.documents = Metrics.counter(NAMESPACE, "documents")
        self.empty = Metrics.counter(NAMESPACE, "empty")
        self.rejected = Metrics.counter(NAMESPACE, REJECTED)

    def setup(self) -> None:
        self.normalize = row_normalizer(self.text, self.id_field)  # normalize_row, with its short paths

    @_mypy_only
    def process(self, element: object) -> Iterator[Document | TaggedOutput[str, Rejected]]:
        self.rows.inc()
        if isinstance(element, SourceRow):
            out = self.normalize(element.record, None, element.path, element.row, element.relpath)
        elif isinstance(element, dict):
            out = self.normalize(element, None, "", 0, None)
        else:
            out = Rejected("", 0, f"not a row: a {type(element).__name__}, expected a dict or SourceRow")
        if isinstance(out, Document):
            self.documents.inc()
            yield out
            return
        if out.empty:
            self.empty.inc()
        else:
            self.rejected.inc()
            if self.strict:
                _fail_on_reject(out)
        if not self.strict:
            yield beam.pvalue.TaggedOutput(REJECTED, out)


class Normalize(beam.PTransform[PCollection[Any], Union[PCollection[Document],
                                                         tuple[PCollection[Document], PCollection[Rejected]]]]):
    """Rows -> documents. Input: ``dict`` (a parsed row) or :class:`SourceRow` (a row with its
    file and row number). Output: :class:`Document` ``(doc_id, text, source, row)``.

    The text is ``row[text_field]``, or ``text_template`` filled from the row's fields (e.g.
    ``"{question}\\n\\n{answer}"``; a chat message list is flattened to ``"role: content"``
    messages joined by blank lines: :mod:`refinery.transforms.io.text`), normalized (NFC,
    newlines, control characters, strip);
    the id is ``str(row[id_field])``, else ``"{relpath}:{row}"`` for a :class:`SourceRow`,
    else a hash of the row's canonical JSON. ``(source, row)`` is the order key the sink
    sorts by (``("", 0)`` for a plain dict, which then sorts by id).

    ``Normalize()`` raises :class:`RejectedRowError` on a row it cannot use; use
    ``Normalize().with_rejected()`` to get ``(documents, rejected)`` instead.
    """

    def __init__(self, text_field: str | None = None, id_field: str = "id", *, text_template: str | None = None,
                 _with_rejected: bool = False):
        super().__init__()
        self.text = TextSpec.from_options(text_field, text_template)  # a bad template raises here
        self.text_field, self.text_template, self.id_field = text_field, text_template, id_field
        self._with_rejected = _with_rejected

    def with_rejected(self) -> "Normalize":
        """This transform returning ``(documents, rejected)``: each :class:`Rejected` has the
        row's path (``""`` for a plain dict), row and reason."""
        return Normalize(self.text_field, self.id_field, text_template=self.text_template, _with_rejected=True)

    @_mypy_only
    def expand(self, rows: PCollection[Any]) -> PCollection[Document] | tuple[PCollection[Document],
                                                                              PCollection[Rejected]]:
        fn = _NormalizeFn(self.text, self.id_field, strict=not self._with_rejected)
        out = rows | "Normalize" >> beam.ParDo(fn).with_outputs(REJECTED, main="documents")
        documents: PCollection[Document] = out.documents
        rejected: PCollection[Rejected] = out[REJECTED]
        documents.element_type = Document
        rejected.element_type = Rejected
        if self._with_rejected:
            return documents, rejected
        return documents


# Beam's DoFn parameters, typed as what Beam passes in their place (a default is how Beam finds them)
_TIMESTAMP_PARAM: Any = beam.DoFn.TimestampParam
_WINDOW_PARAM: Any = beam.DoFn.WindowParam


class _TokenizeFn(beam.DoFn):
    """Documents -> :class:`TokenizedDocument`, encoded in batches (:data:`BATCH_CHARS` of text,
    or the end of a bundle) by :func:`tokenize_documents`: the tokenize units' one encoder call
    per batch. Each output keeps its input's timestamp and window."""

    def __init__(self, spec: TokenizerSpec, encoder: str = "fast"):
        self.spec, self.encoder = spec, encoder
        self.tokens = Metrics.counter(NAMESPACE, "tokens")
        self.documents = Metrics.counter(NAMESPACE, "tokenized")
        self.fallbacks = Metrics.counter(NAMESPACE, "encoder_fallbacks")  # documents the fast encoder left to tiktoken
        self.enc: PrepTokenizer | None = None
        self._batch: list[tuple[Document, Timestamp, BoundedWindow]] = []
        self._chars = 0

    def setup(self) -> None:
        self.enc = load_tokenizer(self.spec, self.encoder)  # once per worker process

    def start_bundle(self) -> None:
        self._batch, self._chars = [], 0

    @_mypy_only
    def process(self, doc: Document, timestamp: Timestamp = _TIMESTAMP_PARAM,
                window: BoundedWindow = _WINDOW_PARAM) -> Iterator[WindowedValue]:
        self._batch.append((doc, timestamp, window))
        self._chars += len(doc.text)
        if self._chars >= BATCH_CHARS or len(self._batch) >= BATCH_DOCS:
            yield from self._encode_batch()

    def finish_bundle(self) -> Iterator[WindowedValue]:
        yield from self._encode_batch()

    def _encode_batch(self) -> Iterator[WindowedValue]:
        batch, self._batch, self._chars = self._batch, [], 0
        if not batch:
            return
        if self.enc is None:
            raise RuntimeError("Tokenize: no tokenizer loaded (DoFn.setup was not called before the bundle)")
        before = getattr(self.enc, "fallbacks", 0)
        out = tokenize_documents(self.enc, [doc for doc, _, _ in batch])
        after = getattr(self.enc, "fallbacks", 0)
        if after != before:
            self.fallbacks.inc(after - before)
        self.documents.inc(len(out))
        self.tokens.inc(sum(len(t.tokens) for t in out))
        for tokenized, (_, timestamp, window) in zip(out, batch):
            yield WindowedValue(tokenized, timestamp, (window,))


class Tokenize(beam.PTransform[PCollection[Document], PCollection[TokenizedDocument]]):
    """Documents -> token ids. Input: :class:`Document`. Output: :class:`TokenizedDocument`
    whose ``tokens`` (``array('I')``, uint32) are the tokenizer's ordinary encoding of the text
    (special-token text stays ordinary text) plus one EOS, the tokenizer's.

    ``tokenizer``: ``"o200k_harmony"`` (default: tiktoken ``encode_ordinary`` + 199999, the
    vocab resolved offline and checked against its sha256), another tiktoken encoding, a
    ``tokenizer.json`` path or folder (local or ``gs://``; ``encode(text,
    add_special_tokens=False)``), or a resolved ``TokenizerSpec``. ``eos_token``: a token or an
    id overriding the EOS. Both are resolved when the transform is built (in the driver); a
    bad value raises ``TokenizerError``. ``encoder``: ``"fast"`` (gigatoken's exact encoder
    where it knows the encoding and is installed, else bpe-openai's; tiktoken for what it
    refuses), ``"bpe-openai"`` or ``"tiktoken"``: the same tokens either way. Documents are
    encoded in batches within a bundle, as ``refinery prep``'s tokenize units do."""

    def __init__(self, tokenizer: str | TokenizerSpec | None = None, eos_token: str | int | None = None,
                 encoder: str = "fast"):
        super().__init__()
        self.spec = resolve_tokenizer(tokenizer, eos_token)
        self.encoder = encoder

    @_mypy_only
    def expand(self, docs: PCollection[Document]) -> PCollection[TokenizedDocument]:
        out: PCollection[TokenizedDocument] = docs | "Tokenize" >> beam.ParDo(_TokenizeFn(self.spec, self.encoder))
        out.element_type = TokenizedDocument
        return out


class AssignShard(beam.PTransform[PCollection[TokenizedDocument], PCollection[tuple[int, TokenizedDocument]]]):
    """Input: :class:`TokenizedDocument`. Output: ``(shard, TokenizedDocument)`` with
    ``shard = int(md5(doc_id).hexdigest()[:16], 16) % num_shards`` (the rule of ``refinery prep``)."""

    def __init__(self, num_shards: int):
        super().__init__()
        if num_shards < 1:
            raise ValueError("num_shards must be at least 1")
        self.num_shards = num_shards

    @_mypy_only
    def expand(self, docs: PCollection[TokenizedDocument]) -> PCollection[tuple[int, TokenizedDocument]]:
        n = self.num_shards
        out: PCollection[tuple[int, TokenizedDocument]] = docs | "AssignShard" >> beam.Map(
            lambda d: (shard_of(d.doc_id, n), d)).with_output_types(Tuple[int, TokenizedDocument])
        return out


# ---------------------------------------------------------------------------------------
# WriteTokenShards
# ---------------------------------------------------------------------------------------

class SinkStats(PackStats):
    """A ``WriteTokenShards`` unit's receipt stats: a pack unit's and its content's digest."""

    content_sha256: str  # pack.content_digest of the shard's documents


class ShardSinkStage(Stage[ShardPayload, SinkStats]):
    """The sink's receipts: one unit per shard under ``OUTPUT/.refinery/write_token_shards/<hash>/``.
    The units are run by :class:`_WriteShardFn`, not planned by ``run_stages``: each with its
    shard's documents, spilled and sorted (:func:`pack.sorted_spill`), as the side input
    ``pieces`` and their :func:`pack.content_digest` as ``content``."""

    name = "write_token_shards"

    def __init__(self, dataset: str, num_shards: int, version: str, tokenizer: TokenizerSpec = DEFAULT):
        self.dataset, self.num_shards, self.version, self.tokenizer = dataset, num_shards, version, tokenizer

    def config(self) -> StageConfig:
        return StageConfig(self._settings(), (), self._identity())

    def _settings(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "num_shards": self.num_shards, "version": self.version,
                "format": shards.FORMAT_VERSION, "docs": provenance.DOCS_FORMAT}

    def _identity(self) -> dict[str, Any]:
        return self.tokenizer.identity()

    def make_plan(self) -> list[Unit[ShardPayload]]:
        return [Unit(f"{s:04d}", ShardPayload(shard=s)) for s in range(self.num_shards)]

    def run_unit(self, unit: Unit[ShardPayload], ctx: UnitContext) -> SinkStats:
        """One shard's ``.npy``, ``.idx`` and ``.docs.parquet``, by the command's packer."""
        shard = unit.payload["shard"]
        npy_rel, idx_rel = shards.shard_relpaths(self.dataset, shard, self.version)
        written = pack.write_shard_files(ctx.open_write, ctx.output_path(npy_rel), ctx.output_path(idx_rel),
                                         ctx.side["pieces"], self.tokenizer.dtype)
        return {"shard": shard, **written, "content_sha256": ctx.side["content"]}


def sink_run(output: str, dataset: str, num_shards: int, version: str,
             tokenizer: TokenizerSpec = DEFAULT) -> StageRun:
    """The sink's receipts, hashed as every stage's (:func:`compute_stage_hash`)."""
    stage = ShardSinkStage(dataset, num_shards, version, tokenizer)
    return StageRun(stage, output.rstrip("/"), compute_stage_hash(stage, None))


class _WriteShardFn(beam.DoFn):
    """``(shard, documents)`` -> the shard's manifest entry (a dict). Skips the write when the
    shard's receipt verifies and records the same content."""

    def __init__(self, output: str, dataset: str, num_shards: int, version: str,
                 tokenizer: TokenizerSpec = DEFAULT):
        self.output, self.dataset, self.num_shards, self.version = output, dataset, num_shards, version
        self.tokenizer = tokenizer
        self.written = Metrics.counter(NAMESPACE, "shards_written")
        self.skipped = Metrics.counter(NAMESPACE, "shards_skipped")

    @_mypy_only
    def process(self, element: tuple[int, Iterable[TokenizedDocument | None]]) -> Iterator[dict[str, Any]]:
        shard, docs = element
        run = sink_run(self.output, self.dataset, self.num_shards, self.version, self.tokenizer)
        with tempfile.TemporaryDirectory(prefix="refinery-shard-") as local:
            pieces = pack.sorted_spill(docs, spill.spill_files(local, "shard"))
            content = pack.content_digest(pieces)
            receipt = execute_unit(run, Unit(f"{shard:04d}", ShardPayload(shard=shard)),
                                   side={"pieces": pieces, "content": content},
                                   stale=lambda r: r.get("stats", {}).get("content_sha256") != content)
        if receipt.get("status") != "completed":
            err: Mapping[str, Any] = receipt.get("error") or {}
            raise RuntimeError(f"shard {shard}: {err.get('type')}: {err.get('message')}")
        (self.skipped if receipt.get("skipped") else self.written).inc()
        yield manifests.entry_from_receipt(shard, receipt)


def _write_rejects(rejected: list[Rejected], output: str) -> dict[str, int]:
    """Write ``rejects/rejects.jsonl`` (sorted by path, row) unless it already holds those bytes;
    returns the counts {"rejected", "empty"}."""
    bad = sorted((r for r in rejected if not r.empty), key=lambda r: (r.path, r.row, r.reason))
    data = jsonl((r.to_json() for r in bad), sort_keys=True)
    _write_if_changed(storage.join(output, "rejects", "rejects.jsonl"), data)
    return {"rejected": len(bad), "empty": len(rejected) - len(bad)}


def _write_if_changed(path: str, data: bytes) -> None:
    try:
        if storage.read_bytes(path) == data:
            return
    except FileNotFoundError:
        pass
    storage.atomic_write_bytes(path, data)


def _write_manifest(_: Any, entries: list[dict[str, Any]], counts: dict[str, int] | None, output: str, dataset: str,
                    num_shards: int, version: str, tokenizer: TokenizerSpec) -> str:
    entries = sorted(entries, key=lambda e: e["shard"])
    accepted = sum(e["num_documents"] for e in entries)
    rows = {} if counts is None else manifests.row_accounting(
        read=accepted + counts["empty"] + counts["rejected"], accepted=accepted, empty=counts["empty"],
        rejected=counts["rejected"], written=accepted)
    run = sink_run(output, dataset, num_shards, version, tokenizer)
    manifest = manifests.build_manifest(
        dataset=dataset, entries=entries, rows=rows, num_shards=num_shards, version=version, tokenizer=tokenizer,
        created_at=manifests.keep_created_at(storage.join(run.dir, "created_at")),
        extra={"plan_hash": run.stage_hash, "source": {"writer": "refinery.transforms.prep.WriteTokenShards"}})
    path = storage.join(output.rstrip("/"), manifests.MANIFEST)
    _write_if_changed(path, manifests.manifest_json(manifest))
    return path


class WriteTokenShards(beam.PTransform[PCollection[tuple[int, TokenizedDocument]], PCollection[str]]):
    """The token-shard sink. Input: ``(shard, TokenizedDocument)``. Output: a PCollection
    holding one ``str``, the path of ``manifest.json``, written last.

    Writes ``OUTPUT/shard_NNNN/{dataset}-{version}-shard-NNNNNN.npy`` + ``.idx`` + ``.docs.parquet``
    (each document's id, source and row: ``formats.provenance``) for every shard
    ``0..num_shards-1`` (empty ones too) and ``OUTPUT/manifest.json``, in the layout of
    ``refinery prep``. Inside a shard documents are ordered by ``(source, row, doc_id)``, so
    the bytes do not depend on bundling, runner or worker count. Each shard has a receipt
    (``OUTPUT/.refinery/write_token_shards/<hash>/receipts/``): running the same pipeline
    again rewrites no shard whose receipt verifies and whose content is unchanged, and a
    deleted or truncated shard comes back byte-identical. A shard's documents are spilled
    to a local folder (the command's spill format) while it is sorted, so memory holds
    only their table rows, never their tokens.

    ``rejected`` (the second output of ``Normalize().with_rejected()``): also write
    ``rejects/rejects.jsonl`` and the row accounting ``read = accepted + empty + rejected``
    into the manifest, as ``refinery prep`` does.

    ``tokenizer`` / ``eos_token``: the ones given to ``Tokenize`` (the same values, or its
    ``.spec``): the shards' dtype (uint16 when every id fits) and the manifest's tokenizer
    fields come from it.
    """

    def __init__(self, output: str, dataset: str, num_shards: int, version: str = shards.FORMAT_VERSION,
                 rejected: PCollection[Rejected] | None = None, tokenizer: str | TokenizerSpec | None = None,
                 eos_token: str | int | None = None):
        super().__init__()
        if num_shards < 1:
            raise ValueError("num_shards must be at least 1")
        shards.check_name(dataset)
        self.output, self.dataset, self.num_shards, self.version = output.rstrip("/"), dataset, num_shards, version
        self.rejected = rejected
        self.tokenizer = resolve_tokenizer(tokenizer, eos_token)

    @_mypy_only
    def expand(self, shard_docs: PCollection[tuple[int, TokenizedDocument]]) -> PCollection[str]:
        p = shard_docs.pipeline
        markers = (p | "ShardIds" >> beam.Create(list(range(self.num_shards)))
                   | "EmptyMarker" >> beam.Map(lambda s: (s, None)))
        entries = ((shard_docs, markers) | "WithMarkers" >> beam.Flatten()
                   | "GroupByShard" >> beam.GroupByKey()
                   | "WriteShard" >> beam.ParDo(_WriteShardFn(self.output, self.dataset, self.num_shards,
                                                               self.version, self.tokenizer)))
        counts = None
        if self.rejected is not None:
            output = self.output
            counts = beam.pvalue.AsSingleton(
                self.rejected | "AllRejected" >> combiners.ToList()
                | "WriteRejects" >> beam.Map(_write_rejects, output))
        manifest: PCollection[str] = (p | "Once" >> beam.Create([None])
                                      | "WriteManifest" >> beam.Map(_write_manifest, beam.pvalue.AsList(entries),
                                                                    counts, self.output, self.dataset,
                                                                    self.num_shards, self.version, self.tokenizer))
        return manifest


class PrepPipeline(beam.PTransform[PBegin, PCollection[UnitResult]]):
    """``refinery prep``'s whole flow for ``config`` (a :class:`~refinery.transforms.prep.stages.PrepConfig`),
    as one composite for a user's pipeline. Input: the pipeline (PBegin). Output: the
    manifest step's ``{unit, status, stats}`` (one dict, once the manifest is written).

    Its steps are the command's (``Tokenize units``, [``Merge spills``], ``Pack shards``,
    ``Write manifest``), with the same receipts: it writes the bytes ``refinery prep`` writes
    for the same inputs and settings, skips every unit whose receipt verifies, and the
    command resumes from it (and it from the command)."""

    def __init__(self, config: PrepConfig):
        super().__init__()
        self.config = config

    @_mypy_only
    def expand(self, pbegin: PBegin) -> PCollection[UnitResult]:
        # never empty: prep's manifest stage has one unit
        done: PCollection[UnitResult] = pbegin | "Stages" >> RunAllStages(build_stages(self.config), self.config.output)
        return done


__all__ = ["AssignShard", "Document", "Normalize", "PrepPipeline", "ReadRows", "Rejected", "RejectedRowError",
           "SourceRow", "TokenizedDocument", "Tokenize", "WriteTokenShards"]
