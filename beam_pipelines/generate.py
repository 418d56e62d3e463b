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

HELP = "generate / rephrase documents with the gpt-oss engine (resumable)"

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


def engine_settings(args):
    """EngineSettings from the engine flags; ValueError (one line) for a checkpoint folder that is not there."""
    import os

    from refinery.beam_pipelines.checks import missing_extra
    from refinery.transforms.inference.handler import EngineSettings

    if "://" not in args.checkpoint and not os.path.isdir(args.checkpoint):
        raise ValueError(f"--checkpoint {args.checkpoint}: no such folder (a gpt-oss checkpoint folder: "
                         f"config.json + *.safetensors; `refinery tiny-checkpoint DIR` makes a small random one)")
    device = args.device
    if device is None:  # torch picks it here, in the driver
        if (missing := missing_extra("torch", "inference")) is not None:
            raise ValueError(f"the gpt-oss engine needs torch; {missing}")
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return EngineSettings(checkpoint=args.checkpoint, device=device, dtype=args.dtype, max_batch=args.max_batch,
                          max_seq_len=args.max_seq_len)


def handler_options(args):
    from refinery.transforms.inference.stages import HandlerOptions

    return HandlerOptions(share_across_processes=not args.no_share_model, model_copies=args.model_copies,
                          batch_tokens=args.batch_tokens)


def document_source(args):
    from refinery.transforms.inference.stages import DocumentSource

    return DocumentSource(paths=list(getattr(args, "input", None) or []), docid_files=list(args.input_docids or []),
                          data_root=args.data_root, text_field=getattr(args, "text_field", "text"),
                          id_field=getattr(args, "id_field", None) or "id", docs_per_unit=args.docs_per_unit)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from refinery.beam_pipelines.checks import add_reject_rate_arg
    from refinery.beam_pipelines.command import add_runner_args

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


def inference_pipeline(command: str, output: str, stages, header: str, summary, verdict=None):
    """A :class:`~refinery.beam_pipelines.command.Pipeline` of infer (in waves) -> merge: one Beam job."""
    from refinery.beam_pipelines.command import Pipeline

    return Pipeline(command, output, stages, header, summary, verdict=verdict)


def generate_stages(args) -> list:
    """The stages of ``refinery generate`` for parsed ``args``: infer -> merge."""
    from refinery.transforms.inference.handler import GenerationParams
    from refinery.transforms.inference.stages import GenerateTask, build_stages

    params = GenerationParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    task = GenerateTask(engine_settings(args), params, args.template, handler_options(args))
    return build_stages(task, document_source(args), args.wave_units)


def run(args, beam_args: list[str]) -> int:
    from refinery.beam_pipelines.checks import (
        UsageError,
        bad_reject_rate,
        check_field,
        check_output,
        reject_rate_failure,
        warn_if_mostly_rejected,
    )
    from refinery.beam_pipelines.command import run_pipeline, usage_error
    from refinery.transforms.inference.stages import GenerateTask
    from refinery.transforms.io import storage

    output = args.output.rstrip("/")
    try:
        if bool(args.input) == bool(args.input_docids):
            raise ValueError("give exactly one of --input PATH... or --input-docids FILE...")
        check_output("generate", output, args.input or [], dry_run=args.dry_run)
        if problem := bad_reject_rate(args):
            raise ValueError(problem)
        stages = generate_stages(args)
        source = stages[0].source
        if args.input:
            check_field("generate", "--text-field", args.text_field, [f.path for f in source.files])
            if args.id_field is not None:
                check_field("generate", "--id-field", args.id_field, [f.path for f in source.files])
        units = len(stages[0].plan())
    except UsageError as e:
        return usage_error(str(e))
    except (storage.InputError, ValueError) as e:
        return usage_error(f"refinery generate: {e}")

    def verdict(result) -> str | None:
        stats = result.runs[-1].check("merge").receipt["stats"]
        read, errors = stats["documents"], stats["errors"]
        return reject_rate_failure("documents", read, errors, read - errors, args.max_reject_rate,
                                   f"reasons in the error field of {storage.join(output, GenerateTask.OUTPUT)}")

    def summary(result, seconds: float) -> str:
        stats = result.runs[-1].check("merge").receipt["stats"]
        warn_if_mostly_rejected("generate", stats["errors"], stats["documents"],
                                f"the error field of {storage.join(output, GenerateTask.OUTPUT)}")
        ran = ", ".join(f"{k} {v}" for k, v in result.ran.items()) or "nothing (all units already done)"
        return (f"generate done in {seconds:.1f}s; units run: {ran}\n"
                f"  {stats['documents']:,} documents ({stats['errors']:,} unreadable), "
                f"{stats['generated_tokens']:,} tokens generated\n"
                f"  output: {storage.join(output, GenerateTask.OUTPUT)}")

    header = (f"generate: {len(source.files)} input file(s), {units} unit(s) -> {output}"
              + (f"\n  {storage.skipped_note(source.skipped)}" if source.skipped else ""))
    return run_pipeline(inference_pipeline("generate", output, stages, header, summary, verdict), args, beam_args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="refinery generate", description=(__doc__ or "").splitlines()[0])
    add_arguments(p)
    return p
