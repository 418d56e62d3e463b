"""info: summarize a prep output's manifest (dataset, tokenizer, totals, rows, shard sizes)."""
from __future__ import annotations

import argparse
import json
import sys

HELP = "summarize a manifest"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", metavar="MANIFEST_OR_DIR", help="a prep output's manifest.json or its folder")
    parser.add_argument("--json", action="store_true", help="print the manifest's summary as JSON")


def run(args, beam_args: list[str]) -> int:
    from refinery.beam_pipelines.verify import manifest_path
    from refinery.transforms.core import io

    path = manifest_path(args.manifest)
    try:
        m = io.read_json(path)
    except FileNotFoundError:
        print(f"refinery info: {path}: not found (give a prep output folder or its manifest.json)", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"refinery info: {path}: not valid JSON ({e})", file=sys.stderr)
        return 2
    summary = {k: m.get(k) for k in ("dataset", "version", "tokenizer", "vocab_size", "eos_token_id", "dtype",
                                     "created_at", "num_shards", "total_documents", "total_tokens", "max_tokens",
                                     "plan_hash", "rows")}
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    for k, val in summary.items():
        print(f"{k:16} {val}")
    docs = [s["num_documents"] for s in m.get("shards", [])]
    toks = [s["num_tokens"] for s in m.get("shards", [])]
    if docs:
        print(f"{'shard docs':16} min {min(docs):,}  max {max(docs):,}")
        print(f"{'shard tokens':16} min {min(toks):,}  max {max(toks):,}")
        print(f"{'tokens/doc':16} {sum(toks) / max(sum(docs), 1):,.1f}")
    return 0
