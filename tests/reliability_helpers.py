"""Helpers of the reliability tests: corpora, killing a run, reading shards back, audit checks.

A run under test is a real ``refinery`` process started in its own session (process group),
with ``$REFINERY_UNIT_LOG`` pointing at an append-only log of unit start/end/skip events
(written by :func:`refinery.transforms.resumable.execute_unit`) and, in the kill loops,
``$REFINERY_TIMELINE`` at the same file (the driver's phase marks: ``main``, ``planned``,
``job_start``, ``submitted``...). Kills are triggered by that log, never by the time since
the launch: "the k-th unit start (or completed unit, or driver phase) of this attempt,
plus a seeded jitter", then ``SIGKILL`` to the whole process group (driver and Beam worker
processes alike). A kill is counted where it landed (the last event before it), so a busy
machine changes where a jittered kill lands, never whether the loop covers each stage:
the pickers aim from the run's own progress (its receipts, and the plan of the reference
run), not from the time a stage is expected to take.
"""
from __future__ import annotations

import atexit
import collections
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pytest
from helpers import gsm8k_texts, tree_digest, write_jsonl

from refinery.transforms.formats import shards
from refinery.transforms.io import rows, storage
from refinery.transforms.io.text import normalize_text

META = ".refinery"


# --- corpora -------------------------------------------------------------------------

def make_corpus(root: Path, files: int, docs_per_file: int, offset: int = 0) -> Path:
    """``files`` .jsonl files of real GSM8K text (unique documents), a few bad rows in the first."""
    texts = gsm8k_texts(files * docs_per_file, offset=offset)
    for k in range(files):
        rows = [{"id": f"{k}-{i}", "text": t} for i, t in enumerate(texts[k * docs_per_file:(k + 1) * docs_per_file])]
        write_jsonl(root / f"part-{k:02d}.jsonl", rows,
                    raw_lines={3: '{"id": "bad", "text": '} if k == 0 else None)
    return root


def expected_texts(corpus_root: Path, text_field: str = "text") -> collections.Counter[str]:
    """Normalized text of every accepted row of the inputs (a multiset)."""
    out: collections.Counter[str] = collections.Counter()
    for f in storage.expand_inputs([str(corpus_root)]):
        for _, rec, err in rows.iter_rows(f.path):
            if err is None and rec is not None and isinstance(rec.get(text_field), str):
                text = normalize_text(rec[text_field])
                if text:
                    out[text] += 1
    return out


# --- outputs -----------------------------------------------------------------------

def shard_texts(out: Path) -> collections.Counter[str]:
    """Every document in the shards listed by ``out/manifest.json``, decoded (a multiset)."""
    from refinery.transforms.formats.tiktoken_vocab import EOS_TOKEN_ID, get_encoding

    enc = get_encoding()
    manifest = json.loads((out / "manifest.json").read_text())
    found: collections.Counter[str] = collections.Counter()
    for s in manifest["shards"]:
        tokens = np.load(out / s["path"])
        for a, b in shards.read_idx(str(out / s["index_path"])):
            doc = tokens[a:b]
            assert doc[-1] == EOS_TOKEN_ID and EOS_TOKEN_ID not in doc[:-1]
            found[enc.decode(doc[:-1].tolist())] += 1
    return found


final_digest = tree_digest  # what the user gets: every file outside .refinery


def temp_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if storage.is_temp_name(p.name))


def current_receipts(out: Path) -> dict[str, bytes]:
    """Bytes of every receipt under the stage hashes of ``run.json`` (relative path -> bytes)."""
    try:
        info = json.loads((out / META / "run.json").read_text())
    except FileNotFoundError:
        return {}
    found: dict[str, bytes] = {}
    for st in info["stages"]:
        d = out / META / st["name"] / st["stage_hash"] / "receipts"
        if d.is_dir():
            for p in d.glob("*.json"):
                found[str(p.relative_to(out))] = p.read_bytes()
    return found


