"""A command's Beam job, on whichever runner its flags name: the step runner every command
gives :func:`~refinery.transforms.resumable.orchestration.run_stages`."""
from __future__ import annotations

from typing import Any

from refinery.transforms.io.beam_import import import_beam

from . import portable
from .local import in_process, runnable
from .shutdown_noise import held_shutdown_noise


def run_job(steps: list[Any], beam_args: list[str], verify_checksums: bool = False) -> dict[str, int]:
    """Run a command's ``steps`` as one Beam job with ``beam_args`` (any runner); its counters.
    On the local runner, a job of only light steps runs in the driver's process
    (:func:`~.local.in_process`: there is nothing to share between worker processes, and
    starting them would cost more than the work), and every job on
    :class:`~refinery.runners.local_runner.LocalRunner` (:func:`~.local.runnable`). A job's
    LOOPBACK worker pool, on any runner, listens on loopback and serves this user only
    (:func:`~.same_user.private_loopback_workers`); on the embedded portable job service
    there is none (:func:`~.portable.runnable`). The SDK workers' tracebacks of a data plane
    hung up at the end of a job are said only if the job failed (:mod:`.shutdown_noise`)."""
    import_beam()  # before anything imports it: without the connectors no command uses
    from refinery.transforms.resumable.beam_steps import light_job, run_on_beam  # lazy: Beam, when a job runs

    from .same_user import private_loopback_workers  # lazy: gRPC, when a job runs

    if light_job(steps):
        beam_args = in_process(beam_args)
    with private_loopback_workers(), held_shutdown_noise():
        return run_on_beam(steps, portable.runnable(runnable(beam_args)), verify_checksums)
