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
- :func:`loopback_worker_pool_at`, :func:`worker_pool_on`: the worker pool Beam's
  PortableRunner starts in this process for a LOOPBACK environment (``--runner prism``,
  ``portable`` with a job server, ``flink`` on an embedded Flink) listens on every interface
  and runs the code of whoever asks it to start a worker. refinery has it listen on loopback
  behind a check that refuses another user's calls (``runners/same_user.py``); the local
  Flink cluster's pool process is the same (``runners/worker_pool.py``).
- :func:`setup_builds_captured`: Beam's stager builds the ``--setup_file`` sdist in a child
  process whose stderr is this process's: every Dataflow ``--dry-run`` would print build's
  progress (``* Building sdist...``). refinery captures it with the child's stdout, which Beam
  reports when the build fails (``runners/translate.py``).
- :data:`WORKER_SERVER_OPTIONS`, :func:`worker_keepalive_ms`, :func:`set_worker_keepalive_ms`:
  Beam's SDK workers ping their channels every ``grpc.keepalive_time_ms`` (20 s), with no
  limit on pings without data (``GRPCChannelFactory.DEFAULT_OPTIONS``). A gRPC server with
  gRPC's defaults (at least 5 minutes between such pings, 2 strikes) answers the third with
  ``GOAWAY too_many_pings``; Beam's worker logging client then reconnects and its old call's
  request thread takes one more entry off the queue, which can be the end-of-stream marker:
  the worker never ends (a finished decon waited 13 minutes for it). A server the workers
  reach takes these options, the ones Beam's own ``GrpcServer`` passes.
- :func:`provision_info`, :func:`flink_job_server`, :func:`shared_subprocess_servers`,
  :func:`beam_runner_names`, :func:`beam_option_flags`: the local runner's provision info,
  Flink's job server with its endpoint, subprocess servers shared by a command's jobs, the
  runner names Beam knows, every option's flag.
- :func:`parser_actions`, :func:`option_flags`, :func:`subcommands`: argparse's private parts
  (a parser's actions, its flags, its subcommand groups), for the commands' checks and help.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

if TYPE_CHECKING:
    from apache_beam.options.pipeline_options import PipelineOptions

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


#: The options of a gRPC server Beam's SDK workers reach (Beam 2.77's ``GrpcServer`` passes
#: these, less its message sizes): any number of pings without data, no strikes, and pings as
#: often as the workers' keepalive (see the module's doc).
WORKER_SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 20_000),
)
_KEEPALIVE = "grpc.keepalive_time_ms"


def worker_keepalive_ms() -> int:
    """How often (ms) the channels of an SDK worker in this process ping: Beam's
    ``GRPCChannelFactory.DEFAULT_OPTIONS``."""
    from apache_beam.runners.worker.channel_factory import GRPCChannelFactory

    return int(dict(GRPCChannelFactory.DEFAULT_OPTIONS)[_KEEPALIVE])


def set_worker_keepalive_ms(ms: int) -> None:
    """Make the channels an SDK worker of this process opens from now on ping every ``ms``
    (for tests: a short period shows in seconds what a long run shows in minutes)."""
    from apache_beam.runners.worker.channel_factory import GRPCChannelFactory

    options = GRPCChannelFactory.DEFAULT_OPTIONS
    if _KEEPALIVE not in dict(options):
        raise RuntimeError(f"apache_beam's GRPCChannelFactory sets no {_KEEPALIVE} (checked: {CHECKED_BEAM})")
    options[:] = [(k, ms if k == _KEEPALIVE else v) for k, v in options]


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


