"""Train/test n-gram overlap with full provenance (the HELM data-overlap method).

``refinery decon --eval PATH... --train PATH... --output DIR --ngrams 5 9 13`` tells, for
every eval instance, whether and where its n-grams appear in the training corpus: which
training file and row, which n-gram, and the character offsets on both sides.

Stages (see :mod:`refinery.transforms.decon.stages`): ``index`` (eval n-grams -> hash
partitions + a compact membership file), ``scan`` (training file slices streamed against
the membership side input; training n-grams are never shuffled), ``reduce`` (one unit per
hash partition: details and per-partition results), ``merge`` (stats, metrics, reports).
Killing the job and re-running the same command finishes it.

Outputs under DIR/stats: ``overlap_stats.jsonl`` (per eval dataset and n),
``overlap_details/`` (per eval row x training row x n-gram, with offsets and a snippet of
the training text: Parquet parts; ``overlap_details.jsonl.gz`` with ``--details-format
jsonl``), ``overlap_instances.jsonl.gz`` (the text of each overlapping eval instance),
``overlap_stats_by_train_path.jsonl``, ``overlap_metrics.jsonl``
(HELM metrics per instance), ``eval_summary.jsonl``, ``report.md``, ``report.html``; then
``DIR/.SUCCESS``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
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
    reject_rate_failure,
    text_spec,
    warn_if_mostly_rejected,
)
from refinery.beam_pipelines.command import Pipeline, RunFlags, add_runner_args, run_and_report, usage_error
from refinery.transforms.decon.ngrams import details as dt
from refinery.transforms.decon.ngrams.steering import steering_lines
from refinery.transforms.decon.stages import (
    DeconSettings,
    build_stages,
    foreign_details,
    input_stages,
    remove_stale_details,
)
from refinery.transforms.formats.droplist import UNREAD_ROWS
from refinery.transforms.formats.failed_run import CorruptFile, clear_failed, mark_failed
from refinery.transforms.io import storage
from refinery.transforms.io.hf import materialize_split
from refinery.transforms.io.rows import CORRUPT, DEFAULT_MAX_ROW_BYTES
from refinery.transforms.io.text import DEFAULT_MATCH_FOLD, MATCH_FOLDS, TextSpec
from refinery.transforms.resumable import JobResult, Stage, StageRun
from refinery.transforms.resumable.ledger import META_DIR
from refinery.transforms.resumable.units import Unit

# what the local runner's warm worker process imports ahead (runners.warm_workers)
WORKER_IMPORTS = ("refinery.transforms.decon.stages",)

MATCH_FOLD_HELP = ("the key both sides' normalized text is folded to before n-grams are matched (offsets still "
                   "index the rows' text as read; prep and clean keep the text as it is). nfkc-cf (default): format "
                   "characters (Unicode Cf: soft hyphen, zero-width space and joiners, word joiner, BOM, ...) "
                   "dropped, then NFKC (fullwidth letters, ligatures such as \ufb01 -> fi, superscripts): text that "
                   "is the same to a reader, or to an NFKC tokenizer, matches; none: the normalized text as it is "
                   "(HELM's exact text)")
EPILOG = """\
examples:
  refinery decon --eval decontamination/ --train corpus/ --output out/decon --ngrams 5 9 13
  refinery decon --eval gsm8k/test.jsonl --eval-text-field question \\
      --train 'gs://my-bucket/crawl/*.jsonl.zst' --output gs://my-bucket/decon --runner dataflow ...
  refinery decon --eval gsm8k/test.jsonl --eval-text-template '{question}\\n\\n{answer}' \\
      --train corpus/ --output out/decon

Text: each side's text comes from its own flag (--eval-text-field or --eval-text-template,
--train-text-field or --train-text-template), else from the shared --text-field or
--text-template, else from the field "text". A template is Python format syntax over the
rows' top-level fields ({name}; {{ and }} for literal braces), with \\n, \\t and \\\\ read as
newline, tab and backslash (as typed in single quotes). A field holding a chat message list
([{"role": ..., "content": ...}, ...]) is flattened to one "role: content" per message,
joined by a blank line. Rows without text (a missing field, not a string) are counted as
bad rows.

