"""The stages of ``refinery dedup`` (thin wiring over :mod:`.sign`, :mod:`.graph`,
:mod:`.minhash` and :mod:`.store`)::

    sign        unit = a slice of an input file (decon's slicing): rows read and normalized as
                prep reads them, each document signed; its records written as one frame per
                bucket partition, its documents' index and (minhash) shingle sets
    bucket      unit = a bucket partition: its records from every sign unit; the exact band's
                groups -> exact edges; the near bands' buckets (2 to --max-bucket texts)
                -> candidate pairs, one frame per verify partition; larger buckets skipped,
                counted and sampled
    verify      (minhash) unit = a pair partition: its candidate pairs from every bucket unit,
                each counted once, kept when the Jaccard of the shingle sets is >= --threshold
    components  one unit: the connected components of the exact and verified edges; each
                component's smallest node is its kept row; every other row's Jaccard to it
    report      one unit: dup_list.jsonl, clusters.jsonl, report.md, dedup_stats.json,
                stats/input_files.jsonl, then .SUCCESS

Every intermediate file is a checksummed frame or a file whose size the receipt records;
every output is a pure function of the inputs and the settings, so a killed run finished
writes the bytes an uninterrupted run writes.
"""
from __future__ import annotations

import contextlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, TypedDict

import numpy as np

from refinery.transforms.decon.stages import TrainSlice, plan_train_units
from refinery.transforms.dedup import graph
from refinery.transforms.dedup.frames import (
    compress_frame,
    frames_by_partition,
    read_frames,
    write_partitioned,
)
from refinery.transforms.dedup.minhash import DEFAULT_THRESHOLD, SHINGLE_WORDS, MinHashParams, jaccard_many
from refinery.transforms.dedup.report import ClusterExample, InputShare, ReportData, render_report
from refinery.transforms.dedup.sign import DOC_DTYPE, MODES, doc_records, key_partition, key_records, sign_batch
from refinery.transforms.dedup.store import SetStore, docs_file, sets_file
from refinery.transforms.formats.droplist import ReadSpec, TrainFile, file_sha256
from refinery.transforms.formats.duplist import CLUSTERS, DUP_LIST, INPUT_FILES, REPORT, STATS
from refinery.transforms.io import storage
from refinery.transforms.io.jsonl import jsonl
from refinery.transforms.io.rows import CORRUPT, DEFAULT_MAX_ROW_BYTES, iter_rows
from refinery.transforms.io.text import TEXT_NORMALIZATION, TextSpec
from refinery.transforms.prep.documents import Rejected, row_normalizer
from refinery.transforms.prep.stages import check_unchanged
from refinery.transforms.resumable import Stage, StageConfig, StageRun, StageWiring, Traits, Unit, UnitContext
from refinery.transforms.resumable.progress import human_bytes, rate

FORMAT = 1
DEFAULT_MAX_BUCKET = 100
DEFAULT_PARTITIONS = 16
BATCH_CHARS = 4 << 20  # characters of text signed at once
HELD_RECORDS = 1 << 20  # key records a sign unit holds before it writes their frames
JACCARD_VALUES = 1 << 23  # shingle values compared at once (both sides)
REASONS_KEPT = 8
SUCCESS = ".SUCCESS"


@dataclass
class DedupConfig:
    """What ``refinery dedup`` computes (its flags, checked); the inputs are the sign stage's."""

    output: str
    mode: str = "minhash"
    text_field: str = "text"
    text_template: str | None = None
    id_field: str = "id"
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES
    params: MinHashParams = field(default_factory=MinHashParams)
    threshold: float = DEFAULT_THRESHOLD
    max_bucket: int = DEFAULT_MAX_BUCKET
    partitions: int = DEFAULT_PARTITIONS
    slice_bytes: int = 64 << 20
    report_clusters: int = 10
    verify_inputs_by_content: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"--threshold must be in (0, 1], not {self.threshold}")
        for name in ("max_bucket", "partitions", "slice_bytes", "max_row_bytes"):
            if getattr(self, name) < (2 if name == "max_bucket" else 1):
                raise ValueError(f"--{name.replace('_', '-')} is too small: {getattr(self, name)}")
        _ = self.text  # a bad template raises here

    @property
    def text(self) -> TextSpec:
        return TextSpec.from_options(None, self.text_template, self.text_field)

    @property
    def minhash(self) -> bool:
        return self.mode == "minhash"

    def read_identity(self) -> dict[str, Any]:
        """How rows are read into text: what every stage's hash starts from."""
        return {"format": FORMAT, "mode": self.mode, **self.text.identity(), "id_field": self.id_field,
                "max_row_bytes": self.max_row_bytes, "text_normalization": TEXT_NORMALIZATION}


