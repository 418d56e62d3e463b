"""decon's public PTransforms: train/test n-gram overlap inside your own Beam pipeline.

::

    index = eval_rows | BuildNgramIndex(ngrams=[13], eval_dataset="gsm8k")
    overlaps = train_rows | FindOverlaps(index)

==========================  ==========================================  ===============================
transform                   input element                               output element
==========================  ==========================================  ===============================
``BuildNgramIndex(ns)``     eval row: ``dict`` or ``SourceRow``          one :class:`~.ngrams.NgramIndex`
``FindOverlaps(index)``     training row: ``dict`` or ``SourceRow``      :class:`Overlap`
``DropOverlaps(overlaps)``  training row: ``dict`` or ``SourceRow``      the same rows, overlapping ones
                                                                        left out
==========================  ==========================================  ===============================

A decontaminated corpus inside one pipeline::

    overlaps = train_rows | FindOverlaps(index)
    clean = train_rows | DropOverlaps(overlaps, ngrams=[13])

The method is HELM's (what ``refinery decon`` computes, through the same code in
:mod:`refinery.transforms.decon.ngrams`): an eval instance overlaps at n when it shares an
n-gram of ``min(n, its token count)`` tokens with a training document. The index is
hash-partitioned: a compact membership set of n-gram hashes is probed first, and a hit is
verified against the exact n-gram text of its hash partition (no false positives).

``FindOverlaps`` is a side-input join: the index is broadcast (``AsSingleton``) and the
training rows are streamed through one ``ParDo``; they are never shuffled.

Beam metrics (namespace ``refinery_decon``): ``eval_rows``, ``eval_bad_rows``, ``test_ngrams``,
``train_rows``, ``train_bad_rows``, ``train_rows_with_overlaps``, ``overlaps``.
"""
from __future__ import annotations

from typing import Any, Iterator, NamedTuple

import apache_beam as beam
from apache_beam.coders import typecoders
from apache_beam.metrics.metric import Metrics
from apache_beam.pvalue import PBegin, PCollection
from apache_beam.transforms import combiners

from refinery.transforms.decon import ngrams as ng
from refinery.transforms.decon.stages import DeconSettings, build_stages
from refinery.transforms.formats.row_ids import doc_id_for
from refinery.transforms.io.coders import TupleCoder
from refinery.transforms.io.rows import SourceRow
from refinery.transforms.io.text import DEFAULT_MATCH_FOLD, TextSpec
from refinery.transforms.resumable.beam_steps import RunAllStages, UnitResult, _mypy_only

NAMESPACE = "refinery_decon"


class Overlap(NamedTuple):
    """One eval instance sharing one n-gram with one training row, with offsets on both sides.

    ``n`` is the configured n-gram length; ``ngram`` has ``min(n, tokens of the instance)``
    tokens joined by one space (HELM's rule for short instances). Offsets are ``[start, end)``
    character offsets into the original texts, one pair per occurrence. ``train_path`` and
    ``train_row`` are known when the training rows came as :class:`SourceRow` (else ``""``
    and ``-1``).
    """

    instance_id: str
    eval_dataset: str
    n: int
    ngram: str
    eval_offsets: tuple[tuple[int, int], ...]
    train_doc_id: str
    train_offsets: tuple[tuple[int, int], ...]
    train_path: str = ""
    train_row: int = -1


class OverlapCoder(TupleCoder):
    cls = Overlap


class NgramIndexCoder(beam.coders.Coder):
    def encode(self, value: ng.NgramIndex) -> bytes:
        return value.to_bytes()

    def decode(self, encoded: bytes) -> ng.NgramIndex:
        return ng.NgramIndex.from_bytes(encoded)

    def is_deterministic(self) -> bool:
        return True

    def to_type_hint(self) -> type[ng.NgramIndex]:
        return ng.NgramIndex


typecoders.registry.register_coder(Overlap, OverlapCoder)
typecoders.registry.register_coder(ng.NgramIndex, NgramIndexCoder)


def _provenance(element: object, default_dataset: str | None) -> tuple[str, str, int, dict[str, Any] | None]:
    """(eval dataset, path, row, record) of an input row (dict or SourceRow)."""
    if isinstance(element, SourceRow):
        return default_dataset or ng.eval_dataset_name(element.path), element.path, element.row, element.record
    if isinstance(element, dict):
        return default_dataset or "eval", "", -1, element
    return default_dataset or "eval", "", -1, None


