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
(staging defaults to it). :func:`option_problems` checks them up front, offline: Beam's own
check, when one is missing or malformed, raises a traceback, or looks for a default bucket
over the network. Often: ``--machine_type``, ``--num_workers``,
``--sdk_container_image``, ``--service_account_email``, ``--subnetwork``,
``--no_use_public_ips``, ``--job_name``. ``--dry_run`` builds the job description
without submitting it (see :mod:`refinery.runners.translate`).
"""
from __future__ import annotations

import re

from refinery.transforms.io.gcs import bucket_problem

from .args import RunnerOptionsError, has, take, value, values, with_defaults
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
    if setup := setup_file():
        defaults["--setup_file"] = setup
    if workers:
        defaults["--max_num_workers"] = str(workers)
    return with_defaults(args, defaults)


# Google Cloud's rules: a project ID has 6-30 lowercase letters, digits or hyphens, starts with
# a letter and does not end with a hyphen (older ones may carry a domain: example.com:my-project).
PROJECT_ID = re.compile(r"([a-z0-9][-a-z0-9.]*[a-z0-9]:)?[a-z][-a-z0-9]{4,28}[a-z0-9]")
REGION = re.compile(r"[a-z]+(-[a-z]+)+[0-9]+")
JOB_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def is_dataflow(args: list[str]) -> bool:
    """Whether Beam arguments ``args`` run on Dataflow."""
    return (value(args, "--runner") or "").lower() in ("dataflowrunner", "dataflow")


def option_problems(args: list[str]) -> list[str]:
    """One line per Dataflow option of ``args`` that is missing or malformed ([] when all are
    usable): ``--project``, ``--region``, ``--temp_location`` (or ``--staging_location``),
    ``--job_name``. Reads nothing remote."""
    problems = []
    project = value(args, "--project")
    if not project:
        problems.append("--runner dataflow needs --project PROJECT_ID (the project the job runs in and is billed to)")
    elif not PROJECT_ID.fullmatch(project):
        problems.append(f"--project {project}: not a project ID (6-30 lowercase letters, digits or hyphens, "
                        "starting with a letter, e.g. my-project); give the ID, not the project's name or number")
    region = value(args, "--region")
    if not region:
        problems.append("--runner dataflow needs --region REGION (where the job runs, e.g. us-central1)")
    elif not REGION.fullmatch(region):
        problems.append(f"--region {region}: not a Compute Engine region (e.g. us-central1, europe-west4)")
    locations = [(f, path) for f in ("--temp_location", "--staging_location") if (path := value(args, f))]
    if not locations:
        problems.append("--runner dataflow needs --temp_location gs://BUCKET/PATH (Dataflow's temp and staging files)")
    for flag, path in locations:
        if not path.startswith("gs://") or "/" not in path[len("gs://"):]:
            problems.append(f"{flag} {path}: give gs://BUCKET/PATH (a folder in a Cloud Storage bucket)")
        elif (bad := bucket_problem(path)) is not None:
            problems.append(f"{flag} {bad}")
    job = value(args, "--job_name")
    if job and not JOB_NAME.fullmatch(job):
        problems.append(f"--job_name {job}: lowercase letters, digits and hyphens, starting with a letter "
                        "(or leave it unset: Beam names each job uniquely)")
    return problems


def check_options(args: list[str]) -> None:
    """:class:`RunnerOptionsError` with one line per problem of :func:`option_problems`."""
    problems = option_problems(args)
    if problems:
        raise RunnerOptionsError("\n".join(problems))