Datasets: an eval row's dataset is its file's folder (gsm8k-dolma-3fa9c1/test.jsonl -> gsm8k),
or with --eval-dataset-field FIELD its own FIELD; AI2 decon's reference files, one file of
several benchmarks, read as they are:
  refinery decon --eval ai2_eval.jsonl --eval-dataset-field eval_key \\
      --eval-text-template '{question}' --train corpus/ --output out/decon

Matching: both sides' text is normalized as prep normalizes it (CR LF as LF, controls
dropped, NFC, ends stripped), then folded to the match key (--match-fold nfkc-cf: format
characters dropped, NFKC; none: as it is), and the n-grams of that are matched; offsets in
the details and spans index the rows' text as read. HELM's method exactly, on text the
normalization leaves alone: --match-fold none --min-eval-tokens 0.
"""


def _count_or_none(value: str) -> int | None:
    if value.lower() == "none":
        return None
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'none', got {value!r}")
    return count


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Decon's options, then the shared execution flags (``--runner``, ``--workers``, ...)."""
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    g = parser.add_argument_group("inputs")
    g.add_argument("--eval", nargs="+", default=[], metavar="PATH",
                   help="eval (test) data: files, folders (recursive) or globs; local or gs://; "
                        ".jsonl .jsonl.gz .jsonl.zst .json .parquet .arrow (any case; other files in a folder "
                        "are skipped and named). The eval dataset name comes from "
                        "each file's folder (gsm8k-dolma-3fa9c1/test.jsonl -> gsm8k), or --eval-dataset-field")
    g.add_argument("--eval-dataset-field", metavar="FIELD",
                   help="name each eval row's dataset by the value of its FIELD (e.g. eval_key: one file holding "
                        "several benchmarks, as AI2 decon's reference files do), not by its file's folder; a row "
                        "whose FIELD is missing, not a string or not a name (empty, a '/') is a bad row of its "
                        "file's dataset, listed with its reason in stats/eval_bad_rows.jsonl; no row of an eval "
                        "file having FIELD: exit 2")
    g.add_argument("--eval-hf", nargs="+", default=[], metavar="NAME[:SUBSET]:SPLIT",
                   help="eval sets by Hugging Face name (or a local dataset folder), e.g. openai/gsm8k:main:test; "
                        "loaded with `datasets` at a pinned revision (--eval-hf-revision) and kept under "
                        "OUTPUT/.refinery/eval-hf/")
    g.add_argument("--eval-hf-revision", metavar="SHA", help="pin --eval-hf to this commit (default: the current one)")
    g.add_argument("--train", nargs="+", required=True, metavar="PATH", help="training data, same forms")
    g.add_argument("--text-field", default=None,
                   help="text field on both sides (default: text); a chat message list is flattened")
    g.add_argument("--text-template", metavar="TEMPLATE",
                   help="build the text of both sides from several fields instead, e.g. "
                        "'{question}\\n\\n{answer}' (\\n, \\t, \\\\ interpreted; see below); not with --text-field")
    g.add_argument("--eval-text-field", default=None,
                   help="text field of eval rows (default: --text-field / --text-template)")
    g.add_argument("--eval-text-template", metavar="TEMPLATE",
                   help="text template of eval rows (default: --text-field / --text-template)")
    g.add_argument("--train-text-field", default=None,
                   help="text field of training rows (default: --text-field / --text-template)")
    g.add_argument("--train-text-template", metavar="TEMPLATE",
                   help="text template of training rows (default: --text-field / --text-template)")
    g.add_argument("--id-field", default=None,
                   help="id field of eval and training rows (default: id; absent or null -> blake2b hash of the "
                        "whole record); given, it must be in some row of each input file (else exit 2)")
    g.add_argument("--max-row-bytes", type=int, default=DEFAULT_MAX_ROW_BYTES, metavar="N",
                   help="an eval or training row larger than N bytes is unreadable (counted, and each training one "
                        "listed in stats/unread_train_rows.jsonl, which prep --exclude-overlaps leaves out); the "
                        "same default as prep's, and prep --exclude-overlaps refuses a drop list made with another "
                        f"cap than its own (default: {DEFAULT_MAX_ROW_BYTES} = {DEFAULT_MAX_ROW_BYTES >> 20} MiB)")
    g.add_argument("--verify-inputs-by-content", action="store_true",
                   help="record the sha256 of each training file in stats/train_files.jsonl (each is read once "
                        "more), so that prep --exclude-overlaps --verify-inputs-by-content can tell a file whose "
                        "rows changed with its size and mtime kept (cp -p, rsync -t, tar)")
    add_reject_rate_arg(g, "the eval rows read, or of the training rows read,")
    m = parser.add_argument_group("method")
    m.add_argument("--ngrams", nargs="+", type=int, default=[13], metavar="N",
                   help="n-gram lengths (default: 13); rows shorter than n use their one min(n, len)-gram")
    m.add_argument("--tokenizer", default="default", choices=["default", "whitespace", "no_lowercase"],
                   help="default: HELM's lower() + split on runs of whitespace/ASCII punctuation")
    m.add_argument("--match-fold", choices=MATCH_FOLDS, default=DEFAULT_MATCH_FOLD, help=MATCH_FOLD_HELP)
    m.add_argument("--max-train-count", type=int, default=None, metavar="K",
                   help="ignore n-grams found in more than K training documents (HELM's frequency filter)")
    m.add_argument("--max-ngram-details", type=_count_or_none, default=100_000, metavar="D",
                   help="write at most D detail records per n-gram (eval rows x training rows; the stats still "
                        "count them all) and warn when an n-gram has more; 'none': no cap (default: 100000)")
    m.add_argument("--min-eval-tokens", type=int, default=5, metavar="K",
                   help="eval rows of fewer than K tokens (\"a\", \"the\", \"1\": their one n-gram is in most "
                        "training rows) are not indexed; they are counted and named in a warning, "
                        "overlap_stats.jsonl and report.md. 0 or 1: every row, as HELM (default: 5)")
    o = parser.add_argument_group("output and layout")
    o.add_argument("--output", required=True, metavar="DIR", help="output folder, local or gs://")
    o.add_argument("--details-format", choices=["parquet", "jsonl"], default="parquet",
                   help="the detail records: parquet (default): a folder stats/overlap_details/ of one "
                        "part-PPPPP.parquet per partition; jsonl: one stats/overlap_details.jsonl.gz")
    o.add_argument("--partitions", type=int, default=64, help="hash partitions of the test index (default: 64)")
    o.add_argument("--slice-mb", type=float, default=256.0,
                   help="training .jsonl/.parquet files larger than this are split into slices (default: 256)")
    o.add_argument("--eval-slice-mb", type=float, default=16.0,
                   help="eval .jsonl/.parquet files larger than this are indexed in slices, in parallel; a "
                        "slice's n-gram windows take about 60 bytes each while it is indexed (default: 16)")
    o.add_argument("--report-examples", type=int, default=20, metavar="K",
                   help="stats/report.html shows the K most contaminated instances of each eval dataset at "
                        "each n (default: 20)")
    add_runner_args(parser)


