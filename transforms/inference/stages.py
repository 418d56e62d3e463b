"""Resumable model inference over documents: ``infer`` (RunInference per wave of units) -> ``merge``.

Shared by ``refinery generate`` and the model-driven HYDRA steps (oracle labels, grading).
What differs between them is a :class:`~.tasks.Task`: how a document becomes an example, which
ModelHandler runs it, how a result becomes an output row, and what the merge writes.

- Documents (:class:`~.documents.DocumentSource`, :mod:`.documents`): rows of data files, or
  doc ids read from prep shards. A unit is a slice of at most ``docs_per_unit`` documents of
  one input file; prompts are :mod:`.prompts`, tasks :mod:`.tasks`.
- ``infer`` units run in waves, each a part of the command's one Beam job, after the one before:
  ``ReadUnits | Reshuffle | ExpandUnit -> ((unit, i), example) | RunInference(KeyedGptOssModelHandler)
  | CoGroupByKey(unit) | WriteUnit`` whose last step writes each unit's part file and receipt
  through :func:`refinery.transforms.resumable.execute_unit` (the one completion check).
  RunInference has a dead-letter output: a batch that raises fails the units of its
  documents (:class:`InferenceFailed` in their receipts, the error's type and message),
  the rest of the wave completes, and the command exits 1 naming the failed units; the
  next run redoes only those. The
  workers read a wave's units from the plan the driver wrote; there are at most
  :data:`MAX_WAVES` waves (a bigger plan gets bigger waves), so the job does not grow with
  the documents. Killing a run loses at most the wave in flight; the next run skips every
  unit with a receipt.
- Without Beam results (tests, a worker re-running a unit) ``run_unit`` computes the same
  rows with the engine directly.
- ``merge`` (local, one unit): parts in plan order -> the task's final files.

Part rows are JSON lines in document order; a document that could not be read is an output
row with an ``error`` and no generation (nothing is dropped silently).
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence, TypedDict, TypeVar

import apache_beam as beam
from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions
from apache_beam.pvalue import PBegin, PCollection, TaggedOutput
from apache_beam.typehints.decorators import no_annotations

from refinery.transforms.inference.documents import Doc, DocumentSource, InferPayload, JsonObject
from refinery.transforms.inference.tasks import Task
from refinery.transforms.io import storage
from refinery.transforms.io.beam_private import dead_letter_error
from refinery.transforms.io.jsonl import jsonl
from refinery.transforms.resumable import (
    AllPending,
    Stage,
    StageConfig,
    StageRun,
    StageWiring,
    Traits,
    Unit,
    UnitContext,
    execute_unit,
    now_iso,
)
from refinery.transforms.resumable import base as resumable_base  # PROGRESS_EVERY_S, read when used (tests set it)
from refinery.transforms.resumable.beam_steps import ReadUnits, UnitResult, count_receipt, summary
from refinery.transforms.resumable.unit_lists import PlanRef

if TYPE_CHECKING:  # importing model_handler imports Beam's ML package and torch: only a worker's RunInference needs it
    from apache_beam.ml.inference.base import PredictionResult


log = logging.getLogger("refinery")

FORMAT_VERSION = 1


class DocRow(TypedDict):
    """A document of a unit as the wave carries it: id, why it could not be read (or None),
    the task's metadata for its output row."""

    id: str
    error: str | None
    meta: JsonObject


class InferStats(TypedDict):
    """An infer unit's receipt stats."""

    documents: int
    errors: int
    generated_tokens: int
    prompt_tokens: int
    seconds: float


FailedBatch = tuple[tuple[int, ...], int, str]
"""A unit's share of a batch RunInference failed on: its documents' indexes, the batch's size, the error."""


# ---------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------

def part_file(unit_id: str) -> str:
    return f"{unit_id}.jsonl"


class InferenceFailed(RuntimeError):
    """RunInference raised on a batch that held documents of this unit (the message says what it raised)."""


def failed_batch_units(failed: tuple[Sequence[tuple[tuple[str, int], Any]], Any]) -> list[tuple[str, FailedBatch]]:
    """RunInference's dead letter ``(batch, error)``, the batch of ``((unit_id, i), example)``
    -> ``(unit_id, (indexes, batch size, error))`` for each unit with a document in the
    batch: the indexes of its documents there, the batch's size and ``Type: message`` of
    what it raised (:func:`~refinery.transforms.io.beam_private.dead_letter_error`)."""
    batch, error_info = failed
    docs: dict[str, list[int]] = defaultdict(list)
    for (unit_id, i), _example in batch:
        docs[unit_id].append(i)
    error = dead_letter_error(error_info)
    return [(unit_id, (tuple(sorted(idx)), len(batch), error)) for unit_id, idx in docs.items()]


