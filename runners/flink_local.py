"""A Flink on this machine: Beam's Flink job server jar, a Flink distribution, a session cluster.

A user with internet access needs none of this for ``--runner flink``: Beam downloads its
job server jar itself. This module is for machines that reach package registries but not
the web (CI, air-gapped build hosts), for the test suite, and for ``make flink-demo``.

- :func:`fetch_job_server`: Beam's Flink job server jar
  (``beam-runners-flink-<flink>-job-server-<beam>.jar``) through ``mvn``: the published jar
  when Maven serves it, else the same shaded jar built by ``maven-shade-plugin`` from the
  published runner library ``beam-runners-flink-<flink>`` and its dependencies (main class
  ``FlinkJobServerDriver``, service files merged), for the installed Beam version first,
  then for :data:`FALLBACK_BEAM_JAVA`.
- :func:`fetch_flink`: a Flink distribution (``FLINK_HOME``: ``bin/ conf/ lib/ opt/
  plugins/``) unpacked from the PyPI packages ``apache-flink`` and
  ``apache-flink-libraries``; they are never installed (they pin an old apache-beam).
- :class:`LocalFlinkCluster`: a standalone session cluster, a JobManager and a TaskManager
  as separate JVMs, plus a Beam worker pool for ``--environment_type=EXTERNAL`` (Python SDK
  workers without Docker), each started in its own process group and stopped by its own
  pid.

Everything lands in :func:`cache_dir` (``$REFINERY_FLINK_CACHE``, else a source checkout's
git-ignored ``.cache/flink``, else ``~/.cache/refinery/flink``), where ``--runner flink``
looks for a job server jar (:func:`find_job_server_jar`). Command line::

    python -m refinery.runners.flink_local fetch [--flink 1.19.3]  # jar + distribution
    python -m refinery.runners.flink_local up                       # a cluster until Ctrl-C
    python -m refinery.runners.flink_local demo --input DIR --output DIR
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Callable

from . import tool_cache
from .flink_private import JarPatchError, is_patched, patch_jar
from .tool_cache import free_port, installed_beam_version

CACHE_ENV = "REFINERY_FLINK_CACHE"
# The Flink distribution fetched by default. Its minor must be one the job server supports;
# 1.19 is the newest minor whose Beam runner library resolves, with all its dependencies,
# from the Maven mirror this project's machines reach.
DEFAULT_FLINK = "1.19.3"
# Beam versions to build a job server from when the installed one's is not served, per
# Flink minor (newest first). A Beam job server speaks the portable job API to older and
# newer Python SDKs alike; the tests run this pairing end to end.
FALLBACK_BEAM_JAVA = {"1.19": ["2.62.0"]}
BEAM_GROUP = "org.apache.beam"
JAR_RE = re.compile(r"^beam-runners-flink-(?P<minor>\d+\.\d+)-job-server-(?P<beam>\d+\.\d+\.\d+)\.jar$")


def minor_version(version: str) -> str:
    """``1.19.3`` -> ``1.19``; ``2.2`` -> ``2.2``."""
    return ".".join(version.split(".")[:2])


def cache_dir() -> Path:
    """Where fetched jars and distributions live: ``$REFINERY_FLINK_CACHE``; else, in a source
    checkout, its git-ignored ``.cache/flink``; else ``~/.cache/refinery/flink``."""
    return tool_cache.cache_dir("flink", CACHE_ENV)


def _version_key(v: str) -> tuple[Any, ...]:
    return tuple(int(x) if x.isdigit() else 0 for x in v.split("."))


def job_server_jars(cache: Path | None = None) -> list[tuple[str, str, Path]]:
    """(flink minor, beam version, path) of every job server jar in the cache."""
    folder = (cache or cache_dir()) / "job-server"
    out = []
    for p in sorted(folder.glob("*.jar")) if folder.is_dir() else []:
        m = JAR_RE.match(p.name)
        if m:
            out.append((m["minor"], m["beam"], p))
    return out


def cached_flink_minors(cache: Path | None = None) -> list[str]:
    """The Flink minors with a job server jar in the cache, oldest first."""
    return sorted({minor for minor, _, _ in job_server_jars(cache)}, key=_version_key)


def find_job_server_jar(flink_minor: str, cache: Path | None = None) -> Path | None:
    """The cached job server jar for ``flink_minor``: the installed Beam version's if there,
    else the newest; None if there is none."""
    jars = [(beam, p) for minor, beam, p in job_server_jars(cache) if minor == flink_minor]
    if not jars:
        return None
    same = [p for beam, p in jars if beam == installed_beam_version()]
    return same[0] if same else max(jars, key=lambda bp: _version_key(bp[0]))[1]


def flink_home(version: str = DEFAULT_FLINK, cache: Path | None = None) -> Path | None:
    """``FLINK_HOME`` of a fetched distribution, or None."""
    home = (cache or cache_dir()) / f"flink-{version}"
    return home if (home / "bin" / "jobmanager.sh").exists() and (home / "lib").is_dir() else None


# ---------------------------------------------------------------------------------------
# Fetching
# ---------------------------------------------------------------------------------------

class FetchError(RuntimeError):
    """A jar or distribution could not be fetched; the message says what was tried."""


def _run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)


def _mvn() -> str:
    mvn = shutil.which("mvn")
    if not mvn:
        raise FetchError("mvn (Apache Maven) is not on PATH: it fetches Beam's Flink job server from Maven Central")
    return mvn


SHADE_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <!-- Beam's Flink job server jar, shaded from the published runner library (what Beam's own
       build does with Gradle's shadow plugin): written by refinery.runners.flink_local -->
  <groupId>refinery.local</groupId>
  <artifactId>beam-runners-flink-{minor}-job-server</artifactId>
  <version>{beam}</version>
  <properties><project.build.sourceEncoding>UTF-8</project.build.sourceEncoding></properties>
  <dependencies>
    <dependency>
      <groupId>org.apache.beam</groupId><artifactId>beam-runners-flink-{minor}</artifactId><version>{beam}</version>
    </dependency>
    <dependency>
      <groupId>org.slf4j</groupId><artifactId>slf4j-jdk14</artifactId><version>1.7.30</version>
    </dependency>
  </dependencies>
  <build><plugins><plugin>
    <groupId>org.apache.maven.plugins</groupId><artifactId>maven-shade-plugin</artifactId><version>3.6.0</version>
    <executions><execution><phase>package</phase><goals><goal>shade</goal></goals><configuration>
      <createDependencyReducedPom>false</createDependencyReducedPom>
      <filters><filter><artifact>*:*</artifact><excludes>
        <exclude>META-INF/*.SF</exclude><exclude>META-INF/*.DSA</exclude><exclude>META-INF/*.RSA</exclude>
      </excludes></filter></filters>
      <transformers>
        <transformer implementation="org.apache.maven.plugins.shade.resource.ServicesResourceTransformer"/>
        <transformer implementation="org.apache.maven.plugins.shade.resource.ManifestResourceTransformer">
          <mainClass>org.apache.beam.runners.flink.FlinkJobServerDriver</mainClass>
        </transformer>
      </transformers>
    </configuration></execution></executions>
  </plugin></plugins></build>
</project>
"""


