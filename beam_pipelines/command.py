"""What every ``refinery`` command shares: execution flags, interruption and the resume hint.

A command module (``prep``, ``decon``, ``generate``, ...) plugs into :mod:`cli` with three
names: ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args, beam_args) -> int``
(a process exit code). A (sub)command that calls :func:`add_runner_args` is a pipeline: the
CLI turns ``--runner/--workers`` and every flag it does not know into Beam arguments and
passes them as ``beam_args``; any other command gets ``[]`` and unknown flags are an error.
"""
from __future__ import annotations

import argparse
import shlex
import signal
import sys


def add_runner_args(p: argparse.ArgumentParser) -> None:
    """The execution flags of every pipeline command."""
    from refinery.runners import RUNNERS

    g = p.add_argument_group("execution")
    g.add_argument("--runner", default="local",
                   help=f"where to run: {', '.join(RUNNERS)}, or any Beam runner name (default: local)")
    g.add_argument("--workers", type=int, default=None,
                   help="local: worker processes (default: one per core); flink: parallelism; dataflow: max workers")
    g.add_argument("--verify-checksums", action="store_true",
                   help="treat a finished unit as done only if its files' sha256 still match (reads everything)")
    g.add_argument("--force", action="store_true", help="discard receipts and start a fresh run")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("-v", "--verbose", action="store_true", help="log each stage's plan")


_INTERRUPTED: list[int] = []


def _install_signal_handlers() -> None:
    """SIGINT/SIGTERM stop the run; Beam may wrap the KeyboardInterrupt, so remember it."""
    def handler(signum, frame):
        _INTERRUPTED.append(signum)
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def interruptible(run) -> int:
    """Call ``run()``; on SIGINT/SIGTERM print the resume command and return 130.

    Beam may wrap the KeyboardInterrupt raised inside a bundle, so any exception that
    follows a signal counts as the interruption.
    """
    _install_signal_handlers()
    try:
        return run()
    except KeyboardInterrupt:
        pass
    except Exception:
        if not _INTERRUPTED:
            raise
    print(f"\ninterrupted: finished units are kept. Resume with:\n  {resume_hint()}", file=sys.stderr)
    return 130


def resume_hint() -> str:
    """The command line that resumes this run (``--force`` removed)."""
    argv = [a for a in sys.argv[1:] if a != "--force"]
    return "refinery " + shlex.join(argv)
