"""Train/test n-gram overlap ("decon"), the HELM data-overlap method with full provenance.

The logic, as plain functions and data classes; the Beam wiring lives in
:mod:`refinery.transforms.decon.stages` (the command's stages) and
:mod:`refinery.transforms.decon.beam` (the public transforms).

Method (HELM): index the n-grams of the TEST (eval) side, stream the TRAINING side and look
up each of its n-grams; an eval instance overlaps at n when it shares at least one n-gram.
See ``docs/DECON.md`` for the exact facts these modules implement. One module a step, in
the order the pipeline uses them:

- :mod:`.word_split` (:data:`TOKENIZERS`): ``default`` is exactly
  ``re.compile(rf"[\\s{re.escape(string.punctuation)}]+").split(text.lower())`` with empty
  strings kept; ``no_lowercase`` is the same split without ``lower()``; ``whitespace``
  lowercases and splits on runs of ``\\s`` only. :meth:`WordSplitter.tokenize_with_offsets`
  returns the same tokens plus ``[start, end)`` code-point offsets into the ORIGINAL text
  (``str.lower()`` can change length: ``'İ'.lower()`` has 2 characters). N-grams
  (:func:`eval_ngrams`): tokens joined by one space; an eval row with fewer than n tokens
  contributes its one ``min(n, len)``-gram (the *effective* length); n-grams whose tokens
  are all empty strings are skipped.
- :mod:`.ids`: :func:`eval_dataset_name`, :func:`record_id` (``str(record[id])`` or the
  blake2b-of-msgpack hash of the recursively key-sorted record).
- :mod:`.hashes`: :func:`token_hash` and :func:`ngram_hash` are stable 64-bit hashes
  (polynomial over UTF-8 bytes, then over token hashes, each followed by a 64-bit
  finalizer). They are defined so that :func:`batch_window_hashes` computes the very same
  values for all windows of a batch of training rows with a handful of numpy operations (no
  Python object per token). ``partition = ngram_hash(n, ngram) % P``.
- :mod:`.membership`: :class:`Membership`, the compact structure the scan probes: the sorted
  unique uint64 n-gram hashes (8 bytes per test n-gram on disk) plus a packed bitmap built at
  load time (at most 8 bytes more per n-gram) that rejects most misses with one gather.
  Hash hits are then verified against the exact n-gram text in the hash partition's detail
  records, so there are no false positives.
- :mod:`.index`: eval rows (:func:`eval_rows_of`, :func:`make_eval_rows`), :func:`build_index` and
  :class:`NgramIndex` (membership + records by hash partition), and their serialization.
- :mod:`.scan`: :func:`scan_rows`, the training-side join (batching, probing, verification,
  offsets), giving :class:`ScanHits`.
- :mod:`.reduce`: :func:`hit_blocks` groups the hits by hash partition, each (training row,
  n-gram) with its doc id and a snippet of the training text; :func:`reduce_partition`
  joins one hash partition's hits with its eval records (detail records, training document
  counts for ``max_train_count``, by-path sets, report samples); its detail records are
  streamed, one per distinct eval text (:func:`same_text`), at most ``max_ngram_details``
  per n-gram, n-grams and snippets cut at 1,000 characters; :func:`merge_partitions`: the
  stats and HELM metrics (binary, jaccard, token; jaccard and token also weighted by 1/train
  count) of the whole run.
- :mod:`.longest`: ConTAM's longest match per instance and n (the longest run of eval tokens
  one training row's n-grams cover), exact across partitions, and its coverage (HELM's token
  metric).
- :mod:`.report`: :func:`overlap_instances`, :func:`render_report` (markdown) and
  :func:`contamination_report` (what ``report.html`` shows).
- :mod:`.reference`: :func:`reference_overlap`, a straightforward pure-Python implementation
  of the same method (dict of test n-grams, stream training) used by tests and
  ``bench/decon.py``.

The names below are the package's API: ``from refinery.transforms.decon import ngrams as ng``
then ``ng.scan_rows(...)``.
"""
from __future__ import annotations

from refinery.transforms.io.jsonl import JSON_ERRORS

from .details import NGRAM_MAX_CHARS, WRITE_CHARS
from .hashes import batch_window_hashes, ngram_hash, partition_of, token_hash, tokenize_batch
from .ids import eval_dataset_name, record_hash_id, record_id
from .index import (
    EvalRow,
    NgramIndex,
    Partition,
    SameText,
    build_index,
    dumps_jsonl_gz,
    dumps_partition,
    eval_rows_of,
    load_partition,
    loads_jsonl_gz,
    make_eval_rows,
    partition_records,
    same_text,
)
from .longest import longest_matches, longest_run, record_windows
from .membership import Membership
from .reduce import (
    DEFAULT_MAX_NGRAM_DETAILS,
    SNIPPET_CONTEXT,
    SNIPPET_MAX_CHARS,
    HitGroups,
    coverage_table,
    gather_partitions,
    helm_metrics,
    hit_blocks,
    hit_groups,
    ignored_only_warning,
    instance_metrics,
    merge_partitions,
    reduce_partition,
    row_ids_at,
    split_hits,
)
from .reference import reference_overlap
from .report import capped_warning, contamination_report, merged_snippet, overlap_instances, render_report
from .scan import ScanHits, ScanStats, scan_rows
from .steering import Steering, steering_lines
from .word_split import (
    DEFAULT_SEPARATORS,
    TOKENIZERS,
    WordSplitter,
    configured_ns,
    default_tokenize,
    effective_lengths,
    eval_ngrams,
    get_tokenizer,
)

__all__ = [
    "DEFAULT_MAX_NGRAM_DETAILS", "DEFAULT_SEPARATORS", "JSON_ERRORS", "NGRAM_MAX_CHARS", "SNIPPET_CONTEXT",
    "SNIPPET_MAX_CHARS", "TOKENIZERS", "WRITE_CHARS", "EvalRow", "HitGroups", "Membership", "NgramIndex", "Partition",
    "SameText", "ScanHits", "ScanStats", "Steering", "WordSplitter", "batch_window_hashes", "build_index",
    "capped_warning", "configured_ns", "contamination_report", "coverage_table", "gather_partitions", "helm_metrics",
    "default_tokenize", "dumps_jsonl_gz", "dumps_partition",
    "effective_lengths", "eval_dataset_name", "eval_ngrams", "eval_rows_of", "get_tokenizer", "hit_blocks",
    "hit_groups", "ignored_only_warning", "instance_metrics", "load_partition", "loads_jsonl_gz",
    "longest_matches", "longest_run",
    "make_eval_rows", "merge_partitions", "merged_snippet", "ngram_hash", "overlap_instances", "partition_of",
    "partition_records", "record_hash_id", "record_windows", "record_id", "reduce_partition", "reference_overlap",
    "row_ids_at",
    "render_report", "same_text", "scan_rows", "split_hits", "steering_lines", "token_hash", "tokenize_batch",
]