def inference_failure(doc_ids: list[str], failed: list[FailedBatch]) -> str:
    """Why a unit failed, from its document ids and its :func:`failed_batch_units` entries:
    one clause per failed batch, naming the unit's documents in it and the error."""
    clauses = []
    for indexes, size, error in sorted(failed):
        names = [doc_ids[i] for i in indexes]
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        clauses.append(f"RunInference failed on a batch of {size} document(s) with {', '.join(names[:5])}{more}: "
                       f"{error}")
    return "; ".join(clauses)


class InferStage(Stage[InferPayload, InferStats]):
    """Units = document slices; each writes ``parts/<unit>.jsonl`` (one row per document)."""

    name = "infer"

    def __init__(self, task: Task, source: DocumentSource, wave_units: int = 8) -> None:
        self.task = task
        self.source = source
        self.wave_units = max(1, wave_units)

    def traits(self) -> Traits:
        return Traits(progress_text=self._progress_text, waves=AllPending(), wiring=InferWiring())

    def config(self) -> StageConfig:
        return StageConfig(self._settings(), self._inputs(), self._identity())

    def _settings(self) -> JsonObject:
        return {"format": FORMAT_VERSION, "task": self.task.config(), "source": self.source.config()}

    def _inputs(self) -> list[JsonObject]:
        return self.source.fingerprints()

    def _identity(self) -> JsonObject:
        return self.task.identity()

    def make_plan(self) -> list[Unit[InferPayload]]:
        return self.source.plan()

    def _progress_text(self, stats: Mapping[str, Any], seconds: float) -> str:
        return self.task.progress(stats, seconds)

    def prepare(self, payload: InferPayload) -> tuple[list[Doc], list[JsonObject | None], list[JsonObject]]:
        """(documents, example or None per document, metadata per document)."""
        docs = self.source.read(payload)
        examples: list[JsonObject | None] = []
        metas: list[JsonObject] = []
        for d in docs:
            ex: JsonObject | None
            if d.error is None:
                try:
                    ex, meta = self.task.example(d)
                except ValueError as e:
                    d.error = f"{d.where}: {e}"
            if d.error is not None:
                ex, meta = None, {}
            examples.append(ex)
            metas.append(meta)
        return docs, examples, metas

    def unit_inferences(self, unit: Unit[InferPayload], ctx: UnitContext
                        ) -> tuple[list[DocRow], Mapping[int, Mapping[str, Any]]]:
        """(the unit's documents, the inference of each readable one by its index): from the Beam
        wave (``ctx.side``: documents and RunInference's results, or why they failed), else from
        the engine directly (the same rows)."""
        if "docs" in ctx.side:  # from the Beam wave: documents and RunInference results
            if ctx.side.get("error"):
                raise RuntimeError(ctx.side["error"])
            if ctx.side.get("failed"):  # RunInference's dead letter: a batch with documents of this unit raised
                raise InferenceFailed(inference_failure([d["id"] for d in ctx.side["docs"]], ctx.side["failed"]))
            return ctx.side["docs"], ctx.side["results"]
        docs, examples, metas = self.prepare(unit.payload)
        doc_rows = [DocRow(id=d.id, error=d.error, meta=m) for d, m in zip(docs, metas)]
        todo = [(i, ex) for i, ex in enumerate(examples) if ex is not None]
        inferred = self.task.infer_local([ex for _, ex in todo]) if todo else []
        return doc_rows, dict(zip([i for i, _ in todo], inferred))

    def run_unit(self, unit: Unit[InferPayload], ctx: UnitContext) -> InferStats:
        t0 = time.perf_counter()
        doc_rows, results = self.unit_inferences(unit, ctx)
        rows: list[JsonObject] = []
        stats = InferStats(documents=0, errors=0, generated_tokens=0, prompt_tokens=0, seconds=0.0)
        for i, d in enumerate(doc_rows):
            stats["documents"] += 1
            if d["error"] is not None:
                rows.append({"id": d["id"], "error": d["error"]})
                stats["errors"] += 1
                continue
            if i not in results:
                raise RuntimeError(f"unit {unit.id}: no inference result for document {i} ({d['id']})")
            row = self.task.record(d["id"], d["meta"], results[i])
            stats["generated_tokens"] += int(results[i].get("generated_tokens", 0))
            stats["prompt_tokens"] += int(results[i].get("prompt_tokens", 0))
            rows.append(row)
        ctx.write_bytes(ctx.part_path(part_file(unit.id)), jsonl(rows))
        stats["seconds"] = time.perf_counter() - t0
        return stats


