"""Warm workers: SDK worker processes of the local runner forked from a process that has
already imported Beam and refinery, instead of new Pythons that import them.

A worker of Beam's multi-process runner is a new Python process: before it runs anything
it imports Beam (about 1.2 s of CPU here), then refinery's modules and the tokenizer. A job
waits for that, after the driver has paid the same imports itself. A command that will run
on the local runner with several workers opens a pool (:func:`pool`) as it starts: a warm
process (``python -m refinery.runners.warm_workers serve``) imports all of that while the
driver imports and plans, on another core. When the job asks for a worker, the runner starts
the pool's small attach command (:meth:`Pool.worker_command`), which hands the worker's
environment (Beam's control address, pipeline options, worker id) to the warm process; it
forks, and the child runs Beam's ``sdk_worker_main`` at once. The attach command waits and
exits with the worker's status, so the runner sees an ordinary worker process.

The warm process forks only from its one thread, before anything in it has started a
thread or a gRPC channel. It ends when the driver closes the pool or dies (its stdin is a
pipe from the driver); its children end when it does (``PR_SET_PDEATHSIG``). When the pool
cannot be reached, the attach command becomes an ordinary worker (``exec`` of Beam's
``sdk_worker_main``): the job runs either way. ``REFINERY_WARM_WORKERS=0`` turns the pool off.

The pool's socket, like the sockets a job's workers reach the driver through
(:mod:`.local_runner`), lies in a folder of the temp dir that only this user can enter
(:func:`private_folder`), named for the process that owns it (pid and start time): a run
killed with SIGKILL cannot remove its folders, and the next run removes those whose owner
is gone (:func:`remove_dead_folders`).

This module imports no Beam unless it serves: the attach command must start in milliseconds.
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Callable, Iterator

from refinery.runners.quick_exit import end_now
from refinery.transforms.io.beam_import import import_beam

from .args import value
from .local import is_direct

MODULE = "refinery.runners.warm_workers"
WORKER_MAIN = "apache_beam.runners.worker.sdk_worker_main"
# What every warm process imports: Beam's worker and the per-unit machinery of every step.
BASE_PRELOAD = (WORKER_MAIN, "refinery.transforms.resumable.beam_steps")
_PR_SET_PDEATHSIG = 1
SOCKET_PATH_MAX = 103  # bytes of a unix socket's path (Linux allows 107, macOS 103)

_active: "Pool | None" = None


class Pool:
    """A warm process and the socket its workers are asked for through (see the module)."""

    def __init__(self, preload: tuple[str, ...] = ()):
        self.dir = private_folder()
        self.socket = os.path.join(self.dir, "pool.sock")
        if len(os.fsencode(self.socket)) > SOCKET_PATH_MAX:
            os.rmdir(self.dir)
            raise OSError(f"{self.socket}: too long a path for a unix socket (set TMPDIR to a shorter one)")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", MODULE, "serve", self.socket, *BASE_PRELOAD, *preload],
            stdin=subprocess.PIPE)

    def worker_command(self) -> str:
        """The shell command Beam runs for each worker (the attach command)."""
        return f"{shlex.quote(sys.executable)} -m {MODULE} attach {shlex.quote(self.socket)}"

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:  # a pipe
                self.proc.stdin.close()  # the warm process's lifeline: it exits at EOF
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def active() -> Pool | None:
    """The pool open in this process (the local runner's jobs fork their workers from it)."""
    return _active


def wanted(beam_args: list[str]) -> bool:
    """Whether ``beam_args`` run jobs on the local runner with several worker processes (and
    ``REFINERY_WARM_WORKERS`` is not ``0``)."""
    return (os.environ.get("REFINERY_WARM_WORKERS", "1") != "0" and is_direct(beam_args)
            and value(beam_args, "--direct_running_mode") == "multi_processing")


@contextlib.contextmanager
def pool(beam_args: list[str], preload: tuple[str, ...] = ()) -> Iterator[Pool | None]:
    """A pool for the jobs run inside the block when :func:`wanted`, else None. ``preload``:
    more modules the warm process imports. It imports them before the command has set up
    its environment: a module whose import reads an environment variable the command sets
    does not belong here."""
    global _active
    remove_dead_folders()  # every run: what killed runs left, even if this one needs no pool
    if not wanted(beam_args) or _active is not None:
        yield None
        return
    try:
        _active = Pool(preload)
    except OSError as e:  # no pool: Beam starts its workers as usual
        import logging

        logging.getLogger("refinery").info("no warm workers (%s: %s)", type(e).__name__, e)
        yield None
        return
    try:
        yield _active
    finally:
        p, _active = _active, None
        p.close()


# ---------------------------------------------------------------------------------------
# Folders in the temp dir
# ---------------------------------------------------------------------------------------

FOLDER_PREFIX = "refinery-workers-"
# refinery-workers-PID-START-XXXXXXXX: the owner's pid and start time ("0": unknown), mkdtemp's suffix
FOLDER_NAME = re.compile(r"^refinery-workers-(?P<pid>\d+)-(?P<start>\d+)-[A-Za-z0-9_]+$")
# refinery-workers-XXXXXXXX: the form before the owner was named (removed by age and use)
OLD_FOLDER_NAME = re.compile(r"^refinery-workers-[A-Za-z0-9_]{8}$")
OLD_FOLDER_AGE_S = 600.0


def process_started(pid: int) -> str | None:
    """When process ``pid`` started (Linux: clock ticks since boot, ``/proc/PID/stat``), or
    ``"0"`` where that cannot be read; None if no such process runs (a zombie is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return None if fields[0] in (b"Z", b"X") else fields[19].decode()
    except FileNotFoundError:
        if os.path.exists("/proc/self/stat"):
            return None
    except (OSError, IndexError):
        return "0"
    try:  # no /proc: whether the pid runs
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return "0"


def private_folder() -> str:
    """A new folder in the temp dir that only this user can enter (0700), named for this
    process (see :data:`FOLDER_NAME`); the caller removes it. Folders of dead owners are
    removed first."""
    remove_dead_folders()
    pid = os.getpid()
    return tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{pid}-{process_started(pid) or 0}-")


def folder_owner_gone(name: str, started: Callable[[int], str | None]) -> bool:
    """Whether the folder ``name`` (:data:`FOLDER_NAME`) belongs to a process that is gone:
    ``started(pid)`` (see :func:`process_started`) says no such process runs, or one that
    started at another time (the pid was reused). Any other name: False."""
    m = FOLDER_NAME.match(name)
    if m is None:
        return False
    now = started(int(m["pid"]))
    return now is None or ("0" not in (now, m["start"]) and now != m["start"])


def _bound_unix_sockets() -> str | None:
    """``/proc/net/unix`` (the unix sockets bound in this network namespace), or None."""
    try:
        with open("/proc/net/unix") as f:
            return f.read()
    except OSError:
        return None


def _old_folder_unused(path: str, age_s: float) -> bool:
    """A folder of the old form: unchanged for ``age_s`` and no socket bound in it."""
    bound = _bound_unix_sockets()
    with contextlib.suppress(OSError):
        return bound is not None and time.time() - os.stat(path).st_mtime > age_s and f" {path}/" not in bound
    return False


def remove_dead_folders(root: str | None = None) -> list[str]:
    """Remove this user's folders of :func:`private_folder` under ``root`` (the temp dir)
    whose owner is gone (:func:`folder_owner_gone`), and old-form ones unused for
    :data:`OLD_FOLDER_AGE_S`; returns their paths."""
    root = root or tempfile.gettempdir()
    removed: list[str] = []
    try:
        entries = [e for e in os.scandir(root) if e.name.startswith(FOLDER_PREFIX)]
    except OSError:
        return removed
    for e in entries:
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if not (e.is_dir(follow_symlinks=False) and st.st_uid == os.getuid()):
            continue
        if folder_owner_gone(e.name, process_started) or (
                OLD_FOLDER_NAME.match(e.name) and _old_folder_unused(e.path, OLD_FOLDER_AGE_S)):
            shutil.rmtree(e.path, ignore_errors=True)
            removed.append(e.path)
    return removed


# ---------------------------------------------------------------------------------------
# The warm process
# ---------------------------------------------------------------------------------------

def _die_with_parent() -> None:
    """This process gets SIGKILL when its parent ends (Linux; elsewhere nothing)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def serve(socket_path: str, preload: list[str]) -> None:
    """Listen at ``socket_path`` (at once: attach commands wait in its backlog), import
    ``preload``, then fork a worker for each connection until stdin ends; then end."""
    _die_with_parent()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_path)
    server.listen(256)
    import_beam()
    for module in preload:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - a worker imports what it needs itself
            traceback.print_exc()
    while True:
        ready, _, _ = select.select([server, sys.stdin.fileno()], [], [], 1.0)
        _reap()
        if sys.stdin.fileno() in ready and not os.read(sys.stdin.fileno(), 1 << 16):
            _reap(wait_s=2.0)  # workers send their status just before they end
            os._exit(0)  # the driver closed the pool, or died: nothing to tear down (see quick_exit)
        if server in ready:
            conn, _ = server.accept()
            if os.fork() == 0:
                server.close()
                _run_worker(conn)  # never returns
            conn.close()


