"""dedup's public PTransforms: exact and near-duplicate rows inside your own Beam pipeline.

::

    sigs = rows | MinHashSignatures()                 # or MinHashSignatures(mode="exact")
    dups = sigs | FindDuplicates()
    kept = rows | DropDuplicates(dups)

==============================  =========================================  ==========================
transform                       input element                              output element
==============================  =========================================  ==========================
``MinHashSignatures()``         row: ``dict`` or ``SourceRow``             :class:`Signature`
``FindDuplicates()``            :class:`Signature`                         :class:`Duplicate`
``DropDuplicates(duplicates)``  row: ``dict`` or ``SourceRow``             the rows not listed
``DedupPipeline(cfg, inputs,    (the pipeline)                             the report unit's result
output)``
==============================  =========================================  ==========================

The method is ``refinery dedup``'s, through the same code (:mod:`.sign`, :mod:`.minhash`,
:mod:`.graph`): a row's text is read and normalized as prep reads it, keyed by its 128-bit
text hash (exact) and, in minhash mode, by the bands of its MinHash signature. The band
buckets are a ``GroupByKey`` on (band, key); a bucket of more than ``max_bucket`` distinct
texts is skipped and counted (Beam counter ``refinery_dedup/buckets_skipped``); each candidate
pair is joined with both shingle sets (two ``CoGroupByKey``) and kept when their Jaccard is at
least ``threshold``; the clusters are the connected components of the pairs, computed once
over all of them (one worker holds the pairs: for a corpus's worth, run ``DedupPipeline``,
whose stages partition every step). A cluster keeps its smallest row key: a ``SourceRow``'s
``(path, row)``, a dict's ``(id, -1)`` (its id field, else a hash of the row).

Beam counters (namespace ``refinery_dedup``): ``documents``, ``rows_without_text``,
``candidate_pairs``, ``verified_pairs``, ``buckets_skipped``, ``duplicates``.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, NamedTuple

import apache_beam as beam
import numpy as np
from apache_beam.coders import typecoders
from apache_beam.metrics.metric import Metrics
from apache_beam.pvalue import PBegin, PCollection

from refinery.transforms.dedup import graph
from refinery.transforms.dedup.minhash import DEFAULT_THRESHOLD, MinHashParams, jaccard_many
from refinery.transforms.dedup.sign import MODES, sign_batch
from refinery.transforms.dedup.stages import DEFAULT_MAX_BUCKET, DedupConfig, build_stages
from refinery.transforms.formats.row_ids import doc_id_for
from refinery.transforms.io import storage
from refinery.transforms.io.coders import TupleCoder
from refinery.transforms.io.rows import SourceRow
from refinery.transforms.io.text import TextSpec
from refinery.transforms.prep.documents import Rejected, row_normalizer
from refinery.transforms.resumable.beam_steps import RunAllStages, UnitResult, _mypy_only

NAMESPACE = "refinery_dedup"
RowKey = tuple[str, int]  # (path, row) of a SourceRow; (id, -1) of a dict


class Signature(NamedTuple):
    """A document signed: its row's key, its text hash, its band keys (minhash; ``()`` in exact
    mode) and its shingle set (sorted distinct uint64s, as bytes)."""

    path: str
    row: int
    text_hi: int
    text_lo: int
    bands: tuple[int, ...]
    shingles: bytes

    @property
    def key(self) -> RowKey:
        return (self.path, self.row)


class Duplicate(NamedTuple):
    """A row removed as a duplicate: its key, the key of its cluster's kept row, the Jaccard of
    their shingle sets, whether their texts are the same."""

    path: str
    row: int
    kept_path: str
    kept_row: int
    jaccard: float
    exact: bool


class SignatureCoder(TupleCoder):
    cls = Signature


class DuplicateCoder(TupleCoder):
    cls = Duplicate


typecoders.registry.register_coder(Signature, SignatureCoder)
typecoders.registry.register_coder(Duplicate, DuplicateCoder)


def row_key(element: object, id_field: str = "id") -> RowKey:
    """The key of a row: a :class:`SourceRow`'s ``(path, row)``, else ``(id, -1)``."""
    if isinstance(element, SourceRow):
        return (element.path, element.row)
    return (doc_id_for(element, id_field, None, None) if isinstance(element, dict) else "", -1)


