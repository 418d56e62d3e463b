"""What a finished portable job's SDK worker says as its data channel is hung up: held back,
and said only if the job failed.

When a portable runner (Flink above all) ends a job, it closes the data plane of the SDK
workers that run in this process (LOOPBACK); their reader threads then see gRPC's
``CANCELLED`` ("Multiplexer hanging up"). Beam logs that as ``ERROR ... Failed to read inputs
in the data plane`` with its traceback, and the threads end with more tracebacks, after a job
that succeeded. :func:`held_shutdown_noise` holds exactly those (a ``CANCELLED`` gRPC error,
logged by Beam's data plane or ending a thread) while a job runs: dropped when the job
succeeds, said as they were when it fails. Every other error passes at once.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Iterator

DATA_PLANE_LOGGER = "apache_beam.runners.worker.data_plane"


def is_cancelled(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a gRPC error with status ``CANCELLED`` (a hung-up stream)."""
    code = getattr(exc, "code", None)
    if exc is None or not callable(code):
        return False
    try:
        import grpc

        return isinstance(exc, grpc.RpcError) and code() == grpc.StatusCode.CANCELLED
    except Exception:  # noqa: BLE001 - a stream error that cannot even say its code is not the known noise
        return False


@contextlib.contextmanager
def held_shutdown_noise() -> Iterator[None]:
    """While the body runs, hold the data plane's ``CANCELLED`` log records and the threads
    ending on a ``CANCELLED`` error; after it, drop them if it returned, say them (through the
    logger's handlers and the previous thread excepthook) if it raised."""
    records: list[logging.LogRecord] = []
    threads: list[Any] = []
    logger = logging.getLogger(DATA_PLANE_LOGGER)

    class _Hold(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if record.exc_info and is_cancelled(record.exc_info[1]):
                records.append(record)
                return False
            return True

    hold = _Hold()
    previous = threading.excepthook

    def hook(args: Any) -> None:
        if is_cancelled(args.exc_value):
            threads.append(args)
        else:
            previous(args)

    logger.addFilter(hold)
    threading.excepthook = hook
    failed = True
    try:
        yield
        failed = False
    finally:
        logger.removeFilter(hold)
        if threading.excepthook is hook:
            threading.excepthook = previous
        if failed:  # the job failed: what its workers said may be why
            for record in records:
                logger.handle(record)
            for args in threads:
                previous(args)
