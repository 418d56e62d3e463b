"""prep: corpora -> uint32 (or uint16) token shards (.npy + .idx) with a checksummed manifest.

``refinery prep --input PATH... --output DIR`` normalizes, tokenizes (``--tokenizer``, default
o200k_harmony) and packs
a corpus into ``DIR/shard_NNNN/{dataset}-v1-shard-NNNNNN.{npy,idx}`` and ``DIR/manifest.json``.
Killing the job and running the same command again finishes it.

The job's shape, in one place: :func:`refinery.transforms.prep.stages.build_stages` lists its
steps in order ([count] -> tokenize -> [merge] -> pack -> manifest, each a stage of units);
:func:`refinery.transforms.resumable.beam_steps.build_pipeline` makes them one Beam job (a step per
stage, each after the one before), and :func:`refinery.transforms.resumable.orchestration.run_stages`
plans and runs it. The public PTransforms (``refinery.transforms.prep.beam``: ``Normalize |
Tokenize | AssignShard | WriteTokenShards``) are the same per-document steps for a user's own
pipeline, not this command's job; they write the same bytes (one order rule,
``documents.order_key``, and one writer, ``formats.shards.write_shard``).
"""
from __future__ import annotations

import argparse
import os
import sys

HELP = "tokenize a corpus into .npy/.idx shards with a manifest"
# what the local runner's warm worker process imports ahead (runners.warm_workers)
WORKER_IMPORTS = ("refinery.transforms.prep.stages", "refinery.transforms.formats.warm_encoder")

