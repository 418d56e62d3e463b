"""The Stage API: :class:`Stage`, :class:`Unit`, a stage bound to an output (:class:`StageRun`)
and what a unit writes through (:class:`UnitContext`).

Resumable stages: plan -> units -> idempotent unit outputs -> receipts -> barrier.

Every pipeline (prep, decon, generate, hydra) is a list of :class:`Stage` objects run
by :func:`~refinery.transforms.resumable.orchestration.run_stages`. A stage has a JSON config, a plan (a list of
:class:`Unit`), and ``run_unit(unit, ctx) -> stats`` which writes its files through a
:class:`UnitContext` so that they are recorded in the unit's receipt.

Layout under OUTPUT::

    .refinery/run.json                                 config, stage hashes, unit counts
    .refinery/<stage>/<stage_hash>/receipts/<unit>.json one per unit, written last, atomically
    .refinery/<stage>/<stage_hash>/parts/...            intermediate unit files
    .refinery/<stage>/<stage_hash>/progress/<unit>.json a running unit's counts so far (removed
                                                        when its receipt is written; progress only)
    .refinery/fingerprints/<stage>-<stage_hash>.json    input fingerprints of that plan (to say
                                                        which input changed when a plan changes)

Stage hash = sha256 of (stage name, config, input fingerprints, identity such as the
tokenizer, upstream stage hash). Hashes chain: changing stage k re-runs k and what follows
and keeps what precedes. Outputs of different plans never mix: parts live under the hash.

"Done" is decided by ONE function, :func:`~refinery.transforms.resumable.ledger.check_receipt`
(in :mod:`.ledger`, with the receipt schema below), used both by the planner (which
units are pending) and by the worker right before it runs a unit: the receipt says
completed, its stage hash matches, every listed file exists with the recorded size
(and sha256 with ``verify_checksums``), and no unit of an earlier stage was repaired
since it was built. A receipt whose files are missing means pending.

Repairs: a unit redone because its files were *damaged* (wrong size or sha256, or an
unreadable receipt) gets a new ``repair`` token in its receipt, because what was built
from it may have read the damage; each receipt records the repair tokens of the earlier
stages' done units it was built after (``upstream_repairs``), and a unit whose record
differs from the current one is pending. So a repair invalidates everything after it,
while a unit redone only because a file went missing (rebuilt identically) keeps its token
and invalidates nothing.

Stages run backward-demand-driven: if every unit of the last stages is done, earlier
stages are not run at all, even if their intermediate parts were deleted.

Each run first removes temp files left under OUTPUT by dead writers (``storage.remove_dead_temp_files``)
and, when a stage's hash differs from the previous run's, logs why (:mod:`.hash_changes`).
While a job runs, :mod:`.progress` draws its steps from their receipts.
``$REFINERY_UNIT_LOG`` (optional) receives one JSON line per unit start/skip/end: an audit
trail the fault-injection tests use (see RELIABILITY.md).

The receipt's schema is :class:`~.ledger.Receipt`.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import time
from dataclasses import dataclass, field, replace
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    ClassVar,
    Generic,
    Iterator,
    Mapping,
    Protocol,
    Sequence,
    TypeVar,
    cast,
    final,
)

from refinery.transforms.io import storage
from refinery.transforms.io.hashing import short_hash
from refinery.transforms.resumable.ledger import (
    Completion,
    FileEntry,
    Ledger,
    Receipt,
)
from refinery.transforms.resumable.unit_lists import PlanRef, read_units
from refinery.transforms.resumable.units import Payload, Unit

if TYPE_CHECKING:
    import apache_beam as beam


def now_iso() -> str:
    """Now, in UTC, as receipts and progress files spell it (ISO 8601, milliseconds)."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


Stats = TypeVar("Stats", bound=Mapping[str, Any], covariant=True)
"""What a stage's ``run_unit`` returns: its own TypedDict of counts (prep's ``TokenizeStats``),
stored as the receipt's ``stats``."""


