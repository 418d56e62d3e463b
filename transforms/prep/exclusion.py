"""Training rows that prep leaves out: the drop lists of finished decon runs.

``refinery decon`` writes, beside its reports, ``stats/contaminated_train_docs.jsonl`` (one
line per training row with an overlap: ``train_path``, ``train_row``, ``train_doc_id`` and
the ``ns`` it overlaps at), ``stats/unread_train_rows.jsonl`` (the training rows it could
not read: too large, not JSON) and ``stats/train_files.jsonl`` (every training file it
scanned: as given, resolved, size, version, how it read the text and, with
``--verify-inputs-by-content``, its sha256). ``refinery prep --exclude-overlaps
DECON_OUTPUT [--exclude-n N]`` reads them (:func:`load_exclusion`, a line at a time: its
memory grows with the rows listed, not the drop list's size) and drops the rows that
overlap at n (default: the decon run's largest n), and every row decon could not read,
from the shards; rows are matched by resolved file path and row number, the numbering both
commands' row reader gives.

Nothing leaks in silence (:meth:`Exclusion.check_inputs`, :func:`load_exclusion`):

- the files read are the files decon wrote: their sha256 must be what decon's merge receipt
  records (an edited drop list is refused);
- decon read the training text as this prep does: the same text field or template,
  normalization version and row cap (:func:`~refinery.transforms.formats.droplist.read_spec_mismatch`;
  a decon output that does not record them, from an older decon, is refused: its text was
  not this prep's), and it records a match fold this refinery knows (decon alone folds; the
  manifest's ``decon_runs`` say which fold each run matched under);
- the decon run read some training row's text (:func:`read_nothing_problem`): rows without
  text (a text field that is an object, a list, null, missing) are counted by decon, not
  listed, so a run that read none of them proves nothing (``refinery clean`` leaves such rows
  out; prep rejects them);
- with ``--verify-inputs-by-content``, every input's sha256 must be the one decon recorded
  (a corpus copied with its sizes and mtimes kept, rows swapped, is refused);
- every prep input must be a file each decon run scanned, unchanged since (same resolved path,
  size and version): a renamed file, another copy of the corpus or a file changed since decon
  is refused, naming the first few (``--allow-unscanned-inputs`` keeps unscanned files that
  hold no listed row, loudly, without an overlap check);
- every listed row must lie in a file prep reads, and each must be met while reading
  (:meth:`Exclusion.expected`: the manifest stage compares it with the rows excluded).

The drop lists' sha256 and n enter the tokenize stage's hash: another decon output, or
another n, re-plans; the same ones resume.

``--exclude-min-coverage F`` (:attr:`DropSource.min_coverage`): a row listed at n is left out
only when one of the instances it overlaps there has at least F of its tokens overlapping
(HELM's token coverage, the largest of which each drop-list line names per n: drop list 4;
an older decon output is refused); the others are kept and counted (:attr:`DropSource.below`,
in the manifest and the summary). F enters the hash as the rules do.

Span mode (``--exclude-mode span``, :attr:`Exclusion.rules` set): each decon output's
``stats/contaminated_train_spans.jsonl`` is read too, checked the same way (its sha256 against
decon's merge receipt) and against the drop list (exactly its rows at n); a worker reads the
spans of its files (:meth:`Exclusion.spans_of`), and :mod:`.span_cut` says what is kept of a
listed row. The spans file's sha256 and the rules enter the hash too (row mode's is as before).

Duplicate lists (``--exclude-duplicates DEDUP_OUTPUT``): a finished ``refinery dedup``
output's ``dup_list.jsonl`` is read as a drop list (its ``train_path`` and ``train_row``),
its ``stats/input_files.jsonl`` as the files scanned, with every check above (sha256 against
dedup's report receipt, the same text spec, inputs unchanged, nothing read), and one more:
every file the dedup run read must be an input (a removed row's kept copy may be in any of
them). Its rows are left out whole in either mode (span mode cuts only decon's rows). A run
may give both flags: the rows left out are the union (:class:`ListKind` says which producer
each source is).
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TypeVar

import numpy as np

from refinery.transforms.formats.droplist import (
    CONTAMINATED_DOCS,
    CONTAMINATED_SPANS,
    OVERLAP_STATS,
    TRAIN_FILES,
    UNREAD_ROWS,
    HashedLines,
    ReadSpec,
    drop_rows,
    drop_spans,
    file_sha256,
    match_fold_problem,
    read_jsonl,
    read_spec_mismatch,
)
from refinery.transforms.formats.duplist import DUP_LIST, INPUT_FILES, LAST_STAGE
from refinery.transforms.formats.failed_run import failed_line, read_failed
from refinery.transforms.io import storage
from refinery.transforms.prep.span_cut import SpanRules
from refinery.transforms.resumable.ledger import META_DIR, Receipt, check_receipt

EXCLUDE_MODES = ("row", "span")

UNREAD = "not read (a dry run reads nothing remote)"  # a remote drop list's sha256 during a dry run
SHOWN = 3  # paths named in a refusal


@dataclass(frozen=True)
class ListKind:
    """The producer of a list of rows to leave out: its command, the flag that names its
    outputs, its last stage (whose receipt records the sha256 of the files read), its list
    and its record of the files it scanned."""

    command: str
    flag: str
    last_stage: str
    rows_file: str
    files_file: str
    what: str  # what its list knows of a row: "overlaps", "duplicates"
    rows: str  # the rows it lists


DECON = ListKind("decon", "--exclude-overlaps", "merge", CONTAMINATED_DOCS, TRAIN_FILES, "overlaps",
                 "contaminated rows")
DEDUP = ListKind("dedup", "--exclude-duplicates", LAST_STAGE, DUP_LIST, INPUT_FILES, "duplicates", "duplicate rows")
KINDS = {k.command: k for k in (DECON, DEDUP)}


@dataclass(frozen=True)
class DropSource:
    """One decon output a prep run excludes the overlaps of."""

    output: str   # resolved
    n: int
    sha256: str   # of its contaminated_train_docs.jsonl
    listed: int   # training rows its drop list holds at n
    files_sha256: str = ""  # of its train_files.jsonl (which resolves the drop list's paths)
    unread_sha256: str = ""  # of its unread_train_rows.jsonl (rows decon could not read: left out at any n)
    unread: int = 0          # training rows it could not read
    spans_sha256: str = ""   # span mode: of its contaminated_train_spans.jsonl
    match_fold: str = ""     # the match fold decon compared n-grams under (its train_files.jsonl)
    kind: str = "decon"      # its producer (KINDS): a dedup output's list is dup_list.jsonl, its rows dropped whole
    min_coverage: float | None = None  # --exclude-min-coverage: rows whose instances' coverage is under it are kept
    below: int = 0           # with it: rows listed at n that are kept, their instances' coverage under it

    @property
    def producer(self) -> ListKind:
        return KINDS[self.kind]


def _checked(path: str, sha256: str) -> bytes:
    """The bytes of ``path``, if they are still those whose sha256 the plan recorded."""
    data = storage.read_bytes(path)
    if hashlib.sha256(data).hexdigest() != sha256:
        raise storage.InputError(f"{path}: changed since this job was planned (sha256 {sha256[:16]}... then); run "
                                 "the same command again to plan with it")
    return data


EDITED = ("edited after decon wrote it (its merge receipt)",
          "a changed drop list may keep contaminated rows: run the same decon command with --verify-checksums to "
          "write it again")
PLANNED = ("changed since this job was planned", "run the same command again to plan with it")


_T = TypeVar("_T")


def _streamed(read: Callable[[HashedLines], _T], path: str, sha256: str, why: tuple[str, str]) -> _T:
    """``read`` of ``path``'s lines, read a line at a time and refused (at their end, before
    anything read is used: ``why`` says how) unless their sha256 is ``sha256``; a line that is
    not an entry, in a file that is not the one recorded, is refused as changed."""
    try:
        return read(HashedLines(path, sha256, *why))
    except storage.InputError:
        got = file_sha256(path)
        if got != sha256:
            raise storage.InputError(f"{path}: {why[0]} (sha256 {got[:16]}..., recorded {sha256[:16]}...); "
                                     f"{why[1]}") from None
        raise


def _streamed_rows(path: str, sha256: str, files: list[dict[str, Any]], n: int | None,
                   why: tuple[str, str], min_coverage: float | None = None,
                   below: dict[str, set[int]] | None = None) -> dict[str, set[int]]:
    """:func:`drop_rows` of ``path``, read as :func:`_streamed` says."""
    return _streamed(lambda lines: drop_rows(path, lines, files, n, min_coverage, below), path, sha256, why)


@functools.lru_cache(maxsize=4)
def _source_rows(source: DropSource) -> dict[str, frozenset[int]]:
    """A decon output's rows to leave out (those listed at its n and those it could not read),
    read in a worker (once per process) from the files the driver checked: the same bytes
    (sha256), or an error."""
    kind = source.producer
    files = read_jsonl(kind.files_file, _checked(storage.join(source.output, kind.files_file), source.files_sha256))
    n = source.n if kind is DECON else None
    rows = _streamed_rows(storage.join(source.output, kind.rows_file), source.sha256, files, n, PLANNED,
                          source.min_coverage)
    if source.unread_sha256:
        unread = _streamed_rows(storage.join(source.output, UNREAD_ROWS), source.unread_sha256, files, None, PLANNED)
        for p, r in unread.items():
            rows.setdefault(p, set()).update(r)
    return {p: frozenset(r) for p, r in rows.items()}


@functools.lru_cache(maxsize=4)
def _source_spans(source: DropSource) -> dict[str, dict[int, np.ndarray]]:
    """Span mode: a decon output's spans at its n, read in a worker (once per process) from
    the file the driver checked: the same bytes (sha256), or an error."""
    files = read_jsonl(TRAIN_FILES, _checked(storage.join(source.output, TRAIN_FILES), source.files_sha256))
    path = storage.join(source.output, CONTAMINATED_SPANS)
    spans = _streamed_spans(path, source.spans_sha256, files, source.n, PLANNED)
    return spans if source.min_coverage is None else _spans_of_rows(spans, _source_rows(source))


def _streamed_spans(path: str, sha256: str, files: list[dict[str, Any]], n: int,
                    why: tuple[str, str]) -> dict[str, dict[int, np.ndarray]]:
    """:func:`drop_spans` of ``path``, read as :func:`_streamed` says."""
    return _streamed(lambda lines: drop_spans(path, lines, files, n), path, sha256, why)


@dataclass
class Exclusion:
    """The training rows to leave out, by resolved file path, and where they come from."""

    sources: list[DropSource]
    rows: dict[str, frozenset[int]] | None = field(default_factory=dict)  # None in a worker: read when asked
    # per decon output (as given): resolved path -> (size, version) of every training file it scanned
    scanned: dict[str, dict[str, tuple[int, str]]] = field(default_factory=dict)
    # per decon output (as given): resolved path -> the sha256 decon recorded ("" if none)
    contents: dict[str, dict[str, str]] = field(default_factory=dict)
    unscanned: int = 0  # inputs kept without an overlap check (--allow-unscanned-inputs)
    expected: int | None = None  # listed rows in the inputs: what a full run excludes (set by check_inputs)
    rules: SpanRules | None = None  # span mode (--exclude-mode span): cut the spans out; None: drop rows
    spans: dict[str, dict[int, np.ndarray]] | None = field(default_factory=dict)  # span mode; None: read when asked
    # the rows of the dedup lists (dropped whole in span mode too); None: read when asked
    whole: dict[str, frozenset[int]] | None = field(default_factory=dict)
    # per output (as given): the command that wrote it (KINDS), for what a refusal says
    commands: dict[str, str] = field(default_factory=dict)

    @property
    def mode(self) -> str:
        """``row`` (listed rows are left out) or ``span`` (their overlapping spans are cut out)."""
        return "row" if self.rules is None else "span"

    def identity(self) -> list[dict[str, Any]]:
        """What enters the tokenize stage's hash: each drop list's content and n (not its path);
        in span mode also its spans file's content and the rules (row mode's hash is as before)."""
        rules = self.rules
        return [{"sha256": s.sha256, "n": s.n, **({"unread_sha256": s.unread_sha256} if s.unread else {}),
                 **({"mode": "span", "spans_sha256": s.spans_sha256, **rules.identity()} if rules else {}),
                 **({"min_coverage": s.min_coverage} if s.min_coverage is not None else {})}
                if s.kind == "decon" else {"kind": s.kind, "sha256": s.sha256} for s in self.sources]

    def __getstate__(self) -> dict[str, Any]:
        """What a job carries: where the drop lists are and their sha256, not their rows nor what
        decon scanned; a worker reads the rows (:meth:`rows_of`) and spans (:meth:`spans_of`),
        so the job does not grow with them."""
        return {**self.__dict__, "rows": None, "spans": None, "whole": None, "scanned": {}, "contents": {}}

    def spans_of(self, path: str) -> dict[int, np.ndarray]:
        """Span mode: the overlapping spans of each listed row of the input file ``path`` that
        has them (a row decon could not read has none: it is dropped whole)."""
        if self.spans is None:  # in a worker: from the decon outputs, checked against the plan's sha256
            spans: dict[str, dict[int, np.ndarray]] = {}
            for source in self.sources:
                if source.kind == "decon":
                    for p, rows in _source_spans(source).items():
                        _add_spans(spans.setdefault(p, {}), rows)
            self.spans = spans
        key = storage.resolved(path)
        found, whole = self.spans.get(key, {}), self._whole().get(key)
        return {r: s for r, s in found.items() if r not in whole} if whole else found

    def _whole(self) -> dict[str, frozenset[int]]:
        """The rows of the dedup lists by resolved path (read first in a worker): left out whole."""
        if self.whole is None:
            rows: dict[str, set[int]] = {}
            for source in self.sources:
                if source.kind != "decon":
                    for p, r in _source_rows(source).items():
                        rows.setdefault(p, set()).update(r)
            self.whole = {p: frozenset(r) for p, r in rows.items()}
        return self.whole

    def rows_of(self, path: str) -> frozenset[int]:
        """The rows of the input file ``path`` to leave out."""
        return self._all_rows().get(storage.resolved(path), frozenset())

    def _all_rows(self) -> dict[str, frozenset[int]]:
        """Every listed row by resolved path (read first in a worker)."""
        if self.rows is None:  # in a worker: from the decon outputs, checked against the plan's sha256
            rows: dict[str, set[int]] = {}
            for source in self.sources:
                for p, r in _source_rows(source).items():
                    rows.setdefault(p, set()).update(r)
            self.rows = {p: frozenset(r) for p, r in rows.items()}
        return self.rows

    def check_inputs(self, inputs: list[storage.InputFile], allow_unscanned: bool = False,
                     by_content: bool = False) -> list[str]:
        """Refuse (:class:`storage.InputError`, one line naming the first few) prep inputs that a
        decon run did not scan as they are now, and listed rows in files prep does not read.

        - An input with listed rows that changed since decon scanned it is always refused: its
          rows are matched by number, so they would name other documents.
        - An input a decon run did not scan (another path, a copy, a rename), or scanned at
          another size or version, is refused unless ``allow_unscanned``; then it is kept
          without an overlap check and returned (the caller says so loudly).
        - A listed row in a file that is not among the inputs is refused: its document may be
          in the inputs under another name.
        - ``by_content`` (``--verify-inputs-by-content``): each input a decon run scanned must
          have the sha256 it recorded (read here, in full); one it did not record is refused
          (rerun decon with the flag). Without it, a file whose rows were swapped but whose
          size and mtime were kept (``cp -p``, ``rsync -t``) passes: the documented limit.

        Sets :attr:`expected` (the listed rows of the inputs) and :attr:`unscanned`."""
        listed = self._all_rows()
        keys = {storage.resolved(f.path): f for f in inputs}
        unscanned = self._unscanned(keys, listed)
        if unscanned and not allow_unscanned:
            shown = "; ".join(f"{p}: {why}" for p, (_, why) in list(unscanned.items())[:SHOWN])
            more = f" (and {len(unscanned) - SHOWN} more)" if len(unscanned) > SHOWN else ""
            kind = KINDS[next(iter(unscanned.values()))[0]]
            did = "scanned" if kind is DECON else "read"
            raise storage.InputError(
                f"{len(unscanned)} input file(s) are not what {kind.command} {did}, so their {kind.what} are "
                f"unknown: {shown}{more}; give prep the files {kind.command} {did} (its {kind.files_file}), run "
                f"{kind.command} on these inputs, or pass --allow-unscanned-inputs to keep them without "
                f"{'an overlap' if kind is DECON else 'a duplicate'} check")
        self._check_dedup_inputs(keys)
        elsewhere = {path: len(rows) for path, rows in listed.items() if path not in keys}
        if elsewhere:
            n = sum(elsewhere.values())
            shown = ", ".join(list(elsewhere)[:SHOWN]) + (f" (and {len(elsewhere) - SHOWN} more)"
                                                          if len(elsewhere) > SHOWN else "")
            raise storage.InputError(
                f"the drop list names {n:,} contaminated row(s) in {len(elsewhere)} file(s) this prep does not "
                f"read: {shown}; they would match no input (a renamed file or another copy would keep them): "
                "give prep every training file decon scanned, as decon read it")
        if by_content:
            self._check_contents(keys, set(unscanned))
        self.unscanned = len(unscanned)
        self.expected = sum(len(self.rows_of(f.path)) for f in inputs)
        return list(unscanned)

    def _unscanned(self, keys: dict[str, storage.InputFile],
                   listed: dict[str, frozenset[int]]) -> dict[str, tuple[str, str]]:
        """The inputs a run did not scan as they are now: path -> (its command, why);
        :class:`storage.InputError` for one with listed rows that changed since."""
        unscanned: dict[str, tuple[str, str]] = {}
        for output, files in self.scanned.items():
            command = self.commands.get(output, "decon")
            for key, f in keys.items():
                then = files.get(key)
                if then is None:
                    unscanned.setdefault(f.path, (command, f"not {'scanned' if command == 'decon' else 'read'} "
                                                           f"by the {command} run {output}"))
                    continue
                size, version = then
                same = f.size == size if storage.is_remote(f.path) else (f.size, f.version) == (size, version)
                if same:
                    continue
                change = (f"changed since the {command} run {output} {'scanned' if command == 'decon' else 'read'} "
                          f"it (size {size:,}, now {f.size:,}; version {version}, now {f.version})")
                if key in listed:
                    raise storage.InputError(f"{f.path}: {change}; its listed rows may now name other documents: "
                                             f"run {command} again, then prep")
                unscanned.setdefault(f.path, (command, change))
        return unscanned

    def _check_dedup_inputs(self, keys: dict[str, storage.InputFile]) -> None:
        """Every file a dedup run read is an input: a row its list removes is kept only as the
        copy its cluster kept, which may lie in any of them."""
        for output, files in self.scanned.items():
            if self.commands.get(output, "decon") == "decon":
                continue
            missing = sorted(set(files) - set(keys))
            if missing:
                more = f" (and {len(missing) - SHOWN} more)" if len(missing) > SHOWN else ""
                raise storage.InputError(
                    f"--exclude-duplicates {output}: the dedup run read {len(missing)} file(s) this run does not: "
                    f"{', '.join(missing[:SHOWN])}{more}; a row its list removes is kept only as its cluster's first "
                    "row, which may be in one of them: give every file dedup read (its "
                    f"{INPUT_FILES}), or run dedup on these inputs")

    def _check_contents(self, keys: dict[str, storage.InputFile], unscanned: set[str]) -> None:
        """Each input a decon (or dedup) run scanned read in full: its sha256 must be the one recorded."""
        for output, recorded in self.contents.items():
            command = self.commands.get(output, "decon")
            for key, f in keys.items():
                if f.path in unscanned or key not in recorded:
                    continue
                want = recorded[key]
                if not want:
                    raise storage.InputError(
                        f"--verify-inputs-by-content: the {command} run {output} recorded no sha256 of {f.path}: "
                        f"run that {command} command again with --verify-inputs-by-content")
                got = file_sha256(f.path)
                if got != want:
                    raise storage.InputError(
                        f"{f.path}: its content is not what the {command} run {output} scanned (sha256 "
                        f"{got[:16]}..., {command} recorded {want[:16]}...; same size and version): its rows may "
                        f"now be other documents: run {command} again, then prep")

    def manifest(self, excluded: int, cut: dict[str, int] | None = None) -> dict[str, Any]:
        """The manifest's ``excluded_overlaps``: how many rows were left out (span mode: listed
        rows met, and ``cut``: what was done with them), and from which runs (each run's
        ``unread``: the rows it could not read, left out whatever their overlap); with
        ``--exclude-duplicates``, ``dedup_runs`` too (``documents`` counts every row left out,
        listed by either)."""
        span = {"mode": "span", **self.rules.identity(), **(cut or {})} if self.rules is not None else {}
        dedup = [{"path": s.output, "dup_list_sha256": s.sha256, "listed": s.listed}
                 for s in self.sources if s.kind == "dedup"]
        return {"documents": excluded, **span,
                "decon_runs": [{"path": s.output, "contaminated_train_docs_sha256": s.sha256, "n": s.n,
                                "listed": s.listed, **({"unread": s.unread} if s.unread else {}),
                                **({"match_fold": s.match_fold} if s.match_fold else {}),
                                **({"min_coverage": s.min_coverage, "kept_below_min_coverage": s.below}
                                   if s.min_coverage is not None else {})}
                               for s in self.sources if s.kind == "decon"],
                **({"dedup_runs": dedup} if dedup else {}),
                **({"unscanned_inputs": self.unscanned} if self.unscanned else {})}


def merge_receipt(output: str, kind: ListKind = DECON) -> Receipt:
    """The receipt of a finished decon output's merge unit (a dedup output's report unit: the
    last stage of ``OUTPUT/.refinery/run.json``), checked; :class:`storage.InputError` when
    there is no such record or the stage is not complete."""
    run_json = storage.join(output, META_DIR, "run.json")
    flag, command, last = kind.flag, kind.command, kind.last_stage
    try:
        stages = storage.read_json(run_json).get("stages") or [{}]
    except FileNotFoundError:
        raise storage.InputError(f"{flag} {output}: no run record ({run_json}); a drop list is trusted only beside "
                                 f"the receipts of the {command} run that wrote it: run the same {command} command "
                                 "again") from None
    except (ValueError, AttributeError) as e:
        raise storage.InputError(f"{flag} {output}: unreadable run record {run_json} ({e})") from None
    merge = stages[-1]
    if merge.get("name") != last or "stage_hash" not in merge:
        raise storage.InputError(f"{flag} {output}: not a refinery {command} output (its run record ends with stage "
                                 f"{merge.get('name')!r}, not {last})")
    receipt = storage.join(output, META_DIR, last, merge["stage_hash"], "receipts", f"{last}.json")
    done = check_receipt(output, receipt, merge["stage_hash"])
    if done.damaged:
        raise storage.InputError(f"{flag} {output}: {done.reason}: edited after {command} wrote it; a changed drop "
                                 f"list may keep {kind.rows}: run the same {command} command with "
                                 "--verify-checksums to write it again")
    if not done.done:
        raise storage.InputError(f"{flag} {output}: its {command} {last} is not complete ({done.reason}); run the "
                                 f"same {command} command again")
    return done.done_receipt()


def read_nothing_problem(output: str, receipt: Receipt, kind: ListKind = DECON) -> str | None:
    """Why the output whose last receipt is ``receipt`` is no proof (one line): it read no
    training row's text (none read, or every row unreadable or without text with its text
    spec: such rows are counted, not listed, so its list says nothing of them); or None."""
    if kind is DECON:
        scan = receipt["stats"].get("scan") or {}
        read, bad = int(scan.get("rows", 0)), int(scan.get("bad_rows", 0))
    else:
        read = int(receipt["stats"].get("rows", 0))
        bad = read - int(receipt["stats"].get("documents", 0))
    if read > bad:
        return None
    return (f"{kind.flag} {output}: {kind.command} used 0 of the {read:,} training row(s) it read ({bad:,} "
            f"unreadable, empty or without text: {kind.command} counts such rows, it does not list them), so its "
            f"list says nothing of them: run {kind.command} with the --text-field (or --text-template) that reads "
            "their text")


def _recorded_file(output: str, relpath: str, recorded: dict[str, str], kind: ListKind = DECON) -> tuple[str, str]:
    """(path, the sha256 the run's last receipt records) of ``output/relpath``;
    :class:`storage.InputError` when it is missing or not recorded."""
    path = storage.join(output, relpath)
    if not storage.exists(path):
        raise storage.InputError(f"{kind.flag} {output}: no {relpath} (written by a refinery {kind.command} older "
                                 f"than {kind.flag}?); run the same {kind.command} command again")
    want = recorded.get(relpath)
    if want is None:
        raise storage.InputError(f"{kind.flag} {output}: {kind.command}'s {kind.last_stage} receipt does not list "
                                 f"{relpath}; run the same {kind.command} command again")
    return path, want


def _read_recorded(output: str, relpath: str, recorded: dict[str, str], kind: ListKind = DECON) -> bytes:
    """The bytes of ``output/relpath`` (a small file), refused (:class:`storage.InputError`)
    unless their sha256 is what the run's last receipt recorded."""
    path, want = _recorded_file(output, relpath, recorded, kind)
    data = storage.read_bytes(path)
    got = hashlib.sha256(data).hexdigest()
    if got != want:
        raise storage.InputError(f"{path}: edited after {kind.command} wrote it (sha256 {got[:16]}..., its "
                                 f"{kind.last_stage} receipt records {want[:16]}...); a changed drop list may keep "
                                 f"{kind.rows}: run the same {kind.command} command with --verify-checksums to "
                                 "write it again")
    return data


def check_read_spec(output: str, files: list[dict[str, Any]], read_spec: ReadSpec, kind: ListKind = DECON) -> None:
    """Refuse (:class:`storage.InputError`, one line naming both sides) an output that read the
    training text otherwise than ``read_spec`` (this prep's), or that does not record how it
    read it (an older decon: its text was not this prep's, so its drop list is not proof)."""
    for f in files:
        theirs = ReadSpec.of(f)
        if theirs is None:
            raise storage.InputError(
                f"{kind.flag} {output}: its {kind.files_file} does not record how {kind.command} read the training "
                f"text (text field or template, normalization, row cap): written by an older refinery "
                f"{kind.command}, whose text may not be the text this prep trains on; run the same {kind.command} "
                "command again")
        if problem := read_spec_mismatch(theirs, read_spec, kind.command,
                                         "--train-text-" if kind is DECON else "--text-"):
            raise storage.InputError(f"{kind.flag} {output}: {problem}")
    if kind is DECON and (problem := match_fold_problem(files)):
        raise storage.InputError(f"{kind.flag} {output}: {problem}")


def _spans_of_rows(spans: dict[str, dict[int, np.ndarray]],
                   rows: dict[str, frozenset[int]] | dict[str, set[int]]) -> dict[str, dict[int, np.ndarray]]:
    """``spans`` of the rows in ``rows`` only (``--exclude-min-coverage``: a row kept keeps its text)."""
    return {p: kept for p, by_row in spans.items()
            if (kept := {r: v for r, v in by_row.items() if r in rows.get(p, ())})}


def drop_list_version(output: str) -> int:
    """The drop-list version a finished decon output's merge wrote (its run record's merge
    config, ``drop_list``: :data:`~refinery.transforms.decon.ngrams.droplist.DROP_LIST_VERSION`
    when it was written; 0 when it records none)."""
    stages = storage.read_json(storage.join(output, META_DIR, "run.json")).get("stages") or [{}]
    return int((stages[-1].get("config") or {}).get("drop_list", 0))


MIN_COVERAGE_DROP_LIST = 4  # the first drop list whose lines name their instances' coverage


def _union(a: dict[str, set[int]], b: dict[str, set[int]]) -> dict[str, set[int]]:
    """The rows of ``a`` and ``b``, by path."""
    return {p: a.get(p, set()) | b.get(p, set()) for p in set(a) | set(b)}


def _add_spans(into: dict[int, np.ndarray], rows: dict[int, np.ndarray]) -> None:
    """``rows``' spans added to ``into`` (a row two decon runs list: both runs' spans)."""
    for row, spans in rows.items():
        into[row] = spans if row not in into else np.concatenate([into[row], spans])


def _check_spans_match(output: str, rows: dict[str, set[int]], spans: dict[str, dict[int, np.ndarray]],
                       n: int) -> None:
    """Refuse a spans file whose rows at ``n`` are not the drop list's."""
    for path in sorted(set(rows) | set(spans)):
        listed, spanned = rows.get(path, set()), set(spans.get(path, {}))
        if listed != spanned:
            odd = sorted(listed ^ spanned)[:SHOWN]
            raise storage.InputError(f"--exclude-overlaps {output}: its {CONTAMINATED_SPANS} and {CONTAMINATED_DOCS} "
                                     f"disagree at n={n} on {path} (rows {odd}): run the same decon command again")


def _finished_record(output: str, kind: ListKind) -> dict[str, str]:
    """The sha256 of each file the finished ``output`` of ``kind`` (``.SUCCESS``, no
    ``FAILED.json``, its last receipt complete, some row's text read) records, by relative path."""
    if (failed := read_failed(output)) is not None:  # a run that exited 1: its list is not one to trust
        raise storage.InputError(f"{kind.flag} {failed_line(output, failed)}")
    if not storage.exists(storage.join(output, ".SUCCESS")):
        raise storage.InputError(f"{kind.flag} {output}: not a finished {kind.command} output (no .SUCCESS); "
                                 f"run refinery {kind.command} to the end first")
    receipt = merge_receipt(output, kind)
    if problem := read_nothing_problem(output, receipt, kind):
        raise storage.InputError(problem)
    return {f["path"]: f["sha256"] for f in receipt["files"]}


def _load_duplicates(output: str, read_spec: ReadSpec) -> tuple[DropSource, dict[str, set[int]],
                                                                 list[dict[str, Any]]]:
    """A finished dedup output's source, its listed rows by resolved path, and the files it
    read (its :data:`INPUT_FILES` rows), every file checked as a decon output's are."""
    recorded = _finished_record(output, DEDUP)
    files_data = _read_recorded(output, INPUT_FILES, recorded, DEDUP)
    try:
        files = read_jsonl(INPUT_FILES, files_data)
        for f in files:
            int(f["size"]), str(f["version"]), str(f["resolved"])
    except (KeyError, TypeError, ValueError) as e:
        raise storage.InputError(f"--exclude-duplicates {output}: unreadable {INPUT_FILES} ({e!r})") from None
    check_read_spec(output, files, read_spec, DEDUP)
    path, sha = _recorded_file(output, DUP_LIST, recorded, DEDUP)
    why = (f"edited after dedup wrote it (its {DEDUP.last_stage} receipt)",
           "a changed list may keep duplicate rows: run the same dedup command with --verify-checksums to write it "
           "again")
    rows = _streamed_rows(path, sha, files, None, why)
    source = DropSource(storage.resolved(output), 0, sha, sum(len(r) for r in rows.values()),
                        hashlib.sha256(files_data).hexdigest(), kind="dedup")
    return source, rows, files


def load_exclusion(outputs: list[str], n: int | None = None, *, read_spec: ReadSpec,
                   rules: SpanRules | None = None, duplicates: Sequence[str] = (),
                   min_coverage: float | None = None) -> Exclusion:
    """The rows to leave out from the decon ``outputs`` (each finished: ``.SUCCESS`` and its
    merge receipt), at ``n`` (default: each run's largest n; a given n must be one each run
    computed), and the rows each could not read; and the rows the dedup outputs
    ``duplicates`` list (:func:`_load_duplicates`: left out whole). Every file read must have
    the sha256 its run recorded, and each run must have read the training text as
    ``read_spec`` (this prep's) says. The lists are read a line at a time. With ``rules``
    (span mode), each decon run's spans file is read too and must list exactly its drop
    list's rows at n. With ``min_coverage`` (``--exclude-min-coverage``), a decon row listed at
    n is left out only when its line's ``max_coverage`` there is at least it (a decon output
    older than drop list 4 is refused); the others are counted (:attr:`DropSource.below`).
    Raises :class:`storage.InputError` naming the output and what is wrong with it."""
    exclusion = _load_overlaps(outputs, n, read_spec, rules, min_coverage)
    rows = {p: set(r) for p, r in (exclusion.rows or {}).items()}
    whole: dict[str, set[int]] = {}
    for output in duplicates:
        output = output.rstrip("/")
        if storage.offline_state() is not None and storage.is_remote(output):
            exclusion.sources.append(DropSource(output, 0, UNREAD, 0, kind="dedup"))
            continue
        source, listed, files = _load_duplicates(output, read_spec)
        exclusion.sources.append(source)
        exclusion.commands[output] = "dedup"
        exclusion.scanned[output] = {f["resolved"]: (int(f["size"]), str(f["version"])) for f in reversed(files)}
        exclusion.contents[output] = {f["resolved"]: str(f.get("sha256", "")) for f in reversed(files)}
        for path, r in listed.items():
            rows.setdefault(path, set()).update(r)
            whole.setdefault(path, set()).update(r)
    exclusion.rows = {p: frozenset(r) for p, r in rows.items()}
    exclusion.whole = {p: frozenset(r) for p, r in whole.items()}
    return exclusion


def _load_overlaps(outputs: list[str], n: int | None, read_spec: ReadSpec, rules: SpanRules | None,
                   min_coverage: float | None = None) -> Exclusion:
    """:func:`load_exclusion` of the decon ``outputs``."""
    sources: list[DropSource] = []
    rows: dict[str, set[int]] = {}
    scanned: dict[str, dict[str, tuple[int, str]]] = {}
    contents: dict[str, dict[str, str]] = {}
    all_spans: dict[str, dict[int, np.ndarray]] = {}
    for output in outputs:
        output = output.rstrip("/")
        if storage.offline_state() is not None and storage.is_remote(output):
            # a dry run reads nothing remote: the job is described without the drop list's rows
            sources.append(DropSource(output, -1 if n is None else n, UNREAD, 0))
            continue
        recorded = _finished_record(output, DECON)
        if min_coverage is not None and (version := drop_list_version(output)) < MIN_COVERAGE_DROP_LIST:
            raise storage.InputError(f"--exclude-min-coverage: the decon run {output} wrote drop list {version}, "
                                     "whose lines do not name their instances' coverage (drop list "
                                     f"{MIN_COVERAGE_DROP_LIST} does): run the same decon command again")
        files_data = _read_recorded(output, TRAIN_FILES, recorded)
        try:
            stats = read_jsonl(OVERLAP_STATS, _read_recorded(output, OVERLAP_STATS, recorded))
            ns = sorted({int(s["n"]) for s in stats})
            files = read_jsonl(TRAIN_FILES, files_data)
            scanned[output] = {f["resolved"]: (int(f["size"]), str(f["version"])) for f in reversed(files)}
            contents[output] = {f["resolved"]: str(f.get("sha256", "")) for f in reversed(files)}
        except (KeyError, TypeError, ValueError) as e:
            raise storage.InputError(f"--exclude-overlaps {output}: unreadable decon stats ({e!r})") from None
        check_read_spec(output, files, read_spec)
        at = ns[-1] if n is None and ns else n
        if at not in ns:
            raise storage.InputError(f"--exclude-n {n}: the decon run {output} computed n = "
                                     f"{', '.join(map(str, ns)) or 'none'}")
        docs_path, docs_sha = _recorded_file(output, CONTAMINATED_DOCS, recorded)
        below: dict[str, set[int]] = {}
        mine = _streamed_rows(docs_path, docs_sha, files, at, EDITED, min_coverage, below)
        spans_sha = ""
        if rules is not None:
            if CONTAMINATED_SPANS not in recorded:
                raise storage.InputError(f"--exclude-overlaps {output}: no {CONTAMINATED_SPANS} (written by a "
                                         "refinery decon older than --exclude-mode span); run the same decon "
                                         "command again")
            spans_path, spans_sha = _recorded_file(output, CONTAMINATED_SPANS, recorded)
            spans = _streamed_spans(spans_path, spans_sha, files, at, EDITED)
            _check_spans_match(output, _union(mine, below), spans, at)
            spans = _spans_of_rows(spans, mine) if min_coverage is not None else spans
            for path, rows_spans in spans.items():
                _add_spans(all_spans.setdefault(path, {}), rows_spans)
        unread_path, unread_sha = _recorded_file(output, UNREAD_ROWS, recorded)
        unread = _streamed_rows(unread_path, unread_sha, files, None, EDITED)
        for listed in (mine, unread):
            for path, listed_rows in listed.items():
                rows.setdefault(path, set()).update(listed_rows)
        sources.append(DropSource(storage.resolved(output), at, docs_sha, sum(len(r) for r in mine.values()),
                                  hashlib.sha256(files_data).hexdigest(), unread_sha,
                                  sum(len(r) for r in unread.values()), spans_sha,
                                  str(files[0].get("match_fold", "")) if files else "",
                                  min_coverage=min_coverage, below=sum(len(r) for r in below.values())))
    return Exclusion(sources, {p: frozenset(r) for p, r in rows.items()}, scanned, contents=contents, rules=rules,
                     spans=all_spans)
