"""``dataflow``: Google Cloud Dataflow (Runner v2), CPU workers or GPU workers.

Our defaults (a flag you give wins):

- ``--runner=DataflowRunner``.
- ``--setup_file=<this checkout>/setup.py``: each worker pip-installs this package (and
  its dependencies) at start, so workers run the same code as the command that submitted
  the job. With ``--sdk_container_image`` (our image already has the package) this is
  still added, and cheap: the dependencies are already satisfied.
- ``--max_num_workers=N`` from ``--workers N`` (autoscaling upper bound).

Our one flag of our own, removed before Beam sees the arguments:

- ``--gpu TYPE[:COUNT]`` (e.g. ``--gpu nvidia-l4``, ``--gpu nvidia-h100-80gb:1``): GPU
  workers for ``generate``/``hydra``. Adds
  ``--dataflow_service_options=worker_accelerator=type:TYPE;count:COUNT;install-nvidia-driver``,
  ``--experiments=no_use_multiple_sdk_containers`` (one SDK process per VM, so a large
  model is loaded once per GPU, not once per vCPU) and, unless ``--machine_type`` is
  given, the machine type that carries that GPU (:data:`GPU_MACHINES`). Requires
  ``--sdk_container_image`` (``containers/Dockerfile.gpu``: CUDA, torch, triton and this
  package): Beam's stock image has no CUDA runtime.

Beam flags you always give: ``--project``, ``--region``, ``--temp_location=gs://...``
(staging defaults to it). Often: ``--machine_type``, ``--num_workers``,
``--sdk_container_image``, ``--service_account_email``, ``--subnetwork``,
``--no_use_public_ips``, ``--job_name``. ``--dry_run`` builds the job description
without submitting it (see :mod:`refinery.runners.translate`).
"""
from __future__ import annotations

from .args import RunnerOptionsError, has, take, values, with_defaults
from .package import setup_file

ONE_SDK_PROCESS = "no_use_multiple_sdk_containers"

# GPU type -> {count per VM: the machine type that carries that many}.
GPU_MACHINES = {
    "nvidia-l4": {1: "g2-standard-8", 2: "g2-standard-24", 4: "g2-standard-48", 8: "g2-standard-96"},
    "nvidia-tesla-a100": {n: f"a2-highgpu-{n}g" for n in (1, 2, 4, 8)},
    "nvidia-a100-80gb": {n: f"a2-ultragpu-{n}g" for n in (1, 2, 4, 8)},
    "nvidia-h100-80gb": {n: f"a3-highgpu-{n}g" for n in (1, 2, 4, 8)},
}


def parse_gpu(spec: str) -> tuple[str, int]:
    """``"nvidia-l4"`` -> (``"nvidia-l4"``, 1); ``"nvidia-l4:2"`` -> (``"nvidia-l4"``, 2)."""
    kind, _, count = spec.strip().partition(":")
    if not kind or (count and not count.isdigit()) or (count and int(count) < 1):
        raise RunnerOptionsError(f"--gpu {spec!r}: expected TYPE or TYPE:COUNT, e.g. nvidia-l4 or nvidia-l4:2")
    return kind.lower(), int(count or 1)


def gpu_args(spec: str, args: list[str]) -> list[str]:
    """The Beam arguments that put ``spec`` GPUs on each Dataflow worker."""
    kind, count = parse_gpu(spec)
    if not has(args, "--sdk_container_image"):
        raise RunnerOptionsError(
            f"--gpu {spec}: give --sdk_container_image=REGISTRY/refinery-gpu:TAG (built from "
            "containers/Dockerfile.gpu); Beam's default SDK image has no CUDA runtime")
    out = [f"--dataflow_service_options=worker_accelerator=type:{kind};count:{count};install-nvidia-driver"]
    if ONE_SDK_PROCESS not in values(args, "--experiments"):
        out.append(f"--experiments={ONE_SDK_PROCESS}")
    if not has(args, "--machine_type") and not has(args, "--worker_machine_type"):
        machine = GPU_MACHINES.get(kind, {}).get(count)
        if machine is None:
            raise RunnerOptionsError(f"--gpu {spec}: no default machine type for {count} x {kind}; "
                                     "give --machine_type")
        out.append(f"--machine_type={machine}")
    return out


def dataflow_args(workers: int | None, args: list[str]) -> list[str]:
    """Beam arguments for ``--runner dataflow``."""
    args, gpu = take(args, "--gpu")
    if gpu is not None:
        args = args + gpu_args(gpu, args)
    defaults = {"--runner": "DataflowRunner"}
    if setup_file():
        defaults["--setup_file"] = setup_file()
    if workers:
        defaults["--max_num_workers"] = str(workers)
    return with_defaults(args, defaults)
