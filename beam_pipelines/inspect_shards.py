"""Inspect token shards for quality issues; exit 1 when any is found.

``refinery inspect --manifest M`` (EOS id, vocab size and expected counts from the manifest) or
``refinery inspect --data-dir D --eos-token-id N`` (every ``**/*.npy`` with its ``.idx``).
Per shard: tokens, EOS, documents; issues: double EOS, empty documents, ``.idx``/``.npy``
mismatch, tokens after the last EOS, ids outside the vocabulary. ``--stats`` adds document
lengths, distinct tokens, vocabulary coverage and the most frequent tokens; ``--histogram
PNG`` draws document lengths. ``--sample N`` prints N consecutive tokens from a random place.
``--doc SHARD:I`` prints document I of a shard (a shard number or a ``.npy`` path): its tokens,
its decoded text and, from the shard's ``.docs.parquet`` sidecar, its id, source file and row
(and that row as the file holds it, when the file is readable here).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import numpy.typing as npt

from refinery.beam_pipelines.checks import missing_extra
from refinery.transforms.formats import provenance, shards
from refinery.transforms.formats.encoders import load_tokenizer
from refinery.transforms.formats.inspect import (
    ShardRef,
    ShardReport,
    inspect_shard,
    shards_from_manifest,
    shards_in_dir,
    write_length_histogram,
)
from refinery.transforms.formats.tiktoken_vocab import EOS_TOKEN_ID
from refinery.transforms.formats.tokenizer_choice import DEFAULT, spec_from_manifest
from refinery.transforms.io import storage

EPILOG = """\
examples:
  refinery inspect --manifest /data/fineweb/train/manifest.json --all --verbose
  refinery inspect --data-dir /data/fineweb --eos-token-id 199999 --num-shards 3 --stats
  refinery inspect --manifest out/manifest.json --stats --histogram /tmp/lengths.png --sample 100
  refinery inspect --manifest out/manifest.json --doc 0:3

Exit code: 0 when no issue is found, 1 when any is, 2 for bad arguments.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--manifest", metavar="PATH", help="manifest.json (gives EOS id, vocab size, expected counts)")
    src.add_argument("--data-dir", metavar="DIR", help="folder of shards (every **/*.npy with its .idx)")
    parser.add_argument("--eos-token-id", type=int, default=None,
                        help="EOS token id (default: the manifest's, else 199999)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="vocabulary size for coverage and out-of-range ids (default: the manifest's, "
                             "else 201088)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--num-shards", type=int, default=1, metavar="N",
                       help="inspect the first N shards (default: 1; the output says how many were left out)")
    which.add_argument("--all", action="store_true", help="inspect every shard")
    parser.add_argument("-v", "--verbose", action="store_true", help="list each issue's positions")
    parser.add_argument("--stats", action="store_true", help="document lengths and token distribution")
    parser.add_argument("--histogram", metavar="PNG",
                        help="write a PNG histogram of document lengths (implies --stats)")
    parser.add_argument("--sample", type=int, default=0, metavar="N",
                        help="print N consecutive tokens from a random place in each shard (decoded)")
    parser.add_argument("--seed", type=int, default=0, help="seed of --sample (default: 0)")
    parser.add_argument("--doc", metavar="SHARD:I", type=_doc_address,
                        help="print document I of SHARD (a shard number, or a .npy path) with its source file and "
                             "row, from the shard's .docs.parquet sidecar")
    parser.add_argument("--chars", type=int, default=500, metavar="N",
                        help="with --doc: print the first N characters of the text and of the source row "
                             "(default: 500)")


def _doc_address(value: str) -> tuple[str, int]:
    shard, sep, doc = value.rpartition(":")
    if not sep or not shard or not doc.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r}: expected SHARD:I (a shard number or .npy path, a document "
                                         "index), e.g. 0:3")
    return shard, int(doc)


@dataclass(frozen=True)
class InspectSettings:
    """``refinery inspect``'s flags, read once from the command line."""

    manifest: str | None = None
    data_dir: str | None = None
    eos_token_id: int | None = None
    vocab_size: int | None = None
    num_shards: int = 1
    all: bool = False
    verbose: bool = False
    stats: bool = False
    histogram: str | None = None
    sample: int = 0
    seed: int = 0
    doc: tuple[str, int] | None = None
    chars: int = 500

    @property
    def source(self) -> str:
        """The ``--manifest`` or the ``--data-dir`` (one is required)."""
        return self.manifest or self.data_dir or ""


def settings_from_args(args: argparse.Namespace) -> InspectSettings:
    """The :class:`InspectSettings` of ``args`` (parsed by :func:`add_arguments`' parser)."""
    return InspectSettings(manifest=args.manifest, data_dir=args.data_dir, eos_token_id=args.eos_token_id,
                           vocab_size=args.vocab_size, num_shards=args.num_shards, all=args.all,
                           verbose=args.verbose, stats=args.stats, histogram=args.histogram, sample=args.sample,
                           seed=args.seed, doc=args.doc, chars=args.chars)


