"""LocalRunner: how a job of ``--runner local`` or ``--runner direct`` runs.

Beam's DirectRunner first offers a pipeline to Prism, a runner in a separate binary that it
downloads from the internet at first use and starts as a subprocess: on a machine without
internet that try costs about 0.25 s per job, and with it the job runs on another engine
than here. Refinery's pipelines are batch pipelines, which is what Beam's FnApiRunner runs:
:class:`LocalRunner` sets it up as the DirectRunner does for a batch pipeline it runs itself
(the pipeline options reach every worker process) and takes the DirectRunner's flags
(``--direct_running_mode``, ``--direct_num_workers``).

With ``multi_processing`` and a pool of warm workers open in this process
(:func:`refinery.runners.warm_workers.active`), each SDK worker is forked from the pool's
warm process instead of starting a new Python that imports Beam.

With ``multi_processing`` (and Beam's ``multi_threading``: worker threads) the workers
reach the driver through gRPC servers (Beam's control, data, state and logging services,
and the service that prints the worker processes' log lines). Beam would have them listen
on every interface of the machine and take any caller: whoever reaches them can read the
job, its pickled DoFns included, or pose as a worker. Here they listen on unix sockets in a
folder of the temp dir that only this user can enter (:func:`worker_channels`; loopback TCP
where the temp dir's path is too long for a socket name). The worker processes' log lines
print as lines (a unit's failure: one line), not as Beam's log protos
(:func:`worker_log_record`). ``in_memory`` (one worker, or ``--runner direct``) runs its
worker in the driver's thread: no server at all.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import subprocess
import sys
import threading
from typing import Any, Iterator

from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions
from apache_beam.portability.api import beam_fn_api_pb2_grpc, endpoints_pb2
from apache_beam.runners.portability.fn_api_runner import worker_handlers
from apache_beam.runners.runner import PipelineResult, PipelineRunner
from apache_beam.runners.worker.log_handler import LOGENTRY_TO_LOG_LEVEL_MAP
from apache_beam.transforms import environments

from refinery.transforms.io.beam_private import WORKER_SERVER_OPTIONS, fn_api_servers_at, provision_info

from . import warm_workers

_log = logging.getLogger(__name__)

# FnApiRunner warns when in_memory is asked with several workers: with its own environments
# that is what LocalRunner asks for (see run_pipeline), and the warning would be wrong.
_FN_RUNNER_LOG = "apache_beam.runners.portability.fn_api_runner.fn_runner"


class _NoInMemoryWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "direct_running_mode should be" not in record.getMessage()


class LocalRunner(PipelineRunner):
    """Beam's FnApiRunner for a batch pipeline on this machine (see the module's doc)."""

    def run_pipeline(self, pipeline: Any, options: PipelineOptions) -> PipelineResult:
        from apache_beam.runners.portability.fn_api_runner import fn_runner

        info = provision_info(options)
        direct = options.view_as(DirectOptions)
        mode = direct.direct_running_mode
        if mode not in ("multi_processing", "multi_threading"):
            return fn_runner.FnApiRunner(provision_info=info).run_pipeline(pipeline, options)
        # Workers that reach the driver over worker_channels(): processes started by
        # LocalWorkerHandler (the pool's attach command, or Beam's worker as FnApiRunner
        # starts it), or threads of this process. FnApiRunner would replace this environment
        # with its own for either mode: it is asked for in_memory with the same number of
        # workers (the workers received the options as given, above).
        env: environments.Environment
        if mode == "multi_processing":
            pool = warm_workers.active()
            env = LocalWorkerEnvironment.from_command_string(pool.worker_command() if pool else worker_main_command())
        else:
            env = LocalThreadsEnvironment.default()
        quiet = _NoInMemoryWarning()
        logging.getLogger(_FN_RUNNER_LOG).addFilter(quiet)
        direct.direct_running_mode = "in_memory"
        try:
            with worker_channels():
                return fn_runner.FnApiRunner(default_environment=env, provision_info=info).run_pipeline(pipeline,
                                                                                                      options)
        finally:
            direct.direct_running_mode = mode
            logging.getLogger(_FN_RUNNER_LOG).removeFilter(quiet)


def worker_main_command() -> str:
    """Beam's SDK worker as a new Python process (what FnApiRunner runs for multi_processing)."""
    return f"{shlex.quote(sys.executable)} -m {warm_workers.WORKER_MAIN}"


