"""``portable``: Beam's PortableRunner, i.e. any job server that speaks the Beam job API.

Defaults: ``--job_endpoint=embed`` (an in-process job service running the pipeline with
Beam's portable Python runner) and ``--environment_type=LOOPBACK`` (SDK workers run inside
this process). This is the job API that Flink's, Spark's and Samza's job servers speak,
so ``--runner portable --job_endpoint=HOST:8099`` submits to such a server (for example
the ``apache/beam_flink1.19_job_server`` container next to a Flink cluster).

Flags (Beam's own, passed through):

- ``--job_endpoint``: ``embed`` or ``HOST:PORT`` of a job server.
- ``--environment_type``: where SDK workers run. ``LOOPBACK``: in this process (the job
  server must reach this machine). ``DOCKER``: a container per worker, image from
  ``--sdk_container_image`` (use ``containers/Dockerfile.cpu``: it has this package).
  ``PROCESS``: ``--environment_config='{"command": "/opt/apache/beam/boot"}'`` on hosts
  where this package is installed. ``EXTERNAL``: ``--environment_config=HOST:PORT`` of a
  running worker pool (``python -m apache_beam.runners.worker.worker_pool_main``).
- ``--workers`` is not used: parallelism belongs to the job server.

With the embedded job service a LOOPBACK job runs in an EMBEDDED environment
(:func:`runnable`): the SDK worker is in this process either way, and no worker pool or
Fn API server is started (a LOOPBACK pool runs the code of whoever reaches it). With a job
server, the LOOPBACK pool listens on loopback and serves this user only
(:mod:`.same_user`).
"""
from __future__ import annotations

from .args import docker_image_config, has, value, with_defaults

EMBEDDED_ENVIRONMENT = "beam:env:embedded_python:v1"  # Beam's in-process SDK worker, no gRPC


def portable_args(workers: int | None, args: list[str]) -> list[str]:
    """Beam arguments for ``--runner portable``."""
    args = args + docker_image_config(args) if has(args, "--environment_type") else args
    return with_defaults(args, {"--runner": "PortableRunner", "--job_endpoint": "embed",
                                "--environment_type": "LOOPBACK"})


def runnable(args: list[str]) -> list[str]:
    """``args`` as a job runs them: a PortableRunner job on the embedded job service in a
    LOOPBACK environment runs in :data:`EMBEDDED_ENVIRONMENT` (the same worker, in this
    process, with no server for it); any other ``args`` unchanged."""
    runner = (value(args, "--runner") or "").lower()
    if runner not in ("portablerunner", "portable") or value(args, "--job_endpoint") != "embed" or \
            (value(args, "--environment_type") or "").upper() != "LOOPBACK":
        return args
    kept = [a for i, a in enumerate(args) if not a.startswith("--environment_type")
            and not (i > 0 and args[i - 1] == "--environment_type")]
    return kept + [f"--environment_type={EMBEDDED_ENVIRONMENT}"]
