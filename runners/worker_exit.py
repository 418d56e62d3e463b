"""Imported first by every worker process of the local multi-process runner (Beam's
``--beam_plugins``, set by :func:`refinery.runners.local.local_args`): such a process ends
as soon as Beam's harness returns, without the interpreter's teardown (see
:mod:`refinery.runners.quick_exit`). All its results were sent and its receipts written
before the harness returned. Its exit status stays: 1 after an uncaught exception, else 0.

Only Beam's worker entry point is affected; imported anywhere else this does nothing.
"""
from __future__ import annotations

import sys
from types import TracebackType

from refinery.runners.quick_exit import exit_quickly

WORKER_MAIN = "apache_beam.runners.worker.sdk_worker_main"

_failed = False
_previous_hook = sys.excepthook


def _note_failure(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    global _failed
    _failed = True
    _previous_hook(exc_type, exc, tb)


def in_worker() -> bool:
    """Whether this process is running Beam's SDK worker as its main module."""
    main = sys.modules.get("__main__")
    return getattr(getattr(main, "__spec__", None), "name", None) == WORKER_MAIN


if in_worker():
    sys.excepthook = _note_failure
    exit_quickly(lambda: 1 if _failed else 0)
