"""``flink``: Beam's FlinkRunner, on a Flink cluster on-prem.

Our defaults (a flag you give wins):

- ``--runner=FlinkRunner``.
- ``--parallelism=N`` from ``--workers N`` (Flink's default parallelism otherwise).
- ``--environment_type=DOCKER`` when ``--flink_master`` names a cluster: each task manager
  starts SDK worker containers. Give ``--sdk_container_image=REGISTRY/refinery-cpu:TAG``
  (``containers/Dockerfile.cpu``, which has this package); it becomes
  ``--environment_config=IMAGE``, the flag Beam reads for a portable job's DOCKER image
  (Beam ignores ``--sdk_container_image`` outside Dataflow). Without an image, Beam's
  stock SDK image is used and ``--setup_file`` (added then) makes each worker
  pip-install this package at start, which needs PyPI access from the task managers. ``PROCESS``
  (``--environment_config='{"command": "/opt/apache/beam/boot"}'``, package installed on
  the task managers) and ``EXTERNAL`` (``--environment_config=HOST:50000``, a worker pool
  sidecar running our image) are the alternatives.
- Checkpointing stays off (Flink's and Beam's default, ``checkpointing_interval=-1``):
  these are batch jobs; a failed job is resumed by re-running the command, and receipts
  skip the units that finished.

Beam flags worth knowing: ``--flink_master=HOST:8081`` (the JobManager's REST address;
``[local]`` starts an embedded Flink), ``--flink_version`` (must match the cluster:
1.19, 1.20, 2.0, ...), ``--flink_job_server_jar=PATH`` (the Beam Flink job server jar, for
machines that cannot download it), ``--flink_submit_uber_jar`` (upload one jar to the
JobManager instead of running a job server).
"""
from __future__ import annotations

from .args import docker_image_config, has, value, with_defaults
from .package import setup_file

LOCAL_MASTERS = ("[auto]", "[local]")


def flink_args(workers: int | None, args: list[str]) -> list[str]:
    """Beam arguments for ``--runner flink``."""
    defaults = {"--runner": "FlinkRunner"}
    if workers:
        defaults["--parallelism"] = str(workers)
    master = value(args, "--flink_master") or "[auto]"
    if master not in LOCAL_MASTERS:
        env = (value(args, "--environment_type") or "DOCKER").upper()
        defaults["--environment_type"] = "DOCKER"
        if env == "DOCKER" and not has(args, "--environment_config"):
            args = args + docker_image_config(args)
        if env in ("DOCKER", "PROCESS") and not has(args, "--environment_config") and setup_file():
            defaults["--setup_file"] = setup_file()  # stock image: workers install this package
    return with_defaults(args, defaults)
