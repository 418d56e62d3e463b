"""Training rows that prep leaves out: the drop lists of finished decon runs.

``refinery decon`` writes, beside its reports, ``stats/contaminated_train_docs.jsonl`` (one
line per training row with an overlap: ``train_path``, ``train_row``, ``train_doc_id``, the
``ns`` it overlaps at and, per eval dataset and n, the instances) and
``stats/train_files.jsonl`` (every training file it scanned: as given, resolved, size and
version). ``refinery prep --exclude-overlaps DECON_OUTPUT [--exclude-n N]`` reads them
(:func:`load_exclusion`) and drops the rows that overlap at n (default: the decon run's
largest n) from the shards; rows are matched by resolved file path and row number, the
numbering both commands' row reader gives.

Nothing leaks in silence (:meth:`Exclusion.check_inputs`, :func:`load_exclusion`):

- the files read are the files decon wrote: their sha256 must be what decon's merge receipt
  records (an edited drop list is refused);
- every prep input must be a file each decon run scanned, unchanged since (same resolved path,
  size and version): a renamed file, another copy of the corpus or a file changed since decon
  is refused, naming the first few (``--allow-unscanned-inputs`` keeps unscanned files that
  hold no listed row, loudly, without an overlap check);
- every listed row must lie in a file prep reads, and each must be met while reading
  (:meth:`Exclusion.expected`: the manifest stage compares it with the rows excluded).

The drop lists' sha256 and n enter the tokenize stage's hash: another decon output, or
another n, re-plans; the same ones resume.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field

from refinery.transforms.core import storage
from refinery.transforms.core.receipts import META_DIR, check_receipt
from refinery.transforms.formats.droplist import CONTAMINATED_DOCS, OVERLAP_STATS, TRAIN_FILES, drop_rows, read_jsonl

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


def _checked(path: str, sha256: str) -> bytes:
    """The bytes of ``path``, if they are still those whose sha256 the plan recorded."""
    data = storage.read_bytes(path)
    if hashlib.sha256(data).hexdigest() != sha256:
        raise storage.InputError(f"{path}: changed since this job was planned (sha256 {sha256[:16]}... then); run "
                                 "the same command again to plan with it")
    return data


@functools.lru_cache(maxsize=4)
def _source_rows(source: DropSource) -> dict[str, frozenset[int]]:
    """A decon output's rows to leave out, read in a worker (once per process) from the files
    the driver checked: the same bytes (sha256), or an error."""
    docs = storage.join(source.output, CONTAMINATED_DOCS)
    files = read_jsonl(TRAIN_FILES, _checked(storage.join(source.output, TRAIN_FILES), source.files_sha256))
    return {p: frozenset(r) for p, r in drop_rows(docs, _checked(docs, source.sha256), files, source.n).items()}


@dataclass
class Exclusion:
    """The training rows to leave out, by resolved file path, and where they come from."""

    sources: list[DropSource]
    rows: dict[str, frozenset[int]] | None = field(default_factory=dict)  # None in a worker: read when asked
    # per decon output (as given): resolved path -> (size, version) of every training file it scanned
    scanned: dict[str, dict[str, tuple[int, str]]] = field(default_factory=dict)
    unscanned: int = 0  # inputs kept without an overlap check (--allow-unscanned-inputs)
    expected: int | None = None  # listed rows in the inputs: what a full run excludes (set by check_inputs)

    def identity(self) -> list[dict]:
        """What enters the tokenize stage's hash: each drop list's content and n (not its path)."""
        return [{"sha256": s.sha256, "n": s.n} for s in self.sources]

    def __getstate__(self) -> dict:
        """What a job carries: where the drop lists are and their sha256, not their rows nor what
        decon scanned; a worker reads the rows (:meth:`rows_of`), so the job does not grow with
        them."""
        return {**self.__dict__, "rows": None, "scanned": {}}

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

    def check_inputs(self, inputs: list[storage.InputFile], allow_unscanned: bool = False) -> list[str]:
        """Refuse (:class:`storage.InputError`, one line naming the first few) prep inputs that a
        decon run did not scan as they are now, and listed rows in files prep does not read.

        - An input with listed rows that changed since decon scanned it is always refused: its
          rows are matched by number, so they would name other documents.
        - An input a decon run did not scan (another path, a copy, a rename), or scanned at
          another size or version, is refused unless ``allow_unscanned``; then it is kept
          without an overlap check and returned (the caller says so loudly).
        - A listed row in a file that is not among the inputs is refused: its document may be
          in the inputs under another name.

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
        self.unscanned = len(unscanned)
        self.expected = sum(len(self.rows_of(f.path)) for f in inputs)
        return list(unscanned)

    def manifest(self, excluded: int) -> dict:
        """The manifest's ``excluded_overlaps``: how many rows were left out, and from which runs."""
        return {"documents": excluded,
                "decon_runs": [{"path": s.output, "contaminated_train_docs_sha256": s.sha256, "n": s.n,
                                "listed": s.listed} for s in self.sources],
                **({"unscanned_inputs": self.unscanned} if self.unscanned else {})}