def index_of_elements(elements: list[Any], ngrams: list[int], eval_dataset: str | None, tokenizer: str,
                      text_field: str | TextSpec, id_field: str, partitions: int,
                      match_fold: str = DEFAULT_MATCH_FOLD) -> ng.NgramIndex:
    """The index of eval rows given in any order: rows are ordered by (dataset, path, row,
    instance id, text) first, so the index does not depend on how Beam delivered them.
    ``text_field``: a field name or a :class:`TextSpec` (a template, chat rows)."""
    records = [_provenance(element, eval_dataset) for element in elements]
    spec = TextSpec.of(text_field)

    def order(r: tuple[Any, ...]) -> tuple[Any, ...]:
        ds, path, row, record = r
        text, _ = spec.extract(record)
        if text is None:
            return (ds, path, row, "", "")  # a bad row: counted, never indexed, wherever it sorts
        return ds, path, row, ng.record_id(record, id_field), text

    records.sort(key=order)
    rows, bad = ng.eval_rows_of(records, spec, id_field, ng.get_tokenizer(tokenizer, match_fold))
    return ng.NgramIndex.build(rows, bad, ngrams, tokenizer, partitions, match_fold=match_fold)


class BuildNgramIndex(beam.PTransform[PCollection[Any], PCollection[ng.NgramIndex]]):
    """Eval rows -> the hash-partitioned test-side n-gram index.

    Input: eval rows, ``dict`` (with ``text_field`` and optionally ``id_field``) or
    :class:`~refinery.transforms.io.rows.SourceRow`. Output: a PCollection holding
    one :class:`~refinery.transforms.decon.ngrams.NgramIndex`, to pass to ``FindOverlaps``
    (it is used there as a singleton side input).

    ``text_template``: build the text from several fields instead of ``text_field`` (e.g.
    ``"{question}\\n\\n{answer}"``; a chat message list is flattened to ``"role: content"``
    messages joined by blank lines: :mod:`refinery.transforms.io.text`).
    ``eval_dataset``: the name of the eval set (default: from each SourceRow's folder, as
    ``refinery decon`` names it, else ``"eval"``). Instance ids are ``str(row[id_field])``,
    else a hash of the whole row. ``tokenizer``: ``default`` (HELM's), ``no_lowercase`` or
    ``whitespace``. ``match_fold``: ``nfkc-cf`` (the default: format characters dropped and
    NFKC before matching, on both sides) or ``none`` (HELM's exact text), as ``refinery decon
    --match-fold``; ``FindOverlaps`` matches with the index's. Rows without a string text are
    counted as bad rows, never indexed.
    """

    def __init__(self, ngrams: list[int] | int, eval_dataset: str | None = None, tokenizer: str = "default",
                 text_field: str | None = None, id_field: str = "id", partitions: int = 64, *,
                 text_template: str | None = None, match_fold: str = DEFAULT_MATCH_FOLD):
        super().__init__()
        self.text = TextSpec.from_options(text_field, text_template)  # a bad template raises here
        self.ngrams = sorted({int(n) for n in ([ngrams] if isinstance(ngrams, int) else ngrams)})
        if not self.ngrams or self.ngrams[0] < 1:
            raise ValueError("ngrams must be positive integers")
        ng.get_tokenizer(tokenizer, match_fold)  # an unknown name or fold raises here
        self.eval_dataset, self.tokenizer, self.match_fold = eval_dataset, tokenizer, match_fold
        self.text_field, self.text_template = text_field, text_template
        self.id_field, self.partitions = id_field, partitions

    @_mypy_only
    def expand(self, rows: PCollection[Any]) -> PCollection[ng.NgramIndex]:
        def build(elements: list[Any]) -> ng.NgramIndex:
            index = index_of_elements(elements, self.ngrams, self.eval_dataset, self.tokenizer, self.text,
                                      self.id_field, self.partitions, self.match_fold)
            Metrics.counter(NAMESPACE, "eval_rows").inc(len(index.rows))
            Metrics.counter(NAMESPACE, "eval_bad_rows").inc(sum(b["bad_rows"] for b in index.bad.values()))
            Metrics.counter(NAMESPACE, "test_ngrams").inc(index.num_ngrams)
            return index

        index: PCollection[ng.NgramIndex] = (
            rows | "AllEvalRows" >> combiners.ToList()
            | "BuildIndex" >> beam.Map(build).with_output_types(ng.NgramIndex))
        return index


