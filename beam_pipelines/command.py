"""What every ``refinery`` command shares: execution flags, interruption and the resume hint.

A command module (``prep``, ``decon``, ``generate``, ...) plugs into :mod:`cli` with three
names: ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args, beam_args) -> int``
(a process exit code). A (sub)command that calls :func:`add_runner_args` is a pipeline: the
CLI turns ``--runner/--workers`` and every flag it does not know into Beam arguments and
passes them as ``beam_args``; any other command gets ``[]`` and unknown flags are an error.
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import logging
import os
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable


def add_runner_args(p: argparse.ArgumentParser) -> None:
    """The execution flags of every pipeline command."""
    from refinery.runners import RUNNERS

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


_INTERRUPTED: list[int] = []
_WATCHDOG: list[threading.Timer] = []
STOP_GRACE_S = 5.0  # after SIGINT/SIGTERM, exit hard if Beam has not stopped by then
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _descendants(pid: int) -> list[int]:
    """Pids of every process below ``pid`` (Linux ``/proc``; [] elsewhere)."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for d in os.listdir("/proc"):
            if d.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    with open(f"/proc/{d}/stat", "rb") as f:
                        ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
                    children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


WORKER_COMMANDS = (b"sdk_worker_main", b"refinery.runners.warm_workers")  # Beam's workers; the warm pool's


def _stop_beam_workers() -> None:
    """SIGKILL the Beam SDK worker processes below this one (they block SIGINT, see
    :func:`interruptible`), the warm pool's included: a unit they were running leaves only
    temp files, which the next run removes."""
    for pid in _descendants(os.getpid()):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            if any(c in cmdline for c in WORKER_COMMANDS):
                os.kill(pid, signal.SIGKILL)


def _say(message: str) -> None:
    """One message on stderr, now (ASCII dots where the terminal cannot show an ellipsis)."""
    with contextlib.suppress(Exception):
        try:
            print(message, file=sys.stderr, flush=True)
        except UnicodeEncodeError:
            print(message.replace("\u2026", "..."), file=sys.stderr, flush=True)


def _signal_name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def _hard_exit(signum: int, why: str) -> None:
    """Leave now, saying ``why``: finished units have receipts, unfinished ones only temp
    files that the next run removes. Beam's worker processes (our descendants) are killed first."""
    _say(f"\ninterrupted ({_signal_name(signum)}); {why}, exiting now. Finished units are kept. "
         f"Resume with:\n  {resume_hint()}")
    for pid in _descendants(os.getpid()):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    os._exit(130)


def _on_stop_signal(signum: int) -> None:
    """Bookkeeping of SIGINT/SIGTERM: a second one exits at once; the first is acknowledged
    at once (the progress bar stops, "stopping…" is printed), arms a watchdog (Beam can
    swallow a KeyboardInterrupt and wait forever) and stops Beam's workers."""
    from refinery.transforms.core.stages import halt_progress

    _INTERRUPTED.append(signum)
    if len(_INTERRUPTED) > 1:
        _hard_exit(signum, f"{_signal_name(signum)} again")
    logging.disable(logging.CRITICAL)  # Beam's threads dying of the stop: no log lines before the hint
    halt_progress()
    _say(f"\nstopping\u2026 ({_signal_name(signum)} again to quit now)")
    timer = threading.Timer(STOP_GRACE_S, _hard_exit, args=(signum, f"Beam did not stop within {STOP_GRACE_S:.0f}s"))
    timer.daemon = True
    timer.start()
    _WATCHDOG.append(timer)
    _stop_beam_workers()


def _interrupt_main_thread() -> None:
    """Raise KeyboardInterrupt in the main thread at its next bytecode (SIGINT is ignored
    there while a command runs, so ``_thread.interrupt_main`` would do nothing)."""
    import ctypes

    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(threading.main_thread().ident),
                                               ctypes.py_object(KeyboardInterrupt))