@dataclass(frozen=True)
class StageConfig:
    """What enters a stage's hash (:func:`compute_stage_hash`): ``settings``, the JSON-able
    settings that change the unit outputs; ``inputs``, the input fingerprints (path, size,
    mtime or generation: recorded under OUTPUT to name what changed, and read back by the
    workers, whose job does not carry input lists); ``identity``, other identities (the
    tokenizer's)."""

    settings: Mapping[str, Any] = field(default_factory=dict)
    inputs: Sequence[Any] = ()
    identity: Mapping[str, Any] = field(default_factory=dict)


class Waves(Protocol):
    """A wave policy (:attr:`Traits.waves`): which units of a stage the next job runs, given the
    receipts of its units done so far (``done``, by unit id); returns (units, final), final
    False when more waves follow once these are done. A stage with one is judged in the
    driver (its receipts read), and so are the stages before it; a job ends at a wave that is
    not final (:mod:`.planner`)."""

    def needed(self, units: list[Unit[Any]], done: dict[str, Receipt]) -> tuple[list[Unit[Any]], bool]: ...


class AllPending:
    """The wave policy of a stage whose job must hold exactly the units to run (inference: a
    unit's documents are generated before its receipt is checked): every unit, one wave."""

    def needed(self, units: list[Unit[Any]], done: dict[str, Receipt]) -> tuple[list[Unit[Any]], bool]:
        return units, True


class BeamWiring(Protocol):
    """How a stage's step is wired into the command's Beam job (:attr:`Traits.wiring`; the
    default, ``beam_steps.RunStage`` with no side inputs, needs none; :class:`StageWiring` is
    the base to subclass).

    - ``side_inputs(run, start)``: Beam side inputs of the stage bound as ``run`` (its upstream
      stages are ``run.upstream[name]``), built from ``start``, a PCollection of one element
      that exists once every unit upstream completed; their values arrive as ``ctx.side``.
    - ``step_transform(run, units, verify_checksums, after, ref)``: the stage's own PTransform
      (PBegin -> PCollection of ``{unit, status, stats}``) when its units are not one ParDo
      each (inference: RunInference); ``ref``: where the driver wrote ``units``; None:
      ``beam_steps.RunStage``."""

    def side_inputs(self, run: StageRun, start: beam.PCollection[Any]) -> dict[str, Any]: ...

    def step_transform(self, run: StageRun, units: list[Unit[Any]], verify_checksums: bool,
                       after: beam.PCollection[Any] | None,
                       ref: PlanRef | None = None) -> beam.PTransform[Any, Any] | None: ...


class StageWiring:
    """A stage's Beam wiring (:attr:`Traits.wiring`, :class:`BeamWiring`): none here; a stage's
    own subclass gives side inputs, or its own step transform, or both."""

    def side_inputs(self, run: StageRun, start: beam.PCollection[Any]) -> dict[str, Any]:
        return {}

    def step_transform(self, run: StageRun, units: list[Unit[Any]], verify_checksums: bool,
                       after: beam.PCollection[Any] | None,
                       ref: PlanRef | None = None) -> beam.PTransform[Any, Any] | None:
        return None


def no_progress_text(stats: Mapping[str, Any], seconds: float) -> str:
    return ""


