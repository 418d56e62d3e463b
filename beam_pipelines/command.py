"""What every ``refinery`` command shares: execution flags, interruption and the resume hint.

A command module (``prep``, ``decon``, ``generate``, ...) plugs into :mod:`cli` with three
names: ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args, beam_args) -> int``
(a process exit code). A (sub)command that calls :func:`add_runner_args` is a pipeline: the
CLI turns ``--runner/--workers`` and every flag it does not know into Beam arguments and
passes them as ``beam_args``; any other command gets ``[]`` and unknown flags are an error.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import sys
import threading


def add_runner_args(p: argparse.ArgumentParser) -> None:
    """The execution flags of every pipeline command."""
    from refinery.runners import RUNNERS

    g = p.add_argument_group("execution")
    g.add_argument("--runner", default="local",
                   help=f"where to run: {', '.join(RUNNERS)}, or any Beam runner name (default: local). "
                        "Flags refinery does not know go to Beam (--project, --flink_master, ...); "
                        "dataflow also takes --gpu TYPE[:COUNT] (e.g. nvidia-l4) for GPU workers")
    g.add_argument("--workers", type=int, default=None,
                   help="local: worker processes (default: one per core); flink: parallelism; dataflow: max workers")
    g.add_argument("--verify-checksums", action="store_true",
                   help="treat a finished unit as done only if its files' sha256 still match (reads everything)")
    g.add_argument("--force", action="store_true", help="discard receipts and start a fresh run")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("-v", "--verbose", action="store_true", help="log each stage's plan")


_INTERRUPTED: list[int] = []
_WATCHDOG: list[threading.Timer] = []
STOP_GRACE_S = 5.0  # after SIGINT/SIGTERM, exit hard if Beam has not stopped by then


def _descendants(pid: int) -> list[int]:
    """Pids of every process below ``pid`` (Linux ``/proc``; [] elsewhere)."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for d in os.listdir("/proc"):
            if d.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    with open(f"/proc/{d}/stat", "rb") as f:
                        ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
                    children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _hard_exit(signum: int) -> None:
    """Leave now: finished units have receipts, unfinished ones only temp files that the
    next run removes. Beam's worker processes (our descendants) are killed first."""
    with contextlib.suppress(Exception):
        print(f"\ninterrupted (signal {signum}); Beam did not stop within {STOP_GRACE_S:.0f}s, exiting now. "
              f"Finished units are kept. Resume with:\n  {resume_hint()}", file=sys.stderr, flush=True)
    for pid in _descendants(os.getpid()):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    os._exit(130)


def _install_signal_handlers() -> None:
    """SIGINT/SIGTERM stop the run; Beam may wrap the KeyboardInterrupt, so remember it.

    Beam can swallow a KeyboardInterrupt raised in the wrong place (e.g. while it starts
    its worker processes) and then wait forever; so the first signal also arms a watchdog
    that exits the process after ``STOP_GRACE_S`` seconds, and a second signal exits at once.
    """
    def handler(signum, frame):
        _INTERRUPTED.append(signum)
        if len(_INTERRUPTED) > 1:
            _hard_exit(signum)
        timer = threading.Timer(STOP_GRACE_S, _hard_exit, args=(signum,))
        timer.daemon = True
        timer.start()
        _WATCHDOG.append(timer)
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def interruptible(run) -> int:
    """Call ``run()``; on SIGINT/SIGTERM print the resume command and return 130.

    Beam may wrap the KeyboardInterrupt raised inside a bundle, so any exception that
    follows a signal counts as the interruption.
    """
    _INTERRUPTED.clear()
    _install_signal_handlers()
    try:
        return run()
    except KeyboardInterrupt:
        pass
    except Exception:
        if not _INTERRUPTED:
            raise
    finally:
        for timer in _WATCHDOG:  # stopped in time: no hard exit later (in-process callers)
            timer.cancel()
        _WATCHDOG.clear()
    print(f"\ninterrupted: finished units are kept. Resume with:\n  {resume_hint()}", file=sys.stderr)
    return 130


def resume_hint() -> str:
    """The command line that resumes this run (``--force`` removed)."""
    argv = [a for a in sys.argv[1:] if a != "--force"]
    return "refinery " + shlex.join(argv)
