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
"""
from __future__ import annotations

from .args import docker_image_config, has, with_defaults


def portable_args(workers: int | None, args: list[str]) -> list[str]:
    """Beam arguments for ``--runner portable``."""
    args = args + docker_image_config(args) if has(args, "--environment_type") else args
    return with_defaults(args, {"--runner": "PortableRunner", "--job_endpoint": "embed",
                                "--environment_type": "LOOPBACK"})