def completed(receipts: dict[str, bytes]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for k, v in receipts.items():
        try:
            if json.loads(v).get("status") == "completed":
                out[k] = v
        except ValueError:
            pass
    return out


# --- the unit log ------------------------------------------------------------------

def unit_events(lines: list[bytes] | list[str]) -> list[dict[str, Any]]:
    """The unit events of a unit log's lines (the driver's phase marks, for the time
    breakdown of bench/breakdown.py, left out)."""
    return [e for line in lines if line.strip() and (e := json.loads(line))["event"] != "phase"]


def read_unit_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return unit_events(path.read_text().splitlines())


def recomputed_units(events: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(stage, stage_hash, unit) of every unit that started again after a completed receipt
    of it had been written (in any earlier attempt). Must be empty."""
    done: set[tuple[str, str, str]] = set()
    bad: list[tuple[str, str, str]] = []
    for e in events:
        key = (e["stage"], e["stage_hash"], e["unit"])
        if e["event"] == "end-completed":
            done.add(key)
        elif e["event"] == "start" and key in done:
            bad.append(key)
    return bad


# --- running and killing -------------------------------------------------------------

def refinery_cmd(*args: object) -> list[str]:
    return [sys.executable, "-m", "refinery.beam_pipelines.cli", *map(str, args)]


def child_env(unit_log: Path, phases: bool = False, **extra: object) -> dict[str, str]:
    """This environment with ``$REFINERY_UNIT_LOG`` at ``unit_log`` and, with ``phases``, the
    driver's phase marks (``$REFINERY_TIMELINE``) appended to it too: what a kill aimed at a
    phase (``event="phase:NAME"``) waits for. (Not by default: a test that makes the unit log a
    FIFO must see units only.)"""
    env = dict(os.environ)
    env["REFINERY_UNIT_LOG"] = str(unit_log)
    if phases:
        env["REFINERY_TIMELINE"] = str(unit_log)
    env.pop("PYTEST_CURRENT_TEST", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


@dataclass
class Attempt:
    """One run of a command: its exit code, whether we killed it, and where it was then."""

    returncode: int
    killed: bool
    phase: str = ""                 # stage of the last unit event before the kill
    events_before_kill: list[dict[str, Any]] = field(default_factory=list)
    stderr: str = ""
    seconds: float = 0.0
    stop_seconds: float = 0.0       # from the signal until no process of the group was left


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process descended from it (by the parent pids in ``/proc``)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [pid], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _group_alive(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group."""
    alive = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(d))
    return alive


def wait_group_gone(pgid: int, timeout: float = 10.0) -> list[int]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        left = _group_alive(pgid)
        if not left:
            return []
        time.sleep(0.05)
    return _group_alive(pgid)


class Proc:
    """A started run: its pid (= its process group), ``poll()`` and ``wait()`` (exit codes
    as subprocess gives them: -9 for SIGKILL) and ``stderr()``."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._p = popen
        self.pid = popen.pid
        self._err = b""

    def poll(self) -> int | None:
        return self._p.poll()

    def wait(self, timeout: float) -> int:
        try:
            _, self._err = self._p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.pid, signal.SIGKILL)
            self._p.communicate()
            raise AssertionError(f"run {self._p.args!r} did not finish within {timeout}s") from None
        return int(self._p.returncode)

    def stderr(self) -> str:
        return self._err.decode(errors="replace")


class Run(Protocol):
    """A started run, as :func:`run_attempt` watches it: :class:`Proc` or :class:`ForkedProc`."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float) -> int: ...

    def stderr(self) -> str: ...


# where the next kill of a cycle lands: (k-th event or None for no kill, jitter after it, stage, event)
Pick = Callable[[random.Random, Path], tuple[int | None, float, str | None, str]]

# the driver's phase marks a kill in start-up is aimed at (refinery.transforms.io.timeline.PHASES):
# the command's code started, the plan written, the job about to be made, the pipeline about to run
STARTUP_PHASES = ("phase:main", "phase:planned", "phase:job_start", "phase:submitted")


def planned_units(out: Path) -> list[tuple[str, int]]:
    """(stage, units planned) of the finished run in ``out`` (its ``run.json``): the plan a
    run of the same command makes, known before that run has written its own."""
    stages = json.loads((out / META / "run.json").read_text())["stages"]
    return [(st["name"], int(st["units"])) for st in stages]


def stage_progress(out: Path, plan: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """(stage, completed units, planned units) of the run in ``out``, for the stages of
    ``plan`` (:func:`planned_units` of a reference run): the receipts say what is done, also
    before this run's ``run.json`` exists (then nothing is)."""
    done = completed(current_receipts(out))
    return [(name, sum(1 for k in done if f"/{name}/" in k), units) for name, units in plan]


def _is_event(e: dict[str, Any], event: str, stage: str | None) -> bool:
    """Whether unit-log line ``e`` is the ``event`` a kill waits for: a unit's ``start`` or
    ``end-completed`` (of ``stage``, if given), or ``phase:NAME``, the driver's phase mark."""
    if event.startswith("phase:"):
        return e["event"] == "phase" and e.get("phase") == event[len("phase:"):]
    return e["event"] == event and (stage is None or e.get("stage") == stage)


def spawn(cmd: list[str], env: dict[str, str]) -> Proc:
    """A fresh interpreter running ``cmd`` in a new session (its own process group)."""
    return Proc(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, start_new_session=True))


class ForkServer:
    """A process that has imported refinery, Beam and the tokenizer once and forks a child
    per run: the child starts a new session and runs ``refinery.beam_pipelines.cli.main``
    (the real command) with the given argv and environment. A fresh interpreter spends
    about 3 s importing Beam before its first unit; a forked one starts at once, so a
    kill loop of 20+ kills stays within seconds per kill. Only for in-process runners
    (``--runner direct``): Beam's multi-process workers are started by fresh interpreters.
    ``preload``: more modules to import once (e.g. torch and the inference modules)."""

    def __init__(self, workdir: Path, preload: tuple[str, ...] = ()) -> None:
        self.workdir = workdir
        self._p = subprocess.Popen([sys.executable, __file__, "--fork-server", *preload], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, cwd=str(Path(__file__).parent),
                                   # a PYTHONPATH given (a worktree's package) stays first for the children
                                   env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                       [p for p in (os.environ.get("PYTHONPATH"), str(Path(__file__).parent)) if p])})
        stdin, stdout = self._p.stdin, self._p.stdout
        assert stdin is not None and stdout is not None  # pipes
        self._stdin, self._stdout = stdin, stdout
        assert self._stdout.readline().strip() == "ready"
        self._n = 0

    def start(self, argv: list[str], env: dict[str, str]) -> ForkedProc:
        self._n += 1
        err = self.workdir / f"forked-{self._n}.stderr"
        self._stdin.write(json.dumps({"argv": argv, "env": env, "stderr": str(err)}) + "\n")
        self._stdin.flush()
        pid = json.loads(self._stdout.readline())["pid"]
        return ForkedProc(self, pid, err)

    def close(self) -> None:
        self._stdin.close()
        self._p.wait(timeout=30)


