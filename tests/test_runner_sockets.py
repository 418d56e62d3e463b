"""No listening socket of a running ``refinery prep`` lets another user in (issue 46, item 1).

With ``--runner prism`` or ``--runner portable`` Beam started a worker pool (LOOPBACK) in the
refinery process that listened on every interface and took any caller: another local user
pointed a pipeline at it (``ExternalEnvironment("HOST:PORT")``) and their code ran inside
refinery, as its user. Here a real prep runs under each runner (``local`` as the control),
paused in its first unit (its unit log is a FIFO nobody reads yet), and uid 65534 (nobody):

- connects to every listening TCP port and unix socket of the run's process tree (Prism's
  process included): each is refused (connection refused, permission denied) or its gRPC
  call is rejected with ``PERMISSION_DENIED`` before any handler runs;
- runs a planted pipeline against each TCP port of the refinery process (an
  ``ExternalEnvironment`` whose one step writes a marker file): no marker appears. The same
  planted pipeline against Beam's own pool, in this test process, does write it (so a
  refusal here is not a probe that cannot succeed).

Acting as uid 65534 needs root (CI runs the suite as root): as another user the test fails
with that reason rather than pass having checked nothing. Prism's tests' rule applies to its
binary (``make prism-cache``; skipped without it unless ``REFINERY_REQUIRE_PRISM=1``).
"""
from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from helpers import gsm8k_texts, write_jsonl
from reliability_helpers import process_tree, refinery_cmd
from test_flink import flink_jar  # noqa: F401  # the fixture: the jar, or skip (fail under CI)

from refinery.runners import prism_local, tool_cache
from refinery.runners.same_user import SameUserOnly, peer_address, refusal, socket_owner

NOBODY = 65534
REQUIRED_PRISM = os.environ.get("REFINERY_REQUIRE_PRISM") == "1"

# What uid 65534 runs (python -c): argv[1] is a JSON list of [kind, address] to connect to,
# argv[2] a JSON list of "HOST:PORT" to plant a pipeline at, argv[3] the marker file's path.
# Prints {"connect": {address: outcome}, "planted": {address: outcome}}.
PROBE = r"""
import json, os, socket, sys
import grpc

POOL_METHOD = "/org.apache.beam.model.fn_execution.v1.BeamFnExternalWorkerPool/StopWorker"

def call(target):
    try:
        grpc.insecure_channel(target).unary_unary(POOL_METHOD)(b"", timeout=10)
        return "served"
    except grpc.RpcError as e:
        return "grpc " + e.code().name

def connect(kind, address):
    if kind == "unix":
        s = socket.socket(socket.AF_UNIX)
        where, target = address, "unix:" + address
    else:
        host, port = address.rsplit(":", 1)
        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        where, target = (host, int(port)), (f"[{host}]" if ":" in host else host) + ":" + port
    try:
        s.settimeout(5)
        s.connect(where)
    except PermissionError:
        return "permission denied"
    except ConnectionRefusedError:
        return "refused"
    except OSError as e:
        return "error " + type(e).__name__
    finally:
        s.close()
    answer = call(target)
    return tls(where) if answer == "grpc UNAVAILABLE" and kind == "tcp" else answer

def tls(where):  # a port that is not plain gRPC: does it serve HTTP, or a TLS client without the run's key?
    import ssl
    s = socket.socket(socket.AF_INET6 if ":" in where[0] else socket.AF_INET)
    s.settimeout(5)
    try:
        s.connect(where)
        s.sendall(b"GET /v1/config HTTP/1.0\r\n\r\n")
        head = s.recv(300)
        if head.startswith(b"HTTP/") and not (b" 301 " in head.split(b"\r\n")[0] and b"location: https://"
                                              in head.lower()):  # Flink's TLS REST server redirects plain HTTP
            return "http served: " + head.split(b"\r\n")[0].decode(errors="replace")
    except OSError:
        pass
    finally:
        s.close()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    s = socket.socket(socket.AF_INET6 if ":" in where[0] else socket.AF_INET)
    s.settimeout(5)
    try:
        s.connect(where)
        with ctx.wrap_socket(s) as t:
            t.sendall(b"GET /v1/config HTTP/1.0\r\n\r\n")
            data = t.recv(64)
        return "tls served: " + repr(data[:40]) if data else "tls closed"
    except ssl.SSLError as e:
        return "tls refused: " + (e.reason or type(e).__name__)
    except OSError as e:
        return "tls closed: " + type(e).__name__
    finally:
        s.close()

def plant(address, marker):
    import apache_beam as beam
    from apache_beam.runners.portability.fn_api_runner import fn_runner
    from apache_beam.transforms import environments

    def touch(path):
        with open(path, "w") as f:
            f.write(f"{os.getuid()} {os.getpid()}")
        return path

    env = environments.ExternalEnvironment(address)
    try:
        with beam.Pipeline(runner=fn_runner.FnApiRunner(default_environment=env)) as p:
            p | beam.Create([marker]) | beam.Map(touch)
        return "ran"
    except Exception as e:
        return "failed: " + f"{type(e).__name__}: {e}"[:300]

targets, planted, marker = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
out = {"connect": {a: connect(k, a) for k, a in targets}, "planted": {a: plant(a, marker) for a in planted}}
print(json.dumps(out))
"""

