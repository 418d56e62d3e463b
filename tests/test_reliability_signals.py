"""SIGINT (Ctrl-C: the whole foreground group) and SIGTERM (the driver alone, as Kubernetes or
SLURM send it) to a ``--runner local --workers 2`` prep run: every process of the run is gone
within a few seconds, the exit code is 130 with the resume command printed, no final file
exists half-written under its final name, and the next run (here on the direct runner:
outputs do not depend on the runner) finishes with outputs byte-identical to an
uninterrupted run, redoing no finished unit."""
from __future__ import annotations

import io
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import reliability_helpers
from helpers import run_prep
from reliability_helpers import (
    ForkServer,
    child_env,
    completed,
    current_receipts,
    final_digest,
    make_corpus,
    read_unit_log,
    recomputed_units,
    refinery_cmd,
    run_attempt,
    spawn,
    temp_files,
    write_figures,
)

from refinery.transforms.io import storage

forks = reliability_helpers.forks
STOP_LIMIT_S = 10.0  # the CLI watchdog kills the workers and exits 5 s after the signal at the latest


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("signals")
    corpus = make_corpus(root / "corpus", files=6, docs_per_file=50)
    ref = root / "ref"
    assert run_prep([corpus], ref, "--num-shards", 4, "--dataset", "s", "--unit-mb", 0) == 0
    return corpus, final_digest(ref)


@pytest.mark.parametrize("sig, group, when", [
    (signal.SIGINT, True, ("pack", 1, 0.01)),        # Ctrl-C while shards are being written
    (signal.SIGTERM, False, ("tokenize", 1, 0.0)),   # SIGTERM to the driver alone while its workers run units
])
def test_signal_stops_local_run_and_next_run_resumes(
        tmp_path: Path, forks: ForkServer, reference: tuple[Path, dict[str, str]], sig: signal.Signals, group: bool,
        when: tuple[str, int, float]) -> None:
    corpus, want = reference
    out, log = tmp_path / "out", tmp_path / "units.log"
    argv = ["prep", "--input", str(corpus), "--output", str(out), "--num-shards", "4", "--dataset", "s",
            "--no-progress", "--unit-mb", "0"]
    stage, k, delay = when
    a = run_attempt(lambda: spawn(refinery_cmd(*argv, "--runner", "local", "--workers", "2"), child_env(log)),
                    log, kill_at_start=k, delay=delay, stage=stage, sig=sig, group=group)
    assert a.killed, f"the run finished before the signal: {a.stderr[-2000:]}"
    assert a.returncode == 130, a.stderr[-3000:]
    assert "Resume with:" in a.stderr and "refinery prep" in a.stderr
    ack = "Ctrl-C" if sig == signal.SIGINT else "SIGTERM"
    assert f"stopping\u2026 ({ack} again to quit now)" in a.stderr  # acknowledged at once
    assert a.stop_seconds < STOP_LIMIT_S
    # nothing half-written under a final name: each final file present is the finished one
    # (temp files of the interrupted writes may remain: hidden names, removed by the next run)
    partial = {p: h for p, h in final_digest(out).items() if want.get(p) != h and storage.TMP_MARKER not in p}
    assert partial == {}

    before = completed(current_receipts(out))
    b = run_attempt(lambda: forks.start([*argv, "--runner", "direct"], child_env(log)), log)
    assert b.returncode == 0, b.stderr[-3000:]
    assert final_digest(out) == want and temp_files(out) == []
    assert all(current_receipts(out)[p] == v for p, v in before.items())
    assert recomputed_units(read_unit_log(log)) == []
    write_figures(f"signal_{signal.Signals(sig).name}", {"stop_seconds": round(a.stop_seconds, 2),
                                                           "units_kept": len(before)})


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal (so Progress draws a tqdm bar), with write times."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.times.append(time.monotonic())
        return super().write(text)


def test_a_signal_is_acknowledged_at_once_the_bar_stops_and_the_exit_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """First signal: the bar stops drawing and "stopping… (Ctrl-C again to quit now)" is
    printed, at once; a second signal exits saying so, not "Beam did not stop within 5s"."""
    from refinery.beam_pipelines import interrupt
    from refinery.transforms.resumable import Stage, Unit, bind_stages
    from refinery.transforms.resumable.progress import Progress

    class One(Stage[dict[str, Any], dict[str, int]]):
        name = "one"

        def make_plan(self) -> list[Unit[dict[str, Any]]]:
            return []

    [run] = bind_stages([One()], str(tmp_path))
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setattr(interrupt, "_stop_beam_workers", lambda: None)
    exits: list[str] = []
    monkeypatch.setattr(interrupt, "_hard_exit", lambda signum, why: exits.append(why))
    interrupt._INTERRUPTED.clear()
    try:
        with Progress([(run, 3)], interval=0.05, enabled=True) as progress:
            time.sleep(0.3)  # the bar redraws every 50 ms
            t0 = time.monotonic()
            interrupt._on_stop_signal(signal.SIGINT)
            acked = time.monotonic()
            assert progress._thread is not None and not progress._thread.is_alive()  # stopped drawing
            drawn = len(term.times)
            time.sleep(0.3)
            assert len(term.times) == drawn
        assert acked - t0 < 1.0
        assert term.getvalue().rstrip().endswith("stopping\u2026 (Ctrl-C again to quit now)")
        assert exits == [] and len(interrupt._WATCHDOG) == 1  # the 5 s watchdog is armed, not fired
        interrupt._on_stop_signal(signal.SIGINT)
        assert exits == ["Ctrl-C again"]
    finally:
        for timer in interrupt._WATCHDOG:
            timer.cancel()
        interrupt._WATCHDOG.clear()
        interrupt._INTERRUPTED.clear()
        logging.disable(logging.NOTSET)


def test_a_signal_as_the_run_ends_is_still_a_clean_interruption(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A signal taken while ``interruptible`` cleans up (the run had just returned) raised
    KeyboardInterrupt out of it, a traceback; now it is the same exit 130 as any other once
    acknowledged (one that comes after the clean-up stopped listening is ignored: exit 0)."""
    from refinery.beam_pipelines import interrupt

    monkeypatch.setattr(interrupt, "_stop_beam_workers", lambda: None)
    leaked = 0
    for delay in (0.0, 0.0005, 0.001, 0.002) * 15:  # the signal is taken during run() or after it
        def run(delay: float = delay) -> int:
            os.kill(os.getpid(), signal.SIGINT)
            t = time.monotonic()
            while time.monotonic() - t < delay:  # busy, so the watcher thread may take the signal meanwhile
                pass
            return 0

        try:
            code = interrupt.interruptible(run)
        except KeyboardInterrupt:
            leaked += 1
            continue
        err = capsys.readouterr().err
        if "stopping" in err:
            assert code == 130 and err.strip().splitlines()[-2] == "interrupted: finished units are kept. Resume with:"
        else:
            assert code == 0 and err == ""
    assert leaked == 0