def _watch_signals(stop: threading.Event) -> None:
    """The thread that takes SIGINT/SIGTERM (blocked in every thread, so they wait for it):
    count it, stop Beam's workers, interrupt the main thread."""
    while not stop.is_set():
        info = signal.sigtimedwait(STOP_SIGNALS, 0.05)
        # a stop/continue (SIGSTOP, SIGCONT) can end the wait with a siginfo of no signal
        if info is not None and info.si_signo in STOP_SIGNALS:
            _on_stop_signal(info.si_signo)
            _interrupt_main_thread()


def _quiet_thread_exceptions(args) -> None:
    """After an interruption, Beam's threads dying of it print nothing (the hint comes last)."""
    if not _INTERRUPTED:
        _default_excepthook(args)


_default_excepthook = threading.excepthook


def interruptible(run) -> int:
    """Call ``run()``; on SIGINT/SIGTERM stop quietly, print the resume command last and
    return 130.

    While ``run`` runs, SIGINT and SIGTERM are ignored and blocked: the processes it starts
    (Beam's SDK workers) inherit "ignored", so the terminal's Ctrl-C, which reaches the
    whole process group, does not make each of them print a traceback; in this process
    the blocked signals wait for a watcher thread, which kills the workers and raises
    KeyboardInterrupt in the main thread. Beam may wrap that KeyboardInterrupt, so any
    exception that follows a signal counts as the interruption; so does a KeyboardInterrupt
    that lands in the clean-up (a signal just as ``run`` returned).
    """
    _INTERRUPTED.clear()
    old_handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    threading.excepthook = _quiet_thread_exceptions
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_signals, args=(stop,), name="refinery-signals", daemon=True)
    watcher.start()

    def restore() -> None:  # idempotent: run again when a KeyboardInterrupt cut it short
        stop.set()
        watcher.join(timeout=1)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
        threading.excepthook = _default_excepthook
        logging.disable(logging.NOTSET)
        for timer in _WATCHDOG:  # stopped in time: no hard exit later (in-process callers)
            timer.cancel()
        _WATCHDOG.clear()

    try:
        try:
            return run()
        except KeyboardInterrupt:
            pass
        except Exception:
            if not _INTERRUPTED:
                raise
        finally:
            restore()
    except KeyboardInterrupt:
        restore()
    _stop_beam_workers()
    print(f"\ninterrupted: finished units are kept. Resume with:\n  {resume_hint()}", file=sys.stderr, flush=True)
    return 130


def resume_hint() -> str:
    """The command line that resumes this run (``--force`` removed)."""
    argv = [a for a in sys.argv[1:] if a != "--force"]
    return "refinery " + shlex.join(argv)


# ---------------------------------------------------------------------------------------
# Optional dependencies (setup.py's extras)
# ---------------------------------------------------------------------------------------

def missing_extra(module: str, extra: str) -> str | None:
    """None when ``module`` can be imported; else what to install. refinery is installed from
    a clone (it is not on PyPI), so the hint names the extra of this checkout's setup.py."""
    import importlib.util

    if importlib.util.find_spec(module) is not None:
        return None
    return f"{module} is not installed: pip install -e '.[{extra}]' (in the refinery checkout)"


# ---------------------------------------------------------------------------------------
# Flags: what is not ours must be Beam's
# ---------------------------------------------------------------------------------------

class UsageError(ValueError):
    """A bad command line or input; the CLI prints it as one line and exits 2."""


OUR_RUNNER_FLAGS = ("--gpu",)  # consumed by refinery.runners (dataflow), not Beam


@functools.lru_cache(maxsize=1)
def beam_flags() -> frozenset[str]:
    """Every flag Beam's PipelineOptions define (``--job_name``, ``--temp_location``, ...),
    runner-specific ones (Flink, Spark, portable) included."""
    import apache_beam.options.pipeline_options as po

    for module in ("apache_beam.runners.portability.flink_runner",
                   "apache_beam.runners.portability.spark_runner",
                   "apache_beam.runners.portability.portable_runner"):
        with contextlib.suppress(ImportError):
            __import__(module)
    parser = argparse.ArgumentParser(add_help=False, conflict_handler="resolve")
    todo, seen = [po.PipelineOptions], set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo += cls.__subclasses__()
        with contextlib.suppress(Exception):
            cls._add_argparse_args(parser)
    return frozenset(s for s in parser._option_string_actions if s.startswith("--"))