def recorded_sha256(output: str) -> dict[str, str]:
    """``{relpath: sha256}`` of the files a finished decon output's merge unit wrote, from its
    receipt (the last stage of ``OUTPUT/.refinery/run.json``); :class:`storage.InputError`
    when there is no such record or the merge is not complete."""
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
    return {f["path"]: f["sha256"] for f in done.done_receipt()["files"]}


def _read_recorded(output: str, relpath: str, recorded: dict[str, str]) -> bytes:
    """The bytes of ``output/relpath``, refused (:class:`storage.InputError`) unless their sha256
    is what decon's merge receipt recorded."""
    path = storage.join(output, relpath)
    try:
        data = storage.read_bytes(path)
    except FileNotFoundError:
        raise storage.InputError(f"--exclude-overlaps {output}: no {relpath} (written by a refinery decon older "
                                 "than --exclude-overlaps?); run the same decon command again") from None
    want = recorded.get(relpath)
    got = hashlib.sha256(data).hexdigest()
    if want is None:
        raise storage.InputError(f"--exclude-overlaps {output}: decon's merge receipt does not list {relpath}; "
                                 "run the same decon command again")
    if got != want:
        raise storage.InputError(f"{path}: edited after decon wrote it (sha256 {got[:16]}..., its merge receipt "
                                 f"records {want[:16]}...); a changed drop list may keep contaminated rows: run the "
                                 "same decon command with --verify-checksums to write it again")
    return data


def load_exclusion(outputs: list[str], n: int | None = None) -> Exclusion:
    """The rows to leave out from the decon ``outputs`` (each finished: ``.SUCCESS`` and its
    merge receipt), at ``n`` (default: each run's largest n; a given n must be one each run
    computed). Every file read must have the sha256 decon recorded. Raises
    :class:`storage.InputError` naming the output and what is wrong with it."""
    sources: list[DropSource] = []
    rows: dict[str, set[int]] = {}
    scanned: dict[str, dict[str, tuple[int, str]]] = {}
    for output in outputs:
        output = output.rstrip("/")
        if storage.offline_state() is not None and storage.is_remote(output):
            # a dry run reads nothing remote: the job is described without the drop list's rows
            sources.append(DropSource(output, -1 if n is None else n, UNREAD, 0))
            continue
        if not storage.exists(storage.join(output, ".SUCCESS")):
            raise storage.InputError(f"--exclude-overlaps {output}: not a finished decon output (no .SUCCESS); "
                                     "run refinery decon to the end first")
        recorded = recorded_sha256(output)
        data = _read_recorded(output, CONTAMINATED_DOCS, recorded)
        files_data = _read_recorded(output, TRAIN_FILES, recorded)
        try:
            stats = read_jsonl(OVERLAP_STATS, _read_recorded(output, OVERLAP_STATS, recorded))
            ns = sorted({int(s["n"]) for s in stats})
            files = read_jsonl(TRAIN_FILES, files_data)
            scanned[output] = {f["resolved"]: (int(f["size"]), str(f["version"])) for f in reversed(files)}
        except (KeyError, TypeError, ValueError) as e:
            raise storage.InputError(f"--exclude-overlaps {output}: unreadable decon stats ({e!r})") from None
        at = ns[-1] if n is None and ns else n
        if at not in ns:
            raise storage.InputError(f"--exclude-n {n}: the decon run {output} computed n = "
                                     f"{', '.join(map(str, ns)) or 'none'}")
        mine = drop_rows(storage.join(output, CONTAMINATED_DOCS), data, files, at)
        for path, listed_rows in mine.items():
            rows.setdefault(path, set()).update(listed_rows)
        sources.append(DropSource(storage.resolved(output), at, hashlib.sha256(data).hexdigest(),
                                  sum(len(r) for r in mine.values()), hashlib.sha256(files_data).hexdigest()))
    return Exclusion(sources, {p: frozenset(r) for p, r in rows.items()}, scanned)
