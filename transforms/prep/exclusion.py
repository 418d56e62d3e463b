"""Training rows that prep leaves out: the drop lists of finished decon runs.

``refinery decon`` writes, beside its reports, ``stats/contaminated_train_docs.jsonl`` (one
line per training row with an overlap: ``train_path``, ``train_row``, ``train_doc_id``, the
``ns`` it overlaps at and, per eval dataset and n, the instances) and
``stats/train_files.jsonl`` (every training file it scanned: as given, resolved, size and
version). ``refinery prep --exclude-overlaps DECON_OUTPUT [--exclude-n N]`` reads them
(:func:`load_exclusion`) and drops the rows that overlap at n (default: the decon run's
largest n) from the shards; rows are matched by resolved file path and row number, the
numbering both commands' row reader gives. A training file that changed since decon
scanned it is refused (its row numbers may no longer name the same documents).

The drop lists' sha256 and n enter the tokenize stage's hash: another decon output, or
another n, re-plans; the same ones resume.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from refinery.transforms.core import storage

CONTAMINATED_DOCS = "stats/contaminated_train_docs.jsonl"
TRAIN_FILES = "stats/train_files.jsonl"
OVERLAP_STATS = "stats/overlap_stats.jsonl"
UNREAD = "not read (a dry run reads nothing remote)"  # a remote drop list's sha256 during a dry run


@dataclass(frozen=True)
class DropSource:
    """One decon output a prep run excludes the overlaps of."""

    output: str   # resolved
    n: int
    sha256: str   # of its contaminated_train_docs.jsonl
    listed: int   # training rows its drop list holds at n


@dataclass
class Exclusion:
    """The training rows to leave out, by resolved file path, and where they come from."""

    sources: list[DropSource]
    rows: dict[str, frozenset[int]] = field(default_factory=dict)
    scanned: dict[str, tuple[int, str, str]] = field(default_factory=dict)  # path -> (size, version, decon output)

    def identity(self) -> list[dict]:
        """What enters the tokenize stage's hash: each drop list's content and n (not its path)."""
        return [{"sha256": s.sha256, "n": s.n} for s in self.sources]

    def rows_of(self, path: str) -> frozenset[int]:
        """The rows of the input file ``path`` to leave out."""
        return self.rows.get(storage.resolved(path), frozenset())

    def check_inputs(self, inputs: list[storage.InputFile]) -> None:
        """:class:`storage.InputError` naming an input file with listed rows that changed since
        decon scanned it; rows are matched by number, so they would name other documents."""
        for f in inputs:
            key = storage.resolved(f.path)
            if key not in self.rows or key not in self.scanned:
                continue
            size, version, output = self.scanned[key]
            now, then = (f.size, size) if storage.is_remote(f.path) else ((f.size, f.version), (size, version))
            if now != then:
                raise storage.InputError(
                    f"{f.path}: changed since the decon run {output} scanned it (size {size:,}, now {f.size:,}; "
                    f"version {version}, now {f.version}); run decon again, then prep")

    def manifest(self, excluded: int) -> dict:
        """The manifest's ``excluded_overlaps``: how many rows were left out, and from which runs."""
        return {"documents": excluded,
                "decon_runs": [{"path": s.output, "contaminated_train_docs_sha256": s.sha256, "n": s.n,
                                "listed": s.listed} for s in self.sources]}


def _jsonl(path: str, data: bytes | None = None) -> list[dict]:
    """The JSON lines of ``path`` (its bytes ``data`` when already read)."""
    data = storage.read_bytes(path) if data is None else data
    out = []
    for i, line in enumerate(data.splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError as e:
                raise storage.InputError(f"{path}: row {i} is not JSON ({e})") from None
    return out


def load_exclusion(outputs: list[str], n: int | None = None) -> Exclusion:
    """The rows to leave out from the decon ``outputs`` (each finished: ``.SUCCESS``), at ``n``
    (default: each run's largest n; a given n must be one each run computed). Raises
    :class:`storage.InputError` naming the output and what is wrong with it."""
    sources: list[DropSource] = []
    rows: dict[str, set[int]] = {}
    scanned: dict[str, tuple[int, str, str]] = {}
    for output in outputs:
        output = output.rstrip("/")
        if storage.offline_state() is not None and storage.is_remote(output):
            # a dry run reads nothing remote: the job is described without the drop list's rows
            sources.append(DropSource(output, -1 if n is None else n, UNREAD, 0))
            continue
        if not storage.exists(storage.join(output, ".SUCCESS")):
            raise storage.InputError(f"--exclude-overlaps {output}: not a finished decon output (no .SUCCESS); "
                                     "run refinery decon to the end first")
        docs_path = storage.join(output, CONTAMINATED_DOCS)
        if not storage.exists(docs_path):
            raise storage.InputError(f"--exclude-overlaps {output}: no {CONTAMINATED_DOCS} (written by a refinery "
                                     "decon older than --exclude-overlaps); run the same decon command again")
        try:
            ns = sorted({int(s["n"]) for s in _jsonl(storage.join(output, OVERLAP_STATS))})
            files = _jsonl(storage.join(output, TRAIN_FILES))
        except (FileNotFoundError, KeyError, TypeError, ValueError) as e:
            raise storage.InputError(f"--exclude-overlaps {output}: unreadable decon stats ({e})") from None
        at = ns[-1] if n is None and ns else n
        if at not in ns:
            raise storage.InputError(f"--exclude-n {n}: the decon run {output} computed n = "
                                     f"{', '.join(map(str, ns)) or 'none'}")
        by_given = {}
        for f in files:
            by_given[f["train_path"]] = f["resolved"]
            scanned.setdefault(f["resolved"], (int(f["size"]), str(f["version"]), output))
        listed = 0
        data = storage.read_bytes(docs_path)  # read once: parsed and hashed
        for i, doc in enumerate(_jsonl(docs_path, data), 1):
            try:
                if at not in doc["ns"]:
                    continue
                path = by_given.get(doc["train_path"]) or storage.resolved(doc["train_path"])
                rows.setdefault(path, set()).add(int(doc["train_row"]))
            except (KeyError, TypeError, ValueError) as e:
                raise storage.InputError(f"{docs_path}: row {i} is not a drop-list entry ({e!r})") from None
            listed += 1
        sha = hashlib.sha256(data).hexdigest()
        sources.append(DropSource(storage.resolved(output), at, sha, listed))
    return Exclusion(sources, {p: frozenset(r) for p, r in rows.items()}, scanned)
