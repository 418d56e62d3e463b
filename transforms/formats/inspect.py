"""Data-quality inspection of token shards: counts, EOS placement, empty documents, statistics.

:func:`inspect_shard` reads one ``.npy`` (memory-mapped, scanned in chunks) and its ``.idx``
and returns a :class:`ShardReport`: token, EOS and document counts, and its **issues**:

- double EOS (two EOS in a row: a document emptied, or EOS appended twice),
- empty documents (an ``.idx`` entry holding nothing but its EOS, or less),
- ``.idx``/``.npy`` disagreement (bounds not contiguous, EOS not at document ends, counts
  other than the manifest's), via :func:`refinery.transforms.formats.shards.check_shard`,
- tokens after the last EOS, token ids outside the vocabulary.

With ``stats``: document-length summary, distinct tokens, vocabulary coverage, most frequent
tokens. :func:`write_length_histogram` draws a PNG of document lengths (matplotlib, Agg).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from refinery.transforms.formats import shards
from refinery.transforms.formats.shards import (
    SCAN_CHUNK_TOKENS,
    IndexReader,
    eos_document_lengths,
    find_shards,
    index_path_for,
)
from refinery.transforms.formats.tiktoken_vocab import EOS_TOKEN_ID
from refinery.transforms.io import storage


@dataclass
class ShardReport:
    npy_path: str
    idx_path: str
    num_tokens: int = 0
    num_eos: int = 0
    num_docs: int | None = None  # from the .idx (None if unreadable)
    double_eos: int = 0
    double_eos_positions: list[int] = field(default_factory=list)  # the first few
    empty_docs: int = 0
    empty_doc_indices: list[int] = field(default_factory=list)  # the first few
    out_of_vocab: int = 0
    issues: list[str] = field(default_factory=list)
    stats: dict[str, Any] | None = None
    doc_lengths: np.ndarray | None = None  # with stats: every document's length (EOS included)
    sample: tuple[int, np.ndarray] | None = None  # (start, tokens)


@dataclass(frozen=True)
class ShardRef:
    """A shard to inspect, with what the manifest (if any) says about it."""

    npy_path: str
    idx_path: str
    expected_tokens: int | None = None
    expected_docs: int | None = None


def shards_from_manifest(manifest_path: str) -> tuple[list[ShardRef], int, int | None]:
    """(shards, eos_token_id, vocab_size) of a manifest.json."""
    m = storage.read_json(manifest_path)
    root = storage.dirname(manifest_path)
    refs = [ShardRef(storage.join(root, s["path"]), storage.join(root, s["index_path"]), s.get("num_tokens"),
                     s.get("num_documents")) for s in m.get("shards", [])]
    return refs, int(m.get("eos_token_id", EOS_TOKEN_ID)), m.get("vocab_size")


def shards_in_dir(data_dir: str) -> list[ShardRef]:
    """Every ``**/*.npy`` under ``data_dir`` (hidden folders such as ``.refinery`` skipped), sorted."""
    return [ShardRef(p, index_path_for(p)) for p in find_shards(data_dir)]


def _scan_tokens(tokens: shards.TokenArray, eos: int, vocab_size: int | None, report: ShardReport,
                 max_examples: int, chunk: int) -> None:
    prev_eos = True  # a shard starting with EOS holds an empty first document
    for lo in range(0, len(tokens), chunk):
        part = np.asarray(tokens[lo:lo + chunk])
        is_eos = part == eos
        report.num_eos += int(is_eos.sum())
        double = is_eos & np.concatenate(([prev_eos], is_eos[:-1]))
        if double.any():
            pos = np.flatnonzero(double) + lo
            report.double_eos += len(pos)
            room = max_examples - len(report.double_eos_positions)
            report.double_eos_positions += [int(p) for p in pos[:room]]
        if vocab_size is not None:
            report.out_of_vocab += int((part >= vocab_size).sum())
        prev_eos = bool(is_eos[-1])


def _tokens_after_last_eos(tokens: shards.TokenArray, eos: int, chunk: int) -> int:
    hi = len(tokens)
    while hi > 0:
        lo = max(0, hi - chunk)
        hits = np.flatnonzero(np.asarray(tokens[lo:hi]) == eos)
        if len(hits):
            return len(tokens) - (lo + int(hits[-1]) + 1)
        hi = lo
    return len(tokens)


def inspect_shard(ref: ShardRef, eos_token_id: int, vocab_size: int | None = None, stats: bool = False,
                  sample: int = 0, seed: int = 0, max_examples: int = 5,
                  chunk: int = SCAN_CHUNK_TOKENS) -> ShardReport:
    """Inspect one shard; ``report.issues`` is empty when the shard is clean."""
    report = ShardReport(ref.npy_path, ref.idx_path)
    report.issues += shards.check_shard(ref.npy_path, ref.idx_path, eos_token_id, ref.expected_tokens,
                                      ref.expected_docs)
    try:
        tokens = shards.open_tokens(ref.npy_path)
    except Exception:  # noqa: BLE001 - check_shard already named the problem
        return report
    report.num_tokens = int(len(tokens))
    _scan_tokens(tokens, eos_token_id, vocab_size, report, max_examples, chunk)
    if report.double_eos:
        report.issues.append(f"{ref.npy_path}: {report.double_eos} double EOS (first at token "
                             f"{report.double_eos_positions[0]})")
    if report.out_of_vocab:
        report.issues.append(f"{ref.npy_path}: {report.out_of_vocab} token id(s) >= vocab size {vocab_size}")
    if report.num_tokens and tokens[-1] != eos_token_id:
        trailing = _tokens_after_last_eos(tokens, eos_token_id, chunk)
        report.issues.append(f"{ref.npy_path}: the last {trailing} token(s) follow no EOS (an unterminated document)")
    lengths = None
    try:
        index = IndexReader(ref.idx_path)
        report.num_docs = index.num_docs
        bounds = np.asarray(index.bounds)
        lengths = bounds[:, 1].astype(np.int64) - bounds[:, 0].astype(np.int64)
        empty = np.flatnonzero(lengths <= 1)
        report.empty_docs = int(len(empty))
        report.empty_doc_indices = [int(i) for i in empty[:max_examples]]
        if len(empty):
            report.issues.append(f"{ref.idx_path}: {len(empty)} empty document(s) (first: document {int(empty[0])})")
    except (FileNotFoundError, ValueError):
        pass  # check_shard reported it
    if stats:
        if lengths is None:  # no usable index: documents as the EOS positions delimit them
            lengths = eos_document_lengths(tokens, eos_token_id)[0].astype(np.int64)
        report.doc_lengths = lengths
        report.stats = token_stats(tokens, lengths, vocab_size, chunk=chunk)
    if sample and report.num_tokens:
        n = min(sample, report.num_tokens)
        start = int(np.random.default_rng(seed).integers(0, report.num_tokens - n + 1))
        report.sample = (start, np.asarray(tokens[start:start + n]))
    return report


def token_stats(tokens: shards.TokenArray, doc_lengths: np.ndarray, vocab_size: int | None, top: int = 10,
                chunk: int = SCAN_CHUNK_TOKENS) -> dict[str, Any]:
    """Document-length summary and token distribution (distinct ids, coverage, most frequent)."""
    counts = np.zeros(vocab_size or 0, dtype=np.int64)
    for lo in range(0, len(tokens), chunk):
        c = np.bincount(np.asarray(tokens[lo:lo + chunk]), minlength=len(counts))
        if len(c) > len(counts):
            c[:len(counts)] += counts
            counts = c
        else:
            counts += c
    distinct = int((counts > 0).sum())
    order = np.argsort(-counts, kind="stable")[:top]
    out = {
        "documents": int(len(doc_lengths)),
        "doc_length": _summary(doc_lengths),
        "distinct_tokens": distinct,
        "vocab_coverage": distinct / vocab_size if vocab_size else None,
        "top_tokens": [(int(t), int(counts[t])) for t in order if counts[t] > 0],
    }
    return out


def _summary(lengths: np.ndarray) -> dict[str, Any]:
    if not len(lengths):
        return {"min": 0, "mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0, "max": 0}
    q = np.percentile(lengths, [50, 90, 99])
    return {"min": int(lengths.min()), "mean": float(lengths.mean()), "median": float(q[0]),
            "p90": float(q[1]), "p99": float(q[2]), "max": int(lengths.max())}


def write_length_histogram(lengths: np.ndarray, path: str, title: str = "document lengths") -> None:
    """A PNG histogram of document lengths in tokens (log-spaced bins), written atomically."""
    import matplotlib
    matplotlib.use("Agg")
    import io

    import matplotlib.pyplot as plt

    lengths = np.asarray(lengths, dtype=np.int64)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    if len(lengths):
        hi = max(int(lengths.max()), 2)
        bins = np.unique(np.geomspace(1, hi + 1, num=min(60, hi + 1)).astype(np.int64))
        ax.hist(lengths, bins=bins.tolist(), color="#3b75af", edgecolor="white", linewidth=0.4)
        ax.set_xscale("log")
        ax.axvline(float(np.median(lengths)), color="#c44e52", linestyle="--", linewidth=1,
                   label=f"median {np.median(lengths):,.0f}")
        ax.legend()
    ax.set_xlabel("tokens per document (EOS included)")
    ax.set_ylabel("documents")
    ax.set_title(f"{title} ({len(lengths):,} documents)")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    storage.atomic_write_bytes(path, buf.getvalue())
