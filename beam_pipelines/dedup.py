"""dedup: remove exact and near-duplicate documents, with provenance, before tokenizing.

``refinery dedup --input PATH... --output DIR [--mode exact|minhash]`` reads the rows as
``refinery prep`` reads them (its text field or template, normalization and row cap), finds
the documents whose normalized text is the same (exact) or whose word 5-gram shingle sets
are alike (minhash: a MinHash signature's bands give candidate pairs, each verified by the
Jaccard of the shingle sets), clusters them (connected components) and keeps the first row
of each cluster in input order. ``DIR/dup_list.jsonl`` names every other row (the row it
duplicates, the Jaccard, the cluster), ``DIR/clusters.jsonl`` each cluster, ``DIR/report.md``
the duplicate share of each input and the largest clusters side by side;
``refinery prep --exclude-duplicates DIR`` and ``refinery clean --exclude-duplicates DIR``
leave the listed rows out.

The job's shape: :func:`refinery.transforms.dedup.stages.build_stages` (sign -> bucket ->
[verify] -> components -> report); docs/DEDUP.md.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from functools import partial
from typing import cast

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
    replaced_inputs_problem,
    text_spec,
)
from refinery.beam_pipelines.command import Pipeline, RunFlags, add_runner_args, run_and_report, usage_error
from refinery.transforms.decon.stages import expand_as_given
from refinery.transforms.dedup.minhash import (
    DEFAULT_BANDS,
    DEFAULT_ROWS,
    DEFAULT_THRESHOLD,
    MinHashParams,
    candidate_probability,
)
from refinery.transforms.dedup.sign import MODES
from refinery.transforms.dedup.stages import (
    DEFAULT_MAX_BUCKET,
    DEFAULT_PARTITIONS,
    SUCCESS,
    DedupConfig,
    ReportStats,
    build_stages,
    clear_stale_success,
)
from refinery.transforms.formats.duplist import CLUSTERS, DUP_LIST, REPORT
from refinery.transforms.formats.failed_run import CorruptFile, clear_failed, mark_failed
from refinery.transforms.io import storage
from refinery.transforms.io.rows import DEFAULT_MAX_ROW_BYTES
from refinery.transforms.resumable import JobResult

WORKER_IMPORTS = ("refinery.transforms.dedup.stages",)  # what the warm worker process imports ahead
EPILOG = """\
examples:
  refinery dedup --input corpus/ --output dedup_out/
  refinery dedup --input corpus/ --output dedup_exact/ --mode exact
  refinery prep --input corpus/ --exclude-duplicates dedup_out/ --output shards/
  refinery prep --input corpus/ --exclude-duplicates dedup_out/ --exclude-overlaps decon_out/ --output shards/
  refinery clean --train corpus/ --exclude-duplicates dedup_out/ --output corpus_dedup/

Text: the rows are read as prep reads them: --text-field (default text) or --text-template,
normalized (CR LF as LF, controls dropped, NFC, ends stripped), rows over --max-row-bytes
unread. Give prep (or clean) the same flags: --exclude-duplicates refuses a list made with
another text spec, of inputs changed since, or edited.

Exact mode removes the rows whose normalized text an earlier row has. Minhash mode (the
default) removes those too, and the rows whose word 5-gram shingle sets have a Jaccard of at
least --threshold with a row of their cluster: a pair is a candidate when one of the
--bands bands of --rows MinHash values of both is the same, and each candidate is verified
by its true Jaccard. Clusters are the connected components of the verified pairs; a cluster
keeps its first row in input order. A band bucket of more than --max-bucket distinct texts is
skipped (counted, and named in report.md). docs/DEDUP.md draws the S-curve of the defaults.