@contextlib.contextmanager
def loopback_worker_pool_at(host: str, interceptors: Sequence[Any]) -> Iterator[None]:
    """While inside: the worker pool Beam's PortableRunner starts in this process for a
    LOOPBACK environment (``BeamFnExternalWorkerPoolServicer.start``, which listens on
    ``[::]``, every interface, and takes any caller) listens on ``host`` only, behind
    ``interceptors`` (gRPC server interceptors: ``runners/same_user.py`` refuses another
    user's calls), and is reached at ``host:PORT``. Checked against Beam 2.77:
    ``PortableRunner.start_and_replace_loopback_environments`` calls
    ``worker_pool_main.BeamFnExternalWorkerPoolServicer.start(state_cache_size=...,
    data_buffer_time_limit_ms=..., use_process=...)`` and uses the ``(address, server)`` it
    returns; this replaces that classmethod while inside (what it does besides listening,
    the pool's servicer and its worker processes' clean-up at exit, is done as Beam does)."""
    from apache_beam.runners.worker import worker_pool_main

    pool = worker_pool_main.BeamFnExternalWorkerPoolServicer
    real = pool.__dict__["start"]

    def start(cls: Any, use_process: bool = False, port: int = 0, state_cache_size: int = 0,
              data_buffer_time_limit_ms: int = -1, container_executable: str | None = None) -> tuple[str, Any]:
        return worker_pool_on(host, port, interceptors, cls(
            use_process=use_process, container_executable=container_executable, state_cache_size=state_cache_size,
            data_buffer_time_limit_ms=data_buffer_time_limit_ms))

    pool.start = classmethod(start)  # type: ignore[method-assign, assignment]  # Beam's untyped classmethod
    try:
        yield
    finally:
        pool.start = real  # type: ignore[method-assign]  # Beam's untyped classmethod, put back


def worker_pool_on(host: str, port: int, interceptors: Sequence[Any], servicer: Any) -> tuple[str, Any]:
    """(``host:PORT``, started gRPC server) of Beam's worker pool ``servicer`` (a
    ``BeamFnExternalWorkerPoolServicer``) listening at ``host:port`` (0: a free port) behind
    ``interceptors``, with Beam's server options and its clean-up of the pool's worker
    processes at exit (as ``BeamFnExternalWorkerPoolServicer.start`` of Beam 2.77 does)."""
    import atexit

    import grpc
    from apache_beam.portability.api import beam_fn_api_pb2_grpc
    from apache_beam.runners.worker import worker_pool_main
    from apache_beam.utils import thread_pool_executor

    server = grpc.server(thread_pool_executor.shared_unbounded_instance(), options=list(WORKER_SERVER_OPTIONS),
                         interceptors=list(interceptors))
    bound = server.add_insecure_port(f"{host}:{port}")
    beam_fn_api_pb2_grpc.add_BeamFnExternalWorkerPoolServicer_to_server(servicer, server)
    server.start()

    def kill_worker_processes() -> None:
        for process in servicer._worker_processes.values():
            worker_pool_main.kill_process_gracefully(process)

    atexit.register(kill_worker_processes)
    return f"{host}:{bound}", server


@contextlib.contextmanager
def setup_builds_captured() -> Iterator[None]:
    """While inside: the sdist Beam's stager builds from ``--setup_file`` (``python -m build
    --sdist``, or ``setup.py sdist`` when that fails) has its stderr captured with its stdout
    instead of written to this process's stderr (build's ``* Building sdist...`` progress). A
    failed build still says everything: Beam raises RuntimeError with the captured output.
    Checked against Beam 2.77: ``Stager._build_setup_package`` calls
    ``processes.check_output(build_setup_args)`` without ``stderr`` through the ``processes``
    name of ``stager``, which this replaces while inside (its other calls pass ``stderr``)."""
    from apache_beam.runners.portability import stager

    real = stager.processes
    stager.processes = _StderrCaptured(real)  # type: ignore[assignment]  # a stand-in for the module
    try:
        yield
    finally:
        stager.processes = real


