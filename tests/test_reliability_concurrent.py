"""Two runs of the same prep command at once on the same output: both finish (exit 0), and
the outputs are valid and byte-identical to a single run's; no temp file is left behind
and neither run removes what the other wrote (e.g. its temp files, as 'stale')."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import reliability_helpers
from helpers import run_prep
from reliability_helpers import (
    ForkServer,
    child_env,
    expected_texts,
    final_digest,
    make_corpus,
    read_unit_log,
    refinery_cmd,
    shard_texts,
    spawn,
    temp_files,
    write_figures,
)

from refinery.beam_pipelines.cli import main
from refinery.transforms.io import storage

forks = reliability_helpers.forks


def _argv(corpus: Path, out: Path) -> list[str]:
    return ["prep", "--input", str(corpus), "--output", str(out), "--num-shards", "4", "--dataset", "cc",
            "--runner", "direct", "--no-progress", "--unit-mb", "0"]  # a unit per file: 6 units to pause in


def _wait_for(log: Path, predicate: Callable[[list[dict[str, Any]]], bool], timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate(read_unit_log(log)):
            return
        time.sleep(0.005)
    raise AssertionError("the event did not come")


@pytest.mark.parametrize("pause_at", [("tokenize", 2), ("pack", 1)])
def test_second_run_while_first_is_paused_mid_unit(
        tmp_path: Path, forks: ForkServer, pause_at: tuple[str, int]) -> None:
    """Run A is frozen (SIGSTOP) inside a unit; run B, the same command, starts and finishes
    the whole job while A holds temp files and a unit without a receipt; then A resumes
    (SIGCONT), finishes its unit over B's identical files, skips the rest and exits 0. The
    deterministic version of two overlapping runs, with the nastiest interleaving."""
    corpus = make_corpus(tmp_path / "corpus", files=6, docs_per_file=50)
    ref = tmp_path / "ref"
    assert run_prep([corpus], ref, "--num-shards", 4, "--dataset", "cc", "--unit-mb", 0) == 0
    want = final_digest(ref)
    stage, k = pause_at
    out, log = tmp_path / "out", tmp_path / "units.log"
    a = spawn(refinery_cmd(*_argv(corpus, out)), child_env(log))
    _wait_for(log, lambda events: sum(e["stage"] == stage and e["event"] == "start" for e in events) >= k)
    os.killpg(a.pid, signal.SIGSTOP)
    try:
        b = forks.start(_argv(corpus, out), child_env(log))
        assert b.wait(120) == 0, b.stderr()[-3000:]
        # complete for B; A's temp files (A is alive) are still there and must be left alone
        assert {p: h for p, h in final_digest(out).items() if storage.TMP_MARKER not in p} == want
    finally:
        os.killpg(a.pid, signal.SIGCONT)
    assert a.wait(120) == 0, a.stderr()[-3000:]
    events = read_unit_log(log)
    assert {e["pid"] for e in events if e["event"] == "start"} == {a.pid, b.pid}  # both did work
    assert final_digest(out) == want and temp_files(out) == []
    assert shard_texts(out) == expected_texts(corpus)
    assert main(["verify", str(out / "manifest.json"), "--checksums"]) == 0
    write_figures(f"concurrent_{stage}", {"units_started": sum(e["event"] == "start" for e in events),
                                          "manifest_docs":
                                              json.loads((out / "manifest.json").read_text())["total_documents"]})