def overlaps_of_hits(hits: ng.ScanHits, index: ng.NgramIndex, ngrams: list[int],
                     where: list[tuple[str, int, str | None]], id_field: str) -> Iterator[Overlap]:
    """The :class:`Overlap` records of one batch's verified hits; ``where[i]`` is the
    (path, row, relpath) of the batch's i-th input row."""
    doc_ids: dict[int, str] = {}
    g = hits.group_starts()
    for a, b in zip(g[:-1].tolist(), g[1:].tolist()):
        r = int(hits.row[a])
        row, record, _ = hits.rows[r]
        if r not in doc_ids:  # the row id rule of prep's shards (formats.row_ids)
            doc_ids[r] = doc_id_for(record, id_field, where[row][2], where[row][1])
        n_eff, gram, _, evals = index.lookup(int(hits.partition[a])).records[int(hits.record[a])]
        train_offsets = tuple(zip(hits.start[a:b].tolist(), hits.end[a:b].tolist()))
        path, file_row, _ = where[row]
        for eval_idx, eval_offsets in evals:
            er = index.rows[eval_idx]
            offsets = tuple(tuple(o) for o in eval_offsets)
            for n in ng.configured_ns(ngrams, er.num_tokens, n_eff):
                yield Overlap(er.instance_id, er.eval_dataset, n, gram, offsets, doc_ids[r], train_offsets,
                              path, file_row)


class _FindOverlapsFn(beam.DoFn):
    def __init__(self, ngrams: list[int] | None, text: TextSpec, id_field: str):
        self.ngrams, self.text, self.id_field = ngrams, text, id_field
        self.rows = Metrics.counter(NAMESPACE, "train_rows")
        self.bad = Metrics.counter(NAMESPACE, "train_bad_rows")
        self.hit_rows = Metrics.counter(NAMESPACE, "train_rows_with_overlaps")
        self.overlaps = Metrics.counter(NAMESPACE, "overlaps")

    @_mypy_only
    def process(self, batch: list[Any], index: ng.NgramIndex) -> Iterator[Overlap]:
        ngrams = self.ngrams or index.ns
        if not set(ngrams) <= set(index.ns):
            raise ValueError(f"FindOverlaps(ngrams={ngrams}): the index was built for n = {index.ns}")
        records, where = [], []
        for i, element in enumerate(batch):
            _, path, row, record = _provenance(element, "")
            records.append((i, record, None if isinstance(record, dict) else "not a row"))
            where.append((path, row, element.relpath if isinstance(element, SourceRow) else None))
        stats = ng.ScanStats()
        for hits in ng.scan_rows(records, text_field=self.text, tokenizer=index.splitter,
                                 membership=index.membership, lookup=index.lookup, partitions=index.num_partitions,
                                 stats=stats):
            for overlap in overlaps_of_hits(hits, index, ngrams, where, self.id_field):
                self.overlaps.inc()
                yield overlap
        self.hit_rows.inc(stats.rows_with_hits)
        self.rows.inc(stats.rows)
        self.bad.inc(stats.bad_rows)


class FindOverlaps(beam.PTransform[PCollection[Any], PCollection[Overlap]]):
    """Training rows -> overlap records, joined with the index through a side input.

    Input: training rows, ``dict`` or :class:`~refinery.transforms.io.rows.SourceRow`
    (then each record also carries ``train_path`` and ``train_row``). Output: :class:`Overlap`
    (instance_id, eval_dataset, n, ngram, eval_offsets, train_doc_id, train_offsets,
    train_path, train_row), one per (instance, n, n-gram, training row).

    ``index``: the output of ``BuildNgramIndex``. ``ngrams``: the n to report (default: the
    index's). ``text_field`` or ``text_template``: as ``BuildNgramIndex``'s. Training ids are
    prep's (:mod:`refinery.transforms.formats.row_ids`): ``str(row[id_field])``, else
    ``relpath:row`` of a ``SourceRow``, else ``sha256:...`` of a ``dict`` row. Rows are batched within bundles
    (``BatchElements``), never shuffled.
    """

    def __init__(self, index: PCollection[ng.NgramIndex], ngrams: list[int] | None = None,
                 text_field: str | None = None, id_field: str = "id", *, text_template: str | None = None):
        super().__init__()
        self.index = index
        self.ngrams = sorted({int(n) for n in ngrams}) if ngrams else None
        self.text = TextSpec.from_options(text_field, text_template)  # a bad template raises here
        self.text_field, self.text_template, self.id_field = text_field, text_template, id_field

    @_mypy_only
    def expand(self, rows: PCollection[Any]) -> PCollection[Overlap]:
        overlaps: PCollection[Overlap] = (
            rows
            | "Batch" >> beam.BatchElements(min_batch_size=64, max_batch_size=4096)
            | "Scan" >> beam.ParDo(_FindOverlapsFn(self.ngrams, self.text, self.id_field),
                                   index=beam.pvalue.AsSingleton(self.index)).with_output_types(Overlap))
        return overlaps