# ---------------------------------------------------------------------------------------
# The workers' channels to the driver
# ---------------------------------------------------------------------------------------

LOCAL_WORKER_URN = "refinery:env:local_worker:v1"    # LocalWorkerEnvironment: processes
LOCAL_THREADS_URN = "refinery:env:local_threads:v1"  # LocalThreadsEnvironment: threads (multi_threading)
BEAM_WORKER_LOG = "apache_beam.worker"  # the driver's logger for lines logged by Beam in a worker
WORKER_LOG = "refinery.worker"          # ... and for every other line of a worker


def worker_log_record(level: int, message: str, trace: str, location: str) -> tuple[str, int, str]:
    """(logger name, level, text) for a log line of a worker process (a ``LogEntry`` that
    the worker sent: its level, message, traceback if any, ``PATH:LINE`` where it was
    logged): its message, then its traceback; on :data:`BEAM_WORKER_LOG` if Beam logged it
    (so the driver's level for ``apache_beam`` applies), else on :data:`WORKER_LOG`. A
    unit's failure is one line (``execute_unit`` logs its type and message; the traceback is
    in the unit's receipt)."""
    beam = f"{os.sep}apache_beam{os.sep}" in location or location.startswith(f"apache_beam{os.sep}")
    text = message + (f"\n{trace.rstrip()}" if trace else "")
    return (BEAM_WORKER_LOG if beam else WORKER_LOG), level, text


def worker_environment(base: dict[str, str], control: str, logging_url: str, pipeline_options: str,
                       worker_id: str) -> dict[str, str]:
    """The environment of an SDK worker process (what Beam's ``sdk_worker_main`` reads):
    ``base`` with the driver's control and logging addresses, the pipeline options (JSON) and
    the worker's id."""
    from google.protobuf import text_format

    def descriptor(url: str) -> str:
        text: str = text_format.MessageToString(endpoints_pb2.ApiServiceDescriptor(url=url))
        return text

    return {**base, "CONTROL_API_SERVICE_DESCRIPTOR": descriptor(control),
            "LOGGING_API_SERVICE_DESCRIPTOR": descriptor(logging_url), "PIPELINE_OPTIONS": pipeline_options,
            "WORKER_ID": worker_id}


class _WorkerLogs(beam_fn_api_pb2_grpc.BeamFnLoggingServicer):
    """The driver's end of the workers' log lines: each logged here (see :func:`worker_log_record`)."""

    def Logging(self, request_iterator: Iterator[Any], context: Any = None) -> Iterator[Any]:  # noqa: N802 - Beam's
        for batch in request_iterator:
            for entry in batch.log_entries:
                name, level, text = worker_log_record(LOGENTRY_TO_LOG_LEVEL_MAP.get(entry.severity, logging.INFO),
                                                      entry.message, entry.trace, entry.log_location)
                logging.getLogger(name).log(level, "%s", text)
        return iter(())


