"""Build a command's Beam job without running it: runner-API protos and Dataflow dry runs.

Every command is a list of stages (``refinery.transforms.resumable``) run as ONE Beam job:
each stage a named step over its units, each step after the one before
(``refinery.transforms.resumable.beam_steps``). These helpers build that job for a whole plan, so
that it can be checked before anything runs:

- :func:`command_pipeline`: the built Beam pipeline of every stage with every unit of its
  plan, with the given Beam arguments (any runner's).
- :func:`runner_api`: the portable runner-API proto of a built pipeline, with the
  environment the runner would give it (what a portable job server such as Flink's
  receives).
- :func:`dataflow_job`: that pipeline on DataflowRunner with ``--dry_run``: the runner
  applies its overrides, translates, resolves the container image and stages nothing;
  returns the Dataflow job description (``apiclient.Job``) it would submit. Needs
  ``--project``, ``--region``, ``--temp_location=gs://...`` among the Beam arguments
  (checked first: :class:`~refinery.runners.args.RunnerOptionsError` names each problem).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from refinery.transforms.io.beam_private import fnapi_environment_major_version, setup_builds_captured
from refinery.transforms.resumable import Stage, bind_stages
from refinery.transforms.resumable.planner import Step

from .args import has
from .dataflow import check_options

if TYPE_CHECKING:
    import apache_beam as beam
    from apache_beam.portability.api import beam_runner_api_pb2


def command_pipeline(stages: list[Stage[Any, Any]], output: str, beam_args: list[str],
                     verify_checksums: bool = False) -> beam.Pipeline | None:
    """The command's Beam pipeline, built, not run: every stage a step over its whole plan
    (what ``run_stages`` runs when no unit is done yet); None when no stage plans a unit."""
    from refinery.transforms.resumable.beam_steps import build_pipeline  # lazy: Beam, when a job is built

    steps = [Step(run, units, run.stage.plan_ref) for run in bind_stages(stages, output)
             if (units := run.stage.plan())]  # the job reads its units from the output: not written here
    return build_pipeline(steps, beam_args, verify_checksums) if steps else None


def default_environment(pipeline: beam.Pipeline) -> Any:
    """The environment the pipeline's runner gives SDK workers (None: Beam's default)."""
    runner = pipeline.runner
    if hasattr(runner, "default_environment"):  # PortableRunner and FlinkRunner
        return runner.default_environment(pipeline.options)
    return None


def runner_api(pipeline: beam.Pipeline) -> beam_runner_api_pb2.Pipeline:
    """``beam_runner_api_pb2.Pipeline`` of a built pipeline, with its runner's environment."""
    return pipeline.to_runner_api(default_environment=default_environment(pipeline))


def dataflow_job(stages: list[Stage[Any, Any]], output: str, beam_args: list[str],
                 verify_checksums: bool = False) -> Any:
    """The Dataflow job of :func:`command_pipeline`, built with DataflowRunner and
    ``--dry_run``: the runner applies its overrides, translates the pipeline, resolves the
    container image and builds the job description (``apiclient.Job``; ``.proto`` is the
    Dataflow Job message, with its environment from :func:`job_environment`) but submits
    nothing and uploads nothing. None when no stage plans a unit.

    ``--dry_run`` is added here, before the pipeline is built: Beam's option validation
    at construction already skips its GCS bucket checks only in a dry run.
    """
    from apache_beam.runners.dataflow.dataflow_runner import DataflowRunner

    check_options(beam_args)  # Beam would raise a traceback, or look for a default bucket online
    args = list(beam_args) if has(beam_args, "--dry_run") else [*beam_args, "--dry_run=True"]
    pipeline = command_pipeline(stages, output, args, verify_checksums)
    if pipeline is None:
        return None
    if not isinstance(pipeline.runner, DataflowRunner):
        raise ValueError(f"the runner is {type(pipeline.runner).__name__}, not DataflowRunner")
    with setup_builds_captured():  # the sdist of --setup_file: its build's progress is not ours to print
        result: Any = pipeline.run()  # DataflowRunner's result, whose job Beam does not type
        job = result.job
    job.proto.environment = job_environment(job)
    return job


def job_bytes(job: Any) -> int:
    """The size of a Dataflow job description from :func:`dataflow_job` as the service would
    receive it (the serialized ``Job`` message, steps included): what Dataflow's 10 MB limit
    applies to."""
    return len(type(job.proto).serialize(job.proto))


def step_names(proto_pipeline: beam_runner_api_pb2.Pipeline) -> list[str]:
    """The names of a runner-API pipeline's top-level steps, in order (a command's stages:
    ``Tokenize units``, ``Pack shards``, ...)."""
    names = []
    for root in proto_pipeline.root_transform_ids:
        for sub in proto_pipeline.components.transforms[root].subtransforms:
            names.append(proto_pipeline.components.transforms[sub].unique_name)
    return names


def staged_artifacts(proto_pipeline: beam_runner_api_pb2.Pipeline) -> list[str]:
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


def job_environment(job: Any) -> Any:
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
        environment_version=fnapi_environment_major_version(),  # what the client sends
        proto_pipeline_staged_url=f"{staging}/pipeline.pb", proto_pipeline=job.proto_pipeline).proto
