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

Span mode (``--exclude-mode span``, :attr:`Exclusion.rules` set): each decon output's
``stats/contaminated_train_spans.jsonl`` is read too, checked the same way (its sha256 against
decon's merge receipt) and against the drop list (exactly its rows at n); a worker reads the
spans of its files (:meth:`Exclusion.spans_of`), and :mod:`.span_cut` says what is kept of a
listed row. The spans file's sha256 and the rules enter the hash too (row mode's is as before).
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

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
from refinery.transforms.formats.failed_run import failed_line, read_failed
from refinery.transforms.io import storage
from refinery.transforms.prep.span_cut import SpanRules
from refinery.transforms.resumable.ledger import META_DIR, Receipt, check_receipt

EXCLUDE_MODES = ("row", "span")

UNREAD = "not read (a dry run reads nothing remote)"  # a remote drop list's sha256 during a dry run
SHOWN = 3  # paths named in a refusal


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
                   why: tuple[str, str]) -> dict[str, set[int]]:
    """:func:`drop_rows` of ``path``, read as :func:`_streamed` says."""
    return _streamed(lambda lines: drop_rows(path, lines, files, n), path, sha256, why)


@functools.lru_cache(maxsize=4)
def _source_rows(source: DropSource) -> dict[str, frozenset[int]]:
    """A decon output's rows to leave out (those listed at its n and those it could not read),
    read in a worker (once per process) from the files the driver checked: the same bytes
    (sha256), or an error."""
    files = read_jsonl(TRAIN_FILES, _checked(storage.join(source.output, TRAIN_FILES), source.files_sha256))
    rows = _streamed_rows(storage.join(source.output, CONTAMINATED_DOCS), source.sha256, files, source.n, PLANNED)
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
    return _streamed_spans(path, source.spans_sha256, files, source.n, PLANNED)


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

    @property
    def mode(self) -> str:
        """``row`` (listed rows are left out) or ``span`` (their overlapping spans are cut out)."""
        return "row" if self.rules is None else "span"

    def identity(self) -> list[dict[str, Any]]:
        """What enters the tokenize stage's hash: each drop list's content and n (not its path);
        in span mode also its spans file's content and the rules (row mode's hash is as before)."""
        rules = self.rules
        return [{"sha256": s.sha256, "n": s.n, **({"unread_sha256": s.unread_sha256} if s.unread else {}),
                 **({"mode": "span", "spans_sha256": s.spans_sha256, **rules.identity()} if rules else {})}
                for s in self.sources]

    def __getstate__(self) -> dict[str, Any]:
        """What a job carries: where the drop lists are and their sha256, not their rows nor what
        decon scanned; a worker reads the rows (:meth:`rows_of`) and spans (:meth:`spans_of`),
        so the job does not grow with them."""
        return {**self.__dict__, "rows": None, "spans": None, "scanned": {}, "contents": {}}

    def spans_of(self, path: str) -> dict[int, np.ndarray]:
        """Span mode: the overlapping spans of each listed row of the input file ``path`` that
        has them (a row decon could not read has none: it is dropped whole)."""
        if self.spans is None:  # in a worker: from the decon outputs, checked against the plan's sha256
            spans: dict[str, dict[int, np.ndarray]] = {}
            for source in self.sources:
                for p, rows in _source_spans(source).items():
                    _add_spans(spans.setdefault(p, {}), rows)
            self.spans = spans
        return self.spans.get(storage.resolved(path), {})

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
        unscanned: dict[str, str] = {}  # input path -> why
        for output, files in self.scanned.items():
            for key, f in keys.items():
                then = files.get(key)
                if then is None:
                    unscanned.setdefault(f.path, f"not scanned by the decon run {output}")
                    continue
                size, version = then
                same = f.size == size if storage.is_remote(f.path) else (f.size, f.version) == (size, version)
                if same:
                    continue
                change = (f"changed since the decon run {output} scanned it (size {size:,}, now {f.size:,}; "
                          f"version {version}, now {f.version})")
                if key in listed:
                    raise storage.InputError(f"{f.path}: {change}; its listed rows may now name other documents: "
                                             "run decon again, then prep")
                unscanned.setdefault(f.path, change)
        if unscanned and not allow_unscanned:
            shown = "; ".join(f"{p}: {why}" for p, why in list(unscanned.items())[:SHOWN])
            more = f" (and {len(unscanned) - SHOWN} more)" if len(unscanned) > SHOWN else ""
            raise storage.InputError(
                f"{len(unscanned)} input file(s) are not what decon scanned, so their overlaps are unknown: {shown}"
                f"{more}; give prep the files decon scanned (its {TRAIN_FILES}), run decon on these inputs, or "
                "pass --allow-unscanned-inputs to keep them without an overlap check")
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

    def _check_contents(self, keys: dict[str, storage.InputFile], unscanned: set[str]) -> None:
        """Each input a decon run scanned read in full: its sha256 must be the one recorded."""
        for output, recorded in self.contents.items():
            for key, f in keys.items():
                if f.path in unscanned or key not in recorded:
                    continue
                want = recorded[key]
                if not want:
                    raise storage.InputError(
                        f"--verify-inputs-by-content: the decon run {output} recorded no sha256 of {f.path}: run "
                        "that decon command again with --verify-inputs-by-content")
                got = file_sha256(f.path)
                if got != want:
                    raise storage.InputError(
                        f"{f.path}: its content is not what the decon run {output} scanned (sha256 {got[:16]}..., "
                        f"decon recorded {want[:16]}...; same size and version): its rows may now be other "
                        "documents: run decon again, then prep")

    def manifest(self, excluded: int, cut: dict[str, int] | None = None) -> dict[str, Any]:
        """The manifest's ``excluded_overlaps``: how many rows were left out (span mode: listed
        rows met, and ``cut``: what was done with them), and from which runs (each run's
        ``unread``: the rows it could not read, left out whatever their overlap)."""
        span = {"mode": "span", **self.rules.identity(), **(cut or {})} if self.rules is not None else {}
        return {"documents": excluded, **span,
                "decon_runs": [{"path": s.output, "contaminated_train_docs_sha256": s.sha256, "n": s.n,
                                "listed": s.listed, **({"unread": s.unread} if s.unread else {}),
                                **({"match_fold": s.match_fold} if s.match_fold else {})}
                               for s in self.sources],
                **({"unscanned_inputs": self.unscanned} if self.unscanned else {})}



