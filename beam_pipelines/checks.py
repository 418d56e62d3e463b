"""Checks made before a command runs anything: where it reads and writes (without the
network), its input fields, its optional dependencies, and its reject rate afterwards. Each
problem is one line naming the flag, the file or the row."""
from __future__ import annotations

import argparse
import glob as globlib
import importlib.util
import json
import os
import re
import sys
from collections import Counter
from typing import Sequence

from refinery.runners.dataflow import is_dataflow, option_problems
from refinery.transforms.formats.failed_run import CorruptFile
from refinery.transforms.io import beam_private, storage
from refinery.transforms.io.gcs import bucket_problem
from refinery.transforms.io.rows import iter_rows
from refinery.transforms.io.text import TextSpec, unescape
from refinery.transforms.resumable.ledger import fingerprints_path


class UsageError(ValueError):
    """A bad command line or input; the CLI prints it as one line and exits 2."""


# ---------------------------------------------------------------------------------------
# Optional dependencies (setup.py's extras)
# ---------------------------------------------------------------------------------------

def missing_extra(module: str, extra: str) -> str | None:
    """None when ``module`` can be imported; else what to install. refinery is installed from
    a clone (it is not on PyPI), so the hint names the extra of this checkout's setup.py."""
    if importlib.util.find_spec(module) is not None:
        return None
    return f"{module} is not installed: pip install -e '.[{extra}]' (in the refinery checkout)"


# ---------------------------------------------------------------------------------------
# Where a run reads and writes: checked up front, without the network
# ---------------------------------------------------------------------------------------

# the data paths a pipeline's workers read or write (the flags' dest names)
WORKER_PATHS = ("input", "eval", "train", "input_docids", "data_root", "output")


