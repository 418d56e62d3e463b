"""clean: a decontaminated copy of training files, in their own format, for other tools.

``refinery clean --train PATH... --exclude-overlaps DECON_OUTPUT... --output DIR`` writes
each training file to ``DIR/<relpath>`` in its format (``.jsonl``, ``.jsonl.gz``,
``.jsonl.zst``, ``.parquet``), rows in order, without the rows (``--exclude-mode row``) or
passages (``--exclude-mode span``) that the decon runs found overlapping an eval set, and
``DIR/_clean_manifest.json``: what was left out of each file. A row decon read no text of
is left out too, listed in ``DIR/_clean_rejects.jsonl``. The drop lists are checked as
``refinery prep --exclude-overlaps`` checks them (:mod:`.exclusion_flags`), so prep of the
copy gives the documents prep with ``--exclude-overlaps`` of the original gives.

The job's shape: :func:`refinery.transforms.clean.stages.build_stages` (clean -> manifest).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from dataclasses import dataclass
from functools import partial

from refinery.beam_pipelines.checks import (
    UsageError,
    check_field,
    check_output,
    check_text,
    local_spellings,
    named_inputs,
    recorded_command,
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
from refinery.transforms.clean.stages import (
    FORMATS,
    MANIFEST,
    REJECTS,
    CleanConfig,
    build_stages,
    clear_stale_success,
    foreign_files,
    unsupported_inputs,
)
from refinery.transforms.io import storage
from refinery.transforms.io.rows import DEFAULT_MAX_ROW_BYTES
from refinery.transforms.io.text import escape
from refinery.transforms.prep.exclusion import Exclusion
from refinery.transforms.resumable import JobResult

EPILOG = """\
examples:
  refinery decon --eval evals/ --train corpus/ --output decon_out/
  refinery clean --train corpus/ --exclude-overlaps decon_out/ --output corpus_clean/
  refinery dedup --input corpus/ --output dedup_out/
  refinery clean --train corpus/ --exclude-duplicates dedup_out/ --exclude-overlaps decon_out/ --output corpus_clean/
  refinery clean --train corpus/ --exclude-overlaps decon_out/ --output corpus_clean/ \\
      --exclude-mode span --exclude-window 200 --exclude-min-chars 200
  refinery clean --train 'gs://my-bucket/crawl/*.jsonl.zst' --exclude-overlaps gs://my-bucket/decon \\
      --output gs://my-bucket/crawl-clean --runner dataflow --project my-project --region us-central1 \\
      --temp_location gs://my-bucket/tmp

