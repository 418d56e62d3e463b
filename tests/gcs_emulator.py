"""A local GCS for tests: ``gcp-storage-emulator`` on loopback, gcsfs pointed at it.

Use it from a test module (``tests/`` is on ``sys.path`` for test modules, as for
``engine_fixtures``)::

    pytest_plugins = ["gcs_emulator"]   # registers the gcs_bucket fixture

    def test_x(gcs_bucket):             # gcs_bucket == "gs://refinery-test-<pid>-<n>", empty
        storage.atomic_write_bytes(f"{gcs_bucket}/a/b.txt", b"hi")

``from gcs_emulator import gcs_bucket`` works too (pyflakes then reports the fixture
argument as a redefinition). Outside pytest, :func:`start_emulator` gives an endpoint.

- :func:`start_emulator` starts ``python -m gcp_storage_emulator start`` once per test
  process, in its own process, on 127.0.0.1 with in-memory storage (stopped at exit).
- ``gcs_bucket`` (function scope): a new, empty bucket for each test; yields ``gs://NAME``.
  For the test's duration it sets, for this process and every process it starts
  (DirectRunner multi-processing workers, PortableRunner workers),
  ``STORAGE_EMULATOR_HOST`` (gcsfs sends every request there), ``FSSPEC_GCS_TOKEN=anon``
  (no credential lookup, no metadata-server probe), ``FSSPEC_GCS_PROJECT`` and
  ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` (plain JSON-API gcsfs, see below), and the
  same in this process (fsspec config and registry); cached gcsfs instances (and their
  listing caches) are dropped before and after.

Nothing here contacts Google: a request that escaped to the real GCS would fail for lack
of credentials instead of succeeding silently.
"""
from __future__ import annotations

import atexit
import itertools
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Iterator, TypedDict

import pytest

PROJECT = "refinery-test"
_bucket_numbers = itertools.count()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(endpoint: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gcp-storage-emulator exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{endpoint}/storage/v1/b?project={PROJECT}", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(0.1)
    raise RuntimeError(f"gcp-storage-emulator did not answer on {endpoint} within {timeout:.0f}s")


def create_bucket(endpoint: str, name: str) -> None:
    body = json.dumps({"name": name}).encode()
    req = urllib.request.Request(f"{endpoint}/storage/v1/b?project={PROJECT}", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        if r.status != 200:
            raise RuntimeError(f"emulator refused to create bucket {name}: HTTP {r.status}")


class _Server(TypedDict, total=False):
    proc: subprocess.Popen[bytes]
    endpoint: str


_server: _Server = {}


def _stop() -> None:
    proc = _server.pop("proc", None)
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_emulator() -> str:
    """Start the emulator (once per process); returns its endpoint ``http://127.0.0.1:PORT``."""
    if "endpoint" in _server and _server["proc"].poll() is None:
        return _server["endpoint"]
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port),
         "--in-memory", "--quiet"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _server["proc"], _server["endpoint"] = proc, endpoint
    atexit.register(_stop)
    try:
        _wait_ready(endpoint, proc)
    except BaseException:
        _stop()
        raise
    return endpoint


def _drop_gcsfs_instances() -> None:
    import gcsfs

    gcsfs.GCSFileSystem.clear_instance_cache()


@pytest.fixture
def gcs_bucket(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh, empty bucket on the local emulator: ``gs://refinery-test-<pid>-<n>``."""
    import fsspec.config

    pytest.importorskip("gcp_storage_emulator", reason="pip install gcp-storage-emulator")
    endpoint = start_emulator()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
    monkeypatch.setenv("FSSPEC_GCS_TOKEN", "anon")
    monkeypatch.setenv("FSSPEC_GCS_PROJECT", PROJECT)
    monkeypatch.setitem(fsspec.config.conf, "gcs", {"token": "anon", "project": PROJECT})
    # gcsfs >= 2025 defaults to ExtendedGcsFileSystem, which asks the gRPC Storage Control
    # API for each bucket's layout (zonal/HNS) and retries for a minute against an emulator
    # that does not speak it. The plain JSON-API filesystem is what the emulator serves:
    # children read the env var when they import gcsfs; this process gets the registry entry.
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    import gcsfs.core
    registry = sys.modules["fsspec.registry"]._registry
    for protocol in ("gs", "gcs"):
        monkeypatch.setitem(registry, protocol, gcsfs.core.GCSFileSystem)
    name = f"refinery-test-{os.getpid()}-{next(_bucket_numbers)}"
    create_bucket(endpoint, name)
    _drop_gcsfs_instances()
    yield f"gs://{name}"
    _drop_gcsfs_instances()
