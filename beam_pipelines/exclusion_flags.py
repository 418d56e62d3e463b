"""The ``--exclude-overlaps`` and ``--exclude-duplicates`` flags, shared by ``refinery prep``
and ``refinery clean``: one parser, one settings object, one check, so that both commands
leave out the same rows and cut the same spans from the same decon and dedup outputs."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from refinery.beam_pipelines.checks import UsageError
from refinery.transforms.formats.droplist import ReadSpec
from refinery.transforms.io import storage
from refinery.transforms.io.text import TEXT_NORMALIZATION, TextSpec
from refinery.transforms.prep.exclusion import EXCLUDE_MODES, UNREAD, Exclusion, load_exclusion
from refinery.transforms.prep.span_cut import DEFAULT_MAX_SPLITS, DEFAULT_MIN_CHARS, DEFAULT_WINDOW, SpanRules


def add_exclusion_args(group: argparse._ArgumentGroup, what: str) -> None:
    """The flags, in ``group``; ``what``: what the command makes of the rows it keeps
    (``the shards``, ``the copy``)."""
    group.add_argument("--exclude-overlaps", nargs="+", default=[], metavar="DECON_OUTPUT",
                       help=f"leave out of {what} the training rows (or, with --exclude-mode span, the passages) "
                            "that these finished refinery decon outputs found overlapping an eval set (their "
                            "stats/contaminated_train_docs.jsonl); rows are matched by file and row number; every "
                            "input must be a file decon scanned, unchanged since (else the run is refused, naming "
                            "it), and the drop list must be what decon wrote (its sha256 is checked against "
                            "decon's merge receipt)")
    group.add_argument("--exclude-duplicates", nargs="+", default=[], metavar="DEDUP_OUTPUT",
                       help=f"leave out of {what} the rows these finished refinery dedup outputs list as duplicates "
                            "(their dup_list.jsonl: every row of a cluster but its first); checked as "
                            "--exclude-overlaps' lists are (the list's sha256 against dedup's report receipt, "
                            "inputs unchanged since dedup read them, the same text spec), and every file dedup read "
                            "must be an input; with --exclude-overlaps too, the rows either lists are left out "
                            "(whole, in span mode too)")
    group.add_argument("--exclude-mode", choices=EXCLUDE_MODES, default="row",
                       help="with --exclude-overlaps: row (default) leaves each listed row out whole; span cuts out "
                            "of it the passages that overlap (decon's stats/contaminated_train_spans.jsonl), each "
                            "widened by --exclude-window characters on both sides, and splits the row at the holes "
                            "into documents of their own (id ROW_ID@START, in the row's shard); pieces shorter than "
                            "--exclude-min-chars are dropped, and a row with more than --exclude-max-splits holes "
                            "is dropped whole (GPT-3's rule)")
    group.add_argument("--exclude-window", type=int, default=DEFAULT_WINDOW, metavar="W",
                       help=f"with --exclude-mode span: characters removed on each side of a passage "
                            f"(default: {DEFAULT_WINDOW})")
    group.add_argument("--exclude-min-chars", type=int, default=DEFAULT_MIN_CHARS, metavar="C",
                       help=f"with --exclude-mode span: drop a piece shorter than C characters "
                            f"(default: {DEFAULT_MIN_CHARS})")
    group.add_argument("--exclude-max-splits", type=int, default=DEFAULT_MAX_SPLITS, metavar="S",
                       help=f"with --exclude-mode span: drop a row with more than S holes whole "
                            f"(default: {DEFAULT_MAX_SPLITS})")
    group.add_argument("--allow-unscanned-inputs", action="store_true",
                       help="with --exclude-overlaps: keep input files that decon did not scan (or that changed "
                            "since, holding no listed row) without an overlap check, with a warning, instead of "
                            "refusing the run")
    group.add_argument("--verify-inputs-by-content", action="store_true",
                       help="with --exclude-overlaps: read every input in full first and refuse one whose sha256 "
                            "is not the one decon recorded (decon --verify-inputs-by-content): for corpora copied "
                            "with their sizes and mtimes kept (cp -p, rsync -t, tar), where rows may differ unseen")
    group.add_argument("--exclude-n", type=int, metavar="N",
                       help="with --exclude-overlaps: leave out rows that overlap at this n (one the decon runs "
                            "computed; default: each run's largest n)")
    group.add_argument("--exclude-min-coverage", type=float, metavar="F",
                       help="with --exclude-overlaps: leave out a listed row only for instances whose overlap "
                            "coverage at that n is at least F (0..1: the share of the instance's tokens covered by "
                            "overlapping n-grams, HELM's token metric, decon's overlap_metrics.jsonl 'coverage'); "
                            "a row that overlaps only instances under F is kept, and counted in the summary and "
                            "the manifest. For a low n, where boilerplate an instance shares with many training "
                            "rows covers little of it")


@dataclass(frozen=True)
class ExclusionFlags:
    """The ``--exclude-*`` flags, read once."""

    outputs: tuple[str, ...] = ()
    duplicates: tuple[str, ...] = ()  # --exclude-duplicates: dedup outputs
    n: int | None = None
    mode: str = "row"
    window: int = DEFAULT_WINDOW
    min_chars: int = DEFAULT_MIN_CHARS
    max_splits: int = DEFAULT_MAX_SPLITS
    allow_unscanned_inputs: bool = False
    verify_inputs_by_content: bool = False
    min_coverage: float | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ExclusionFlags:
        return cls(outputs=tuple(args.exclude_overlaps), duplicates=tuple(args.exclude_duplicates), n=args.exclude_n,
                   mode=args.exclude_mode, window=args.exclude_window, min_chars=args.exclude_min_chars,
                   max_splits=args.exclude_max_splits,
                   allow_unscanned_inputs=args.allow_unscanned_inputs,
                   verify_inputs_by_content=args.verify_inputs_by_content, min_coverage=args.exclude_min_coverage)

    def checked_min_coverage(self, command: str) -> float | None:
        """``--exclude-min-coverage``, or None; :class:`UsageError` outside 0..1 (or not a number)."""
        f = self.min_coverage
        if f is not None and not 0.0 <= f <= 1.0:  # NaN fails both
            raise UsageError(f"refinery {command}: --exclude-min-coverage {f}: a share of an instance's tokens, "
                             "from 0 to 1")
        return f

    def rules(self, command: str) -> SpanRules | None:
        """Span mode's rules (None in row mode); :class:`UsageError` for a negative one, or a span
        flag given in row mode."""
        if self.mode == "row":
            given = [f"--exclude-{k.replace('_', '-')}" for k, default in
                     (("window", DEFAULT_WINDOW), ("min_chars", DEFAULT_MIN_CHARS), ("max_splits", DEFAULT_MAX_SPLITS))
                     if getattr(self, k) != default]
            if given:
                raise UsageError(f"refinery {command}: {given[0]} needs --exclude-mode span")
            return None
        try:
            return SpanRules(self.window, self.min_chars, self.max_splits)
        except ValueError as e:
            raise UsageError(f"refinery {command}: {e}") from None


def load_checked_exclusion(command: str, flags: ExclusionFlags, inputs: list[storage.InputFile], text: TextSpec,
                           max_row_bytes: int) -> tuple[Exclusion | None, list[str]]:
    """The rows (and, in span mode, spans) to leave out of ``inputs``, every check made
    (:func:`load_exclusion`, :meth:`Exclusion.check_inputs`), and the inputs kept without an
    overlap check; (None, []) without ``--exclude-overlaps`` or ``--exclude-duplicates``.
    :class:`UsageError` for a flag that needs one of them; :class:`storage.InputError` for a
    refused input."""
    if not flags.outputs:
        needs = [flag for flag, on in (("--exclude-n", flags.n is not None),
                                       ("--exclude-mode span", flags.mode != "row"),
                                       ("--exclude-min-coverage", flags.min_coverage is not None)) if on]
        if needs:
            raise UsageError(f"refinery {command}: {needs[0]} needs --exclude-overlaps DECON_OUTPUT")
    if not flags.outputs and not flags.duplicates:
        needs = [flag for flag, on in (("--allow-unscanned-inputs", flags.allow_unscanned_inputs),
                                       ("--verify-inputs-by-content", flags.verify_inputs_by_content)) if on]
        if needs:
            raise UsageError(f"refinery {command}: {needs[0]} needs --exclude-overlaps DECON_OUTPUT or "
                             "--exclude-duplicates DEDUP_OUTPUT")
        flags.rules(command)
        return None, []
    read_spec = ReadSpec(text.identity(), TEXT_NORMALIZATION, max_row_bytes)
    exclude = load_exclusion(list(flags.outputs), flags.n, read_spec=read_spec, rules=flags.rules(command),
                             duplicates=list(flags.duplicates), min_coverage=flags.checked_min_coverage(command))
    unscanned = exclude.check_inputs(inputs, allow_unscanned=flags.allow_unscanned_inputs,
                                     by_content=flags.verify_inputs_by_content)
    return exclude, unscanned


def exclusion_header(exclude: Exclusion | None, unscanned: list[str]) -> str:
    """The lines a run prints before it starts about what it leaves out (each starts with a
    newline and two spaces), and the inputs kept without an overlap check."""
    if exclude is None:
        return ""
    how = ("excluding" if exclude.rules is None else
           f"cutting the overlapping passages (\u00b1{exclude.rules.window} characters) out of")
    return ("".join(f"\n  excluding the rows that {s.output} listed as duplicates: its list is {s.sha256}"
                    if s.kind == "dedup" and s.sha256 == UNREAD else
                    f"\n  excluding {s.listed:,} row(s) that {s.output} listed as duplicates (whole)"
                    if s.kind == "dedup" else
                    f"\n  {how} the training rows that {s.output} found overlapping: its drop list is {s.sha256}"
                    if s.sha256 == UNREAD else
                    f"\n  {how} {s.listed:,} training row(s) that {s.output} found overlapping at n={s.n}"
                    + (f" (matched under --match-fold {s.match_fold})" if s.match_fold else "")
                    + (f", for instances with at least {s.min_coverage:g} of their tokens overlapping "
                       f"(--exclude-min-coverage; {s.below:,} more listed row(s) kept)"
                       if s.min_coverage is not None else "")
                    + (f", and {'excluding ' if exclude.rules else ''}{s.unread:,} it could not read"
                       if s.unread else "")
                    for s in exclude.sources)
            + (f"\n  WARNING: {len(unscanned)} input file(s) not scanned by decon are kept WITHOUT an overlap "
               f"check (--allow-unscanned-inputs): {', '.join(unscanned[:3])}{' ...' if len(unscanned) > 3 else ''}"
               if unscanned else ""))


def min_coverage_line(excluded: dict[str, Any]) -> str:
    """The summary's line on the listed rows kept by ``--exclude-min-coverage`` (a manifest's
    ``excluded_overlaps``: each decon run's count), starting with a newline; "" without it."""
    runs = [r for r in excluded.get("decon_runs", []) if "min_coverage" in r]
    if not runs:
        return ""
    kept = sum(int(r["kept_below_min_coverage"]) for r in runs)
    return (f"\n  kept {kept:,} listed row(s): every instance they overlap at n has under "
            + " / ".join(f"{r['min_coverage']:g}" for r in runs)
            + " of its tokens overlapping (--exclude-min-coverage; from "
            + ", ".join(f"{r['path']} at n={r['n']}: {int(r['kept_below_min_coverage']):,}" for r in runs) + ")")