class WorkerChannels:
    """Where a job's workers reach the driver: unix sockets in ``folder`` (see
    :func:`worker_channels`), and the service that takes their log lines."""

    def __init__(self, folder: str):
        import grpc
        from apache_beam.utils import thread_pool_executor

        self.folder = folder
        self._n = 0
        self._lock = threading.Lock()
        # Beam's servers' ping options (WORKER_SERVER_OPTIONS): with gRPC's defaults this server
        # would answer the workers' keepalive pings with GOAWAY too_many_pings
        self._log_server = grpc.server(thread_pool_executor.shared_unbounded_instance(),
                                       options=list(WORKER_SERVER_OPTIONS))
        beam_fn_api_pb2_grpc.add_BeamFnLoggingServicer_to_server(_WorkerLogs(), self._log_server)
        where = self.next_address()
        port = self._log_server.add_insecure_port(where)
        self.log_url = where if where.startswith("unix:") else f"127.0.0.1:{port}"
        self._log_server.start()

    def next_address(self) -> str:
        """A new address for a server: ``unix:FOLDER/N.sock``, or ``127.0.0.1:0`` (any free
        loopback port) where that path would be too long for a socket."""
        with self._lock:
            self._n += 1
            path = os.path.join(self.folder, f"{self._n}.sock")
        if len(os.fsencode(path)) <= warm_workers.SOCKET_PATH_MAX:
            return f"unix:{path}"
        if self._n == 1:
            _log.warning("worker channels on loopback TCP, not unix sockets: the temp dir's path is too long for "
                         "a socket (%s; set TMPDIR to a shorter one)", self.folder)
        return "127.0.0.1:0"

    def close(self) -> None:
        """Stop the log service once the log lines still coming in are printed."""
        self._log_server.stop(5).wait()


_channels: WorkerChannels | None = None


@contextlib.contextmanager
def worker_channels() -> Iterator[WorkerChannels]:
    """While inside: the gRPC servers of a job on FnApiRunner with :class:`LocalWorkerEnvironment`
    or :class:`LocalThreadsEnvironment` listen in a new private folder
    (:func:`~refinery.runners.warm_workers.private_folder`), removed at the end."""
    global _channels
    folder = warm_workers.private_folder()
    try:
        channels = WorkerChannels(folder)
        try:
            with fn_api_servers_at(channels.next_address):
                _channels = channels
                yield channels
        finally:
            _channels = None
            channels.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@environments.Environment.register_urn(LOCAL_WORKER_URN, bytes)
class LocalWorkerEnvironment(environments.SubprocessSDKEnvironment):
    """Worker processes started by a command, as Beam's SubprocessSDKEnvironment, but run by
    :class:`LocalWorkerHandler` (their own urn)."""

    def to_runner_api_parameter(self, context: Any) -> tuple[str, Any]:
        return LOCAL_WORKER_URN, super().to_runner_api_parameter(context)[1]

    @staticmethod
    def from_runner_api_parameter(payload: bytes, capabilities: Any, artifacts: Any, resource_hints: Any,
                                  context: Any) -> LocalWorkerEnvironment:
        return LocalWorkerEnvironment(payload.decode("utf-8"), capabilities, artifacts, resource_hints)


@environments.Environment.register_urn(LOCAL_THREADS_URN, bytes)
class LocalThreadsEnvironment(environments.EmbeddedPythonGrpcEnvironment):
    """Worker threads of this process that reach it over gRPC, as Beam's
    EmbeddedPythonGrpcEnvironment (``multi_threading``), but run by :class:`LocalThreadsHandler`."""

    def to_runner_api_parameter(self, context: Any) -> tuple[str, Any]:
        return LOCAL_THREADS_URN, super().to_runner_api_parameter(context)[1]

    @staticmethod
    def from_runner_api_parameter(payload: bytes, capabilities: Any, artifacts: Any, resource_hints: Any,
                                  context: Any) -> LocalThreadsEnvironment:
        config = environments.EmbeddedPythonGrpcEnvironment.parse_config(payload.decode("utf-8")) if payload else {}
        return LocalThreadsEnvironment(  # type: ignore[no-untyped-call]  # the __init__ is Beam's, unannotated
            config.get("state_cache_size"), config.get("data_buffer_time_limit_ms"), capabilities, artifacts,
            resource_hints)


def _channels_now() -> WorkerChannels:
    if _channels is None:
        raise RuntimeError("refinery's local worker environments run only inside worker_channels()")
    return _channels