def check_beam_args(command: str, parser: argparse.ArgumentParser, leftover: list[str]) -> list[str]:
    """``leftover`` (the flags the command's parser did not take) if every flag in it is one of
    Beam's options (or ours, see :data:`OUR_RUNNER_FLAGS`); else :class:`UsageError` naming
    the first unknown one with the nearest known flag ("did you mean --num-shards?")."""
    if not leftover:
        return leftover
    known = beam_flags() | set(OUR_RUNNER_FLAGS)
    after_flag = False
    for token in leftover:
        if token.startswith("--"):
            name = token.split("=", 1)[0]
            if name not in known:
                ours = [s for s in parser._option_string_actions if s.startswith("--")]
                close = difflib.get_close_matches(name, ours, n=1, cutoff=0.6) or \
                    difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
                hint = f"; did you mean {close[0]}?" if close else " (not a refinery or Beam option)"
                raise UsageError(f"refinery {command}: unknown option {name}{hint}")
            after_flag = "=" not in token
        elif not after_flag:
            raise UsageError(f"refinery {command}: unexpected argument {token!r}")
        else:
            after_flag = False
    return leftover


# ---------------------------------------------------------------------------------------
# Where a run reads and writes: checked up front, without the network
# ---------------------------------------------------------------------------------------

# the data paths a pipeline's workers read or write (the flags' dest names)
WORKER_PATHS = ("input", "eval", "train", "input_docids", "data_root", "output")


