"""``local`` and ``direct``: Apache Beam's DirectRunner on this machine.

- ``local`` (the default runner): multi-processing, ``--workers`` processes (default: one
  per core), each a separate Python process with its own copy of what a unit loads; with
  one worker it runs in-process.
- ``direct``: in-process (``in_memory``), one worker unless ``--workers`` says more (then
  threads). The fastest way to run small jobs and tests.

Beam flags: ``--runner=DirectRunner``, ``--direct_running_mode``, ``--direct_num_workers``; a
job runs them on :class:`refinery.runners.local_runner.LocalRunner` (Beam's FnApiRunner,
without the DirectRunner's detour through Prism). This module imports no Beam: what the
local runner's worker processes run first (:mod:`.warm_workers`) imports it.
Environment variables of the driver (``STORAGE_EMULATOR_HOST``, ``REFINERY_VOCAB_FILE``,
credentials) reach the worker processes, which inherit the environment.
"""
from __future__ import annotations

import os

from .args import value, with_defaults


def local_args(workers: int | None, args: list[str]) -> list[str]:
    """Beam arguments for ``--runner local``."""
    n = workers or os.cpu_count() or 1
    if n == 1:
        return with_defaults(args, {"--runner": "DirectRunner", "--direct_running_mode": "in_memory",
                                    "--direct_num_workers": "1"})
    return with_defaults(args, {"--runner": "DirectRunner", "--direct_running_mode": "multi_processing",
                                "--direct_num_workers": str(n), "--beam_plugins": WORKER_PLUGIN})


def direct_args(workers: int | None, args: list[str]) -> list[str]:
    """Beam arguments for ``--runner direct`` (in-process)."""
    return with_defaults(args, {"--runner": "DirectRunner", "--direct_running_mode": "in_memory",
                                "--direct_num_workers": str(workers or 1)})


# What a worker process of the local multi-process runner imports first (Beam's
# --beam_plugins): it ends the process as soon as its work is done (see worker_exit).
WORKER_PLUGIN = "refinery.runners.worker_exit"


LOCAL_RUNNER = "refinery.runners.local_runner.LocalRunner"  # Beam's FnApiRunner, as a job runs (see there)


def is_direct(args: list[str]) -> bool:
    """Whether ``args`` ask for Beam's DirectRunner (what ``local`` and ``direct`` build)."""
    return (value(args, "--runner") or "").lower() in ("directrunner", "direct")


def runnable(args: list[str]) -> list[str]:
    """``args`` as a job runs them: the DirectRunner's become
    :class:`~refinery.runners.local_runner.LocalRunner`'s (same flags); any other runner's
    unchanged."""
    if not is_direct(args):
        return args
    return [a for a in args if not a.startswith("--runner")] + [f"--runner={LOCAL_RUNNER}"]


def in_process(args: list[str]) -> list[str]:
    """``args`` for the same job run in this process, when they ask for the local
    multi-process DirectRunner (a job of light steps: I/O-bound work, or one unit, where
    starting worker processes would cost more than it saves); any other runner's ``args``
    unchanged."""
    if not is_direct(args) or value(args, "--direct_running_mode") != "multi_processing":
        return args
    kept = [a for a in args if not a.startswith(("--direct_running_mode", "--direct_num_workers"))]
    return kept + ["--direct_running_mode=in_memory", "--direct_num_workers=1"]