def _reap(wait_s: float = 0.0) -> None:
    """Collect the workers that ended, and wait up to ``wait_s`` for the others (their peak
    RSS then counts in this process's ``RUSAGE_CHILDREN``, and in the driver's once it
    collects this one)."""
    deadline = time.monotonic() + wait_s
    with contextlib.suppress(ChildProcessError):  # no child left
        while True:
            if not os.waitpid(-1, os.WNOHANG)[0]:
                if time.monotonic() >= deadline:
                    return
                time.sleep(0.01)


def _run_worker(conn: socket.socket) -> None:
    """In a forked child: take the worker's environment from ``conn``, run Beam's SDK worker,
    send its exit status back and end (no interpreter teardown: see ``quick_exit``)."""
    status = 1
    try:
        _die_with_parent()
        conn.sendall(f"pid {os.getpid()}\n".encode())  # the attach command ends this worker with itself
        env = json.loads(_Lines(conn).next())
        os.environ.clear()
        os.environ.update(env)
        keepalive_override(env)
        importlib.import_module(WORKER_MAIN).main([])
        status = 0
    except BaseException:  # noqa: BLE001 - reported through the status, like a worker process's
        traceback.print_exc()
    finally:
        with contextlib.suppress(OSError):
            conn.sendall(f"{status}\n".encode())
        end_now(status)