Killing the job and running the same command again finishes it: finished units are kept
(receipts under OUTPUT/.refinery) and never redone. --force starts from scratch.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    src = parser.add_argument_group("input")
    src.add_argument("--input", nargs="+", required=True, metavar="PATH",
                     help="input files, folders (recursive) or globs; local or gs://; .jsonl .jsonl.gz .jsonl.zst "
                          ".json .parquet .arrow (any case; other files in a folder are skipped and named)")
    src.add_argument("--text-field", default=None, help="field holding the document text, as prep reads it "
                                                        "(default: text; a chat message list is flattened)")
    src.add_argument("--text-template", metavar="TEMPLATE",
                     help="build the text from several fields, as prep --text-template does; not with --text-field")
    src.add_argument("--id-field", default=None,
                     help="the id field prep reads (default: id): with the text, the parquet columns read")
    src.add_argument("--max-row-bytes", type=int, default=DEFAULT_MAX_ROW_BYTES, metavar="N",
                     help=f"a row larger than N bytes is unread, as in prep (default: {DEFAULT_MAX_ROW_BYTES})")
    src.add_argument("--verify-inputs-by-content", action="store_true",
                     help="record each input's sha256 in stats/input_files.jsonl (each is read once more), for "
                          "prep/clean --exclude-duplicates --verify-inputs-by-content")
    add_reject_rate_arg(src)
    m = parser.add_argument_group("method")
    m.add_argument("--mode", choices=MODES, default="minhash",
                   help="exact: the same normalized text; minhash (default): that, and near duplicates")
    m.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, metavar="J",
                   help=f"minhash: a verified pair's Jaccard of 5-gram shingle sets is at least J "
                        f"(default: {DEFAULT_THRESHOLD})")
    m.add_argument("--bands", type=int, default=DEFAULT_BANDS, metavar="B",
                   help=f"minhash: bands of the signature (default: {DEFAULT_BANDS})")
    m.add_argument("--rows", type=int, default=DEFAULT_ROWS, metavar="R",
                   help=f"minhash: MinHash values per band (default: {DEFAULT_ROWS}); a pair of Jaccard s is a "
                        "candidate with probability 1 - (1 - s^R)^B")
    m.add_argument("--max-bucket", type=int, default=DEFAULT_MAX_BUCKET, metavar="K",
                   help=f"minhash: a band bucket of more than K distinct texts is skipped, counted and named in "
                        f"report.md (its K*(K-1)/2 pairs are not compared; default: {DEFAULT_MAX_BUCKET})")
    o = parser.add_argument_group("output and layout")
    o.add_argument("--output", required=True, metavar="DIR", help="output folder, local or gs://")
    o.add_argument("--partitions", type=int, default=DEFAULT_PARTITIONS,
                   help=f"hash partitions of the buckets and pairs (default: {DEFAULT_PARTITIONS})")
    o.add_argument("--slice-mb", type=float, default=64.0,
                   help="input .jsonl/.parquet files larger than this are signed in slices (default: 64)")
    o.add_argument("--report-clusters", type=int, default=10, metavar="K",
                   help="report.md shows the K largest clusters side by side (default: 10)")
    add_runner_args(parser)


@dataclass(frozen=True)
class DedupSettings:
    """``refinery dedup``'s flags, read once from the command line."""

    output: str
    inputs: tuple[str, ...]
    mode: str = "minhash"
    text_field: str | None = None
    text_template: str | None = None
    id_field: str | None = None
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES
    verify_inputs_by_content: bool = False
    max_reject_rate: float | None = None
    threshold: float = DEFAULT_THRESHOLD
    bands: int = DEFAULT_BANDS
    rows: int = DEFAULT_ROWS
    max_bucket: int = DEFAULT_MAX_BUCKET
    partitions: int = DEFAULT_PARTITIONS
    slice_mb: float = 64.0
    report_clusters: int = 10
    run: RunFlags = RunFlags()


def settings_from_args(args: argparse.Namespace) -> DedupSettings:
    """The :class:`DedupSettings` of ``args`` (parsed by :func:`add_arguments`' parser)."""
    return DedupSettings(output=args.output, inputs=tuple(args.input), mode=args.mode, text_field=args.text_field,
                         text_template=args.text_template, id_field=args.id_field, max_row_bytes=args.max_row_bytes,
                         verify_inputs_by_content=args.verify_inputs_by_content,
                         max_reject_rate=args.max_reject_rate, threshold=args.threshold, bands=args.bands,
                         rows=args.rows, max_bucket=args.max_bucket, partitions=args.partitions,
                         slice_mb=args.slice_mb, report_clusters=args.report_clusters, run=RunFlags.from_args(args))


def run(args: argparse.Namespace, beam_args: list[str]) -> int:
    """Run dedup; returns a process exit code (0 ok, 1 units failed or the run's verdict, 2 bad arguments/inputs)."""
    s = settings_from_args(args)
    try:
        cfg, inputs, skipped = checked_config(s)
    except UsageError as e:
        return usage_error(str(e))
    return run_and_report(dedup_pipeline(s, cfg, inputs, skipped), s.run, beam_args)


def checked_config(s: DedupSettings) -> tuple[DedupConfig, list[storage.InputFile], list[str]]:
    """The job's :class:`DedupConfig`, its inputs and the files skipped for their extension,
    every flag and input checked first; :class:`UsageError` (one line) for the first problem."""
    if problem := bad_reject_rate(s.max_reject_rate):
        raise UsageError(f"refinery dedup: {problem}")
    text = text_spec("dedup", s.text_field, s.text_template)
    assert text is not None  # the default field "text"
    if s.mode == "exact":
        minhash_flags = (("--threshold", s.threshold, DEFAULT_THRESHOLD), ("--bands", s.bands, DEFAULT_BANDS),
                         ("--rows", s.rows, DEFAULT_ROWS), ("--max-bucket", s.max_bucket, DEFAULT_MAX_BUCKET))
        given = [flag for flag, value, default in minhash_flags if value != default]
        if given:
            raise UsageError(f"refinery dedup: {given[0]} is a minhash setting; --mode exact compares whole texts")
    skipped: list[str] = []
    try:
        check_output("dedup", s.output, list(s.inputs), dry_run=s.run.dry_run)
        inputs = expand_as_given(list(s.inputs), skipped)
        if not inputs:
            raise UsageError("refinery dedup: --input names no data files")
        check_text("dedup", text, [f.path for f in inputs])
        if s.id_field is not None:
            check_field("dedup", "--id-field", s.id_field, [f.path for f in inputs])
        if problem := replaced_inputs_problem("dedup", s.output, inputs, list(s.inputs), s.run.force):
            raise UsageError(problem)
        cfg = DedupConfig(output=s.output.rstrip("/"), mode=s.mode, text_field=text.field or "text",
                          text_template=text.template, id_field=s.id_field or "id", max_row_bytes=s.max_row_bytes,
                          params=MinHashParams(s.bands, s.rows), threshold=s.threshold, max_bucket=s.max_bucket,
                          partitions=s.partitions, slice_bytes=max(1, int(s.slice_mb * (1 << 20))),
                          report_clusters=s.report_clusters, verify_inputs_by_content=s.verify_inputs_by_content)
    except UsageError:
        raise
    except (storage.InputError, ValueError) as e:
        raise UsageError(f"refinery dedup: {e}") from None
    return cfg, inputs, skipped


