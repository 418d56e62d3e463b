"""Prism on this machine: Beam's Prism runner built from the Go module proxy into a cache, and run.

Beam downloads Prism's binary from the internet at first use; on machines that reach the
Go module proxy but not the web (CI, air-gapped build hosts) :func:`build` compiles it
instead: ``go install github.com/apache/beam/sdks/v2/go/cmd/prism@v<installed Beam>``
(about 5 minutes the first time on 2 cores; Go's module and build caches make a rebuild,
in a new clone too, take seconds), into :func:`cache_dir` with the Beam version it was
built for beside it (``VERSION``). A cached binary of the installed Beam's version is
reused; one of another version is never used (:func:`find_prism`).

:class:`PrismServer`: one Prism process serving the job API on a free port, stopped by its
pid, and ended by the kernel if the process that started it dies (``PR_SET_PDEATHSIG``).
Prism (2.77) listens on every interface, like Beam's other job servers.

Command line::

    python -m refinery.runners.prism_local build [--go PATH]   # once; what `make prism-cache` runs
    python -m refinery.runners.prism_local where               # the cached binary, or why there is none
"""
from __future__ import annotations

import argparse
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
PACKAGE = "github.com/apache/beam/sdks/v2/go/cmd/prism"
BINARY = "prism"
VERSION_FILE = "VERSION"
START_TIMEOUT_S = 60.0


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


def find_prism(cache: Path | None = None) -> Path | None:
    """The cached binary, if it was built for the installed Beam; else None."""
    cache = cache or cache_dir()
    return cache / BINARY if cached_version(cache) == installed_beam_version() else None


def missing_reason(cache: Path | None = None) -> str:
    """One line: why there is no usable cached binary, and how to get one."""
    cache = cache or cache_dir()
    have, want = cached_version(cache), installed_beam_version()
    what = f"no Prism binary in {cache}" if have is None else \
        f"the Prism in {cache} was built for Beam {have}, not the installed {want}"
    return f"{what}: build it with 'make prism-cache' (needs Go; or python -m refinery.runners.prism_local build)"


def build(cache: Path | None = None, go: str | None = None, log: Callable[[str], object] = print) -> Path:
    """The binary for the installed Beam in the cache, built with ``go install`` unless one of
    that version is there; raises :class:`BuildError` (no Go, or the build failed)."""
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
    log(f"prism: go install {PACKAGE}@{version} (minutes the first time) ...")
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="gobin-", dir=cache) as gobin:
        r = subprocess.run([go, "install", f"{PACKAGE}@{version}"], env={**os.environ, "GOBIN": gobin},
                           capture_output=True, text=True, stdin=subprocess.DEVNULL)
        built = Path(gobin) / BINARY
        if r.returncode != 0 or not built.is_file():
            lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip() and "downloading" not in ln]
            raise BuildError(f"go install {PACKAGE}@{version} exited {r.returncode}: "
                             f"{lines[-1] if lines else 'no output'}"[:400])
        (cache / VERSION_FILE).unlink(missing_ok=True)  # a binary is never recorded as another version
        os.replace(built, cache / BINARY)
    (cache / VERSION_FILE).write_text(beam + "\n")
    log(f"prism: built {cache / BINARY} for Beam {beam} in {time.time() - t0:.0f} s")
    return cache / BINARY


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


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class PrismServer:
    """One Prism process serving the job API on ``localhost:PORT`` (:attr:`endpoint`),
    started with :meth:`start`, stopped by its pid with :meth:`stop`. Its log lines go to
    ``log`` (a file), else to a temp file that goes with it; :meth:`start` raises
    :class:`RuntimeError` with its last line when it exits or does not listen."""

    def __init__(self, binary: str | Path, port: int | None = None, log: Path | None = None):
        self.binary, self.port, self.log = str(binary), port or free_port(), log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"localhost:{self.port}"

    def start(self, timeout: float = START_TIMEOUT_S) -> "PrismServer":
        with (open(self.log, "w+b") if self.log else tempfile.TemporaryFile()) as out:
            self.proc = subprocess.Popen([self.binary, f"--job_port={self.port}", "--serve_http=false",
                                          "--log_level=warn"], stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, preexec_fn=_dies_with_parent())
            deadline = time.time() + timeout
            while not _answers(self.port):
                failed = f"exited {self.proc.returncode}" if self.proc.poll() is not None else \
                    f"did not listen on port {self.port} within {timeout:.0f}s" if time.time() > deadline else None
                if failed:
                    self.stop()
                    out.seek(0)
                    said = [ln.strip() for ln in out.read().decode(errors="replace").splitlines() if ln.strip()]
                    raise RuntimeError(f"Prism ({self.binary}) {failed} at start"
                                       + (f": {said[-1][:300]}" if said else ""))
                time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

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
