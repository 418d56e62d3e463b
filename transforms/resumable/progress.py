"""Progress of a running job, drawn from its units' receipts (see :class:`Progress`)."""
from __future__ import annotations

import contextlib
import datetime as _dt
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, cast

from refinery.transforms.io import storage

if TYPE_CHECKING:
    from refinery.transforms.resumable.base import StageRun
    from refinery.transforms.resumable.ledger import Receipt

# show(step index, units done, postfix, step ended): draws one step's progress
Show = Callable[[int, int, str, bool], None]


class Progress:
    """Progress of a job's steps, fed from receipts (the source of truth), polled in a
    background thread: the step in progress is the first whose units have not all
    completed. A tqdm bar per step on a terminal; otherwise (a log file, CI) a plain line
    at most every :attr:`LOG_EVERY_S` seconds, one when a step ends and one at the end,
    never a redrawn bar. :func:`halt_progress` (an interruption) stops every bar at once,
    without a last poll."""

    LOG_EVERY_S = 30.0
    _active: set[Progress] = set()

    def __init__(self, steps: list[tuple[StageRun, int]], interval: float, enabled: bool):
        self.steps, self.interval, self.enabled = [s for s in steps if s[1]] or steps[:1], interval, enabled
        self._seen: dict[str, Receipt] = {}  # completed receipts already read (see read_receipts)
        self._stop = threading.Event()
        self._halted = False
        self._thread: threading.Thread | None = None
        self._current = 0
        self._start = self._step_start = time.time()
        self._last_end: float | None = None  # the latest finish of a unit of this run, of the step polled last
        self._eta = ""  # the step polled last: its time left, from the units this run finished ('' unknown)
        self._started_iso = _dt.datetime.fromtimestamp(self._start, _dt.timezone.utc).isoformat(timespec="milliseconds")

    def __enter__(self) -> Progress:
        if self.enabled and self.steps:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
            Progress._active.add(self)
        return self

    def halt(self, timeout: float) -> None:
        """Stop drawing now: no last poll, no final line; waits up to ``timeout`` s for the
        drawing thread to finish its current line."""
        self._halted = True
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=timeout)

    def _poll(self, run: StageRun, total: int) -> tuple[int, str]:
        """(units done, a postfix such as ``docs=... tokens=... resumed=3 failed=1``) of one step:
        the stats are those of the units finished in this run plus the counts so far of its
        running units (:meth:`_running`); ``resumed``: units done before."""
        done = failed = resumed = 0
        stats: dict[str, float] = {}
        ended: set[str] = set()  # units with a receipt of this run
        last = ""
        for r in run.read_receipts(self._seen):
            new = r.get("finished_at", "") >= self._started_iso
            if new:
                ended.add(str(r.get("unit")))
                last = max(last, r.get("finished_at", ""))
            if r.get("status") == "completed":
                done += 1
                if new:
                    _add(stats, r.get("stats"))
                else:
                    resumed += 1
            else:
                failed += 1
        for counts in self._running(run, ended):
            _add(stats, counts)
        self._last_end = _dt.datetime.fromisoformat(last).timestamp() if last else None
        self._eta = _eta(self._seconds(False), total - min(done, total), done - resumed)
        seconds = self._seconds(done >= total)
        post = run.traits.progress_text(stats, seconds) if stats else ""
        extra = (f" resumed={resumed}" if resumed else "") + (f" failed={failed}" if failed else "")
        return min(done, total), (post + extra).strip()

    def _seconds(self, ended: bool) -> float:
        """The step's time so far; once it ended, until its last unit finished (not until the
        poll that saw it), so that a step's time never exceeds the job's."""
        end = self._last_end if ended and self._last_end is not None else time.time()
        return max(0.0, end - self._step_start)

    def _running(self, run: StageRun, ended: set[str]) -> list[dict[str, Any]]:
        """The counts so far that this run's running units published (``progress/``, see
        :meth:`~refinery.transforms.resumable.base.UnitContext.report_progress`): one listing,
        and a read per running unit; a unit that has ended is counted from its receipt, and
        a file left by an earlier, killed run is ignored."""

        out: list[dict[str, Any]] = []
        for path in storage.listdir(run.ledger.progress_dir):
            name = storage.basename(path)
            if not name.endswith(".json") or storage.is_temp_name(name) or name[:-len(".json")] in ended:
                continue
            with contextlib.suppress(ValueError, OSError):
                p = storage.read_json(path)
                if isinstance(p, dict) and p.get("updated_at", "") >= self._started_iso and p.get("stats"):
                    out.append(p["stats"])
        return out

    def _update(self, show: Show, final: bool) -> None:
        """Poll the step in progress and ``show(step index, done, postfix, step ended)``;
        move on to the next step when its units have all completed."""
        while True:
            run, total = self.steps[self._current]
            done, post = self._poll(run, total)
            ended = done >= total
            show(self._current, done, post, ended or final)
            if not ended or self._current == len(self.steps) - 1:
                return
            self._current += 1
            self._step_start = max(self._step_start, self._last_end or time.time())

    def _loop(self) -> None:
        if not sys.stderr.isatty():
            return self._loop_plain()
        from tqdm import tqdm

        bars: dict[int, tqdm] = {}

        def show(i: int, done: int, post: str, ended: bool) -> None:
            if i not in bars:
                run, total = self.steps[i]
                # no rate: units found done at the start would make it meaningless (and it is in the postfix)
                bars[i] = tqdm(total=total, desc=run.name, unit="unit", file=sys.stderr, dynamic_ncols=True,
                               bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} units "
                                          "[{elapsed}]{postfix}")
            bars[i].n = done
            bars[i].set_postfix_str(post + (f" {self._eta}" if self._eta and not ended else ""), refresh=False)
            bars[i].refresh()
            if ended:
                bars[i].close()

        try:
            self._poll_until_stopped(show)
        finally:
            for bar in bars.values():
                bar.close()

    def _loop_plain(self) -> None:
        last = time.time()
        printed: set[int] = set()

        def show(i: int, done: int, post: str, ended: bool) -> None:
            nonlocal last
            if (ended and i not in printed) or time.time() - last >= self.LOG_EVERY_S:
                run, total = self.steps[i]
                print(f"{run.name}: {done}/{total} units, {self._seconds(ended):.1f}s"
                      + (f", {post}" if post else "") + (f", {self._eta}" if self._eta and not ended else ""),
                      file=sys.stderr, flush=True)
                last = time.time()
                if ended:
                    printed.add(i)

        self._poll_until_stopped(show)

    def _seed(self) -> None:
        """Count the receipts present when the job starts as done without reading them: one
        listing of each step's receipts and ``failures/`` (a unit whose last attempt failed is
        not done), not a read per receipt of a resumed run. Only the receipts that appear
        (or are rewritten as completed) during the job are read."""

        for run, _ in self.steps:
            failed = run.ledger.listed_failures()
            for path in storage.listdir(run.ledger.receipts_dir):
                name = storage.basename(path)
                if path.endswith(".json") and not storage.is_temp_name(name) and name[:-len(".json")] not in failed:
                    # a stand-in: only its status, stats and finished_at are read
                    stand_in = {"status": "completed", "stats": {}, "finished_at": ""}
                    self._seen.setdefault(path, cast("Receipt", stand_in))

    def _poll_until_stopped(self, show: Show) -> None:
        """:meth:`_update` every :attr:`interval` s until the job ends (one last poll then)
        or :meth:`halt` (none); a failed poll is skipped, never the job's failure."""
        with contextlib.suppress(Exception):
            self._seed()
        while True:
            stopping = self._stop.wait(self.interval)
            if self._halted:
                break
            with contextlib.suppress(Exception):
                self._update(show, stopping)
            if stopping:
                break

    def __exit__(self, *exc: object) -> None:
        Progress._active.discard(self)
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)