def gs_paths(args, parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
    """(flag, path) for every ``gs://`` path among the arguments ``parser`` parsed (flag ""
    for a positional argument)."""
    flags = {a.dest: a.option_strings[-1] for a in parser._actions if a.option_strings}
    found = []
    for dest, v in sorted(vars(args).items()):
        for item in v if isinstance(v, list) else [v]:
            if isinstance(item, str) and item.startswith("gs://"):
                found.append((flags.get(dest, ""), item))
    return found


def location_problems(args, parser: argparse.ArgumentParser, beam_args: list[str]) -> list[str]:
    """One line per problem with where the run reads and writes: for Dataflow, its options
    (``runners.dataflow.option_problems``) and every local data path (its workers cannot
    see this machine's files); the bucket name of every ``gs://`` path. Reads nothing remote."""
    from refinery.runners.dataflow import is_dataflow, option_problems
    from refinery.transforms.core import io
    from refinery.transforms.core.gcs import bucket_problem

    problems = []
    if is_dataflow(beam_args):
        problems += option_problems(beam_args)
        for dest in WORKER_PATHS:
            v = getattr(args, dest, None)
            for path in v if isinstance(v, list) else [v]:
                if isinstance(path, str) and not io.is_remote(path):
                    problems.append(f"--{dest.replace('_', '-')} {path}: a local path, which Dataflow's workers "
                                    "cannot see; give a gs://BUCKET/PATH (or run with --runner local)")
    for flag, path in gs_paths(args, parser):
        if (bad := bucket_problem(path)) is not None:
            problems.append(f"{flag} {bad}".strip())
    return problems


# ---------------------------------------------------------------------------------------
# One runner for every pipeline command
# ---------------------------------------------------------------------------------------

@dataclass
class Pipeline:
    """What a pipeline command hands to :func:`run_pipeline`.

    ``header``: printed (stderr) before running; ``summary(result, seconds)``: what a
    successful run did, printed on stdout; ``verdict(result)``: why a run whose units all
    finished still failed (e.g. :func:`reject_rate_failure`), or None: exit 1 with that line;
    ``on_plan``/``runner``: passed to ``run_stages``.
    """

    command: str
    output: str
    stages: list
    header: str = ""
    summary: Callable[[object, float], str] | None = None
    verdict: Callable[[object], str | None] | None = None
    on_plan: Callable | None = None
    runner: Callable | None = None
    run_info: dict = field(default_factory=dict)


def usage_error(message: str) -> int:
    print(message, file=sys.stderr)
    return 2


def run_pipeline(p: Pipeline, args, beam_args: list[str]) -> int:
    """Dry run or run ``p``'s stages; print the header, the failures with the resume command,
    or the summary. Returns the exit code: 0 done, 1 units not completed, a Beam job failed or
    the verdict failed."""
    from refinery.runners import job_service
    from refinery.transforms.core.io import InputError, PathError
    from refinery.transforms.core.stages import JobFailed, StageFailed, run_stages

    if getattr(args, "dry_run", False):
        try:
            return dry_run(p, args, beam_args)
        except InputError as e:
            return usage_error(f"refinery {p.command}: {e}")
    if p.header:
        print(p.header, file=sys.stderr)
    t0 = time.time()
    try:
        with job_service(beam_args) as job_args:
            result = run_stages(p.stages, p.output, job_args,
                                verify_checksums=getattr(args, "verify_checksums", False),
                                force=getattr(args, "force", False), progress=not getattr(args, "no_progress", False),
                                run_info={"command": p.command, "argv": sys.argv[1:], **p.run_info},
                                on_plan=p.on_plan, runner=p.runner)
    except StageFailed as e:
        print(f"refinery {p.command}: {e}\nFinished units are kept; fix the cause and run the same command again:\n"
              f"  {resume_hint()}", file=sys.stderr)
        return 1
    except JobFailed as e:
        if _INTERRUPTED:  # a job stopped by Ctrl-C: the interruption, not a failure
            raise
        print(f"refinery {p.command}: {e}\nFinished units are kept (-v shows {beam_runner_name(beam_args)}'s whole "
              f"error); fix the cause and run the same command again:\n  {resume_hint()}", file=sys.stderr)
        return 1
    except (InputError, PathError) as e:
        return usage_error(f"refinery {p.command}: {e}")
    if p.summary:
        print(p.summary(result, time.time() - t0))
    failure = p.verdict(result) if p.verdict else None
    if failure:
        print(f"refinery {p.command}: {failure}", file=sys.stderr)
        return 1
    return 0


def beam_runner_name(beam_args: list[str]) -> str:
    """The ``--runner`` Beam was given (``FlinkRunner``, ``DirectRunner``, ...)."""
    from refinery.runners.args import value

    return value(beam_args, "--runner") or "DirectRunner"


def dry_run(p: Pipeline, args, beam_args: list[str]) -> int:
    """Print the plan (per stage: units done, failed, pending, by the one completion check)
    and, for ``--runner dataflow``, each Beam job's Dataflow description; change nothing.
    Inside ``io.offline`` (the CLI's dry runs) it says which remote inputs it did not list
    and, for a remote output, that it did not read the receipts."""
    from refinery.runners.dataflow import is_dataflow
    from refinery.transforms.core import io
    from refinery.transforms.core.stages import bind_stages, repairs_of

    force = getattr(args, "force", False)
    verify = getattr(args, "verify_checksums", False)
    offline = io.offline_state()
    print(f"refinery {p.command} --dry-run: plan for {p.output} (nothing is run or written)")
    if p.header:
        print(p.header)
    if offline and offline.unlisted:
        print(f"  not listed ({offline.reason}), so not counted below: {', '.join(offline.unlisted)}")
    unread = bool(offline) and io.is_remote(p.output) and not force
    if unread:
        print(f"  receipts under {p.output} not read ({offline.reason}): done/failed/pending unknown")
    print(f"  {'stage':10} {'hash':16} {'units':>7} {'done':>7} {'failed':>7} {'pending':>7}")
    repairs: dict[str, str] = {}  # of the earlier stages' done units: a later unit built before one is pending
    for run in bind_stages(p.stages, p.output):
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
                repairs.update(repairs_of(run.name, {u.id: c.receipt} if c.done else {}))
        pending = len(units) - done - failed
        print(f"  {run.name:10} {run.stage_hash:16} {len(units):>7} {done:>7} {failed:>7} {pending:>7}")
    if is_dataflow(beam_args):
        from refinery.runners.translate import dataflow_job, step_names

        job = dataflow_job(p.stages, p.output, beam_args, verify)
        print(describe_dataflow_job(p.command, job, step_names(job.proto_pipeline)) if job is not None
              else "  no Dataflow job to describe: its stages have no units planned here")
    return 0


def describe_dataflow_job(command: str, job, steps: list[str]) -> str:
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


# ---------------------------------------------------------------------------------------
# Input sanity: a wrong field name is an error before anything runs, not an empty result
# ---------------------------------------------------------------------------------------

def check_field(command: str, flag: str, field: str, paths: list[str], files: int = 8, rows: int = 100) -> None:
    """:class:`UsageError` when none of the first ``rows`` readable rows of an input file has
    ``field`` (the first ``files`` files are looked at), naming the file and the fields its
    rows do have. A file whose first rows are all unreadable is left to the run (its rows
    are rejected with reasons)."""
    from refinery.transforms.core.rows import iter_rows

    for path in paths[:files]:
        fields: dict[str, None] = {}
        good, found = 0, False
        for _, record, error in iter_rows(path):
            if error is not None:
                continue
            if field in record:
                found = True
                break
            fields.update(dict.fromkeys(record))
            good += 1
            if good >= rows:
                break
        if good and not found:
            raise UsageError(f"refinery {command}: {flag} {field!r}: no row of {path} has it (first {good} "
                             f"row(s) read); their fields: {', '.join(list(fields)[:20])}")


def check_output(command: str, output: str, inputs=(), *, dry_run: bool = False, flag: str = "--output") -> None:
    """:class:`UsageError` unless ``output`` can be this run's output folder, checked before
    anything is written: it is not a file nor under one, a folder can be made there (probed,
    except on a dry run, which writes nothing), and no input folder or glob in ``inputs``
    would list it (a run reading its own outputs back as input). Every command that takes
    ``--output`` calls it (``flag``: how the message names the output)."""
    from refinery.transforms.core import io

    problem = io.output_folder_problem(output, probe=not dry_run)
    if problem:
        raise UsageError(f"refinery {command}: {flag} {output}: {problem}")
    for arg in inputs:
        if io.listing_reaches(arg, output):
            raise UsageError(f"refinery {command}: {flag} {output} is inside the input {arg}, whose listing would "
                             f"read the run's own outputs back; give an output folder outside it")


def add_reject_rate_arg(g, rows: str = "the rows read") -> None:
    """``--max-reject-rate R`` on the argument group ``g``; ``rows``: which rows it counts."""
    g.add_argument("--max-reject-rate", type=float, default=None, metavar="R",
                   help=f"exit 1 when more than R (0..1, e.g. 0.05) of {rows} were rejected; the outputs are "
                        f"still written (default: exit 1 only when no row was accepted). A run that read no "
                        f"row at all always exits 1")


def bad_reject_rate(args) -> str | None:
    """What is wrong with ``--max-reject-rate`` (for a usage error), or None."""
    rate = args.max_reject_rate
    if rate is not None and not 0.0 <= rate <= 1.0:
        return f"--max-reject-rate must be between 0 and 1 (e.g. 0.05 for 5%), not {rate:g}"
    return None


def reject_rate_failure(what: str, read: int, rejected: int, accepted: int, max_rate: float | None,
                        reasons: str) -> str | None:
    """Why a run fails its ``--max-reject-rate`` (one line, naming ``what`` was read, with
    ``reasons``: where the reasons are), or None. ``max_rate`` None: fail only when nothing
    was accepted. Reading nothing at all always fails."""
    if read == 0:
        return f"no {what} read (empty input files?)"
    if max_rate is None:
        if accepted == 0:
            return (f"no {what} accepted of {read:,} read ({rejected:,} rejected; {reasons}); "
                    f"--max-reject-rate 1 lets such a run pass")
        return None
    if rejected > max_rate * read:
        return (f"{rejected:,} of {read:,} {what} ({100 * rejected / read:.0f}%) rejected, more than "
                f"--max-reject-rate {max_rate:g}; {reasons}")
    return None


def warn_if_mostly_rejected(command: str, rejected: int, read: int, where: str) -> None:
    """A loud line on stderr when more than half of the rows read were rejected."""
    if read and rejected * 2 > read:
        print(f"WARNING refinery {command}: {rejected:,} of {read:,} rows ({100 * rejected / read:.0f}%) were "
              f"rejected; the reasons are in {where}. Check --text-field and the input files.", file=sys.stderr)