def _decode(tokens: Sequence[int] | npt.NDArray[np.generic], manifest_path: str | None = None) -> str | None:
    """The text of ``tokens`` by the manifest's tokenizer (o200k_harmony without a manifest),
    or None when that tokenizer cannot be loaded here."""
    try:
        spec = spec_from_manifest(storage.read_json(manifest_path)) if manifest_path else DEFAULT
        return None if spec is None else load_tokenizer(spec).decode(tokens)
    except Exception:  # noqa: BLE001 - decoding is a convenience; ids are printed anyway
        return None


class UsageFailure(Exception):
    """A problem with the flags or the manifest: its line is printed, exit 2."""


def run(args: argparse.Namespace, beam_args: list[str]) -> int:
    """Inspect the shards; exit 0 (no issue), 1 (issues), 2 (bad arguments)."""
    s = settings_from_args(args)
    if s.doc is not None:
        return show_document(s, s.doc)
    try:
        refs, eos, vocab = shards_to_inspect(s)
    except UsageFailure as e:
        print(f"refinery inspect: {e}", file=sys.stderr)
        return 2
    if not refs:
        print(f"refinery inspect: no shards found in {s.source}", file=sys.stderr)
        return 1
    chosen = refs if s.all else refs[: max(1, s.num_shards)]
    print(f"inspecting {len(chosen)} of {len(refs)} shard(s), EOS {eos}, vocab size {vocab}")
    reports = [report_shard(s, ref, eos, vocab) for ref in chosen]
    total_issues = sum(len(r.issues) for r in reports)
    print(f"total: {sum(r.num_tokens for r in reports):,} tokens, {sum(r.num_eos for r in reports):,} EOS, "
          f"{sum(r.num_docs or 0 for r in reports):,} documents in {len(chosen)} shard(s); {total_issues} issue(s)")
    if len(chosen) < len(refs):  # an OK over part of the output must not read as an OK over all of it
        print(f"note: only the first {len(chosen)} of {len(refs)} shard(s) were inspected; the other "
              f"{len(refs) - len(chosen)} were not (--all inspects every shard, --num-shards N the first N)")
    if s.histogram:
        all_lengths = [r.doc_lengths for r in reports if r.stats and r.doc_lengths is not None]
        lengths = np.concatenate(all_lengths) if all_lengths else np.zeros(0, np.int64)
        write_length_histogram(lengths, s.histogram, title=f"document lengths, {len(chosen)} shard(s)")
        print(f"histogram: {s.histogram}")
    if total_issues:
        print(f"refinery inspect: {total_issues} issue(s) found", file=sys.stderr)
        return 1
    return 0


def shards_to_inspect(s: InspectSettings) -> tuple[list[ShardRef], int, int]:
    """(the shards, the EOS id, the vocab size); :class:`UsageFailure` for a missing
    ``--histogram`` dependency or a bad manifest."""
    if s.histogram:  # checked before any shard is scanned
        if (missing := missing_extra("matplotlib", "plots")) is not None:
            raise UsageFailure(f"--histogram needs matplotlib; {missing}")
    if s.manifest:
        try:
            refs, eos, vocab = shards_from_manifest(s.manifest)
        except FileNotFoundError:
            raise UsageFailure(f"{s.manifest}: not found") from None
        except (ValueError, KeyError) as e:
            raise UsageFailure(f"{s.manifest}: not a manifest ({e})") from None
        eos = s.eos_token_id if s.eos_token_id is not None else eos
    else:
        refs = shards_in_dir(s.source)
        eos, vocab = (s.eos_token_id if s.eos_token_id is not None else EOS_TOKEN_ID), None
    return refs, eos, s.vocab_size or vocab or 201088


