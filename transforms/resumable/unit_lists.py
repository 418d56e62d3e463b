"""A stage's plan written into the output, so that a job carries where its units are, not the units.

A command's Beam job must not grow with the corpus (Dataflow refuses a job graph over 10 MB;
users bring 10^5 to 10^6 input files). So the driver writes each stage's plan, and the units
of each step it runs, as parts under OUTPUT; the job holds a :class:`PlanRef` (a folder, a
unit count, each part's sha256) and reads the parts in its workers::

    OUTPUT/.refinery/<stage>/<stage_hash>/plan/part-NNNNN.jsonl         the whole plan, in order
    OUTPUT/.refinery/<stage>/<stage_hash>/plan/index.json               each part's size and sha256
    OUTPUT/.refinery/<stage>/<stage_hash>/steps/<key>/part-NNNNN.jsonl  the units one job runs,
                                                                        when not the whole plan
    OUTPUT/.refinery/<stage>/<stage_hash>/steps/<key>/index.json

A part holds up to :data:`PART_UNITS` units, one JSON line each: ``[unit id, payload]``. A plan
is a pure function of its stage hash, and a step's units of their ids (``key`` is their
hash), so two runs write the same bytes under the same names. Parts are checked by content,
never by size alone: the driver compares each part already there with the bytes it would
write and writes a lost, cut or edited one again (:func:`write_units`); a worker reads a
part only if its sha256 is the one in the job's :class:`PlanRef` (:func:`read_part`); and
``refinery verify`` checks the parts against ``index.json`` (:func:`check_parts`).
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, replace
from typing import Any

from refinery.transforms.io import storage
from refinery.transforms.resumable.units import Unit

log = logging.getLogger("refinery")

PART_UNITS = 4096  # units per part: a part is one read in a worker, ~1 MB for a tokenize plan of small files
INDEX = "index.json"  # beside the parts: each part's size and sha256 (what verify checks)


@dataclass(frozen=True)
class PlanRef:
    """Where a list of units lies in the output: ``folder/part-NNNNN.jsonl`` for ``parts`` parts,
    ``units`` units in all; ``sha256``: each part's, as the driver wrote it (:func:`write_units`;
    empty until then: such a reference cannot be read). Small and picklable: what a job
    carries instead of the units (64 characters per 4,096 units)."""

    folder: str
    units: int
    sha256: tuple[str, ...] = ()

    @property
    def parts(self) -> int:
        return -(-self.units // PART_UNITS)

    def part_path(self, k: int) -> str:
        return storage.join(self.folder, f"part-{k:05d}.jsonl")


def unit_lines(units: list[Unit[Any]]) -> bytes:
    """The bytes of one part: a JSON line ``[id, payload]`` per unit (keys sorted)."""
    return "".join(json.dumps([u.id, u.payload], sort_keys=True, ensure_ascii=False) + "\n"
                   for u in units).encode("utf-8")


def _index_bytes(ref: PlanRef, sizes: list[int]) -> bytes:
    parts = [{"path": storage.basename(ref.part_path(k)), "bytes": n, "sha256": h}
             for k, (n, h) in enumerate(zip(sizes, ref.sha256))]
    return (json.dumps({"units": ref.units, "parts": parts}, indent=1, sort_keys=True) + "\n").encode()


def _write_unless_same(path: str, data: bytes) -> bool:
    """Write ``data`` to ``path`` atomically unless the file there holds exactly these bytes
    (compared by content: a same-size edit is written over); whether it was written."""
    size = storage.file_size(path)
    if size == len(data) and storage.read_bytes(path) == data:
        return False
    if size is not None:
        log.warning("%s: not the bytes of this plan (damaged after it was written): written again", path)
    storage.atomic_write_bytes(path, data)
    return True


def write_units(ref: PlanRef, units: list[Unit[Any]]) -> tuple[PlanRef, int]:
    """Write ``units`` as ``ref``'s parts, each atomically, and their ``index.json``, except a
    file already there with the same bytes (a plan is a pure function of where it lies);
    returns ``ref`` with each part's sha256 (what the workers check) and the parts written."""
    if len(units) != ref.units:
        raise ValueError(f"{ref.folder}: {len(units)} units for a reference to {ref.units}")
    written, digests, sizes = 0, [], []
    for k in range(ref.parts):
        data = unit_lines(units[k * PART_UNITS:(k + 1) * PART_UNITS])
        written += _write_unless_same(ref.part_path(k), data)
        digests.append(hashlib.sha256(data).hexdigest())
        sizes.append(len(data))
    ref = replace(ref, sha256=tuple(digests))
    if ref.parts:
        _write_unless_same(storage.join(ref.folder, INDEX), _index_bytes(ref, sizes))
    return ref, written


def read_part(ref: PlanRef, k: int) -> list[Unit[Any]]:
    """The units of part ``k`` of ``ref``, in order; ValueError naming the part when it is not
    what the reference says (missing, cut short, edited: its sha256 is not the one the driver
    wrote, or not JSON lines of ``[id, payload]``). A damaged part is never used: the next
    run's driver writes it again."""
    path = ref.part_path(k)
    try:
        raw = storage.read_bytes(path)
    except FileNotFoundError:
        raise ValueError(f"{path}: missing (the plan written by the driver of this job)") from None
    if len(ref.sha256) != ref.parts:
        raise ValueError(f"{path}: the job's plan reference has no sha256 of its parts (write_units records them)")
    if (got := hashlib.sha256(raw).hexdigest()) != ref.sha256[k]:
        raise ValueError(f"{path}: sha256 {got[:16]}... is not that of the part the driver wrote "
                         f"({ref.sha256[k][:16]}...): damaged, not used (the next run writes it again)")
    try:
        units = [Unit(uid, payload) for uid, payload in map(json.loads, raw.splitlines())]
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: not a plan part ({e})") from None
    want = min(PART_UNITS, ref.units - k * PART_UNITS)
    if len(units) != want:
        raise ValueError(f"{path}: {len(units)} units, the plan says {want}")
    return units


def read_units(ref: PlanRef) -> list[Unit[Any]]:
    """Every unit ``ref`` names, in order."""
    return [u for k in range(ref.parts) for u in read_part(ref, k)]


def check_parts(folder: str) -> list[str]:
    """Problems with the plan parts in ``folder`` by its ``index.json`` ([] if none, or if
    there is no index: the parts are written again when a run needs them): each part there
    must have the size and sha256 the index records (a missing part is no problem: the next
    run that needs it writes it)."""
    index_path = storage.join(folder, INDEX)
    try:
        index = json.loads(storage.read_bytes(index_path))
        entries = [(str(p["path"]), int(p["bytes"]), str(p["sha256"])) for p in index["parts"]]
    except FileNotFoundError:
        return []
    except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError) as e:
        return [f"{index_path}: not a plan index ({type(e).__name__}: {e})"]
    problems = []
    for name, size, sha in entries:
        path = storage.join(folder, storage.basename(name))
        got = storage.file_size(path)
        if got is None:
            continue
        if got != size:
            problems.append(f"{path}: {got} bytes, {index_path} records {size}: a damaged plan part "
                            "(the next run writes it again)")
        elif storage.sha256_file(path) != sha:
            problems.append(f"{path}: sha256 differs from {index_path}: a damaged plan part "
                            "(the next run writes it again)")
    return problems