class MergeOutputsStage(Stage[JsonObject, Mapping[str, Any]]):
    """Local, one unit: the infer parts in plan order -> the task's final files."""

    name = "merge"

    def __init__(self, infer: InferStage) -> None:
        self.infer = infer

    def traits(self) -> Traits:
        return Traits(title="Merge outputs", light=True, final_outputs=True)

    def config(self) -> StageConfig:
        return StageConfig(self._settings())

    def _settings(self) -> JsonObject:
        return {"format": FORMAT_VERSION}

    def make_plan(self) -> list[Unit[JsonObject]]:
        return [Unit("merge", {})]

    def run_unit(self, unit: Unit[JsonObject], ctx: UnitContext) -> Mapping[str, Any]:
        infer_run = ctx.upstream("infer")
        plan = self.infer.plan()
        missing = [u.id for u in plan if not infer_run.check(u.id).done]
        if missing:
            raise RuntimeError(f"infer units not completed: {missing[:5]}")

        def rows() -> Iterator[JsonObject]:
            for u in plan:
                with storage.open_read(storage.join(infer_run.parts_dir, part_file(u.id))) as f:
                    for line in f:
                        yield json.loads(line)

        return self.infer.task.merge(rows(), ctx)


def build_stages(task: Task, source: DocumentSource, wave_units: int = 8) -> list[Stage[Any, Any]]:
    infer = InferStage(task, source, wave_units)
    return [infer, MergeOutputsStage(infer)]


# ---------------------------------------------------------------------------------------
# Beam wiring: the infer step, waves of units through RunInference, in the command's job
# ---------------------------------------------------------------------------------------

_F = TypeVar("_F", bound=Callable[..., Any])


def for_mypy_only(fn: _F) -> _F:
    """``fn``'s annotations are for mypy: Beam neither turns them into runtime type checks (as
    before they existed) nor chooses coders by them."""
    no_annotations(fn)
    return fn


def infer_stage(run: StageRun) -> InferStage:
    """The :class:`InferStage` that ``run`` runs (the Beam steps below are its step)."""
    if not isinstance(run.stage, InferStage):
        raise TypeError(f"stage {run.name}: the infer steps run an InferStage, not a {type(run.stage).__name__}")
    return run.stage


@for_mypy_only
def _to_unit(element: tuple[tuple[str, int], PredictionResult]) -> tuple[str, tuple[int, Any]]:
    (unit_id, i), prediction = element
    return unit_id, (i, prediction.inference)


def model_identifier(task: Task, options: PipelineOptions) -> str:
    """RunInference's shared-model tag for one job. Beam's shared-model server records the
    tag's address in a file under the temp folder. The DirectRunner's multi-process workers
    exit with their job, so a later job's workers found that file pointing at a dead server
    and retried for ~2.5 s per tag before starting their own: a new tag per job there (they
    load the model afresh anyway). In-process runners keep one tag per driver, so the loaded
    model is reused by every job of the driver. Every wave of one job shares the tag."""
    ident = task.model_identifier()
    if options.view_as(DirectOptions).direct_running_mode == "multi_processing":
        ident += "-" + uuid.uuid4().hex[:8]
    return ident


MAX_WAVES = 16  # waves per job at most (about 44 KB of job graph each): the job does not grow with the corpus