def dedup_pipeline(s: DedupSettings, cfg: DedupConfig, inputs: list[storage.InputFile],
                   skipped: list[str]) -> Pipeline:
    """The job of ``refinery dedup``: its stages, header, summary and verdict."""
    how = (f"minhash: {cfg.params.bands} bands x {cfg.params.rows} rows, Jaccard >= {cfg.threshold} "
           f"(a pair of Jaccard {cfg.threshold} is a candidate with probability "
           f"{float(candidate_probability(cfg.threshold, cfg.params.bands, cfg.params.rows)):.3f})"
           if cfg.minhash else "exact: the same normalized text")
    header = (f"dedup: {len(inputs)} input file(s) -> {cfg.output} ({how})"
              + (f"\n  {storage.skipped_note(skipped)}" if skipped else ""))
    return Pipeline("dedup", cfg.output, build_stages(cfg, inputs), header, partial(dedup_summary, cfg.output),
                    verdict=partial(dedup_verdict, cfg.output, s.max_reject_rate), on_plan=clear_stale_success,
                    run_info={"inputs": named_inputs(list(s.inputs))})


def report_stats(result: JobResult) -> ReportStats:
    """The report unit's counts (its receipt's)."""
    return cast(ReportStats, result.runs[-1].check("report").done_receipt()["stats"])


def dedup_verdict(output: str, max_reject_rate: float | None, result: JobResult) -> str | None:
    """Why a finished run fails (more rows without text than ``--max-reject-rate``; a corrupt or
    cut-short input without it, as prep fails), or None. A failed run leaves ``FAILED.json``
    and no ``.SUCCESS`` (``--exclude-duplicates`` refuses it)."""
    stats = report_stats(result)
    corrupt: list[CorruptFile] = [{"path": c["path"], "reason": c["reason"]} for c in stats["corrupt_files"]]
    failure = reject_rate_failure("rows", stats["rows"], stats["rejected"], stats["documents"], max_reject_rate,
                                  "unreadable or without text: dedup counts such rows; prep rejects them")
    for c in corrupt:
        print(f"WARNING refinery dedup: {c['path']}: {c['reason']}; the rows before it were read", file=sys.stderr)
    if not failure and corrupt and max_reject_rate is None:
        failure = corrupt_files_failure(corrupt, storage.join(output, REPORT))
    if failure:
        mark_failed(output, "dedup", failure, corrupt)
        storage.remove(storage.join(output, SUCCESS), root=output)
    else:
        clear_failed(output)
    return failure


def dedup_summary(output: str, result: JobResult, seconds: float) -> str:
    """What a finished run did (stdout)."""
    stats = report_stats(result)
    ran = ", ".join(f"{k} {v} ({result.seconds.get(k, 0):.1f}s)" for k, v in result.ran.items()) \
        or "nothing (all units already done)"
    docs, removed, skipped = stats["documents"], stats["removed"], stats["skipped"]
    lines = [f"dedup done in {seconds:.1f}s; units run: {ran}",
             f"  rows read {stats['rows']:,} = documents {docs:,} + empty {stats['empty']:,} "
             f"+ without text {stats['rejected']:,}",
             f"  removed {removed:,} of {docs:,} documents ({100 * removed / max(docs, 1):.2f}%; "
             f"{stats['exact_removed']:,} exact copies) in {stats['clusters']:,} cluster(s)",
             f"  duplicate list: {storage.join(output, DUP_LIST)}",
             f"  clusters: {storage.join(output, CLUSTERS)}",
             f"  report: {storage.join(output, REPORT)}"]
    if skipped.get("buckets"):
        print(f"WARNING refinery dedup: {skipped['buckets']:,} band bucket(s) of more than --max-bucket texts were "
              f"skipped ({skipped['documents']:,} documents in them): their pairs were not compared; "
              f"{storage.join(output, REPORT)} names the largest; raise --max-bucket to compare them",
              file=sys.stderr)
    return "\n".join(lines)