def merge_receipt(output: str) -> Receipt:
    """The receipt of a finished decon output's merge unit (the last stage of
    ``OUTPUT/.refinery/run.json``), checked; :class:`storage.InputError` when there is no such
    record or the merge is not complete."""
    run_json = storage.join(output, META_DIR, "run.json")
    try:
        stages = storage.read_json(run_json).get("stages") or [{}]
    except FileNotFoundError:
        raise storage.InputError(f"--exclude-overlaps {output}: no run record ({run_json}); a drop list is trusted "
                                 "only beside the receipts of the decon run that wrote it: run the same decon command "
                                 "again") from None
    except (ValueError, AttributeError) as e:
        raise storage.InputError(f"--exclude-overlaps {output}: unreadable run record {run_json} ({e})") from None
    merge = stages[-1]
    if merge.get("name") != "merge" or "stage_hash" not in merge:
        raise storage.InputError(f"--exclude-overlaps {output}: not a refinery decon output (its run record ends "
                                 f"with stage {merge.get('name')!r}, not merge)")
    receipt = storage.join(output, META_DIR, "merge", merge["stage_hash"], "receipts", "merge.json")
    done = check_receipt(output, receipt, merge["stage_hash"])
    if done.damaged:
        raise storage.InputError(f"--exclude-overlaps {output}: {done.reason}: edited after decon wrote it; a "
                                 "changed drop list may keep contaminated rows: run the same decon command with "
                                 "--verify-checksums to write it again")
    if not done.done:
        raise storage.InputError(f"--exclude-overlaps {output}: its decon merge is not complete ({done.reason}); "
                                 "run the same decon command again")
    return done.done_receipt()


def read_nothing_problem(output: str, receipt: Receipt) -> str | None:
    """Why the decon output whose merge receipt is ``receipt`` is no proof (one line): it read
    no training row's text (none read, or every row unreadable or without text with its text
    spec: such rows are counted, not listed, so its drop list says nothing of them); or None."""
    scan = receipt["stats"].get("scan") or {}
    read, bad = int(scan.get("rows", 0)), int(scan.get("bad_rows", 0))
    if read > bad:
        return None
    return (f"--exclude-overlaps {output}: decon used 0 of the {read:,} training row(s) it read ({bad:,} unreadable "
            "or without text: decon counts such rows, it does not list them), so its drop list says nothing of "
            "them: run decon with the --text-field (or --text-template) that reads their text")


