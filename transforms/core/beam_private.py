"""Where refinery reads or rewrites Beam's private names, each behind one function.

Beam gives no public way to do these things, so this module does them through Beam's
internals, and ``tests/test_beam_private.py`` pins the Beam versions they were checked
against (:data:`CHECKED_BEAM`): a Beam upgrade fails that test first, naming what moved.
(The local runner, ``runners/local_runner.py`` and ``runners/warm_workers.py``, also builds
on Beam's FnApiRunner and SDK worker: through their public names, and in
``local_runner`` through FnApiRunner's worker handlers (its own environments and handlers,
registered with Beam's ``register_urn``/``register_environment``, subclasses of
``GrpcWorkerHandler``, checked against Beam 2.77); ``test_runners``, ``test_warm_workers``
and ``test_local_runner_isolation`` run them.)

- :func:`secure_shared_models`: Beam's shared-model server
  (``apache_beam.utils.multi_process_shared``, used by RunInference to share one model
  between worker processes) authenticates with a fixed key (``b"mps"``) and keeps its
  address files under a predictable name in ``/tmp``: any local user could connect and have
  a pickle unpickled in the server. refinery gives it a random per-driver key and a private
  folder (``transforms/inference/handler.py``).
- :func:`fnapi_environment_major_version`: what Beam's Dataflow client sends as the SDK
  environment version, for the offline ``--dry-run`` job description
  (``runners/translate.py``).
- :func:`dead_letter_error`: what a dead-letter output (``with_exception_handling``, and
  RunInference's ``failed_inferences``) says of the error. Beam documents an error string;
  it gives the exception's type, ``repr`` and formatted traceback, and refinery reads
  ``Type: message`` from them (``transforms/inference/stages.py``: a failed batch's units).
- :func:`fn_api_servers_at`: the gRPC servers Beam's FnApiRunner starts for its SDK workers
  (control, data, state, logging: ``worker_handlers.GrpcServer``) listen on ``[::]:0``,
  every interface of the machine, and take any caller: whoever reaches them can read the
  job (its pickled DoFns) or pose as a worker. The local runner has them listen on unix
  sockets in a folder only its user can enter (``runners/local_runner.py``).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

CHECKED_BEAM = ("2.77",)  # major.minor versions of apache-beam these functions were checked against


def secure_shared_models(secret: bytes, folder: str) -> None:
    """Make this process's shared-model server (client and server side) authenticate with
    ``secret`` and keep its address and lock files in ``folder``."""
    from apache_beam.utils import multi_process_shared

    multi_process_shared.AUTH_KEY = secret
    _shared_model_defaults()["path"] = folder


def _shared_model_defaults() -> dict[str, Any]:
    """The keyword defaults of ``MultiProcessShared.__init__`` (where its ``path`` is)."""
    from apache_beam.utils import multi_process_shared

    defaults = multi_process_shared.MultiProcessShared.__init__.__kwdefaults__
    if defaults is None:
        raise RuntimeError(f"apache_beam's MultiProcessShared has no keyword defaults (checked: {CHECKED_BEAM})")
    return defaults


def shared_models_setting() -> tuple[bytes, str]:
    """(key, folder) the shared-model server of this process uses now."""
    from apache_beam.utils import multi_process_shared

    return multi_process_shared.AUTH_KEY, _shared_model_defaults()["path"]


def fnapi_environment_major_version() -> str:
    """The SDK environment major version Beam's Dataflow client puts in a job description."""
    from apache_beam.runners.dataflow.internal import apiclient

    version: str = apiclient._FNAPI_ENVIRONMENT_MAJOR_VERSION
    return version


def dead_letter_error(error: tuple[type[BaseException], str, list[str] | None]) -> str:
    """``Type: message`` of the error part of a dead-letter element ``(input, error)``.
    Checked against Beam 2.77: ``_ExceptionHandlingWrapperDoFn`` makes it
    ``(type(exn), repr(exn), traceback.format_exception(...))``, whose last line is
    ``[module.]Type: message`` (the message as ``str(exn)`` gives it)."""
    exc_type, exc_repr, traceback_lines = error
    name = exc_type.__name__
    for line in reversed(traceback_lines or []):
        head, sep, message = line.partition(": ")
        if sep and head.rsplit(".", 1)[-1] == name:
            return f"{name}: {message.strip()}"
    return f"{name}: {exc_repr}"


BEAM_ANY_ADDRESS = "[::]:0"  # where worker_handlers.GrpcServer asks each of its servers to listen


@contextlib.contextmanager
def fn_api_servers_at(address: Callable[[], str]) -> Iterator[None]:
    """While inside: each gRPC server that Beam's FnApiRunner starts for its SDK workers
    listens at ``address()`` (called once per server: ``unix:PATH``, or ``HOST:0``) instead
    of :data:`BEAM_ANY_ADDRESS`, and the port Beam records for it is the address a worker
    reaches it at, a str (``unix:PATH`` or ``HOST:PORT``) where Beam has an int. Beam's
    worker handlers would make ``localhost:unix:PATH`` of it: only a handler that passes
    such a port on as it is (``runners/local_runner.py``) may run inside. Checked against
    Beam 2.77: ``GrpcServer.__init__`` calls ``grpc.server(...).add_insecure_port("[::]:0")``
    through the ``grpc`` name of ``worker_handlers``, which this replaces while inside."""
    from apache_beam.runners.portability.fn_api_runner import worker_handlers

    real = worker_handlers.grpc
    worker_handlers.grpc = _GrpcAt(real, address)
    try:
        yield
    finally:
        worker_handlers.grpc = real


class _GrpcAt:
    """The ``grpc`` module as ``worker_handlers`` sees it inside :func:`fn_api_servers_at`."""

    def __init__(self, grpc: Any, address: Callable[[], str]) -> None:
        self._grpc = grpc
        self._address = address

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grpc, name)

    def server(self, *args: Any, **kwargs: Any) -> _ServerAt:
        return _ServerAt(self._grpc.server(*args, **kwargs), self._address)


class _ServerAt:
    """A gRPC server whose :data:`BEAM_ANY_ADDRESS` becomes ``address()`` (see :func:`fn_api_servers_at`)."""

    def __init__(self, server: Any, address: Callable[[], str]) -> None:
        self._server = server
        self._address = address

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)

    def add_insecure_port(self, address: str) -> Any:  # Beam's int port, or where a worker reaches it
        if address != BEAM_ANY_ADDRESS:
            return self._server.add_insecure_port(address)
        where = self._address()
        port = self._server.add_insecure_port(where)
        return where if where.startswith("unix:") else f"{where.rsplit(':', 1)[0]}:{port}"