@dataclass(frozen=True)
class DeconFlags:
    """``refinery decon``'s flags, read once from the command line."""

    output: str
    train_paths: tuple[str, ...]
    eval_paths: tuple[str, ...] = ()
    eval_dataset_field: str | None = None
    eval_hf: tuple[str, ...] = ()
    eval_hf_revision: str | None = None
    text_field: str | None = None
    text_template: str | None = None
    eval_text_field: str | None = None
    eval_text_template: str | None = None
    train_text_field: str | None = None
    train_text_template: str | None = None
    id_field: str | None = None
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES
    verify_inputs_by_content: bool = False
    max_reject_rate: float | None = None
    ngrams: tuple[int, ...] = (13,)
    tokenizer: str = "default"
    match_fold: str = DEFAULT_MATCH_FOLD
    max_train_count: int | None = None
    max_ngram_details: int | None = 100_000
    min_eval_tokens: int = 5
    details_format: str = "parquet"
    partitions: int = 64
    slice_mb: float = 256.0
    eval_slice_mb: float = 16.0
    report_examples: int = 20
    run: RunFlags = RunFlags()


def flags_from_args(args: argparse.Namespace) -> DeconFlags:
    """The :class:`DeconFlags` of ``args`` (parsed by :func:`add_arguments`' parser)."""
    return DeconFlags(
        output=args.output, train_paths=tuple(args.train), eval_paths=tuple(args.eval),
        eval_dataset_field=args.eval_dataset_field, eval_hf=tuple(args.eval_hf), eval_hf_revision=args.eval_hf_revision,
        text_field=args.text_field, text_template=args.text_template, eval_text_field=args.eval_text_field,
        eval_text_template=args.eval_text_template, train_text_field=args.train_text_field,
        train_text_template=args.train_text_template, id_field=args.id_field, max_row_bytes=args.max_row_bytes,
        verify_inputs_by_content=args.verify_inputs_by_content, max_reject_rate=args.max_reject_rate,
        ngrams=tuple(args.ngrams), tokenizer=args.tokenizer, match_fold=args.match_fold,
        max_train_count=args.max_train_count,
        max_ngram_details=args.max_ngram_details, min_eval_tokens=args.min_eval_tokens,
        details_format=args.details_format, partitions=args.partitions, slice_mb=args.slice_mb,
        eval_slice_mb=args.eval_slice_mb, report_examples=args.report_examples, run=RunFlags.from_args(args))


