"""A finished job's command exits promptly (issue 58, item 0).

A decon against a million eval rows wrote ``.SUCCESS`` and then waited 13 minutes in
``LocalWorkerHandler.stop_worker`` for a worker that never ended. The workers' channels ping
every 20 s; the driver's log server had gRPC's default ping policy and answered with
``GOAWAY too_many_pings``; Beam's logging client reconnected, and its dead call's request
thread could take the end-of-stream marker off the queue, so the worker's log flush at its
end waited forever. Here: the servers take the workers' pings (a run with a 50 ms keepalive
shows no GOAWAY and exits within seconds of its job's end), and a worker that does not end
anyway is ended, with one line saying so, and its forked process with it.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import GSM8K_TEST, gsm8k_texts, write_jsonl
from reliability_helpers import refinery_cmd

from refinery.runners import local_runner, warm_workers
from refinery.transforms.io.beam_private import WORKER_SERVER_OPTIONS, worker_keepalive_ms


def test_the_worker_servers_take_beams_keepalive_pings() -> None:
    options = dict(WORKER_SERVER_OPTIONS)
    assert options["grpc.http2.max_ping_strikes"] == 0  # no GOAWAY, however often a worker pings
    assert options["grpc.http2.max_pings_without_data"] == 0
    assert options["grpc.http2.min_ping_interval_without_data_ms"] <= worker_keepalive_ms()


def _timeline(path: Path) -> dict[str, float]:
    marks = [json.loads(line) for line in path.read_text().splitlines()]
    return {m["phase"]: m["t"] for m in marks if m.get("event") == "phase"}


def test_a_run_whose_workers_ping_often_has_no_goaway_and_exits_at_its_end(tmp_path: Path) -> None:
    """Decon on 2 warm workers whose channels ping every 50 ms (a 20-minute run's pings in a
    few seconds): no GOAWAY, no reconnecting log client, and the command returns within
    seconds of the job's end (the timeline's ``job_done`` mark)."""
    train = tmp_path / "train"
    for i in range(4):
        write_jsonl(train / f"part{i}.jsonl", [{"text": t} for t in gsm8k_texts(1500, offset=1500 * i)])
    timeline = tmp_path / "timeline.jsonl"
    env = {**os.environ, warm_workers.KEEPALIVE_ENV: "50", "REFINERY_TIMELINE": str(timeline)}
    env.pop("PYTEST_CURRENT_TEST", None)
    run = subprocess.run(refinery_cmd("decon", "--eval", GSM8K_TEST, "--eval-text-field", "question", "--train",
                                      train, "--output", tmp_path / "out", "--ngrams", "8", "13", "--workers", "2",
                                      "--no-progress"),
                         env=env, capture_output=True, text=True, timeout=600)
    ended = time.time()
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "out" / ".SUCCESS").exists()
    for noise in ("too_many_pings", "GOAWAY", "Logging client failed"):
        assert noise not in run.stderr, run.stderr[-3000:]
    marks = _timeline(timeline)
    assert "job_done" in marks and "exit" in marks
    assert ended - marks["job_done"] < 60, f"the command returned {ended - marks['job_done']:.0f} s after its job"


def _sigterm_ignoring_child(tmp_path: Path) -> subprocess.Popen[bytes]:
    ready = tmp_path / "ready"
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            f"open({str(ready)!r}, 'w').close()\n"
            "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    return proc


def test_a_worker_that_does_not_end_is_ended_with_one_line(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_runner, "WORKER_KILL_S", 0.2)
    proc = _sigterm_ignoring_child(tmp_path)
    with caplog.at_level(logging.WARNING, logger=local_runner.__name__):
        status = local_runner.end_process(proc, "worker_7", grace_s=0.2)
    assert status == 0 and proc.returncode == -signal.SIGKILL  # SIGTERM ignored: killed
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and f"worker process {proc.pid} (worker_7) had not ended" in lines[0], lines


def test_a_worker_that_ends_in_time_keeps_its_status(caplog: pytest.LogCaptureFixture) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with caplog.at_level(logging.WARNING, logger=local_runner.__name__):
        assert local_runner.end_process(proc, "worker_8", grace_s=60) == 3
    assert not caplog.records


def test_the_stop_time_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REFINERY_WORKER_STOP_S", raising=False)
    assert local_runner.worker_stop_s() == local_runner.WORKER_STOP_S
    monkeypatch.setenv("REFINERY_WORKER_STOP_S", "2.5")
    assert local_runner.worker_stop_s() == 2.5
    monkeypatch.setenv("REFINERY_WORKER_STOP_S", "soon")
    with pytest.raises(ValueError, match="REFINERY_WORKER_STOP_S='soon'"):
        local_runner.worker_stop_s()


def _catches_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a SIGTERM handler and does not block SIGTERM (/proc)."""
    fields = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if ":\t" in line)
    bit = 1 << (signal.SIGTERM - 1)
    return bool(int(fields["SigCgt"], 16) & bit) and not int(fields["SigBlk"], 16) & bit


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_attach_command_ends_its_forked_worker_on_sigterm(tmp_path: Path) -> None:
    """The attach command (started as the driver starts it: SIGTERM ignored and blocked) learns
    its worker's pid from the pool; SIGTERM then ends the worker, then the attach command."""
    path = str(tmp_path / "pool.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    worker = _sigterm_ignoring_child(tmp_path)  # stands for the forked worker
    got_env: list[bytes] = []

    def pool() -> None:  # the warm process's side: an env line in, the worker's pid out
        conn, _ = server.accept()
        got_env.append(conn.recv(1 << 20))
        conn.sendall(f"pid {worker.pid}\n".encode())
        time.sleep(600)

    threading.Thread(target=pool, daemon=True).start()

    def as_the_driver_starts_it() -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    attach = subprocess.Popen([sys.executable, "-m", warm_workers.MODULE, "attach", path],
                              preexec_fn=as_the_driver_starts_it)
    try:
        deadline = time.monotonic() + 60
        while not _catches_sigterm(attach.pid):
            assert time.monotonic() < deadline and attach.poll() is None
            time.sleep(0.02)
        attach.terminate()
        assert attach.wait(timeout=30) == 128 + signal.SIGTERM
        assert worker.wait(timeout=30) == -signal.SIGKILL
        assert got_env and got_env[0].endswith(b"\n")
    finally:
        for p in (attach, worker):
            if p.poll() is None:
                p.kill()
                p.wait()
        server.close()