def _published_jar(minor: str, beam: str, dest: Path) -> str | None:
    """Copy the published job server jar to ``dest``; None if done, else why not."""
    artifact = f"{BEAM_GROUP}:beam-runners-flink-{minor}-job-server:{beam}"
    r = _run([_mvn(), "-q", "-B", "dependency:copy", f"-Dartifact={artifact}", f"-DoutputDirectory={dest.parent}"])
    return None if r.returncode == 0 and dest.exists() else "not served"


def _shaded_jar(minor: str, beam: str, dest: Path) -> str | None:
    """Build the job server jar from the runner library into ``dest``; None if done, else why not."""
    build = dest.parent.parent / "build" / f"flink-{minor}-beam-{beam}"
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir(parents=True)
    (build / "pom.xml").write_text(SHADE_POM.format(minor=minor, beam=beam))
    r = _run([_mvn(), "-q", "-B", "package"], cwd=build)
    built = build / "target" / dest.name
    if r.returncode != 0 or not built.exists():
        errors = [ln for ln in (r.stdout + r.stderr).splitlines() if "ERROR" in ln]
        shutil.rmtree(build, ignore_errors=True)
        return (errors[0] if errors else f"mvn exited {r.returncode}")[:300]
    tmp = dest.with_suffix(".jar.tmp")
    shutil.copyfile(built, tmp)
    os.replace(tmp, dest)
    shutil.rmtree(build, ignore_errors=True)
    return None