def text_specs(flags: DeconFlags) -> tuple[TextSpec, TextSpec]:
    """(eval, train) :class:`~refinery.transforms.io.text.TextSpec` of the text flags: a
    side's own flag, else the shared one, else the field ``text``; :class:`UsageError` for a
    bad template or two flags of one side."""
    shared = text_spec("decon", flags.text_field, flags.text_template)
    assert shared is not None  # the default field "text"
    eval_text = text_spec("decon", flags.eval_text_field, flags.eval_text_template, "--eval-text-field",
                          "--eval-text-template", default=None)
    train_text = text_spec("decon", flags.train_text_field, flags.train_text_template, "--train-text-field",
                           "--train-text-template", default=None)
    return eval_text or shared, train_text or shared


def stage_settings(flags: DeconFlags) -> DeconSettings:
    """The stages' :class:`~refinery.transforms.decon.stages.DeconSettings` of ``flags``."""
    eval_text, train_text = text_specs(flags)
    return DeconSettings(
        eval_paths=list(flags.eval_paths), train_paths=list(flags.train_paths), ns=list(flags.ngrams),
        eval_text_field=eval_text.field or "text", eval_text_template=eval_text.template,
        train_text_field=train_text.field or "text", train_text_template=train_text.template,
        id_field=flags.id_field or "id", tokenizer=flags.tokenizer, partitions=flags.partitions,
        max_train_count=flags.max_train_count, max_ngram_details=flags.max_ngram_details,
        slice_bytes=max(1, int(flags.slice_mb * (1 << 20))),
        eval_slice_bytes=max(1, int(flags.eval_slice_mb * (1 << 20))),
        report_examples=flags.report_examples, details_format=flags.details_format,
        max_row_bytes=flags.max_row_bytes, verify_inputs_by_content=flags.verify_inputs_by_content,
        min_eval_tokens=flags.min_eval_tokens, eval_dataset_field=flags.eval_dataset_field,
        match_fold=flags.match_fold,
    )


