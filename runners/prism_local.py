"""Prism on this machine: Beam's Prism runner built from the Go module proxy into a cache, and run.

Beam downloads Prism's binary from the internet at first use; on machines that reach the
Go module proxy but not the web (CI, air-gapped build hosts) :func:`build` compiles it
instead: ``go build`` of ``github.com/apache/beam/sdks/v2/go/cmd/prism`` at
``v<installed Beam>`` from the Go module proxy (about 5 minutes the first time on 2 cores;
Go's module and build caches make a rebuild, in a new clone too, take seconds), into
:func:`cache_dir` with the Beam version it was built for beside it (``VERSION``). A cached
binary of the installed Beam's version is reused; one of another version is never used
(:func:`find_prism`).

Prism as Beam publishes it (2.77) serves its job API and its workers' Fn API on one TCP
port on every interface, to any caller: another user could submit a job there (an EXTERNAL
environment naming a worker pool, a PROCESS environment's command) that Prism, as this
user, would run. The binary here is built from a copy of the module with :data:`PATCHES`
applied (the module cache is not touched): it listens on the unix socket named by
``$REFINERY_PRISM_SOCKET`` (:data:`SOCKET_ENV`), else on ``127.0.0.1`` only, and gives its
clients and workers that address (``unix:PATH``). A binary built without them (``PATCH``
in the cache says with which) is not used. Each patch must find its text in the module
once, else the build fails naming the file (a Beam upgrade is checked again, not patched
blindly).

:class:`PrismServer`: one Prism process serving the job API on a unix socket in a folder of
the temp dir that only this user can enter (:attr:`PrismServer.endpoint`: ``unix:PATH``),
stopped by its pid, and ended by the kernel if the process that started it dies
(``PR_SET_PDEATHSIG``).

Command line::

    python -m refinery.runners.prism_local build [--go PATH]   # once; what `make prism-cache` runs
    python -m refinery.runners.prism_local where               # the cached binary, or why there is none
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from . import tool_cache
from .tool_cache import free_port, installed_beam_version

CACHE_ENV = "REFINERY_PRISM_CACHE"
MODULE = "github.com/apache/beam/sdks/v2"
PACKAGE = f"{MODULE}/go/cmd/prism"
BINARY = "prism"
VERSION_FILE = "VERSION"
PATCH_FILE = "PATCH"
START_TIMEOUT_S = 60.0
SOCKET_ENV = "REFINERY_PRISM_SOCKET"
PATCH_ID = "listen-private-1"  # what PATCH says of a binary built with PATCHES; a change of them changes it

_SERVER_GO = "go/pkg/beam/runners/prism/internal/jobservices/server.go"
_WORKER_GO = "go/pkg/beam/runners/prism/internal/worker/worker.go"
# (file of the module, text found there once, its replacement): Prism listens where refinery says
PATCHES: tuple[tuple[str, str, str], ...] = (
    (_SERVER_GO, 'lis, err := net.Listen("tcp", fmt.Sprintf(":%d", port))', "lis, err := refineryListen(port)"),
    (_SERVER_GO, "func (s *Server) Endpoint() string {\n",
     "func (s *Server) Endpoint() string {\n"
     '\tif s.lis.Addr().Network() == "unix" {\n'
     '\t\treturn "unix:" + s.lis.Addr().String()\n'
     "\t}\n"),
    (_SERVER_GO, "// NewServer acquires the indicated port.\n",
     f"// refineryListen: the unix socket named by ${SOCKET_ENV} (refinery's build), else loopback TCP.\n"
     "func refineryListen(port int) (net.Listener, error) {\n"
     f'\tif path := os.Getenv("{SOCKET_ENV}"); path != "" {{\n'
     '\t\treturn net.Listen("unix", path)\n'
     "\t}\n"
     '\treturn net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))\n'
     "}\n\n"
     "// NewServer acquires the indicated port.\n"),
    (_WORKER_GO, 'endpoint: "localhost:" + p,',
     'endpoint: map[bool]string{true: "unix:" + lis.Addr().String(), false: "localhost:" + p}'
     '[lis.Addr().Network() == "unix"],'),
)


class BuildError(RuntimeError):
    """Prism could not be built; the message says why in one line."""


def cache_dir() -> Path:
    """Where the binary lives: ``$REFINERY_PRISM_CACHE``; else, in a source checkout, its
    git-ignored ``.cache/prism`` (beside Flink's); else ``~/.cache/refinery/prism``."""
    return tool_cache.cache_dir("prism", CACHE_ENV)


def module_version(beam_version: str) -> str:
    """The Go module version of Beam's release ``beam_version``: ``2.77.0`` -> ``v2.77.0``,
    ``2.78.0rc2`` -> ``v2.78.0-RC2``. Raises :class:`BuildError` for a development version
    (no published module: build Prism from that Beam's source tree and pass ``--prism_location``)."""
    m = re.fullmatch(r"(\d+\.\d+\.\d+)(?:rc(\d+))?", beam_version)
    if m is None:
        raise BuildError(f"apache-beam {beam_version} is not a release: build Prism from its source tree "
                         f"(go build ./sdks/go/cmd/prism) and pass --prism_location PATH")
    return f"v{m[1]}" + (f"-RC{m[2]}" if m[2] else "")


def cached_version(cache: Path | None = None) -> str | None:
    """The Beam version the cached binary was built for, or None when there is no binary."""
    cache = cache or cache_dir()
    if not (cache / BINARY).is_file() or not (cache / VERSION_FILE).is_file():
        return None
    return (cache / VERSION_FILE).read_text().strip() or None


def cached_patch(cache: Path | None = None) -> str | None:
    """What ``PATCH`` in the cache says of its binary (:data:`PATCH_ID` when built here now)."""
    try:
        return ((cache or cache_dir()) / PATCH_FILE).read_text().strip() or None
    except OSError:
        return None


def find_prism(cache: Path | None = None) -> Path | None:
    """The cached binary, if it was built for the installed Beam with :data:`PATCHES`; else None."""
    cache = cache or cache_dir()
    usable = cached_version(cache) == installed_beam_version() and cached_patch(cache) == PATCH_ID
    return cache / BINARY if usable else None


def missing_reason(cache: Path | None = None) -> str:
    """One line: why there is no usable cached binary, and how to get one."""
    cache = cache or cache_dir()
    have, want = cached_version(cache), installed_beam_version()
    what = f"no Prism binary in {cache}" if have is None else \
        f"the Prism in {cache} was built for Beam {have}, not the installed {want}" if have != want else \
        f"the Prism in {cache} was built without refinery's patch (it would listen on every interface)"
    return f"{what}: build it with 'make prism-cache' (needs Go; or python -m refinery.runners.prism_local build)"


def patched_module(module_dir: Path, into: Path) -> Path:
    """A copy in ``into`` of the Beam Go module at ``module_dir`` (its ``go.mod``, ``go.sum``
    and ``go/``: the Go SDK) with :data:`PATCHES` applied; raises :class:`BuildError` naming
    a file whose text is not there once (the module cache itself is read-only, and
    ``go build -overlay`` may not replace files in it)."""
    into.mkdir(parents=True, exist_ok=True)
    for name in ("go.mod", "go.sum"):
        shutil.copyfile(module_dir / name, into / name)
    shutil.copytree(module_dir / "go", into / "go", copy_function=shutil.copyfile)
    texts: dict[str, str] = {}
    for rel, old, new in PATCHES:
        path = into / rel
        try:
            text = texts[rel] if rel in texts else path.read_text()
        except OSError as e:
            raise BuildError(f"{module_dir / rel}: cannot read it to patch Prism ({e.strerror})") from None
        if text.count(old) != 1:
            raise BuildError(f"{module_dir / rel}: refinery's Prism patch does not apply (it expects "
                             f"{old.splitlines()[0]!r} once, and finds it {text.count(old)} times): "
                             f"check PATCHES against this Beam")
        texts[rel] = text.replace(old, new)
    for rel, text in texts.items():
        (into / rel).write_text(text)
    return into


def build(cache: Path | None = None, go: str | None = None, log: Callable[[str], object] = print) -> Path:
    """The binary for the installed Beam in the cache, built (:data:`PATCHES` applied) unless
    one of that version and patch is there; raises :class:`BuildError` (no Go, or the build
    failed)."""
    cache = cache or cache_dir()
    found = find_prism(cache)
    if found:
        log(f"prism: reusing {found} (Beam {installed_beam_version()})")
        return found
    go = go or shutil.which("go")
    if not go:
        raise BuildError("go is not on PATH: Go builds Beam's Prism runner from the Go module proxy "
                         "(Beam 2.77's needs Go 1.26)")
    beam = installed_beam_version()
    version = module_version(beam)
    cache.mkdir(parents=True, exist_ok=True)
    log(f"prism: go build {PACKAGE}@{version}, patched to listen privately (minutes the first time) ...")
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="gobin-", dir=cache) as gobin:
        try:
            module_dir = Path(json.loads(_go(go, ["mod", "download", "-json", f"{MODULE}@{version}"], gobin))["Dir"])
        except (ValueError, KeyError, TypeError):
            raise BuildError(f"go mod download {MODULE}@{version} did not say where the module is") from None
        source = patched_module(module_dir, Path(gobin) / "src")
        built = Path(gobin) / BINARY
        _go(go, ["build", "-trimpath", "-o", str(built), "./go/cmd/prism"], gobin, cwd=source)
        if not built.is_file():
            raise BuildError(f"go build of {PACKAGE}@{version} wrote no {BINARY} in {gobin}")
        (cache / VERSION_FILE).unlink(missing_ok=True)  # a binary is never recorded as another version
        (cache / PATCH_FILE).unlink(missing_ok=True)
        os.replace(built, cache / BINARY)
    (cache / VERSION_FILE).write_text(beam + "\n")
    (cache / PATCH_FILE).write_text(PATCH_ID + "\n")
    log(f"prism: built {cache / BINARY} for Beam {beam} in {time.time() - t0:.0f} s")
    return cache / BINARY