# Run first, as root: what the probe needs is imported (one in-process pipeline loads what Beam
# imports lazily), then the process becomes uid 65534 with no groups, as setpriv would make it.
# Imported before the change, the venv need not be readable by 65534 (a fresh clone in a 0700
# folder is not), and every socket the probe opens after it is 65534's.
AS_NOBODY = rf"""
import os
import apache_beam as beam
import grpc
from apache_beam.runners.portability.fn_api_runner import fn_runner
from apache_beam.transforms import environments
for warm in (environments.EmbeddedPythonGrpcEnvironment.default(), None):  # gRPC's server side too
    with beam.Pipeline(runner=fn_runner.FnApiRunner(default_environment=warm)) as p:
        p | beam.Create([1]) | beam.Map(lambda x: x)
from apache_beam.runners.portability.fn_api_runner import worker_handlers  # noqa: F401  # ExternalEnvironment's
os.setgroups([])
os.setresgid({NOBODY}, {NOBODY}, {NOBODY})
os.setresuid({NOBODY}, {NOBODY}, {NOBODY})
assert os.getuid() == os.geteuid() == {NOBODY} and os.getgroups() == []
import tempfile
tempfile.tempdir = None  # chosen again, as 65534 (a folder root chose may not be 65534's to write)
"""

REFUSED = ("refused", "permission denied", "grpc PERMISSION_DENIED", "tls refused", "tls closed")


def _as_nobody(targets: list[tuple[str, str]], planted: list[str], marker: Path, scratch: Path) -> dict[str, Any]:
    if os.getuid() != 0:
        pytest.fail(f"this test acts as uid {NOBODY} and needs root to (CI runs the suite as root); as uid "
                    f"{os.getuid()} it would check nothing")
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(scratch), "TMPDIR": str(scratch),
           "PYTHONDONTWRITEBYTECODE": "1"}
    r = subprocess.run([sys.executable, "-c", AS_NOBODY + PROBE, json.dumps(targets), json.dumps(planted),
                        str(marker)], env=env, capture_output=True, text=True, timeout=120, cwd=str(scratch))
    assert r.returncode == 0, r.stderr[-3000:]
    answer: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return answer


# --- the sockets of a process tree ----------------------------------------------------

def _socket_inodes(pid: int) -> set[str]:
    found: set[str] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(target[len("socket:["):-1])
    return found


def _ip(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    return str(ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))))


def listening(pids: list[int]) -> list[tuple[int, str, str]]:
    """(pid, kind, address) of every listening socket the processes hold: ``tcp`` with
    ``IP:PORT``, or ``unix`` with its path."""
    owner = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    out = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in owner:  # 0A: TCP_LISTEN
                host, port = f[1].split(":")
                out.append((owner[f[9]], "tcp", f"{_ip(host)}:{int(port, 16)}"))
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        f = line.split(maxsplit=7)
        if len(f) == 8 and f[3] == "00010000" and f[6] in owner:  # __SO_ACCEPTCON: listening
            out.append((owner[f[6]], "unix", f[7]))
    return sorted(set(out))