def settings_from_args(args: argparse.Namespace) -> DeconSettings:
    """The stages' settings of ``args`` (tests, and a caller that builds the stages itself)."""
    return stage_settings(flags_from_args(args))


def run(args: argparse.Namespace, beam_args: list[str]) -> int:
    """Run decon; returns a process exit code (0 ok, 1 units failed, 2 bad arguments/inputs)."""
    flags = flags_from_args(args)
    try:
        job = checked_job(flags)
    except UsageError as e:
        return usage_error(str(e))
    if job.pending_hf:
        print(f"  (--dry-run: {', '.join(job.pending_hf)} would be loaded first; not counted below)")
    return run_and_report(decon_pipeline(job), flags.run, beam_args)


@dataclass
class DeconJob:
    """A checked decon run: its output folder, its stages' settings and stages, the files
    skipped for their extension, the ``--eval-hf`` sets a dry run has not loaded yet."""

    output: str
    flags: DeconFlags
    settings: DeconSettings
    stages: list[Stage[Any, Any]]
    skipped: list[str]
    pending_hf: list[str]


def checked_job(flags: DeconFlags) -> DeconJob:
    """The run's stages, every flag and input checked first (before anything is written but the
    ``--eval-hf`` sets); :class:`UsageError` (one line) for the first problem."""
    output = flags.output.rstrip("/")
    if problem := bad_reject_rate(flags.max_reject_rate):
        raise UsageError(f"refinery decon: {problem}")
    if not (flags.eval_paths or flags.eval_hf):
        raise UsageError("refinery decon: give the eval data: --eval PATH... and/or --eval-hf NAME[:SUBSET]:SPLIT...")
    try:
        job = checked_inputs(flags, output)
    except UsageError:
        raise
    except (storage.InputError, ValueError) as e:
        raise UsageError(f"refinery decon: {e}") from None
    if not (flags.run.dry_run and storage.is_remote(output)) and (foreign := foreign_details(output)):
        raise UsageError(f"refinery decon: {storage.join(output, foreign[0])}: not a file decon writes, in its "
                         f"detail records' folder (a reader would take its rows for details); move it out of "
                         f"{output}" + (f" ({len(foreign) - 1} more such file(s))" if len(foreign) > 1 else ""))
    return job


def checked_inputs(flags: DeconFlags, output: str) -> DeconJob:
    """The text flags, the output folder, the ``--eval-hf`` sets (loaded), the input files and
    their fields, checked; the stages."""
    text_specs(flags)  # a bad template or flag pair: before anything is read or written
    check_output("decon", output, [*flags.eval_paths, *flags.train_paths], dry_run=flags.run.dry_run)
    loaded, pending_hf = load_eval_hf(flags, output)
    if pending_hf and not loaded:
        raise UsageError(f"refinery decon --dry-run: {', '.join(pending_hf)} not loaded yet; nothing to plan")
    flags = dataclasses.replace(flags, eval_paths=loaded)
    settings = stage_settings(flags)
    skipped: list[str] = []
    stages = build_stages(settings, skipped)
    index, scan = input_stages(stages)
    for side, spec, files in (("eval", settings.eval_text, index.eval_files),
                              ("train", settings.train_text, scan.train_files)):
        check_text("decon", spec, [f.path for f in files], f"--{side}-text-field", f"--{side}-text-template")
        if flags.id_field is not None:  # given: a field no row has would silently id every row by a hash
            check_field("decon", "--id-field", flags.id_field, [f.path for f in files])
    if flags.eval_dataset_field is not None:  # a field no row has would make every row a bad row
        check_field("decon", "--eval-dataset-field", flags.eval_dataset_field, [f.path for f in index.eval_files])
    return DeconJob(output, flags, settings, stages, skipped, pending_hf)


