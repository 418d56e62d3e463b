"""Rebuild a shard's lost ``.idx`` from the EOS positions in its ``.npy``.

``refinery regenerate-index SHARD.npy --eos-token-id 199999`` writes ``SHARD.idx`` beside the
shard (or ``--output PATH``). Without ``--eos-token-id`` the EOS is the ``eos_token_id`` of the
prep output's ``manifest.json`` (``OUT/shard_NNNN/x.npy`` -> ``OUT/manifest.json``), else
199999. Each document ends at an EOS, so the index is a function of the tokens alone and
comes out byte-identical to the one prep wrote. If an ``.idx`` is already
there it is compared, not overwritten: identical -> exit 0; different -> exit 1 unless
``--force``. Tokens after the last EOS (wrong EOS id, truncated shard) are an error.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

from refinery.transforms.formats.manifests import MANIFEST
from refinery.transforms.formats.shards import index_path_for, regenerate_index
from refinery.transforms.formats.tiktoken_vocab import EOS_TOKEN_ID
from refinery.transforms.io import storage

EPILOG = """\
examples:
  refinery regenerate-index out/shard_0003/web-v1-shard-000003.npy --eos-token-id 199999
  refinery regenerate-index shard.npy --output /tmp/shard.idx
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("shard", metavar="SHARD.npy", help="the shard (.npy, local or gs://)")
    parser.add_argument("--eos-token-id", type=int, default=None,
                        help="EOS token id that ends every document (default: the eos_token_id of the manifest "
                             f"of the shard's prep output, else {EOS_TOKEN_ID}, o200k_harmony's)")
    parser.add_argument("--output", metavar="PATH", help="where to write the index (default: SHARD.idx)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing index that differs")


def shard_manifest(shard: str) -> dict[str, Any]:
    """The manifest two folders up from a shard ({} if there is none or it is unreadable)."""
    try:
        m = storage.read_json(storage.join(storage.dirname(storage.dirname(shard)), MANIFEST))
        return m if isinstance(m, dict) else {}
    except (OSError, ValueError):
        return {}


def manifest_eos(shard: str) -> int:
    """The ``eos_token_id`` of the manifest two folders up from a shard, else o200k_harmony's."""
    try:
        return int(shard_manifest(shard).get("eos_token_id", EOS_TOKEN_ID))
    except (ValueError, TypeError):
        return EOS_TOKEN_ID


@dataclass(frozen=True)
class RegenerateSettings:
    """``refinery regenerate-index``'s flags, read once from the command line."""

    shard: str
    eos_token_id: int | None = None
    output: str | None = None
    force: bool = False


def settings_from_args(args: argparse.Namespace) -> RegenerateSettings:
    return RegenerateSettings(shard=args.shard, eos_token_id=args.eos_token_id, output=args.output, force=args.force)


def run(args: argparse.Namespace, beam_args: list[str]) -> int:
    """Rebuild the shard's index; exit 0 (written or identical), 1 (differs, bad shard), 2 (no shard)."""
    return regenerate(settings_from_args(args))


def regenerate(s: RegenerateSettings) -> int:
    """:func:`run` on settings."""
    if shard_manifest(s.shard).get("eos_token_is_ordinary"):
        print(f"refinery regenerate-index: {s.shard}: its prep output's EOS is an ordinary token "
              "(eos_token_is_ordinary in its manifest): documents may hold it, so their ends cannot be rebuilt from "
              "EOS positions; restore the .idx from a copy or run prep again", file=sys.stderr)
        return 1
    try:
        out = s.output or index_path_for(s.shard)
        eos = s.eos_token_id if s.eos_token_id is not None else manifest_eos(s.shard)
        data = regenerate_index(s.shard, eos)
    except FileNotFoundError:
        print(f"refinery regenerate-index: {s.shard}: not found", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"refinery regenerate-index: {e}", file=sys.stderr)
        return 1
    num_docs = (len(data) - 32) // 16
    existing = storage.read_bytes(out) if storage.exists(out) else None
    if existing == data:
        print(f"OK   {out}: already identical to the regenerated index ({num_docs:,} documents)")
        return 0
    if existing is not None and not s.force:
        print(f"refinery regenerate-index: {out} exists and differs from the index rebuilt from {s.shard} "
              f"({len(existing)} vs {len(data)} bytes); pass --force to overwrite it", file=sys.stderr)
        return 1
    storage.atomic_write_bytes(out, data)
    print(f"wrote {out}: {num_docs:,} documents, {len(data):,} bytes")
    return 0