class ForkedProc:
    def __init__(self, server: ForkServer, pid: int, err: Path) -> None:
        self.server, self.pid, self._errfile = server, pid, err
        self._rc: int | None = None

    def poll(self) -> int | None:
        import select

        if self._rc is None:
            ready, _, _ = select.select([self.server._stdout], [], [], 0)
            if ready:
                self._rc = json.loads(self.server._stdout.readline())["exit"]
        return self._rc

    def wait(self, timeout: float) -> int:
        deadline = time.time() + timeout
        while (rc := self.poll()) is None:
            if time.time() > deadline:
                os.killpg(self.pid, signal.SIGKILL)
                raise AssertionError(f"forked run did not finish within {timeout}s")
            time.sleep(0.005)
        return rc

    def stderr(self) -> str:
        """What the run wrote ("" if it was killed before its fork opened the file)."""
        try:
            return self._errfile.read_text(errors="replace")
        except FileNotFoundError:
            return ""


_SERVER: list[ForkServer] = []


@pytest.fixture
def forks(tmp_path_factory: pytest.TempPathFactory) -> ForkServer:
    """The fork server shared by every reliability test of this session (started once)."""
    if not _SERVER:
        _SERVER.append(ForkServer(tmp_path_factory.mktemp("forks")))
        atexit.register(_SERVER[0].close)
    return _SERVER[0]


def _serve_forks(preload: list[str]) -> None:
    """The fork server's loop (see :class:`ForkServer`)."""
    import importlib
    import traceback

    from refinery.beam_pipelines import cli
    from refinery.transforms.formats.tiktoken_vocab import get_encoding

    for name in ("apache_beam", "apache_beam.runners.portability.fn_api_runner.fn_runner",
                 "refinery.transforms.prep.stages", "refinery.beam_pipelines.decon", "refinery.transforms.decon.stages",
                 *preload):
        importlib.import_module(name)  # imported once, shared by every forked run
    get_encoding()
    print("ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            rc = 1
            try:
                os.setsid()
                fd = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.environ.clear()
                os.environ.update(req["env"])
                import fsspec.config
                fsspec.config.set_conf_env(fsspec.config.conf)  # FSSPEC_* settings of this run
                sys.argv = ["refinery", *req["argv"]]
                rc = cli.main(req["argv"])
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
            except BaseException:  # noqa: BLE001 - reported through the exit code and stderr
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc or 0)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"exit": os.waitstatus_to_exitcode(status)}), flush=True)


HANG_S = 900.0  # a run that has not ended after this long hangs: a guard, not a speed check