def _dialable(address: str) -> str:
    """``HOST:PORT`` a client on this machine dials for a listening ``IP:PORT``."""
    host, port = address.rsplit(":", 1)
    ip = ipaddress.ip_address(host)
    return f"[{ip}]:{port}" if ip.version == 6 and not ip.is_unspecified else \
        f"127.0.0.1:{port}" if ip.is_unspecified else f"{ip}:{port}"


def _waiting_on_fifo(pids: list[int]) -> bool:
    """Whether a thread of the processes waits to open a FIFO (its unit log)."""
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                if Path(f"/proc/{pid}/task/{tid}/wchan").read_text().strip() == "wait_for_partner":
                    return True
            except OSError:
                continue
    return False


# --- a prep paused in its first unit ---------------------------------------------------

@pytest.fixture
def scratch() -> Iterator[Path]:
    """A short private TMPDIR for the run (unix socket paths are limited to 107 bytes), and
    a folder uid 65534 may write in."""
    d = Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp"))
    (d / "tmp").mkdir()
    (d / "nobody").mkdir()
    os.chmod(d / "nobody", 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _corpus(root: Path) -> Path:
    texts = gsm8k_texts(120)
    for k in range(3):
        write_jsonl(root / f"f{k}.jsonl", [{"text": t} for t in texts[k * 40:(k + 1) * 40]])
    return root


def _probe_paused_prep(tmp_path: Path, scratch: Path,
                       runner_args: list[str]) -> tuple[list[tuple[int, str, str]], dict[str, Any], Path]:
    """Run ``refinery prep`` with ``runner_args``, paused at its first unit; probe it as uid
    65534; let it finish (exit 0). (listening sockets, the probe's answer, the marker path)."""
    fifo = scratch / "units.fifo"
    os.mkfifo(fifo)
    marker = tmp_path / "planted-code-ran"
    env = {**os.environ, "TMPDIR": str(scratch / "tmp"), "REFINERY_UNIT_LOG": str(fifo)}
    env.pop("PYTEST_CURRENT_TEST", None)
    cmd = refinery_cmd("prep", "--input", _corpus(tmp_path / "c"), "--output", tmp_path / "o", "--no-progress",
                       "--unit-mb", "0", *runner_args)
    p = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         start_new_session=True)
    err: list[bytes] = []
    reader = threading.Thread(target=lambda: err.append(p.stderr.read() if p.stderr else b""), daemon=True)
    reader.start()
    fd = None
    try:
        deadline = time.time() + 120
        while not _waiting_on_fifo(process_tree(p.pid)):
            assert p.poll() is None, f"prep ended before its first unit: {b''.join(err).decode()[-3000:]}"
            assert time.time() < deadline, "prep did not reach its first unit within 120 s"
            time.sleep(0.05)
        sockets = listening(process_tree(p.pid))
        targets = [(kind, addr) for _, kind, addr in sockets]
        planted = [_dialable(addr) for pid, kind, addr in sockets if pid == p.pid and kind == "tcp"]
        answer = _as_nobody(targets, planted, marker, scratch / "nobody")
        fd = os.open(fifo, os.O_RDWR)  # the unit log is read: the run goes on (its lines fit in the pipe)
        assert p.wait(180) == 0, b"".join(err).decode(errors="replace")[-3000:]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        if fd is not None:
            os.close(fd)
        reader.join(10)
    return sockets, answer, marker


def _assert_nothing_let_in(sockets: list[tuple[int, str, str]], answer: dict[str, Any], marker: Path) -> None:
    print(f"listening: {sockets}\nas uid {NOBODY}: {answer}")
    assert not marker.exists(), f"uid {NOBODY}'s planted pipeline ran in the run (uid, pid): {marker.read_text()}"
    let_in = {a: outcome for a, outcome in answer["connect"].items() if not outcome.startswith(REFUSED)}
    assert let_in == {}, f"uid {NOBODY} was let in: {let_in}"
    assert all(v.startswith("failed") for v in answer["planted"].values()), answer["planted"]


