"""info: summarize a prep output's manifest (dataset, tokenizer, totals, rows, shard sizes)."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from refinery.beam_pipelines.verify import manifest_path, output_of, runs_below
from refinery.transforms.formats.failed_run import failed_line, read_failed
from refinery.transforms.formats.manifests import MANIFEST
from refinery.transforms.io import storage


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", metavar="MANIFEST_OR_DIR", help="a prep output's manifest.json or its folder")
    parser.add_argument("--json", action="store_true", help="print the manifest's summary as JSON")


@dataclass(frozen=True)
class InfoSettings:
    """``refinery info``'s flags, read once from the command line."""

    manifest: str
    json: bool = False


def settings_from_args(args: argparse.Namespace) -> InfoSettings:
    return InfoSettings(manifest=args.manifest, json=args.json)


def run(args: argparse.Namespace, beam_args: list[str]) -> int:
    """Print the summary of a manifest; exit 2 when it cannot be read, or its run failed
    (``FAILED.json``: named with its corrupt input files)."""
    s = settings_from_args(args)
    path = manifest_path(s.manifest)
    if (failed := read_failed(output_of(path))) is not None:  # no summary of a run that failed
        print(f"refinery info: {failed_line(output_of(path), failed)}", file=sys.stderr)
        return 2
    try:
        m = storage.read_json(path)
    except FileNotFoundError:
        print(f"refinery info: {path}: not found (give a prep output folder or its manifest.json)"
              + runs_below(output_of(path), (MANIFEST,)), file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"refinery info: {path}: not valid JSON ({e})", file=sys.stderr)
        return 2
    summary = {k: m.get(k) for k in ("dataset", "version", "tokenizer", "vocab_size", "eos_token_id", "dtype",
                                     "created_at", "num_shards", "total_documents", "total_tokens", "max_tokens",
                                     "plan_hash", "rows")}
    summary.update({k: m[k] for k in ("tokenizer_kind", "eos_token", "excluded_overlaps") if k in m})
    if s.json:
        print(json.dumps(summary, indent=2))
        return 0
    for label, text in readable(m):
        print(f"{label:16} {text}")
    return 0


def readable(m: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, text) lines of a manifest for people: counts with thousands separators, the
    row accounting as its sum, no raw Python values."""
    def count(v: object) -> str:
        return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else ("-" if v is None else str(v))

    counts = ("vocab_size", "num_shards", "total_documents", "total_tokens")
    lines = [(k, count(m.get(k)) if k in counts else ("-" if m.get(k) is None else str(m.get(k))))
             for k in ("dataset", "version", "tokenizer", "tokenizer_kind", "vocab_size", "eos_token_id", "eos_token",
                       "dtype", "created_at", *counts[1:])
             if k in m or k not in ("tokenizer_kind", "eos_token")]
    budget = m.get("max_tokens")
    lines.append(("max_tokens", "no budget" if budget is None else count(budget)))
    lines.append(("plan_hash", count(m.get("plan_hash"))))
    rows = m.get("rows")
    if isinstance(rows, dict):
        parts = [f"{k.replace('_', ' ')} {count(rows[k])}" for k in ("accepted", "empty", "rejected", "over_budget")
                 if k in rows and (k != "over_budget" or rows[k])]
        parts += [f"{k.replace('_', ' ')} {count(v)}" for k, v in rows.items()
                  if k not in ("read", "accepted", "empty", "rejected", "over_budget")]
        lines.append(("rows", f"read {count(rows.get('read'))} = " + " + ".join(parts)))
    for run in (m.get("excluded_overlaps") or {}).get("decon_runs", []):
        lines.append(("excluded", f"rows overlapping at n={run.get('n')} in decon {run.get('path')} "
                                  f"({count(run.get('listed'))} listed)"))
    docs = [s["num_documents"] for s in m.get("shards", [])]
    toks = [s["num_tokens"] for s in m.get("shards", [])]
    if docs:
        lines.append(("shard docs", f"min {min(docs):,}  max {max(docs):,}"))
        lines.append(("shard tokens", f"min {min(toks):,}  max {max(toks):,}"))
        lines.append(("tokens/doc", f"{sum(toks) / max(sum(docs), 1):,.1f}"))
    return lines
