"""End a process whose work is done without tearing its interpreter down.

A refinery process imports Beam, gRPC, numpy, pyarrow and tiktoken. Once its work is done,
Python's own teardown of all that (module state, garbage, C extension finalizers) takes
about 0.4 s: paid by every command at its end, and by every worker process of the local
multi-process runner, which the runner closes one after another.

:func:`exit_quickly` registers an ``atexit`` handler: when the process ends normally,
Python first joins its threads and runs the other ``atexit`` handlers registered after it
(those of the libraries imported later), then this one flushes the logs and the standard
streams and ends the process with ``os._exit(status())``. When ``status()`` is None the
process ends as Python would end it.

This module imports nothing heavy: the console script imports it before a command starts,
and a library imported then (Beam, gRPC) could start threads that do not block the stop
signals (see ``interrupt.interruptible``).
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
from typing import Callable


def end_now(code: int) -> None:
    """End this process at once with ``code``, its logs and standard streams flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def exit_quickly(status: Callable[[], int | None]) -> None:
    """At the normal end of this process, end it at once with ``status()`` (unless None)."""
    def _end() -> None:
        code = status()
        if code is not None:
            end_now(code)

    atexit.register(_end)