def fetch_job_server(flink_minor: str, beam_versions: list[str] | None = None, cache: Path | None = None,
                     log: Callable[[str], object] = print) -> Path:
    """Beam's Flink job server jar for ``flink_minor`` in the cache (fetched once); raises
    :class:`FetchError` saying what was tried. ``beam_versions``: the Beam versions to try,
    default the installed one, then :data:`FALLBACK_BEAM_JAVA`."""
    found = find_job_server_jar(flink_minor, cache)
    if found:
        return private_job_server(str(found), cache, log)
    folder = (cache or cache_dir()) / "job-server"
    folder.mkdir(parents=True, exist_ok=True)
    versions = beam_versions or [installed_beam_version(), *FALLBACK_BEAM_JAVA.get(flink_minor, [])]
    tried = []
    for beam in dict.fromkeys(versions):
        dest = folder / f"beam-runners-flink-{flink_minor}-job-server-{beam}.jar"
        for how, fetch in (("published jar", _published_jar), ("shaded from beam-runners-flink", _shaded_jar)):
            log(f"Flink {flink_minor} job server, Beam {beam}: trying the {how} ...")
            why = fetch(flink_minor, beam, dest)
            if why is None:
                log(f"  -> {dest}")
                return private_job_server(str(dest), cache, log)
            tried.append(f"Beam {beam} {how}: {why}")
    raise FetchError(f"no Flink {flink_minor} job server could be fetched ({'; '.join(tried)})")


def private_job_server(jar: str, cache: Path | None = None, log: Callable[[str], object] = print) -> Path:
    """The job server ``jar`` (a path, or a URL Beam downloads into its own jar cache), patched
    to serve this user only (:mod:`.flink_private`): the jar itself when it carries the patch,
    else a patched copy of the same name in the cache's ``job-server`` folder (made once, about
    20 s). Raises :class:`~.flink_private.JarPatchError`."""
    if "://" in jar:
        from apache_beam.utils.subprocess_server import JavaJarServer

        jar = JavaJarServer.local_jar(jar)
    path = Path(jar)
    if not path.is_file():
        raise JarPatchError(f"{path}: no such job server jar")
    if is_patched(path):
        return path
    dest = (cache or cache_dir()) / "job-server" / path.name
    if dest.resolve() != path.resolve() and is_patched(dest):
        return dest
    patch_jar(path, dest, log=log)
    return dest


def _pip_download(args: list[str], dest: Path) -> Path:
    before = set(dest.iterdir())
    r = _run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), *args])
    new = sorted(set(dest.iterdir()) - before)
    if r.returncode != 0 or not new:
        raise FetchError(f"pip download {' '.join(args)} failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return new[0]


def fetch_flink(version: str = DEFAULT_FLINK, cache: Path | None = None,
                log: Callable[[str], object] = print) -> Path:
    """``FLINK_HOME`` of Flink ``version``, unpacked from PyPI's ``apache-flink`` wheel (bin,
    conf) and ``apache-flink-libraries`` (lib, opt, plugins) into the cache once."""
    home = flink_home(version, cache)
    if home:
        return home
    root = cache or cache_dir()
    home = root / f"flink-{version}"
    with tempfile.TemporaryDirectory(dir=root if root.exists() else None) as tmp_dir:
        tmp = Path(tmp_dir)
        log(f"Flink {version}: downloading apache-flink and apache-flink-libraries from PyPI ...")
        # the scripts are the same in every wheel of a release: take the CPython 3.11 Linux one
        wheel = _pip_download(["--only-binary=:all:", "--platform", "manylinux2014_x86_64", "--python-version", "3.11",
                               "--implementation", "cp", f"apache-flink=={version}"], tmp)
        libs = _pip_download([f"apache-flink-libraries=={version}"], tmp)
        staging = tmp / "home"
        _unpack(wheel, staging, ("pyflink/",))
        _unpack(libs, staging, ("pyflink/", f"apache-flink-libraries-{version}/deps/",
                                f"apache_flink_libraries-{version}/deps/"))
        if not (staging / "bin" / "jobmanager.sh").exists() or not (staging / "lib").is_dir():
            raise FetchError(f"Flink {version}: the PyPI packages hold no bin/jobmanager.sh or lib/")
        for script in (staging / "bin").iterdir():
            script.chmod(0o755)
        shutil.rmtree(home, ignore_errors=True)
        home.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, home)
    log(f"  -> FLINK_HOME={home}")
    return home