class _Lines:
    """The lines a socket receives, one at a time (a line's end may come with the next one)."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self._data = b""

    def next(self) -> bytes:
        """The next line without its newline; at the stream's end, what is left (b"": nothing)."""
        while b"\n" not in self._data:
            chunk = self._conn.recv(1 << 16)
            if not chunk:
                line, self._data = self._data, b""
                return line
            self._data += chunk
        line, self._data = self._data.split(b"\n", 1)
        return line


KEEPALIVE_ENV = "REFINERY_GRPC_KEEPALIVE_MS"  # for tests: how often a warm worker's channels ping (ms)


def keepalive_override(env: dict[str, str]) -> None:
    """A worker's channels ping every ``env[KEEPALIVE_ENV]`` ms instead of Beam's 20 s, where set."""
    if env.get(KEEPALIVE_ENV):
        from refinery.transforms.io.beam_private import set_worker_keepalive_ms

        set_worker_keepalive_ms(int(env[KEEPALIVE_ENV]))


# ---------------------------------------------------------------------------------------
# The attach command
# ---------------------------------------------------------------------------------------

def attach(socket_path: str) -> int:
    """Have the warm process at ``socket_path`` fork a worker with this process's environment;
    wait for it and return its status. Without a pool there: become an ordinary worker."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(socket_path)
    except OSError:
        os.execv(sys.executable, [sys.executable, "-m", WORKER_MAIN])
    conn.sendall(json.dumps(dict(os.environ)).encode() + b"\n")
    lines = _Lines(conn)
    reply = lines.next().strip()
    if reply.startswith(b"pid ") and reply[4:].isdigit():
        _end_with_this_process(int(reply[4:]))
        reply = lines.next().strip()
    return int(reply) if reply.isdigit() else 1  # no status: the worker was killed


def _end_with_this_process(worker: int) -> None:
    """On SIGTERM (the runner ending a worker that did not stop: ``local_runner.end_process``),
    SIGKILL the forked ``worker`` first, then end."""
    def end(signum: int, frame: object) -> None:
        with contextlib.suppress(OSError):
            os.kill(worker, signal.SIGKILL)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, end)
    # the command started this process with SIGTERM ignored and blocked (beam_pipelines.interrupt)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3:])
    elif sys.argv[1] == "attach":
        sys.exit(attach(sys.argv[2]))
    else:
        sys.exit(f"usage: python -m {MODULE} serve SOCKET [MODULE ...] | attach SOCKET")