def gs_paths(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
    """(flag, path) for every ``gs://`` path among the arguments ``parser`` parsed (flag ""
    for a positional argument)."""
    flags = {a.dest: a.option_strings[-1] for a in beam_private.parser_actions(parser) if a.option_strings}
    found = []
    for dest, v in sorted(vars(args).items()):
        for item in v if isinstance(v, list) else [v]:
            if isinstance(item, str) and item.startswith("gs://"):
                found.append((flags.get(dest, ""), item))
    return found


def location_problems(args: argparse.Namespace, parser: argparse.ArgumentParser, beam_args: list[str]) -> list[str]:
    """One line per problem with where the run reads and writes: for Dataflow, its options
    (``runners.dataflow.option_problems``) and every local data path (its workers cannot
    see this machine's files); the bucket name of every ``gs://`` path. Reads nothing remote."""
    problems = []
    if is_dataflow(beam_args):
        problems += option_problems(beam_args)
        for dest in WORKER_PATHS:
            v = getattr(args, dest, None)
            for path in v if isinstance(v, list) else [v]:
                if isinstance(path, str) and not storage.is_remote(path):
                    problems.append(f"--{dest.replace('_', '-')} {path}: a local path, which Dataflow's workers "
                                    "cannot see; give a gs://BUCKET/PATH (or run with --runner local)")
    for flag, path in gs_paths(args, parser):
        if (bad := bucket_problem(path)) is not None:
            problems.append(f"{flag} {bad}".strip())
    return problems


# ---------------------------------------------------------------------------------------
# Input sanity: a wrong field name is an error before anything runs, not an empty result
# ---------------------------------------------------------------------------------------

def check_field(command: str, flag: str, field: str | tuple[str, ...], paths: list[str], files: int = 8,
                rows: int = 100, shown: str | None = None) -> None:
    """:class:`UsageError` when none of the first ``rows`` readable rows of an input file has
    ``field`` (the first ``files`` files are looked at), naming the file and the fields its
    rows do have. A file whose first rows are all unreadable is left to the run (its rows
    are rejected with reasons). A tuple of fields (a text template's, ``shown`` as the
    template): each must be in some row."""
    wanted = (field,) if isinstance(field, str) else tuple(field)
    for path in paths[:files]:
        fields: dict[str, None] = {}
        good, missing = 0, wanted
        for _, record, error in iter_rows(path):
            if error is not None or record is None:  # no record: an error says why
                continue
            missing = tuple(f for f in missing if f not in record)
            if not missing:
                break
            fields.update(dict.fromkeys(record))
            good += 1
            if good >= rows:
                break
        if good and missing:
            what = f"{field!r}" if isinstance(field, str) else f"{shown!r}: field {missing[0]!r}"
            raise UsageError(f"refinery {command}: {flag} {what}: no row of {path} has it (first {good} "
                             f"row(s) read); their fields: {', '.join(list(fields)[:20])}")


def text_spec(command: str, field: str | None, template: str | None, field_flag: str = "--text-field",
              template_flag: str = "--text-template", default: str | None = "text") -> TextSpec | None:
    """The :class:`~refinery.transforms.io.text.TextSpec` of a text field / text template
    pair of flags (the template as typed: ``\\n``, ``\\t``, ``\\\\`` interpreted), or None
    when neither is given and there is no ``default``; :class:`UsageError` (one line) for
    both, or for a bad template."""
    if field is not None and template is not None:
        raise UsageError(f"refinery {command}: give {field_flag} or {template_flag}, not both")
    try:
        if template is not None:
            return TextSpec(template=unescape(template))
        return None if field is None and default is None else TextSpec(field=default if field is None else field)
    except ValueError as e:  # TemplateError included
        raise UsageError(f"refinery {command}: {template_flag if template is not None else field_flag}: {e}"
                         ) from None


def check_text(command: str, spec: TextSpec, paths: list[str], field_flag: str = "--text-field",
               template_flag: str = "--text-template") -> None:
    """:func:`check_field` for the field, or for each field of the template, of ``spec``."""
    if spec.field is not None:
        check_field(command, field_flag, spec.field, paths)
    else:
        check_field(command, template_flag, spec.fields(), paths, shown=spec.template)


def check_output(command: str, output: str, inputs: Sequence[str] = (), *, dry_run: bool = False,
                 flag: str = "--output") -> None:
    """:class:`UsageError` unless ``output`` can be this run's output folder, checked before
    anything is written: it is not a file nor under one, a folder can be made there (probed,
    except on a dry run, which writes nothing), and no input folder or glob in ``inputs``
    would list it (a run reading its own outputs back as input); for prep and prep-mixture, no
    other run's output lies above or below it (:func:`nested_run_problem`). Every command that
    takes ``--output`` calls it (``flag``: how the message names the output)."""
    problem = storage.output_folder_problem(output, probe=not dry_run)
    if problem:
        raise UsageError(f"refinery {command}: {flag} {output}: {problem}")
    spellings = [output] if storage.is_remote(output) else local_spellings(output)
    for arg in inputs:
        if any(storage.listing_reaches(arg, spelled) for spelled in spellings) or same_folder_above(arg, output):
            raise UsageError(f"refinery {command}: {flag} {output} is inside the input {arg}, whose listing would "
                             f"read the run's own outputs back; give an output folder outside it")
    if not (dry_run and storage.is_remote(output)):  # a dry run reads nothing remote
        other = recorded_command(output)
        if other is not None and command_family(other) != command_family(command):
            raise UsageError(f"refinery {command}: {flag} {output} holds the output of 'refinery {other}' "
                             f"({storage.join(output, '.refinery', 'run.json')}); the two would mix: give another "
                             f"{flag}, or remove that folder first")
        if command_family(command) == "prep" and (problem := nested_run_problem(output)):
            raise UsageError(f"refinery {command}: {flag} {output} {problem}")


def nested_run_problem(output: str) -> str | None:
    """Why ``output`` cannot be a prep output because of other runs' outputs (one line), or
    None: a folder above it holds a run (``manifest.json`` or ``.refinery/``: it lies inside
    that run's output), or folders below it do (it would hold theirs). A reader of a folder
    (a tool globbing its shards, a copy, a removal) would take the runs for one; outputs are
    siblings. The search below is bounded (:func:`storage.folders_holding`)."""
    for above in storage.runs_above(output):
        marker = next(m for m in storage.RUN_MARKERS if storage.exists(storage.join(above, m)))
        return (f"lies inside {above}, the output of another run ({storage.join(above, marker)}): give a folder "
                f"outside it, e.g. a sibling of it")
    if below := storage.folders_holding(output):
        return (f"holds the output of another run below it: {', '.join(below)}; give a folder beside it (runs are "
                f"siblings), or move that run out first")
    return None


def named_inputs(given: list[str]) -> list[str]:
    """The inputs as the user named them (``--input`` arguments, a ``--hf-dataset`` name), local
    paths resolved: what run.json records as ``inputs``, and what :func:`replaced_inputs_problem`
    compares."""
    return sorted({g if storage.is_remote(g) or not storage.exists(g) else storage.resolved(g) for g in given})


def recorded_inputs(output: str) -> tuple[list[str], list[str]] | None:
    """(the input files, the inputs as named: :func:`named_inputs`) of the run recorded in
    ``output``: its first stage's recorded input fingerprints (``.refinery/fingerprints/``) and
    run.json's ``inputs``; None when the folder records no run, or a run of a refinery that did
    not record what it was given (nothing to compare)."""
    try:
        info = storage.read_json(storage.join(output, ".refinery", "run.json"))
        named = [str(x) for x in info["inputs"]]
        stage = next(st for st in info["stages"] if "inputs_hash" in st)
        files = storage.read_json(fingerprints_path(output, stage["name"], stage["stage_hash"]))
        paths = sorted({storage.resolved(f["path"]) for f in files})
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        return None  # a damaged record is named by verify and rewritten by the run: no basis to refuse here
    return paths, named


def replaced_inputs_problem(command: str, output: str, inputs: list[storage.InputFile], given: list[str],
                            force: bool) -> str | None:
    """One line when ``output`` holds the output of OTHER inputs: named otherwise than ``given``
    (this run's ``--input`` arguments) AND holding other files than ``inputs`` (its
    :class:`~refinery.transforms.io.storage.InputFile` s): a mistyped ``--input`` or
    ``--output`` would replace hours of work. The same inputs with other settings, or with
    files edited, added or removed since (the run says which and replaces what changed), and
    the same files named another way, are no problem. ``force``: the user asked for it."""
    recorded = None if force else recorded_inputs(output)
    if recorded is None:
        return None
    before, before_named = recorded
    now = sorted({storage.resolved(f.path) for f in inputs})
    if before_named == named_inputs(given) or before == now:
        return None
    gone, new = sorted(set(before) - set(now)), sorted(set(now) - set(before))

    def some(paths: list[str]) -> str:
        return ", ".join(paths[:2]) + (f" and {len(paths) - 2} more" if len(paths) > 2 else "")

    diff = "; ".join(part for part in (f"{len(gone)} of its {len(before)} file(s) are not inputs now ({some(gone)})"
                                       if gone else "",
                                       f"{len(new)} input file(s) are new ({some(new)})" if new else "") if part)
    return (f"refinery {command}: --output {output} holds the output of other inputs ({' '.join(before_named)}; "
            f"now {' '.join(named_inputs(given))}): {diff}. Nothing was touched: give another --output, or --force "
            f"to replace that output")


MOUNTINFO = "/proc/self/mountinfo"


def mount_aliases(path: str, mountinfo: str) -> list[str]:
    """Every spelling of the resolved local ``path`` through the mounts of its filesystem
    (``mountinfo``: the text of ``/proc/self/mountinfo``): a bind mount shows one folder at two
    paths, and a check on spelled paths alone sees two folders. ``path`` itself first."""
    def unescape(field: str) -> str:  # mountinfo writes a space as \040, a tab as \011, ...
        return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)

    def under(p: str, top: str) -> str | None:  # p's part below top, or None when p is not under it
        if top == "/":
            return p
        return p[len(top):] or "/" if p == top or p.startswith(top + "/") else None

    mounts = []
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if len(fields) >= 5:
            mounts.append((fields[2], unescape(fields[3]), unescape(fields[4])))  # device, root, mount point
    real = os.path.realpath(path)
    home = max((m for m in mounts if under(real, m[2]) is not None), key=lambda m: len(m[2]), default=None)
    if home is None:
        return [real]
    device, root, point = home
    below = under(real, point) or "/"
    inside = root.rstrip("/") + below if below != "/" else root  # the path within the filesystem
    out = [real]
    for dev, other_root, other_point in mounts:
        rest = under(inside, other_root) if dev == device else None
        if rest is not None:
            spelled = os.path.normpath(other_point.rstrip("/") + rest if rest != "/" else other_point)
            if spelled not in out:
                out.append(spelled)
    return out