# ---------------------------------------------------------------------------------------
# Frames of an upstream stage, as a side input
# ---------------------------------------------------------------------------------------

def upstream_frames(run: StageRun, folder: str) -> dict[int, list[tuple[str, int, int]]]:
    """``{partition: [(path, offset, length), ...]}`` of every unit of the finished stage
    ``run`` (its units' files ``<folder>/<unit>.bin``, frames listed in their receipts), in
    plan order."""
    plan = run.stage.plan()
    receipts = run.completed_receipts(plan)
    missing = [u.id for u in plan if u.id not in receipts]
    if missing:
        raise RuntimeError(f"{run.name} units not completed: {missing[:5]}")
    return frames_by_partition([(storage.join(run.parts_dir, f"{folder}/{u.id}.bin"),
                                 receipts[u.id]["stats"]["frames"]) for u in plan])


class FramesWiring(StageWiring):
    """A partition stage's Beam wiring: where its upstream stage's frames are, computed once
    that stage is done, as a side input (every unit reads its partition's frames)."""

    def __init__(self, upstream: str, folder: str):
        self.upstream, self.folder = upstream, folder

    def side_inputs(self, run: StageRun, start: Any) -> dict[str, Any]:
        import apache_beam as beam  # lazy: Beam loads with the job, not with the command

        frames = start | "Frames" >> beam.Map(lambda _, up, folder: upstream_frames(up, folder),
                                              run.upstream[self.upstream], self.folder)
        return {"frames": beam.pvalue.AsSingleton(frames, default_value=None)}


def _frames(ctx: UnitContext, upstream: str, folder: str, p: int) -> list[tuple[str, int, int]]:
    table = ctx.side.get("frames")
    if table is None:  # run without Beam (tests, a direct stage run)
        table = upstream_frames(ctx.upstream(upstream), folder)
    return list(table.get(p, []))


def write_frame(ctx: UnitContext, name: str, records: np.ndarray) -> None:
    """``records`` as one checksummed frame, the unit's part ``name``."""
    ctx.write_bytes(ctx.part_path(name), compress_frame(records.tobytes()))


def read_part(run: StageRun, name: str, dtype: np.dtype[Any]) -> np.ndarray:
    """A :func:`write_frame` part of ``run``'s units."""
    path = storage.join(run.parts_dir, name)
    return read_frames([(path, 0, storage.file_size(path) or 0)], dtype)


# ---------------------------------------------------------------------------------------
# sign
# ---------------------------------------------------------------------------------------

class SignStats(TypedDict):
    rows: int          # rows read
    documents: int     # rows with text (not empty once normalized)
    empty: int         # rows whose text normalized to nothing
    rejected: int      # rows without text (unreadable, too large, no text field...): prep rejects them
    rejected_reasons: dict[str, int]
    corrupt: str       # the file's content ends in damage (the rows before it were read), or ""
    chars: int
    shingles: int
    frames: list[list[int]]


class _Signer:
    """A sign unit's rows read into batches, each signed and written."""

    def __init__(self, cfg: DedupConfig, unit: int, keys_out: storage.BinaryWriter,
                 docs: list[np.ndarray], sets_out: storage.BinaryWriter | None):
        self.cfg, self.unit, self.keys_out, self.docs, self.sets_out = cfg, unit, keys_out, docs, sets_out
        self.rows_list: list[int] = []
        self.texts: list[str] = []
        self.chars = self.batch_chars = self.values = self.offset = 0
        self.held: list[np.ndarray] = []
        self.frames: list[list[int]] = []

    def add(self, row: int, text: str) -> None:
        self.rows_list.append(row)
        self.texts.append(text)
        self.batch_chars += len(text)
        if self.batch_chars >= BATCH_CHARS:
            self.flush()

    def flush(self, last: bool = False) -> None:
        if self.texts:
            batch = sign_batch(self.rows_list, self.texts, self.cfg.mode, self.cfg.params)
            self.docs.append(doc_records(batch, self.values))
            if self.sets_out is not None:
                self.sets_out.write(batch.values.astype("<u8").tobytes())
            self.values += len(batch.values)
            self.held.append(key_records(batch, self.unit))
            self.chars += self.batch_chars
            self.rows_list, self.texts, self.batch_chars = [], [], 0
        if self.held and (last or sum(len(h) for h in self.held) >= HELD_RECORDS):
            records = np.concatenate(self.held)
            self.held = []
            frames = write_partitioned(self.keys_out, records, key_partition(records, self.cfg.partitions))
            self.frames += [[p, self.offset + o, n] for p, o, n in frames]
            self.offset += sum(n for _, _, n in frames)


