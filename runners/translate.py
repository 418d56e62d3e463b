"""Build a pipeline's Beam jobs without running them: runner-API protos and Dataflow dry runs.

Every pipeline is a list of stages (``refinery.transforms.core.stages``); each stage that is not
``local`` becomes one Beam job over its pending units (the ``infer`` stage of the inference
pipelines: one job per wave of units). These helpers build those jobs for
a whole plan so that a job can be checked before anything runs:

- :func:`stage_pipelines`: (stage run, Beam pipeline) for each Beam job of each Beam stage,
  every unit of its plan, built with the given Beam arguments (any runner's). A stage is one
  job (:func:`refinery.transforms.core.stages.build_stage_pipeline`) unless a ``builder`` says
  otherwise: the inference pipelines (generate, hydra oracle-label and grade) pass
  :func:`refinery.transforms.inference.stages.wave_pipelines`, one job per wave of ``infer``
  units, as they pass ``infer_runner`` to ``run_stages``.
- :func:`runner_api`: the portable runner-API proto of a built pipeline, with the
  environment the runner would give it (what a portable job server such as Flink's
  receives).
- :func:`dataflow_jobs`: each of those jobs on DataflowRunner with ``--dry_run``: the
  runner applies its overrides, translates, resolves the container image and stages
  nothing; yields the Dataflow job description (``apiclient.Job``) it would submit.
  Needs ``--project``, ``--region``, ``--temp_location=gs://...`` among the Beam arguments
  (checked first: :class:`~refinery.runners.args.RunnerOptionsError` names each problem).
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

from .args import has
from .dataflow import check_options

from refinery.transforms.core.stages import Stage, StageRun, Unit, bind_stages, build_stage_pipeline


def beam_stages(stages: list[Stage], output: str) -> list[tuple[StageRun, list[Unit]]]:
    """(bound stage, its whole plan) for every stage that runs on Beam (not ``local``)."""
    return [(run, run.stage.plan()) for run in bind_stages(stages, output) if not run.stage.local]


# (stage run, its units, Beam arguments, verify checksums) -> the stage's built Beam jobs
PipelineBuilder = Callable[[StageRun, list[Unit], list[str], bool], Iterable[object]]


def one_pipeline(run: StageRun, units: list[Unit], beam_args: list[str], verify_checksums: bool = False):
    """The default :data:`PipelineBuilder`: the stage's units in one job (what ``run_stages`` runs)."""
    return [build_stage_pipeline(run, units, beam_args, verify_checksums)]


def stage_pipelines(stages: list[Stage], output: str, beam_args: list[str], verify_checksums: bool = False,
                    builder: PipelineBuilder | None = None) -> Iterator[tuple[StageRun, object]]:
    """(stage run, built ``beam.Pipeline``) for each Beam job of each Beam stage, in run
    order; nothing is run or written. ``builder``: see the module docstring."""
    for run, units in beam_stages(stages, output):
        for pipeline in (builder or one_pipeline)(run, units, beam_args, verify_checksums):
            yield run, pipeline


def default_environment(pipeline):
    """The environment the pipeline's runner gives SDK workers (None: Beam's default)."""
    runner = pipeline.runner
    if hasattr(runner, "default_environment"):  # PortableRunner and FlinkRunner
        return runner.default_environment(pipeline.options)
    return None


def runner_api(pipeline):
    """``beam_runner_api_pb2.Pipeline`` of a built pipeline, with its runner's environment."""
    return pipeline.to_runner_api(default_environment=default_environment(pipeline))


def dataflow_jobs(stages: list[Stage], output: str, beam_args: list[str], verify_checksums: bool = False,
                  builder: PipelineBuilder | None = None) -> Iterator[tuple[StageRun, object]]:
    """(stage run, Dataflow job) for each Beam job of :func:`stage_pipelines`, built with DataflowRunner and
    ``--dry_run``: the runner applies its overrides, translates the pipeline, resolves the
    container image and builds the job description (``apiclient.Job``; ``.proto`` is the
    Dataflow Job message, with its environment from :func:`job_environment`) but submits
    nothing and uploads nothing.

    ``--dry_run`` is added here, before the pipeline is built: Beam's option validation
    at construction already skips its GCS bucket checks only in a dry run.
    """
    from apache_beam.runners.dataflow.dataflow_runner import DataflowRunner

    check_options(beam_args)  # Beam would raise a traceback, or look for a default bucket online
    args = list(beam_args) if has(beam_args, "--dry_run") else [*beam_args, "--dry_run=True"]
    for run, pipeline in stage_pipelines(stages, output, args, verify_checksums, builder):
        if not isinstance(pipeline.runner, DataflowRunner):
            raise ValueError(f"stage {run.name}: runner is {type(pipeline.runner).__name__}, not DataflowRunner")
        job = pipeline.run().job
        job.proto.environment = job_environment(job)
        yield run, job


def staged_artifacts(proto_pipeline) -> list[str]:
    """Names under which Dataflow would stage the pipeline's dependencies (the sdist of
    ``--setup_file`` is ``workflow.tar.gz``; Beam adds its submission-environment list)."""
    from apache_beam.portability import common_urns
    from apache_beam.portability.api import beam_runner_api_pb2

    names = []
    for _, env in sorted(proto_pipeline.components.environments.items()):
        for dep in env.dependencies:
            if dep.role_urn == common_urns.artifact_roles.STAGING_TO.urn:
                names.append(beam_runner_api_pb2.ArtifactStagingToRolePayload.FromString(dep.role_payload).staged_name)
    return sorted(set(names))


def job_environment(job):
    """The Dataflow ``Environment`` message (worker pool: machine type, container image,
    packages, autoscaling; experiments; service options; SDK pipeline options) that
    ``DataflowApplicationClient.create_job_description`` would attach to ``job``, built
    the same way but without its uploads: the package list holds the names that would be
    staged and the pipeline URL points where ``pipeline.pb`` would be."""
    from apache_beam.options.pipeline_options import GoogleCloudOptions
    from apache_beam.runners.dataflow.internal import apiclient

    staging = job.options.view_as(GoogleCloudOptions).staging_location.rstrip("/")
    return apiclient.Environment(
        packages=staged_artifacts(job.proto_pipeline), options=job.options,
        environment_version=apiclient._FNAPI_ENVIRONMENT_MAJOR_VERSION,  # what the client sends
        proto_pipeline_staged_url=f"{staging}/pipeline.pb", proto_pipeline=job.proto_pipeline).proto
