"""One Beam pipeline per command: every stage's pending units, as named steps of one graph.

:func:`refinery.transforms.resumable.run_stages` plans (which units of which stage are
pending, by their receipts) and hands the steps to :func:`build_pipeline`, which makes one
Beam pipeline of them::

    Tokenize:  ReadUnits | Reshuffle | ParDo(RunUnitFn)  ----------> results
    Pack:      ReadUnits | Reshuffle | ParDo(RunUnitFn, upstream=AsList(results))
    ...

The units a step runs are not in the job: the driver writes them under OUTPUT
(:mod:`.unit_lists`) and the job reads them back in its workers (:class:`ReadUnits`: the part
numbers are all the job holds), so its size does not grow with the corpus.

Each step is a :class:`RunStage` (or a stage's own transform: its :class:`StageWiring`)
whose output is one small dict per unit, ``{unit, status, stats}``. A step waits for the
step before it through a side input of those results: Beam computes a side input before
the step that reads it runs, on every runner (the local one, Flink, Dataflow), so one job
runs the stages in order and no barrier needs a second job. A step whose upstream has a
unit that did not complete runs none of its units (``status: blocked``, no receipt): they
stay pending, and the command lists the failures and exits 1 as before.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Mapping, TypedDict, TypeVar

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.typehints.decorators import no_annotations

from refinery.transforms.io import beam_private
from refinery.transforms.io.timeline import mark
from refinery.transforms.resumable.base import Stage, StageRun
from refinery.transforms.resumable.execution import execute_unit, span_key, unit_counters, unit_times_ms
from refinery.transforms.resumable.ledger import Receipt
from refinery.transforms.resumable.planner import Step, bind_stages, record_inputs, write_plans
from refinery.transforms.resumable.unit_lists import PART_UNITS, PlanRef, read_part
from refinery.transforms.resumable.units import Unit

BLOCKED = "blocked"  # a unit not run because a unit upstream of it did not complete


_F = TypeVar("_F", bound=Callable[..., Any])


def _mypy_only(fn: _F) -> _F:
    """``fn``'s annotations are for mypy: Beam does not turn them into runtime type checks (as
    before they existed) or choose coders by them."""
    no_annotations(fn)
    return fn


class UnitResult(TypedDict):
    """What a step outputs per unit (small: a side input of the step after it): the unit's
    id, status (``completed``, ``failed``, :data:`BLOCKED`) and stats, as its receipt has them."""

    unit: str | None
    status: str | None
    stats: dict[str, Any] | None


def _part_units(k: int, ref: PlanRef, lo: int = 0, hi: int | None = None) -> list[tuple[str, Mapping[str, Any]]]:
    """(id, payload) of the units of part ``k`` of ``ref`` whose index in it is in [lo, hi)."""
    first = k * PART_UNITS
    return [(u.id, u.payload) for i, u in enumerate(read_part(ref, k), first)
            if lo <= i and (hi is None or i < hi)]


class ReadUnits(beam.PTransform[beam.pvalue.PBegin, beam.PCollection[tuple[str, Mapping[str, Any]]]]):
    """PBegin -> PCollection[tuple[str, dict]]: ``(unit id, payload)`` of the units of a step,
    read by the workers from the parts the driver wrote (``ref``): the job holds the part
    numbers only. ``span``: only the units at those indexes [lo, hi) (a wave). Without a
    ``ref``, the ``units`` themselves (a job that grows with them)."""

    def __init__(self, units: list[Unit[Any]], ref: PlanRef | None = None, span: tuple[int, int] | None = None):
        super().__init__()
        self.units, self.ref, self.span = units, ref, span

    @_mypy_only
    def expand(self, pbegin: beam.pvalue.PBegin) -> beam.PCollection[tuple[str, Mapping[str, Any]]]:
        lo, hi = self.span or (0, len(self.units))
        units: beam.PCollection[tuple[str, Mapping[str, Any]]]
        if self.ref is None:
            units = pbegin | "Units" >> beam.Create([(u.id, u.payload) for u in self.units[lo:hi]], reshuffle=False)
            return units
        parts = list(range(lo // PART_UNITS, -(-hi // PART_UNITS)))
        units = (pbegin | "Parts" >> beam.Create(parts, reshuffle=False)
                 | "ReadParts" >> beam.FlatMap(_part_units, self.ref, lo, hi))
        return units


def count_receipt(stage: str, receipt: Receipt) -> None:
    """Beam metrics of one unit's receipt, namespace ``refinery``: the counters of
    :func:`unit_counters`, and for a unit run now its start and end (ms since the epoch) in the
    distributions ``<stage>_started_ms`` and ``<stage>_finished_ms``, whose min and max give
    the stage's wall time. The runner reports them back (:func:`run_pipeline`; Flink's and
    Dataflow's UIs show them)."""
    for name, v in unit_counters(stage, receipt).items():
        Metrics.counter("refinery", name).inc(v)
    if times := unit_times_ms(receipt):
        Metrics.distribution("refinery", f"{stage}_started_ms").update(times[0])
        Metrics.distribution("refinery", f"{stage}_finished_ms").update(times[1])


