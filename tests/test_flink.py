"""refinery on a real Flink: an embedded Flink and a standalone session cluster.

- ``resolve_flink`` and the CLI: the cluster's version from its REST API, and one line
  (exit 2) for a cluster that does not answer, an unsupported or mismatched version, no
  job server jar and no way to download one, no Java.
- Embedded (``--flink_master=[local]``): generate, dedup and prep --exclude-duplicates give
  byte-identical outputs to the same command on the local runner (prep and decon run on the
  cluster below, and every command on Prism, the other portable runner, in ``test_prism.py``).
- Standalone: a JobManager and a TaskManager (2 slots) as separate JVMs plus a Beam worker
  pool (``--environment_type=EXTERNAL``), started from a Flink distribution unpacked from
  PyPI and stopped by their own pids. prep and decon give byte-identical outputs, Flink's
  REST API lists one FINISHED job per command, and the Beam counters reported back equal the units'
  receipts. Faults: the TaskManager killed with SIGKILL inside prep's tokenize stage, and
  refinery itself killed mid-job; in both cases the same command run again finishes with
  the same bytes, and no unit that had finished runs again.

The job server jar and the Flink distribution come from ``make test`` (``python -m
refinery.runners.flink_local fetch`` into ``.cache/flink``). Without Java, or without them,
these tests skip with one reason, unless ``REFINERY_REQUIRE_FLINK=1`` (set by ``.ci/run``),
which turns that into a failure.
"""
from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest
from helpers import GSM8K_TEST, gsm8k_rows, gsm8k_texts, write_jsonl
from reliability_helpers import (
    Proc,
    child_env,
    final_digest,
    read_unit_log,
    recomputed_units,
    refinery_cmd,
    spawn,
    temp_files,
    wait_group_gone,
)

from refinery.runners import RunnerOptionsError, flink_local, pipeline_args, prepare_run, tool_cache
from refinery.runners import flink as flink_mod

REQUIRED = os.environ.get("REFINERY_REQUIRE_FLINK") == "1"


