"""Receipts: the one record of a finished unit, and THE check of whether a unit is done.

A unit's receipt (``OUTPUT/.refinery/<stage>/<stage_hash>/receipts/<unit>.json``) is written
last, after the unit's files; its schema is :class:`Receipt` (and nowhere else: docs/FORMATS.md
quotes :func:`receipt_schema`, which a test holds it to). It is written by
:func:`~refinery.transforms.resumable.execution.execute_unit` through :meth:`Ledger.record`.
:func:`check_receipt` judges one, for the planner, the worker, ``refinery status`` and
``refinery verify`` alike.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import typing
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypedDict, TypeVar, cast

from refinery.transforms.io import storage
from refinery.transforms.io.hashing import short_hash
from refinery.transforms.resumable.run_record import RunRecord, StageEntry
from refinery.transforms.resumable.unit_lists import check_parts

log = logging.getLogger("refinery")
_T = TypeVar("_T")

RECEIPT_SCHEMA = "refinery.receipt/1"


META_DIR = ".refinery"


def fingerprints_path(output: str, stage: str, stage_hash: str) -> str:
    """Where the input fingerprints of one plan of a stage are kept (to explain a later change,
    and the input list a worker reads: :meth:`~.base.StageRun.input_fingerprints`)."""
    return storage.join(output, META_DIR, "fingerprints", f"{stage}-{stage_hash}.json")


class FileEntry(TypedDict):
    """One file a unit wrote: its path relative to OUTPUT, its size and sha256."""

    path: str
    bytes: int
    sha256: str


class UnitError(TypedDict):
    """Why a unit failed (a ``failed`` receipt's ``error``)."""

    type: str
    message: str
    traceback: str


class _ReceiptBase(TypedDict):
    schema: str
    stage: str
    stage_hash: str
    unit: str
    started_at: str
    host: str
    pid: int


class Receipt(_ReceiptBase, total=False):
    """A unit's receipt, as :func:`~refinery.transforms.resumable.execution.execute_unit` writes it
    (keys in this order): ``status`` ("completed" or "failed"), ``files``, ``stats`` (the stage's
    own, e.g. prep's ``TokenizeStats``) and ``finished_at`` are always there once written;
    ``repair``, ``upstream_repairs`` when set, ``error`` when failed. ``skipped`` is never
    stored: ``execute_unit`` adds it to what it returns for a unit found done."""

    repair: str
    upstream_repairs: dict[str, str]
    status: str
    files: list[FileEntry]
    stats: dict[str, Any]
    error: UnitError
    finished_at: str
    skipped: bool


STORED_ALWAYS = ("status", "files", "stats", "finished_at")  # of Receipt's optional keys: in every stored one
NEVER_STORED = ("skipped",)
_VALUES = {"schema": f'"{RECEIPT_SCHEMA}"', "status": "completed|failed"}


def _value(key: str, kind: Any) -> str:
    """How the schema line spells a key's value: a fixed one, a nested TypedDict's keys, or nothing."""
    if key in _VALUES:
        return f": {_VALUES[key]}"
    inner = typing.get_args(kind)
    if typing.get_origin(kind) is list and inner and typing.is_typeddict(inner[0]):
        return ": [{" + ", ".join(typing.get_type_hints(inner[0])) + "}]"
    if typing.is_typeddict(kind):
        return ": {" + ", ".join(typing.get_type_hints(kind)) + "}"
    return ""


def receipt_schema() -> str:
    """A stored receipt's keys, from :class:`Receipt` (``?``: present only when set), as
    docs/FORMATS.md quotes them."""
    optional = Receipt.__optional_keys__ - set(STORED_ALWAYS)
    keys = [f"{key}{'?' if key in optional else ''}{_value(key, kind)}"
            for key, kind in typing.get_type_hints(Receipt).items() if key not in NEVER_STORED]
    return "{" + ", ".join(keys) + "}"


@dataclass(frozen=True)
class Completion:
    done: bool
    reason: str
    receipt: Receipt | None = None
    damaged: bool = False  # the unit's files (or receipt) changed after it was written: a redo is a repair
    failed: bool = False   # the unit ran in this plan and failed: the next run retries it
    stale: bool = False    # complete, but built before a repair of an upstream unit: to be redone

    def done_receipt(self) -> Receipt:
        """The receipt of a unit found done (a done unit always has one); RuntimeError, naming why,
        for a unit that is not done."""
        if self.receipt is None:
            raise RuntimeError(f"no receipt: {self.reason}")
        return self.receipt


def repairs_of(stage: str, receipts: dict[str, Receipt]) -> dict[str, str]:
    """``{"stage/unit": repair token}`` of the units (done receipts by unit id) that were
    rebuilt over damaged files: what a later stage's receipts record as ``upstream_repairs``."""
    return {f"{stage}/{u}": r["repair"] for u, r in sorted(receipts.items()) if r.get("repair")}


def check_receipt(output: str, receipt_path: str, stage_hash: str,
                  verify_checksums: bool = False, upstream_repairs: dict[str, str] | None = None) -> Completion:
    """THE completion check. Used by the planner and by the worker; nothing else decides.

    ``upstream_repairs``: the :func:`repairs_of` the earlier stages' done units now; a receipt
    that recorded others was built before an upstream repair and is pending (None: not judged).
    """
    try:
        raw = storage.read_bytes(receipt_path)
    except FileNotFoundError:
        return Completion(False, "no receipt")
    try:
        receipt: Receipt = json.loads(raw)
        if not isinstance(receipt, dict):
            raise ValueError("not an object")
    except ValueError as e:
        return Completion(False, f"unreadable receipt ({e})", damaged=True)
    if receipt.get("schema") != RECEIPT_SCHEMA or receipt.get("stage_hash") != stage_hash:
        return Completion(False, "receipt from another plan", receipt)
    if receipt.get("status") != "completed":
        err = receipt.get("error")
        reason = (f"{receipt.get('status')}: {err.get('type', '') if err else ''} "
                  f"{err.get('message', '') if err else ''}").strip()
        return Completion(False, reason, receipt, failed=receipt.get("status") == "failed")
    files = receipt.get("files")
    if not isinstance(files, list):
        return Completion(False, "receipt lists no files", receipt)
    for entry in files:
        if not (isinstance(entry, dict) and isinstance(entry.get("path"), str)
                and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str)):
            return Completion(False, f"malformed file entry in receipt: {entry!r:.200}", receipt, damaged=True)
        try:
            path = storage.join(output, storage.safe_relpath(entry["path"]))
        except ValueError as e:
            return Completion(False, f"receipt lists a file outside the output: {e}", receipt, damaged=True)
        size = storage.file_size(path)
        if size is None:
            return Completion(False, f"missing output {entry['path']}", receipt)
        if size != entry["bytes"]:
            return Completion(False, f"size mismatch for {entry['path']}: {size} != {entry['bytes']}", receipt,
                              damaged=True)
        if verify_checksums and storage.sha256_file(path) != entry["sha256"]:
            return Completion(False, f"checksum mismatch for {entry['path']}", receipt, damaged=True)
    built_after = receipt.get("upstream_repairs") or {}
    if upstream_repairs is not None and built_after != upstream_repairs:
        changed = sorted(k for k in {**built_after, **upstream_repairs}
                         if built_after.get(k) != upstream_repairs.get(k))
        return Completion(False, f"built before a repair of {', '.join(changed[:3])}"
                                 f"{' ...' if len(changed) > 3 else ''} (damaged files rebuilt since)", receipt,
                          stale=True)
    return Completion(True, "completed", receipt)