def _go(go: str, args: list[str], gobin: str, cwd: Path | None = None) -> str:
    """``go ARGS``' stdout; :class:`BuildError` with its last line when it fails."""
    r = subprocess.run([go, *args], env={**os.environ, "GOBIN": gobin, "GOFLAGS": "-mod=mod"}, capture_output=True,
                       text=True, stdin=subprocess.DEVNULL, cwd=cwd)
    if r.returncode != 0:
        lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip() and "downloading" not in ln]
        said = " ".join(a for a in args if not a.startswith("-"))
        raise BuildError(f"go {said} exited {r.returncode}: {lines[-1] if lines else 'no output'}"[:400])
    return r.stdout


# ---------------------------------------------------------------------------------------
# A Prism process
# ---------------------------------------------------------------------------------------

def _dies_with_parent() -> Callable[[], object] | None:
    """What a child runs before exec so that the kernel sends it SIGTERM when the thread that
    started it ends (``PR_SET_PDEATHSIG``; Linux), or None where there is no ``prctl``.
    Looked up here, in the parent: the child may take no lock another thread held."""
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def _answers(path: str) -> bool:
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(0.5)
            s.connect(path)
            return True
    except OSError:
        return False


class PrismServer:
    """One Prism process (built here: :data:`PATCHES`) serving the job API on a unix socket
    in a new folder of the temp dir that only this user can enter (:attr:`endpoint`:
    ``unix:PATH``; :func:`~.warm_workers.private_folder`, removed by :meth:`stop`, or by a
    later run when this process was killed), started with :meth:`start`, stopped by its pid
    with :meth:`stop`. Its log lines go to ``log`` (a file), else to a temp file that goes
    with it; :meth:`start` raises :class:`RuntimeError` with its last line when it exits or
    does not listen. ``port``: Prism's ``--job_port``, which it uses only without the socket."""

    def __init__(self, binary: str | Path, port: int | None = None, log: Path | None = None):
        self.binary, self.port, self.log = str(binary), port or free_port(), log
        self.proc: subprocess.Popen[bytes] | None = None
        self.folder: str | None = None
        self.socket = ""

    @property
    def endpoint(self) -> str:
        return f"unix:{self.socket}"

    def start(self, timeout: float = START_TIMEOUT_S) -> "PrismServer":
        # warm_workers runs as `python -m`: importing the runners package must not import it
        from .warm_workers import SOCKET_PATH_MAX, private_folder  # lazy: see the line above

        self.folder = private_folder()
        self.socket = os.path.join(self.folder, "prism.sock")
        if len(os.fsencode(self.socket)) > SOCKET_PATH_MAX:
            self.stop()
            raise RuntimeError(f"the temp dir's path is too long for Prism's socket ({self.socket}): "
                               "set TMPDIR to a shorter one")
        with (open(self.log, "w+b") if self.log else tempfile.TemporaryFile()) as out:
            self.proc = subprocess.Popen([self.binary, f"--job_port={self.port}", "--serve_http=false",
                                          "--log_level=warn"], stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, preexec_fn=_dies_with_parent(),
                                         env={**os.environ, SOCKET_ENV: self.socket})
            deadline = time.time() + timeout
            while not _answers(self.socket):
                failed = f"exited {self.proc.returncode}" if self.proc.poll() is not None else \
                    f"did not listen at {self.socket} within {timeout:.0f}s" if time.time() > deadline else None
                if failed:
                    self.stop()
                    out.seek(0)
                    said = [ln.strip() for ln in out.read().decode(errors="replace").splitlines() if ln.strip()]
                    raise RuntimeError(f"Prism ({self.binary}) {failed} at start"
                                       + (f": {said[-1][:300]}" if said else ""))
                time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def __enter__(self) -> "PrismServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m refinery.runners.prism_local", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build Prism for the installed Beam into the cache (reused when there)")
    b.add_argument("--go", help="the go command (default: go on PATH)")
    sub.add_parser("where", help="print the cached binary, or why there is none (exit 1)")
    args = p.parse_args(argv)
    if args.cmd == "where":
        found = find_prism()
        print(found if found else f"prism where: {missing_reason()}", file=sys.stdout if found else sys.stderr)
        return 0 if found else 1
    try:
        print(f"cache: {cache_dir()}\n  prism: {build(go=args.go)}")
        return 0
    except BuildError as e:
        print(f"prism build: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
