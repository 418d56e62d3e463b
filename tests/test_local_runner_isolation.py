"""What a ``--runner local --workers 2`` run exposes to this machine and leaves on it, and what it
prints when units fail in its worker processes (issue 34, items 5, 9 and 11):

- its servers (Beam's FnApi control, data, state and logging services and the worker-log
  service) listen on no network address, not even loopback: only on unix sockets in a
  folder other users cannot enter (as root, the test checks that uid 65534 is refused);
  so do those of Beam's ``multi_threading`` mode;
- a run killed with SIGKILL leaves its folders in the temp dir, and the next run removes
  them (their owner is gone);
- a unit that fails in a worker process prints one line on stderr, not Beam's log proto.

The end-to-end tests run real ``refinery prep`` processes, with a short private ``TMPDIR``.
"""
from __future__ import annotations

import ipaddress
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest
from helpers import gsm8k_texts, write_jsonl
from reliability_helpers import child_env, process_tree, read_unit_log, refinery_cmd, run_attempt, spawn

from refinery.runners import warm_workers


@pytest.fixture
def private_tmp() -> Iterator[Path]:
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
    cmd: list[str] = refinery_cmd("prep", "--input", corpus, "--output", out, "--runner", "local", "--workers", "2",
                                  "--no-progress", "--unit-mb", "0")
    return cmd


# --- the sockets of a process tree ----------------------------------------------------

def _socket_inodes(pids: list[int]) -> set[str]:
    found = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                found.add(target[len("socket:["):-1])
    return found


