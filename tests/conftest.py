"""Shared fixtures: small corpora in every input format, built from real GSM8K text."""
from __future__ import annotations

import json
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from helpers import gsm8k_texts, write_jsonl

# What `make test-fast` leaves out: the modules whose tests take tens of seconds to minutes each
# (clusters, kill loops, the README run, the tiny model's chains). CI runs everything (`make test`).
SLOW_MODULES = frozenset({
    "test_readme_commands.py", "test_flink.py", "test_prism.py", "test_hydra_chain.py",
    "test_reliability_crash.py", "test_reliability_generate.py", "test_reliability_hydra.py",
    "test_reliability_signals.py", "test_gpu_check_dry_run.py", "test_runner_sockets.py", "test_dedup_reliability.py",
})


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: left out by `make test-fast` (CI runs it: `make test`)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    # the slow modules first (each module's own order kept): `make test`'s workers (pytest-xdist, a module
    # at a time) then end on short modules, not on one that runs for minutes while the other worker waits
    items.sort(key=lambda item: item.path.name not in SLOW_MODULES)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A corpus folder with .jsonl, .jsonl.gz, .jsonl.zst, .json and multi-row-group .parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "corpus"
    texts = gsm8k_texts(260)
    write_jsonl(root / "a.jsonl", [{"id": f"a{i}", "text": t} for i, t in enumerate(texts[:60])],
                raw_lines={10: '{"id": "broken", "text": "unterminated', 20: '[1, 2, 3]'})
    write_jsonl(root / "sub" / "b.jsonl.gz", [{"text": t} for t in texts[60:110]] + [{"text": "   "}, {"title": "x"}])
    write_jsonl(root / "sub" / "c.jsonl.zst", [{"id": 1000 + i, "text": t} for i, t in enumerate(texts[110:150])])
    (root / "d.json").write_text(json.dumps([{"id": f"d{i}", "text": t} for i, t in enumerate(texts[150:180])]))
    table = pa.table({"id": [f"p{i}" for i in range(80)], "text": texts[180:260], "extra": list(range(80))})
    pq.write_table(table, root / "e.parquet", row_group_size=10)
    (root / "notes.txt").write_text("not a data file; folders skip it")
    return root


@pytest.fixture
def small_corpus(tmp_path: Path) -> Path:
    root = tmp_path / "small"
    write_jsonl(root / "x.jsonl", [{"id": f"x{i}", "text": t} for i, t in enumerate(gsm8k_texts(40))])
    write_jsonl(root / "y.jsonl", [{"text": t} for t in gsm8k_texts(30, offset=40)])
    return root


class _PipFreezeOnce:
    """``subprocess`` as Beam's stager sees it, with ``pip freeze`` run once per session.

    Beam records the submitting environment (``pip freeze``, ~0.4 s in a subprocess) each
    time it turns a pipeline into a portable or Dataflow job; the runner tests build over a
    hundred. The staged artifact is the same, only the repeated subprocess is saved."""

    def __init__(self, real: ModuleType) -> None:
        self._real = real
        self._frozen: Any = None  # what pip freeze printed (bytes or str, as the caller asked)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def check_output(self, cmd: list[str], *args: Any, **kwargs: Any) -> Any:
        if list(cmd[1:]) == ["-m", "pip", "freeze"]:
            if self._frozen is None:
                self._frozen = self._real.check_output(cmd, *args, **kwargs)
            return self._frozen
        return self._real.check_output(cmd, *args, **kwargs)


@pytest.fixture(autouse=True, scope="session")
def _pip_freeze_once() -> Iterator[None]:
    try:
        from apache_beam.runners.portability import stager
    except ImportError:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stager, "subprocess", _PipFreezeOnce(subprocess))
        yield


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[object]]:
    """Refuse (and record) every connection and name lookup that is not to this machine; the
    test fails if any was tried."""
    attempts: list[object] = []
    local = ("127.0.0.1", "::1", "localhost")
    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def connect(self: socket.socket, address: tuple[Any, ...] | str) -> None:
        if isinstance(address, tuple) and address[0] not in local:
            attempts.append(address)
            raise OSError(f"test: network refused ({address})")
        return real_connect(self, address)

    def getaddrinfo(host: str | None, *args: Any, **kwargs: Any) -> Any:
        if host not in local and host is not None:
            attempts.append(host)
            raise socket.gaierror(f"test: name lookup refused ({host})")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield attempts
    assert attempts == [], "the network was touched"