def local_spellings(output: str) -> list[str]:
    """:func:`mount_aliases` of the local ``output`` (just its resolved path where the mount
    table cannot be read: not Linux)."""


    path = storage.paths._local(output)
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as f:
            return mount_aliases(path, f.read())
    except OSError:
        return [os.path.realpath(path)]


def same_folder_above(arg: str, output: str) -> bool:
    """Whether the local input folder ``arg`` (no glob) is ``output`` or one of its existing
    parents by device and inode (``os.stat``), whatever the spelling of either."""


    if storage.is_remote(arg) or storage.is_remote(output) or globlib.has_magic(arg):
        return False
    try:
        folder = os.stat(storage.paths._local(arg))
    except OSError:
        return False
    current = os.path.abspath(storage.paths._local(output))
    while True:
        try:
            if os.path.samestat(os.stat(current), folder):
                return True
        except OSError:
            pass
        parent = os.path.dirname(current)
        if parent == current:
            return False
        current = parent


def command_family(command: str) -> str:
    """Commands whose outputs are the same kind: prep-mixture writes prep outputs."""
    return "prep" if command in ("prep", "prep-mixture") else command


def recorded_command(output: str) -> str | None:
    """The command of the run recorded in ``output`` (``.refinery/run.json``), or None."""
    try:
        info = storage.read_json(storage.join(output, ".refinery", "run.json"))
    except (OSError, ValueError):
        return None
    return info.get("command") if isinstance(info, dict) and isinstance(info.get("command"), str) else None


