"""Numpy records between dedup's stages: hash-partitioned frames, and sets read by range.

A stage that hands records to the next one partitioned by a hash (the band keys to the
bucket units, the candidate pairs to the verify units) writes one file per unit holding one
zstd frame per partition (with its content checksum, checked on reading), the partition's
records as a numpy structured array; the unit's receipt lists the frames as ``[partition,
offset, length]`` (:func:`write_partitioned`). A unit of the next stage reads its
partition's frame from every file (:func:`read_frames`, a ranged read each): the shuffle
goes through files, as decon's scan hands its hits to its reduce.

Shingle sets are read by range (:func:`read_runs`): many runs of uint64 values at once, from
a local file through a read-only map, from an object store by ranged reads of runs close
together.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np
import zstandard

from refinery.transforms.io import storage

REBUILD_HINT = "run the same command again with --verify-checksums to rebuild it"
GAP_VALUES = 1 << 13  # runs of an object store read together when at most this many values apart


def compress_frame(data: bytes) -> bytes:
    """One zstd frame of ``data`` with its content checksum."""
    return zstandard.ZstdCompressor(level=1, write_checksum=True).compress(data)


def decompress_frame(frame: bytes, where: str) -> bytes:
    """The data of a :func:`compress_frame` frame; ValueError naming ``where`` if it is damaged."""
    try:
        if not zstandard.get_frame_parameters(frame).has_checksum:
            raise zstandard.ZstdError("the frame carries no checksum")
        return zstandard.ZstdDecompressor().decompress(frame)
    except zstandard.ZstdError as e:
        raise ValueError(f"{where}: damaged zstd frame ({e}); {REBUILD_HINT}") from None


def write_partitioned(out: storage.BinaryWriter, records: np.ndarray, partition: np.ndarray) -> list[list[int]]:
    """Write ``records`` to ``out`` as one frame per partition (``partition[i]``: record i's),
    partitions ascending, records in their order within each; returns ``[[partition, offset,
    length], ...]`` of the frames written (none for an empty partition)."""
    order = np.argsort(partition, kind="stable")
    records, partition = records[order], partition[order]
    cuts = np.flatnonzero(np.r_[True, partition[1:] != partition[:-1]]) if len(partition) else np.zeros(0, np.int64)
    bounds = np.r_[cuts, len(partition)]
    frames: list[list[int]] = []
    offset = 0
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        frame = compress_frame(records[lo:hi].tobytes())
        out.write(frame)
        frames.append([int(partition[lo]), offset, len(frame)])
        offset += len(frame)
    return frames


def read_frames(sources: Iterable[tuple[str, int, int]], dtype: np.dtype[Any]) -> np.ndarray:
    """The records of the frames ``(path, offset, length)``, concatenated in the order given."""
    parts = []
    for path, offset, length in sources:
        where = f"{path} frame at bytes {offset}-{offset + length}"
        data = decompress_frame(storage.read_range(path, offset, offset + length), where)
        if len(data) % dtype.itemsize:
            raise ValueError(f"{where}: {len(data)} bytes, not whole records of {dtype.itemsize}; {REBUILD_HINT}")
        parts.append(np.frombuffer(data, dtype=dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def frames_by_partition(files: Sequence[tuple[str, Sequence[Sequence[int]]]]) -> dict[int, list[tuple[str, int, int]]]:
    """``{partition: [(path, offset, length), ...]}`` of the frames each file's receipt lists
    (``files``: ``(path, frames)`` in plan order: a partition's frames are read in that order)."""
    out: dict[int, list[tuple[str, int, int]]] = {}
    for path, frames in files:
        for p, offset, length in frames:
            out.setdefault(int(p), []).append((path, int(offset), int(length)))
    return out


def gather_runs(values: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The runs ``values[starts[i] : starts[i] + counts[i]]``, concatenated."""
    total = int(counts.sum())
    if not total:
        return np.zeros(0, dtype=values.dtype)
    base = np.repeat(starts - (np.cumsum(counts) - counts), counts)
    return np.asarray(values[base + np.arange(total)])


def read_runs(path: str, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The runs of uint64 values ``[starts[i], starts[i] + counts[i])`` of the file ``path``
    (little-endian uint64s), concatenated in the order given. A local file is mapped
    read-only for the call; an object's runs are read by ranges, runs at most
    :data:`GAP_VALUES` apart in one read."""
    starts, counts = starts.astype(np.int64), counts.astype(np.int64)
    if not int(counts.sum()):
        return np.zeros(0, dtype="<u8")
    if not storage.is_remote(path):
        mapped = np.memmap(storage.resolved(path), dtype="<u8", mode="r")
        try:
            return gather_runs(mapped, starts, counts).copy()
        finally:
            del mapped
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], starts[order] + counts[order]
    reach = np.maximum.accumulate(e)
    breaks = np.flatnonzero(s[1:] > reach[:-1] + GAP_VALUES) + 1
    lo_idx, hi_idx = np.r_[0, breaks], np.r_[breaks, len(s)]
    pieces, where = [], np.zeros(len(s), dtype=np.int64)
    base = 0
    for a, b in zip(lo_idx.tolist(), hi_idx.tolist()):
        first, last = int(s[a]), int(reach[b - 1])
        pieces.append(np.frombuffer(storage.read_range(path, first * 8, last * 8), dtype="<u8"))
        where[a:b] = base + (s[a:b] - first)
        base += last - first
    joined = np.concatenate(pieces)
    moved = np.empty(len(starts), dtype=np.int64)
    moved[order] = where
    return gather_runs(joined, moved, counts)
