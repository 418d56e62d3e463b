"""decon's drop list: the files one decon output holds for prep to leave rows out.

decon writes them (its merge stage), ``prep --exclude-overlaps`` reads them
(:mod:`refinery.transforms.prep.exclusion`): the format lives here, below both.

- :data:`CONTAMINATED_DOCS`: one :class:`DropEntry` per training row with an overlap, sorted
  by path and row;
- :data:`CONTAMINATED_SPANS`: one :class:`SpanEntry` per (training row with an overlap, n
  it overlaps at): the union of the training offsets of its overlapping n-grams, sorted by
  path, row and n (what span mode cuts out);
- :data:`UNREAD_ROWS`: one :class:`UnreadRow` per training row decon could not read (too
  large, not JSON, a corrupt file's end), in scan order: its overlaps are unknown;
- :data:`TRAIN_FILES`: one :class:`TrainFile` per training file decon scanned, with how
  decon read its text (:class:`ReadSpec`: the header prep checks its own against);
- :data:`OVERLAP_STATS`: one line per (eval dataset, n), which says the n decon ran at.

The readers stream (:func:`hashed_lines`): a drop list is read a line at a time, keeping
only the row numbers, so a reader's memory grows with the rows listed, not the file.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, TypedDict

import numpy as np

from refinery.transforms.io import storage
from refinery.transforms.io.text import MATCH_FOLDS

CONTAMINATED_DOCS = "stats/contaminated_train_docs.jsonl"
CONTAMINATED_SPANS = "stats/contaminated_train_spans.jsonl"
UNREAD_ROWS = "stats/unread_train_rows.jsonl"
TRAIN_FILES = "stats/train_files.jsonl"
OVERLAP_STATS = "stats/overlap_stats.jsonl"
READ_SPEC_KEYS = ("text", "normalization", "max_row_bytes")  # a TrainFile's record of how decon read it


class DropEntry(TypedDict):
    """A training row with an overlap: where it is (as decon was given it), its document id, the
    n it overlaps at and, per n of ``ns``, the largest coverage at that n (HELM's token metric:
    the share of an instance's tokens that overlap) of the instances it overlaps there: what
    ``--exclude-min-coverage`` compares (drop list 4; older ones have none). (The drop lists of
    older decons also carry ``overlaps``, the eval instances per row; readers drop it as they
    read.)"""

    train_path: str
    train_row: int
    train_doc_id: str
    ns: list[int]
    max_coverage: list[float]


class SpanEntry(TypedDict):
    """A training row's overlapping spans at one n: ``[start, end)`` code-point offsets into
    its text as read, merged where they overlap or touch, ascending."""

    train_path: str
    train_row: int
    n: int
    spans: list[list[int]]


class UnreadRow(TypedDict):
    """A training row decon could not read: where it is and the reader's reason."""

    train_path: str
    train_row: int
    reason: str


class _TrainFileBase(TypedDict):
    train_path: str
    resolved: str
    size: int
    version: str


class TrainFile(_TrainFileBase, total=False):
    """A training file decon scanned: as given, resolved, the version it read, how it read its
    text (:data:`READ_SPEC_KEYS`; absent in outputs of older decons), the match fold it
    compared n-grams under and, with ``--verify-inputs-by-content``, the sha256 of its bytes."""

    text: dict[str, str]     # TextSpec.identity(): {"text_field": F} or {"text_template": T}
    normalization: str       # refinery.transforms.io.text.TEXT_NORMALIZATION
    max_row_bytes: int       # the row cap (--max-row-bytes)
    match_fold: str          # decon --match-fold: the key its n-grams were compared by (io.text.MATCH_FOLDS)
    sha256: str


@dataclass(frozen=True)
class ReadSpec:
    """How training rows were read into text: the text spec's identity, the normalization
    version and the row cap. decon records it per training file; prep compares its own."""

    text: dict[str, str]
    normalization: str
    max_row_bytes: int

    def record(self) -> dict[str, Any]:
        """The :class:`TrainFile` keys that record it."""
        return {"text": dict(self.text), "normalization": self.normalization, "max_row_bytes": self.max_row_bytes}

    @classmethod
    def of(cls, f: dict[str, Any]) -> ReadSpec | None:
        """The spec a ``train_files.jsonl`` row records, or None if it records none (an older decon)."""
        if not all(k in f for k in READ_SPEC_KEYS):
            return None
        return cls(dict(f["text"]), str(f["normalization"]), int(f["max_row_bytes"]))


def _text_words(text: dict[str, str]) -> tuple[str, str, str]:
    """(what, value as typed, the flag suffix) of a text spec identity."""
    if "text_template" in text:
        template = text["text_template"].replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")
        return "template", template, "template"
    return "field", text.get("text_field", "text"), "field"


def read_spec_mismatch(decon: ReadSpec, prep: ReadSpec, producer: str = "decon",
                       text_flag: str = "--train-text-") -> str | None:
    """One line naming both sides of the first way ``decon`` (the spec a decon run recorded;
    ``producer``: the command that recorded it, whose text flags begin with ``text_flag``)
    and ``prep`` (this prep's) read training text differently, with the flags that make them
    agree; None when they agree."""
    if decon.text != prep.text:
        (dw, dv, df), (pw, pv, pf) = _text_words(decon.text), _text_words(prep.text)
        return (f"{producer} read the training text from {dw} {dv!r}; this prep reads {pw} {pv!r}: rerun "
                f"{producer} with {text_flag}{pf} {_shell(pv)}, or prep with --text-{df} {_shell(dv)}")
    if decon.normalization != prep.normalization:
        return (f"{producer} read the training text normalized as {decon.normalization!r}; this prep normalizes "
                f"it as {prep.normalization!r}: rerun {producer} with this refinery")
    if decon.max_row_bytes != prep.max_row_bytes:
        return (f"{producer} read training rows of up to {decon.max_row_bytes:,} bytes; this prep reads rows of up "
                f"to {prep.max_row_bytes:,}: rerun {producer} with --max-row-bytes {prep.max_row_bytes}, or prep "
                f"with --max-row-bytes {decon.max_row_bytes}")
    return None


def match_fold_problem(files: list[dict[str, Any]]) -> str | None:
    """Why the match fold that ``files`` (a decon run's :data:`TRAIN_FILES` rows) record is
    not one this refinery knows, or not one for the whole run (one line); None when it is.
    Only decon folds: prep and clean read the training text as it is and cut at raw offsets,
    so they need the fold only to say it, but an unknown one is not a run of this method."""
    folds = sorted({str(f.get("match_fold", "")) for f in files})
    if len(folds) <= 1 and set(folds) <= set(MATCH_FOLDS):
        return None
    said = "no match fold" if folds == [""] else f"the match fold(s) {', '.join(repr(f) for f in folds)}"
    return (f"its {TRAIN_FILES} records {said} (this refinery's: {', '.join(MATCH_FOLDS)}): written by another "
            "refinery decon; run the same decon command again")


def _shell(value: str) -> str:
    """``value`` as typed on a command line: bare when it is a plain word, else single-quoted."""
    return value if value and all(c.isalnum() or c in "-_." for c in value) else "'" + value.replace("'", "'\\''") + "'"


def parse_line(path: str, i: int, line: bytes) -> dict[str, Any] | None:
    """The JSON object of line ``i`` of ``path`` (None for a blank line);
    :class:`storage.InputError` naming the line when it is not JSON."""
    if not line.strip():
        return None
    try:
        value: dict[str, Any] = json.loads(line)
    except ValueError as e:
        raise storage.InputError(f"{path}: row {i} is not JSON ({e})") from None
    return value


def read_jsonl(path: str, data: bytes) -> list[dict[str, Any]]:
    """The JSON lines of ``data``, the bytes of ``path``; :class:`storage.InputError` naming
    the first line that is not JSON."""
    return [d for i, line in enumerate(data.splitlines(), 1) if (d := parse_line(path, i, line)) is not None]


class HashedLines:
    """The lines of a file, read a piece at a time, and the sha256 of all of them: iterate
    to the end, then :attr:`sha256` is the file's. With ``want``, a file whose sha256 differs
    raises :class:`storage.InputError` at the end (``path: {changed} (sha256 ...); {hint}``):
    a caller uses what it read only after the last line."""

    def __init__(self, path: str, want: str | None = None, changed: str = "changed", hint: str = ""):
        self.path, self.want, self.changed, self.hint = path, want, changed, hint
        self.sha256 = ""

    def __iter__(self) -> Iterator[bytes]:
        h = hashlib.sha256()
        with storage.open_read(self.path) as f:
            for line in f:
                h.update(line)
                yield line
        self.sha256 = h.hexdigest()
        if self.want is not None and self.sha256 != self.want:
            raise storage.InputError(f"{self.path}: {self.changed} (sha256 {self.sha256[:16]}..., recorded "
                                     f"{self.want[:16]}...){'; ' + self.hint if self.hint else ''}")


def file_sha256(path: str) -> str:
    """The sha256 of the bytes of ``path`` (local or remote), read a piece at a time."""
    h = hashlib.sha256()
    with storage.open_read(path) as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def drop_rows(docs_path: str, lines: bytes | Iterable[bytes], files: list[dict[str, Any]], n: int | None,
              min_coverage: float | None = None, below: dict[str, set[int]] | None = None) -> dict[str, set[int]]:
    """The rows a drop list (``lines``, those of ``docs_path``, or its bytes) lists at ``n``
    (None: at any n; an :data:`UNREAD_ROWS` file has no ``ns`` and is read with None), by
    the resolved path of their file (``files``: decon's ``train_files.jsonl`` rows, which
    resolve the paths as decon named them). With ``min_coverage`` F (``--exclude-min-coverage``),
    a row whose ``max_coverage`` at ``n`` is under F (every instance it overlaps there has less
    than F of its tokens overlapping) is not among them but in ``below``, by path. One line at
    a time, keeping only row numbers (a line's other keys, e.g. an older drop list's
    ``overlaps``, are dropped as it is read); :class:`storage.InputError` naming a row that is
    not an entry, or, with F, one without its coverage."""
    by_given = {f["train_path"]: f["resolved"] for f in files}
    rows: dict[str, set[int]] = {}
    for i, line in enumerate(lines.splitlines() if isinstance(lines, bytes) else lines, 1):
        doc = parse_line(docs_path, i, line)
        if doc is None:
            continue
        if min_coverage is not None and "max_coverage" not in doc:
            raise storage.InputError(f"{docs_path}: row {i} has no max_coverage, which --exclude-min-coverage "
                                     "needs: written by an older refinery decon; run the same decon command again")
        try:
            if n is not None and n not in doc["ns"]:
                continue
            path = by_given.get(doc["train_path"]) or storage.resolved(doc["train_path"])
            kept = min_coverage is not None and float(doc["max_coverage"][doc["ns"].index(n)]) < min_coverage
            into = (below if below is not None else {}) if kept else rows
            into.setdefault(path, set()).add(int(doc["train_row"]))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise storage.InputError(f"{docs_path}: row {i} is not a drop-list entry ({e!r})") from None
    return rows


def drop_spans(spans_path: str, lines: Iterable[bytes], files: list[dict[str, Any]],
               n: int) -> dict[str, dict[int, np.ndarray]]:
    """The spans a :data:`CONTAMINATED_SPANS` file (``lines``, those of ``spans_path``) lists
    at ``n``: resolved path -> row -> ``(k, 2)`` int64 ``[start, end)``. One line at a time;
    :class:`storage.InputError` naming a row that is not an entry, or a (path, row) listed
    twice at ``n``."""
    by_given = {f["train_path"]: f["resolved"] for f in files}
    out: dict[str, dict[int, np.ndarray]] = {}
    for i, line in enumerate(lines, 1):
        entry = parse_line(spans_path, i, line)
        if entry is None:
            continue
        try:
            if int(entry["n"]) != n:
                continue
            path = by_given.get(entry["train_path"]) or storage.resolved(entry["train_path"])
            row = int(entry["train_row"])
            spans = np.array(entry["spans"], dtype=np.int64).reshape(-1, 2)
        except (KeyError, TypeError, ValueError) as e:
            raise storage.InputError(f"{spans_path}: row {i} is not a span entry ({e!r})") from None
        if not len(spans):
            raise storage.InputError(f"{spans_path}: row {i} lists no span")
        rows = out.setdefault(path, {})
        if row in rows:
            raise storage.InputError(f"{spans_path}: row {i} lists {entry['train_path']} row {row} at n={n} again")
        rows[row] = spans
    return out
