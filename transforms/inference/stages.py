"""Resumable model inference over documents: ``infer`` (RunInference per wave of units) -> ``merge``.

Shared by ``refinery generate`` and the model-driven HYDRA steps (oracle labels, grading).
What differs between them is a :class:`Task`: how a document becomes an example, which
ModelHandler runs it, how a result becomes an output row, and what the merge writes.

- Documents (:class:`DocumentSource`): rows of JSONL/JSON/parquet files (``--text-field``,
  ``--id-field``; a missing id becomes ``{relpath}:{row}``), or doc ids
  (``{source}//{relpath}#s=..:e=..``) listed in files, read from prep shards under a data
  root. A unit is a slice of at most ``docs_per_unit`` documents of one input file.
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
import os
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence, TypedDict, TypeVar

import apache_beam as beam
from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions
from apache_beam.pvalue import PBegin, PCollection, TaggedOutput
from apache_beam.typehints.decorators import no_annotations

from refinery.transforms.formats.docids import read_doc_tokens, read_docid_file
from refinery.transforms.formats.harmony import render_prompt
from refinery.transforms.formats.tiktoken_vocab import get_encoding
from refinery.transforms.inference.handler import (
    BatchingOptions,
    EngineSettings,
    Generation,
    GenerationParams,
    cached_engine,
    decode,
    doc_seed,
    run_generation,
)
from refinery.transforms.io import rows, storage
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
    short_hash,
)
from refinery.transforms.resumable import base as resumable_base  # PROGRESS_EVERY_S, read when used (tests set it)
from refinery.transforms.resumable.beam_steps import ReadUnits, UnitResult, count_receipt, summary
from refinery.transforms.resumable.progress import rate
from refinery.transforms.resumable.unit_lists import PlanRef

if TYPE_CHECKING:  # importing model_handler imports Beam's ML package and torch: only a worker's RunInference needs it
    from apache_beam.ml.inference.base import PredictionResult

    from refinery.transforms.inference.model_handler import EngineModelHandler, GptOssModelHandler

log = logging.getLogger("refinery")

FORMAT_VERSION = 1

JsonObject = dict[str, Any]
"""A JSON object: an example for the handler, a document's metadata, an output row."""


class InferPayload(TypedDict):
    """An infer unit: documents ``[lo, hi)`` of input file number ``file``."""

    file: int
    path: str
    relpath: str
    lo: int
    hi: int


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
# Documents
# ---------------------------------------------------------------------------------------

@dataclass
class Doc:
    """One input document: ``id``, and ``text`` or ``tokens`` (doc-id inputs), or an ``error``."""

    id: str
    text: str | None = None
    tokens: list[int] | None = None
    error: str | None = None
    where: str = ""  # file:row, for messages

    def get_tokens(self) -> list[int]:
        if self.tokens is None:
            self.tokens = get_encoding().encode_ordinary(self.text or "")
        return self.tokens

    def get_text(self) -> str:
        if self.text is None:
            self.text = decode(self.tokens or [])
        return self.text


