"""generate: synthetic data and rephrasing with the gpt-oss engine, resumable.

``refinery generate --checkpoint CKPT --input PROMPTS --output DIR`` fills a harmony prompt
template with each document (``--template rephrase`` or a text file with ``{text}``), runs
the engine through Beam's RunInference (model loaded once per machine and shared by the
worker processes, continuous batching inside each batch), and writes ``DIR/generations.jsonl``:
one row per input document, in input order, ``{id, prompt, text, final, finish_reason,
prompt_tokens, generated_tokens, truncated_tokens}`` (``final`` = the harmony final channel;
an unreadable document is a row with ``error``).

Inputs: JSONL/JSON/parquet rows (``--text-field``, ``--id-field``), or doc ids
``{source}//{relpath}#s=..:e=..`` (``--input-docids FILE --data-root ROOT``, e.g. HYDRA
slices) read from prep shards. Sampling: ``--temperature 0`` is greedy; otherwise each
document draws from its own RNG seeded by (``--seed``, document id), so its draws do not depend
on which documents share its batch; a rerun of a unit with the same settings writes the same
bytes. (Float rounding of batched matmuls can still change a token when the batch *size* or
the runner changes: see RELIABILITY.md.) Stages: ``infer`` (units of ``--docs-per-unit`` documents,
run in waves of ``--wave-units`` in the one Beam job) -> ``merge``. Killing the job and running the
same command again finishes it.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from refinery.beam_pipelines.checks import (
    UsageError,
    add_reject_rate_arg,
    bad_reject_rate,
    check_field,
    check_output,
    missing_extra,
    reject_rate_failure,
    warn_if_mostly_rejected,
)
from refinery.beam_pipelines.command import Pipeline, RunFlags, add_runner_args, run_and_report, usage_error
from refinery.transforms.inference.documents import DocumentSource
from refinery.transforms.inference.handler import EngineSettings, GenerationParams
from refinery.transforms.inference.stages import InferStage, build_stages
from refinery.transforms.inference.tasks import GenerateTask, HandlerOptions
from refinery.transforms.io import storage
from refinery.transforms.resumable import JobResult, Stage

EPILOG = """\
examples:
  refinery generate --checkpoint gpt-oss-20b/original --input corpus/ --output out/gen --max-tokens 512
  refinery generate --checkpoint CKPT --input-docids slices/docids_val.jsonl --data-root prep_out/ \\
      --output out/rephrased --template my_template.txt --temperature 0.8 --seed 7
"""


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine options shared by generate and the hydra commands."""
    e = parser.add_argument_group("engine")
    e.add_argument("--checkpoint", required=True, metavar="CKPT",
                   help="gpt-oss checkpoint folder (OpenAI original or Hugging Face layout)")
    e.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    e.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                   help="compute dtype (default: bfloat16; experts stay MXFP4)")
    e.add_argument("--max-batch", type=int, default=32, help="sequences decoded together (default: 32)")
    e.add_argument("--max-seq-len", type=int, default=4096, help="prompt + generated tokens (default: 4096)")
    e.add_argument("--batch-tokens", type=int, default=None,
                   help="prompt tokens per RunInference batch (default: 512 x --max-batch)")
    e.add_argument("--no-share-model", action="store_true",
                   help="load one engine per worker process instead of one per machine")
    e.add_argument("--model-copies", type=int, default=None,
                   help="engines to load per machine, shared by its workers (e.g. one per GPU)")


def add_input_arguments(parser: argparse.ArgumentParser, docids_only: bool = False) -> None:
    """Where the documents come from: input files, or doc-id files (generate and the hydra commands)."""
    g = parser.add_argument_group("inputs")
    if not docids_only:
        g.add_argument("--input", nargs="+", metavar="PATH",
                       help="files, folders or globs of .jsonl .jsonl.gz .jsonl.zst .json .parquet .arrow rows "
                            "(any case; other files in a folder are skipped and named)")
        g.add_argument("--text-field", default="text", help="text field of input rows (default: text)")
        g.add_argument("--id-field", default=None,
                       help="id field (default: id; absent -> '{relpath}:{row}'); given, it must be in some row of "
                            "each input file (else exit 2)")
    g.add_argument("--input-docids", nargs="+", metavar="FILE", required=docids_only,
                   help="doc-id files (JSONL rows with doc_id, or one doc id per line)")
    g.add_argument("--data-root", metavar="DIR", help="folder the doc ids' relpaths start from (prep output)")
    g.add_argument("--docs-per-unit", type=int, default=256, help="documents per resumable unit (default: 256)")
    g.add_argument("--wave-units", type=int, default=8,
                   help="units per wave of the job, each wave after the one before: a kill loses "
                        "at most the wave in flight (default: 8; a job has at most 16 waves, so a bigger plan "
                        "gets bigger waves)")