def test_planted_code_runs_in_beams_own_pool(tmp_path: Path, scratch: Path) -> None:
    """The probe can succeed: Beam's LOOPBACK pool as Beam starts it (every interface, any
    caller) runs uid 65534's planted pipeline in this process, as this process's user."""
    from apache_beam.runners.worker.worker_pool_main import BeamFnExternalWorkerPoolServicer

    address, server = BeamFnExternalWorkerPoolServicer.start()
    marker = tmp_path / "planted-code-ran"
    try:
        answer = _as_nobody([], [address], marker, scratch / "nobody")
    finally:
        server.stop(1)
    assert answer["planted"] == {address: "ran"}, answer
    assert marker.read_text().split()[0] == str(os.getuid())  # it ran as this user, not as nobody


def test_a_local_run(tmp_path: Path, scratch: Path) -> None:
    sockets, answer, marker = _probe_paused_prep(tmp_path, scratch, ["--runner", "local", "--workers", "2"])
    assert sockets and all(kind == "unix" for _, kind, _ in sockets), sockets
    _assert_nothing_let_in(sockets, answer, marker)


def test_a_portable_run(tmp_path: Path, scratch: Path) -> None:
    """The embedded job service: no worker pool and no Fn API server (an EMBEDDED environment)."""
    sockets, answer, marker = _probe_paused_prep(tmp_path, scratch, ["--runner", "portable"])
    _assert_nothing_let_in(sockets, answer, marker)
    assert [s for s in sockets if s[1] == "tcp"] == [], sockets


def test_a_prism_run(tmp_path: Path, scratch: Path) -> None:
    """Prism's job port (Prism's process) and the LOOPBACK pool (the refinery process)."""
    if prism_local.find_prism() is None:
        reason = f"Prism socket test skipped: {prism_local.missing_reason()}"
        if REQUIRED_PRISM:
            pytest.fail(f"{reason} (REFINERY_REQUIRE_PRISM=1: CI must run the Prism tests)")
        pytest.skip(reason)
    sockets, answer, marker = _probe_paused_prep(tmp_path, scratch, ["--runner", "prism"])
    assert answer["planted"], f"no TCP port of the refinery process to plant a pipeline at: {sockets}"
    _assert_nothing_let_in(sockets, answer, marker)


# --- the check itself, without Beam --------------------------------------------------------

# rows of /proc/net/tcp and tcp6 (sl, local, remote, state, queues, timer, retransmits, uid, timeout, inode)
TABLE = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 100 1
   1: 0100007F:D431 0100007F:1F90 01 00000000:00000000 00:00000000 00000000 65534        0 101 1
   2: 0100007F:D432 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 102 1
"""
V6_LOOPBACK, V6_MAPPED = "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"
TABLE6 = f"""  sl  local_address remote_address st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: {V6_LOOPBACK}:D433 {V6_LOOPBACK}:1F90 01 00000000:00000000 00:00000000 00000000  1000  0 103 1
   1: {V6_MAPPED}:D434 {V6_MAPPED}:1F90 01 00000000:00000000 00:00000000 00000000  1001  0 104 1
