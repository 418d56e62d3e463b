"""The ``refinery`` command line: a registry of command modules, nothing else.

Each command lives in its own module of ``refinery.beam_pipelines`` with three names (see
:mod:`refinery.beam_pipelines.command`): ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args, beam_args) -> exit code``. A command whose parser has ``--runner`` (added by
``command.add_runner_args``) is a pipeline: the flags it does not know must be Beam's
PipelineOptions (``--project``, ``--temp_location``, ``--flink_master``, ...), and are passed
to Beam; anything else exits 2 naming the flag and the nearest one.

Before any command runs, where it reads and writes is checked without the network
(``checks.location_problems``: Dataflow's options, local paths under Dataflow, bucket
names; then credentials for ``gs://``), each problem one line, exit 2. A ``--dry-run`` runs
inside ``storage.offline``: it lists and reads nothing remote.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from refinery.transforms.io import beam_private

COMMANDS = {
    "prep": "refinery.beam_pipelines.prep",
    "verify": "refinery.beam_pipelines.verify",
    "info": "refinery.beam_pipelines.info",
    "status": "refinery.beam_pipelines.status",
    "decon": "refinery.beam_pipelines.decon",
    "generate": "refinery.beam_pipelines.generate",
    "hydra": "refinery.beam_pipelines.hydra",
    "prep-mixture": "refinery.beam_pipelines.prep_mixture",
    "inspect": "refinery.beam_pipelines.inspect_shards",
    "regenerate-index": "refinery.beam_pipelines.regenerate_index",
    "tiny-checkpoint": "refinery.beam_pipelines.tiny_checkpoint",
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and each command's subparser (by name)."""
    parser = argparse.ArgumentParser(
        prog="refinery", description="Prepare LLM training data as Apache Beam pipelines.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    subparsers = {}
    for name, module_name in COMMANDS.items():
        mod = importlib.import_module(module_name)
        c = sub.add_parser(name, help=mod.HELP, description=(mod.__doc__ or mod.HELP).strip().split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(c)
        subparsers[name] = c
    return parser, subparsers


def version_line() -> str:
    """``refinery 0.1.0 (apache-beam 2.77.0, Python 3.11.7)``: what ``--version`` prints."""
    import platform
    from importlib import metadata

    def dist(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return f"refinery {dist('llm-refinery')} (apache-beam {dist('apache-beam')}, Python {platform.python_version()})"


def _leaf_parser(parser: argparse.ArgumentParser, args) -> argparse.ArgumentParser:
    """The innermost subparser that parsed ``args`` (e.g. ``hydra grade``'s)."""
    for dest, choices in beam_private.subcommands(parser):
        name = getattr(args, dest, None)
        if name in choices:
            return _leaf_parser(choices[name], args)
    return parser


class _BeamNoise(logging.Filter):
    """Drops the lines Beam logs on the root logger (out of reach of the ``apache_beam``
    logger's level) that say nothing to a refinery user: RunInference without scipy cannot
    measure its memory use, "Resource module is not available", once per model load; the
    portable runner's "Waiting for grpc channel to be ready" while its job server starts."""

    NOISE = ("Resource module is not available", "Waiting for grpc channel to be ready")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.NOISE)


def configure_logging(verbose: bool) -> None:
    """Warnings and errors on stderr (``--verbose``: also INFO); Beam's routine warnings off."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not verbose:
        logging.getLogger("apache_beam").setLevel(logging.ERROR)  # workers' routine warnings
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font cache INFO lines, even with -v
    root = logging.getLogger()
    if not any(isinstance(f, _BeamNoise) for f in root.filters):
        root.addFilter(_BeamNoise())


_exit_code: int | None = None  # set by entry(): the console script's status, for a quick end


def entry() -> None:
    """The ``refinery`` console script: :func:`main`, then the process ends with its exit code
    without the interpreter's teardown (:mod:`refinery.runners.quick_exit`, ~0.4 s)."""
    global _exit_code
    from refinery.runners.quick_exit import exit_quickly

    exit_quickly(lambda: _exit_code)  # registered before the commands import Beam: runs after their handlers
    _exit_code = main()
    sys.exit(_exit_code)


def main(argv: list[str] | None = None) -> int:
    """Run one command; SIGINT/SIGTERM at any point (start-up included) stop it with exit 130
    and the command that resumes it."""
    from refinery.beam_pipelines.interrupt import interruptible

    return interruptible(lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    from refinery.beam_pipelines.beam_flags import check_beam_args
    from refinery.beam_pipelines.checks import UsageError, gs_paths, location_problems
    from refinery.runners import RunnerOptionsError, pipeline_args, prepare_run
    from refinery.transforms.io import storage
    from refinery.transforms.io.gcs import credentials_problem

    parser, subparsers = build_parser()
    args, unknown = parser.parse_known_args(argv)
    configure_logging(getattr(args, "verbose", False))
    mod = importlib.import_module(COMMANDS[args.command])
    leaf = _leaf_parser(subparsers[args.command], args)
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
        if (missing := credentials_problem()) is not None:
            if not dry_run:
                problems.append(missing)
            else:  # a dry run reads nothing remote; the run will need them
                print(f"refinery {command}: note: {missing}", file=sys.stderr)
    if problems:
        return _usage_lines(command, problems)
    if dry_run:
        with storage.offline("a dry run reads nothing remote"):
            return mod.run(args, beam_args)
    from refinery.runners import warm_workers

    with warm_workers.pool(beam_args, getattr(mod, "WORKER_IMPORTS", ())):  # warms up while the driver plans
        return mod.run(args, beam_args)


def _usage_lines(command: str, lines: list[str]) -> int:
    """Print each line as ``refinery COMMAND: line`` on stderr; exit code 2."""
    for line in lines:
        print(line if line.startswith("refinery ") else f"refinery {command}: {line}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    entry()
