"""What a ``--runner local --workers 2`` run leaves on this machine (issue 34, item 9):
a run killed with SIGKILL leaves its folders in the temp dir, and the next run removes them
(their owner is gone).

Each test runs real ``refinery prep`` processes, with a short private ``TMPDIR``.
"""
from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

import pytest
from helpers import gsm8k_texts, write_jsonl
from reliability_helpers import child_env, refinery_cmd, run_attempt, spawn

from refinery.runners import warm_workers


@pytest.fixture
def private_tmp():
    """A TMPDIR of its own (short: unix socket paths are limited to 107 bytes)."""
    d = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def _corpus(root: Path, files: int, repeat: int) -> Path:
    texts = gsm8k_texts(400)
    for k in range(files):
        write_jsonl(root / f"f{k:02d}.jsonl", [{"text": t * repeat} for t in texts])
    return root


def _prep(corpus: Path, out: Path) -> list[str]:
    return refinery_cmd("prep", "--input", corpus, "--output", out, "--runner", "local", "--workers", "2",
                        "--no-progress", "--unit-mb", "0")


def test_the_run_folders_are_private():
    folder = warm_workers.private_folder()
    try:
        st = os.lstat(folder)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
        assert warm_workers.folder_owner_gone(os.path.basename(folder), warm_workers.process_started) is False
    finally:
        os.rmdir(folder)


# --- folders of killed runs ---------------------------------------------------------

def test_folder_owner_gone():
    started = {10: "500", 11: "0"}.get  # pid -> start time of the live process (None: no such process)
    assert warm_workers.folder_owner_gone("refinery-workers-10-500-abc_12", started) is False
    assert warm_workers.folder_owner_gone("refinery-workers-10-499-abc_12", started) is True   # pid reused
    assert warm_workers.folder_owner_gone("refinery-workers-12-500-abc_12", started) is True   # gone
    assert warm_workers.folder_owner_gone("refinery-workers-11-500-abc_12", started) is False  # start unknown
    assert warm_workers.folder_owner_gone("refinery-workers-10-0-abc_12", started) is False
    assert warm_workers.folder_owner_gone("refinery-other-12-500-abc", started) is False
    assert warm_workers.folder_owner_gone("refinery-workers-ab12cd34", started) is False  # old form: by age


def _worker_folders(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.glob("refinery-workers-*"))


def test_folders_of_killed_runs_are_removed_by_the_next_run(tmp_path, private_tmp):
    corpus = _corpus(tmp_path / "c", files=8, repeat=10)
    log = tmp_path / "units.log"
    env = child_env(log, TMPDIR=private_tmp)
    kills, left = 2, set()
    for _ in range(kills):  # SIGKILL to the whole process group, while its workers run units
        a = run_attempt(lambda: spawn(_prep(corpus, tmp_path / "o"), env), log, kill_at_start=1, timeout=60)
        assert a.killed, a.stderr[-2000:]
        now = set(_worker_folders(private_tmp))
        assert now - left, "the killed run left no folder: nothing to test"  # SIGKILL: no clean-up
        left |= now
    next_run = run_attempt(lambda: spawn(_prep(corpus, tmp_path / "o"), env), log, timeout=60)
    assert next_run.returncode == 0, next_run.stderr[-3000:]
    print(f"folders left by {kills} killed runs: {len(left)}; of them after the next run: "
          f"{len(left & set(_worker_folders(private_tmp)))}")
    assert _worker_folders(private_tmp) == []


def test_a_folder_of_a_live_run_is_kept(private_tmp, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))
    mine = warm_workers.private_folder()
    old = private_tmp / "refinery-workers-ab12cd34"  # the old form (no owner): removed once old and unused
    old.mkdir(mode=0o700)
    (old / "pool.sock").touch()
    fresh = private_tmp / "refinery-workers-ef56gh78"
    fresh.mkdir(mode=0o700)
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))
    warm_workers.remove_dead_folders()
    assert sorted(p.name for p in private_tmp.iterdir()) == sorted([os.path.basename(mine), fresh.name])