def load_eval_hf(flags: DeconFlags, output: str) -> tuple[tuple[str, ...], list[str]]:
    """(the eval paths with each ``--eval-hf`` set's file added, the sets not loaded: on a dry
    run, which writes nothing, those not loaded before)."""
    eval_paths, pending_hf = flags.eval_paths, []
    for spec in flags.eval_hf:
        path = materialize_split(spec, storage.join(output, META_DIR, "eval-hf"), flags.eval_hf_revision,
                                 write=not flags.run.dry_run)
        if storage.exists(path):
            eval_paths = (*eval_paths, path)
        else:
            pending_hf.append(spec)
    return eval_paths, pending_hf


def decon_pipeline(job: DeconJob) -> Pipeline:
    """The job of ``refinery decon``: its stages, header, summary and verdict."""
    index, scan = input_stages(job.stages)
    header = (f"decon: {len(index.eval_files)} eval file(s), {len(scan.train_files)} training file(s), "
              f"n = {' '.join(map(str, job.settings.ns))} -> {job.output}"
              + (f"\n  {storage.skipped_note(job.skipped)}" if job.skipped else ""))
    return Pipeline("decon", job.output, job.stages, header, partial(decon_summary, job.output),
                    verdict=partial(decon_verdict, job.output, job.flags.max_reject_rate),
                    on_plan=partial(clear_stale_outputs, job.output, job.settings.details_format))


def clear_stale_outputs(output: str, details_format: str, runs: list[StageRun], plans: list[list[Unit[Any]]]) -> None:
    """Once the stages are planned: what a reader would take for this run's output goes."""
    # a run whose reduce is not done yet must not leave an old .SUCCESS behind
    if not runs[-1].check(plans[-1][0].id).done:
        storage.remove(storage.join(output, ".SUCCESS"), root=output)
    # a part not of this plan (more partitions before, or a planted copy) is read as detail rows
    parquet = details_format == "parquet"
    current = {dt.details_part(u.payload["p"]) for u in plans[-2]} if parquet else set()
    if removed := remove_stale_details(output, current, jsonl_too=False):
        print(f"decon: removed {len(removed)} detail part(s) not of this run's plan: {', '.join(removed[:5])}",
              file=sys.stderr)


BAD_ROWS = "unreadable or without text"


def row_counts(output: str, result: JobResult) -> dict[str, tuple[int, int]]:
    """(rows read, rows unreadable or without text) of each side."""
    summary_lines = storage.read_bytes(storage.join(output, "stats", "eval_summary.jsonl")).splitlines()
    evals = [json.loads(line) for line in summary_lines]
    scan = result.runs[-1].check("merge").done_receipt()["stats"]["scan"]
    return {"eval": (sum(e["num_rows"] + e["num_bad_rows"] for e in evals), sum(e["num_bad_rows"] for e in evals)),
            "training": (int(scan.get("rows", 0)), int(scan.get("bad_rows", 0)))}


def decon_verdict(output: str, max_reject_rate: float | None, result: JobResult) -> str | None:
    """Why a finished run fails (too many rows unreadable or without text; a corrupt or cut-short
    training file without ``--max-reject-rate``, as prep fails), or None. A failed run never
    looks finished: its ``FAILED.json`` is written, then its ``.SUCCESS`` removed (so
    ``--exclude-overlaps`` and ``clean`` refuse it); a run that passes removes an earlier one."""
    counts = row_counts(output, result)
    corrupt = corrupt_train_files(output) if counts["training"][1] else []
    failure = next((f for side, (read, bad) in counts.items()
                    if (f := reject_rate_failure(f"{side} rows", read, bad, read - bad, max_reject_rate,
                                                 f"{BAD_ROWS}: decon counts such rows, it does not list them"))),
                   None)
    for c in corrupt:  # let through by --max-reject-rate or not: named, once each
        print(f"WARNING refinery decon: {c['path']}: {c['reason']}; the rows before it were read", file=sys.stderr)
    if not failure and corrupt and max_reject_rate is None:
        failure = corrupt_files_failure(corrupt, storage.join(output, UNREAD_ROWS))
    if failure:
        mark_failed(output, "decon", failure, corrupt)
        storage.remove(storage.join(output, ".SUCCESS"), root=output)
    else:
        clear_failed(output)
    return failure