def _eta(seconds: float, left: int, finished: int) -> str:
    """``ETA 1m05s``: the units ``left`` at the pace of the ``finished`` ones of this run (none
    finished yet, or none left: '' - no guess)."""
    if finished <= 0 or left <= 0:
        return ""
    eta = round(seconds * left / finished)
    return f"ETA {eta // 3600}h{eta // 60 % 60:02d}m" if eta >= 3600 else \
        f"ETA {eta // 60}m{eta % 60:02d}s" if eta >= 60 else f"ETA {eta}s"


def human_bytes(n: float) -> str:
    """``n`` bytes as a person reads them: ``812 B``, ``4.1 KB``, ``3.2 MB``, ``1.5 GB`` (powers of 1000)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


MIN_RATE_S = 1.0  # no rate over less time than this: a few ms would give any figure at all


def rate(amount: float, seconds: float, unit: str, fmt: str = ",.1f") -> str:
    """``"{amount/seconds} {unit}/s"``, or '' when there is nothing to divide (no amount, or
    under :data:`MIN_RATE_S`): a progress line never shows a rate over 0 bytes or 0 s."""
    if amount <= 0 or seconds < MIN_RATE_S:
        return ""
    return f"{amount / seconds:{fmt}} {unit}/s"


def _add(total: dict[str, float], stats: dict[str, Any] | None) -> None:
    """Add the numeric values of ``stats`` (a receipt's or a running unit's) into ``total``."""
    for k, v in (stats or {}).items():
        if isinstance(v, (int, float)):
            total[k] = total.get(k, 0) + v


def halt_progress(timeout: float = 1.0) -> None:
    """Stop every progress display of this process at once (SIGINT/SIGTERM: the bar must not
    go on ticking while the run stops)."""
    for progress in list(Progress._active):
        progress.halt(timeout)