def _unavailable(reason: str) -> NoReturn:
    if REQUIRED:
        pytest.fail(f"{reason} (REFINERY_REQUIRE_FLINK=1: CI must run the Flink tests)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def flink_jar() -> Path:
    """The fetched job server jar (Flink 1.19), or skip/fail with one reason."""
    if shutil.which("java") is None:
        _unavailable("Flink tests skipped: no Java")
    minor = flink_local.minor_version(flink_local.DEFAULT_FLINK)
    jar = flink_local.find_job_server_jar(minor)
    if jar is None:
        _unavailable(f"Flink tests skipped: no Flink {minor} job server jar in {flink_local.cache_dir()} "
                     "(make test fetches it: python -m refinery.runners.flink_local fetch)")
    return jar


def run_cli(*args: object, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``refinery ARGS`` in a fresh interpreter (a user's run: its job server JVMs end with it)."""
    return subprocess.run(refinery_cmd(*args), env=env or child_env(Path(os.devnull)), capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def ok(r: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stderr[-3000:]}"
    return r


def counters_logged(stderr: str) -> dict[str, dict[str, int]]:
    """stage -> the runner's counters, from ``-v``'s 'stage S: runner counters {...}' lines."""
    out: dict[str, dict[str, int]] = {}
    for stage, counters in re.findall(r"stage (\w+): runner counters (\{.*\})", stderr):
        for k, v in json.loads(counters).items():
            out.setdefault(stage, {})[k] = out.get(stage, {}).get(k, 0) + v
    return out


def receipt_counters(out: Path) -> dict[str, dict[str, int]]:
    """What the counters must be: per stage run on Beam, units completed and the sums of their
    receipts' integer stats."""
    info = json.loads((out / ".refinery" / "run.json").read_text())
    want: dict[str, dict[str, int]] = {}
    for st in info["stages"]:
        receipts = [json.loads(p.read_text()) for p in
                    sorted((out / ".refinery" / st["name"] / st["stage_hash"] / "receipts").glob("*.json"))]
        sums = {f"{st['name']}_units_completed": len(receipts)}
        for r in receipts:
            for k, v in r["stats"].items():
                if isinstance(v, int) and not isinstance(v, bool):
                    sums[f"{st['name']}_{k}"] = sums.get(f"{st['name']}_{k}", 0) + v
        want[st["name"]] = sums
    return want


# ---------------------------------------------------------------------------------------
# Before a run: version, jar, Java (no Flink needed)
# ---------------------------------------------------------------------------------------

class _FakeFlink(http.server.BaseHTTPRequestHandler):
    version = "1.20.1"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = json.dumps({"flink-version": self.version, "refresh-interval": 3000}).encode()
        self.send_response(200 if self.path == "/v1/config" else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a: Any) -> None:
        pass


FakeRest = tuple[str, Callable[[str], None]]  # a fake JobManager's host:port, and how to set its Flink version


@pytest.fixture
def fake_rest() -> Iterator[FakeRest]:
    """A stand-in for a JobManager's REST API: (host:port, set_version)."""
    class H(_FakeFlink):  # this fixture's own version
        pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def set_version(v: str) -> None:
        H.version = v

    yield f"127.0.0.1:{server.server_address[1]}", set_version
    server.shutdown()


@pytest.fixture
def java_present(monkeypatch: pytest.MonkeyPatch) -> None:
    """``java`` looks installed (these checks never start it)."""
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")  # the module flink.py calls


@pytest.fixture
def no_jars(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An empty jar cache and a Maven that does not answer."""
    monkeypatch.setenv(flink_local.CACHE_ENV, str(tmp_path / "cache"))
    dead = f"http://127.0.0.1:{tool_cache.free_port()}/beam-runners-flink-job-server.jar"
    monkeypatch.setattr(flink_mod, "beam_jar_path", lambda minor: (dead, str(tmp_path / "beam-cache" / "x.jar")))
    return dead


def test_version_comes_from_the_cluster(fake_rest: FakeRest, java_present: None,
                                        tmp_path: Path) -> None:
    master, set_version = fake_rest
    jar = tmp_path / "job-server.jar"
    jar.write_bytes(b"PK")
    args = pipeline_args("flink", 2, [f"--flink_master={master}", "--environment_type=EXTERNAL",
                                      "--environment_config=localhost:50000", f"--flink_job_server_jar={jar}"])
    assert "--flink_version=1.20" in prepare_run("flink", args)  # 1.20.1 -> the job server's 1.20
    set_version("2.2.0")
    assert "--flink_version=2.2" in prepare_run("flink", args)
    assert prepare_run("flink", [*args, "--flink_version=2.2"]).count("--flink_version=2.2") == 1  # given, matching
    with pytest.raises(RunnerOptionsError, match=r"--flink_version 1.20 does not match .* runs Flink 2.2.0"):
        prepare_run("flink", [*args, "--flink_version=1.20"])
    set_version("1.16.3")
    with pytest.raises(RunnerOptionsError, match=r"runs Flink 1.16.3, which this Beam does not support "
                                                 r"\(it supports Flink 1.19, 1.20"):
        prepare_run("flink", args)
    assert flink_mod.rest_url("jm:8081") == "http://jm:8081" and flink_local.minor_version("1.19.3") == "1.19"


def test_cached_jar_is_found_for_the_cluster_version(fake_rest: FakeRest, java_present: None, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    master, set_version = fake_rest
    monkeypatch.setenv(flink_local.CACHE_ENV, str(tmp_path))
    (tmp_path / "job-server").mkdir()
    for name in ("beam-runners-flink-1.20-job-server-2.61.0.jar", "beam-runners-flink-1.20-job-server-2.64.0.jar",
                 "beam-runners-flink-2.0-job-server-2.64.0.jar", "notes.jar"):
        (tmp_path / "job-server" / name).write_bytes(b"PK")
    assert flink_local.cached_flink_minors() == ["1.20", "2.0"]
    args = prepare_run("flink", pipeline_args("flink", None, [f"--flink_master={master}", "--environment_type=EXTERNAL",
                                                              "--environment_config=localhost:1"]))
    # the newest Beam version's jar for the cluster's Flink minor
    assert f"--flink_job_server_jar={tmp_path}/job-server/beam-runners-flink-1.20-job-server-2.64.0.jar" in args
    embedded = prepare_run("flink", pipeline_args("flink", None, []))  # [auto]: a fetched version, not a download
    assert "--flink_version=2.0" in embedded and any(a.endswith("flink-2.0-job-server-2.64.0.jar") for a in embedded)


def _one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], expected: str) -> None:
    from refinery.beam_pipelines.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(expected, err), err


def test_cli_says_what_is_missing_in_one_line(fake_rest: FakeRest, no_jars: str, small_corpus: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    master, set_version = fake_rest
    prep = ["prep", "--input", str(small_corpus), "--output", str(tmp_path / "out"), "--runner", "flink"]
    ext = ["--environment_type=EXTERNAL", "--environment_config=localhost:1"]
    dead = f"127.0.0.1:{tool_cache.free_port()}"
    _one_line_exit_2(capsys, [*prep, f"--flink_master={dead}", *ext],
                     rf"^refinery prep: the Flink cluster at http://{dead} does not answer \(.*\): start it, or fix "
                     r"--flink_master$")
    set_version("1.18.1")
    _one_line_exit_2(capsys, [*prep, f"--flink_master={master}", *ext], r"runs Flink 1.18.1, which this Beam does not")
    set_version("1.19.3")
    if shutil.which("java"):
        _one_line_exit_2(capsys, [*prep, f"--flink_master={master}", *ext],
                         r"no Flink 1.19 job server jar here and Beam cannot download it \(http://127.0.0.1:\d+/"
                         r".*\)\. Fetch one with 'python -m refinery.runners.flink_local fetch --flink 1.19'")
    monkeypatch.setenv("PATH", str(tmp_path / "no-java-here"))
    _one_line_exit_2(capsys, [*prep, "--flink_master=[local]"], r"needs Java 11 or newer .* 'java' is not on PATH")
    assert not (tmp_path / "out").exists()  # refused before anything was planned or written


def test_flink_local_runs_as_a_module_without_a_warning() -> None:
    """``python -m refinery.runners.flink_local`` (make flink-cache, the README): importing the
    package refinery.runners must not import flink_local first (runpy would warn)."""
    r = subprocess.run([sys.executable, "-m", "refinery.runners.flink_local", "--help"], capture_output=True,
                       text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and "usage: python -m refinery.runners.flink_local" in r.stdout
    assert r.stderr == ""


def test_unpack_takes_flink_folders_from_wheel_and_sdist(tmp_path: Path) -> None:
    import io
    import tarfile
    import zipfile

    wheel = tmp_path / "apache_flink-9.9.9-cp311-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name in ("pyflink/bin/jobmanager.sh", "pyflink/conf/config.yaml", "pyflink/datastream/x.py",
                     "pyflink/bin/../../escape.sh"):
            z.writestr(name, name)
    sdist = tmp_path / "apache-flink-libraries-9.9.9.tar.gz"
    with tarfile.open(sdist, "w:gz") as t:
        for name in ("apache-flink-libraries-9.9.9/deps/lib/flink-dist-9.9.9.jar",
                     "apache-flink-libraries-9.9.9/deps/plugins/m/m.jar", "apache-flink-libraries-9.9.9/setup.py"):
            data = name.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    home = tmp_path / "home"
    flink_local._unpack(wheel, home, ("pyflink/",))
    flink_local._unpack(sdist, home, ("apache-flink-libraries-9.9.9/deps/",))
    got = sorted(str(p.relative_to(home)) for p in home.rglob("*") if p.is_file())
    assert got == ["bin/jobmanager.sh", "conf/config.yaml", "lib/flink-dist-9.9.9.jar", "plugins/m/m.jar"]
    assert not (tmp_path / "escape.sh").exists()


# ---------------------------------------------------------------------------------------
# Embedded Flink: same bytes as the local runner
# ---------------------------------------------------------------------------------------

EMBEDDED = ["--runner", "flink", "--flink_master=[local]", "--workers", "2"]


def test_embedded_flink_generate_equals_local(flink_jar: Path, tmp_path: Path) -> None:
    from engine_fixtures import write_harmony_checkpoint

    ckpt = write_harmony_checkpoint(tmp_path / "ckpt", num_hidden_layers=1)
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"id": f"g{i}", "text": t} for i, t in enumerate(gsm8k_texts(5))])
    argv = ["generate", "--checkpoint", ckpt, "--input", docs, "--max-tokens", "4", "--dtype", "float32", "--device",
            "cpu", "--max-seq-len", "256", "--max-batch", "4", "--docs-per-unit", "2", "--temperature", "0.8",
            "--seed", "7", "--no-share-model"]
    flink, local = tmp_path / "flink", tmp_path / "local"
    r = ok(run_cli(*argv, "--output", flink, "--no-progress", "-v", *EMBEDDED))
    assert "'--flink-master', '[local]'" in r.stderr  # Beam started the Flink job server, embedded
    assert r.stderr.count("Really starting service") == 1  # one job server JVM for all the command's jobs
    for stage, counters in counters_logged(r.stderr).items():  # and Flink reported the units back
        assert counters == receipt_counters(flink)[stage], stage
    ok(run_cli(*argv, "--output", local, "--no-progress", "--runner", "direct"))
    assert final_digest(flink) == final_digest(local)
    assert len((flink / "generations.jsonl").read_text().splitlines()) == 5


def test_embedded_flink_decon_succeeds_quietly(flink_jar: Path, small_corpus: Path, tmp_path: Path) -> None:
    """A successful embedded-Flink run printed `ERROR ... Failed to read inputs in the data
    plane` and gRPC CANCELLED tracebacks (the SDK workers' data plane hung up at the job's end),
    then exited 0: now only its own lines (runners/shutdown_noise.py)."""
    ev = write_jsonl(tmp_path / "gsm8k" / "test.jsonl", [{"id": f"q{i}", "question": t}
                                                          for i, t in enumerate(gsm8k_texts(40))])
    r = ok(run_cli("decon", "--eval", ev, "--eval-text-field", "question", "--train", small_corpus,
                   "--output", tmp_path / "d", "--ngrams", "13",
                   "--no-progress", *EMBEDDED))
    assert "data plane" not in r.stderr and "Traceback" not in r.stderr and "ERROR" not in r.stderr, r.stderr
    assert "decon done" in r.stdout + r.stderr


def test_embedded_flink_span_mode_prep_equals_local(flink_jar: Path, tmp_path: Path) -> None:
    """``prep --exclude-mode span`` on embedded Flink writes the bytes the local runner does."""
    test = gsm8k_rows("test")[:20]
    docs = [{"id": f"d{i}", "text": t + (" " + test[i // 10]["question"] + " " + t if i % 10 == 0 else "")}
            for i, t in enumerate(gsm8k_texts(120))]
    train = write_jsonl(tmp_path / "train" / "t.jsonl", docs)
    ev = write_jsonl(tmp_path / "gsm8k" / "test.jsonl", [{"id": f"q{i}", "text": r["question"]}
                                                          for i, r in enumerate(test)])
    ok(run_cli("decon", "--eval", ev, "--train", train.parent, "--output", tmp_path / "d", "--ngrams", "13",
               "--runner", "direct", "--no-progress"))
    argv = ["prep", "--input", train.parent, "--num-shards", "2", "--exclude-overlaps", tmp_path / "d",
            "--exclude-mode", "span", "--exclude-window", "10", "--exclude-min-chars", "20"]
    ok(run_cli(*argv, "--output", tmp_path / "flink", "--no-progress", *EMBEDDED))
    ok(run_cli(*argv, "--output", tmp_path / "local", "--no-progress", "--runner", "direct"))
    assert final_digest(tmp_path / "flink") == final_digest(tmp_path / "local")
    cut = json.loads((tmp_path / "flink" / "manifest.json").read_text())["excluded_overlaps"]
    assert cut["mode"] == "span" and cut["rows_split"] >= 12 and cut["pieces"] >= 12


def test_embedded_flink_dedup_and_its_exclusion_equal_local(flink_jar: Path, tmp_path: Path) -> None:
    """``refinery dedup`` (every stage: sign, bucket, verify, components, report) and ``prep
    --exclude-duplicates`` of its list on embedded Flink write the bytes the local runner does."""
    texts = gsm8k_texts(150)
    docs = [{"id": f"d{i}", "text": t if i % 10 else texts[i // 10]} for i, t in enumerate(texts)]
    corpus = write_jsonl(tmp_path / "corpus" / "a.jsonl", docs[:80]).parent
    write_jsonl(corpus / "b.jsonl", docs[80:])
    argv = ["dedup", "--input", corpus, "--partitions", "3", "--slice-mb", "0.02"]
    ok(run_cli(*argv, "--output", tmp_path / "flink", "--no-progress", *EMBEDDED))
    ok(run_cli(*argv, "--output", tmp_path / "local", "--no-progress", "--runner", "direct"))
    assert final_digest(tmp_path / "flink") == final_digest(tmp_path / "local")
    assert len((tmp_path / "flink" / "dup_list.jsonl").read_text().splitlines()) == 13  # (row 100 copies row 10: gone)
    prep = ["prep", "--input", corpus, "--num-shards", "2", "--exclude-duplicates", tmp_path / "local"]
    ok(run_cli(*prep, "--output", tmp_path / "pf", "--no-progress", *EMBEDDED))
    ok(run_cli(*prep, "--output", tmp_path / "pl", "--no-progress", "--runner", "direct"))
    assert final_digest(tmp_path / "pf") == final_digest(tmp_path / "pl")
    assert json.loads((tmp_path / "pf" / "manifest.json").read_text())["rows"]["excluded"] == 13


# ---------------------------------------------------------------------------------------
# A standalone session cluster
# ---------------------------------------------------------------------------------------

class LoggedCluster(flink_local.LocalFlinkCluster):
    """A local cluster whose SDK workers append unit events to ``unit_log``."""

    unit_log: Path


@pytest.fixture(scope="module")
def cluster(flink_jar: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoggedCluster]:
    """A JobManager, a TaskManager with 2 slots and a Beam worker pool, as separate processes;
    SDK workers append unit events to the cluster's unit log (``cluster.unit_log``)."""
    home = flink_local.flink_home()
    if home is None:
        _unavailable(f"Flink tests skipped: no Flink {flink_local.DEFAULT_FLINK} distribution in "
                     f"{flink_local.cache_dir()} (python -m refinery.runners.flink_local fetch)")
    work = tmp_path_factory.mktemp("flink-cluster")
    unit_log = work / "units.log"
    c = LoggedCluster(home, work, slots=2, worker_env={"REFINERY_UNIT_LOG": str(unit_log)})
    c.unit_log = unit_log
    c.start()
    try:
        yield c
    finally:
        c.stop()
        assert all(p.poll() is not None for p in c.procs.values())  # stopped by their own pids


def _finished_jobs_since(cluster: LoggedCluster, t0: float) -> list[dict[str, Any]]:
    jobs = [j for j in cluster.jobs() if j["start-time"] / 1000 >= t0 - 1]
    deadline = time.time() + 60
    while any(j["state"] not in ("FINISHED", "FAILED", "CANCELED") for j in jobs) and time.time() < deadline:
        time.sleep(1)
        jobs = [j for j in cluster.jobs() if j["start-time"] / 1000 >= t0 - 1]
    return jobs


def test_cluster_prep_and_decon_equal_local(cluster: LoggedCluster, corpus: Path,
                                            tmp_path: Path) -> None:
    on = ["--runner", "flink", "--workers", "2", "--no-progress", "-v", *cluster.beam_args()]
    t0 = time.time()
    r = ok(run_cli("prep", "--input", corpus, "--output", tmp_path / "prep", "--num-shards", "3", "--unit-mb", "0",
                   *on))
    assert r.stderr.count("Really starting service") == 1  # one job server
    ok(run_cli("prep", "--input", corpus, "--output", tmp_path / "prep-local", "--num-shards", "3", "--unit-mb", "0",
               "--runner", "direct", "--no-progress"))
    assert final_digest(tmp_path / "prep") == final_digest(tmp_path / "prep-local")
    counters = counters_logged(r.stderr)
    want = receipt_counters(tmp_path / "prep")
    assert set(counters) == {"tokenize", "pack", "manifest"}  # every stage: steps of the one job
    for stage in counters:  # the Beam counters the Flink job reported equal the receipts' stats
        assert counters[stage] == want[stage], stage
    manifest = json.loads((tmp_path / "prep" / "manifest.json").read_text())
    assert counters["tokenize"]["tokenize_tokens"] == manifest["total_tokens"] > 0
    assert counters["tokenize"]["tokenize_accepted"] == manifest["total_documents"]

    train = write_jsonl(tmp_path / "train" / "t.jsonl",
                        [{"id": f"t{i}", "text": t} for i, t in enumerate(gsm8k_texts(80))])
    decon = ["decon", "--eval", GSM8K_TEST, "--eval-text-field", "question", "--train", train.parent, "--ngrams", "8"]
    r = ok(run_cli(*decon, "--output", tmp_path / "decon", *on))
    ok(run_cli(*decon, "--output", tmp_path / "decon-local", "--runner", "direct", "--no-progress"))
    assert final_digest(tmp_path / "decon") == final_digest(tmp_path / "decon-local")
    counters = counters_logged(r.stderr)
    want = receipt_counters(tmp_path / "decon")
    assert set(counters) == {"eval", "index", "scan", "reduce", "merge"}
    for stage in counters:
        assert counters[stage] == want[stage], stage
    assert counters["scan"]["scan_verified_hits"] > 0  # the training rows hold GSM8K text: overlaps found

    jobs = _finished_jobs_since(cluster, t0)
    assert len(jobs) == 2 and all(j["state"] == "FINISHED" for j in jobs), jobs  # one job per command


def _big_corpus(root: Path, files: int = 6, docs: int = 1500) -> Path:
    """Files big enough that one tokenize unit takes a visible moment (unique ids, GSM8K text)."""
    texts = gsm8k_texts(docs)
    for k in range(files):
        write_jsonl(root / f"part-{k}.jsonl", [{"id": f"{k}-{i}", "text": t} for i, t in enumerate(texts)])
    return root


def _wait_for(log: Path, stage: str, event: str, count: int, proc: Proc, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if sum(e["stage"] == stage and e["event"] == event for e in read_unit_log(log)) >= count:
            return
        assert proc.poll() is None, f"the run ended first:\n{proc.stderr()[-2000:]}"
        time.sleep(0.02)
    raise AssertionError(f"no {count} x {event} of {stage} within {timeout}s")


def _completed_before(log: Path) -> tuple[set[tuple[str, str]], int]:
    """(stage, unit) of every unit completed so far, and how many events the log holds."""
    events = read_unit_log(log)
    return {(e["stage"], e["unit"]) for e in events if e["event"] == "end-completed"}, len(events)


def _restarted(log: Path, done: set[tuple[str, str]], after: int) -> list[dict[str, Any]]:
    """Start events, after the first ``after`` events, of units in ``done``: must be none."""
    return [e for e in read_unit_log(log)[after:] if e["event"] == "start" and (e["stage"], e["unit"]) in done]


@pytest.fixture(scope="module")
def big_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("big")
    corpus = _big_corpus(root / "corpus")
    ref = root / "ref"
    ok(run_cli("prep", "--input", corpus, "--output", ref, "--num-shards", "2", "--unit-mb", "0", "--runner", "direct",
               "--no-progress"))
    return corpus, final_digest(ref)


def _prep_on_cluster(cluster: LoggedCluster, corpus: Path, out: Path) -> tuple[list[object], Proc]:
    """(argv, process) of ``refinery prep`` on the cluster, once it has finished 2 tokenize units."""
    cluster.unit_log.write_text("")
    argv: list[object] = ["prep", "--input", corpus, "--output", out, "--num-shards", "2", "--unit-mb", "0",
                          "--runner", "flink",
            "--workers", "1", "--no-progress", *cluster.beam_args()]
    proc = spawn(refinery_cmd(*argv), child_env(Path(os.devnull)))
    _wait_for(cluster.unit_log, "tokenize", "end-completed", 2, proc)
    return argv, proc


def _assert_finished_as_reference(cluster: LoggedCluster, out: Path, want: dict[str, str],
                                  done_at_kill: set[tuple[str, str]], at_kill: int) -> None:
    """Same bytes as the reference; no unit that had finished ran again; no temp files left."""
    assert final_digest(out) == want
    events = read_unit_log(cluster.unit_log)
    assert len(done_at_kill) >= 2 and recomputed_units(events) == []  # no unit ran again once it had finished
    assert _restarted(cluster.unit_log, done_at_kill, at_kill) == []
    assert temp_files(out) == []


def test_taskmanager_killed_mid_tokenize_then_rerun(cluster: LoggedCluster,
                                                    big_reference: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    corpus, want = big_reference
    out = tmp_path / "out"
    argv, proc = _prep_on_cluster(cluster, corpus, out)
    _wait_for(cluster.unit_log, "tokenize", "start", 3, proc)
    cluster.kill("taskmanager", signal.SIGKILL)
    try:
        done_at_kill, at_kill = _completed_before(cluster.unit_log)
        rc = proc.wait(timeout=180)
        err = proc.stderr()
        assert rc == 1, err[-3000:]
        # the error names the first stage with units left: tokenize, unless the tokenize units (a
        # tenth of a second each with the fast encoder) all finished before the kill landed
        tokenized = {u for stage, u in _completed_before(cluster.unit_log)[0] if stage == "tokenize"}
        stage = "tokenize" if len(tokenized) < len(list(corpus.glob("*.jsonl"))) else "pack"
        tail = err.strip().splitlines()
        assert re.search(rf"^refinery prep: stage {stage}: the Beam job failed: ", tail[-3]), err[-3000:]
        assert tail[-2].startswith("Finished units are kept") and tail[-1].startswith("  refinery prep --input")
        assert "Traceback" not in err
    finally:
        cluster.restart_taskmanager()  # whatever failed above, the next test needs a TaskManager
    ok(run_cli(*argv, env=child_env(Path(os.devnull)), timeout=300))
    _assert_finished_as_reference(cluster, out, want, done_at_kill, at_kill)


def test_refinery_killed_mid_job_then_rerun(cluster: LoggedCluster,
                                            big_reference: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    corpus, want = big_reference
    out = tmp_path / "out"
    t0 = time.time()
    argv, proc = _prep_on_cluster(cluster, corpus, out)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and its job server JVM; the Flink job lives on
    assert wait_group_gone(proc.pid) == []
    done_at_kill, at_kill = _completed_before(cluster.unit_log)
    ok(run_cli(*argv, env=child_env(Path(os.devnull)), timeout=300))
    jobs = _finished_jobs_since(cluster, t0)  # the orphaned job too: it skips what the rerun did
    assert all(j["state"] == "FINISHED" for j in jobs), jobs
    _assert_finished_as_reference(cluster, out, want, done_at_kill, at_kill)


def _processes_mentioning(text: str) -> list[int]:
    """Pids of the processes whose command line mentions ``text``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def test_flink_local_up_stops_its_cluster_on_sigterm(flink_jar: Path, tmp_path: Path) -> None:
    """SIGTERM is Ctrl-C for ``flink_local up``: the JobManager, the TaskManager and the worker
    pool it started go with it (they used to be left running)."""
    if flink_local.flink_home() is None:
        _unavailable(f"Flink tests skipped: no Flink {flink_local.DEFAULT_FLINK} distribution in "
                     f"{flink_local.cache_dir()} (python -m refinery.runners.flink_local fetch)")
    work = tmp_path / "up"
    proc = subprocess.Popen([sys.executable, "-m", "refinery.runners.flink_local", "up", "--workdir", str(work)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        assert proc.stdout is not None  # a pipe
        for line in proc.stdout:
            lines.append(line)
            if "is up" in line:
                break
        assert any("is up" in ln for ln in lines), "".join(lines)
        assert len(_processes_mentioning(str(work))) >= 2  # its JobManager and TaskManager (and pool)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        deadline = time.time() + 30
        while _processes_mentioning(str(work)) and time.time() < deadline:
            time.sleep(0.5)
        assert _processes_mentioning(str(work)) == []
    finally:
        if proc.poll() is None:
            proc.kill()
