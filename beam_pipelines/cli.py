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
import platform
import sys
from importlib import metadata
from typing import TYPE_CHECKING, cast

from refinery.beam_pipelines.interrupt import interruptible
from refinery.runners.quick_exit import exit_quickly
from refinery.transforms.io import beam_private
from refinery.transforms.io.timeline import mark

if TYPE_CHECKING:
    from refinery.beam_pipelines.launch import CommandModule



# each command: its module in refinery.beam_pipelines, and its one line of help (``refinery --help``
# imports no command's module)
COMMANDS: dict[str, tuple[str, str]] = {
    "prep": ("prep",
        "tokenize a corpus into .npy/.idx shards with a manifest"),
    "verify": ("verify",
        "check an output: a manifest and its shards, or a decon/generate/hydra run (exit 1 naming each problem)"),
    "info": ("info",
        "summarize a manifest"),
    "status": ("status",
        "units done/pending/failed per stage of a run, from its receipts"),
    "decon": ("decon",
        "train/test n-gram overlap with provenance"),
    "dedup": ("dedup",
        "remove exact and near-duplicate documents (MinHash), with provenance: a list prep and clean leave out"),
    "clean": ("clean",
        "copy training files in their own format without the rows or passages decon found overlapping"),
    "generate": ("generate",
        "generate / rephrase documents with the gpt-oss engine (resumable)"),
    "hydra": ("hydra",
        "HYDRA quality grading: slices, oracle-label, calibrate, train probe|judge, grade"),
    "prep-mixture": ("prep_mixture",
        "prepare every source/split of a mixture TOML (resumable prep runs under one data root)"),
    "inspect": ("inspect_shards",
        "check shards for double EOS, empty documents, idx/npy mismatch; token statistics (exit 1 on issues)"),
    "regenerate-index": ("regenerate_index",
        "rebuild a shard's lost .idx from its EOS positions (byte-identical)"),
    "tiny-checkpoint": ("tiny_checkpoint",
        "write a tiny random gpt-oss checkpoint (to try generate and hydra on a CPU)"),
}


def command_module(name: str) -> CommandModule:
    """The module of the command ``name``, imported now: a command's module imports its
    pipeline's code (Beam's, the transforms'), which ``refinery --help`` and every other
    command must not pay for."""
    return cast("CommandModule", importlib.import_module(f"refinery.beam_pipelines.{COMMANDS[name][0]}"))


def build_parser(command: str | None = None) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and each command's subparser (by name); given ``command``, only
    that command's subparser has its flags (the others: their help line), so that only its
    module is imported."""
    parser = argparse.ArgumentParser(
        prog="refinery", description="Prepare LLM training data as Apache Beam pipelines.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    subparsers = {}
    for name, (_, help_line) in COMMANDS.items():
        if command is not None and name != command:
            subparsers[name] = sub.add_parser(name, help=help_line)
            continue
        mod = command_module(name)
        c = sub.add_parser(name, help=help_line, description=(mod.__doc__ or help_line).strip().split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(c)
        subparsers[name] = c
    return parser, subparsers


def command_named(argv: list[str]) -> str:
    """The command ``argv`` names: its first word that is not a flag (``refinery``'s own
    flags, ``--help`` and ``--version``, take no value), or "" when there is none."""
    return next((a for a in argv if not a.startswith("-")), "")


def version_line() -> str:
    """``refinery 0.1.0 (apache-beam 2.77.0, Python 3.11.7)``: what ``--version`` prints."""
    def dist(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return f"refinery {dist('llm-refinery')} (apache-beam {dist('apache-beam')}, Python {platform.python_version()})"


def _leaf_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
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
    exit_quickly(lambda: _exit_code)  # registered before the commands import Beam: runs after their handlers
    _exit_code = main()
    sys.exit(_exit_code)


def main(argv: list[str] | None = None) -> int:
    """Run one command; SIGINT/SIGTERM at any point (start-up included) stop it with exit 130
    and the command that resumes it."""
    return interruptible(lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    mark("main")
    parser, subparsers = build_parser(command_named(sys.argv[1:] if argv is None else argv))
    args, unknown = parser.parse_known_args(argv)
    configure_logging(getattr(args, "verbose", False))
    # imported inside interruptible(), which blocks the stop signals: a thread that the libraries
    # below start (fsspec, gRPC) must inherit the block, or it takes a Ctrl-C and drops it
    from refinery.beam_pipelines.launch import launch  # lazy: after the stop signals are blocked

    code = launch(command_module(args.command), args, unknown, _leaf_parser(subparsers[args.command], args))
    mark("exit")
    return code


if __name__ == "__main__":
    entry()