@dataclass(frozen=True)
class EngineFlags:
    """The engine flags of :func:`add_engine_arguments`, read once from the command line."""

    checkpoint: str
    device: str | None = None
    dtype: str = "bfloat16"
    max_batch: int = 32
    max_seq_len: int = 4096
    batch_tokens: int | None = None
    no_share_model: bool = False
    model_copies: int | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineFlags:
        return cls(checkpoint=args.checkpoint, device=args.device, dtype=args.dtype, max_batch=args.max_batch,
                   max_seq_len=args.max_seq_len, batch_tokens=args.batch_tokens, no_share_model=args.no_share_model,
                   model_copies=args.model_copies)


@dataclass(frozen=True)
class InputFlags:
    """The input flags of :func:`add_input_arguments`, read once from the command line."""

    input: tuple[str, ...] = ()
    text_field: str = "text"
    id_field: str | None = None
    input_docids: tuple[str, ...] = ()
    data_root: str | None = None
    docs_per_unit: int = 256
    wave_units: int = 8

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> InputFlags:
        """(a doc-ids-only command's parser has no ``--input``, ``--text-field``, ``--id-field``)"""
        return cls(input=tuple(getattr(args, "input", None) or ()), text_field=getattr(args, "text_field", "text"),
                   id_field=getattr(args, "id_field", None), input_docids=tuple(args.input_docids or ()),
                   data_root=args.data_root, docs_per_unit=args.docs_per_unit, wave_units=args.wave_units)


def engine_settings(flags: EngineFlags) -> EngineSettings:
    """EngineSettings from the engine flags; ValueError (one line) for a checkpoint folder that is not there."""
    if "://" not in flags.checkpoint and not os.path.isdir(flags.checkpoint):
        raise ValueError(f"--checkpoint {flags.checkpoint}: no such folder (a gpt-oss checkpoint folder: "
                         f"config.json + *.safetensors; `refinery tiny-checkpoint DIR` makes a small random one)")
    device = flags.device
    if device is None:  # torch picks it here, in the driver
        if (missing := missing_extra("torch", "inference")) is not None:
            raise ValueError(f"the gpt-oss engine needs torch; {missing}")
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return EngineSettings(checkpoint=flags.checkpoint, device=device, dtype=flags.dtype, max_batch=flags.max_batch,
                          max_seq_len=flags.max_seq_len)


def handler_options(flags: EngineFlags) -> HandlerOptions:
    return HandlerOptions(share_across_processes=not flags.no_share_model, model_copies=flags.model_copies,
                          batch_tokens=flags.batch_tokens)


def document_source(flags: InputFlags) -> DocumentSource:
    return DocumentSource(paths=list(flags.input), docid_files=list(flags.input_docids), data_root=flags.data_root,
                          text_field=flags.text_field, id_field=flags.id_field or "id",
                          docs_per_unit=flags.docs_per_unit)


@dataclass(frozen=True)
class GenerateSettings:
    """``refinery generate``'s flags, read once from the command line."""

    output: str
    inputs: InputFlags
    engine: EngineFlags
    max_reject_rate: float | None = None
    template: str = "rephrase"
    max_tokens: int = 512
    temperature: float = 0.0
    seed: int = 0
    run: RunFlags = RunFlags()