@dataclass(frozen=True)
class Traits:
    """How the framework treats a stage's units (none of it is the work itself):

    - ``title``: the step's name in the command's Beam pipeline (``Tokenize units``; default:
      the stage's name, capitalized).
    - ``light``: mostly I/O, or one unit: on the local multi-process runner a job of only
      light steps runs in the driver's process instead of starting a pool of worker
      processes (seconds of start-up for a second of work).
    - ``final_outputs``: the stage writes user-facing files under fixed names that another
      plan's run would overwrite; receipts of other plans of it are discarded. Its pending
      units are always run (with what precedes them); a stage of intermediate files runs
      only for a later stage that runs (:func:`~.planner.demanded`).
    - ``chained = False``: the stage's hash does not enter the hashes of the stages after it
      (its outputs are a pure function of inputs that the next stage's hash covers already).
    - ``driver_only``: attributes a worker never needs (input lists, plans): left out when the
      stage is pickled into a job once its plan is written, so that the job's size does not
      grow with the corpus.
    - ``waves``: a wave policy (:class:`Waves`; None: every unit in one job, judged by listings).
    - ``wiring``: its Beam wiring (:class:`BeamWiring`; None: ``beam_steps.RunStage``).
    - ``progress_text(stats, seconds)``: a short progress postfix from the summed stats of the
      finished units (``42.1k tok/s``)."""

    title: str = ""
    light: bool = False
    final_outputs: bool = False
    chained: bool = True
    driver_only: tuple[str, ...] = ()
    waves: Waves | None = None
    wiring: BeamWiring | None = None
    progress_text: Callable[[Mapping[str, Any], float], str] = no_progress_text


class Stage(Generic[Payload, Stats]):
    """A resumable stage: a name and four hooks, nothing else.

    - ``name``: the stage's name (its folder under ``OUTPUT/.refinery``);
    - ``traits()``: how the framework treats its units (:class:`Traits`: title, light, final
      outputs, chaining, driver-only attributes, wave policy, Beam wiring, progress text);
    - ``config()``: what enters its hash (:class:`StageConfig`);
    - ``make_plan()``: the deterministic list of its units (callers use :meth:`plan`, which
      makes it once in the driver, and in a worker reads what the driver wrote under OUTPUT:
      ``plan_ref``, set by :func:`~.planner.bind_stages`, :mod:`.unit_lists`);
    - ``run_unit(unit, ctx)``: do the work, write files only through ``ctx`` (so that they are
      listed in the unit's receipt), return the unit's stats.
    """

    name: ClassVar[str] = ""
    plan_ref: PlanRef | None = None  # where the driver writes this stage's plan (bind_stages)
    _units: list[Unit[Payload]] | None = None
    _unpickled = False  # True in a worker's copy: its plan is read from plan_ref

    def traits(self) -> Traits:
        return Traits()

    def config(self) -> StageConfig:
        return StageConfig()

    def make_plan(self) -> list[Unit[Payload]]:
        raise NotImplementedError

    def run_unit(self, unit: Unit[Payload], ctx: UnitContext) -> Stats:
        raise NotImplementedError

    @final
    def plan(self) -> list[Unit[Payload]]:
        """The stage's units: made once (``make_plan``), or in a worker read from ``plan_ref``."""
        if self._units is None:
            if self.plan_ref is not None and self._unpickled:
                self._units = cast("list[Unit[Payload]]", read_units(self.plan_ref))
            else:
                self._units = self.make_plan()
        return self._units

    @final
    def __getstate__(self) -> dict[str, Any]:
        """What a job carries of the stage: without its units and ``driver_only`` attributes once
        its plan has a place in the output (a worker reads the plan from there)."""
        state = dict(self.__dict__)
        if self.plan_ref is not None:
            state.pop("_units", None)
            if not self._unpickled:  # a copy has none of them left (and its traits may need its plan)
                for name in traits_of(self).driver_only:
                    state.pop(name, None)
        state["_unpickled"] = True
        return state


def traits_of(stage: Stage[Any, Any]) -> Traits:
    """``stage.traits()`` with its title filled in (the name, capitalized, when it gives none)."""
    traits = stage.traits()
    return traits if traits.title else replace(traits, title=stage.name.capitalize())


def compute_stage_hash(stage: Stage[Any, Any], upstream_hash: str | None) -> str:
    config = stage.config()
    return short_hash({
        "stage": stage.name,
        "config": config.settings,
        "inputs": list(config.inputs),
        "identity": config.identity,
        "upstream": upstream_hash,
    })


