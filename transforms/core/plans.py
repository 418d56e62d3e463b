"""A stage's plan written into the output, so that a job carries where its units are, not the units.

A command's Beam job must not grow with the corpus (Dataflow refuses a job graph over 10 MB;
users bring 10^5 to 10^6 input files). So the driver writes each stage's plan, and the units
of each step it runs, as parts under OUTPUT; the job holds a :class:`PlanRef` (a folder, a
unit count, a part count) and reads the parts in its workers::

    OUTPUT/.refinery/<stage>/<stage_hash>/plan/part-NNNNN.jsonl         the whole plan, in order
    OUTPUT/.refinery/<stage>/<stage_hash>/steps/<key>/part-NNNNN.jsonl  the units one job runs,
                                                                        when not the whole plan

A part holds up to :data:`PART_UNITS` units, one JSON line each: ``[unit id, payload]``. A plan
is a pure function of its stage hash, and a step's units of their ids (``key`` is their
hash), so two runs write the same bytes under the same names, and a part already there with
its size is not written again (a deleted or cut part is written again by the next run).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from refinery.transforms.core import storage
from refinery.transforms.core.units import Unit

PART_UNITS = 4096  # units per part: a part is one read in a worker, ~1 MB for a tokenize plan of small files


@dataclass(frozen=True)
class PlanRef:
    """Where a list of units lies in the output: ``folder/part-NNNNN.jsonl`` for ``parts`` parts,
    ``units`` units in all. Small and picklable: what a job carries instead of the units."""

    folder: str
    units: int

    @property
    def parts(self) -> int:
        return -(-self.units // PART_UNITS)

    def part_path(self, k: int) -> str:
        return storage.join(self.folder, f"part-{k:05d}.jsonl")


def unit_lines(units: list[Unit]) -> bytes:
    """The bytes of one part: a JSON line ``[id, payload]`` per unit (keys sorted)."""
    return "".join(json.dumps([u.id, u.payload], sort_keys=True, ensure_ascii=False) + "\n"
                   for u in units).encode("utf-8")


def write_units(ref: PlanRef, units: list[Unit]) -> int:
    """Write ``units`` as ``ref``'s parts, each atomically, except a part already there with its
    size (a plan is a pure function of where it lies: the same bytes); the parts written."""
    if len(units) != ref.units:
        raise ValueError(f"{ref.folder}: {len(units)} units for a reference to {ref.units}")
    written = 0
    for k in range(ref.parts):
        data = unit_lines(units[k * PART_UNITS:(k + 1) * PART_UNITS])
        if storage.file_size(ref.part_path(k)) != len(data):
            storage.atomic_write_bytes(ref.part_path(k), data)
            written += 1
    return written


def read_part(ref: PlanRef, k: int) -> list[Unit]:
    """The units of part ``k`` of ``ref``, in order; ValueError naming the part when it is not
    what the reference says (missing, cut short, or not JSON lines of ``[id, payload]``)."""
    path = ref.part_path(k)
    try:
        lines = storage.read_bytes(path).splitlines()
        units = [Unit(uid, payload) for uid, payload in map(json.loads, lines)]
    except FileNotFoundError:
        raise ValueError(f"{path}: missing (the plan written by the driver of this job)") from None
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: not a plan part ({e})") from None
    want = min(PART_UNITS, ref.units - k * PART_UNITS)
    if len(units) != want:
        raise ValueError(f"{path}: {len(units)} units, the plan says {want}")
    return units


def read_units(ref: PlanRef) -> list[Unit]:
    """Every unit ``ref`` names, in order."""
    return [u for k in range(ref.parts) for u in read_part(ref, k)]