FLINK_DIRS = ("bin", "conf", "lib", "opt", "plugins")


def _unpack(archive: Path, dest: Path, prefixes: tuple[str, ...]) -> None:
    """Members of a wheel/zip or sdist/tar.gz under one of ``prefixes``, for the Flink
    folders (:data:`FLINK_DIRS`) only, into ``dest`` with the prefix removed."""
    import tarfile

    def target(name: str) -> Path | None:
        for prefix in prefixes:
            if name.startswith(prefix):
                rel = name[len(prefix):]
                if rel.split("/", 1)[0] in FLINK_DIRS and ".." not in rel.split("/"):
                    return dest / rel
        return None

    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as z:
            for info in z.infolist():
                path = target(info.filename)
                if path and not info.is_dir():
                    path.parent.mkdir(parents=True, exist_ok=True)
                    with z.open(info) as src, open(path, "wb") as out:
                        shutil.copyfileobj(src, out, 1 << 20)
    else:
        with tarfile.open(archive) as t:
            for member in t:
                path = target(member.name)
                if path and member.isfile() and (data := t.extractfile(member)) is not None:  # a file: never None
                    path.parent.mkdir(parents=True, exist_ok=True)
                    with data, open(path, "wb") as out:
                        shutil.copyfileobj(data, out, 1 << 20)


# ---------------------------------------------------------------------------------------
# A standalone session cluster
# ---------------------------------------------------------------------------------------