def settings_from_args(args: argparse.Namespace) -> GenerateSettings:
    """The :class:`GenerateSettings` of ``args`` (parsed by :func:`add_arguments`' parser)."""
    return GenerateSettings(output=args.output, inputs=InputFlags.from_args(args), engine=EngineFlags.from_args(args),
                            max_reject_rate=args.max_reject_rate, template=args.template, max_tokens=args.max_tokens,
                            temperature=args.temperature, seed=args.seed, run=RunFlags.from_args(args))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_input_arguments(parser)
    g = parser.add_argument_group("generation")
    add_reject_rate_arg(g, "the documents read (unreadable rows: error rows in the output)")
    g.add_argument("--output", required=True, metavar="DIR", help="output folder (local or gs://)")
    g.add_argument("--template", default="rephrase",
                   help="'rephrase' (built in) or a text file whose {text} is replaced by the document")
    g.add_argument("--max-tokens", type=int, default=512, help="generated tokens per document at most (default: 512)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    g.add_argument("--seed", type=int, default=0, help="global seed; each document's seed = f(seed, doc id)")
    add_engine_arguments(parser)
    add_runner_args(parser)


def inference_pipeline(command: str, output: str, stages: list[Stage[Any, Any]], header: str,
                       summary: Callable[[JobResult, float], str],
                       verdict: Callable[[JobResult], str | None] | None = None) -> Pipeline:
    """A :class:`~refinery.beam_pipelines.command.Pipeline` of infer (in waves) -> merge: one Beam job."""
    return Pipeline(command, output, stages, header, summary, verdict=verdict)


def generate_stages(s: GenerateSettings) -> list[Stage[Any, Any]]:
    """The stages of ``refinery generate``: infer -> merge."""
    params = GenerationParams(max_tokens=s.max_tokens, temperature=s.temperature, seed=s.seed)
    task = GenerateTask(engine_settings(s.engine), params, s.template, handler_options(s.engine))
    return build_stages(task, document_source(s.inputs), s.inputs.wave_units)


def run(args: argparse.Namespace, beam_args: list[str]) -> int:
    """Run generate; returns a process exit code (0 ok, 1 units failed or too many errors, 2 bad arguments)."""
    s = settings_from_args(args)
    output = s.output.rstrip("/")
    try:
        stages, units = checked_stages(s, output)
    except UsageError as e:
        return usage_error(str(e))
    except (storage.InputError, ValueError) as e:
        return usage_error(f"refinery generate: {e}")
    infer = stages[0]
    assert isinstance(infer, InferStage)
    source = infer.source
    header = (f"generate: {len(source.files)} input file(s), {units} unit(s) -> {output}"
              + (f"\n  {storage.skipped_note(source.skipped)}" if source.skipped else ""))
    pipeline = inference_pipeline("generate", output, stages, header, partial(generate_summary, output),
                                  partial(generate_verdict, output, s.max_reject_rate))
    return run_and_report(pipeline, s.run, beam_args)


def checked_stages(s: GenerateSettings, output: str) -> tuple[list[Stage[Any, Any]], int]:
    """The stages and how many units the first plans, every flag and input checked first."""
    if bool(s.inputs.input) == bool(s.inputs.input_docids):
        raise ValueError("give exactly one of --input PATH... or --input-docids FILE...")
    check_output("generate", output, list(s.inputs.input), dry_run=s.run.dry_run)
    if problem := bad_reject_rate(s.max_reject_rate):
        raise ValueError(problem)
    stages = generate_stages(s)
    infer = stages[0]
    assert isinstance(infer, InferStage)
    if s.inputs.input:
        check_field("generate", "--text-field", s.inputs.text_field, [f.path for f in infer.source.files])
        if s.inputs.id_field is not None:
            check_field("generate", "--id-field", s.inputs.id_field, [f.path for f in infer.source.files])
    return stages, len(infer.plan())


def generate_verdict(output: str, max_reject_rate: float | None, result: JobResult) -> str | None:
    """Why a finished run fails (too many unreadable documents), or None."""
    stats = result.runs[-1].check("merge").done_receipt()["stats"]
    read, errors = stats["documents"], stats["errors"]
    return reject_rate_failure("documents", read, errors, read - errors, max_reject_rate,
                               f"reasons in the error field of {storage.join(output, GenerateTask.OUTPUT)}")


def generate_summary(output: str, result: JobResult, seconds: float) -> str:
    """What a finished run did (stdout), after a warning for mostly unreadable documents."""
    stats = result.runs[-1].check("merge").done_receipt()["stats"]
    warn_if_mostly_rejected("generate", stats["errors"], stats["documents"],
                            f"the error field of {storage.join(output, GenerateTask.OUTPUT)}")
    ran = ", ".join(f"{k} {v}" for k, v in result.ran.items()) or "nothing (all units already done)"
    return (f"generate done in {seconds:.1f}s; units run: {ran}\n"
            f"  {stats['documents']:,} documents ({stats['errors']:,} unreadable), "
            f"{stats['generated_tokens']:,} tokens generated\n"
            f"  output: {storage.join(output, GenerateTask.OUTPUT)}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="refinery generate", description=(__doc__ or "").splitlines()[0])
    add_arguments(p)
    return p
