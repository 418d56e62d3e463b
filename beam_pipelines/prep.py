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
import unicodedata
from dataclasses import dataclass
from functools import partial
from typing import Any

from refinery.beam_pipelines.checks import (
    UsageError,
    add_reject_rate_arg,
    bad_reject_rate,
    check_field,
    check_output,
    check_text,
    corrupt_files_failure,
    named_inputs,
    reject_rate_failure,
    rejects_hint,
    replaced_inputs_problem,
    text_spec,
    warn_if_mostly_rejected,
)
from refinery.beam_pipelines.command import Pipeline, RunFlags, add_runner_args, run_and_report, usage_error
from refinery.beam_pipelines.exclusion_flags import (
    ExclusionFlags,
    add_exclusion_args,
    exclusion_header,
    load_checked_exclusion,
    min_coverage_line,
)
from refinery.transforms.formats.failed_run import FAILED, clear_failed, mark_failed
from refinery.transforms.formats.shards import check_name
from refinery.transforms.formats.tiktoken_vocab import TIKTOKEN_FILES, VocabError
from refinery.transforms.formats.tokenizer_choice import TokenizerError, TokenizerSpec, resolve_tokenizer
from refinery.transforms.io import storage
from refinery.transforms.io.hf import resolve_hf_parquet
from refinery.transforms.io.rows import DEFAULT_MAX_ROW_BYTES
from refinery.transforms.io.text import TextSpec
from refinery.transforms.prep.exclusion import Exclusion
from refinery.transforms.prep.stages import PrepConfig, build_stages, clear_stale_manifest, parse_token_count
from refinery.transforms.resumable import JobResult

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
    add_exclusion_args(src, "the shards")
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


@dataclass(frozen=True)
class TokenizerFlags:
    """``--tokenizer``, ``--eos-token``, ``--eos-token-is-ordinary``, ``--encoder``, ``--vocab-file``."""

    tokenizer: str = "o200k_harmony"
    eos_token: str | None = None
    eos_token_is_ordinary: bool = False
    encoder: str = "fast"
    vocab_file: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TokenizerFlags:
        return cls(tokenizer=args.tokenizer, eos_token=args.eos_token,
                   eos_token_is_ordinary=bool(getattr(args, "eos_token_is_ordinary", False)),
                   encoder=getattr(args, "encoder", "fast"), vocab_file=args.vocab_file)


def resolve_tokenizer_flags(flags: TokenizerFlags, command: str) -> TokenizerSpec:
    """The :class:`TokenizerSpec` of ``flags``, or :class:`UsageError` (one line)."""
    if flags.vocab_file and flags.tokenizer not in ("o200k_harmony", "o200k_base"):
        raise UsageError(f"refinery {command}: --vocab-file is the o200k_base vocab; "
                         f"it does not apply to --tokenizer {flags.tokenizer}")
    if flags.vocab_file:
        os.environ["REFINERY_VOCAB_FILE"] = flags.vocab_file  # workers inherit it locally
    try:
        spec = resolve_tokenizer(flags.tokenizer, flags.eos_token, flags.eos_token_is_ordinary)
        if spec.eos_ordinary:
            print(f"refinery {command}: WARNING: the EOS {spec.eos_token!r} (id {spec.eos_id}) is an ordinary token "
                  "(--eos-token-is-ordinary): documents may hold it, so only the .idx files record where they "
                  "end (the manifest says eos_token_is_ordinary)", file=sys.stderr)
        return spec
    except storage.RemoteNotRead:  # a dry run: the job is described without reading the file
        print(f"refinery {command}: --tokenizer {flags.tokenizer}: not read (a dry run reads nothing remote); "
              "the job is described with a placeholder for it")
        return TokenizerSpec("tokenizers", flags.tokenizer, "not read (dry run)", 1 << 32, -1, "")
    except (TokenizerError, VocabError, storage.InputError) as e:
        raise UsageError(f"refinery {command}: {e}") from None


@dataclass(frozen=True)
class PrepSettings:
    """``refinery prep``'s flags, read once from the command line."""

    output: str
    inputs: tuple[str, ...] = ()  # --input (none with --hf-dataset)
    hf_dataset: str | None = None
    hf_subset: str | None = None
    hf_split: str = "train"
    hf_revision: str | None = None
    text_field: str | None = None
    text_template: str | None = None
    id_field: str | None = None
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES
    max_reject_rate: float | None = None
    exclude: ExclusionFlags = ExclusionFlags()
    dataset: str | None = None
    num_shards: int = 8
    max_tokens: str | None = None
    unit_mb: float = 16.0
    tokenizer: TokenizerFlags = TokenizerFlags()
    run: RunFlags = RunFlags()

    @property
    def given(self) -> list[str]:
        """The inputs as named: the ``--input`` arguments, or the ``--hf-dataset`` name."""
        return list(self.inputs) or [self.hf_dataset or ""]