def _recorded_file(output: str, relpath: str, recorded: dict[str, str]) -> tuple[str, str]:
    """(path, the sha256 decon's merge receipt records) of ``output/relpath``;
    :class:`storage.InputError` when it is missing or not recorded."""
    path = storage.join(output, relpath)
    if not storage.exists(path):
        raise storage.InputError(f"--exclude-overlaps {output}: no {relpath} (written by a refinery decon older "
                                 "than --exclude-overlaps?); run the same decon command again")
    want = recorded.get(relpath)
    if want is None:
        raise storage.InputError(f"--exclude-overlaps {output}: decon's merge receipt does not list {relpath}; "
                                 "run the same decon command again")
    return path, want


def _read_recorded(output: str, relpath: str, recorded: dict[str, str]) -> bytes:
    """The bytes of ``output/relpath`` (a small file), refused (:class:`storage.InputError`)
    unless their sha256 is what decon's merge receipt recorded."""
    path, want = _recorded_file(output, relpath, recorded)
    data = storage.read_bytes(path)
    got = hashlib.sha256(data).hexdigest()
    if got != want:
        raise storage.InputError(f"{path}: edited after decon wrote it (sha256 {got[:16]}..., its merge receipt "
                                 f"records {want[:16]}...); a changed drop list may keep contaminated rows: run the "
                                 "same decon command with --verify-checksums to write it again")
    return data


def check_read_spec(output: str, files: list[dict[str, Any]], read_spec: ReadSpec) -> None:
    """Refuse (:class:`storage.InputError`, one line naming both sides) a decon output that read
    the training text otherwise than ``read_spec`` (this prep's), or that does not record how
    it read it (an older decon: its text was not this prep's, so its drop list is not proof)."""
    for f in files:
        theirs = ReadSpec.of(f)
        if theirs is None:
            raise storage.InputError(
                f"--exclude-overlaps {output}: its {TRAIN_FILES} does not record how decon read the training text "
                "(text field or template, normalization, row cap): written by an older refinery decon, whose "
                "text may not be the text this prep trains on; run the same decon command again")
        if problem := read_spec_mismatch(theirs, read_spec):
            raise storage.InputError(f"--exclude-overlaps {output}: {problem}")
    if problem := match_fold_problem(files):
        raise storage.InputError(f"--exclude-overlaps {output}: {problem}")


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


def load_exclusion(outputs: list[str], n: int | None = None, *, read_spec: ReadSpec,
                   rules: SpanRules | None = None) -> Exclusion:
    """The rows to leave out from the decon ``outputs`` (each finished: ``.SUCCESS`` and its
    merge receipt), at ``n`` (default: each run's largest n; a given n must be one each run
    computed), and the rows each could not read. Every file read must have the sha256 decon
    recorded, and each run must have read the training text as ``read_spec`` (this prep's)
    says. The drop lists are read a line at a time. With ``rules`` (span mode), each run's
    spans file is read too and must list exactly its drop list's rows at n. Raises
    :class:`storage.InputError` naming the output and what is wrong with it."""
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
        if (failed := read_failed(output)) is not None:  # a decon that exited 1: its drop list is not one to trust
            raise storage.InputError(f"--exclude-overlaps {failed_line(output, failed)}")
        if not storage.exists(storage.join(output, ".SUCCESS")):
            raise storage.InputError(f"--exclude-overlaps {output}: not a finished decon output (no .SUCCESS); "
                                     "run refinery decon to the end first")
        receipt = merge_receipt(output)
        if problem := read_nothing_problem(output, receipt):
            raise storage.InputError(problem)
        recorded = {f["path"]: f["sha256"] for f in receipt["files"]}
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
        mine = _streamed_rows(docs_path, docs_sha, files, at, EDITED)
        spans_sha = ""
        if rules is not None:
            if CONTAMINATED_SPANS not in recorded:
                raise storage.InputError(f"--exclude-overlaps {output}: no {CONTAMINATED_SPANS} (written by a "
                                         "refinery decon older than --exclude-mode span); run the same decon "
                                         "command again")
            spans_path, spans_sha = _recorded_file(output, CONTAMINATED_SPANS, recorded)
            spans = _streamed_spans(spans_path, spans_sha, files, at, EDITED)
            _check_spans_match(output, mine, spans, at)
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
                                  str(files[0].get("match_fold", "")) if files else ""))
    return Exclusion(sources, {p: frozenset(r) for p, r in rows.items()}, scanned, contents=contents, rules=rules,
                     spans=all_spans)