def overlap_row_key(overlap: Overlap) -> tuple[str, object]:
    """The training row an :class:`Overlap` names: ``("row", (path, row))`` when it came as a
    :class:`SourceRow`, else ``("id", train_doc_id)``."""
    if overlap.train_row >= 0:
        return ("row", (overlap.train_path, overlap.train_row))
    return ("id", overlap.train_doc_id)


def row_key(element: object, id_field: str = "id") -> tuple[str, object]:
    """The key of a training row, as :func:`overlap_row_key` spells it for the overlaps it has."""
    if isinstance(element, SourceRow):
        return ("row", (element.path, element.row))
    return ("id", ng.record_id(element, id_field) if isinstance(element, dict) else "")


class DropOverlaps(beam.PTransform[PCollection[Any], PCollection[Any]]):
    """Training rows -> the same rows, less those with an overlap (a decontaminated corpus).

    Input: training rows, ``dict`` or :class:`~refinery.transforms.io.rows.SourceRow`,
    the rows given to ``FindOverlaps``. Output: the same elements, unchanged, except the rows
    that ``overlaps`` (``FindOverlaps``' output, a side input) names at one of ``ngrams``
    (default: any n). A SourceRow is matched by (path, row); a dict by
    ``str(row[id_field])``, else a hash of the whole row (as ``FindOverlaps`` ids it).
    Beam metric ``refinery_decon/train_rows_dropped``.
    """

    def __init__(self, overlaps: PCollection[Overlap], ngrams: list[int] | int | None = None, id_field: str = "id"):
        super().__init__()
        self.overlaps, self.id_field = overlaps, id_field
        self.ngrams = None if ngrams is None else {int(n) for n in ([ngrams] if isinstance(ngrams, int) else ngrams)}

    @_mypy_only
    def expand(self, rows: PCollection[Any]) -> PCollection[Any]:
        ngrams, id_field = self.ngrams, self.id_field
        keys = (self.overlaps
                | "AtN" >> beam.Filter(lambda o: ngrams is None or o.n in ngrams)
                | "RowKeys" >> beam.Map(lambda o: (overlap_row_key(o), True))
                | "OncePerRow" >> beam.CombinePerKey(any))
        dropped = Metrics.counter(NAMESPACE, "train_rows_dropped")

        def keep(element: object, drop: dict[tuple[str, object], bool]) -> bool:
            if row_key(element, id_field) in drop:
                dropped.inc()
                return False
            return True

        kept: PCollection[Any] = rows | "Drop" >> beam.Filter(keep, drop=beam.pvalue.AsDict(keys))
        return kept


__all__ = ["BuildNgramIndex", "DeconPipeline", "DropOverlaps", "FindOverlaps", "Overlap"]


class DeconPipeline(beam.PTransform[PBegin, PCollection[UnitResult]]):
    """``refinery decon``'s whole flow for ``settings`` (a
    :class:`~refinery.transforms.decon.stages.DeconSettings`) into ``output``, as one composite
    for a user's pipeline. Input: the pipeline (PBegin). Output: the merge step's ``{unit,
    status, stats}`` (one dict, once the stats files and reports are written).

    Its steps are the command's (``Read eval sets``, ``Index eval sets``, ``Scan training data``, ``Reduce
    partitions``, ``Merge reports``), with the same receipts: it writes the bytes
    ``refinery decon`` writes for the same inputs and settings, skips every unit whose
    receipt verifies, and the command resumes from it (and it from the command)."""

    def __init__(self, settings: DeconSettings, output: str):
        super().__init__()
        self.settings, self.output = settings, output.rstrip("/")

    @_mypy_only
    def expand(self, pbegin: PBegin) -> PCollection[UnitResult]:
        merged: PCollection[UnitResult] = pbegin | "Stages" >> RunAllStages(build_stages(self.settings), self.output)
        return merged
