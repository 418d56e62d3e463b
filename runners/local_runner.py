"""LocalRunner: how a job of ``--runner local`` or ``--runner direct`` runs.

Beam's DirectRunner first offers a pipeline to Prism, a runner in a separate binary that it
downloads from the internet at first use and starts as a subprocess: on a machine without
internet that try costs about 0.25 s per job, and with it the job runs on another engine
than here. Refinery's pipelines are batch pipelines, which is what Beam's FnApiRunner runs:
:class:`LocalRunner` sets it up as the DirectRunner does for a batch pipeline it runs itself
(the pipeline options reach every worker process) and takes the DirectRunner's flags
(``--direct_running_mode``, ``--direct_num_workers``).

With ``multi_processing`` and a pool of warm workers open in this process
(:func:`refinery.runners.warm_workers.active`), each SDK worker is forked from the pool's
warm process instead of starting a new Python that imports Beam.
"""
from __future__ import annotations

import logging

from apache_beam.options.pipeline_options import DirectOptions
from apache_beam.runners.runner import PipelineRunner

from . import warm_workers

# FnApiRunner warns when in_memory is asked with several workers: with a pool's environment
# that is what LocalRunner asks for (see run_pipeline), and the warning would be wrong.
_FN_RUNNER_LOG = "apache_beam.runners.portability.fn_api_runner.fn_runner"


class _NoInMemoryWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "direct_running_mode should be" not in record.getMessage()


class LocalRunner(PipelineRunner):
    """Beam's FnApiRunner for a batch pipeline on this machine (see the module's doc)."""

    def run_pipeline(self, pipeline, options):
        from apache_beam.portability.api import beam_provision_api_pb2
        from apache_beam.runners.portability.fn_api_runner import fn_runner
        from apache_beam.runners.portability.portable_runner import JobServiceHandle
        from apache_beam.transforms import environments

        encoded = JobServiceHandle.encode_pipeline_options(options.get_all_options())
        info = fn_runner.ExtendedProvisionInfo(beam_provision_api_pb2.ProvisionInfo(pipeline_options=encoded))
        direct = options.view_as(DirectOptions)
        pool = warm_workers.active()
        if pool is None or direct.direct_running_mode != "multi_processing":
            return fn_runner.FnApiRunner(provision_info=info).run_pipeline(pipeline, options)
        # The pool's command as the workers' environment. FnApiRunner would replace it with
        # its own for multi_processing: it is asked for in_memory with the same number of
        # workers (the workers received the options as given, above).
        env = environments.SubprocessSDKEnvironment.from_command_string(pool.worker_command())
        quiet = _NoInMemoryWarning()
        logging.getLogger(_FN_RUNNER_LOG).addFilter(quiet)
        direct.direct_running_mode = "in_memory"
        try:
            return fn_runner.FnApiRunner(default_environment=env, provision_info=info).run_pipeline(pipeline, options)
        finally:
            direct.direct_running_mode = "multi_processing"
            logging.getLogger(_FN_RUNNER_LOG).removeFilter(quiet)
