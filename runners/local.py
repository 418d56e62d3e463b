"""``local`` and ``direct``: Apache Beam's DirectRunner on this machine.

- ``local`` (the default runner): multi-processing, ``--workers`` processes (default: one
  per core), each a separate Python process with its own copy of what a unit loads; with
  one worker it runs in-process.
- ``direct``: in-process (``in_memory``), one worker unless ``--workers`` says more (then
  threads). The fastest way to run small jobs and tests.

Beam flags: ``--runner=DirectRunner``, ``--direct_running_mode``, ``--direct_num_workers``.
Environment variables of the driver (``STORAGE_EMULATOR_HOST``, ``REFINERY_VOCAB_FILE``,
credentials) reach the worker processes, which inherit the environment.
"""
from __future__ import annotations

import os

from .args import with_defaults


def local_args(workers: int | None, args: list[str]) -> list[str]:
    """Beam arguments for ``--runner local``."""
    n = workers or os.cpu_count() or 1
    if n == 1:
        return with_defaults(args, {"--runner": "DirectRunner", "--direct_running_mode": "in_memory",
                                    "--direct_num_workers": "1"})
    return with_defaults(args, {"--runner": "DirectRunner", "--direct_running_mode": "multi_processing",
                                "--direct_num_workers": str(n)})


def direct_args(workers: int | None, args: list[str]) -> list[str]:
    """Beam arguments for ``--runner direct`` (in-process)."""
    return with_defaults(args, {"--runner": "DirectRunner", "--direct_running_mode": "in_memory",
                                "--direct_num_workers": str(workers or 1)})


# Beam's DirectRunner hands every pipeline it can to Prism, a runner that starts as a
# subprocess of its own: about 0.4 s more per job than Beam's in-process FnApiRunner here.
IN_PROCESS_RUNNER = "apache_beam.runners.portability.fn_api_runner.FnApiRunner"


def in_process(args: list[str]) -> list[str]:
    """``args`` for the same job run in this process on Beam's FnApiRunner, when they ask
    for the local multi-process DirectRunner (a job of light steps: I/O-bound work, or
    one unit, where starting worker processes would cost more than it saves); any other
    runner's ``args`` unchanged."""
    from .args import value

    if (value(args, "--runner") or "").lower() not in ("directrunner", "direct") or \
            value(args, "--direct_running_mode") != "multi_processing":
        return args
    kept = [a for a in args if not a.startswith(("--direct_running_mode", "--direct_num_workers", "--runner"))]
    return kept + [f"--runner={IN_PROCESS_RUNNER}", "--direct_running_mode=in_memory", "--direct_num_workers=1"]