class SignStage(Stage[TrainSlice, SignStats]):
    """Unit: a slice of an input file -> its documents signed."""

    name = "sign"

    def __init__(self, cfg: DedupConfig, inputs: list[storage.InputFile]):
        self.cfg, self.inputs = cfg, inputs

    def traits(self) -> Traits:
        return Traits(title="Sign documents", progress_text=self._progress_text, driver_only=("inputs",))

    def config(self) -> StageConfig:
        cfg = self.cfg
        settings = {**cfg.read_identity(), "slice_bytes": cfg.slice_bytes, "partitions": cfg.partitions,
                    **({"minhash": cfg.params.identity()} if cfg.minhash else {})}
        return StageConfig(settings, [f.fingerprint() for f in self.inputs])

    def make_plan(self) -> list[Unit[TrainSlice]]:
        return plan_train_units(self.inputs, self.cfg.slice_bytes)

    def _progress_text(self, stats: Mapping[str, Any], seconds: float) -> str:
        read = stats.get("chars", 0)
        return ", ".join(filter(None, [f"docs={int(stats.get('documents', 0)):,}", human_bytes(read),
                                       rate(read / 1e6, seconds, "MB")]))

    def run_unit(self, unit: Unit[TrainSlice], ctx: UnitContext) -> SignStats:
        cfg, p = self.cfg, unit.payload
        check_unchanged({"path": p["path"], "fingerprint": _fingerprint(ctx.run, p["path"])})
        number = next(i for i, u in enumerate(self.plan()) if u.id == unit.id)
        docs: list[np.ndarray] = []
        stats: SignStats = {"rows": 0, "documents": 0, "empty": 0, "rejected": 0, "rejected_reasons": {},
                            "corrupt": "", "chars": 0, "shingles": 0, "frames": []}
        reasons: Counter[str] = Counter()
        with ctx.open_write(ctx.part_path(f"keys/{unit.id}.bin")) as keys_out, contextlib.ExitStack() as more:
            sets_out = more.enter_context(ctx.open_write(ctx.part_path(sets_file(unit.id)))) if cfg.minhash else None
            signer = _Signer(cfg, number, keys_out, docs, sets_out)
            normalize = row_normalizer(cfg.text, cfg.id_field)
            for row, record, error in _slice_rows(p, cfg):
                stats["rows"] += 1
                doc = normalize(record, error, p["path"], row, p["relpath"])
                if isinstance(doc, Rejected):
                    if doc.empty:
                        stats["empty"] += 1
                        continue
                    stats["rejected"] += 1
                    reasons[doc.reason if not doc.reason.startswith(CORRUPT) else CORRUPT] += 1
                    stats["corrupt"] = doc.reason if doc.reason.startswith(CORRUPT) else stats["corrupt"]
                    continue
                stats["documents"] += 1
                signer.add(row, doc.text)
                if not stats["rows"] & 4095:
                    ctx.report_progress({"rows": stats["rows"], "documents": stats["documents"],
                                         "chars": signer.chars + signer.batch_chars})
            signer.flush(last=True)
        write_frame(ctx, docs_file(unit.id), np.concatenate(docs) if docs else np.zeros(0, DOC_DTYPE))
        check_unchanged({"path": p["path"], "fingerprint": _fingerprint(ctx.run, p["path"])})
        stats["rejected_reasons"] = dict(reasons.most_common(REASONS_KEPT))
        stats["chars"], stats["shingles"], stats["frames"] = signer.chars, signer.values, signer.frames
        return stats


def _fingerprint(run: StageRun, path: str) -> dict[str, Any] | None:
    """The planned fingerprint of the input ``path`` (what the stage hash names)."""
    return next((f for f in run.input_fingerprints() if f["path"] == path), None)


