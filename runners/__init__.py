"""PipelineOptions builders: turn ``--runner NAME`` plus our few options into Beam arguments.

One module per target, each documenting its flags and defaults:

- :mod:`.local`: ``local`` (default): DirectRunner, multi-processing, one worker per core
  (``--workers``); with one worker it runs in-process. ``direct``: DirectRunner in-process.
  Their jobs run on :mod:`.local_runner` (Beam's FnApiRunner), with workers forked from a
  warm process (:mod:`.warm_workers`) that end at once when done (:mod:`.worker_exit`).
- :mod:`.prism`: ``prism``: Beam's PrismRunner (a Go binary built into the cache by
  ``make prism-cache``), one Prism process per command, a LOOPBACK environment.
- :mod:`.portable`: ``portable``: PortableRunner, by default with the embedded job service
  and a LOOPBACK environment (the job API that Flink's job server speaks).
- :mod:`.flink`: ``flink``: FlinkRunner (``--flink_master``, parallelism, environment).
- :mod:`.dataflow`: ``dataflow``: DataflowRunner; workers install this package from its
  ``setup.py``; ``--gpu TYPE[:COUNT]`` for inference workers.

Any other name is passed to Beam as ``--runner=NAME``. Flags the user gave win over every
default here. :func:`prepare_run` completes them for a real run (not a dry run): for Flink,
the cluster's version and a job server jar, for Prism its binary, or one line saying what
is missing.
:mod:`.translate` builds a command's Beam pipeline without running it (runner API proto,
Dataflow ``--dry_run`` job description).
"""
from __future__ import annotations

from typing import ContextManager

from refinery.transforms.io.beam_private import beam_runner_names

from .args import RunnerOptionsError, with_defaults
from .dataflow import dataflow_args
from .flink import flink_args, flink_job_service, resolve_flink
from .local import direct_args, local_args
from .package import setup_file
from .portable import portable_args
from .prism import is_prism, prism_args, prism_job_service, resolve_prism

RUNNERS = ("local", "direct", "prism", "portable", "flink", "dataflow")

_BUILDERS = {"local": local_args, "direct": direct_args, "prism": prism_args, "portable": portable_args,
             "flink": flink_args, "dataflow": dataflow_args}

__all__ = ["RUNNERS", "RunnerOptionsError", "check_runner_name", "job_service", "pipeline_args", "prepare_run",
           "setup_file"]


def pipeline_args(runner: str = "local", workers: int | None = None, beam_args: list[str] | None = None) -> list[str]:
    """Beam command-line arguments for ``runner``; ``beam_args`` are passed through unchanged
    (except our own runner flags, such as dataflow's ``--gpu``, which become Beam flags).

    Raises :class:`RunnerOptionsError` (a ValueError) naming a flag that cannot be used.
    """
    args = list(beam_args or [])
    builder = _BUILDERS.get(runner.lower())
    if builder is None:
        check_runner_name(runner)
        return with_defaults(args, {"--runner": runner})
    return builder(workers, args)


def check_runner_name(runner: str) -> None:
    """Raise :class:`RunnerOptionsError` unless ``runner`` is one of :data:`RUNNERS`, a runner
    Beam knows by name (``FlinkRunner``, ``PrismRunner``, ``flink`` ...), or a dotted path to
    a runner class: checked before anything is planned or written."""
    name, beam = runner.lower(), beam_runner_names()
    if name in RUNNERS or "." in runner or name in beam or name + "runner" in beam:
        return
    raise RunnerOptionsError(f"--runner {runner}: not a runner; refinery's are {', '.join(RUNNERS)} "
                             "(any Beam runner's name, such as SparkRunner, or a module.Class path works too)")


def prepare_run(runner: str, beam_args: list[str]) -> list[str]:
    """``beam_args`` from :func:`pipeline_args`, checked and completed right before a real
    run; may contact the runner's service (Flink's REST API). Raises
    :class:`RunnerOptionsError` with the one-line cause."""
    if runner.lower() == "flink":
        return resolve_flink(beam_args)
    if is_prism(beam_args):  # --runner prism, or Beam's PrismRunner by name: never its download
        return resolve_prism(beam_args)
    return beam_args


def job_service(beam_args: list[str]) -> ContextManager[list[str]]:
    """A context manager giving ``beam_args`` for all of a command's Beam jobs: for Flink
    through Beam's job server, one job server for them all (:func:`.flink.flink_job_service`);
    for Prism one Prism process (:func:`.prism.prism_job_service`); for other runners
    ``beam_args`` as they are."""
    return prism_job_service(beam_args) if is_prism(beam_args) else flink_job_service(beam_args)
