"""Ctrl-C and SIGTERM while a command runs: stop quietly, kill Beam's workers, print the
command that resumes the run (exit 130); a second signal, or a Beam that does not stop within
:data:`STOP_GRACE_S`, exits at once."""
from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import sys
import threading
from typing import Callable

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
    # the console script imports this module before the stop signals are blocked, when nothing
    # that may start a thread may be imported (see interruptible)
    from refinery.transforms.resumable.progress import halt_progress  # lazy: not before the signals are blocked

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

    main = threading.main_thread().ident
    assert main is not None  # the main thread has started: it runs this process
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main),
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


def _quiet_thread_exceptions(args: threading.ExceptHookArgs) -> None:
    """After an interruption, Beam's threads dying of it print nothing (the hint comes last)."""
    if not _INTERRUPTED:
        _default_excepthook(args)


_default_excepthook = threading.excepthook


def interruptible(run: Callable[[], int]) -> int:
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


def interrupted() -> bool:
    """Whether a stop signal came while the current command ran (Beam may wrap the
    KeyboardInterrupt it raised into another exception)."""
    return bool(_INTERRUPTED)