# Built on Beam 2.77's GrpcWorkerHandler: inside worker_channels(), the ports of its server are
# the addresses its workers reach them at (strs), which port_from_worker passes on as they are.

@worker_handlers.WorkerHandler.register_environment(LOCAL_WORKER_URN, bytes)
class LocalWorkerHandler(worker_handlers.GrpcWorkerHandler):
    """One worker process of :class:`LocalWorkerEnvironment`, given the addresses of the job's
    :class:`WorkerChannels`."""

    def __init__(self, command: bytes, state: Any, provision_info: Any, grpc_server: Any) -> None:
        self._channels = _channels_now()
        super().__init__(state, provision_info, grpc_server)
        self._command = command.decode("utf-8")
        self._process: subprocess.Popen[bytes] | None = None

    def port_from_worker(self, port: Any) -> str:
        return port if isinstance(port, str) else super().port_from_worker(port)

    def logging_api_service_descriptor(self) -> endpoints_pb2.ApiServiceDescriptor:
        return endpoints_pb2.ApiServiceDescriptor(url=self._channels.log_url)

    def start_worker(self) -> None:
        from google.protobuf import json_format

        options = json_format.MessageToJson(self.provision_info.provision_info.pipeline_options)
        env = worker_environment(dict(os.environ), self.control_address, self._channels.log_url, options,
                                 self.worker_id)
        self._process = subprocess.Popen(shlex.split(self._command), env=env)

    def stop_worker(self) -> None:
        """Wait for the worker process, told to stop (its control stream ended), to end: one
        that has not ended :func:`worker_stop_s` later is ended (:func:`end_process`)."""
        if self._process is not None and (status := end_process(self._process, self.worker_id, worker_stop_s())):
            _log.error("worker process %s (%s) exited with status %s", self._process.pid, self.worker_id, status)


WORKER_STOP_S = 30.0  # how long a worker told to stop may take to end (REFINERY_WORKER_STOP_S)
WORKER_KILL_S = 5.0   # ... and then to end after SIGTERM, before SIGKILL


def worker_stop_s() -> float:
    """Seconds a worker process told to stop may take to end: ``$REFINERY_WORKER_STOP_S``, or
    :data:`WORKER_STOP_S`. A worker has sent all its results before it is told to stop."""
    raw = os.environ.get("REFINERY_WORKER_STOP_S", "")
    try:
        return max(0.0, float(raw)) if raw else WORKER_STOP_S
    except ValueError:
        raise ValueError(f"REFINERY_WORKER_STOP_S={raw!r}: not a number of seconds") from None


def end_process(process: subprocess.Popen[bytes], name: str, grace_s: float) -> int:
    """``process``'s exit status once it has ended: waited for up to ``grace_s``, then sent
    SIGTERM (the pool's attach command ends its forked worker with it) and, after
    :data:`WORKER_KILL_S` more, SIGKILL; one line says so. Its status is then the signal's."""
    try:
        return process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    _log.warning("worker process %s (%s) had not ended %.0f s after its job's end: ending it", process.pid, name,
                 grace_s)
    process.terminate()
    try:
        process.wait(timeout=WORKER_KILL_S)
    except subprocess.TimeoutExpired:
        process.kill()
    process.wait()
    return 0  # the job had ended: a worker ended here is not a failure


@worker_handlers.WorkerHandler.register_environment(LOCAL_THREADS_URN, bytes)
class LocalThreadsHandler(worker_handlers.EmbeddedGrpcWorkerHandler):
    """One worker thread of :class:`LocalThreadsEnvironment` (it logs in this process)."""

    def __init__(self, payload: bytes, state: Any, provision_info: Any, grpc_server: Any) -> None:
        _channels_now()
        super().__init__(payload, state, provision_info, grpc_server)

    def port_from_worker(self, port: Any) -> str:
        return port if isinstance(port, str) else super().port_from_worker(port)