class _SignFn(beam.DoFn):
    def __init__(self, mode: str, params: MinHashParams, text: TextSpec, id_field: str):
        self.mode, self.params, self.text, self.id_field = mode, params, text, id_field
        self.documents = Metrics.counter(NAMESPACE, "documents")
        self.without_text = Metrics.counter(NAMESPACE, "rows_without_text")

    @_mypy_only
    def process(self, batch: list[Any]) -> Iterator[Signature]:
        normalize = row_normalizer(self.text, self.id_field)
        keys, texts = [], []
        for element in batch:
            record = element.record if isinstance(element, SourceRow) else element
            doc = normalize(record if isinstance(record, dict) else None, None if isinstance(record, dict)
                            else "not a row", "", 0, None)
            if isinstance(doc, Rejected):
                self.without_text.inc()
                continue
            keys.append(row_key(element, self.id_field))
            texts.append(doc.text)
        self.documents.inc(len(texts))
        signed = sign_batch(list(range(len(texts))), texts, self.mode, self.params)
        ends = np.cumsum(signed.counts)
        for i, key in enumerate(keys):
            bands = tuple(int(k) for k in signed.keys[i]) if signed.keys is not None and signed.counts[i] else ()
            sets = signed.values[ends[i] - signed.counts[i]:ends[i]]
            yield Signature(key[0], key[1], int(signed.text_hi[i]), int(signed.text_lo[i]), bands,
                            sets.astype("<u8").tobytes())


class MinHashSignatures(beam.PTransform[PCollection[Any], PCollection[Signature]]):
    """Rows -> :class:`Signature` records (rows without text, or empty once normalized, are
    left out and counted). ``mode``: ``minhash`` (default) or ``exact``; ``bands``/``rows``: the
    signature's shape; ``text_field`` or ``text_template``, ``id_field``: as prep's."""

    def __init__(self, mode: str = "minhash", bands: int = 16, rows: int = 8, text_field: str | None = None,
                 id_field: str = "id", *, text_template: str | None = None):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.mode, self.params, self.id_field = mode, MinHashParams(bands, rows), id_field
        self.text = TextSpec.from_options(text_field, text_template)

    @_mypy_only
    def expand(self, rows: PCollection[Any]) -> PCollection[Signature]:
        sigs: PCollection[Signature] = (
            rows | "Batch" >> beam.BatchElements(min_batch_size=64, max_batch_size=4096)
            | "Sign" >> beam.ParDo(_SignFn(self.mode, self.params, self.text, self.id_field))
            .with_output_types(Signature))
        return sigs


def _bucket_pairs(bucket: tuple[Any, Iterable[tuple[RowKey, tuple[int, int]]]], cap: int
                  ) -> Iterator[tuple[RowKey, RowKey]]:
    """Every pair (smaller key first) of the distinct texts of a band bucket (the first key of
    each text); none from a bucket of more than ``cap`` texts (counted)."""
    firsts: dict[tuple[int, int], RowKey] = {}
    for key, text in sorted(bucket[1]):
        firsts.setdefault(text, key)
    reps = sorted(firsts.values())
    if len(reps) > cap:
        Metrics.counter(NAMESPACE, "buckets_skipped").inc()
        return
    for i, a in enumerate(reps):
        for b in reps[i + 1:]:
            yield (a, b)


def _exact_pairs(group: tuple[Any, Iterable[RowKey]]) -> Iterator[tuple[RowKey, RowKey]]:
    keys = sorted(group[1])
    for k in keys[1:]:
        yield (keys[0], k)


def _with_sets(pairs: PCollection[tuple[RowKey, RowKey]], sigs: PCollection[Signature], label: str
               ) -> PCollection[tuple[RowKey, RowKey, bytes, bytes, bool]]:
    """Each pair (a, b) with the shingle sets of a and b and whether their texts are the same."""
    by_key = sigs | f"{label}ByKey" >> beam.Map(lambda s: (s.key, (s.shingles, (s.text_hi, s.text_lo))))

    def first(joined: tuple[RowKey, dict[str, list[Any]]]) -> Iterator[tuple[RowKey, tuple[RowKey, Any]]]:
        key, parts = joined
        for sig in parts["sig"][:1]:
            for b in parts["pairs"]:
                yield (b, (key, sig))

    def second(joined: tuple[RowKey, dict[str, list[Any]]]) -> Iterator[tuple[RowKey, RowKey, bytes, bytes, bool]]:
        key, parts = joined
        for sig in parts["sig"][:1]:
            for a, (sets, text) in parts["pairs"]:
                yield (a, key, sets, sig[0], text == sig[1])

    half = ({"pairs": pairs, "sig": by_key} | f"{label}JoinA" >> beam.CoGroupByKey()
            | f"{label}WithA" >> beam.FlatMap(first))
    joined: PCollection[tuple[RowKey, RowKey, bytes, bytes, bool]] = (
        {"pairs": half, "sig": by_key} | f"{label}JoinB" >> beam.CoGroupByKey()
        | f"{label}WithB" >> beam.FlatMap(second))
    return joined


def jaccard_of_bytes(a: bytes, b: bytes) -> float:
    """The Jaccard of two shingle sets given as their uint64 bytes."""
    va, vb = np.frombuffer(a, "<u8"), np.frombuffer(b, "<u8")
    return float(jaccard_many(va, np.array([len(va)]), vb, np.array([len(vb)]))[0])