def settings_from_args(args: argparse.Namespace) -> PrepSettings:
    """The :class:`PrepSettings` of ``args`` (parsed by :func:`add_arguments`' parser)."""
    return PrepSettings(
        output=args.output, inputs=tuple(args.input or ()), hf_dataset=args.hf_dataset, hf_subset=args.hf_subset,
        hf_split=args.hf_split, hf_revision=args.hf_revision, text_field=args.text_field,
        text_template=args.text_template, id_field=args.id_field, max_row_bytes=args.max_row_bytes,
        max_reject_rate=args.max_reject_rate, exclude=ExclusionFlags.from_args(args),
        dataset=args.dataset, num_shards=args.num_shards, max_tokens=args.max_tokens,
        unit_mb=args.unit_mb, tokenizer=TokenizerFlags.from_args(args), run=RunFlags.from_args(args))


def dataset_name(s: PrepSettings) -> str:
    """``--dataset``, else a name made from the HF dataset or the first input: its accents
    dropped (``données`` -> ``donnees``), any other character that is not an ASCII letter,
    digit, ``-`` or ``_`` made ``_``, so that the name is always one shard files can carry."""
    if s.dataset:
        return s.dataset
    if s.hf_dataset:
        base = s.hf_dataset.rsplit("/", 1)[-1]
    else:
        base = s.inputs[0].rstrip("/").rsplit("/", 1)[-1]
        for suffix in (".gz", ".zst", ".jsonl", ".json", ".parquet", ".arrow"):
            if base.lower().endswith(suffix):
                base = base[:-len(suffix)]
    plain = "".join(c for c in unicodedata.normalize("NFKD", base) if not unicodedata.combining(c))
    clean = "".join(c if (c.isascii() and c.isalnum()) or c in "-_" else "_" for c in plain).strip("_-")
    return clean or "dataset"


def run(args: argparse.Namespace, beam_args: list[str]) -> int:
    """Run prep; returns a process exit code (0 ok, 1 units failed or too many rejects, 2 bad
    arguments/inputs)."""
    settings = settings_from_args(args)
    try:
        cfg, found = checked_config(settings)
    except UsageError as e:
        return usage_error(str(e))
    return run_and_report(prep_pipeline(settings, cfg, found), settings.run, beam_args)


@dataclass
class FoundInputs:
    """What the checks found: the input files, how they were named, the files skipped for
    their extension, the rows to leave out and the inputs kept without an overlap check."""

    files: list[storage.InputFile]
    source: dict[str, Any]
    skipped: list[str]
    exclude: Exclusion | None
    unscanned: list[str]


def check_flags(s: PrepSettings) -> TextSpec:
    """The flags checked alone (before any file is read): the text spec, or :class:`UsageError`."""
    if bool(s.inputs) == bool(s.hf_dataset):
        raise UsageError("refinery prep: give exactly one of --input PATH... or --hf-dataset NAME")
    if s.num_shards < 1:
        raise UsageError("refinery prep: --num-shards must be at least 1")
    if s.max_row_bytes < 1:
        raise UsageError("refinery prep: --max-row-bytes must be at least 1")
    if problem := bad_reject_rate(s.max_reject_rate):
        raise UsageError(f"refinery prep: {problem}")
    text = text_spec("prep", s.text_field, s.text_template)
    assert text is not None  # the default field "text"
    return text


def checked_config(s: PrepSettings) -> tuple[PrepConfig, FoundInputs]:
    """The job's :class:`PrepConfig`, every flag and input checked first (in the driver, before
    anything is written); :class:`UsageError` (one line) for the first problem."""
    text = check_flags(s)
    tokenizer = resolve_tokenizer_flags(s.tokenizer, "prep")  # fails early, in the driver
    try:
        check_output("prep", s.output, list(s.inputs), dry_run=s.run.dry_run)
        max_tokens = parse_token_count(s.max_tokens) if s.max_tokens else None
        found = find_inputs(s, text)
    except UsageError:
        raise
    except (storage.InputError, ValueError) as e:
        raise UsageError(f"refinery prep: {e}") from None
    try:
        dataset = check_name(dataset_name(s))
    except ValueError as e:  # only a --dataset given can fail: a derived name is always made valid
        raise UsageError(f"refinery prep: --dataset: {e}") from None
    workers = s.run.workers or os.cpu_count() or 1
    cfg = PrepConfig(inputs=found.files, output=s.output.rstrip("/"), dataset=dataset,
                     num_shards=s.num_shards, text_field=text.field or "text", text_template=text.template,
                     id_field=s.id_field or "id",
                     max_tokens=max_tokens, wave_units=max(2, 2 * workers), source=found.source,
                     unit_bytes=int(s.unit_mb * (1 << 20)), max_row_bytes=s.max_row_bytes,
                     tokenizer=tokenizer, encoder=s.tokenizer.encoder, exclude=found.exclude)
    return cfg, found