Give clean the training files decon scanned, with decon's --text-field (or --text-template),
--id-field and --max-row-bytes: every check of prep --exclude-overlaps applies (the drop
list's sha256 against decon's receipt, inputs unchanged since decon scanned them, the same
text spec). Each file is written to OUTPUT/<its path under its --train argument>, in its own
format, rows in order: a kept JSON line byte for byte as it was. A row decon read no text of
(a text field that is an object, a list, null or missing; multi-part chat content) is left
out and listed with its reason in OUTPUT/_clean_rejects.jsonl; a decon output that used no
training row is refused. With --exclude-mode span a listed row is replaced by the pieces kept
of it, each a row of its own: the row's fields, its text field set to the piece and its id (if
it has one) to ID@START. OUTPUT/_clean_manifest.json says what was left out of each file, and why.
With --exclude-duplicates (refinery dedup's outputs; with or without --exclude-overlaps) the rows
its dup_list.jsonl names are left out whole, in either mode; give clean every file dedup read.

OUTPUT holds the copy and nothing else: a folder holding any other file (a raw file, a copy of
the corpus, an earlier clean run's files of other inputs), or holding an input, is refused,
naming it; an earlier clean run of the same inputs (a rerun, a killed run) is finished.

Killing the job and running the same command again finishes it: finished units are kept
(receipts under OUTPUT/.refinery) and never redone. --force starts from scratch.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    src = parser.add_argument_group("input")
    src.add_argument("--train", nargs="+", required=True, metavar="PATH",
                     help="training files, folders (recursive) or globs; local or gs://; "
                          f"{' '.join(FORMATS)} (any case); other data files are refused, naming them")
    src.add_argument("--text-field", default=None,
                     help="field holding the document text, as decon read it (default: text)")
    src.add_argument("--text-template", metavar="TEMPLATE",
                     help="the text template decon read the rows with (row mode only: a piece cannot be put back "
                          "into several fields)")
    src.add_argument("--id-field", default=None,
                     help="field holding the document id (default: id); in span mode a piece's id is ID@START "
                          "(a run where that is also a kept row's id fails, naming both rows)")
    src.add_argument("--max-row-bytes", type=int, default=DEFAULT_MAX_ROW_BYTES, metavar="N",
                     help=f"the row cap decon read with (default: {DEFAULT_MAX_ROW_BYTES})")
    add_exclusion_args(src, "the copy")
    out = parser.add_argument_group("output")
    out.add_argument("--output", required=True, metavar="DIR", help="output folder, local or gs://")
    add_runner_args(parser)


@dataclass(frozen=True)
class CleanSettings:
    """``refinery clean``'s flags, read once from the command line."""

    output: str
    train: tuple[str, ...]
    text_field: str | None = None
    text_template: str | None = None
    id_field: str | None = None
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES
    exclude: ExclusionFlags = ExclusionFlags()
    run: RunFlags = RunFlags()


def settings_from_args(args: argparse.Namespace) -> CleanSettings:
    """The :class:`CleanSettings` of ``args`` (parsed by :func:`add_arguments`' parser)."""
    return CleanSettings(output=args.output, train=tuple(args.train), text_field=args.text_field,
                         text_template=args.text_template, id_field=args.id_field, max_row_bytes=args.max_row_bytes,
                         exclude=ExclusionFlags.from_args(args), run=RunFlags.from_args(args))


def run(args: argparse.Namespace, beam_args: list[str]) -> int:
    """Run clean; returns a process exit code (0 ok, 1 units failed or the rows met are not the
    rows listed, 2 bad arguments/inputs)."""
    settings = settings_from_args(args)
    try:
        cfg, unscanned = checked_config(settings)
    except UsageError as e:
        return usage_error(str(e))
    return run_and_report(clean_pipeline(settings, cfg, unscanned), settings.run, beam_args)


def check_flags(s: CleanSettings) -> None:
    """The flags checked alone (before any file is read); :class:`UsageError`."""
    if not s.exclude.outputs and not s.exclude.duplicates:
        raise UsageError("refinery clean: give --exclude-overlaps DECON_OUTPUT... (the decon runs whose overlaps "
                         "the copy leaves out) and/or --exclude-duplicates DEDUP_OUTPUT... (the dedup runs whose "
                         "duplicates it leaves out)")
    if s.max_row_bytes < 1:
        raise UsageError("refinery clean: --max-row-bytes must be at least 1")
    if s.exclude.mode == "span" and s.text_template is not None:
        raise UsageError("refinery clean: --exclude-mode span takes --text-field, not --text-template: a piece "
                         "cut from a text made of several fields cannot be put back into them")


def checked_config(s: CleanSettings) -> tuple[CleanConfig, list[str]]:
    """The job's :class:`CleanConfig` and the inputs kept without an overlap check, every flag
    and input checked first (in the driver, before anything is written); :class:`UsageError`
    (one line) for the first problem."""
    check_flags(s)
    text = text_spec("clean", s.text_field, s.text_template)
    assert text is not None  # the default field "text"
    try:
        check_output("clean", s.output, list(s.train), dry_run=s.run.dry_run)
        inputs = storage.expand_inputs(list(s.train))
        check_inputs(inputs)
        check_output_holds_no_input(s.output, inputs)
        check_text("clean", text, [f.path for f in inputs])
        if s.id_field is not None:
            check_field("clean", "--id-field", s.id_field, [f.path for f in inputs])
        if problem := replaced_inputs_problem("clean", s.output, inputs, list(s.train), s.run.force):
            raise UsageError(problem)
        if not (s.run.dry_run and storage.is_remote(s.output)):  # a dry run reads nothing remote
            check_output_holds_only_clean(s.output, inputs)
        exclude, unscanned = load_checked_exclusion("clean", s.exclude, inputs, text, s.max_row_bytes)
    except UsageError:
        raise
    except (storage.InputError, ValueError) as e:
        raise UsageError(f"refinery clean: {e}") from None
    assert exclude is not None  # --exclude-overlaps or --exclude-duplicates is given (check_flags)
    cfg = CleanConfig(inputs=inputs, output=s.output.rstrip("/"), exclude=exclude, text_field=text.field or "text",
                      text_template=text.template, id_field=s.id_field or "id", max_row_bytes=s.max_row_bytes)
    return cfg, unscanned


def check_inputs(inputs: list[storage.InputFile]) -> None:
    """:class:`UsageError` for an input clean cannot copy in its format, or two inputs that
    would be written to the same place (the same path under two ``--train`` arguments)."""
    if not inputs:
        raise UsageError("refinery clean: --train names no data files")
    if bad := unsupported_inputs([f.path for f in inputs]):
        raise UsageError(f"refinery clean: {bad[0]}: clean writes a copy in the file's own format, and copies "
                         f"{', '.join(FORMATS)} files only" + (f" ({len(bad) - 1} more such file(s))"
                                                               if len(bad) > 1 else ""))
    twice = [r for r, k in Counter(f.relpath for f in inputs).items() if k > 1]
    if twice:
        paths = [f.path for f in inputs if f.relpath == twice[0]]
        raise UsageError(f"refinery clean: {paths[0]} and {paths[1]} would both be written to OUTPUT/{twice[0]}: "
                         "give --train arguments whose files have different paths under them")


def _inside(path: str, folders: list[str]) -> bool:
    return any(path == f or path.startswith(f.rstrip("/") + "/") for f in folders)


def check_output_holds_no_input(output: str, inputs: list[storage.InputFile]) -> None:
    """:class:`UsageError` naming the first input that lies inside ``output`` (however either
    is spelled: resolved, through every mount of its folder): clean would write beside or
    over its own inputs, and a reader of the folder would take them for the copy. (An output
    inside an input is :func:`check_output`'s.)"""
    remote = storage.is_remote(output)
    folders = [output.rstrip("/")] if remote else local_spellings(output)
    for f in inputs:
        path = f.path if remote else os.path.realpath(storage.resolved(f.path))
        if storage.is_remote(f.path) == remote and _inside(path, folders):
            raise UsageError(f"refinery clean: --output {output} holds the input {f.path}: the copy would be "
                             "written beside (or over) the files it is made of; give an output folder outside "
                             "the inputs")


def check_output_holds_only_clean(output: str, inputs: list[storage.InputFile]) -> None:
    """:class:`UsageError` naming the first files under ``output`` that are not an earlier clean
    run's of these inputs (a raw file, a copy of the corpus, another run's files): a tokenizer
    pointed at the folder would read them as part of the copy. An empty or new folder, or one
    holding an earlier clean run of the same inputs (a rerun, a killed run), is no problem."""
    if not storage.isdir(output):
        return
    earlier = recorded_command(output) == "clean"
    found, count = foreign_files(output, {f.relpath for f in inputs} if earlier else None)
    if found:
        more = f" (and {count - 1} more)" if count > 1 else ""
        none = "" if earlier else ", and the folder records no clean run"
        raise UsageError(f"refinery clean: --output {output} holds {found[0]}, which is not a file of a clean run of "
                         f"these inputs{more}{none}: a tokenizer pointed at the folder would read it as part of the "
                         "copy; give an empty or new folder, or move it out first")


def clean_pipeline(s: CleanSettings, cfg: CleanConfig, unscanned: list[str]) -> Pipeline:
    """The job of ``refinery clean``: its stages, header and summary."""
    return Pipeline("clean", cfg.output, build_stages(cfg), clean_header(cfg, cfg.exclude, unscanned),
                    partial(clean_summary, cfg.output), on_plan=clear_stale_success,
                    run_info={"inputs": named_inputs(list(s.train))})


def clean_header(cfg: CleanConfig, exclude: Exclusion, unscanned: list[str]) -> str:
    """What a run prints (stderr) before it starts: inputs, output, what is left out."""
    return (f"clean: {cfg.num_inputs} training file(s) -> {cfg.output} (each in its own format, "
            f"--exclude-mode {exclude.mode})" + exclusion_header(exclude, unscanned))


def clean_summary(output: str, result: JobResult, seconds: float) -> str:
    """What a finished run did (stdout)."""
    path = storage.join(output, MANIFEST)
    m = storage.read_json(path)
    t = m["totals"]
    ran = ", ".join(f"{k} {v} ({result.seconds.get(k, 0):.1f}s)" for k, v in result.ran.items()) \
        or "nothing (all units already done)"
    corrupt = [f for f in m["files"] if f.get("corrupt")]
    for f in corrupt:
        print(f"WARNING refinery clean: {f['train_path']}: {f['corrupt']}; decon listed the damage: the copy holds "
              "the rows before it", file=sys.stderr)
    span = (f"\n  listed rows: split {t['rows_split']:,} into {t['pieces']:,} piece(s), dropped whole "
            f"{t['rows_dropped']:,}; {t['pieces_too_short']:,} piece(s) too short dropped; "
            f"{t['chars_removed']:,} characters removed" if m["mode"] == "span" else "")
    rejected = int(t.get("rows_rejected", 0))
    rejects = storage.join(output, REJECTS)
    spec = f"--text-field {m['text_field']}" if "text_field" in m else f"--text-template '{escape(m['text_template'])}'"
    if rejected:
        warn_if_mostly_rejected("clean", rejected, int(t["rows_read"]), rejects, rejects_hint(rejects))
    return (f"clean done in {seconds:.1f}s; units run: {ran}\n"
            f"  {t['files']} file(s): rows read {t['rows_read']:,} = kept {t['rows_kept']:,} + left out "
            f"{t['rows_left_out']:,} + rejected {rejected:,}" + span
            + min_coverage_line(m.get("excluded_overlaps", {}))
            + (f"\n  {rejected:,} row(s) decon read no text of ({spec}): listed in {rejects}" if rejected else "")
            + f"\n  manifest: {path}")
