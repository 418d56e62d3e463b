"""``prism``: Beam's PrismRunner, Beam's portable runner written in Go, from a binary built here.

Prism runs as its own process and speaks the Beam job API and Fn API over gRPC, like a
Flink job server or Dataflow Runner v2; Beam's DirectRunner hands it most pipelines (and
falls back to its own engines, without a word, when Prism fails: ``--runner prism`` asks
for PrismRunner itself, so a job that ran ran on Prism).

Our defaults (a flag you give wins): ``--runner=PrismRunner`` and
``--environment_type=LOOPBACK`` (the SDK worker runs in the refinery process, which Prism
calls back). ``--workers`` is not used: Prism gives each environment one SDK worker.

Before a real run :func:`resolve_prism` finds the binary: ``--prism_location`` given, else
the one built into the cache for the installed Beam (:mod:`.prism_local`, ``make
prism-cache``), else one line naming ``make prism-cache`` (Beam would try to download
it). A command's Beam jobs then share one Prism process (:func:`prism_job_service`),
started for the command and stopped at its end; it also ends if the refinery process is
killed. With ``--job_endpoint HOST:PORT`` the jobs go to a Prism already running there.

No socket of the run serves another user: that Prism listens on a unix socket in a folder
only this user can enter (the binary built here is patched to, see :mod:`.prism_local`),
and the LOOPBACK worker pool Prism calls back listens on loopback and refuses any other
uid's call (:mod:`.same_user`).
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

from .args import RunnerOptionsError, has, value, with_defaults


def prism_args(workers: int | None, args: list[str]) -> list[str]:
    """Beam arguments for ``--runner prism`` (pure: nothing is looked up; see :func:`resolve_prism`)."""
    return with_defaults(args, {"--runner": "PrismRunner", "--environment_type": "LOOPBACK"})


def is_prism(args: list[str]) -> bool:
    """Whether ``args`` ask for Beam's PrismRunner (``--runner prism`` or ``PrismRunner``)."""
    return (value(args, "--runner") or "").lower() in ("prismrunner", "prism")


def resolve_prism(args: list[str]) -> list[str]:
    """``args`` completed for a real run, or :class:`RunnerOptionsError` with the one-line
    cause: unchanged with ``--job_endpoint`` (a running Prism); with ``--prism_location``
    that must be a file here; else the cached binary as ``--prism_location`` (Beam would
    download one)."""
    if has(args, "--job_endpoint"):
        return args
    given = value(args, "--prism_location")
    if given:
        if not os.path.isfile(given):
            raise RunnerOptionsError(f"--prism_location {given}: no such file (make prism-cache builds one)")
        return args
    from .prism_local import find_prism, missing_reason  # lazy: `python -m refinery.runners.prism_local` runs it

    found = find_prism()
    if found is None:
        raise RunnerOptionsError(f"--runner prism: {missing_reason()}")
    return args + [f"--prism_location={found}"]


# ---------------------------------------------------------------------------------------
# One Prism for a command
# ---------------------------------------------------------------------------------------

@contextlib.contextmanager
def prism_job_service(args: list[str]) -> Iterator[list[str]]:
    """``args`` with ``--job_endpoint`` of one Prism process started here (the binary of
    ``--prism_location``, see :func:`resolve_prism`) and stopped on leaving, for every Beam
    job of a command; ``args`` unchanged when they are not for Prism, or name a
    ``--job_endpoint`` already. Raises :class:`RunnerOptionsError` (one line) when Prism
    does not start."""
    binary = value(args, "--prism_location")
    if not is_prism(args) or has(args, "--job_endpoint") or not binary:
        yield args
        return
    from .prism_local import PrismServer  # lazy: as in resolve_prism

    try:
        server = PrismServer(binary).start()
    except RuntimeError as e:
        raise RunnerOptionsError(f"--runner prism: {e}") from None
    try:
        yield args + [f"--job_endpoint={server.endpoint}"]
    finally:
        server.stop()