def next_repair(done: Completion) -> str | None:
    """The ``repair`` token a unit gets when it is run now, given its :func:`check_receipt`:
    a unit redone over damaged files gets a new one (derived from the previous one and the
    damage, so two runs repairing the same damage agree); otherwise it keeps the previous
    receipt's token. The planner uses it to know, before anything runs, what the later
    stages' receipts will record as ``upstream_repairs``."""
    repair = done.receipt.get("repair") if done.receipt else None
    if done.damaged:
        repair = short_hash({"after": repair, "damage": done.reason})
    return repair


CHECK_THREADS = 32  # receipt checks in flight at once on an object store


class Ledger:
    """The records of one plan of one stage on one output, and the only code that writes them:

    ``OUTPUT/.refinery/<stage>/<stage_hash>/``
        ``receipts/<unit>.json``  a unit's receipt (:class:`Receipt`), written last
        ``repairs/<unit>``        the repair token of a unit rebuilt over damaged files
        ``failures/<unit>``       why a unit's last attempt failed (removed when it completes)
        ``progress/<unit>.json``  a running unit's counts so far (a display; never read to decide)
        ``parts/``                the units' intermediate files (written through ``UnitContext``)

    Repairs and failures are files of their own so that the planner learns them from one
    listing each, never a receipt read per unit. Whether a unit is done is
    :func:`check_receipt`'s call alone (:meth:`check`)."""

    def __init__(self, output: str, stage: str, stage_hash: str) -> None:
        self.output = output
        self.stage = stage
        self.stage_hash = stage_hash
        self.dir = storage.join(output, META_DIR, stage, stage_hash)

    @property
    def receipts_dir(self) -> str:
        return storage.join(self.dir, "receipts")

    @property
    def repairs_dir(self) -> str:
        return storage.join(self.dir, "repairs")

    @property
    def failures_dir(self) -> str:
        return storage.join(self.dir, "failures")

    @property
    def progress_dir(self) -> str:
        return storage.join(self.dir, "progress")

    @property
    def parts_dir(self) -> str:
        return storage.join(self.dir, "parts")

    def receipt_path(self, unit_id: str) -> str:
        return storage.join(self.receipts_dir, f"{unit_id}.json")

    def progress_path(self, unit_id: str) -> str:
        return storage.join(self.progress_dir, f"{unit_id}.json")

    def failure_path(self, unit_id: str) -> str:
        return storage.join(self.failures_dir, unit_id)

    # -- what one listing says (no receipt read) --

    def listed_units(self) -> set[str]:
        """Ids of the units that have a receipt file, whatever it says: one listing of the
        receipts folder (a LIST call per 1,000 receipts on an object store), no receipt read."""
        return {storage.basename(p)[:-len(".json")] for p in storage.listdir(self.receipts_dir)
                if p.endswith(".json") and not storage.is_temp_name(storage.basename(p))}

    def listed_failures(self) -> set[str]:
        """Ids of the units whose last attempt failed, from one listing of ``failures/``."""
        return {storage.basename(p) for p in storage.listdir(self.failures_dir)
                if not storage.is_temp_name(storage.basename(p))}

    def recorded_repairs(self) -> dict[str, str]:
        """``{"stage/unit": token}`` of the units rebuilt over damaged files, from ``repairs/``
        (what :func:`repairs_of` gives from their receipts)."""
        out = {}
        for path in storage.listdir(self.repairs_dir):
            name = storage.basename(path)
            if not storage.is_temp_name(name):
                out[f"{self.stage}/{name}"] = storage.read_bytes(path).decode(errors="replace")  # damaged: no match
        return out

    # -- judging receipts --

    def check(self, unit_id: str, verify_checksums: bool = False,
              upstream_repairs: dict[str, str] | None = None) -> Completion:
        """:func:`check_receipt` of one unit's receipt."""
        return check_receipt(self.output, self.receipt_path(unit_id), self.stage_hash, verify_checksums,
                             upstream_repairs)

    def check_all(self, unit_ids: list[str], check: Callable[[str], Completion]) -> dict[str, Completion]:
        """``check`` of many units: :meth:`check` with the caller's upstream repairs."""
        return dict(zip(unit_ids, self._each(check, unit_ids)))

    def read_receipts_of(self, unit_ids: list[str]) -> list[Receipt]:
        """The receipts of ``unit_ids`` that can be read, as stored (not judged)."""
        return [r for r in self._each(self.read_receipt, unit_ids) if r is not None]

    def _each(self, fn: Callable[[str], _T], unit_ids: list[str]) -> list[_T]:
        """``fn`` of each unit id, in order. On an object store every call is a few requests of
        tens of milliseconds each, so they are made CHECK_THREADS at a time."""
        if not storage.is_remote(self.output) or len(unit_ids) < 2:
            return [fn(u) for u in unit_ids]
        with ThreadPoolExecutor(CHECK_THREADS) as pool:
            return list(pool.map(fn, unit_ids))

    def read_receipt(self, unit_id: str) -> Receipt | None:
        """The receipt of ``unit_id`` as stored, if it can be read (not judged)."""
        try:
            r = storage.read_json(self.receipt_path(unit_id))
        except (OSError, ValueError):
            return None
        return cast(Receipt, r) if isinstance(r, dict) else None

    def read_receipts(self, cache: dict[str, Receipt] | None = None) -> Iterator[Receipt]:
        """Every parseable receipt of this plan, whatever its status (for status and progress).

        ``cache`` (path -> receipt): completed receipts read before are taken from it and new
        ones added, so a progress poll on GCS reads only the receipts that appeared since
        the last poll (one listing + one GET per new receipt, not one GET per unit)."""
        for path in storage.listdir(self.receipts_dir):
            if path.endswith(".json") and not storage.is_temp_name(storage.basename(path)):
                if cache is not None and path in cache:
                    yield cache[path]
                    continue
                with contextlib.suppress(ValueError, OSError):
                    r: Receipt = storage.read_json(path)
                    if isinstance(r, dict) and r.get("stage_hash") == self.stage_hash:
                        if cache is not None and r.get("status") == "completed":
                            cache[path] = r
                        yield r

    # -- writing records --

    def record_repair(self, unit_id: str, token: str) -> None:
        storage.atomic_write_bytes(storage.join(self.repairs_dir, unit_id), token.encode())

    def keep_repair_recorded(self, unit_id: str, token: str) -> None:
        """Record ``token`` for a done unit whose receipt carries it, if that file is missing or
        says otherwise (deleted, or edited): the listing the later stages' receipts are judged
        against is derived from the receipts, and a run rebuilds it, so a lost one neither makes
        them be rebuilt without it nor leaves ``verify`` failing."""
        path = storage.join(self.repairs_dir, unit_id)
        try:
            if storage.read_bytes(path) == token.encode():
                return
        except FileNotFoundError:
            pass
        log.warning("%s: the repair recorded in the receipt of %s/%s was lost: recorded again", path, self.stage,
                    unit_id)
        self.record_repair(unit_id, token)

    def record(self, receipt: Receipt, progress_written: bool) -> Receipt:
        """Write a unit's ``receipt`` (its ``status`` set) and what goes with it, in the order a
        kill anywhere leaves right: a repair token and the removal of a failure record before a
        completed receipt (a kill between them leaves the unit pending, not unrecorded), a
        failure record before a failed one; then the unit's progress file goes. A full disk
        leaves the unit pending (no receipt), said in one line: the receipt is returned as
        failed."""
        unit_id = receipt["unit"]
        try:
            if receipt["status"] == "completed":
                if repair := receipt.get("repair"):
                    self.record_repair(unit_id, repair)
                storage.remove(self.failure_path(unit_id), root=self.output)
            else:
                error = receipt["error"]
                storage.atomic_write_bytes(self.failure_path(unit_id),
                                           f"{error['type']}: {error['message']}"[:500].encode())
            storage.atomic_write_json(self.receipt_path(unit_id), receipt)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            log.error("unit %s/%s: its receipt could not be written: %s", self.stage, unit_id, e)
            return {**receipt, "status": "failed"}
        if progress_written or receipt["status"] != "completed":  # its counts are in the receipt now
            with contextlib.suppress(OSError):
                storage.remove(self.progress_path(unit_id), root=self.output)
        return receipt

    def forget_failure(self, unit_id: str) -> None:
        """Remove the failure record of a unit found done (left by a kill after it completed)."""
        storage.remove(self.failure_path(unit_id), root=self.output)

    def remove_receipt(self, unit_id: str) -> None:
        storage.remove(self.receipt_path(unit_id), root=self.output)

    def recorded_fingerprints(self, inputs_hash: str | None) -> list[Any]:
        """The input fingerprints the driver recorded for this plan (:func:`fingerprints_path`),
        read once per process; ValueError naming the file when it is not JSON, or not the list
        whose short hash the driver put in the job (``inputs_hash``; None: not judged)."""
        return _recorded_fingerprints(fingerprints_path(self.output, self.stage, self.stage_hash), inputs_hash)