def add_reject_rate_arg(g: argparse._ArgumentGroup, rows: str = "the rows read") -> None:
    """``--max-reject-rate R`` on the argument group ``g``; ``rows``: which rows it counts."""
    g.add_argument("--max-reject-rate", type=float, default=None, metavar="R",
                   help=f"exit 1 when more than R (0..1, e.g. 0.05) of {rows} were rejected (default: exit 1 "
                        f"only when no row was accepted; prep and decon also when an input file is corrupt or cut "
                        f"short, which R lets through as one rejected row). prep and decon record such a failed "
                        f"run in OUTPUT/FAILED.json, without the manifest.json or .SUCCESS of a finished one. A run "
                        f"that read no row at all always exits 1")


def bad_reject_rate(rate: float | None) -> str | None:
    """What is wrong with ``--max-reject-rate`` ``rate`` (for a usage error), or None."""
    if rate is not None and not 0.0 <= rate <= 1.0:
        return f"--max-reject-rate must be between 0 and 1 (e.g. 0.05 for 5%), not {rate:g}"
    return None


def reject_rate_failure(what: str, read: int, rejected: int, accepted: int, max_rate: float | None,
                        reasons: str) -> str | None:
    """Why a run fails its ``--max-reject-rate`` (one line, naming ``what`` was read, with
    ``reasons``: where the reasons are), or None. ``max_rate`` None: fail only when nothing
    was accepted. Reading nothing at all always fails."""
    if read == 0:
        return f"no {what} read (empty input files?)"
    if max_rate is None:
        if accepted == 0:
            return (f"no {what} accepted of {read:,} read ({rejected:,} rejected; {reasons}); "
                    f"--max-reject-rate 1 lets such a run pass")
        return None
    if rejected > max_rate * read:
        return (f"{rejected:,} of {read:,} {what} ({100 * rejected / read:.0f}%) rejected, more than "
                f"--max-reject-rate {max_rate:g}; {reasons}")
    return None


def corrupt_files_failure(corrupt: Sequence[CorruptFile], listed: str) -> str:
    """The one line a run with corrupt or cut-short input files fails with (without
    ``--max-reject-rate``): the first file and its reason, and how many more ``listed`` names."""
    first = corrupt[0]
    more = f" (and {len(corrupt) - 1} more, listed in {listed})" if len(corrupt) > 1 else ""
    return (f"{len(corrupt)} input file(s) corrupt or cut short: {first['path']}: {first['reason']}{more}; "
            "the rows before the damage were read. Replace the file, or give --max-reject-rate R to count "
            "each as one rejected row")


def warn_if_mostly_rejected(command: str, rejected: int, read: int, where: str, hint: str | None = None) -> None:
    """A loud line on stderr when more than half of the rows read were rejected; ``hint``: what
    to check (default: the text field and the input files; :func:`rejects_hint` reads it from
    the most common reason)."""
    if read and rejected * 2 > read:
        print(f"WARNING refinery {command}: {rejected:,} of {read:,} rows ({100 * rejected / read:.0f}%) were "
              f"rejected; the reasons are in {where}. "
              f"{hint or 'Check --text-field (or --text-template) and the input files.'}", file=sys.stderr)


def rejection_hint(reasons: list[str]) -> str | None:
    """What to check, from the reasons of rejected rows: by the most common kind of reason
    (the words before its first ``:``, or the whole reason), or None when there is none."""
    if not reasons:
        return None
    kinds = Counter(r.split(":", 1)[0].strip() for r in reasons)
    kind, count = kinds.most_common(1)[0]
    share = f"{count:,} of the {len(reasons):,} reasons read"
    if kind == "malformed JSON":
        return (f"Most are 'malformed JSON' ({share}): the files are not JSON rows (plain text?); refinery reads "
                ".jsonl, .json, .parquet and .arrow files whose rows are objects with a text field.")
    if "text field" in kind or "(text template)" in kind or kind.startswith("missing field"):
        return f"Most are '{kind}' ({share}): check --text-field (or --text-template)."
    return f"The most common reason is '{kind}' ({share}); check the input files."


def rejects_hint(rejects_path: str, limit: int = 10_000) -> str | None:
    """:func:`rejection_hint` of the first ``limit`` rows of a rejects file (None if unreadable)."""


    reasons: list[str] = []
    try:
        with storage.open_read(rejects_path) as f:
            for line in f:
                reasons.append(str(json.loads(line).get("reason", "")))
                if len(reasons) >= limit:
                    break
    except (OSError, ValueError, AttributeError):
        return None
    return rejection_hint(reasons)
