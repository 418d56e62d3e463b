"""The ``refinery`` command line.

Every pipeline command takes ``--runner`` (default ``local``: DirectRunner, one worker per
core) and passes any flag it does not know to Beam's PipelineOptions, so Dataflow/Flink
flags (``--project``, ``--region``, ``--flink_master``, ...) go straight through.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from refinery.beam_pipelines.command import add_runner_args, interruptible, resume_hint
from refinery.runners import RunnerOptionsError, pipeline_args

# Command modules plugged in by name: each has HELP, add_arguments(parser), run(args, beam_args).
# (see refinery.beam_pipelines.command). Uncomment a line when its module lands.
COMMANDS = {
    "decon": "refinery.beam_pipelines.decon",
    "generate": "refinery.beam_pipelines.generate",          # issue 6
    "hydra": "refinery.beam_pipelines.hydra",                # issue 6
    "prep-mixture": "refinery.beam_pipelines.prep_mixture",  # issue 9
    "inspect": "refinery.beam_pipelines.inspect_shards",     # issue 9
    "regenerate-index": "refinery.beam_pipelines.regenerate_index",  # issue 9
}

EPILOG_PREP = """\
examples:
  refinery prep --input corpus/ --output out/ --num-shards 16
  refinery prep --input 'gs://bucket/crawl/*.jsonl.zst' --output gs://bucket/tokens \\
      --runner dataflow --project P --region us-central1 --temp_location gs://bucket/tmp
  refinery prep --hf-dataset HuggingFaceFW/fineweb-edu --hf-subset sample-10BT --output out/ --max-tokens 100M