@dataclass
class DocumentSource:
    """Where documents come from: data files (``paths``) or doc-id files + ``data_root``."""

    paths: list[str] = field(default_factory=list)
    docid_files: list[str] = field(default_factory=list)
    data_root: str | None = None
    text_field: str = "text"
    id_field: str = "id"
    docs_per_unit: int = 256

    def __post_init__(self) -> None:
        if bool(self.paths) == bool(self.docid_files):
            raise ValueError("give either input data files or doc-id files (with a data root), not both")
        if self.docid_files and not self.data_root:
            raise ValueError("doc-id inputs need --data-root (the folder their relpaths start from)")
        if self.docs_per_unit < 1:
            raise ValueError("docs per unit must be at least 1")
        # doc-id files may have any name (docids_val.jsonl, val_shard_00, ...)
        self.skipped: list[str] = []  # files of the input folders skipped for their extension
        self.files = (storage.expand_inputs(self.paths, skipped=self.skipped) if self.paths
                      else storage.expand_inputs(self.docid_files, suffixes=("",)))
        self._plan: list[Unit[InferPayload]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        """What a job carries: configuration, not the input list or the plan (a worker reads its
        units from the plan the driver wrote, ``Stage.plan_ref``, and the inputs' fingerprints
        from the output, ``StageRun.input_fingerprints``), so that the job does not grow with them."""
        state = dict(self.__dict__)
        state.pop("files", None)
        state["skipped"], state["_plan"] = [], None
        return state

    def config(self) -> JsonObject:
        return {"kind": "docids" if self.docid_files else "rows", "text_field": self.text_field,
                "id_field": self.id_field, "docs_per_unit": self.docs_per_unit}

    def fingerprints(self) -> list[JsonObject]:
        fps = [f.fingerprint() for f in self.files]
        if self.data_root:
            fps += [f.fingerprint() for f in storage.expand_inputs([self.data_root], suffixes=(".npy",))]
        return fps

    def _count(self, path: str) -> int:
        if self.docid_files:
            return sum(1 for _ in read_docid_file(path))
        return sum(1 for _ in rows.iter_rows(path))

    def plan(self) -> list[Unit[InferPayload]]:
        """Units: ``fNNNNN-dNNNNNNNN`` = documents ``[lo, hi)`` of file NNNNN (document order)."""
        if self._plan is None:
            units: list[Unit[InferPayload]] = []
            for fi, f in enumerate(self.files):
                n = self._count(f.path)
                for lo in range(0, n, self.docs_per_unit):
                    units.append(Unit(f"f{fi:05d}-d{lo:08d}", InferPayload(
                        file=fi, path=f.path, relpath=f.relpath, lo=lo, hi=min(n, lo + self.docs_per_unit))))
            self._plan = units
        return self._plan

    def read(self, payload: InferPayload) -> list[Doc]:
        """The documents of one unit, in order."""
        lo, hi, path = payload["lo"], payload["hi"], payload["path"]
        docs: list[Doc] = []
        if self.docid_files:
            data_root = self.data_root
            assert data_root is not None  # __post_init__: doc-id inputs come with a data root
            for i, (line, doc_id) in enumerate(read_docid_file(path)):
                if lo <= i < hi:
                    where = f"{path}:{line}"
                    try:
                        docs.append(Doc(doc_id, tokens=read_doc_tokens(data_root, doc_id), where=where))
                    except (ValueError, FileNotFoundError) as e:
                        docs.append(Doc(doc_id, error=str(e), where=where))
            return docs
        for i, (row, record, error) in enumerate(rows.iter_rows(path)):
            if not lo <= i < hi:
                continue
            where = f"{path}:{row + 1}"
            if error is not None:
                docs.append(Doc(f"{payload['relpath']}:{row}", error=f"{where}: {error}", where=where))
                continue
            assert record is not None  # iter_rows: a record, or else an error
            rid = record.get(self.id_field)
            doc_id = str(rid) if rid is not None else f"{payload['relpath']}:{row}"
            text = record.get(self.text_field)
            if not isinstance(text, str):
                docs.append(Doc(doc_id, error=f"{where}: text field {self.text_field!r} missing or not a string",
                                where=where))
            else:
                docs.append(Doc(doc_id, text=text, where=where))
        return docs


# ---------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------

TEMPLATES: dict[str, dict[str, str | None]] = {
    "rephrase": {
        "developer": "Rephrase the document the user gives you as clear, well-structured prose. Keep every "
                     "fact, number and name; add nothing new. Answer with the rephrased document only.",
        "user": "{text}",
    },
}


def load_template(name_or_path: str) -> dict[str, str | None]:
    """A built-in template name, or a text file whose ``{text}`` marks where the document goes
    (the whole file is the user message)."""
    if name_or_path in TEMPLATES:
        return dict(TEMPLATES[name_or_path])
    try:
        text = storage.read_bytes(name_or_path).decode("utf-8")
    except FileNotFoundError:
        raise ValueError(f"template {name_or_path!r}: not a built-in ({', '.join(TEMPLATES)}) "
                         f"and no such file") from None
    if "{text}" not in text:
        raise ValueError(f"template file {name_or_path}: has no {{text}} placeholder")
    return {"developer": None, "user": text}


def fit_prompt(render: Callable[[str], list[int]], doc: Doc, budget: int) -> tuple[list[int], str, int]:
    """(prompt tokens, document text used, tokens cut): the document's tail is cut until the
    rendered prompt fits in ``budget`` tokens (the assistant-start suffix always stays)."""
    text = doc.get_text()
    prompt = render(text)
    if len(prompt) <= budget:
        return prompt, text, 0
    tokens = doc.get_tokens()
    keep = max(0, len(tokens) - (len(prompt) - budget))
    while True:
        text = decode(tokens[:keep])
        prompt = render(text)
        if len(prompt) <= budget or keep == 0:
            break
        keep = max(0, keep - max(1, len(prompt) - budget))
    if len(prompt) > budget:
        raise ValueError(f"doc {doc.id}: the template alone takes {len(prompt)} tokens, over the budget {budget}")
    return prompt, text, len(tokens) - keep


def render_template(template: Mapping[str, str | None], text: str) -> list[int]:
    return render_prompt(developer=template.get("developer"), user=template_user(template).replace("{text}", text))


def template_user(template: Mapping[str, str | None]) -> str:
    """The template's user message (``{text}`` where the document goes)."""
    user = template["user"]
    assert user is not None  # load_template: every template has one
    return user


# ---------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------

@dataclass
class HandlerOptions:
    """How RunInference holds the engine: shared across processes, copies, batch token budget."""

    share_across_processes: bool = True
    model_copies: int | None = None
    batch_tokens: int | None = None


class Task:
    """What an inference pipeline does with each document. Subclasses implement the hooks."""

    name = "task"

    def config(self) -> JsonObject:
        raise NotImplementedError

    def identity(self) -> JsonObject:
        return {}

    def example(self, doc: Doc) -> tuple[JsonObject, JsonObject]:
        """(example for the handler, metadata kept for the output row)."""
        raise NotImplementedError

    def handler(self) -> EngineModelHandler[Any]:
        """The RunInference handler: a :class:`~refinery.transforms.inference.model_handler.EngineModelHandler`."""
        raise NotImplementedError

    def model_identifier(self) -> str:
        return f"refinery-{self.name}-{short_hash(self.config(), 12)}-{os.getpid()}"

    def infer_local(self, examples: list[JsonObject]) -> Sequence[Mapping[str, Any]]:
        """The handler's inference dicts without Beam (same engine code)."""
        raise NotImplementedError

    def record(self, doc_id: str, meta: JsonObject, inference: Mapping[str, Any]) -> JsonObject:
        raise NotImplementedError

    def merge(self, rows: Iterator[JsonObject], ctx: UnitContext) -> Mapping[str, Any]:
        raise NotImplementedError

    def progress(self, stats: Mapping[str, Any], seconds: float) -> str:
        docs, toks = stats.get("documents", 0), stats.get("generated_tokens", 0)
        rates = ", ".join(filter(None, [rate(docs, seconds, "docs"), rate(toks, seconds, "tok")]))
        return f"{docs:,.0f} docs, {toks:,.0f} tokens" + (f", {rates}" if rates else "")


def checkpoint_fingerprint(checkpoint: str) -> list[JsonObject]:
    files = storage.expand_inputs([checkpoint], suffixes=(".safetensors", ".json"))
    return [{"path": f.relpath, "size": f.size, "version": f.version} for f in files]


class GenerateTask(Task):
    """Template-filled harmony prompts -> generated text (``generations.jsonl``)."""

    name = "generate"
    OUTPUT = "generations.jsonl"

    def __init__(self, engine: EngineSettings, params: GenerationParams, template: str = "rephrase",
                 handler_options: HandlerOptions | None = None) -> None:
        self.engine = engine
        self.params = params
        self.template_name = template
        self.template = load_template(template)
        self.options = handler_options or HandlerOptions()
        if params.max_tokens >= engine.max_seq_len:
            raise ValueError(f"--max-tokens {params.max_tokens} leaves no room for a prompt under "
                             f"--max-seq-len {engine.max_seq_len}")

    def config(self) -> JsonObject:
        return {"task": self.name, "template": self.template, "params": self.params.to_dict(),
                "dtype": self.engine.dtype, "max_seq_len": self.engine.max_seq_len}

    def identity(self) -> JsonObject:
        return {"checkpoint": checkpoint_fingerprint(self.engine.checkpoint)}

    def example(self, doc: Doc) -> tuple[JsonObject, JsonObject]:
        budget = self.engine.max_seq_len - self.params.max_tokens
        prompt, text, cut = fit_prompt(lambda t: render_template(self.template, t), doc, budget)
        example = {"tokens": prompt, "seed": doc_seed(self.params.seed, doc.id)}
        return example, {"prompt": template_user(self.template).replace("{text}", text), "truncated_tokens": cut}

    def handler(self) -> GptOssModelHandler:
        from refinery.transforms.inference.model_handler import GptOssModelHandler  # lazy: Beam's ML package, torch

        batching = BatchingOptions(self.engine.max_seq_len, self.options.batch_tokens or self.engine.max_batch * 512)
        return GptOssModelHandler(self.engine, self.params, share_across_processes=self.options.share_across_processes,
                                  model_copies=self.options.model_copies, batching=batching)

    def infer_local(self, examples: list[JsonObject]) -> list[Generation]:
        return run_generation(cached_engine(self.engine), examples, self.params)

    def record(self, doc_id: str, meta: JsonObject, inference: Mapping[str, Any]) -> JsonObject:
        return {"id": doc_id, "prompt": meta["prompt"], "text": inference["text"], "final": inference["final"],
                "finish_reason": inference["finish_reason"], "prompt_tokens": inference["prompt_tokens"],
                "generated_tokens": inference["generated_tokens"], "truncated_tokens": meta["truncated_tokens"]}

    def merge(self, rows: Iterator[JsonObject], ctx: UnitContext) -> dict[str, float]:
        stats: dict[str, float] = {"documents": 0, "errors": 0, "generated_tokens": 0, "prompt_tokens": 0}
        with ctx.open_write(ctx.output_path(self.OUTPUT)) as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False).encode() + b"\n")
                stats["documents"] += 1
                stats["errors"] += "error" in row
                stats["generated_tokens"] += row.get("generated_tokens", 0)
                stats["prompt_tokens"] += row.get("prompt_tokens", 0)
        return stats


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