@dataclass
class LocalFlinkCluster:
    """A Flink session cluster on this machine: JobManager, TaskManager (``slots`` slots)
    and a Beam worker pool, each a process group of its own, on free loopback ports.

    ``python``: the interpreter whose environment the SDK workers use (its folder is put
    first on the worker pool's PATH: the pool starts ``python`` from there); ``worker_env``:
    extra environment variables for the SDK workers; ``conf``: Flink settings (given as
    ``-D`` dynamic properties, over the distribution's ``conf/``). Logs go to ``workdir/log``.
    """

    home: Path
    workdir: Path
    slots: int = 2
    python: str = sys.executable
    worker_env: dict[str, Any] = field(default_factory=dict)
    rest_port: int = 0
    pool_port: int = 0
    rpc_port: int = 0
    # a lost TaskManager is noticed within seconds (Flink's default heartbeat timeout is 50 s)
    conf: dict[str, Any] = field(default_factory=lambda: {"heartbeat.interval": 2000, "heartbeat.timeout": 15000})
    procs: dict[str, Any] = field(default_factory=dict)

    @property
    def master(self) -> str:
        return f"localhost:{self.rest_port}"

    @property
    def web_ui(self) -> str:
        return f"http://localhost:{self.rest_port}"

    def beam_args(self) -> list[str]:
        """What ``refinery ... --runner flink`` needs to run on this cluster."""
        return [f"--flink_master={self.master}", "--environment_type=EXTERNAL",
                f"--environment_config=127.0.0.1:{self.pool_port}"]

    def _flink_env(self) -> dict[str, Any]:
        log = self.workdir / "log"
        log.mkdir(parents=True, exist_ok=True)
        return {**os.environ, "FLINK_HOME": str(self.home), "FLINK_CONF_DIR": str(self.home / "conf"),
                "FLINK_LOG_DIR": str(log), "FLINK_PID_DIR": str(self.workdir)}

    def _dynamic(self) -> list[str]:
        tmp = self.workdir / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        props = {
            "jobmanager.rpc.address": "localhost", "jobmanager.bind-host": "localhost",
            "jobmanager.rpc.port": self.rpc_port, "rest.address": "localhost", "rest.bind-address": "localhost",
            "rest.port": self.rest_port, "taskmanager.host": "localhost", "taskmanager.bind-host": "localhost",
            "taskmanager.numberOfTaskSlots": self.slots, "parallelism.default": self.slots,
            "io.tmp.dirs": tmp, "web.tmpdir": tmp, "blob.storage.directory": tmp, **self.conf,
        }
        return [arg for k, v in props.items() for arg in ("-D", f"{k}={v}")]

    def _start(self, name: str, cmd: list[str], env: dict[str, Any]) -> None:
        out = open(self.workdir / "log" / f"{name}.out", "ab")
        self.procs[name] = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        out.close()

    def start_taskmanager(self) -> None:
        self._start("taskmanager", [str(self.home / "bin" / "taskmanager.sh"), "start-foreground", *self._dynamic()],
                    self._flink_env())

    def taskmanager_ids(self) -> list[str]:
        return [tm["id"] for tm in self._get("/v1/taskmanagers")["taskmanagers"]]

    def restart_taskmanager(self, timeout: float = 90.0) -> None:
        """Start a new TaskManager after the old one died, and wait until it is the only one
        registered (the JobManager forgets a dead one at its heartbeat timeout)."""
        old = set(self.taskmanager_ids())
        self.start_taskmanager()
        deadline = time.time() + timeout
        while time.time() < deadline:
            ids = self.taskmanager_ids()
            if len(ids) == 1 and ids[0] not in old and self.overview().get("slots-available", 0) >= self.slots:
                return
            time.sleep(0.5)
        raise RuntimeError(f"no new TaskManager registered within {timeout:.0f}s; see {self.workdir / 'log'}")

    def start(self, timeout: float = 90.0) -> "LocalFlinkCluster":
        """Start the three processes and wait until the TaskManager's slots are registered."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.rest_port = self.rest_port or free_port()
        self.pool_port = self.pool_port or free_port()
        self.rpc_port = self.rpc_port or free_port()
        env = self._flink_env()
        self._start("jobmanager", [str(self.home / "bin" / "jobmanager.sh"), "start-foreground", *self._dynamic()], env)
        self.start_taskmanager()
        bin_dir = os.path.dirname(self.python)
        pool_env = {**os.environ, **self.worker_env, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
        # Beam's worker_pool_main, on loopback and for this user only (it runs whatever code it is sent)
        self._start("worker_pool", [self.python, "-m", "refinery.runners.worker_pool",
                                    f"--service_port={self.pool_port}"], pool_env)
        self.wait_for_slots(timeout)
        return self

    def _get(self, path: str) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.web_ui}{path}", timeout=5) as r:
            answer: dict[str, Any] = json.loads(r.read())
            return answer

    def overview(self) -> dict[str, Any]:
        return self._get("/v1/overview")

    def jobs(self) -> list[dict[str, Any]]:
        """Flink's job overview: name, state, start/end time, ... of every job."""
        jobs: list[dict[str, Any]] = self._get("/v1/jobs/overview")["jobs"]
        return jobs

    def wait_for_slots(self, timeout: float = 90.0) -> None:
        """Wait until ``slots`` task slots are registered; RuntimeError naming the log folder if not."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"Flink's {name} exited with {p.returncode}; see {self.workdir / 'log'}")
            try:
                o = self.overview()
                if o.get("taskmanagers", 0) >= 1 and o.get("slots-total", 0) >= self.slots:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the Flink cluster did not come up within {timeout:.0f}s; see {self.workdir / 'log'}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal one of the processes (and its group), and wait for it to end."""
        p = self.procs.get(name)
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=15)

    def stop(self) -> None:
        """Stop the worker pool, the TaskManager and the JobManager, by their own pids."""
        for name in ("worker_pool", "taskmanager", "jobmanager"):
            self.kill(name, signal.SIGTERM)

    def __enter__(self) -> "LocalFlinkCluster":
        try:
            return self.start()
        except BaseException:  # a failed or interrupted start: stop what was started
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------

def _fetch_all(flink_version: str, beam_versions: list[str] | None) -> tuple[Path, Path]:
    jar = fetch_job_server(minor_version(flink_version), beam_versions)
    return jar, fetch_flink(flink_version)


def _up(args: argparse.Namespace) -> int:
    _, home = _fetch_all(args.flink, None)
    cluster = LocalFlinkCluster(home, Path(args.workdir or tempfile.mkdtemp(prefix="refinery-flink-")), args.slots)
    try:  # Ctrl-C or SIGTERM at any point, start-up included: the cluster is stopped on the way out
        with cluster:
            print(f"Flink {args.flink} is up: web UI {cluster.web_ui} (logs in {cluster.workdir / 'log'})\n"
                  f"run on it with:\n  refinery prep ... --runner flink {' '.join(cluster.beam_args())}\n"
                  "Ctrl-C stops it.", flush=True)
            while all(p.poll() is None for p in cluster.procs.values()):
                time.sleep(1)
            print("a cluster process exited; stopping", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        return 0


def _stop_on_sigterm() -> None:
    """SIGTERM (``kill``, a supervisor, a CI timeout) stops the cluster as Ctrl-C does: the
    ``with`` block unwinds and every process it started is stopped."""
    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupt)