def corrupt_train_files(output: str) -> list[CorruptFile]:
    """The training files decon's scan found corrupt or cut short (each one row of
    ``stats/unread_train_rows.jsonl``, whose reason says so), read a line at a time."""
    found: dict[str, CorruptFile] = {}
    with storage.open_read(storage.join(output, UNREAD_ROWS)) as f:
        for line in f:
            row = json.loads(line)
            if str(row.get("reason", "")).startswith(CORRUPT):
                found.setdefault(row["train_path"], {"path": row["train_path"], "reason": row["reason"]})
    return sorted(found.values(), key=lambda c: c["path"])


def decon_summary(output: str, result: JobResult, seconds: float) -> str:
    """What a finished run found (stdout), after its warnings (stderr)."""
    ran = ", ".join(f"{k} {v}" for k, v in result.ran.items()) or "nothing (all units already done)"
    lines = [f"decon done in {seconds:.1f}s; units run: {ran}"]
    for side, (read, bad) in row_counts(output, result).items():
        lines.append(f"  {side} rows: read {read:,} = used {read - bad:,} + {BAD_ROWS} {bad:,}")
    for line in storage.read_bytes(storage.join(output, "stats", "overlap_stats.jsonl")).splitlines():
        s = json.loads(line)
        lines.append(f"  {s['eval_dataset']:24} n={s['n']:<3} {len(s['instance_ids']):>7} / "
                     f"{s['num_instances']:<7} instances overlap")
    merge = next(iter(result.runs[-1].completed_receipts().values()), None)
    if merge is not None and merge["stats"].get("steering"):  # boilerplate n-grams, and the K that ignores them
        lines += [f"  {line}" for line in steering_lines(merge["stats"]["steering"])]
    lines.append(f"  report: {storage.join(output, 'stats', 'report.html')} (and report.md)")
    warn_decon(output, result)
    return "\n".join(lines)


def warn_decon(output: str, result: JobResult) -> None:
    """The run's warnings (stderr): bad eval rows, capped details, short eval rows, mostly bad rows."""
    catalog = next(r for r in result.runs if r.name == "index").check("catalog").receipt
    catalog_stats = catalog["stats"] if catalog else {}
    if catalog_stats.get("bad_rows_warning"):
        print(f"WARNING refinery decon: {catalog_stats['bad_rows_warning']}", file=sys.stderr)
    for receipt in result.runs[-1].completed_receipts().values():
        if receipt["stats"].get("capped_warning"):
            print(f"WARNING refinery decon: {receipt['stats']['capped_warning']}", file=sys.stderr)
        for warning in ("short_warning", "ignored_only_warning"):
            if receipt["stats"].get(warning):
                print(f"WARNING refinery decon: {receipt['stats'][warning]}", file=sys.stderr)
    for line in storage.read_bytes(storage.join(output, "stats", "eval_summary.jsonl")).splitlines():
        e = json.loads(line)
        warn_if_mostly_rejected("decon", e["num_bad_rows"], e["num_rows"] + e["num_bad_rows"],
                                f"the eval rows of {e['eval_dataset']} ({BAD_ROWS})")


def build_parser() -> argparse.ArgumentParser:
    """A stand-alone parser (tests, ``python -m``): decon's options + the execution flags."""
    p = argparse.ArgumentParser(prog="refinery decon", description=(__doc__ or "").splitlines()[0])
    add_arguments(p)
    return p


if __name__ == "__main__":
    ns, beam = build_parser().parse_known_args()
    sys.exit(run(ns, beam or ["--runner=DirectRunner"]))