@functools.lru_cache(maxsize=8)
def _recorded_fingerprints(path: str, inputs_hash: str | None) -> list[Any]:
    try:
        fingerprints: list[Any] = json.loads(storage.read_bytes(path))
    except FileNotFoundError:
        raise ValueError(f"{path}: missing (the input fingerprints written by the driver of this job)") from None
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e}): damaged, not used (the next run writes it again)") from None
    if inputs_hash is not None and short_hash(fingerprints) != inputs_hash:
        raise ValueError(f"{path}: not the input fingerprints of this plan (hash {short_hash(fingerprints)}, the "
                         f"driver recorded {inputs_hash}): damaged, not used (the next run writes it again)")
    return fingerprints


def check_recorded_run(output: str, info: RunRecord,
                       checksums: bool = False) -> Iterator[tuple[StageEntry, list[str], list[Completion]]]:
    """(stage entry of run.json, its receipt paths, :func:`check_receipt` of each) per stage of
    a recorded run, in order, each judged against the repairs of the earlier stages' done units."""
    repairs: dict[str, str] = {}
    for st in info.get("stages", []):
        receipts_dir = storage.join(output, META_DIR, st["name"], st["stage_hash"], "receipts")
        paths = [p for p in storage.listdir(receipts_dir)
                 if p.endswith(".json") and not storage.is_temp_name(storage.basename(p))]
        checks = [check_receipt(output, path, st["stage_hash"], checksums, dict(repairs)) for path in paths]
        repairs.update(repairs_of(st["name"], {str(c.receipt.get("unit")): c.receipt for c in checks
                                               if c.done and c.receipt is not None}))
        yield st, paths, checks