# the element type Beam inferred for a step's results, declared: its inference walks the
# bytecode of RunUnitFn.process and all it calls, 0.1 s per step at every job's start
UNIT_RESULT_TYPE = beam.typehints.Dict[str, beam.typehints.Any]


def summary(receipt: Receipt) -> UnitResult:
    """What a step outputs per unit: ``{unit, status, stats}`` (small: a side input downstream)."""
    return {"unit": receipt.get("unit"), "status": receipt.get("status"), "stats": receipt.get("stats")}


def upstream_completed(results: Iterable[UnitResult]) -> bool:
    """Whether every unit of the upstream step completed (or was found done)."""
    return all(r.get("status") == "completed" for r in results)


def _start_after(_: None, upstream: list[UnitResult]) -> Iterator[None]:
    if upstream_completed(upstream):
        yield None


class RunUnitFn(beam.DoFn):
    """(unit_id, payload) -> ``{unit, status, stats}``: :func:`execute_unit`, which skips a
    unit whose receipt verifies and writes the receipt last. ``upstream`` (the results of the
    step before, a side input): when a unit there did not complete, nothing runs here."""

    def __init__(self, run: StageRun, verify_checksums: bool = False) -> None:
        self.run = run
        self.verify_checksums = verify_checksums

    @_mypy_only
    def process(self, element: tuple[str, Mapping[str, Any]], upstream: Iterable[UnitResult] = (),
                **side: Any) -> Iterator[UnitResult]:
        unit_id, payload = element
        if not upstream_completed(upstream):  # no receipt: the unit stays pending
            Metrics.counter("refinery", f"{self.run.name}_units_{BLOCKED}").inc(1)
            yield {"unit": unit_id, "status": BLOCKED, "stats": {}}
            return
        receipt = execute_unit(self.run, Unit(unit_id, payload), self.verify_checksums, side)
        count_receipt(self.run.name, receipt)
        yield summary(receipt)


class RunStage(beam.PTransform[beam.pvalue.PBegin, beam.PCollection[UnitResult]]):
    """PBegin -> PCollection[dict]: ``{unit, status, stats}`` for each of ``units`` of ``run``.

    ``ReadUnits | Reshuffle | ParDo(RunUnitFn)``. ``ref``: where the driver wrote ``units``
    (:class:`ReadUnits`). ``after``: the results of the step before (a PCollection of those
    dicts), or None for the first step; this step's units and its stage's side inputs
    (its :class:`StageWiring`'s) wait for all of them.
    """

    def __init__(self, run: StageRun, units: list[Unit[Any]], verify_checksums: bool = False,
                 after: beam.PCollection[UnitResult] | None = None, unit_fn: type[RunUnitFn] = RunUnitFn,
                 ref: PlanRef | None = None) -> None:
        super().__init__()
        self.run, self.units, self.verify_checksums = run, units, verify_checksums
        self.after, self.unit_fn, self.ref = after, unit_fn, ref

    @_mypy_only
    def expand(self, pbegin: beam.pvalue.PBegin) -> beam.PCollection[UnitResult]:
        start = pbegin | "Start" >> beam.Create([None])
        gate: dict[str, Any] = {}
        if self.after is not None:
            start = start | "AfterUpstream" >> beam.FlatMap(_start_after, beam.pvalue.AsList(self.after))
            gate = {"upstream": beam.pvalue.AsList(self.after)}
        wiring = self.run.traits.wiring
        side = wiring.side_inputs(self.run, start) if wiring else {}
        units = pbegin | "Units" >> ReadUnits(self.units, self.ref)
        if len(self.units) > 1:  # one unit has nothing to spread over workers
            units = units | "Spread" >> beam.Reshuffle()
        results: beam.PCollection[UnitResult] = \
            units | "Run" >> beam.ParDo(self.unit_fn(self.run, self.verify_checksums), **gate, **side) \
            .with_output_types(UNIT_RESULT_TYPE)
        return results


def apply_steps(pbegin: beam.pvalue.PBegin | beam.Pipeline, steps: list[Step], verify_checksums: bool = False,
                unit_fn: type[RunUnitFn] = RunUnitFn) -> beam.PCollection[UnitResult] | None:
    """Apply ``steps`` to ``pbegin`` in order, each after the one before, each named by its
    stage's ``title``; returns the last step's results (None when there is no step)."""
    after: beam.PCollection[UnitResult] | None = None
    for step in steps:
        traits = step.run.traits
        own = traits.wiring.step_transform(step.run, step.units, verify_checksums, after, step.ref) \
            if traits.wiring else None
        transform = own or RunStage(step.run, step.units, verify_checksums, after, unit_fn, step.ref)
        after = pbegin | traits.title >> transform
    return after