Killing the job and running the same command again finishes it: finished units are kept
(receipts under OUTPUT/.refinery) and never redone. --force starts from scratch.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="refinery", description="Prepare LLM training data as Apache Beam pipelines.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("prep", help="tokenize a corpus into .npy/.idx shards with a manifest",
                       description="Normalize, tokenize (o200k_harmony) and pack a corpus into uint32 "
                                   ".npy + .idx token shards with a checksummed manifest.json.",
                       epilog=EPILOG_PREP, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("input")
    src.add_argument("--input", nargs="+", metavar="PATH",
                     help="files, folders (recursive) or globs; local or gs://; "
                          ".jsonl .jsonl.gz .jsonl.zst .json .parquet")
    src.add_argument("--hf-dataset", metavar="NAME", help="a Hugging Face dataset (its parquet files)")
    src.add_argument("--hf-subset", metavar="S", help="dataset subset/config")
    src.add_argument("--hf-split", default="train", metavar="SPLIT", help="split (default: train)")
    src.add_argument("--hf-revision", metavar="REV", help="revision to pin (default: the current commit)")
    src.add_argument("--text-field", default="text", help="field holding the document text (default: text)")
    src.add_argument("--id-field", default="id",
                     help="field holding the document id (default: id; absent -> '{relpath}:{row}')")
    out = p.add_argument_group("output")
    out.add_argument("--output", required=True, metavar="DIR", help="output folder, local or gs://")
    out.add_argument("--dataset", help="dataset name used in shard file names (default: from the input)")
    out.add_argument("--num-shards", type=int, default=8, help="number of output shards (default: 8)")
    out.add_argument("--max-tokens", metavar="N",
                     help="keep documents in input order up to N tokens (suffixes K, M, B, T)")
    out.add_argument("--vocab-file", help="o200k_base.tiktoken[.gz] to use (default: resolved offline)")
    add_runner_args(p)

    v = sub.add_parser("verify", help="check a manifest and its shards (exit 1 naming each problem)")
    v.add_argument("manifest", help="path to manifest.json (local or gs://)")
    v.add_argument("--checksums", action="store_true", help="also re-hash every file (sha256)")

    i = sub.add_parser("info", help="summarize a manifest")
    i.add_argument("manifest")
    i.add_argument("--json", action="store_true", help="print the manifest's summary as JSON")

    s = sub.add_parser("status", help="units done/pending/failed per stage of a run, from its receipts")
    s.add_argument("output", help="the run's output folder (local or gs://)")

    import importlib
    for name, module_name in COMMANDS.items():
        mod = importlib.import_module(module_name)
        c = sub.add_parser(name, help=mod.HELP, description=(mod.__doc__ or mod.HELP).strip().split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(c)
    return parser


def _dataset_name(args) -> str:
    if args.dataset:
        return args.dataset
    if args.hf_dataset:
        base = args.hf_dataset.rsplit("/", 1)[-1]
    else:
        base = args.input[0].rstrip("/").rsplit("/", 1)[-1]
        for suffix in (".gz", ".zst", ".jsonl", ".json", ".parquet"):
            base = base.removesuffix(suffix)
    clean = "".join(c if c.isalnum() or c in "-_" else "_" for c in base).strip("_")
    return clean or "dataset"


def cmd_prep(args, beam_args: list[str]) -> int:
    from refinery.transforms.prep.stages import PrepConfig, build_stages, clear_stale_manifest, parse_token_count
    from refinery.transforms.core import io
    from refinery.transforms.core.stages import StageFailed, run_stages
    from refinery.transforms.formats.tokenizer import get_encoding

    if bool(args.input) == bool(args.hf_dataset):
        print("refinery prep: give exactly one of --input PATH... or --hf-dataset NAME", file=sys.stderr)
        return 2
    if args.num_shards < 1:
        print("refinery prep: --num-shards must be at least 1", file=sys.stderr)
        return 2
    try:
        beam_args = pipeline_args(args.runner, args.workers, beam_args)
    except RunnerOptionsError as e:
        print(f"refinery prep: {e}", file=sys.stderr)
        return 2
    if args.vocab_file:
        os.environ["REFINERY_VOCAB_FILE"] = args.vocab_file  # workers inherit it locally
    get_encoding(args.vocab_file)  # fail early, in the driver, if the vocab is unavailable
    source = {}
    try:
        max_tokens = parse_token_count(args.max_tokens) if args.max_tokens else None
        if args.hf_dataset:
            from refinery.transforms.core.hf import resolve_hf_parquet
            hf = resolve_hf_parquet(args.hf_dataset, args.hf_subset, args.hf_split, args.hf_revision)
            inputs = io.expand_inputs(list(hf.files))
            source = hf.describe()
        else:
            inputs = io.expand_inputs(args.input)
    except (io.InputError, ValueError) as e:
        print(f"refinery prep: {e}", file=sys.stderr)
        return 2
    workers = args.workers or os.cpu_count() or 1
    cfg = PrepConfig(inputs=inputs, output=args.output.rstrip("/"), dataset=_dataset_name(args),
                     num_shards=args.num_shards, text_field=args.text_field, id_field=args.id_field,
                     max_tokens=max_tokens, wave_units=max(2, 2 * workers), source=source)
    print(f"prep: {len(inputs)} input file(s) -> {cfg.output} ({cfg.num_shards} shards, dataset {cfg.dataset!r}"
          + (f", max {max_tokens:,} tokens" if max_tokens else "") + ")", file=sys.stderr)
    t0 = time.time()

    def run() -> int:
        try:
            result = run_stages(
                build_stages(cfg), cfg.output, beam_args,
                verify_checksums=args.verify_checksums, force=args.force, progress=not args.no_progress,
                run_info={"command": "prep", "argv": sys.argv[1:]}, on_plan=clear_stale_manifest)
        except StageFailed as e:
            print(f"refinery prep: {e}\nFinished units are kept; fix the cause and run the same command again:\n"
                  f"  {resume_hint()}", file=sys.stderr)
            return 1
        manifest_path = io.join(cfg.output, "manifest.json")
        m = io.read_json(manifest_path)
        ran = ", ".join(f"{k} {v} ({result.seconds.get(k, 0):.1f}s)" for k, v in result.ran.items()) \
            or "nothing (all units already done)"
        rows = m["rows"]
        print(f"prep done in {time.time() - t0:.1f}s; units run: {ran}\n"
              f"  {m['total_documents']:,} documents, {m['total_tokens']:,} tokens in {m['num_shards']} shards\n"
              f"  rows: read {rows['read']:,} = accepted {rows['accepted']:,} + empty {rows['empty']:,} + "
              f"rejected {rows['rejected']:,}" + (f" + over budget {rows['over_budget']:,}" if rows.get("over_budget") else "")
              + (f"  (reasons in {io.join(cfg.output, 'rejects/rejects.jsonl')})" if rows["rejected"] else "")
              + f"\n  manifest: {manifest_path}")
        return 0

    return interruptible(run)


def cmd_verify(args) -> int:
    from refinery.transforms.formats.shards import verify_manifest

    problems = verify_manifest(args.manifest, checksums=args.checksums)
    for p in problems:
        print(f"BAD  {p}")
    if problems:
        print(f"{len(problems)} problem(s) found", file=sys.stderr)
        return 1
    from refinery.transforms.core import io
    m = io.read_json(args.manifest)
    print(f"OK   {args.manifest}: {m['num_shards']} shards, {m['total_documents']:,} documents, "
          f"{m['total_tokens']:,} tokens" + (" (checksums verified)" if args.checksums else ""))
    return 0


def cmd_info(args) -> int:
    from refinery.transforms.core import io

    try:
        m = io.read_json(args.manifest)
    except FileNotFoundError:
        print(f"refinery info: {args.manifest}: not found", file=sys.stderr)
        return 2
    summary = {k: m.get(k) for k in ("dataset", "version", "tokenizer", "vocab_size", "eos_token_id", "dtype",
                                     "num_shards", "total_documents", "total_tokens", "max_tokens", "plan_hash", "rows")}
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    for k, val in summary.items():
        print(f"{k:16} {val}")
    docs = [s["num_documents"] for s in m["shards"]]
    toks = [s["num_tokens"] for s in m["shards"]]
    if docs:
        print(f"{'shard docs':16} min {min(docs):,}  max {max(docs):,}")
        print(f"{'shard tokens':16} min {min(toks):,}  max {max(toks):,}")
        print(f"{'tokens/doc':16} {sum(toks) / max(sum(docs), 1):,.1f}")
    return 0


def cmd_status(args) -> int:
    from refinery.transforms.core.stages import stage_status

    try:
        rows = stage_status(args.output)
    except FileNotFoundError as e:
        print(f"refinery status: {e}", file=sys.stderr)
        return 2
    print(f"{'stage':10} {'hash':16} {'units':>7} {'done':>7} {'failed':>7} {'pending':>7}")
    for r in rows:
        print(f"{r['stage']:10} {r['stage_hash']:16} {r['units']:>7} {r['done']:>7} {r['failed']:>7} {r['pending']:>7}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "verbose", False):
        logging.getLogger("apache_beam").setLevel(logging.ERROR)  # workers' routine warnings
    if args.command == "prep":
        return cmd_prep(args, unknown)
    if args.command == "verify":
        return cmd_verify(args)
    if args.command == "info":
        return cmd_info(args)
    if args.command == "status":
        return cmd_status(args)
    if args.command in COMMANDS:
        import importlib
        mod = importlib.import_module(COMMANDS[args.command])
        if hasattr(args, "runner"):  # a pipeline: unknown flags go to Beam
            try:
                beam_args = pipeline_args(args.runner, args.workers, unknown)
            except RunnerOptionsError as e:
                print(f"refinery {args.command}: {e}", file=sys.stderr)
                return 2
            return interruptible(lambda: mod.run(args, beam_args))
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        return mod.run(args, [])
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
