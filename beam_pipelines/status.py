"""status: units done / failed / pending per stage of a run, by the one completion check.

``refinery status OUT`` (or ``OUT/manifest.json``) reads ``OUT/.refinery/run.json`` and checks
every planned unit's receipt the way the planner does (receipt completed, same plan, every
file present with its recorded size; ``--checksums`` also re-hashes them): a truncated or
deleted output shows as pending, not done. A run that failed (its ``FAILED.json``: prep or
decon exited 1 with every unit done) gets a ``FAILED`` line naming why.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from refinery.transforms.formats.failed_run import failed_line, read_failed
from refinery.transforms.io import storage
from refinery.transforms.resumable import stage_status


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("output", metavar="OUTPUT", help="the run's output folder, or its manifest.json (local or gs://)")
    parser.add_argument("--checksums", action="store_true", help="also re-hash every file a receipt lists")


@dataclass(frozen=True)
class StatusSettings:
    """``refinery status``'s flags, read once from the command line."""

    output: str
    checksums: bool = False


def settings_from_args(args: argparse.Namespace) -> StatusSettings:
    return StatusSettings(output=args.output, checksums=args.checksums)


def run(args: argparse.Namespace, beam_args: list[str]) -> int:
    """Print units done, failed and pending per stage; exit 2 when the folder records no run."""
    s = settings_from_args(args)
    output = s.output.rstrip("/")
    if storage.basename(output) == "manifest.json" and not storage.isdir(output):
        output = storage.dirname(output)
    try:
        rows = stage_status(output, s.checksums)
    except FileNotFoundError as e:
        print(f"refinery status: {e}", file=sys.stderr)
        return 2
    print(f"{'stage':10} {'hash':16} {'units':>7} {'done':>7} {'failed':>7} {'pending':>7}")
    for r in rows:
        idle = "  (not needed: the stages after it are complete)" if r["pending"] and not r["needed"] else ""
        print(f"{r['stage']:10} {r['stage_hash']:16} {r['units']:>7} {r['done']:>7} {r['failed']:>7} "
              f"{r['pending']:>7}{idle}")
    if (record := read_failed(output)) is not None:  # units all done, and yet the run failed
        print(f"FAILED {failed_line(output, record)}")
    return 0