def build_pipeline(steps: list[Step], beam_args: list[str], verify_checksums: bool = False,
                   unit_fn: type[RunUnitFn] = RunUnitFn) -> beam.Pipeline:
    """The Beam pipeline of ``steps`` (in order, each after the one before), built, not run.

    Each step is a top-level transform named by its stage's ``title``, so that Flink's and
    Dataflow's UIs show the command's real shape. Tests translate it
    (``pipeline.to_runner_api()``) or hand it to Dataflow's ``--dry_run``
    (``refinery.runners.translate``); :func:`run_pipeline` runs it.
    """
    from apache_beam.options.pipeline_options import PipelineOptions

    pipeline = beam.Pipeline(options=PipelineOptions(beam_args))
    apply_steps(pipeline, steps, verify_checksums, unit_fn)
    return pipeline


class RunAllStages(beam.PTransform[beam.pvalue.PBegin, beam.PCollection[UnitResult]]):
    """PBegin -> PCollection[dict]: a command's whole flow as one composite, for a user's own
    pipeline: every unit of every stage of ``stages`` (bound to ``output``), each stage after
    the one before; ``{unit, status, stats}`` of the last stage's units.

    A unit whose receipt verifies is skipped, as in the command, so a user's pipeline and
    the command write the same bytes and each resumes the other. (The command also plans:
    it runs only the pending units, records ``run.json`` and judges repairs.)
    """

    def __init__(self, stages: list[Stage[Any, Any]], output: str, verify_checksums: bool = False) -> None:
        super().__init__()
        runs = bind_stages(stages, output.rstrip("/"))
        # the workers read each stage's plan, the units of its step and its input list from the output
        for run in runs:
            record_inputs(run, list(run.stage.config().inputs))
        self.steps = write_plans(runs, [Step(run, units) for run in runs if (units := run.stage.plan())])
        self.verify_checksums = verify_checksums

    # None when no stage has a unit: Beam accepts a composite that outputs nothing
    @_mypy_only
    def expand(self, pbegin: beam.pvalue.PBegin) -> beam.PCollection[UnitResult] | None:  # type: ignore[override]  # None: no step
        return apply_steps(pbegin, self.steps, self.verify_checksums)


def run_pipeline(pipeline: beam.Pipeline) -> dict[str, int]:
    """Run a pipeline from :func:`build_pipeline`, wait for it (raises if it fails) and
    return its ``refinery`` counters (:func:`count_receipt`) as the runner reports them.

    Subprocess servers the run starts (Flink's job server) are shared while it runs and
    stopped at the end, as ``with pipeline`` would; the counters are read before that,
    while the job service still answers.
    """
    with beam_private.shared_subprocess_servers():
        mark("submitted")
        result = pipeline.run()
        result.wait_until_finish()
        mark("job_done")
        return refinery_counters(result)


def refinery_counters(result: Any) -> dict[str, int]:
    """``{name: value}`` of a finished pipeline's counters in the ``refinery`` namespace,
    summed over steps (committed values where the runner has them, else attempted), and per
    stage with units run its wall time in ms under ``span_key(stage)`` (from the
    distributions of :func:`count_receipt`); {} when the runner reports no metrics."""
    import logging

    from apache_beam.metrics.metric import MetricsFilter

    try:
        metrics = result.metrics().query(MetricsFilter().with_namespace("refinery"))
    except Exception as e:  # noqa: BLE001 - metrics are a report; the run's outputs are in its receipts
        logging.getLogger("refinery").info("no metrics from the runner (%s: %s)", type(e).__name__, e)
        return {}
    out: dict[str, int] = {}
    for c in metrics["counters"]:
        v = c.committed if c.committed is not None else c.attempted
        out[c.key.metric.name] = out.get(c.key.metric.name, 0) + int(v or 0)
    starts: dict[str, int] = {}  # stage -> the first start of its units run now (ms)
    ends: dict[str, int] = {}  # and the last end
    for d in metrics.get("distributions", []):
        v = d.committed if d.committed is not None else d.attempted
        name = d.key.metric.name
        if v is None or not v.count:
            continue
        if name.endswith("_started_ms"):
            stage = name[:-len("_started_ms")]
            starts[stage] = min(starts.get(stage, v.min), v.min)
        elif name.endswith("_finished_ms"):
            stage = name[:-len("_finished_ms")]
            ends[stage] = max(ends.get(stage, v.max), v.max)
    for stage in starts.keys() & ends.keys():
        out[span_key(stage)] = max(0, ends[stage] - starts[stage])
    return dict(sorted(out.items()))


def light_job(steps: list[Step]) -> bool:
    """Whether every step is light (I/O, or one unit): a local runner gains nothing from
    worker processes for such a job (see ``runners.jobs.run_job``)."""
    return all(step.run.traits.light or (len(step.units) if step.to_run is None else step.to_run) <= 1
               for step in steps)


def run_on_beam(steps: list[Step], beam_args: list[str], verify_checksums: bool = False) -> dict[str, int]:
    """The default step runner of ``run_stages``: ``steps`` as one Beam job with ``beam_args``
    as given; its counters. The commands run jobs through ``runners.jobs.run_job``, which
    first fits the arguments of the local runner to the job."""
    return run_pipeline(build_pipeline(steps, beam_args, verify_checksums))
