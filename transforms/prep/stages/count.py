"""The count stage: the rows before each byte range of a big local ``.jsonl``, counted in
parallel inside the job (tokenize numbers a range's rows from them)."""
from __future__ import annotations

from typing import Any, TypedDict

from refinery.transforms.io import storage
from refinery.transforms.prep.stages.config import PrepConfig, check_unchanged
from refinery.transforms.resumable import (
    Stage,
    StageConfig,
    StageRun,
    Traits,
    Unit,
    UnitContext,
)


def range_newlines(path: str, lo: int, hi: int, chunk: int = 1 << 24) -> int:
    """The newlines in bytes ``[lo, hi)`` of a local file."""
    count = 0
    with open(path, "rb") as f:
        f.seek(lo)
        left = hi - lo
        while left > 0 and (data := f.read(min(chunk, left))):
            count += data.count(b"\n")
            left -= len(data)
    return count


def byte_ranges(size: int, step: int) -> list[tuple[int, int]]:
    """The byte ranges a big ``.jsonl`` of ``size`` bytes is split into: ``step`` bytes each."""
    return [(lo, min(lo + step, size)) for lo in range(0, size, step)]


def count_span(ranges: list[tuple[int, int]], k: int) -> tuple[int, int]:
    """The bytes whose newlines range ``k`` contributes to the row numbers of the ranges after
    it: ``[lo - 1, next lo - 1)`` (``[0, ...)`` for the first). A range's rows are numbered
    from :func:`row_bases`: 0 for the first, else 1 + the newlines before its ``lo - 1``, the
    lines that start before it (a line starts at 0 and after each newline)."""
    lo, hi = ranges[k]
    return max(lo - 1, 0), hi - 1


def row_bases(newlines: list[int]) -> list[int]:
    """Each range's first row number, from the newlines each range but the last counted
    (:func:`count_span`)."""
    out, seen = [0], 0
    for n in newlines:
        seen += n
        out.append(1 + seen)
    return out


def split_by_range(f: storage.InputFile, unit_bytes: int) -> bool:
    """Whether tokenize splits ``f`` into byte ranges: a local ``.jsonl`` over twice ``unit_bytes``."""
    return storage.has_suffix(f.path, ".jsonl") and not storage.is_remote(f.path) and 0 < 2 * unit_bytes < f.size


class CountPayload(TypedDict):
    """A count unit's payload: its file (as planned) and the bytes whose newlines it counts."""

    path: str
    fingerprint: dict[str, Any]  # storage.InputFile.fingerprint() when planned
    span: list[int]  # [lo, hi) bytes: count_span of the unit's byte range


class CountStats(TypedDict):
    """A count unit's receipt stats."""

    newlines: int


class CountRowsStage(Stage[CountPayload, CountStats]):
    """Unit: a byte range of a big local ``.jsonl`` (all but the last of its file) -> the
    newlines of its :func:`count_span`, in its receipt's stats (no file).

    The rows of a byte range are numbered from the lines before it, which the driver would
    otherwise read the whole file to count; these units count them in parallel, inside the
    job, and tokenize takes the row bases from their receipts (a side input). Present only
    when some input is split by byte range. The counts are a pure function of the input files,
    which tokenize's hash covers: this stage does not enter the hashes after it (``chained``),
    so plans made before it existed keep theirs.
    """

    name = "count"

    def __init__(self, cfg: PrepConfig, files: list[tuple[int, storage.InputFile]]):
        self.cfg = cfg
        self.files = files  # (input index, file) of the inputs split by byte range

    def traits(self) -> Traits:
        return Traits(title="Count rows", chained=False, driver_only=("files",))

    def config(self) -> StageConfig:
        return StageConfig(self._settings(), self._inputs())

    def _settings(self) -> dict[str, Any]:
        return {"unit_bytes": self.cfg.unit_bytes}

    def _inputs(self) -> list[dict[str, Any]]:
        return [f.fingerprint() for _, f in self.files]

    def make_plan(self) -> list[Unit[CountPayload]]:
        units: list[Unit[CountPayload]] = []
        for i, f in self.files:
            ranges = byte_ranges(f.size, self.cfg.unit_bytes)
            units += [Unit(f"{i:05d}-r{k:04d}", CountPayload(path=f.path, fingerprint=f.fingerprint(),
                                                             span=list(count_span(ranges, k))))
                      for k in range(len(ranges) - 1)]
        return units

    def run_unit(self, unit: Unit[CountPayload], ctx: UnitContext) -> CountStats:
        check_unchanged(unit.payload)
        lo, hi = unit.payload["span"]
        newlines = range_newlines(unit.payload["path"], lo, hi)
        check_unchanged(unit.payload)
        return {"newlines": newlines}

    @staticmethod
    def bases(run: StageRun) -> dict[str, int]:
        """Tokenize unit id -> the row its byte range starts at, from the receipts of ``run``
        (this stage, bound): read once per job and handed to every tokenize unit."""
        receipts = run.completed_receipts()
        counts: dict[str, list[int]] = {}
        for u in run.stage.plan():
            if u.id not in receipts:
                raise RuntimeError(f"count unit {u.id} is not complete")
            counts.setdefault(u.id.split("-r")[0], []).append(int(receipts[u.id]["stats"]["newlines"]))
        return {f"{i}-r{k:04d}": base for i, newlines in counts.items() for k, base in enumerate(row_bases(newlines))}