@dataclass
class StageRun:
    """A stage bound to an output directory and its (chained) hash: what the planner made of
    it for one run. Picklable (a job carries it). Its records are its :attr:`ledger`'s.

    ``upstream_repairs``: the repair tokens of the earlier stages' done units, set by the
    planner; its units' receipts record it and :meth:`check` compares (None: not judged)."""

    stage: Stage[Any, Any]
    output: str
    stage_hash: str
    upstream: dict[str, "StageRun"] = field(default_factory=dict)
    upstream_repairs: dict[str, str] | None = None
    listing_job: str | None = None  # a job planned from listings: the workers judge repairs (see execute_unit)
    inputs_hash: str | None = None  # short hash of the stage's input fingerprints, set by record_inputs

    @property
    def name(self) -> str:
        return self.stage.name

    @property
    def traits(self) -> Traits:
        return traits_of(self.stage)

    @property
    def ledger(self) -> Ledger:
        return Ledger(self.output, self.stage.name, self.stage_hash)

    @property
    def dir(self) -> str:
        return self.ledger.dir

    @property
    def parts_dir(self) -> str:
        return self.ledger.parts_dir

    def receipt_path(self, unit_id: str) -> str:
        return self.ledger.receipt_path(unit_id)

    def progress_path(self, unit_id: str) -> str:
        return self.ledger.progress_path(unit_id)

    def input_fingerprints(self) -> list[Any]:
        """The stage's input fingerprints (``Stage.fingerprints``): its own in the driver, else,
        in a worker (whose job does not carry input lists), those the driver recorded under
        OUTPUT for this plan (:func:`record_inputs`), read once per process and checked by
        content (``inputs_hash``): a damaged file is named, never used."""
        try:
            return list(self.stage.config().inputs)
        except AttributeError:  # a driver_only input list, left out of the job
            return self.ledger.recorded_fingerprints(self.inputs_hash)

    def listed_upstream_repairs(self) -> dict[str, str]:
        """The repair tokens of every earlier stage's units, from their ``repairs`` listings:
        what this stage's receipts are judged against once those stages have finished."""
        out: dict[str, str] = {}
        for up in self.upstream.values():
            out.update(up.ledger.recorded_repairs())
        return dict(sorted(out.items()))

    def check(self, unit_id: str, verify_checksums: bool = False) -> Completion:
        """:func:`check_receipt` of one unit, judged against ``upstream_repairs``, or in a job
        planned from listings against the earlier stages' repairs listed once they finished."""
        if self.listing_job is not None:
            self.upstream_repairs = _listed_repairs(self.listing_job, self)
        return self.ledger.check(unit_id, verify_checksums, self.upstream_repairs)

    def check_all(self, unit_ids: list[str], verify_checksums: bool = False) -> dict[str, Completion]:
        """:meth:`check` of many units (CHECK_THREADS at a time on an object store)."""
        return self.ledger.check_all(unit_ids, lambda u: self.check(u, verify_checksums))

    def pending(self, units: list[Unit[Any]], verify_checksums: bool = False) -> list[Unit[Any]]:
        checks = self.check_all([u.id for u in units], verify_checksums)
        return [u for u in units if not checks[u.id].done]

    def completed_receipts(self, units: list[Unit[Any]] | None = None,
                           verify_checksums: bool = False) -> dict[str, Receipt]:
        """Receipts of the completed units (of ``units``, default: the whole plan)."""
        units = self.stage.plan() if units is None else units
        checks = self.check_all([u.id for u in units], verify_checksums)
        return {u.id: c.receipt for u in units if (c := checks[u.id]).done and c.receipt is not None}

    def read_receipts(self, cache: dict[str, Receipt] | None = None) -> Iterator[Receipt]:
        return self.ledger.read_receipts(cache)


# How often a running unit publishes its counts (:meth:`UnitContext.report_progress`), in
# seconds: on a local disk about every second; on an object store, where a write is a request
# the user pays for, every 10 s. A unit shorter than the first interval writes none.
PROGRESS_EVERY_S = 1.0
REMOTE_PROGRESS_EVERY_S = 10.0