def run_attempt(start: Callable[[], Run], unit_log: Path, kill_at_start: int | None = None, delay: float = 0.0,
                sig: int = signal.SIGKILL, stage: str | None = None, timeout: float = HANG_S,
                event: str = "start", group: bool = True) -> Attempt:
    """Start a run with ``start()`` (-> :class:`Proc` or :class:`ForkedProc`). If
    ``kill_at_start`` is given, send ``sig`` to its whole process group ``delay`` seconds
    after the k-th ``event`` of this attempt: a unit's ``start`` or ``end-completed`` (of
    ``stage`` if given), or ``phase:NAME``, a driver phase mark (the run's env from
    ``child_env(..., phases=True)``); k=0: ``delay`` seconds from the launch, which depends on
    the machine's speed (the kill loops do not use it). A run that finishes first is not
    killed. ``group=False`` signals the driver process alone (as Kubernetes does with SIGTERM).
    ``timeout``: the run is taken for hung after that long."""
    offset = unit_log.stat().st_size if unit_log.exists() else 0
    t0 = time.time()
    proc = start()

    def events() -> list[dict[str, Any]]:
        if not unit_log.exists():
            return []
        with open(unit_log, "rb") as f:
            f.seek(offset)
            return unit_events(f.read().splitlines())

    sent = False
    if kill_at_start is not None:
        trigger_at = t0 + delay if kill_at_start == 0 else None
        pos, tail, count = offset, b"", 0
        while proc.poll() is None and time.time() - t0 < timeout:
            if trigger_at is None and unit_log.exists():  # read only what was appended since
                with open(unit_log, "rb") as f:
                    f.seek(pos)
                    chunk = f.read()
                pos += len(chunk)
                *lines, tail = (tail + chunk).split(b"\n")
                for line in lines:
                    e = json.loads(line)
                    count += _is_event(e, event, stage)
                if count >= kill_at_start:
                    trigger_at = time.time() + delay
            if trigger_at is not None and time.time() >= trigger_at:
                try:
                    (os.killpg if group else os.kill)(proc.pid, sig)
                    sent = True
                    sent_at = time.time()
                except ProcessLookupError:
                    pass
                break
            time.sleep(0.0005)
    rc = proc.wait(timeout)
    killed = sent and rc != 0
    seen = events()
    stop_seconds = 0.0
    if sent:
        left = wait_group_gone(proc.pid)
        assert not left, f"processes of the signalled group still alive: {left}"
        stop_seconds = time.time() - sent_at
    phase = (seen[-1]["stage"] if seen else "startup") if killed else ""
    return Attempt(rc, killed, phase, seen, proc.stderr(), time.time() - t0, stop_seconds)


def kill_cycle(rng: random.Random, launch: Callable[[dict[str, str]], Run], out: Path, unit_log: Path,
               want: dict[str, str], outputs: list[str], max_kills: int, pick: Pick | None) -> list[str]:
    """Attempts on one output until a run exits 0, at most ``max_kills`` of them aimed by
    ``pick``; returns where each kill landed (``stage:event`` of the last unit event before
    it, or ``startup``)."""
    kills: list[str] = []
    assert pick is not None or max_kills == 0, "kills asked for, and no pick to place them"
    env = child_env(unit_log, phases=True)
    for _ in range(max_kills + 10):
        before = completed(current_receipts(out))
        aim = len(kills) < max_kills
        k, delay, stage, event = pick(rng, out) if pick is not None and aim else (None, 0.0, None, "start")
        a = run_attempt(lambda: launch(env), unit_log, kill_at_start=k, delay=delay, stage=stage, event=event)
        if os.environ.get("RELIABILITY_DEBUG"):
            print(f"aim k={k} stage={stage} event={event} delay={delay:.3f}: rc={a.returncode} "
                  f"after {a.seconds:.1f}s, last {a.events_before_kill[-1:]}")
        after = current_receipts(out)
        changed = [p for p, b in before.items() if after.get(p) != b]
        assert not changed, f"completed receipts rewritten or lost by a rerun: {changed[:5]}"
        assert recomputed_units(read_unit_log(unit_log)) == []
        got = final_digest(out)
        for name in outputs:  # never half-written under its final name
            if name in got:
                assert got[name] == want[name], f"{name} present but not the finished file"
        if a.killed:
            last = a.events_before_kill[-1] if a.events_before_kill else None
            kills.append(f"{last['stage']}:{last['event']}" if last else "startup")
            continue
        assert a.returncode == 0, a.stderr[-3000:]
        return kills
    raise AssertionError("the run never finished")


def write_figures(name: str, figures: dict[str, Any]) -> None:
    """Record a test's figures in ``$REFINERY_RELIABILITY_FIGURES`` (a JSON-lines file), if set."""
    path = os.environ.get("REFINERY_RELIABILITY_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": name, **figures}) + "\n")


if __name__ == "__main__" and sys.argv[1:2] == ["--fork-server"]:
    _serve_forks(sys.argv[2:])