def wave_spans(n: int, size: int, max_waves: int = MAX_WAVES) -> list[tuple[int, int]]:
    """[lo, hi) of each wave over ``n`` units, in order: ``size`` units each (all of them when
    ``size`` is 0), but never more than ``max_waves`` waves: a bigger plan gets bigger waves,
    so that the job's graph stays the same size whatever the corpus."""
    size = max(size or n or 1, -(-n // max_waves))
    return [(k, min(n, k + size)) for k in range(0, n, size)]


class ExpandUnitFn(beam.DoFn):
    """(unit_id, payload) -> main: ((unit_id, i), example) per readable document;
    tagged ``info``: (unit_id, {docs: [{id, error, meta}], error, payload}).
    ``after`` (a side input: the results of the wave before) only makes it wait."""

    def __init__(self, run: StageRun) -> None:
        self.run = run

    @for_mypy_only
    def process(self, element: tuple[str, InferPayload], after: Sequence[Any] = ()
                ) -> Iterator[tuple[tuple[str, int], JsonObject] | TaggedOutput[str, tuple[str, JsonObject]]]:
        unit_id, payload = element
        try:
            docs, examples, metas = infer_stage(self.run).prepare(payload)
        except Exception as e:  # noqa: BLE001 - becomes the unit's failed receipt
            yield beam.pvalue.TaggedOutput("info", (unit_id, {"docs": [], "error": f"{type(e).__name__}: {e}"}))
            return
        rows = [{"id": d.id, "error": d.error, "meta": m} for d, m in zip(docs, metas)]
        yield beam.pvalue.TaggedOutput("info", (unit_id, {"docs": rows, "error": None, "payload": payload}))
        # shortest prompts first: BatchElements then groups documents of similar length
        readable = {i: ex for i, ex in enumerate(examples) if ex is not None}
        for i in sorted(readable, key=lambda i: len(readable[i]["tokens"])):
            yield (unit_id, i), readable[i]


@for_mypy_only
def _failed_units(failed: tuple[Sequence[tuple[tuple[str, int], Any]], Any]) -> list[tuple[str, FailedBatch]]:
    """:func:`failed_batch_units`, logged (where the worker's log is read)."""
    units = failed_batch_units(failed)
    for unit_id, (indexes, size, error) in units:
        log.error("unit %s: RunInference failed on a batch of %d document(s), %d of them this unit's: %s",
                  unit_id, size, len(indexes), error)
    return units


class WriteUnitFn(beam.DoFn):
    """(unit_id, {info: [...], results: [(i, inference)], failed: [(indexes, batch size, error)]})
    -> ``{unit, status, stats}``:
    :func:`execute_unit` with the documents, RunInference's results and its failures
    (a failed receipt) as ``ctx.side``."""

    def __init__(self, run: StageRun, verify_checksums: bool) -> None:
        self.run = run
        self.verify_checksums = verify_checksums

    @for_mypy_only
    def process(self, element: tuple[str, Mapping[str, Iterable[Any]]]) -> Iterator[UnitResult]:
        unit_id, grouped = element
        info = list(grouped["info"])[0]
        results = {i: inf for i, inf in grouped["results"]}
        side = {"docs": info["docs"], "error": info["error"], "results": results, "failed": list(grouped["failed"])}
        receipt = execute_unit(self.run, Unit(unit_id, info.get("payload") or {}), self.verify_checksums, side)
        with contextlib.suppress(OSError):  # RunInference's counts of the unit (UnitProgress): in its receipt now
            storage.remove(self.run.progress_path(unit_id), root=self.run.output)
        count_receipt(self.run.name, receipt)
        yield summary(receipt)


class UnitProgress:
    """Counts of the infer units that RunInference is working on, in this worker process,
    published as each unit's progress (:meth:`StageRun.progress_path`, read by the driver's
    progress display) at most every :data:`~refinery.transforms.resumable.base.PROGRESS_EVERY_S`:
    ``documents`` and ``generated_tokens`` so far, so that a long unit shows documents and
    tokens per second before it ends. A unit whose documents are batched in several worker
    processes shows the counts of the last one to write (a display, never a figure)."""

    def __init__(self, run: StageRun) -> None:
        self.run = run
        self._counts: dict[str, dict[str, float]] = {}
        self._next: dict[str, float] = {}

    def __getstate__(self) -> dict[str, StageRun]:
        return {"run": self.run}  # a worker's counts start at zero

    def __setstate__(self, state: dict[str, StageRun]) -> None:
        self.run = state["run"]  # the same fields as a new one: counts start at zero
        self._counts = {}
        self._next = {}

    def __call__(self, results: Sequence[tuple[tuple[str, int], PredictionResult]]) -> None:
        now = time.monotonic()
        touched: set[str] = set()
        for (unit_id, _), prediction in results:
            counts = self._counts.setdefault(unit_id, {"documents": 0, "generated_tokens": 0})
            counts["documents"] += 1
            inference = prediction.inference
            counts["generated_tokens"] += int(inference.get("generated_tokens", 0)) if isinstance(inference, Mapping) \
                else 0
            touched.add(unit_id)
        for unit_id in touched:
            if now >= self._next.get(unit_id, 0.0):
                self._next[unit_id] = now + resumable_base.PROGRESS_EVERY_S
                with contextlib.suppress(OSError):
                    storage.atomic_write_json(self.run.progress_path(unit_id),
                                              {"unit": unit_id, "stats": dict(self._counts[unit_id]),
                                               "updated_at": now_iso()})


class InferWave(beam.PTransform[PBegin, PCollection[UnitResult]]):
    """PBegin -> PCollection[dict]: ``{unit, status, stats}`` of one wave of infer units: those
    of ``units`` at indexes ``span`` [lo, hi), read from ``ref`` by the workers when the driver
    wrote them there (``pipeline.ReadUnits``: the job holds part numbers, not documents).

    ``ReadUnits | Expand | RunInference | CoGroupByKey(unit) | Write``: the units'
    parts and receipts are written when the whole wave's inference is done, so a wave
    is what a kill can lose. RunInference's dead letter (a batch that raised) joins the
    group by unit: each unit with a document in such a batch gets a failed receipt, in
    the wave (no step outside it). ``after``: the results of the wave before, which this
    wave waits for (a side input), so that waves run one after another."""

    def __init__(self, run: StageRun, units: list[Unit[InferPayload]], verify_checksums: bool,
                 after: PCollection[UnitResult] | None, tag: str,
                 ref: PlanRef | None = None, span: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.run, self.units, self.verify_checksums, self.after, self.tag = run, units, verify_checksums, after, tag
        self.ref, self.span = ref, span

    @for_mypy_only
    def expand(self, pbegin: PBegin) -> PCollection[UnitResult]:
        from apache_beam.ml.inference.base import RunInference  # lazy: imports torch

        from refinery.transforms.inference.model_handler import KeyedGptOssModelHandler  # lazy: imports torch

        wait = {} if self.after is None else {"after": beam.pvalue.AsList(self.after)}
        expanded = (pbegin
                    | "Units" >> ReadUnits(self.units, self.ref, self.span)
                    | "Spread" >> beam.Reshuffle()
                    | "Expand" >> beam.ParDo(ExpandUnitFn(self.run), **wait).with_outputs("info", main="examples"))
        inferred, dead = (expanded.examples
                          | "Infer" >> RunInference(KeyedGptOssModelHandler(infer_stage(self.run).task.handler(),
                                                                            on_batch=UnitProgress(self.run)),
                                                    model_identifier=self.tag).with_exception_handling())
        if dead.failed_preprocessing or dead.failed_postprocessing:  # the handlers have neither
            raise ValueError("the inference handler has pre- or postprocessing functions: their failures "
                             "would not reach the units' receipts")
        results = inferred | "ByUnit" >> beam.Map(_to_unit)
        failed = dead.failed_inferences | "FailedByUnit" >> beam.FlatMap(_failed_units)
        written: PCollection[UnitResult] = ({"info": expanded.info, "results": results, "failed": failed}
                                            | "Group" >> beam.CoGroupByKey()
                                            | "Write" >> beam.ParDo(WriteUnitFn(self.run, self.verify_checksums)))
        return written


class InferAllWaves(beam.PTransform[PBegin, PCollection[UnitResult]]):
    """PBegin -> PCollection[dict]: ``{unit, status, stats}`` of every infer unit given, in
    waves of the stage's ``wave_units`` (at most :data:`MAX_WAVES` of them, :func:`wave_spans`;
    :class:`InferWave`), each after the one before. ``ref``: where the driver wrote ``units``."""

    def __init__(self, run: StageRun, units: list[Unit[InferPayload]], verify_checksums: bool = False,
                 ref: PlanRef | None = None) -> None:
        super().__init__()
        self.run, self.units, self.verify_checksums, self.ref = run, units, verify_checksums, ref

    @for_mypy_only
    def expand(self, pbegin: PBegin) -> PCollection[UnitResult]:
        stage = infer_stage(self.run)
        tag = model_identifier(stage.task, pbegin.pipeline.options)
        after: PCollection[UnitResult] | None = None
        outs: list[PCollection[UnitResult]] = []
        for k, span in enumerate(wave_spans(len(self.units), stage.wave_units), 1):
            after = pbegin | f"Wave {k}" >> InferWave(self.run, self.units, self.verify_checksums, after, tag,
                                                      self.ref, span)
            outs.append(after)
        every: PCollection[UnitResult] = outs | "AllWaves" >> beam.Flatten()
        return every


class InferWiring(StageWiring):
    """The infer stage's Beam wiring: its own step, RunInference in waves (:class:`InferAllWaves`)."""

    def step_transform(self, run: StageRun, units: list[Unit[Any]], verify_checksums: bool,
                       after: PCollection[Any] | None, ref: PlanRef | None = None) -> InferAllWaves:
        if after is not None:
            raise ValueError("the infer stage runs first in its pipeline: it waits for no upstream")
        return InferAllWaves(run, units, verify_checksums, ref)