class UnitContext:
    """What ``run_unit`` writes through. Every file written here is listed in the receipt."""

    def __init__(self, run: StageRun, unit: Unit[Any], side: Mapping[str, Any] | None = None):
        self.run = run
        self.unit = unit
        self.output = run.output
        self.parts_dir = run.parts_dir
        self.side = side or {}
        self.files: list[FileEntry] = []
        self._group: storage.AtomicGroup | None = None  # set inside writes_together()
        self._progress_every = REMOTE_PROGRESS_EVERY_S if storage.is_remote(run.output) else PROGRESS_EVERY_S
        self._next_progress = time.monotonic() + self._progress_every
        self.progress_written = False

    def report_progress(self, counts: dict[str, int | float]) -> None:
        """Publish the unit's counts so far (the keys of its final stats that the stage's
        ``describe_progress`` shows, e.g. documents and tokens), so that the progress display
        moves while a long unit runs. Cheap to call often: it writes at most every
        :data:`PROGRESS_EVERY_S` (:data:`REMOTE_PROGRESS_EVERY_S` on an object store) and
        never for a unit shorter than that. A failed write is ignored: progress is a display."""
        now = time.monotonic()
        if now < self._next_progress:
            return
        self._next_progress = now + self._progress_every
        with contextlib.suppress(OSError):
            storage.atomic_write_json(self.run.progress_path(self.unit.id),
                                      {"unit": self.unit.id, "stats": dict(counts), "updated_at": now_iso()})
            self.progress_written = True

    def part_path(self, name: str) -> str:
        return storage.join(self.parts_dir, name)

    def output_path(self, relpath: str) -> str:
        return storage.join(self.output, relpath)

    def _relpath(self, path: str) -> str:
        """``path`` relative to OUTPUT, normalized; ValueError if it is not inside OUTPUT
        (a ``..`` escape is judged after normalization, not before)."""
        root = self.output.rstrip("/") + "/"
        if not path.startswith(root):
            raise ValueError(f"{path} is outside the output directory {self.output}")
        try:
            return storage.safe_relpath(path[len(root):])
        except ValueError:
            raise ValueError(f"{path} is outside the output directory {self.output}") from None

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[storage.HashingWriter]:
        rel = self._relpath(path)
        with storage.atomic_open(path, self._group) as f:
            yield f
        self.files.append({"path": rel, "bytes": f.bytes_written, "sha256": f.sha256})

    @contextlib.contextmanager
    def writes_together(self) -> Iterator[None]:
        """The files :meth:`open_write` writes inside the block are made durable and moved into
        place together when it ends (:func:`~refinery.transforms.io.storage.atomic_group`: one
        journal commit for them all, not one each), all before the unit's receipt; a unit
        reads none of them back inside the block. On an object store, as without it."""
        if storage.is_remote(self.output) or self._group is not None:
            yield
            return
        with storage.atomic_group() as group:
            self._group = group
            try:
                yield
            finally:
                self._group = None

    def write_bytes(self, path: str, data: bytes) -> None:
        with self.open_write(path) as f:
            f.write(data)

    def upstream(self, stage_name: str) -> StageRun:
        return self.run.upstream[stage_name]


_LISTED_REPAIRS: dict[tuple[str, str], dict[str, str]] = {}


def _listed_repairs(job: str, run: StageRun) -> dict[str, str]:
    """:meth:`StageRun.listed_upstream_repairs` of ``run``, read once per job (``job``) per process."""
    key = (job, run.dir)
    if key not in _LISTED_REPAIRS:
        if len(_LISTED_REPAIRS) > 64:
            _LISTED_REPAIRS.clear()
        _LISTED_REPAIRS[key] = run.listed_upstream_repairs()
    return _LISTED_REPAIRS[key]