def _slice_rows(p: TrainSlice, cfg: DedupConfig) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    """The rows of a sign unit's slice, read as prep reads them (its columns, its row cap)."""
    columns = [*cfg.text.fields(), cfg.id_field] if storage.has_suffix(p["path"], ".parquet") else None
    if p["kind"] == "bytes":
        return iter_rows(p["path"], columns=columns, byte_range=(p["lo"], p["hi"]), max_row_bytes=cfg.max_row_bytes)
    if p["kind"] == "row_groups":
        return iter_rows(p["path"], row_groups=(p["lo"], p["hi"]), columns=columns, max_row_bytes=cfg.max_row_bytes)
    return iter_rows(p["path"], columns=columns, max_row_bytes=cfg.max_row_bytes)


# ---------------------------------------------------------------------------------------
# bucket
# ---------------------------------------------------------------------------------------

class PartNumber(TypedDict):
    p: int


class BucketStats(TypedDict):
    records: int
    exact_edges: int
    candidates: int
    skipped: dict[str, Any]  # graph.Skipped.to_json(): the buckets over --max-bucket
    frames: list[list[int]]


def exact_part(unit_id: str) -> str:
    return f"exact/{unit_id}.bin"


class BucketStage(Stage[PartNumber, BucketStats]):
    """Unit: a bucket partition -> its exact edges and candidate pairs."""

    name = "bucket"

    def __init__(self, cfg: DedupConfig):
        self.cfg = cfg

    def traits(self) -> Traits:
        return Traits(title="Group buckets", wiring=FramesWiring("sign", "keys"))

    def config(self) -> StageConfig:
        return StageConfig({"max_bucket": self.cfg.max_bucket, "partitions": self.cfg.partitions})

    def make_plan(self) -> list[Unit[PartNumber]]:
        return [Unit(f"part-{p:05d}", {"p": p}) for p in range(self.cfg.partitions)]

    def run_unit(self, unit: Unit[PartNumber], ctx: UnitContext) -> BucketStats:
        records = read_frames(_frames(ctx, "sign", "keys", unit.payload["p"]), graph.KEY_DTYPE)
        exact = records["band"] == graph.EXACT_BAND
        member, first = graph.exact_edges(records[exact])
        edges = np.zeros(len(member), dtype=graph.EDGE_DTYPE)
        edges["a"], edges["b"], edges["jaccard"] = first, member, 1.0
        write_frame(ctx, exact_part(unit.id), edges)
        skipped = graph.Skipped()
        pairs = graph.bucket_pairs(records[~exact], self.cfg.max_bucket, skipped)
        with ctx.open_write(ctx.part_path(f"pairs/{unit.id}.bin")) as out:
            frames = write_partitioned(out, pairs, graph.pair_partition(pairs["a"], pairs["b"], self.cfg.partitions))
        return {"records": len(records), "exact_edges": len(edges), "candidates": len(pairs),
                "skipped": skipped.to_json(), "frames": frames}


# ---------------------------------------------------------------------------------------
# verify
# ---------------------------------------------------------------------------------------

class VerifyStats(TypedDict):
    candidates: int   # pairs read (a pair found in several bands' partitions once each)
    pairs: int        # distinct pairs
    verified: int     # of Jaccard >= the threshold
    below: int        # candidates whose shingle sets are less alike: not duplicates


def edges_part(unit_id: str) -> str:
    return f"edges/{unit_id}.bin"


def sign_unit_ids(sign: StageRun) -> list[str]:
    return [u.id for u in sign.stage.plan()]