def clusters_of(edges: list[tuple[RowKey, RowKey]]) -> list[tuple[RowKey, RowKey]]:
    """(row, its component's smallest row) for every row of ``edges`` that is not the smallest."""
    keys = sorted({k for e in edges for k in e})
    index = {k: i for i, k in enumerate(keys)}
    a = np.array([index[x] for x, _ in edges], dtype=np.uint64)
    b = np.array([index[y] for _, y in edges], dtype=np.uint64)
    nodes, roots = graph.components(a, b)
    return [(keys[int(n)], keys[int(r)]) for n, r in zip(nodes.tolist(), roots.tolist()) if n != r]


class FindDuplicates(beam.PTransform[PCollection[Signature], PCollection[Duplicate]]):
    """:class:`Signature` records -> a :class:`Duplicate` for every row of a cluster but its
    kept row (its smallest key). ``threshold``: the Jaccard a near pair must reach;
    ``max_bucket``: a band bucket of more distinct texts is skipped (counted)."""

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, max_bucket: int = DEFAULT_MAX_BUCKET):
        super().__init__()
        self.threshold, self.max_bucket = threshold, max_bucket

    @_mypy_only
    def expand(self, sigs: PCollection[Signature]) -> PCollection[Duplicate]:
        threshold = self.threshold
        exact = (sigs | "ByText" >> beam.Map(lambda s: ((s.text_hi, s.text_lo), s.key))
                 | "GroupTexts" >> beam.GroupByKey() | "ExactPairs" >> beam.FlatMap(_exact_pairs))
        near = (sigs | "ByBand" >> beam.FlatMap(lambda s: [((i, k), (s.key, (s.text_hi, s.text_lo)))
                                                            for i, k in enumerate(s.bands)])
                | "GroupBands" >> beam.GroupByKey() | "Candidates" >> beam.FlatMap(_bucket_pairs, self.max_bucket)
                | "OncePerPair" >> beam.Distinct())
        candidates, verified = Metrics.counter(NAMESPACE, "candidate_pairs"), Metrics.counter(NAMESPACE,
                                                                                              "verified_pairs")

        def verify(item: tuple[RowKey, RowKey, bytes, bytes, bool]) -> Iterator[tuple[RowKey, RowKey]]:
            candidates.inc()
            if item[4] or jaccard_of_bytes(item[2], item[3]) >= threshold:
                verified.inc()
                yield (item[0], item[1])

        edges = ((exact, _with_sets(near, sigs, "Near") | "Verify" >> beam.FlatMap(verify))
                 | "Edges" >> beam.Flatten() | "AllEdges" >> beam.combiners.ToList())
        removed = edges | "Clusters" >> beam.FlatMap(clusters_of)
        duplicates = Metrics.counter(NAMESPACE, "duplicates")

        def record(item: tuple[RowKey, RowKey, bytes, bytes, bool]) -> Duplicate:
            duplicates.inc()
            (kept, row), j = item[:2], 1.0 if item[4] else jaccard_of_bytes(item[2], item[3])
            return Duplicate(row[0], row[1], kept[0], kept[1], j, item[4])

        flipped = removed | "KeptFirst" >> beam.Map(lambda pair: (pair[1], pair[0]))
        out: PCollection[Duplicate] = (_with_sets(flipped, sigs, "Kept") | "Records" >> beam.Map(record)
                                       .with_output_types(Duplicate))
        return out


class DropDuplicates(beam.PTransform[PCollection[Any], PCollection[Any]]):
    """Rows -> the same rows, less those ``duplicates`` (:class:`FindDuplicates`' output, a side
    input) lists; a row is matched by its key (:func:`row_key`)."""

    def __init__(self, duplicates: PCollection[Duplicate], id_field: str = "id"):
        super().__init__()
        self.duplicates, self.id_field = duplicates, id_field

    @_mypy_only
    def expand(self, rows: PCollection[Any]) -> PCollection[Any]:
        id_field = self.id_field
        keys = self.duplicates | "Keys" >> beam.Map(lambda d: ((d.path, d.row), True))
        kept: PCollection[Any] = rows | "Drop" >> beam.Filter(
            lambda row, drop: row_key(row, id_field) not in drop, drop=beam.pvalue.AsDict(keys))
        return kept


class DedupPipeline(beam.PTransform[PBegin, PCollection[UnitResult]]):
    """``refinery dedup``'s whole flow for ``cfg`` over ``inputs`` into ``output``, as one
    composite: the command's steps and receipts, the bytes it writes (it resumes the command's
    run and the command resumes it). Output: the report unit's ``{unit, status, stats}``."""

    def __init__(self, cfg: DedupConfig, inputs: list[storage.InputFile], output: str):
        super().__init__()
        self.cfg, self.inputs, self.output = cfg, inputs, output.rstrip("/")

    @_mypy_only
    def expand(self, pbegin: PBegin) -> PCollection[UnitResult]:
        result: PCollection[UnitResult] = pbegin | "Stages" >> RunAllStages(build_stages(self.cfg, self.inputs),
                                                                             self.output)
        return result


__all__ = ["DedupPipeline", "DropDuplicates", "Duplicate", "FindDuplicates", "MinHashSignatures", "Signature"]