def verify_receipts(output: str, checksums: bool = False, notes: list[str] | None = None) -> list[str]:
    """Problems with the receipts of the run recorded in ``OUTPUT/.refinery/run.json``
    ([] if none, or if there is no run record): each receipt present under a stage's
    current hash must pass :func:`check_receipt` (a truncated receipt, one from another
    plan, a failed unit, a missing or changed file, one built before an upstream repair
    are each named), the receipt count of a stage may not exceed its planned units, and a
    stage of user-facing files (``final`` in run.json; the last stage of an older record)
    must have one for every planned unit: a deleted receipt is named, not rebuilt in silence
    by the next run. A stage of intermediate files may lack receipts (its files may be
    removed once the stages after it are complete): that is appended to ``notes``."""
    problems: list[str] = []
    try:
        info: RunRecord = storage.read_json(storage.join(output, META_DIR, "run.json"))
    except FileNotFoundError:
        return problems
    except ValueError as e:
        return problems + [f"{storage.join(output, META_DIR, 'run.json')}: not valid JSON ({e})"]
    stages = info.get("stages", [])
    for st, paths, checks in check_recorded_run(output, info, checksums):
        problems += recorded_plan_problems(output, st)
        receipts_dir = storage.join(output, META_DIR, st["name"], st["stage_hash"], "receipts")
        problems += [f"{path}: {c.reason}" for path, c in zip(paths, checks) if not c.done]
        units = st.get("units", len(paths))
        if len(paths) > units:
            problems.append(f"{receipts_dir}: {len(paths)} receipts for {units} planned units")
        elif len(paths) < units:
            missing = (f"stage {st['name']}: {units - len(paths)} of {units} planned units have no receipt "
                       f"in {receipts_dir}")
            if st.get("final", st is stages[-1]):
                problems.append(f"{missing} (deleted, or the run has not finished); the next run redoes them")
            elif notes is not None:
                notes.append(f"{missing}: intermediate files, not needed while the stages after it are complete")
    return problems


