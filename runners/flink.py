"""``flink``: Beam's FlinkRunner, on a Flink cluster on-prem or an embedded Flink.

Our defaults (a flag you give wins):

- ``--runner=FlinkRunner``.
- ``--parallelism=N`` from ``--workers N`` (Flink's default parallelism otherwise).
- ``--environment_type=DOCKER`` when ``--flink_master`` names a cluster: each task manager
  starts SDK worker containers. Give ``--sdk_container_image=REGISTRY/refinery-cpu:TAG``
  (``containers/Dockerfile.cpu``, which has this package); it becomes
  ``--environment_config=IMAGE``, the flag Beam reads for a portable job's DOCKER image
  (Beam ignores ``--sdk_container_image`` outside Dataflow). Without an image, Beam's
  stock SDK image is used and ``--setup_file`` (added then) makes each worker
  pip-install this package at start, which needs PyPI access from the task managers.
  ``EXTERNAL`` (``--environment_config=HOST:50000``, a worker pool beside each task
  manager: ``python -m apache_beam.runners.worker.worker_pool_main --service_port=50000``)
  and ``PROCESS`` are the alternatives without Docker.
- The job server's JVM gets the ``--add-opens`` flags Beam's own tests give it on Java 17
  (:data:`JVM_OPENS`), unless ``--job_server_jvm_properties`` is given.
- Checkpointing stays off (Flink's and Beam's default): these are batch jobs; a failed job
  is resumed by re-running the command, and receipts skip the units that finished.

Before a real run (not a ``--dry-run``), :func:`resolve_flink` checks what Beam would
otherwise report as a Java stack trace, and says it in one line instead:

- the cluster answers on its REST API, and its Flink version (``/v1/config``) becomes
  ``--flink_version`` (the job server's Flink minor must equal the cluster's), or the
  one you gave must match it; a version Beam does not support is refused;
- a Flink job server jar is at hand: ``--flink_job_server_jar``, else one fetched into the
  cache (:mod:`refinery.runners.flink_local`), else Beam's own jar cache, else Maven
  Central must be reachable for Beam to download it;
- Java is on ``PATH`` (the job server is a Java program), unless the jar is uploaded
  straight to the cluster (``--flink_submit_uber_jar``).

A command's Beam jobs share one job server (:func:`flink_job_service`): Beam would start a
JVM for each job and stop them all only when the process exits. That JVM runs only patched to
serve this user (:mod:`refinery.runners.flink_private`: loopback, other uids refused; an
embedded Flink's REST and blob servers behind TLS with a private key); a jar that cannot be
patched is refused in one line.

Beam flags worth knowing: ``--flink_master=HOST:8081`` (the JobManager's REST address;
``[local]`` starts an embedded Flink), ``--flink_version`` (1.19, 1.20, 2.0, 2.1, 2.2),
``--flink_job_server_jar=PATH``, ``--flink_submit_uber_jar`` (upload the job server jar with
the pipeline to the JobManager instead of running a job server on this machine).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import urllib.error
import urllib.request
from typing import Any, Iterator

from refinery.transforms.io import beam_private

from .args import RunnerOptionsError, docker_image_config, has, value, with_defaults
from .flink_private import JarPatchError, embedded_flink_conf
from .package import setup_file

LOCAL_MASTERS = ("[auto]", "[local]")
# what Beam's own tests give the job server's JVM on Java 17 (Flink serializes JDK classes)
JVM_OPENS = tuple(f"--add-opens=java.base/{pkg}=ALL-UNNAMED" for pkg in ("java.lang", "java.nio", "java.util"))
REST_TIMEOUT_S = 5.0


def flink_args(workers: int | None, args: list[str]) -> list[str]:
    """Beam arguments for ``--runner flink`` (pure: nothing is contacted; see :func:`resolve_flink`)."""
    defaults = {"--runner": "FlinkRunner"}
    if workers:
        defaults["--parallelism"] = str(workers)
    master = value(args, "--flink_master") or "[auto]"
    if master not in LOCAL_MASTERS:
        env = (value(args, "--environment_type") or "DOCKER").upper()
        defaults["--environment_type"] = "DOCKER"
        if env == "DOCKER" and not has(args, "--environment_config"):
            args = args + docker_image_config(args)
        if env in ("DOCKER", "PROCESS") and not has(args, "--environment_config") and (setup := setup_file()):
            defaults["--setup_file"] = setup  # stock image: workers install this package
    args = with_defaults(args, defaults)
    if not (has(args, "--job_server_jvm_properties") or has(args, "--job_server_jvm_property")):
        args = args + [f"--job_server_jvm_properties={p}" for p in JVM_OPENS]
    return args


# ---------------------------------------------------------------------------------------
# Before a run: the cluster, its version, the job server jar, Java
# ---------------------------------------------------------------------------------------

def rest_url(master: str) -> str:
    """The JobManager's REST base URL from ``--flink_master`` (``host:8081`` -> ``http://host:8081``)."""
    master = master.strip().rstrip("/")
    return master if master.startswith(("http://", "https://")) else f"http://{master}"