def _demo(args: argparse.Namespace) -> int:
    _, home = _fetch_all(args.flink, None)
    workdir = Path(tempfile.mkdtemp(prefix="refinery-flink-"))
    try:
        return _demo_on(args, home, workdir)
    except KeyboardInterrupt:
        print("interrupted: the cluster is stopped", file=sys.stderr)
        return 130


def _demo_on(args: argparse.Namespace, home: Path, workdir: Path) -> int:
    with LocalFlinkCluster(home, workdir, args.slots) as cluster:
        print(f"Flink {args.flink} session cluster up: open {cluster.web_ui} for Flink's web UI "
              f"(the jobs stay listed until the cluster stops)", flush=True)
        cmd = [sys.executable, "-m", "refinery.beam_pipelines.cli", "prep", "--input", args.input, "--output",
               args.output, "--dataset", "sample", "--num-shards", "4", "--runner", "flink", *cluster.beam_args()]
        print("$ refinery " + " ".join(cmd[3:]), flush=True)
        rc = subprocess.call(cmd)
        if rc == 0:
            rc = subprocess.call([sys.executable, "-m", "refinery.beam_pipelines.cli", "verify",
                                  str(Path(args.output) / "manifest.json"), "--checksums"])
        for job in cluster.jobs():
            print(f"  Flink job {job['jid']} {job['name']}: {job['state']} in {job['duration'] / 1000:.1f}s")
        if args.keep:
            print(f"the cluster stays up until Ctrl-C: {cluster.web_ui}", flush=True)
            while all(p.poll() is None for p in cluster.procs.values()):
                time.sleep(1)
        elif args.hold:
            print(f"holding the cluster for {args.hold}s: {cluster.web_ui}", flush=True)
            time.sleep(args.hold)
        print("stopping the cluster" + ("" if args.keep or args.hold else
                                        " (--keep keeps it and its web UI up until Ctrl-C)"), flush=True)
    return rc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m refinery.runners.flink_local", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="fetch Beam's Flink job server jar and a Flink distribution into the cache")
    u = sub.add_parser("up", help="start a local session cluster and a worker pool until Ctrl-C (or SIGTERM)")
    d = sub.add_parser("demo", help="start a cluster, run refinery prep on it, verify, stop")
    pt = sub.add_parser("patch", help="patch a Flink job server jar in place to serve this user only "
                        "(see refinery.runners.flink_private; fetch does it to what it fetches)")
    pt.add_argument("jar", type=Path, help="the job server jar")
    for s in (f, u, d):
        s.add_argument("--flink", default=DEFAULT_FLINK, help=f"Flink version (default {DEFAULT_FLINK})")
    f.add_argument("--beam-version", action="append", help="Beam version(s) of the job server to try "
                   "(default: the installed one, then a known-good fallback)")
    f.add_argument("--jar-only", action="store_true", help="only the job server jar (an embedded Flink needs no more)")
    for s in (u, d):
        s.add_argument("--slots", type=int, default=2, help="task slots of the TaskManager (default 2)")
    u.add_argument("--workdir", help="logs and temp files (default: a new temp folder)")
    d.add_argument("--input", required=True, help="the corpus to prepare")
    d.add_argument("--output", required=True, help="where the shards go")
    d.add_argument("--hold", type=int, default=0, help="keep the cluster up this many seconds after the run")
    d.add_argument("--keep", action="store_true", help="keep the cluster (and its web UI) up after the run, "
                   "until Ctrl-C")
    args = p.parse_args(argv)
    _stop_on_sigterm()
    try:
        if args.cmd == "patch":
            counts = patch_jar(args.jar)
            print(f"{args.jar}: " + (f"patched ({sum(counts.values())} server builder calls)" if counts
                                     else "already patched"))
            return 0
        if args.cmd == "fetch":
            jar = fetch_job_server(minor_version(args.flink), args.beam_version)
            home = None if args.jar_only else fetch_flink(args.flink)
            print(f"cache: {cache_dir()}\n  job server: {jar}" + (f"\n  FLINK_HOME: {home}" if home else ""))
            return 0
        return _up(args) if args.cmd == "up" else _demo(args)
    except (FetchError, JarPatchError, RuntimeError) as e:
        print(f"flink_local {args.cmd}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