def recorded_plan_problems(output: str, st: StageEntry) -> list[str]:
    """Problems with what the driver recorded of one stage of a run beside its receipts, each
    checked by content: its plan parts and the units of its steps against their
    ``index.json`` (:func:`~.unit_lists.check_parts`), and its input fingerprints against the
    ``inputs_hash`` of run.json. A missing one is no problem: a run that needs it writes it."""
    stage_dir = storage.join(output, META_DIR, st["name"], st["stage_hash"])
    problems = check_parts(storage.join(stage_dir, "plan"))
    for folder in sorted(storage.listdir(storage.join(stage_dir, "steps"))):
        problems += check_parts(folder)
    if "inputs_hash" in st:
        path = fingerprints_path(output, st["name"], st["stage_hash"])
        try:
            fingerprints = json.loads(storage.read_bytes(path))
        except FileNotFoundError:
            return problems
        except ValueError as e:
            return problems + [f"{path}: not valid JSON ({e}): damaged input fingerprints (the next run writes "
                               "them again)"]
        if short_hash(fingerprints) != st["inputs_hash"]:
            problems.append(f"{path}: not the input fingerprints of plan {st['stage_hash']} (hash "
                            f"{short_hash(fingerprints)}, run.json records {st['inputs_hash']}): damaged (the "
                            "next run writes them again)")
    return problems


def verify_run(output: str, checksums: bool = False, notes: list[str] | None = None) -> list[str]:
    """Every problem with a refinery output judged by its run record alone (decon, generate,
    hydra: outputs without a prep manifest): :func:`verify_receipts` (each final file a receipt
    lists present with its size, and its sha256 with ``checksums``; no receipt of a final
    stage missing), and no temp file of an interrupted write anywhere under ``output``."""
    run_json = storage.join(output, META_DIR, "run.json")
    if not storage.exists(run_json):
        return [f"{run_json}: not found (not a refinery output, or written before run records)"]
    problems = verify_receipts(output, checksums, notes)
    problems += [f"{tmp}: stray temporary file (an interrupted write)" for tmp in storage.find_temp_files(output)]
    return problems