def _ip(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address of /proc/net/tcp{,6}: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def _on_loopback(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def listening(pids: list[int]) -> list[tuple[str, str]]:
    """(kind, address) of every listening socket the processes hold: kind ``tcp`` with
    ``IP:PORT`` (``tcp`` and ``tcp6`` tables), or ``unix`` with its path."""
    inodes = _socket_inodes(pids)
    out = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: TCP_LISTEN
                host, port = f[1].split(":")
                out.append(("tcp", f"{_ip(host)}:{int(port, 16)}"))
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        f = line.split(maxsplit=7)
        if len(f) == 8 and f[3] == "00010000" and f[6] in inodes:  # __SO_ACCEPTCON: listening
            out.append(("unix", f[7]))
    return out


def _slowly(x: int) -> int:
    time.sleep(0.05)
    return x


def _refused_to_another_user(path: str) -> bool:
    """Whether uid/gid 65534 (nobody) cannot connect to the unix socket ``path`` (a forked
    child that drops to that user tries; this process's Python may not be readable by it)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
            code = 0
        except PermissionError:
            code = 3
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 3


def test_a_local_run_listens_on_no_network_address(tmp_path: Path, private_tmp: Path) -> None:
    corpus = _corpus(tmp_path / "c", files=8, repeat=10)
    p = subprocess.Popen(_prep(corpus, tmp_path / "o"), env={**os.environ, "TMPDIR": str(private_tmp)},
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    seen: set[tuple[str, str]] = set()
    refused: dict[str, bool] = {}
    try:
        while p.poll() is None:
            for kind, addr in listening(process_tree(p.pid)):
                seen.add((kind, addr))
                if kind == "unix" and addr not in refused and os.getuid() == 0:
                    refused[addr] = _refused_to_another_user(addr)
            time.sleep(0.01)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        err = p.communicate()[1].decode(errors="replace")
    assert p.returncode == 0, err[-3000:]
    tcp = sorted(a for kind, a in seen if kind == "tcp")
    network = [a for a in tcp if not _on_loopback(ipaddress.ip_address(a.rsplit(":", 1)[0]))]
    print(f"listening: {len(network)} on a network address, {len(tcp)} TCP in all, "
          f"{sum(kind == 'unix' for kind, _ in seen)} unix sockets")
    assert network == [], f"listening on a network address: {network}"
    assert tcp == [], f"listening on loopback TCP, which any local user can reach: {tcp}"
    unix = sorted(a for kind, a in seen if kind == "unix")
    assert len(unix) >= 5, unix  # the pool's, Beam's 4 FnApi services and the worker-log service
    for path in unix:  # each in a folder of the run's, under its TMPDIR, that only its user can enter
        folder = Path(path).parent
        assert folder.parent == private_tmp and folder.name.startswith("refinery-workers-"), path
    assert all(refused.values()), f"another user could connect: {[a for a, r in refused.items() if not r]}"
    assert not list(private_tmp.iterdir()), "the run's folders outlived it"


def test_a_multi_threading_job_listens_on_no_network_address() -> None:
    """Beam's ``multi_threading`` mode (worker threads of the driver that reach it over gRPC,
    ``--direct_running_mode multi_threading``): the same unix sockets."""
    import threading

    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    from refinery.runners.local import runnable

    args = ["--runner=DirectRunner", "--direct_running_mode=multi_threading", "--direct_num_workers=2"]
    before = set(listening(process_tree(os.getpid())))
    seen: set[tuple[str, str]] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.update(set(listening(process_tree(os.getpid()))) - before)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with beam.Pipeline(options=PipelineOptions(runnable(args))) as p:
            p | beam.Create(list(range(8))) | beam.Reshuffle() | beam.Map(_slowly)
    finally:
        done.set()
        watcher.join()
    assert [a for kind, a in seen if kind == "tcp"] == []
    unix = [a for kind, a in seen if kind == "unix"]
    assert len(unix) >= 4 and all(Path(a).parent.name.startswith("refinery-workers-") for a in unix), unix


def test_the_run_folders_are_private() -> None:
    folder = warm_workers.private_folder()
    try:
        st = os.lstat(folder)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
        assert warm_workers.folder_owner_gone(os.path.basename(folder), warm_workers.process_started) is False
    finally:
        os.rmdir(folder)


# --- folders of killed runs ---------------------------------------------------------

def test_folder_owner_gone() -> None:
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


def test_folders_of_killed_runs_are_removed_by_the_next_run(tmp_path: Path, private_tmp: Path) -> None:
    corpus = _corpus(tmp_path / "c", files=8, repeat=10)
    log = tmp_path / "units.log"
    env = child_env(log, TMPDIR=private_tmp)
    kills, left = 2, set[str]()
    for _ in range(kills):  # SIGKILL to the whole process group, while its workers run units
        a = run_attempt(lambda: spawn(_prep(corpus, tmp_path / "o"), env), log, kill_at_start=1)
        assert a.killed, a.stderr[-2000:]
        now = set(_worker_folders(private_tmp))
        assert now - left, "the killed run left no folder: nothing to test"  # SIGKILL: no clean-up
        left |= now
    next_run = run_attempt(lambda: spawn(_prep(corpus, tmp_path / "o"), env), log)
    assert next_run.returncode == 0, next_run.stderr[-3000:]
    print(f"folders left by {kills} killed runs: {len(left)}; of them after the next run: "
          f"{len(left & set(_worker_folders(private_tmp)))}")
    assert _worker_folders(private_tmp) == []


def test_a_folder_of_a_live_run_is_kept(private_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
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


# --- failed units -----------------------------------------------------------------------

PROTO_TEXT = re.compile(r"log_entries|severity:|instruction_id|transform_id|log_location|message: \"|Worker: ")


def test_units_failing_in_workers_print_one_line_each(tmp_path: Path, private_tmp: Path) -> None:
    """Inputs removed once the first unit started: the units that had not opened theirs fail
    in the worker processes. stderr: one line per failed unit, then the command's summary."""
    corpus = _corpus(tmp_path / "c", files=12, repeat=5)
    log = tmp_path / "units.log"
    p = spawn(_prep(corpus, tmp_path / "o"), child_env(log, TMPDIR=private_tmp))
    deadline = time.time() + 60
    while time.time() < deadline and not (log.exists() and '"start"' in log.read_text()):
        time.sleep(0.002)
    for f in sorted(corpus.iterdir())[2:]:
        f.unlink()
    assert p.wait(60) == 1, p.stderr()[-3000:]
    err = p.stderr()
    failed = sorted(e["unit"] for e in read_unit_log(log) if e["event"] == "end-failed")
    assert failed, err[-3000:]
    lines = err.splitlines()
    proto = [ln for ln in lines if PROTO_TEXT.search(ln)]
    print(f"{len(failed)} failed units; lines of proto text: {len(proto)}")
    assert proto == [], "\n".join(proto[:5])
    summary = next(i for i, ln in enumerate(lines) if "unit(s) not completed" in ln)
    per_unit = [ln for ln in lines[:summary] if re.search(r"unit tokenize/\d+ failed: ", ln)]
    assert sorted(re.findall(r"unit tokenize/(\d+) failed", ln)[0] for ln in per_unit) == failed, err[-3000:]
    for ln in per_unit:  # the error's type and message, on the one line
        assert re.search(r"failed: \w+: .*f\d\d\.jsonl", ln), ln


def test_a_workers_log_line_is_its_message_on_the_logger_of_who_logged_it() -> None:
    from refinery.runners.local_runner import BEAM_WORKER_LOG, WORKER_LOG, worker_log_record

    unit = "unit tokenize/00003 failed: InputError: /data/f03.jsonl: no such file, folder or glob match"
    assert worker_log_record(40, unit, "", "/src/refinery/transforms/stages.py:377") == (WORKER_LOG, 40, unit)
    beam = worker_log_record(40, "Error processing instruction bundle_6", "Traceback ...\nValueError: x\n",
                             "/venv/lib/python3.11/site-packages/apache_beam/runners/worker/sdk_worker.py:320")
    assert beam == (BEAM_WORKER_LOG, 40, "Error processing instruction bundle_6\nTraceback ...\nValueError: x")
    assert BEAM_WORKER_LOG.startswith("apache_beam.")  # the CLI's level for Beam's loggers applies to it