def find_inputs(s: PrepSettings, text: TextSpec) -> FoundInputs:
    """The input files (listed), checked: their fields, that ``--output`` holds no other
    inputs' output, the decon drop lists of ``--exclude-overlaps``."""
    source: dict[str, Any] = {}
    skipped: list[str] = []
    if s.hf_dataset:
        hf = resolve_hf_parquet(s.hf_dataset, s.hf_subset, s.hf_split, s.hf_revision)
        inputs = storage.expand_inputs(list(hf.files))
        source = hf.describe()
    else:
        inputs = storage.expand_inputs(list(s.inputs), skipped=skipped)
    check_text("prep", text, [f.path for f in inputs])
    if s.id_field is not None:  # given: a field no row has would silently id every row by its place
        check_field("prep", "--id-field", s.id_field, [f.path for f in inputs])
    if problem := replaced_inputs_problem("prep", s.output, inputs, s.given, s.run.force):
        raise UsageError(problem)
    exclude, unscanned = load_checked_exclusion("prep", s.exclude, inputs, text, s.max_row_bytes)
    return FoundInputs(inputs, source, skipped, exclude, unscanned)


def prep_pipeline(s: PrepSettings, cfg: PrepConfig, found: FoundInputs) -> Pipeline:
    """The job of ``refinery prep``: its stages, header, summary and verdict."""
    return Pipeline("prep", cfg.output, build_stages(cfg), prep_header(cfg, found), partial(prep_summary, cfg.output),
                    verdict=partial(prep_verdict, cfg.output, s.max_reject_rate), on_plan=clear_stale_manifest,
                    run_info={"inputs": named_inputs(s.given)})


def prep_verdict(output: str, max_reject_rate: float | None, result: JobResult) -> str | None:
    """Why a finished run fails (too many rejected rows, corrupt input files), or None."""
    return settle_prep_output("prep", output, max_reject_rate)


def settle_prep_output(command: str, output: str, max_reject_rate: float | None) -> str | None:
    """Why the finished prep run into ``output`` fails (no row accepted, more rejected than
    ``max_reject_rate``, corrupt input files without it), or None. A failed run never looks
    finished: its ``FAILED.json`` is written (:mod:`~refinery.transforms.formats.failed_run`:
    the failure and the corrupt files), then its ``manifest.json`` removed (the next run writes
    it again and judges it again); a run that passes removes an earlier ``FAILED.json``."""
    rejects_path = storage.join(output, "rejects/rejects.jsonl")
    manifest_path = storage.join(output, "manifest.json")
    manifest = storage.read_json(manifest_path)
    rows, corrupt = manifest["rows"], manifest.get("corrupt_files", [])
    failure = reject_rate_failure("rows", rows["read"], rows["rejected"], rows["accepted"], max_reject_rate,
                                  f"reasons in {rejects_path}")
    if not failure and corrupt and max_reject_rate is None:
        failure = corrupt_files_failure(corrupt, storage.join(output, FAILED))
    if failure:
        mark_failed(output, command, failure, corrupt)
        storage.remove(manifest_path, root=output)
    else:
        clear_failed(output)
    return failure


def prep_summary(output: str, result: JobResult, seconds: float) -> str:
    """What a finished run did (stdout), after a warning per corrupt file and for mostly rejected rows."""
    rejects_path = storage.join(output, "rejects/rejects.jsonl")
    manifest_path = storage.join(output, "manifest.json")
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
            + (f" - pieces {rows['pieces']:,}" if "pieces" in rows else "")
            + (f"  (reasons in {rejects_path})" if rows["rejected"] else "")
            + span_line(m.get("excluded_overlaps", {}))
            + min_coverage_line(m.get("excluded_overlaps", {}))
            + f"\n  manifest: {manifest_path}")


def span_line(excluded: dict[str, Any]) -> str:
    """The summary's line about span mode's cuts (empty in row mode)."""
    if excluded.get("mode") != "span":
        return ""
    return (f"\n  spans cut (\u00b1{excluded['window']} chars): {excluded['rows_split']:,} row(s) split into "
            f"{excluded['pieces']:,} piece(s), {excluded['rows_dropped']:,} dropped whole (over "
            f"{excluded['max_splits']} holes, or unread by decon), {excluded['pieces_too_short']:,} piece(s) under "
            f"{excluded['min_chars']} chars dropped, {excluded['chars_removed']:,} characters removed")


def prep_header(cfg: PrepConfig, found: FoundInputs) -> str:
    """What a run prints (stderr) before it starts: inputs, output, shards, tokenizer, exclusions."""
    unscanned, exclude, max_tokens, tokenizer = found.unscanned, found.exclude, cfg.max_tokens, cfg.tokenizer
    return (f"prep: {len(found.files)} input file(s) -> {cfg.output} ({cfg.num_shards} shards, "
            f"dataset {cfg.dataset!r}"
            + (f", max {max_tokens:,} tokens" if max_tokens else "") + ")"
            + ("" if tokenizer.is_default else f"\n  tokenizer: {tokenizer.describe()}")
            + exclusion_header(exclude, unscanned)
            + (f"\n  {storage.skipped_note(found.skipped)}" if found.skipped else ""))
