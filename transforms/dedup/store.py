"""Where the sign stage leaves each document, and reading it back by node.

A sign unit writes, under its stage's parts:

- ``docs/<unit>.bin``: one checksummed frame of its documents' index
  (:data:`~.sign.DOC_DTYPE`: row, text hash, where its shingle set lies), by row;
- ``sets/<unit>.bin`` (minhash mode): every document's shingle set, sorted distinct uint64s,
  one after another (read by range: :func:`~.frames.read_runs`).

:class:`SetStore` finds nodes there: their text hashes and shingle sets, many at once."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from refinery.transforms.dedup import graph
from refinery.transforms.dedup.frames import gather_runs, read_frames, read_runs
from refinery.transforms.dedup.sign import DOC_DTYPE
from refinery.transforms.io import storage


def docs_file(unit_id: str) -> str:
    return f"docs/{unit_id}.bin"


def sets_file(unit_id: str) -> str:
    return f"sets/{unit_id}.bin"


@dataclass
class Located:
    """Nodes found: the text hash halves, and their sets' unit, start and size."""

    units: np.ndarray
    starts: np.ndarray
    counts: np.ndarray
    text_hi: np.ndarray
    text_lo: np.ndarray

    def subset(self, sel: slice | np.ndarray) -> Located:
        return Located(self.units[sel], self.starts[sel], self.counts[sel], self.text_hi[sel], self.text_lo[sel])


class SetStore:
    """The documents of a sign stage's units (``unit_ids``, in plan order: a node's unit is its
    index there), their indexes read as needed, the last :data:`CACHED` kept."""

    CACHED = 8

    def __init__(self, parts_dir: str, unit_ids: list[str]):
        self.parts_dir, self.unit_ids = parts_dir, unit_ids
        self._docs: OrderedDict[int, np.ndarray] = OrderedDict()

    def docs(self, unit: int) -> np.ndarray:
        """The index of the sign unit numbered ``unit``."""
        if unit not in self._docs:
            path = storage.join(self.parts_dir, docs_file(self.unit_ids[unit]))
            self._docs[unit] = read_frames([(path, 0, storage.file_size(path) or 0)], DOC_DTYPE)
            if len(self._docs) > self.CACHED:
                self._docs.popitem(last=False)
        self._docs.move_to_end(unit)
        return self._docs[unit]

    def locate(self, nodes: np.ndarray) -> Located:
        """Where each of ``nodes`` is; ValueError naming a node no sign unit wrote."""
        units, rows = graph.unit_of(nodes), graph.row_of(nodes).astype(np.uint64)
        out = Located(units, np.zeros(len(nodes), np.int64), np.zeros(len(nodes), np.int64),
                      np.zeros(len(nodes), np.uint64), np.zeros(len(nodes), np.uint64))
        for u in np.unique(units).tolist():
            sel = np.flatnonzero(units == u)
            docs = self.docs(u)
            at = np.searchsorted(docs["row"], rows[sel])
            found = (at < len(docs)) & (docs["row"][np.minimum(at, len(docs) - 1)] == rows[sel]) if len(docs) \
                else np.zeros(len(sel), dtype=bool)
            if not found.all():
                missing = int(rows[sel][~found][0])
                raise ValueError(f"sign unit {self.unit_ids[u]} has no document at row {missing}: its index is not "
                                 "what the later stages read; run the same command again with --verify-checksums")
            hit = docs[at]
            out.starts[sel], out.counts[sel] = hit["start"].astype(np.int64), hit["count"].astype(np.int64)
            out.text_hi[sel], out.text_lo[sel] = hit["text_hi"], hit["text_lo"]
        return out

    def sets(self, located: Located) -> np.ndarray:
        """The shingle sets of ``located``, concatenated in its order (sizes: ``located.counts``)."""
        order = np.argsort(located.units, kind="stable")
        units, counts = located.units[order], located.counts[order]
        blocks = []
        for u in np.unique(units).tolist():
            sel = order[units == u]
            path = storage.join(self.parts_dir, sets_file(self.unit_ids[u]))
            blocks.append(read_runs(path, located.starts[sel], located.counts[sel]))
        joined = np.concatenate(blocks) if blocks else np.zeros(0, np.uint64)
        where = np.empty(len(order), dtype=np.int64)
        where[order] = np.cumsum(counts) - counts
        return gather_runs(joined, where, located.counts)
