"""``local`` and ``direct``: Apache Beam's DirectRunner on this machine.

- ``local`` (the default runner): multi-processing, ``--workers`` processes (default: one
  per core), each a separate Python process with its own copy of what a unit loads; with
  one worker it runs in-process.
- ``direct``: in-process (``in_memory``), one worker unless ``--workers`` says more (then
  threads). The fastest way to run small jobs and tests.

Beam flags: ``--runner=DirectRunner``, ``--direct_running_mode``, ``--direct_num_workers``; a
job runs them on :class:`LocalRunner` (Beam's FnApiRunner, without the DirectRunner's detour
through Prism).
Environment variables of the driver (``STORAGE_EMULATOR_HOST``, ``REFINERY_VOCAB_FILE``,
credentials) reach the worker processes, which inherit the environment.
"""
from __future__ import annotations

import os

from apache_beam.runners.runner import PipelineRunner

from .args import with_defaults


def local_args(workers: int | None, args: list[str]) -> list[str]:
    """Beam arguments for ``--runner local``."""
    n = workers or os.cpu_count() or 1
    if n == 1:
        return with_defaults(args, {"--runner": "DirectRunner", "--direct_running_mode": "in_memory",
                                    "--direct_num_workers": "1"})
    return with_defaults(args, {"--runner": "DirectRunner", "--direct_running_mode": "multi_processing",
                                "--direct_num_workers": str(n), "--beam_plugins": WORKER_PLUGIN})


def direct_args(workers: int | None, args: list[str]) -> list[str]:
    """Beam arguments for ``--runner direct`` (in-process)."""
    return with_defaults(args, {"--runner": "DirectRunner", "--direct_running_mode": "in_memory",
                                "--direct_num_workers": str(workers or 1)})


# What a worker process of the local multi-process runner imports first (Beam's
# --beam_plugins): it ends the process as soon as its work is done (see worker_exit).
WORKER_PLUGIN = "refinery.runners.worker_exit"


class LocalRunner(PipelineRunner):
    """Beam's FnApiRunner, set up as the DirectRunner sets it up for a batch pipeline it
    runs itself (the pipeline options reach every worker process).

    The DirectRunner first offers a pipeline to Prism, a runner in a separate binary that
    it downloads from the internet at first use and starts as a subprocess: on a machine
    without internet that try costs about 0.25 s per job, and with it the job runs on
    another engine than here. Refinery's pipelines are batch pipelines, which is what the
    FnApiRunner runs; ``--runner local`` and ``--runner direct`` use it directly, with the
    DirectRunner's flags (``--direct_running_mode``, ``--direct_num_workers``).
    """

    def run_pipeline(self, pipeline, options):
        from apache_beam.portability.api import beam_provision_api_pb2
        from apache_beam.runners.portability.fn_api_runner import fn_runner
        from apache_beam.runners.portability.portable_runner import JobServiceHandle

        encoded = JobServiceHandle.encode_pipeline_options(options.get_all_options())
        info = fn_runner.ExtendedProvisionInfo(beam_provision_api_pb2.ProvisionInfo(pipeline_options=encoded))
        return fn_runner.FnApiRunner(provision_info=info).run_pipeline(pipeline, options)


LOCAL_RUNNER = f"{LocalRunner.__module__}.{LocalRunner.__qualname__}"


def is_direct(args: list[str]) -> bool:
    """Whether ``args`` ask for Beam's DirectRunner (what ``local`` and ``direct`` build)."""
    from .args import value

    return (value(args, "--runner") or "").lower() in ("directrunner", "direct")


def runnable(args: list[str]) -> list[str]:
    """``args`` as a job runs them: the DirectRunner's become :class:`LocalRunner`'s (same
    flags); any other runner's unchanged."""
    if not is_direct(args):
        return args
    return [a for a in args if not a.startswith("--runner")] + [f"--runner={LOCAL_RUNNER}"]


def in_process(args: list[str]) -> list[str]:
    """``args`` for the same job run in this process, when they ask for the local
    multi-process DirectRunner (a job of light steps: I/O-bound work, or one unit, where
    starting worker processes would cost more than it saves); any other runner's ``args``
    unchanged."""
    from .args import value

    if not is_direct(args) or value(args, "--direct_running_mode") != "multi_processing":
        return args
    kept = [a for a in args if not a.startswith(("--direct_running_mode", "--direct_num_workers"))]
    return kept + ["--direct_running_mode=in_memory", "--direct_num_workers=1"]
