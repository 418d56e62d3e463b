"""verify: check a refinery output: a prep output's manifest and shards, or any run by its receipts.

``refinery verify OUT/manifest.json`` (or ``refinery verify OUT``) exits 0 when every shard
listed matches the manifest (sizes, document bounds, EOS placement, totals, row accounting)
and nothing stray lies beside it; else it prints one ``BAD`` line per problem and exits 1.
An output without a manifest (``refinery decon``, ``generate``, ``hydra``) is checked by its
run record: every receipt of the recorded plan verifies, every file a final stage's receipt
lists is present with its size, no receipt of a final stage is missing, no temp file is left.
``--checksums`` also re-hashes every file against its recorded sha256. An output whose run
failed (its ``FAILED.json``: prep or decon exited 1) is one ``BAD`` line naming the failure and
the corrupt input files, exit 1, whatever its files.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from refinery.transforms.decon.ngrams.details import DETAILS_DIR
from refinery.transforms.formats.failed_run import failed_line, read_failed
from refinery.transforms.formats.manifests import MANIFEST, verify_manifest
from refinery.transforms.io import storage
from refinery.transforms.resumable.ledger import META_DIR, verify_run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", metavar="OUTPUT",
                        help="a prep output's folder or its manifest.json, or the output folder of refinery decon, "
                             "generate or hydra (local or gs://)")
    parser.add_argument("--checksums", action="store_true", help="also re-hash every file (sha256)")


def manifest_path(path: str) -> str:
    """A manifest path from a manifest or a prep output folder (whichever the user gave)."""
    path = path.rstrip("/")
    return path if storage.basename(path) == MANIFEST or not storage.isdir(path) else storage.join(path, MANIFEST)


def output_of(path: str) -> str:
    """The output folder of a :func:`manifest_path` (its folder), or the path itself."""
    return storage.dirname(path) if storage.basename(path) == MANIFEST else path


def runs_below(folder: str, names: tuple[str, ...] = storage.RUN_MARKERS, shown: int = 3) -> str:
    """``; it holds other runs' outputs below it: A, B (give one of them)`` for a folder that is
    no run itself (the first ``shown``, bounded search: :func:`storage.folders_holding`), or ""."""
    below = storage.folders_holding(folder, names, limit=shown + 1)
    if not below:
        return ""
    return (f"; it holds other runs' outputs below it: {', '.join(below[:shown])}"
            + (" and more" if len(below) > shown else "") + " (give one of them)")


def _report(problems: list[str], notes: list[str]) -> int:
    for n in notes:
        print(f"NOTE {n}")
    for p in problems:
        print(f"BAD  {p}")
    if problems:
        print(f"{len(problems)} problem(s) found", file=sys.stderr)
        return 1
    return 0


def unlisted_details(output: str) -> list[str]:
    """One problem per file under a decon output's ``stats/overlap_details/`` that no receipt of
    its recorded run lists (temp files aside: :func:`verify_run` names them): a reader of the
    folder takes every file's rows for detail records, so a planted or left-over file means
    duplicate or foreign rows."""
    folder = storage.join(output, DETAILS_DIR)
    files = [p for p in storage.listdir(folder) if not storage.is_temp_name(storage.basename(p))]
    if not files:
        return []
    listed: set[str] = set()
    try:
        info = storage.read_json(storage.join(output, META_DIR, "run.json"))
    except (OSError, ValueError):
        return []  # verify_run names it
    for st in info.get("stages", []) if isinstance(info, dict) else []:
        for path in storage.listdir(storage.join(output, META_DIR, st["name"], st["stage_hash"], "receipts")):
            try:
                receipt = json.loads(storage.read_bytes(path))
                listed.update(f["path"] for f in receipt.get("files", []) if isinstance(f, dict))
            except (OSError, ValueError, AttributeError, TypeError):
                continue  # verify_run names a receipt it cannot read
    return [f"{p}: not written by this run (no receipt lists it), yet read as detail records by every reader of "
            f"{folder}/; run the same decon command again to remove a stale part, or move the file out"
            for p in files if f"{DETAILS_DIR}/{storage.basename(p)}" not in listed]


def _missing_manifest(path: str, output: str) -> int:
    """A manifest named on the command line that is not there: one line saying so, and what its
    folder holds (no run; an unfinished or damaged run, with how many problems; a finished run
    of a command that writes no manifest). 1 when its folder holds a run with problems, else 2."""
    run_json = storage.join(output, META_DIR, "run.json")
    if not storage.exists(run_json):
        print(f"refinery verify: {path}: missing, and {output} holds no refinery run (no {run_json})"
              + runs_below(output), file=sys.stderr)
        return 2
    try:
        command = " ".join(["refinery", str(storage.read_json(run_json).get("command") or "")]).strip()
    except (ValueError, AttributeError):
        command = "refinery"
    if problems := verify_run(output, False):
        print(f"refinery verify: {path}: missing; {output} holds an unfinished or damaged {command} run "
              f"({len(problems)} problem(s): `refinery verify {output}` names them; rerunning the command "
              "finishes it)", file=sys.stderr)
        return 1
    print(f"refinery verify: {path}: missing; {output} holds a finished {command} run, which has no manifest "
          f"(`refinery verify {output}` checks it)", file=sys.stderr)
    return 2


@dataclass(frozen=True)
class VerifySettings:
    """``refinery verify``'s flags, read once from the command line."""

    manifest: str
    checksums: bool = False


def settings_from_args(args: argparse.Namespace) -> VerifySettings:
    return VerifySettings(manifest=args.manifest, checksums=args.checksums)


def run(args: argparse.Namespace, beam_args: list[str]) -> int:
    """Verify an output; exit 0 (no problem), 1 (each problem named), 2 (nothing to verify)."""
    s = settings_from_args(args)
    path = manifest_path(s.manifest)
    notes: list[str] = []
    if (record := read_failed(output_of(path))) is not None:  # a run that exited 1 is never OK
        return _report([failed_line(output_of(path), record)], notes)
    if not storage.exists(path):
        output = s.manifest.rstrip("/")
        if storage.basename(output) == MANIFEST and not storage.isdir(output):
            return _missing_manifest(path, storage.dirname(output))
        run_json = storage.join(output, META_DIR, "run.json")
        if not storage.exists(run_json):
            print(f"refinery verify: {path}: not found, and no {run_json} (give a prep output folder or its "
                  "manifest.json, or a decon, generate or hydra output folder)" + runs_below(output), file=sys.stderr)
            return 2
        if failed := _report(verify_run(output, s.checksums, notes) + unlisted_details(output), notes):
            return failed
        info = storage.read_json(run_json)
        receipts = sum(int(st.get("units", 0)) for st in info.get("stages", []))
        print(f"OK   {output}: a refinery {info.get('command', '')} output, {len(info.get('stages', []))} stages, "
              f"{receipts:,} planned units, every receipt verified"
              + (" (checksums verified)" if s.checksums else ""))
        return 0
    if failed := _report(verify_manifest(path, checksums=s.checksums, notes=notes), notes):
        return failed
    m = storage.read_json(path)
    print(f"OK   {path}: {m['num_shards']} shards, {m['total_documents']:,} documents, "
          f"{m['total_tokens']:,} tokens" + (" (checksums verified)" if s.checksums else ""))
    return 0
