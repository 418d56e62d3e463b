"""verify: check a prep output (its manifest, every shard and the run's receipts).

``refinery verify OUT/manifest.json`` (or ``refinery verify OUT``) exits 0 when every shard
listed matches the manifest (sizes, document bounds, EOS placement, totals, row accounting)
and nothing stray lies beside it; else it prints one ``BAD`` line per problem and exits 1.
``--checksums`` also re-hashes every file against its recorded sha256.
"""
from __future__ import annotations

import argparse
import sys

HELP = "check a manifest and its shards (exit 1 naming each problem)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", metavar="MANIFEST_OR_DIR",
                        help="a prep output's manifest.json or its folder (local or gs://)")
    parser.add_argument("--checksums", action="store_true", help="also re-hash every file (sha256)")


def manifest_path(path: str) -> str:
    """A manifest path from a manifest or a prep output folder (whichever the user gave)."""
    from refinery.transforms.core import storage
    from refinery.transforms.formats.manifests import MANIFEST

    path = path.rstrip("/")
    return path if storage.basename(path) == MANIFEST or not storage.isdir(path) else storage.join(path, MANIFEST)


def run(args, beam_args: list[str]) -> int:
    from refinery.transforms.core import storage
    from refinery.transforms.formats.manifests import verify_manifest

    path = manifest_path(args.manifest)
    if not storage.exists(path):
        print(f"refinery verify: {path}: not found (give a prep output folder or its manifest.json)",
              file=sys.stderr)
        return 2
    problems = verify_manifest(path, checksums=args.checksums)
    for p in problems:
        print(f"BAD  {p}")
    if problems:
        print(f"{len(problems)} problem(s) found", file=sys.stderr)
        return 1
    m = storage.read_json(path)
    print(f"OK   {path}: {m['num_shards']} shards, {m['total_documents']:,} documents, "
          f"{m['total_tokens']:,} tokens" + (" (checksums verified)" if args.checksums else ""))
    return 0