def flink_rest(master: str, path: str, timeout: float = REST_TIMEOUT_S) -> Any:
    """GET ``path`` of the Flink REST API at ``master`` as JSON. Raises RunnerOptionsError
    naming the address when the cluster does not answer."""
    url = f"{rest_url(master)}/{path.lstrip('/')}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise RunnerOptionsError(f"the Flink cluster at {rest_url(master)} does not answer ({reason}): "
                                 "start it, or fix --flink_master") from None


def cluster_flink_version(master: str) -> str:
    """The cluster's Flink version, e.g. ``1.19.3`` (REST ``/v1/config``)."""
    version = flink_rest(master, "/v1/config").get("flink-version")
    if not isinstance(version, str) or not version:
        raise RunnerOptionsError(f"the Flink cluster at {rest_url(master)} did not report its version (/v1/config)")
    return version


def supported_flink_versions() -> list[str]:
    """The Flink minors the installed Beam publishes a job server for."""
    from apache_beam.options.pipeline_options import FlinkRunnerOptions

    return list(FlinkRunnerOptions.PUBLISHED_FLINK_VERSIONS)


def beam_jar_path(flink_minor: str) -> tuple[str, str]:
    """(URL Beam would download its job server jar from, the path it caches it at)."""
    from apache_beam.utils.subprocess_server import JavaJarServer

    url = JavaJarServer.path_to_beam_jar(f":runners:flink:{flink_minor}:job-server:shadowJar")
    return url, os.path.join(JavaJarServer.JAR_CACHE, os.path.basename(url))


def reachable(url: str, timeout: float = REST_TIMEOUT_S) -> str | None:
    """None if a HEAD request to ``url`` succeeds, else why not (one line)."""
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
        return None
    except (urllib.error.URLError, OSError, ValueError) as e:
        return str(getattr(e, "reason", None) or e)


