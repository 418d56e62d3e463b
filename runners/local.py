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