class _StderrCaptured:
    """Beam's ``processes`` module as ``stager`` sees it inside :func:`setup_builds_captured`."""

    def __init__(self, processes: Any) -> None:
        self._processes = processes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._processes, name)

    def check_output(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("stderr", self._processes.STDOUT)
        return self._processes.check_output(*args, **kwargs)


# ---------------------------------------------------------------------------------------
# Beam's job plumbing: the local runner's provision info, Flink's job server, shared
# subprocess servers, runner names, every option's flag
# ---------------------------------------------------------------------------------------

def provision_info(options: PipelineOptions) -> Any:
    """What Beam's FnApiRunner hands its SDK workers (``fn_runner.ExtendedProvisionInfo``),
    holding ``options`` encoded as a portable runner encodes them
    (``JobServiceHandle.encode_pipeline_options``): the local runner's workers then see the
    command's options. Neither is public in Beam 2.77."""
    from apache_beam.portability.api import beam_provision_api_pb2
    from apache_beam.runners.portability.fn_api_runner import fn_runner
    from apache_beam.runners.portability.portable_runner import JobServiceHandle

    encoded = JobServiceHandle.encode_pipeline_options(options.get_all_options())
    return fn_runner.ExtendedProvisionInfo(beam_provision_api_pb2.ProvisionInfo(pipeline_options=encoded))


def flink_job_server(options: PipelineOptions) -> Any:
    """Beam's Flink job server (``FlinkJarJobServer``) for ``options``, not started: after
    ``start()`` its ``endpoint`` says where its job service listens (Beam's ``start()`` returns
    a gRPC stub and keeps the address to itself; the class below records what its
    ``subprocess_cmd_and_endpoint`` chose)."""
    return _flink_job_server_class()(options)


@functools.lru_cache(maxsize=1)
def _flink_job_server_class() -> type:
    """Made once, on first use: Beam's Flink runner module is not imported before."""
    from apache_beam.runners.portability.flink_runner import FlinkJarJobServer

    class FlinkJobServer(FlinkJarJobServer):
        endpoint: str | None = None

        def subprocess_cmd_and_endpoint(self) -> tuple[list[str], str]:
            cmd, self.endpoint = super().subprocess_cmd_and_endpoint()  # type: ignore[no-untyped-call]  # Beam's, unannotated
            return cmd, self.endpoint

    return FlinkJobServer


def shared_subprocess_servers() -> contextlib.AbstractContextManager[None]:
    """While inside, the subprocess servers Beam starts (a job server, an expansion service)
    are shared by the jobs started and stopped at the end, as ``with pipeline`` does
    (``SubprocessServer.cache_subprocesses``, a classmethod Beam uses internally)."""
    from apache_beam.utils.subprocess_server import SubprocessServer

    return SubprocessServer.cache_subprocesses()


def beam_runner_names() -> frozenset[str]:
    """The lower-case runner names Beam resolves by itself (``flinkrunner``, ``prismrunner``...:
    the keys of ``apache_beam.runners.runner._RUNNER_MAP``)."""
    from apache_beam.runners.runner import _RUNNER_MAP

    return frozenset(_RUNNER_MAP)


def beam_option_flags() -> frozenset[str]:
    """Every ``--flag`` of every Beam ``PipelineOptions`` class known now (each class adds its
    flags through its ``_add_argparse_args``)."""
    from apache_beam.options import pipeline_options as po

    parser = argparse.ArgumentParser(add_help=False, conflict_handler="resolve")
    todo, seen = [po.PipelineOptions], set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo += cls.__subclasses__()
        with contextlib.suppress(Exception):
            cls._add_argparse_args(parser)  # type: ignore[arg-type]  # Beam's own parser subclass adds nothing needed here
    return frozenset(s for s in option_flags(parser) if s.startswith("--"))


# ---------------------------------------------------------------------------------------
# argparse's private parts: a parser's actions and flags, its subcommands
# ---------------------------------------------------------------------------------------

def parser_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The actions of ``parser``, in the order they were added (``parser._actions``)."""
    return list(parser._actions)


def option_flags(parser: argparse.ArgumentParser) -> frozenset[str]:
    """Every option string ``parser`` takes (``--num-shards``, ``-h``...: ``_option_string_actions``)."""
    return frozenset(parser._option_string_actions)


def subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, dict[str, argparse.ArgumentParser]]]:
    """(dest, {name: subparser}) of each subcommand group of ``parser`` (``_SubParsersAction``)."""
    return [(a.dest, dict(a.choices)) for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