def resolve_flink(args: list[str]) -> list[str]:
    """``args`` (from :func:`flink_args`) completed for a real run, or RunnerOptionsError
    with the one-line cause: the cluster's version as ``--flink_version``, a job server jar
    as ``--flink_job_server_jar``; see the module docstring. Contacts the cluster's REST API
    (and Maven Central when no jar is at hand), nothing else."""
    # imported here, not with the package: `python -m refinery.runners.flink_local` runs that module
    # as __main__, and runpy warns when importing refinery.runners has imported it already
    from .flink_local import cached_flink_minors, find_job_server_jar, minor_version  # lazy: see above

    master = value(args, "--flink_master") or "[auto]"
    given = value(args, "--flink_version")
    supported = supported_flink_versions()
    if master not in LOCAL_MASTERS:
        version = cluster_flink_version(master)
        minor = minor_version(version)
        if minor not in supported:
            raise RunnerOptionsError(f"the Flink cluster at {rest_url(master)} runs Flink {version}, which this Beam "
                                     f"does not support (it supports Flink {', '.join(supported)})")
        if given and given != minor:
            raise RunnerOptionsError(f"--flink_version {given} does not match the cluster at {rest_url(master)}, "
                                     f"which runs Flink {version}: leave --flink_version out, or give {minor}")
    else:  # an embedded Flink: the version of a fetched job server, else Beam's default
        cached = [m for m in cached_flink_minors() if m in supported]
        minor = given or (supported[-1] if supported[-1] in cached or not cached else cached[-1])
    extra = [] if given else [f"--flink_version={minor}"]

    uber = has(args, "--flink_submit_uber_jar") and master not in LOCAL_MASTERS
    launcher = value(args, "--job_server_java_launcher") or "java"
    if not uber and shutil.which(launcher) is None:
        raise RunnerOptionsError(f"--runner flink needs Java 11 or newer to run Beam's Flink job server, and "
                                 f"{launcher!r} is not on PATH (or pass --flink_submit_uber_jar for a cluster)")
    jar = value(args, "--flink_job_server_jar")
    if jar:
        if "://" not in jar and not os.path.exists(jar):
            raise RunnerOptionsError(f"--flink_job_server_jar {jar}: no such file")
        return args + extra
    found = find_job_server_jar(minor)
    if found:
        return args + extra + [f"--flink_job_server_jar={found}"]
    url, cached_at = beam_jar_path(minor)
    if os.path.exists(cached_at):
        return args + extra
    why = reachable(url)
    if why:
        raise RunnerOptionsError(
            f"no Flink {minor} job server jar here and Beam cannot download it ({url}: {why}). Fetch one with "
            f"'python -m refinery.runners.flink_local fetch --flink {minor}' or give --flink_job_server_jar PATH")
    return args + extra


@contextlib.contextmanager
def flink_job_service(args: list[str]) -> Iterator[list[str]]:
    """``args`` with ``--job_endpoint`` of one Beam Flink job server started here and stopped
    on leaving, for every Beam job of a command; ``args`` unchanged when they are not for
    FlinkRunner through a job server (another runner, ``--job_endpoint`` given, or the uber
    jar submitted straight to a cluster)."""
    master = value(args, "--flink_master") or "[auto]"
    if (value(args, "--runner") or "").lower() != "flinkrunner" or has(args, "--job_endpoint") or \
            (has(args, "--flink_submit_uber_jar") and master not in LOCAL_MASTERS):
        yield args
        return
    from apache_beam.options.pipeline_options import FlinkRunnerOptions, PipelineOptions
    from apache_beam.runners.portability.flink_runner import FlinkRunner

    from .flink_local import cache_dir, private_job_server  # lazy: python -m runs it (see resolve_flink)

    options = PipelineOptions(args)
    flink = options.view_as(FlinkRunnerOptions)
    flink.flink_master = FlinkRunner.add_http_scheme(flink.flink_master)  # as FlinkRunner does for its own
    try:  # the jar Beam would run (downloaded by Beam if it is a URL or not given), patched
        flink.flink_job_server_jar = str(private_job_server(flink.flink_job_server_jar or beam_jar_path(
            flink.flink_version)[0], log=_note))
        conf = embedded_flink_conf(cache_dir(), log=_note) if master in LOCAL_MASTERS else None
    except JarPatchError as e:
        raise RunnerOptionsError(f"{e} (--runner flink runs only a job server that serves this user alone: "
                                 "see refinery.runners.flink_private)") from None
    server = beam_private.flink_job_server(options)
    with _env("FLINK_CONF_DIR", str(conf) if conf else None):  # the JVM reads it once, at its start
        server.start()
    try:
        yield args + [f"--job_endpoint={server.endpoint}"]
    finally:
        server.stop()


def _note(line: str) -> None:
    print(f"refinery: {line}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
    """``os.environ[name] = value`` inside the block (nothing when ``value`` is None), restored after."""
    if value is None:
        yield
        return
    before = os.environ.get(name)
    if before is not None and before != value:
        _note(f"{name}={before} is set; the embedded Flink uses refinery's private configuration instead")
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