EPILOG = """\
examples:
  refinery prep --input corpus/ --output out/ --num-shards 16
  refinery prep --input 'gs://my-bucket/crawl/*.jsonl.zst' --output gs://my-bucket/tokens \\
      --runner dataflow --project my-project --region us-central1 --temp_location gs://my-bucket/tmp
  refinery prep --hf-dataset HuggingFaceFW/fineweb-edu --hf-subset sample-10BT --output out/ --max-tokens 100M
  refinery prep --input gsm8k/train.jsonl --text-template '{question}\\n\\n{answer}' --output out/gsm8k
  refinery prep --input corpus/ --output out-cl100k/ --tokenizer cl100k_base
  refinery prep --input corpus/ --output out-llama/ --tokenizer ./llama3/tokenizer.json --eos-token '<|end_of_text|>'

Text: --text-field F takes each row's text from field F; --text-template T fills T, Python
format syntax over the rows' top-level fields ({name}; {{ and }} for literal braces), with
\\n, \\t and \\\\ in T read as newline, tab and backslash (as typed in single quotes). A row
missing a field, or whose field is not a string, is rejected with the reason. A field holding
a chat message list ([{"role": ..., "content": ...}, ...]) is flattened to one "role: content"
per message, joined by a blank line.

Killing the job and running the same command again finishes it: finished units are kept
(receipts under OUTPUT/.refinery) and never redone. --force starts from scratch.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from refinery.beam_pipelines.checks import add_reject_rate_arg
    from refinery.beam_pipelines.command import add_runner_args
    from refinery.transforms.io.rows import DEFAULT_MAX_ROW_BYTES

    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    src = parser.add_argument_group("input")
    src.add_argument("--input", nargs="+", metavar="PATH",
                     help="files, folders (recursive) or globs; local or gs://; "
                          ".jsonl .jsonl.gz .jsonl.zst .json .parquet .arrow (any case), or a datasets "
                          "save_to_disk folder; other files in a folder are skipped and named")
    src.add_argument("--hf-dataset", metavar="NAME", help="a Hugging Face dataset (its parquet files)")
    src.add_argument("--hf-subset", metavar="S", help="dataset subset/config")
    src.add_argument("--hf-split", default="train", metavar="SPLIT", help="split (default: train)")
    src.add_argument("--hf-revision", metavar="REV", help="revision to pin (default: the current commit)")
    src.add_argument("--text-field", default=None,
                     help="field holding the document text (default: text); a chat message list is flattened")
    src.add_argument("--text-template", metavar="TEMPLATE",
                     help="build the text from several fields instead, e.g. '{question}\\n\\n{answer}' "
                          "(\\n, \\t, \\\\ interpreted; see below); not with --text-field")
    src.add_argument("--id-field", default=None,
                     help="field holding the document id (default: id; a row without it -> '{relpath}:{row}'); "
                          "given, it must be in some row of each input file (else exit 2, listing their fields)")
    src.add_argument("--max-row-bytes", type=int, default=DEFAULT_MAX_ROW_BYTES, metavar="N",
                     help="reject a row larger than N bytes (a JSONL line, a .json array element, a parquet/"
                          "arrow row) as 'row too large', reading past it without holding it in memory "
                          f"(default: {DEFAULT_MAX_ROW_BYTES} = {DEFAULT_MAX_ROW_BYTES >> 20} MiB)")
    add_reject_rate_arg(src)
    src.add_argument("--exclude-overlaps", nargs="+", default=[], metavar="DECON_OUTPUT",
                     help="leave out the training rows that these finished refinery decon outputs found "
                          "overlapping an eval set (their stats/contaminated_train_docs.jsonl); rows are matched "
                          "by file and row number; every input must be a file decon scanned, unchanged since "
                          "(else the run is refused, naming it), and the drop list must be what decon wrote "
                          "(its sha256 is checked against decon's merge receipt)")
    src.add_argument("--allow-unscanned-inputs", action="store_true",
                     help="with --exclude-overlaps: keep input files that decon did not scan (or that changed "
                          "since, holding no listed row) without an overlap check, with a warning, instead of "
                          "refusing the run")
    src.add_argument("--verify-inputs-by-content", action="store_true",
                     help="with --exclude-overlaps: read every input in full first and refuse one whose sha256 is "
                          "not the one decon recorded (decon --verify-inputs-by-content): for corpora copied with "
                          "their sizes and mtimes kept (cp -p, rsync -t, tar), where rows may differ unseen")
    src.add_argument("--exclude-n", type=int, metavar="N",
                     help="with --exclude-overlaps: leave out rows that overlap at this n (one the decon runs "
                          "computed; default: each run's largest n)")
    out = parser.add_argument_group("output")
    out.add_argument("--output", required=True, metavar="DIR", help="output folder, local or gs://")
    out.add_argument("--dataset", help="dataset name used in shard file names (default: from the input)")
    out.add_argument("--num-shards", type=int, default=8, help="number of output shards (default: 8)")
    out.add_argument("--max-tokens", metavar="N",
                     help="keep documents in input order up to N tokens (suffixes K, M, B, T)")
    out.add_argument("--unit-mb", type=float, default=16.0, metavar="MB",
                     help="input per tokenize unit: smaller files are grouped, bigger local .jsonl files split by "
                          "byte range, so the cores share any layout (default: 16; 0: one unit per file)")
    add_tokenizer_args(parser)
    add_runner_args(parser)


def add_tokenizer_args(parser: argparse.ArgumentParser) -> None:
    """``--tokenizer``, ``--eos-token``, ``--vocab-file`` (prep and prep-mixture)."""
    from refinery.transforms.formats.tiktoken_vocab import TIKTOKEN_FILES

    tok = parser.add_argument_group("tokenizer")
    tok.add_argument("--tokenizer", default="o200k_harmony", metavar="NAME_OR_PATH",
                     help="a tiktoken encoding (" + ", ".join(TIKTOKEN_FILES) + "; o200k_* and cl100k_base work "
                          "offline, the others only from tiktoken's cache) or a Hugging Face tokenizer.json file or "
                          "a folder holding one, local or gs://, or a hub model ORG/MODEL[@REVISION] (its "
                          "tokenizer.json at that revision's commit; default: the current one) (default: "
                          "o200k_harmony). Shards are uint16 when "
                          "every id fits (vocab <= 65,536), else uint32; the manifest records tokenizer, sha256 of "
                          "its file, vocab size, EOS id and dtype. Another tokenizer (name, or file content) re-plans "
                          "the output; the same one resumes it")
    tok.add_argument("--eos-token", metavar="TOKEN_OR_ID",
                     help="the token that ends every document, as a token of the vocab or its id (default: "
                          "tiktoken's <|endoftext|>; for a tokenizer.json the eos_token of a tokenizer_config.json "
                          "beside it, else the first of </s> <|endoftext|> <|end_of_text|> <|im_end|> <eos> "
                          "in its vocab)")
    tok.add_argument("--eos-token-is-ordinary", action="store_true",
                     help="accept an --eos-token that is an ordinary token (one a document's text can encode to; "
                          "refused without this): document ends then cannot be told from the tokens, so "
                          "regenerate-index refuses these shards and the .idx is their only record")
    tok.add_argument("--encoder", choices=["fast", "bpe-openai", "tiktoken"], default="fast",
                     help="what encodes a tiktoken encoding: fast (default): for o200k_harmony, o200k_base and "
                          "cl100k_base, gigatoken's Rust BPE (gigatoken-cachefix, Linux x86-64) a batch of "
                          "documents at a time, else bpe-openai's; exactly tiktoken's tokens (tested token for "
                          "token), tiktoken for any document they refuse (counted as encoder_fallbacks in the "
                          "tokenize receipts); bpe-openai: bpe-openai's alone; tiktoken: tiktoken alone, the "
                          "reference. Not part of the plan: the tokens are the same")
    tok.add_argument("--vocab-file", help="o200k_base.tiktoken[.gz] to use for o200k_harmony/o200k_base "
                                          "(default: resolved offline)")


def resolve_tokenizer_args(args, command: str):
    """(TokenizerSpec, None) or (None, exit code 2 after one line on stderr) for the
    ``--tokenizer``/``--eos-token``/``--vocab-file`` of ``args``."""
    from refinery.beam_pipelines.command import usage_error
    from refinery.transforms.formats.tiktoken_vocab import VocabError
    from refinery.transforms.formats.tokenizer_choice import TokenizerError, TokenizerSpec, resolve_tokenizer
    from refinery.transforms.io import storage

    if args.vocab_file and args.tokenizer not in ("o200k_harmony", "o200k_base"):
        return None, usage_error(f"refinery {command}: --vocab-file is the o200k_base vocab; "
                                 f"it does not apply to --tokenizer {args.tokenizer}")
    if args.vocab_file:
        os.environ["REFINERY_VOCAB_FILE"] = args.vocab_file  # workers inherit it locally
    try:
        spec = resolve_tokenizer(args.tokenizer, args.eos_token, getattr(args, "eos_token_is_ordinary", False))
        if spec.eos_ordinary:
            print(f"refinery {command}: WARNING: the EOS {spec.eos_token!r} (id {spec.eos_id}) is an ordinary token "
                  "(--eos-token-is-ordinary): documents may hold it, so only the .idx files record where they "
                  "end (the manifest says eos_token_is_ordinary)", file=sys.stderr)
        return spec, None
    except storage.RemoteNotRead:  # a dry run: the job is described without reading the file
        print(f"refinery {command}: --tokenizer {args.tokenizer}: not read (a dry run reads nothing remote); "
              "the job is described with a placeholder for it")
        return TokenizerSpec("tokenizers", args.tokenizer, "not read (dry run)", 1 << 32, -1, ""), None
    except (TokenizerError, VocabError, storage.InputError) as e:
        return None, usage_error(f"refinery {command}: {e}")


def dataset_name(args) -> str:
    """``--dataset``, else a name made from the HF dataset or the first input: its accents
    dropped (``données`` -> ``donnees``), any other character that is not an ASCII letter,
    digit, ``-`` or ``_`` made ``_``, so that the name is always one shard files can carry."""
    import unicodedata

    if args.dataset:
        return args.dataset
    if args.hf_dataset:
        base = args.hf_dataset.rsplit("/", 1)[-1]
    else:
        base = args.input[0].rstrip("/").rsplit("/", 1)[-1]
        for suffix in (".gz", ".zst", ".jsonl", ".json", ".parquet", ".arrow"):
            if base.lower().endswith(suffix):
                base = base[:-len(suffix)]
    plain = "".join(c for c in unicodedata.normalize("NFKD", base) if not unicodedata.combining(c))
    clean = "".join(c if (c.isascii() and c.isalnum()) or c in "-_" else "_" for c in plain).strip("_-")
    return clean or "dataset"


def corrupt_files_failure(corrupt: list[dict]) -> str:
    """The one line a run with corrupt or cut-short input files fails with (without
    ``--max-reject-rate``): the first file and its reason, and how many there are."""
    first = corrupt[0]
    more = f" (and {len(corrupt) - 1} more, listed in the manifest's corrupt_files)" if len(corrupt) > 1 else ""
    return (f"{len(corrupt)} input file(s) corrupt or cut short: {first['path']}: {first['reason']}{more}; "
            "the rows before the damage were read. Replace the file, or give --max-reject-rate R to count "
            "each as one rejected row")


def run(args, beam_args: list[str]) -> int:
    from refinery.beam_pipelines.checks import (
        UsageError,
        bad_reject_rate,
        check_field,
        check_output,
        check_text,
        named_inputs,
        reject_rate_failure,
        rejects_hint,
        replaced_inputs_problem,
        text_spec,
        warn_if_mostly_rejected,
    )
    from refinery.beam_pipelines.command import Pipeline, run_pipeline, usage_error
    from refinery.transforms.formats.droplist import ReadSpec
    from refinery.transforms.formats.shards import check_name
    from refinery.transforms.io import storage
    from refinery.transforms.io.text import TEXT_NORMALIZATION
    from refinery.transforms.prep.exclusion import UNREAD, load_exclusion
    from refinery.transforms.prep.stages import PrepConfig, build_stages, clear_stale_manifest, parse_token_count

    if bool(args.input) == bool(args.hf_dataset):
        return usage_error("refinery prep: give exactly one of --input PATH... or --hf-dataset NAME")
    if args.num_shards < 1:
        return usage_error("refinery prep: --num-shards must be at least 1")
    if args.max_row_bytes < 1:
        return usage_error("refinery prep: --max-row-bytes must be at least 1")
    if problem := bad_reject_rate(args):
        return usage_error(f"refinery prep: {problem}")
    try:
        text = text_spec("prep", args.text_field, args.text_template)
    except UsageError as e:
        return usage_error(str(e))
    tokenizer, failed = resolve_tokenizer_args(args, "prep")  # fails early, in the driver
    if tokenizer is None:
        return failed
    source = {}
    skipped: list[str] = []
    try:
        check_output("prep", args.output, args.input or [], dry_run=args.dry_run)
        max_tokens = parse_token_count(args.max_tokens) if args.max_tokens else None
        if args.hf_dataset:
            from refinery.transforms.io.hf import resolve_hf_parquet
            hf = resolve_hf_parquet(args.hf_dataset, args.hf_subset, args.hf_split, args.hf_revision)
            inputs = storage.expand_inputs(list(hf.files))
            source = hf.describe()
        else:
            inputs = storage.expand_inputs(args.input, skipped=skipped)
        check_text("prep", text, [f.path for f in inputs])
        if args.id_field is not None:  # given: a field no row has would silently id every row by its place
            check_field("prep", "--id-field", args.id_field, [f.path for f in inputs])
        if problem := replaced_inputs_problem("prep", args.output, inputs, args.input or [args.hf_dataset],
                                              getattr(args, "force", False)):
            raise UsageError(problem)
        exclude = None
        unscanned: list[str] = []
        if args.exclude_overlaps:
            read_spec = ReadSpec(text.identity(), TEXT_NORMALIZATION, args.max_row_bytes)
            exclude = load_exclusion(args.exclude_overlaps, args.exclude_n, read_spec=read_spec)
            unscanned = exclude.check_inputs(inputs, allow_unscanned=args.allow_unscanned_inputs,
                                             by_content=args.verify_inputs_by_content)
        elif args.exclude_n is not None or args.allow_unscanned_inputs or args.verify_inputs_by_content:
            flag = ("--exclude-n" if args.exclude_n is not None else
                    "--allow-unscanned-inputs" if args.allow_unscanned_inputs else "--verify-inputs-by-content")
            raise UsageError(f"refinery prep: {flag} needs --exclude-overlaps DECON_OUTPUT")
    except UsageError as e:
        return usage_error(str(e))
    except (storage.InputError, ValueError) as e:
        return usage_error(f"refinery prep: {e}")
    try:
        dataset = check_name(dataset_name(args))
    except ValueError as e:  # only a --dataset given can fail: a derived name is always made valid
        return usage_error(f"refinery prep: --dataset: {e}")
    workers = args.workers or os.cpu_count() or 1
    cfg = PrepConfig(inputs=inputs, output=args.output.rstrip("/"), dataset=dataset,
                     num_shards=args.num_shards, text_field=text.field or "text", text_template=text.template,
                     id_field=args.id_field or "id",
                     max_tokens=max_tokens, wave_units=max(2, 2 * workers), source=source,
                     unit_bytes=int(args.unit_mb * (1 << 20)), max_row_bytes=args.max_row_bytes,
                     tokenizer=tokenizer, encoder=args.encoder, exclude=exclude)

    rejects_path = storage.join(cfg.output, "rejects/rejects.jsonl")

    def verdict(result) -> str | None:
        manifest_path = storage.join(cfg.output, "manifest.json")
        manifest = storage.read_json(manifest_path)
        rows = manifest["rows"]
        failure = reject_rate_failure("rows", rows["read"], rows["rejected"], rows["accepted"], args.max_reject_rate,
                                      f"reasons in {rejects_path}")
        if not failure and manifest.get("corrupt_files") and args.max_reject_rate is None:
            failure = corrupt_files_failure(manifest["corrupt_files"])
        if failure and not rows["accepted"]:  # no manifest of nothing: the next run writes it again, and fails again
            storage.remove(manifest_path, root=cfg.output)
        return failure

    def summary(result, seconds: float) -> str:
        manifest_path = storage.join(cfg.output, "manifest.json")
        m = storage.read_json(manifest_path)
        ran = ", ".join(f"{k} {v} ({result.seconds.get(k, 0):.1f}s)" for k, v in result.ran.items()) \
            or "nothing (all units already done)"
        rows = m["rows"]
        for c in m.get("corrupt_files", []):  # let through by --max-reject-rate: still named, once each
            print(f"WARNING refinery prep: {c['path']}: {c['reason']}; the rows before it were read", file=sys.stderr)
        if rows["read"] and rows["rejected"] * 2 > rows["read"]:
            warn_if_mostly_rejected("prep", rows["rejected"], rows["read"], rejects_path, rejects_hint(rejects_path))
        return (f"prep done in {seconds:.1f}s; units run: {ran}\n"
                f"  {m['total_documents']:,} documents, {m['total_tokens']:,} tokens in {m['num_shards']} shards\n"
                f"  rows: read {rows['read']:,} = accepted {rows['accepted']:,} + empty {rows['empty']:,} + "
                f"rejected {rows['rejected']:,}"
                + (f" + over budget {rows['over_budget']:,}" if rows.get("over_budget") else "")
                + (f" + excluded {rows['excluded']:,}" if "excluded" in rows else "")
                + (f"  (reasons in {rejects_path})" if rows["rejected"] else "")
                + f"\n  manifest: {manifest_path}")

    header = (f"prep: {len(inputs)} input file(s) -> {cfg.output} ({cfg.num_shards} shards, dataset {cfg.dataset!r}"
              + (f", max {max_tokens:,} tokens" if max_tokens else "") + ")"
              + ("" if tokenizer.is_default else f"\n  tokenizer: {tokenizer.describe()}")
              + "".join(f"\n  excluding the training rows that {s.output} found overlapping: its drop list is "
                        f"{s.sha256}" if s.sha256 == UNREAD else
                        f"\n  excluding {s.listed:,} training row(s) that {s.output} found overlapping at n={s.n}"
                        + (f", and {s.unread:,} it could not read" if s.unread else "")
                        for s in (exclude.sources if exclude else []))
              + (f"\n  WARNING: {len(unscanned)} input file(s) not scanned by decon are kept WITHOUT an overlap "
                 f"check (--allow-unscanned-inputs): {', '.join(unscanned[:3])}{' ...' if len(unscanned) > 3 else ''}"
                 if unscanned else "")
              + (f"\n  {storage.skipped_note(skipped)}" if skipped else ""))
    return run_pipeline(Pipeline("prep", cfg.output, build_stages(cfg), header, summary, verdict=verdict,
                                 on_plan=clear_stale_manifest,
                                 run_info={"inputs": named_inputs(args.input or [args.hf_dataset])}),
                        args, beam_args)