def report_shard(s: InspectSettings, ref: ShardRef, eos: int, vocab: int) -> ShardReport:
    """Inspect one shard and print its lines."""
    r = inspect_shard(ref, eos, vocab, stats=s.stats or bool(s.histogram), sample=s.sample, seed=s.seed)
    mark = "OK  " if not r.issues else "BAD "
    docs = "?" if r.num_docs is None else f"{r.num_docs:,}"
    print(f"{mark} {ref.npy_path}: {r.num_tokens:,} tokens, {r.num_eos:,} EOS, {docs} documents, "
          f"{r.double_eos} double EOS, {r.empty_docs} empty")
    for issue in r.issues:
        print(f"     issue: {issue}")
    if s.verbose:
        if r.double_eos_positions:
            print(f"     double EOS at token(s) {r.double_eos_positions}" + (" ..." if r.double_eos > len(
                r.double_eos_positions) else ""))
        if r.empty_doc_indices:
            print(f"     empty document(s) {r.empty_doc_indices}" + (" ..." if r.empty_docs > len(
                r.empty_doc_indices) else ""))
    if r.stats:
        st, dl = r.stats, r.stats["doc_length"]
        cov = f"{st['vocab_coverage']:.2%}" if st["vocab_coverage"] is not None else "?"
        print(f"     doc length: min {dl['min']:,} median {dl['median']:,.0f} mean {dl['mean']:,.1f} "
              f"p90 {dl['p90']:,.0f} p99 {dl['p99']:,.0f} max {dl['max']:,}")
        print(f"     distinct tokens {st['distinct_tokens']:,} (vocab coverage {cov}); top: "
              + ", ".join(f"{t}x{c:,}" for t, c in st["top_tokens"][:10]))
    if r.sample is not None:
        start, toks = r.sample
        text = _decode(toks, s.manifest)
        print(f"     sample at token {start:,}: {[int(t) for t in toks]}")
        if text is not None:
            print(f"     decoded: {text!r}")
    return r


def _find_shard(shard: str, refs: list[ShardRef], base: str) -> str | None:
    """The ``.npy`` a ``--doc`` SHARD names: a shard number (the manifest's entry, or the
    ``*-shard-NNNNNN.npy`` of a data dir), else a path (as given, or under ``base``)."""
    if shard.isdigit():
        suffix = f"-shard-{int(shard):06d}.npy"
        found = [r.npy_path for r in refs if r.npy_path.endswith(suffix)]
        return found[0] if len(found) == 1 else None
    for path in (shard, storage.join(base, shard)):
        if path.endswith(".npy") and (storage.is_remote(path) or os.path.exists(path)):
            return path
    return None


def show_document(s: InspectSettings, doc_address: tuple[str, int]) -> int:
    """``--doc SHARD:I``: a document, its text and its source; exit 1 when its sidecar or row is missing."""
    shard, i = doc_address
    try:
        refs, eos, _ = shards_from_manifest(s.manifest) if s.manifest else (shards_in_dir(s.source), None,
                                                                                  None)
    except FileNotFoundError:
        print(f"refinery inspect: {s.manifest}: not found", file=sys.stderr)
        return 2
    except (ValueError, KeyError) as e:
        print(f"refinery inspect: {s.manifest}: not a manifest ({e})", file=sys.stderr)
        return 2
    eos = s.eos_token_id if s.eos_token_id is not None else (eos if eos is not None else EOS_TOKEN_ID)
    base = storage.dirname(s.manifest) if s.manifest else s.source
    npy = _find_shard(shard, refs, base)
    if npy is None:
        print(f"refinery inspect: --doc {shard}:{i}: no such shard in {s.source} "
              f"({len(refs)} shard(s); give a shard number or a .npy path)", file=sys.stderr)
        return 2
    try:
        tokens = shards.ShardReader(npy).document(i)
    except (IndexError, ValueError, FileNotFoundError) as e:
        print(f"refinery inspect: {e}", file=sys.stderr)
        return 1
    body = tokens[:-1] if len(tokens) and int(tokens[-1]) == eos else tokens
    print(f"{npy} document {i}: {len(tokens):,} tokens (EOS included)")
    text = _decode([int(t) for t in body], s.manifest)
    if text is not None:
        more = f" ... ({len(text):,} characters)" if len(text) > s.chars else ""
        print(f"  text:   {text[:s.chars]!r}{more}")
    docs_path = provenance.docs_path_for(npy)
    try:
        doc = provenance.read_doc(docs_path, i)
    except FileNotFoundError:
        print(f"refinery inspect: {docs_path}: missing: this shard has no provenance sidecar (written before "
              "sidecars, or removed); prep it again to have one", file=sys.stderr)
        return 1
    except (IndexError, ValueError, OSError) as e:
        print(f"refinery inspect: {e}", file=sys.stderr)
        return 1
    if doc["num_tokens"] != len(tokens):
        print(f"refinery inspect: {docs_path}: document {i} has {doc['num_tokens']} tokens, the shard "
              f"{len(tokens)}: the sidecar is not this shard's", file=sys.stderr)
        return 1
    print(f"  id:     {doc['doc_id']}")
    print(f"  source: {doc['source'] or '(a row given without its file)'}, row {doc['row']}")
    if doc["source"]:
        record, why = provenance.source_row(doc["source"], doc["row"])
        if record is None:
            print(f"  row:    (not shown: {why})")
        else:
            raw = json.dumps(record, ensure_ascii=False, default=str)
            print(f"  row:    {raw[:s.chars]}" + (" ..." if len(raw) > s.chars else ""))
    return 0