def pair_jaccards(store: SetStore, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The Jaccard of the shingle sets of each pair ``(a[i], b[i])``, a bounded batch at a time."""
    where_a, where_b = store.locate(a), store.locate(b)
    sizes = where_a.counts + where_b.counts
    out = np.zeros(len(a), dtype=np.float64)
    lo = 0
    while lo < len(a):
        hi = lo + max(1, int(np.searchsorted(np.cumsum(sizes[lo:]), JACCARD_VALUES)))
        hi = min(hi, lo + (1 << 20), len(a))
        sa, sb = where_a.subset(slice(lo, hi)), where_b.subset(slice(lo, hi))
        out[lo:hi] = jaccard_many(store.sets(sa), sa.counts, store.sets(sb), sb.counts)
        lo = hi
    return out


class VerifyStage(Stage[PartNumber, VerifyStats]):
    """Unit: a pair partition -> its pairs of Jaccard >= the threshold."""

    name = "verify"

    def __init__(self, cfg: DedupConfig):
        self.cfg = cfg

    def traits(self) -> Traits:
        return Traits(title="Verify pairs", wiring=FramesWiring("bucket", "pairs"))

    def config(self) -> StageConfig:
        return StageConfig({"threshold": self.cfg.threshold, "partitions": self.cfg.partitions})

    def make_plan(self) -> list[Unit[PartNumber]]:
        return [Unit(f"part-{p:05d}", {"p": p}) for p in range(self.cfg.partitions)]

    def run_unit(self, unit: Unit[PartNumber], ctx: UnitContext) -> VerifyStats:
        found = read_frames(_frames(ctx, "bucket", "pairs", unit.payload["p"]), graph.PAIR_DTYPE)
        pairs = graph.unique_pairs(found["a"], found["b"])
        sign = ctx.upstream("sign")
        j = pair_jaccards(SetStore(sign.parts_dir, sign_unit_ids(sign)), pairs["a"], pairs["b"])
        keep = j >= self.cfg.threshold
        edges = np.zeros(int(keep.sum()), dtype=graph.EDGE_DTYPE)
        edges["a"], edges["b"], edges["jaccard"] = pairs["a"][keep], pairs["b"][keep], j[keep]
        write_frame(ctx, edges_part(unit.id), edges)
        return {"candidates": len(found), "pairs": len(pairs), "verified": len(edges), "below": len(pairs) - len(edges)}


# ---------------------------------------------------------------------------------------
# components
# ---------------------------------------------------------------------------------------

ASSIGN_DTYPE = np.dtype([("node", "<u8"), ("root", "<u8"), ("cluster", "<u8"), ("jaccard", "<f4"), ("exact", "u1")])
CLUSTER_DTYPE = np.dtype([("root", "<u8"), ("size", "<u8"), ("exact", "<u8"), ("min_jaccard", "<f4"),
                          ("example", "<u8")])
ASSIGN_FILE, CLUSTERS_FILE = "assign.bin", "clusters.bin"


class ComponentsStats(TypedDict):
    edges: int
    clusters: int
    removed: int
    exact_removed: int
    largest: int


def removed_rows(store: SetStore | None, nodes: np.ndarray, roots: np.ndarray) -> np.ndarray:
    """:data:`ASSIGN_DTYPE` of every node that is not its component's root: its root, cluster
    (the roots numbered in order), Jaccard to the root and whether their texts are the same;
    ``store`` None (exact mode): every one the same text, Jaccard 1."""
    gone = nodes != roots
    out = np.zeros(int(gone.sum()), dtype=ASSIGN_DTYPE)
    out["node"], out["root"] = nodes[gone], roots[gone]
    out["cluster"] = np.searchsorted(np.unique(roots), roots[gone])
    if store is None:
        out["jaccard"], out["exact"] = 1.0, 1
        return out
    out["jaccard"] = pair_jaccards(store, out["root"], out["node"])
    mine, theirs = store.locate(out["node"]), store.locate(out["root"])
    out["exact"] = (mine.text_hi == theirs.text_hi) & (mine.text_lo == theirs.text_lo)
    out["jaccard"][out["exact"] == 1] = 1.0
    return out


def cluster_table(assigned: np.ndarray) -> np.ndarray:
    """:data:`CLUSTER_DTYPE` per cluster (by id): root, size (the root included), exact copies,
    the lowest Jaccard of a member to the root and that member (the report's example)."""
    order = np.lexsort((assigned["node"], assigned["jaccard"], assigned["cluster"]))
    by = assigned[order]
    starts, lengths = graph.runs(by["cluster"])
    out = np.zeros(len(starts), dtype=CLUSTER_DTYPE)
    out["root"], out["size"] = by["root"][starts], lengths + 1
    out["exact"] = np.add.reduceat(by["exact"].astype(np.uint64), starts) if len(starts) else 0
    out["min_jaccard"], out["example"] = by["jaccard"][starts], by["node"][starts]
    return out


class ComponentsStage(Stage[PartNumber, ComponentsStats]):
    """One unit: the exact and verified edges -> clusters, and every removed row's Jaccard to its kept row."""

    name = "components"

    def __init__(self, cfg: DedupConfig):
        self.cfg = cfg

    def traits(self) -> Traits:
        return Traits(title="Find clusters", light=True)

    def config(self) -> StageConfig:
        return StageConfig({"clusters": 1})

    def make_plan(self) -> list[Unit[PartNumber]]:
        return [Unit("components", {"p": 0})]

    def run_unit(self, unit: Unit[PartNumber], ctx: UnitContext) -> ComponentsStats:
        bucket, sign = ctx.upstream("bucket"), ctx.upstream("sign")
        parts = [read_part(bucket, exact_part(u.id), graph.EDGE_DTYPE) for u in bucket.stage.plan()]
        if self.cfg.minhash:
            verify = ctx.upstream("verify")
            parts += [read_part(verify, edges_part(u.id), graph.EDGE_DTYPE) for u in verify.stage.plan()]
        edges = np.concatenate(parts) if parts else np.zeros(0, graph.EDGE_DTYPE)
        nodes, roots = graph.components(edges["a"], edges["b"])
        store = SetStore(sign.parts_dir, sign_unit_ids(sign)) if self.cfg.minhash else None
        assigned = removed_rows(store, nodes, roots)
        clusters = cluster_table(assigned)
        write_frame(ctx, ASSIGN_FILE, assigned)
        write_frame(ctx, CLUSTERS_FILE, clusters)
        return {"edges": len(edges), "clusters": len(clusters), "removed": len(assigned),
                "exact_removed": int(assigned["exact"].sum()),
                "largest": int(clusters["size"].max()) if len(clusters) else 0}


def build_stages(cfg: DedupConfig, inputs: list[storage.InputFile]) -> list[Stage[Any, Any]]:
    """THE shape of ``refinery dedup``'s job over ``inputs``: sign -> bucket -> [verify] ->
    components -> report."""
    middle: list[Stage[Any, Any]] = [VerifyStage(cfg)] if cfg.minhash else []
    return [SignStage(cfg, inputs), BucketStage(cfg), *middle, ComponentsStage(cfg), ReportStage(cfg)]


def assignments(run: StageRun) -> tuple[np.ndarray, np.ndarray]:
    """The components unit's (removed rows, clusters)."""
    return read_part(run, ASSIGN_FILE, ASSIGN_DTYPE), read_part(run, CLUSTERS_FILE, CLUSTER_DTYPE)


def dumps(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode()


# ---------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------

class ReportStats(TypedDict):
    rows: int
    documents: int
    empty: int
    rejected: int
    removed: int
    exact_removed: int
    clusters: int
    skipped: dict[str, Any]
    corrupt_files: list[dict[str, str]]


@dataclass
class SignUnits:
    """The sign units in plan order: each one's payload and the rows of its file before it
    (the byte slices before it; 0 for a whole file or row groups, numbered from the file's
    start), and the input files in order with the sign units' counts summed per file."""

    payloads: list[TrainSlice]
    base: np.ndarray
    file_of: np.ndarray
    totals: list[dict[str, int]]
    corrupt: list[dict[str, str]]

    @classmethod
    def of(cls, sign: StageRun, files: int) -> SignUnits:
        plan = sign.stage.plan()
        receipts = sign.completed_receipts(plan)
        before: dict[int, int] = {}
        base, file_of = np.zeros(len(plan), np.int64), np.zeros(len(plan), np.int64)
        totals = [{"rows": 0, "documents": 0, "empty": 0, "rejected": 0} for _ in range(files)]
        corrupt = []
        for i, u in enumerate(plan):
            if u.id not in receipts:
                raise RuntimeError(f"sign unit {u.id} ({u.payload['path']}) is not complete")
            stats, f = receipts[u.id]["stats"], int(u.payload["file"])
            base[i], file_of[i] = before.get(f, 0) if u.payload["kind"] == "bytes" else 0, f
            before[f] = before.get(f, 0) + int(stats["rows"])
            for k in totals[f]:
                totals[f][k] += int(stats[k])
            if stats.get("corrupt"):
                corrupt.append({"path": u.payload["path"], "reason": str(stats["corrupt"])})
        return cls([u.payload for u in plan], base, file_of, totals, corrupt)

    def where(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sign unit, row in its file) of each node."""
        units = graph.unit_of(nodes)
        return units, self.base[units] + graph.row_of(nodes)

    def spell(self, node: int) -> str:
        units, rows = self.where(np.array([node], np.uint64))
        return f"{self.payloads[int(units[0])]['path']}:{int(rows[0])}"


def example_texts(units: SignUnits, cfg: DedupConfig, nodes: list[int]) -> dict[int, str]:
    """The normalized text of each of ``nodes`` (a few: the report's examples), read from its
    sign unit's slice up to its row."""
    out: dict[int, str] = {}
    wanted: dict[int, set[int]] = {}
    for n in nodes:
        wanted.setdefault(n >> graph.ROW_BITS, set()).add(n & int(graph.ROW_MASK))
    normalize = row_normalizer(cfg.text, cfg.id_field)
    for u, rows in sorted(wanted.items()):
        p = units.payloads[u]
        for row, record, error in _slice_rows(p, cfg):
            if row in rows:
                doc = normalize(record, error, p["path"], row, p["relpath"])
                out[(u << graph.ROW_BITS) | row] = doc.text if not isinstance(doc, Rejected) else f"({doc.reason})"
            if row >= max(rows):
                break
    return out


def dup_lines(units: SignUnits, assigned: np.ndarray) -> Iterator[bytes]:
    """``dup_list.jsonl`` (:class:`~refinery.transforms.formats.duplist.DupEntry` lines, in
    node order: input order), a block of lines at a time."""
    for lo in range(0, len(assigned), 1 << 16):
        block = assigned[lo:lo + (1 << 16)]
        units_a, rows_a = units.where(block["node"])
        units_b, rows_b = units.where(block["root"])
        lines = [json.dumps({"train_path": units.payloads[ua]["path"], "train_row": ra,
                             "dup_of_path": units.payloads[ub]["path"], "dup_of_row": rb,
                             "jaccard": round(j, 4), "exact": bool(e), "cluster": c}, ensure_ascii=False)
                 for ua, ra, ub, rb, j, e, c in zip(units_a.tolist(), rows_a.tolist(), units_b.tolist(),
                                                    rows_b.tolist(), block["jaccard"].astype(float).tolist(),
                                                    block["exact"].tolist(), block["cluster"].tolist())]
        yield ("\n".join(lines) + "\n").encode("utf-8", "backslashreplace")


def cluster_lines(units: SignUnits, clusters: np.ndarray) -> Iterator[bytes]:
    """``clusters.jsonl`` (:class:`~refinery.transforms.formats.duplist.ClusterEntry` lines, by id)."""
    for lo in range(0, len(clusters), 1 << 16):
        block = clusters[lo:lo + (1 << 16)]
        u, rows = units.where(block["root"])
        lines = [json.dumps({"cluster": lo + i, "kept_path": units.payloads[a]["path"], "kept_row": r, "size": s,
                             "exact": e, "min_jaccard": round(j, 4)}, ensure_ascii=False)
                 for i, (a, r, s, e, j) in enumerate(zip(u.tolist(), rows.tolist(), block["size"].tolist(),
                                                         block["exact"].tolist(),
                                                         block["min_jaccard"].astype(float).tolist()))]
        yield ("\n".join(lines) + "\n").encode("utf-8", "backslashreplace")


def input_files(sign: StageRun, cfg: DedupConfig) -> list[TrainFile]:
    """``stats/input_files.jsonl``: every input read (as given and resolved, its size and
    version, how its text was read and, with ``verify_inputs_by_content``, its sha256, read
    again here: a file changed since it was signed is an error)."""
    spec = ReadSpec(cfg.text.identity(), TEXT_NORMALIZATION, cfg.max_row_bytes)
    out: list[TrainFile] = []
    for f in sign.input_fingerprints():
        row: TrainFile = {"train_path": f["path"], "resolved": storage.resolved(f["path"]), "size": f["size"],
                          "version": f["version"], "text": dict(spec.text), "normalization": spec.normalization,
                          "max_row_bytes": spec.max_row_bytes}
        if cfg.verify_inputs_by_content:
            row["sha256"] = file_sha256(f["path"])
            check_unchanged({"path": f["path"], "fingerprint": f})
        out.append(row)
    return out


def _summed(receipts: Mapping[str, Any], keys: tuple[str, ...]) -> dict[str, int]:
    return {k: sum(int(r["stats"].get(k, 0)) for r in receipts.values()) for k in keys}


def skipped_buckets(bucket: StageRun, units: SignUnits) -> dict[str, Any]:
    """The bucket units' skipped buckets merged: counts, and the largest with a row of each."""
    merged = graph.Skipped()
    for r in bucket.completed_receipts().values():
        s = r["stats"]["skipped"]
        merged.buckets += int(s["buckets"])
        merged.documents += int(s["documents"])
        merged.largest = sorted(merged.largest + [list(x) for x in s["largest"]], key=lambda x: (-x[1], x[2], x[0]))
        merged.largest = merged.largest[:merged.keep]
    out = merged.to_json()
    out["largest"] = [[band, size, units.spell(node)] for band, size, node in merged.largest]
    return out


class ReportStage(Stage[PartNumber, ReportStats]):
    """One unit: the clusters -> the user-facing files, then ``.SUCCESS`` (last)."""

    name = "report"

    def __init__(self, cfg: DedupConfig):
        self.cfg = cfg

    def traits(self) -> Traits:
        return Traits(title="Write report", light=True, final_outputs=True)

    def config(self) -> StageConfig:
        return StageConfig({"report": 1, "report_clusters": self.cfg.report_clusters,
                            **({"inputs_sha256": True} if self.cfg.verify_inputs_by_content else {})})

    def make_plan(self) -> list[Unit[PartNumber]]:
        return [Unit("report", {"p": 0})]

    def run_unit(self, unit: Unit[PartNumber], ctx: UnitContext) -> ReportStats:
        sign, cfg = ctx.upstream("sign"), self.cfg
        files = input_files(sign, cfg)
        units = SignUnits.of(sign, len(files))
        assigned, clusters = assignments(ctx.upstream("components"))
        for name, lines in ((DUP_LIST, dup_lines(units, assigned)), (CLUSTERS, cluster_lines(units, clusters))):
            with ctx.open_write(ctx.output_path(name)) as out:
                for chunk in lines:
                    out.write(chunk)
        removed = np.bincount(units.file_of[graph.unit_of(assigned["node"])], minlength=len(files))
        shares = [InputShare(f["train_path"], t["rows"], t["documents"], int(k))
                  for f, t, k in zip(files, units.totals, removed.tolist())]
        skipped = skipped_buckets(ctx.upstream("bucket"), units) if cfg.minhash else {}
        verify = (_summed(ctx.upstream("verify").completed_receipts(), ("candidates", "pairs", "verified", "below"))
                  if cfg.minhash else {})
        data = ReportData(report_settings(cfg), shares, len(clusters), len(assigned), int(assigned["exact"].sum()),
                          self._examples(units, clusters), skipped, verify,
                          (cfg.params.bands, cfg.params.rows) if cfg.minhash else None)
        totals = {k: sum(t[k] for t in units.totals) for k in ("rows", "documents", "empty", "rejected")}
        stats: ReportStats = {"rows": totals["rows"], "documents": totals["documents"], "empty": totals["empty"],
                              "rejected": totals["rejected"], "removed": len(assigned),
                              "exact_removed": int(assigned["exact"].sum()), "clusters": len(clusters),
                              "skipped": {k: v for k, v in skipped.items() if k != "largest"},
                              "corrupt_files": units.corrupt}
        ctx.write_bytes(ctx.output_path(REPORT), render_report(data).encode())
        ctx.write_bytes(ctx.output_path(STATS), dumps({**stats, "skipped": skipped, "verify": verify,
                                                       "inputs": [s.__dict__ for s in shares]}))
        ctx.write_bytes(ctx.output_path(INPUT_FILES), jsonl(files))
        ctx.write_bytes(ctx.output_path(SUCCESS), b"")
        return stats

    def _examples(self, units: SignUnits, clusters: np.ndarray) -> list[ClusterExample]:
        top = np.lexsort((np.arange(len(clusters)), -clusters["size"].astype(np.int64)))[:self.cfg.report_clusters]
        chosen = clusters[top]
        texts = example_texts(units, self.cfg, sorted({int(n) for n in chosen["root"]} |
                                                      {int(n) for n in chosen["example"]}))
        return [ClusterExample(int(c), int(row["size"]), int(row["exact"]), float(row["min_jaccard"]),
                               units.spell(int(row["root"])), units.spell(int(row["example"])),
                               texts.get(int(row["root"]), ""), texts.get(int(row["example"]), ""))
                for c, row in zip(top.tolist(), chosen)]


def report_settings(cfg: DedupConfig) -> list[tuple[str, str]]:
    what, value = cfg.text.describe()
    out = [("mode", cfg.mode), (what, value), ("normalization", TEXT_NORMALIZATION),
           ("max row bytes", f"{cfg.max_row_bytes:,}")]
    if cfg.minhash:
        out += [("shingles", f"{SHINGLE_WORDS}-word"), ("bands x rows", f"{cfg.params.bands} x {cfg.params.rows}"),
                ("threshold", f"Jaccard >= {cfg.threshold}"), ("max bucket", f"{cfg.max_bucket} texts")]
    return out


def clear_stale_success(runs: list[StageRun], plans: list[list[Unit[Any]]]) -> None:
    """Once the stages are planned: a run whose report is not done leaves no earlier run's
    ``.SUCCESS`` (the list beside it may be rewritten)."""
    if not runs[-1].check(plans[-1][0].id).done:
        storage.remove(storage.join(runs[-1].output, SUCCESS), root=runs[-1].output)
