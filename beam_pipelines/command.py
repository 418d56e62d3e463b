"""What every ``refinery`` pipeline command shares: its execution flags (:class:`RunFlags`)
and one way to run its stages (:func:`run_and_report`: run or dry run, failures with the
resume command, the summary).

A command module (``prep``, ``decon``, ``generate``, ...) plugs into :mod:`cli` (which
holds its one-line help) with two names: ``add_arguments(parser)`` and ``run(args,
beam_args) -> int`` (a process exit code). ``run`` reads ``args`` once, into the command's
typed settings (``settings_from_args``); its checks and its job take those settings, never
``args``. A (sub)command that calls :func:`add_runner_args` is a pipeline: the CLI turns
``--runner/--workers`` and every flag it does not know into Beam arguments and passes them
as ``beam_args``; any other command gets ``[]`` and unknown flags are an error.

Beside it: :mod:`.interrupt` (Ctrl-C and SIGTERM), :mod:`.beam_flags` (which flags are
Beam's), :mod:`.checks` (inputs, outputs and reject rates, checked up front).
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from refinery import runners
from refinery.beam_pipelines.interrupt import interrupted, resume_hint
from refinery.runners import RUNNERS, RunnerOptionsError
from refinery.runners.args import value
from refinery.runners.dataflow import is_dataflow
from refinery.runners.jobs import run_job
from refinery.runners.translate import command_pipeline, dataflow_job, job_bytes, runner_api, step_names
from refinery.transforms.io import storage
from refinery.transforms.io.storage import InputError, PathError
from refinery.transforms.resumable import (
    JobFailed,
    JobResult,
    Stage,
    StageFailed,
    StageRun,
    bind_stages,
    demanded,
    run_stages,
)
from refinery.transforms.resumable.ledger import repairs_of
from refinery.transforms.resumable.orchestration import Runner
from refinery.transforms.resumable.units import Unit

OnPlan = Callable[[list[StageRun], list[list[Unit[Any]]]], None]  # what run_stages calls once the stages are planned


def add_runner_args(p: argparse.ArgumentParser) -> None:
    """The execution flags of every pipeline command."""
    g = p.add_argument_group("execution")
    g.add_argument("--runner", default="local",
                   help=f"where to run: {', '.join(RUNNERS)}, or any Beam runner name (default: local). "
                        "Flags refinery does not know go to Beam (--project, --flink_master, ...); "
                        "dataflow needs --project, --region and --temp_location gs://BUCKET/PATH, and gs:// "
                        "inputs and output; it also takes --gpu TYPE[:COUNT] (e.g. nvidia-l4) for GPU workers")
    g.add_argument("--workers", type=int, default=None,
                   help="local: worker processes (default: one per core); flink: parallelism; dataflow: max workers")
    g.add_argument("--verify-checksums", action="store_true",
                   help="treat a finished unit as done only if its files' sha256 still match (reads everything)")
    g.add_argument("--force", action="store_true", help="discard receipts and start a fresh run")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--dry-run", action="store_true",
                   help="print the plan (units per stage: done, failed, pending; with --runner dataflow also "
                        "each job's Dataflow description) and exit; nothing is run or written, and nothing "
                        "remote is read (gs:// inputs are not listed, receipts on gs:// not read)")
    g.add_argument("-v", "--verbose", action="store_true", help="log each stage's plan")


@dataclass(frozen=True)
class RunFlags:
    """The execution flags of :func:`add_runner_args`, as read once from the command line."""

    runner: str = "local"
    workers: int | None = None
    verify_checksums: bool = False
    force: bool = False
    no_progress: bool = False
    dry_run: bool = False
    verbose: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunFlags:
        """The flags of ``args`` (a command without one of them: its default)."""
        return cls(runner=str(getattr(args, "runner", "local")), workers=getattr(args, "workers", None),
                   verify_checksums=bool(getattr(args, "verify_checksums", False)),
                   force=bool(getattr(args, "force", False)), no_progress=bool(getattr(args, "no_progress", False)),
                   dry_run=bool(getattr(args, "dry_run", False)), verbose=bool(getattr(args, "verbose", False)))


# ---------------------------------------------------------------------------------------
# One runner for every pipeline command
# ---------------------------------------------------------------------------------------

@dataclass
class Pipeline:
    """What a pipeline command hands to :func:`run_and_report`.

    ``header``: printed (stderr) before running; ``summary(result, seconds)``: what a
    successful run did, printed on stdout; ``verdict(result)``: why a run whose units all
    finished still failed (e.g. :func:`reject_rate_failure`), or None: exit 1 with that line;
    ``on_plan``/``runner``: passed to ``run_stages``.
    """

    command: str
    output: str
    stages: list[Stage[Any, Any]]
    header: str = ""
    summary: Callable[[JobResult, float], str] | None = None
    verdict: Callable[[JobResult], str | None] | None = None
    on_plan: OnPlan | None = None
    runner: Runner | None = None
    run_info: dict[str, Any] = field(default_factory=dict)


def usage_error(message: str) -> int:
    print(message, file=sys.stderr)
    return 2


def run_and_report(p: Pipeline, flags: RunFlags, beam_args: list[str]) -> int:
    """Dry run or run ``p``'s stages; print the header, the failures with the resume command,
    or the summary. Returns the exit code: 0 done, 1 units not completed, a Beam job failed or
    the verdict failed."""
    if flags.dry_run:
        try:
            return print_plan(p, flags, beam_args)
        except InputError as e:
            return usage_error(f"refinery {p.command}: {e}")
    if p.header:
        print(p.header, file=sys.stderr)
    t0 = time.time()
    full = DiskFull()
    try:
        with runners.job_service(beam_args) as job_args, full.watching(verbose=flags.verbose):
            result = run_stages(p.stages, p.output, job_args, verify_checksums=flags.verify_checksums,
                                force=flags.force, progress=not flags.no_progress,
                                run_info={"command": p.command, "argv": sys.argv[1:], **p.run_info},
                                on_plan=p.on_plan, runner=p.runner or run_job)
    except (StageFailed, JobFailed, OSError) as e:
        if not (full.seen or is_disk_full(e)) or (isinstance(e, JobFailed) and interrupted()):
            if isinstance(e, OSError):
                raise
            return _failed(p, e, beam_args)
        print(f"refinery {p.command}: {disk_full_line(p.output)}; finished units are kept: free some space and run "
              f"the same command again: {resume_hint()}", file=sys.stderr)
        return 1
    except (InputError, PathError, RunnerOptionsError) as e:  # the last: a job server that did not start
        return usage_error(f"refinery {p.command}: {e}")
    said = p.summary(result, time.time() - t0) if p.summary else None
    failure = p.verdict(result) if p.verdict else None
    if said is not None:
        print(failed_summary(p.command, said) if failure else said)
    if failure:
        print(f"refinery {p.command}: {failure}", file=sys.stderr)
        return 1
    return 0


def failed_summary(command: str, summary: str) -> str:
    """A run's summary once its verdict failed it: never "done", and never a path it did not
    leave: ``COMMAND done in`` reads ``COMMAND failed after``, and a line naming an output
    (``  manifest: PATH``, ``  report: PATH ...``) that does not exist says there is none."""
    lines = summary.splitlines()
    if lines and lines[0].startswith(f"{command} done in "):
        lines[0] = f"{command} failed after " + lines[0][len(f"{command} done in "):]
    for k, line in enumerate(lines):
        label, sep, rest = line.partition(": ")
        path = rest.split(" ", 1)[0]
        if sep and line.startswith("  ") and " " not in label.strip() and "/" in path and not storage.exists(path):
            lines[k] = f"{label}: none (the run failed; `refinery status` shows what is unfinished)"
    return "\n".join(lines)


def _failed(p: Pipeline, e: StageFailed | JobFailed, beam_args: list[str]) -> int:
    """The failure of a run whose units failed (:class:`StageFailed`) or whose Beam job failed
    (:class:`JobFailed`), with the command that resumes it; exit 1."""
    if not isinstance(e, JobFailed):
        print(f"refinery {p.command}: {e}\nFinished units are kept; fix the cause and run the same command again:\n"
              f"  {resume_hint()}", file=sys.stderr)
        return 1
    if interrupted():  # a job stopped by Ctrl-C: the interruption, not a failure
        raise e
    print(f"refinery {p.command}: {e}\nFinished units are kept (-v shows {beam_runner_name(beam_args)}'s whole "
          f"error); fix the cause and run the same command again:\n  {resume_hint()}", file=sys.stderr)
    return 1


NO_SPACE = ("[Errno 28]", "No space left on device")  # how an ENOSPC reads once a worker turned it into text


def is_disk_full(e: BaseException) -> bool:
    """Whether ``e``, its causes or its text (a unit's failure, a runner's error: text by the
    time it reaches the driver) say a disk is full (``ENOSPC``)."""
    seen: set[int] = set()
    current: BaseException | None = e
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno == errno.ENOSPC:
            return True
        if any(mark in str(current) for mark in NO_SPACE):
            return True
        current = getattr(current, "cause", None) or current.__cause__ or current.__context__
    return False


def disk_full_line(output: str) -> str:
    """One line naming the disk ``output`` is on (its mount point, free and total space), or the
    output alone where it is not a local folder."""
    if storage.is_remote(output):
        return f"no space left on a disk while writing {output} (a worker's local disk, or its spool)"
    folder = os.path.abspath(output)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    mount = os.path.realpath(folder)
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    usage = shutil.disk_usage(folder)
    return (f"no space left on device: the disk of {output} (mounted at {mount}) has {usage.free / 1e6:,.1f} MB free "
            f"of {usage.total / 1e6:,.1f} MB")


class DiskFull:
    """While :meth:`watching`: the log records that say a disk is full (each failed unit's
    line, a runner's tracebacks, every worker's copy of them) are held back, and ``seen`` says
    whether there was one: the run then ends in one line (:func:`disk_full_line`), not a
    screenful of the same error. With ``verbose``, the records are printed as well."""

    def __init__(self) -> None:
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        exc = record.exc_info[1] if record.exc_info else None
        if any(mark in text for mark in NO_SPACE) or (exc is not None and is_disk_full(exc)):
            self.seen = True
            return self.verbose
        return True

    @contextlib.contextmanager
    def watching(self, verbose: bool = False) -> Iterator[None]:
        self.verbose = verbose
        handlers = logging.getLogger().handlers
        for h in handlers:
            h.addFilter(self.filter)
        try:
            yield
        finally:
            for h in handlers:
                h.removeFilter(self.filter)


def beam_runner_name(beam_args: list[str]) -> str:
    """The ``--runner`` Beam was given (``FlinkRunner``, ``DirectRunner``, ...)."""
    return value(beam_args, "--runner") or "DirectRunner"


def print_plan(p: Pipeline, flags: RunFlags, beam_args: list[str]) -> int:
    """Print the plan (per stage: units done, failed, pending, by the one completion check)
    and, for ``--runner dataflow``, each Beam job's Dataflow description; change nothing.
    Inside ``storage.offline`` (the CLI's dry runs) it says which remote inputs it did not list
    and, for a remote output, that it did not read the receipts."""
    force, verify = flags.force, flags.verify_checksums
    offline = storage.offline_state()
    print(f"refinery {p.command} --dry-run: plan for {p.output} (nothing is run or written)")
    if p.header:
        print(p.header)
    if offline and offline.unlisted:
        print(f"  not listed ({offline.reason}), so not counted below: {', '.join(offline.unlisted)}")
    unread = bool(offline) and storage.is_remote(p.output) and not force
    if unread and offline:
        print(f"  receipts under {p.output} not read ({offline.reason}): done/failed/pending unknown")
    print(f"  {'stage':10} {'hash':16} {'units':>7} {'done':>7} {'failed':>7} {'pending':>7}")
    repairs: dict[str, str] = {}  # of the earlier stages' done units: a later unit built before one is pending
    runs = bind_stages(p.stages, p.output)
    rows: list[tuple[StageRun, int, int, int, int]] = []
    for run in runs:
        units = run.stage.plan()
        if unread:
            print(f"  {run.name:10} {run.stage_hash:16} {len(units):>7} {'?':>7} {'?':>7} {'?':>7}")
            continue
        done = failed = 0
        run.upstream_repairs = dict(repairs)
        if not force:
            for u in units:
                c = run.check(u.id, verify)
                done += c.done
                failed += c.failed
                repairs.update(repairs_of(run.name, {u.id: c.done_receipt()} if c.done else {}))
        rows.append((run, len(units), done, failed, len(units) - done - failed))
    last = demanded([r.traits.final_outputs for r, *_ in rows], [done < n for _, n, done, _, _ in rows])
    for i, (run, n, done, failed, pending) in enumerate(rows):
        idle = "  (not run: the stages after it are complete)" if pending and i > last else ""
        print(f"  {run.name:10} {run.stage_hash:16} {n:>7} {done:>7} {failed:>7} {pending:>7}{idle}")
    unplanned = [r.traits.title for r in runs if not r.stage.plan()]
    if unplanned:  # remote inputs a dry run does not list: the real run's job has these steps too
        print(f"  no units planned here for: {', '.join(unplanned)} (its inputs are listed when the run starts; "
              "the run's job has that step too, not shown below)")
    print_job_size(p, verify, beam_args)
    return 0


def print_job_size(p: Pipeline, verify: bool, beam_args: list[str]) -> None:
    """The size of the job a run of ``p`` submits (for Dataflow, its description too)."""
    if is_dataflow(beam_args):
        job = dataflow_job(p.stages, p.output, beam_args, verify)
        print(describe_dataflow_job(p.command, job, step_names(job.proto_pipeline)) if job is not None
              else "  no Dataflow job to describe: its stages have no units planned here")
        if job is not None:
            proto, request = len(job.proto_pipeline.SerializeToString()), job_bytes(job)
            print(f"  job size: {proto / 1e6:.2f} MB runner-API proto (the job graph Dataflow builds from it), "
                  f"{request / 1e6:.2f} MB job request; the units are read from the plan written into the output, "
                  "not carried in the job")
            if max(proto, request) > DATAFLOW_GRAPH_LIMIT:
                print(f"  WARNING: the job is over Dataflow's {DATAFLOW_GRAPH_LIMIT // 10**6} MB limit for a job "
                      "graph: add --experiments=upload_graph", file=sys.stderr)
    else:
        pipeline = command_pipeline(p.stages, p.output, [a for a in beam_args if a.startswith("--runner")], verify)
        if pipeline is not None:
            size = len(runner_api(pipeline).SerializeToString())
            print(f"  job size: {size / 1e6:.2f} MB (its runner-API proto; the units are read from the plan "
                  "written into the output, not carried in the job)")


DATAFLOW_GRAPH_LIMIT = 10 * 10**6  # bytes of a job graph Dataflow accepts without --experiments=upload_graph


def describe_dataflow_job(command: str, job: Any, steps: list[str]) -> str:
    """A few lines of a Dataflow job description: its steps, image, machine type, workers,
    packages."""
    env = job.proto.environment
    lines = [f"  dataflow job for refinery {command}: {job.proto.name or '(unnamed)'}",
             f"    steps: {', '.join(steps)}"]
    for pool in env.worker_pools:
        scaling = pool.autoscaling_settings
        lines.append(f"    image {pool.worker_harness_container_image or '(Beam default)'}, machine "
                     f"{pool.machine_type or '(default)'}, max workers "
                     f"{scaling.max_num_workers if scaling and scaling.max_num_workers else '-'}")
        lines.append(f"    packages: {', '.join(pk.name for pk in pool.packages) or '-'}")
    if env.service_options:
        lines.append(f"    service options: {', '.join(env.service_options)}")
    return "\n".join(lines)


