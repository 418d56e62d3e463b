"""What runs a parsed command: its Beam arguments (a pipeline's unknown flags must be Beam's
options), where it reads and writes checked without the network, a dry run offline, the
local runner's warm workers started while the driver plans."""
from __future__ import annotations

import argparse
import sys
from typing import Protocol

from refinery.beam_pipelines.beam_flags import check_beam_args
from refinery.beam_pipelines.checks import UsageError, gs_paths, location_problems
from refinery.runners import RunnerOptionsError, pipeline_args, prepare_run, warm_workers
from refinery.transforms.io import gcs, storage


class CommandModule(Protocol):
    """What a command's module holds (see :mod:`refinery.beam_pipelines.command`)."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace, beam_args: list[str]) -> int: ...


def launch(mod: CommandModule, args: argparse.Namespace, unknown: list[str], leaf: argparse.ArgumentParser) -> int:
    """Run the command of ``mod`` on ``args`` (parsed by ``leaf``, its innermost subparser;
    ``unknown``: the flags it did not know); returns the exit code."""
    command = leaf.prog.removeprefix("refinery ")
    beam_args: list[str] = []
    if not hasattr(args, "runner"):
        if unknown:
            leaf.error(f"unrecognized arguments: {' '.join(unknown)}")
    else:
        try:  # a pipeline: what the command does not know must be a Beam option
            leftover = check_beam_args(command, leaf, unknown)
            beam_dry_run = [a for a in leftover if a == "--dry_run" or a.startswith("--dry_run=")]
            if beam_dry_run:  # Beam's spelling of --dry-run (its own would run nothing and report failed units)
                args.dry_run = beam_dry_run[-1].lower() not in ("--dry_run=false", "--dry_run=0")
                leftover = [a for a in leftover if a not in beam_dry_run]
            beam_args = pipeline_args(args.runner, args.workers, leftover)
            if not args.dry_run:
                beam_args = prepare_run(args.runner, beam_args)
        except (UsageError, RunnerOptionsError) as e:
            return _usage_lines(command, str(e).splitlines())
    dry_run = getattr(args, "dry_run", False)
    problems = location_problems(args, leaf, beam_args)
    if not problems and (gs_paths(args, leaf) or any("gs://" in a for a in beam_args)):
        if (missing := gcs.credentials_problem()) is not None:  # (through the module: tests stand in for it)
            if not dry_run:
                problems.append(missing)
            else:  # a dry run reads nothing remote; the run will need them
                print(f"refinery {command}: note: {missing}", file=sys.stderr)
    if problems:
        return _usage_lines(command, problems)
    if dry_run:
        with storage.offline("a dry run reads nothing remote"):
            return mod.run(args, beam_args)
    with warm_workers.pool(beam_args, getattr(mod, "WORKER_IMPORTS", ())):  # warms up while the driver plans
        return mod.run(args, beam_args)


def _usage_lines(command: str, lines: list[str]) -> int:
    """Print each line as ``refinery COMMAND: line`` on stderr; exit code 2."""
    for line in lines:
        print(line if line.startswith("refinery ") else f"refinery {command}: {line}", file=sys.stderr)
    return 2