"""


def test_peer_addresses() -> None:
    assert peer_address("ipv4:127.0.0.1:54321") == (ipaddress.ip_address("127.0.0.1"), 54321)
    assert peer_address("ipv6:[::1]:80") == (ipaddress.ip_address("::1"), 80)
    assert peer_address("ipv6:%5B::ffff:127.0.0.1%5D:80") == (ipaddress.ip_address("127.0.0.1"), 80)
    assert peer_address("unix:/tmp/x.sock") is None
    assert peer_address("ipv4:nonsense") is None


def test_the_owner_of_a_peer_socket_and_who_is_refused() -> None:
    loop, six = ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")
    tables = [TABLE, TABLE6]
    assert socket_owner(loop, 0xD431, tables) == NOBODY
    assert socket_owner(loop, 0xD432, tables) == 0
    assert socket_owner(loop, 0x1F90, tables) is None  # the listening socket is nobody's peer
    assert socket_owner(six, 0xD433, tables) == 1000
    assert socket_owner(loop, 0xD434, tables) == 1001  # an IPv4-mapped row
    assert refusal("ipv4:127.0.0.1:54321", 0, lambda: tables) == (
        "refinery: a call from ipv4:127.0.0.1:54321 (uid 65534) refused: only uid 0 is served")
    assert refusal("ipv4:127.0.0.1:54322", 0, lambda: tables) is None
    assert refusal("ipv6:[::1]:54323", 1000, lambda: tables) is None
    assert "no socket of this machine" in (refusal("ipv4:10.1.2.3:54322", 0, lambda: tables) or "")
    assert refusal("unix:", 0, lambda: tables) is None
    assert SameUserOnly().uid == os.getuid()


# --- Prism's build: the patch that makes it listen privately --------------------------------

def _fake_module(root: Path, server_go: str) -> Path:
    root.mkdir(parents=True)
    (root / "go.mod").write_text("module github.com/apache/beam/sdks/v2\n")
    (root / "go.sum").write_text("")
    worker_go = 'x := W{endpoint: "localhost:" + p,}\n'
    for rel, text in ((prism_local._SERVER_GO, server_go), (prism_local._WORKER_GO, worker_go)):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


SERVER_GO = ('import ("fmt"; "net"; "os")\n// NewServer acquires the indicated port.\nfunc NewServer(port int) {\n'
             '\tlis, err := net.Listen("tcp", fmt.Sprintf(":%d", port))\n}\n'
             'func (s *Server) Endpoint() string {\n\treturn "localhost"\n}\n')


def test_prism_is_built_patched_to_listen_privately(tmp_path: Path) -> None:
    module = _fake_module(tmp_path / "module", SERVER_GO)
    copy = prism_local.patched_module(module, tmp_path / "copy")
    server = (copy / prism_local._SERVER_GO).read_text()
    assert 'net.Listen("tcp", fmt.Sprintf(":%d"' not in server and "lis, err := refineryListen(port)" in server
    assert f'os.Getenv("{prism_local.SOCKET_ENV}")' in server and 'net.Listen("unix", path)' in server
    assert '"127.0.0.1:%d"' in server and 'return "unix:" + s.lis.Addr().String()' in server
    assert '"unix:" + lis.Addr().String()' in (copy / prism_local._WORKER_GO).read_text()
    assert (module / prism_local._SERVER_GO).read_text() == SERVER_GO  # the module itself is untouched

    changed = _fake_module(tmp_path / "changed", SERVER_GO.replace('":%d"', '"0.0.0.0:%d"'))  # another Beam
    with pytest.raises(prism_local.BuildError, match=r"server\.go: refinery's Prism patch does not apply .*"
                                                     r"finds it 0 times"):
        prism_local.patched_module(changed, tmp_path / "copy2")


def test_the_patch_applies_to_the_module_of_the_installed_beam(tmp_path: Path) -> None:
    """Where Go has the module of the installed Beam (``make prism-cache`` downloaded it)."""
    gomodcache = os.environ.get("GOMODCACHE") or str(Path.home() / "go" / "pkg" / "mod")
    version = prism_local.module_version(tool_cache.installed_beam_version())
    module = Path(gomodcache) / f"{prism_local.MODULE.replace('/v2', '')}/v2@{version}"
    if not module.is_dir():
        pytest.skip(f"no {module} (Go's module cache of Beam {version})")
    copy = prism_local.patched_module(module, tmp_path / "copy")
    assert "refineryListen" in (copy / prism_local._SERVER_GO).read_text()


@pytest.mark.usefixtures("flink_jar")
def test_a_flink_run(tmp_path: Path, scratch: Path) -> None:
    """An embedded Flink: Beam's job server JVM, patched (:mod:`refinery.runners.flink_private`):
    its job, artifact, expansion and Fn API servers on loopback for this uid only, the embedded
    Flink's REST and blob servers behind TLS with a key only this user reads. Before: 10 TCP
    ports on ``[::]`` and one on loopback, 9 answering gRPC to uid 65534, and Flink's REST
    server (which takes jobs) among the 2 others."""
    sockets, answer, marker = _probe_paused_prep(tmp_path, scratch, ["--runner", "flink"])
    _assert_nothing_let_in(sockets, answer, marker)
