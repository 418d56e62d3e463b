"""The five stages of ``refinery decon``: eval -> index -> scan -> reduce -> merge (thin wiring).

The logic lives in :mod:`refinery.transforms.decon.ngrams`; this module binds it to the
stage/receipt machinery of :mod:`refinery.transforms.resumable`.

- ``eval`` (units: eval file slices, ``--eval-slice-mb``): each unit reads its rows, and
  writes them, their text hashes and their n-gram windows cut by hash partition
  (:mod:`~refinery.transforms.decon.ngrams.eval_slices`). No process reads every eval row.
- ``index`` (units: ``catalog`` + one per hash partition): the slices merged. The
  ``catalog`` unit writes the compact membership file (``membership.bin``: sorted uint64
  n-gram hashes, merged a hash range at a time) and the eval rows table; ``partition-XXXXX``
  reads its windows of every slice and writes the detail records of the n-grams whose
  ``ngram_hash % P == XXXXX`` (text, eval rows, eval offsets).
- ``scan`` (units: training file slices): each unit streams its slice, probes the
  membership structure (a Beam side input: the membership file's bytes, broadcast), verifies
  each hash hit against the exact n-gram text of the partition it falls in (partitions are
  loaded only when hit, cached per worker process), and writes its verified hits grouped by
  partition, each with a snippet of the training text around it. Training n-grams never
  enter a shuffle.
- ``reduce`` (units: one per hash partition): the partition's hits from every scan unit
  (ranged reads of the frames its receipts list) joined with the partition's eval records:
  its detail records (``--details-format parquet``, the default: the user-facing
  ``stats/overlap_details/part-PPPPP.parquet``, so the stage has ``final_outputs``;
  ``jsonl``: one gzip member under its parts) and its share of the results (instance sets, training
  document counts, by-path sets, examples for the report). A partition's n-grams are its own.
- ``merge`` (local, one unit): Parquet details: removes the parts of a run with other
  partitions (and a jsonl file); jsonl: the members, each inflated to check its CRC first,
  concatenated in partition order into
  ``stats/overlap_details.jsonl.gz``; then ``stats/overlap_instances.jsonl.gz``,
  ``stats/overlap_stats.jsonl``, ``stats/clean/<dataset>/n=<n>.jsonl.gz`` (the clean eval subsets:
  :mod:`~refinery.transforms.decon.ngrams.clean`), ``stats/overlap_stats_by_train_path.jsonl``,
  ``stats/overlap_metrics.jsonl``, ``stats/eval_summary.jsonl``,
  ``stats/contaminated_train_docs.jsonl`` (the drop list), ``stats/train_files.jsonl``,
  ``stats/report.md``, ``stats/report.html``, and ``.SUCCESS`` last.
"""
from __future__ import annotations

import gc
import gzip
import hashlib
import json
import re
import resource
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import IO, Any, Callable, Iterator, Mapping, TypedDict, cast

import msgpack
import numpy as np
import zstandard
from isal import igzip, isal_zlib

from refinery.transforms.decon import ngrams as ng
from refinery.transforms.decon.ngrams import clean as cl
from refinery.transforms.decon.ngrams import details as dt
from refinery.transforms.decon.ngrams import eval_slices as es
from refinery.transforms.decon.ngrams import row_shares as rs
from refinery.transforms.decon.ngrams.droplist import DROP_LIST_VERSION
from refinery.transforms.decon.ngrams.index import (
    DEFAULT_MIN_EVAL_TOKENS,
    bad_row_reasons,
    bad_rows_warning,
    note_short_rows,
    short_rows,
    short_rows_warning,
)
from refinery.transforms.decon.ngrams.reduce import ReduceResult
from refinery.transforms.decon.report_html import fingerprint_text, render_html
from refinery.transforms.formats.droplist import (
    CONTAMINATED_DOCS,
    CONTAMINATED_SPANS,
    TRAIN_FILES,
    UNREAD_ROWS,
    ReadSpec,
    TrainFile,
    file_sha256,
)
from refinery.transforms.io import storage
from refinery.transforms.io.gc_pause import gc_paused, release_freed_memory
from refinery.transforms.io.jsonl import jsonl
from refinery.transforms.io.rows import DEFAULT_MAX_ROW_BYTES, Row, iter_rows, parquet_row_groups
from refinery.transforms.io.text import DEFAULT_MATCH_FOLD, TEXT_NORMALIZATION, TextSpec
from refinery.transforms.resumable import Stage, StageConfig, StageRun, StageWiring, Traits, Unit, UnitContext
from refinery.transforms.resumable.progress import human_bytes, rate

FORMAT_VERSION = 5  # 3: checksummed hits frames; shared eval texts collapsed, capped details, cut snippets;
# 4: reduce results carry their records' eval windows; longest match and coverage per instance
# 5: eval rows say whether their id was hashed; reduce results keep spans and samples at every n
MEMBERSHIP_FILE = "membership.bin"
EVAL_ROWS_FILE = "eval_rows.jsonl.gz"
EVAL_SUMMARY_FILE = "eval_bad_rows.json"
EVAL_BAD_ROWS = "stats/eval_bad_rows.jsonl"  # with --eval-dataset-field: the bad eval rows and their reasons


def hits_file(unit_id: str) -> str:
    """A scan unit's verified hits: zstd frames (with content checksums), each the msgpack
    of one partition's :func:`ngrams.hit_blocks` block; the unit's receipt lists the frames
    as ``frames: [[partition, offset, length], ...]``."""
    return f"hits/{unit_id}.bin"


REBUILD_HINT = "run the same command again with --verify-checksums to rebuild it"


def compress_frame(data: bytes) -> bytes:
    """One zstd frame of ``data`` with its content checksum (xxhash64), checked on reading."""
    return zstandard.ZstdCompressor(level=1, write_checksum=True).compress(data)


def decompress_frame(frame: bytes, where: str) -> bytes:
    """The data of a :func:`compress_frame` frame; ValueError naming ``where`` if the frame is
    damaged (its checksum, or its header's checksum flag, does not hold)."""
    try:
        if not zstandard.get_frame_parameters(frame).has_checksum:
            raise zstandard.ZstdError("the frame carries no checksum")
        return zstandard.ZstdDecompressor().decompress(frame)
    except zstandard.ZstdError as e:
        raise ValueError(f"{where}: damaged zstd frame ({e}); {REBUILD_HINT}") from None


def copy_gzip_member(src: IO[bytes], out: storage.BinaryWriter, where: str, chunk: int = 1 << 20) -> None:
    """Copy one complete gzip member from ``src`` to ``out``, inflating it on the way to check
    its CRC and length; ValueError naming ``where`` if it is damaged or not one whole member
    (``out`` then holds a partial copy: the caller's unit fails and its file is not kept)."""
    inflate = isal_zlib.decompressobj(wbits=31)
    gzip_error = cast("type[Exception]", isal_zlib.error)  # a class; isal's stub calls it an instance
    try:
        while block := src.read(chunk):
            if inflate.eof:
                raise gzip_error("data after the end of the gzip member")
            inflate.decompress(block, chunk)  # the output is dropped: only checked
            while inflate.unconsumed_tail:
                inflate.decompress(inflate.unconsumed_tail, chunk)
            out.write(block)
        if not inflate.eof or inflate.unused_data:
            raise gzip_error("cut short" if not inflate.eof else "data after the end of the gzip member")
    except gzip_error as e:
        raise ValueError(f"{where}: damaged gzip member ({e}); {REBUILD_HINT}") from None


HELD_CHARS = 8 << 20  # snippet characters a scan unit holds before it writes its frames


def partition_file(p: int) -> str:
    return f"partitions/part-{p:05d}.msgpack"


@dataclass
class DeconSettings:
    eval_paths: list[str]
    train_paths: list[str]
    ns: list[int]
    eval_text_field: str = "text"
    train_text_field: str = "text"
    id_field: str = "id"
    tokenizer: str = "default"
    partitions: int = 64
    max_train_count: int | None = None
    max_ngram_details: int | None = ng.DEFAULT_MAX_NGRAM_DETAILS
    slice_bytes: int = 256 << 20
    eval_slice_bytes: int = 16 << 20  # eval files larger than this are indexed in slices (--eval-slice-mb)
    batch_bytes: int = 1 << 20
    report_examples: int = 20
    eval_text_template: str | None = None   # set: eval text is this template (eval_text_field unused)
    train_text_template: str | None = None  # set: training text is this template (train_text_field unused)
    details_format: str = "parquet"  # "jsonl": one stats/overlap_details.jsonl.gz (ngrams.details)
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES  # a larger row (eval or training) is unreadable (--max-row-bytes)
    verify_inputs_by_content: bool = False  # train_files.jsonl records each training file's sha256
    min_eval_tokens: int = DEFAULT_MIN_EVAL_TOKENS  # shorter eval rows are not indexed (--min-eval-tokens)
    eval_dataset_field: str | None = None  # set: an eval row's dataset is this field's value (--eval-dataset-field)
    match_fold: str = DEFAULT_MATCH_FOLD  # the match key both sides are folded to before matching (--match-fold)

    def row_cap(self) -> dict[str, Any]:
        """What a stage config records of the row cap: nothing at the default (the hashes of
        outputs made before --max-row-bytes are kept)."""
        return {"max_row_bytes": self.max_row_bytes} if self.max_row_bytes != DEFAULT_MAX_ROW_BYTES else {}

    @property
    def splitter(self) -> ng.WordSplitter:
        """The tokenizer, matching under the match fold (both enter the index and scan hashes)."""
        return ng.get_tokenizer(self.tokenizer, self.match_fold)

    @property
    def eval_text(self) -> TextSpec:
        return TextSpec.from_options(None, self.eval_text_template, self.eval_text_field)

    @property
    def train_text(self) -> TextSpec:
        return TextSpec.from_options(None, self.train_text_template, self.train_text_field)

    def __post_init__(self) -> None:
        self.ns = sorted(set(int(n) for n in self.ns))
        if not self.ns or self.ns[0] < 1:
            raise ValueError("--ngrams needs positive integers")
        if self.partitions < 1:
            raise ValueError("--partitions must be >= 1")
        if self.report_examples < 0:
            raise ValueError("--report-examples must be >= 0")
        if self.max_ngram_details is not None and self.max_ngram_details < 1:
            raise ValueError("--max-ngram-details must be >= 1 (or none)")
        if self.max_row_bytes < 1:
            raise ValueError("--max-row-bytes must be at least 1")
        if self.min_eval_tokens < 0:
            raise ValueError("--min-eval-tokens must be >= 0")
        _ = self.splitter  # an unknown tokenizer or match fold raises ValueError here
        dt.check_format(self.details_format)
        _ = self.eval_text, self.train_text  # a bad template raises ValueError here


# ---------------------------------------------------------------------------------------
# Per-process caches (a worker process serves many units)
# ---------------------------------------------------------------------------------------

class PartitionPayload(TypedDict, total=False):
    """An index or reduce unit's payload: its hash partition (none: the index's catalog, the merge)."""

    p: int


class _TrainSliceBase(TypedDict):
    path: str
    relpath: str
    kind: str   # "file", "bytes" (a .jsonl's byte range) or "row_groups" (a .parquet's)
    file: int
    slice: int


class TrainSlice(_TrainSliceBase, total=False):
    """A scan unit's payload: a training file or a slice of it, ``lo`` to ``hi`` (bytes or row groups)."""

    lo: int
    hi: int


_gzip_writer = cast(Callable[..., IO[bytes]], igzip.IGzipFile)  # isal's IGzipFile has no annotations


_MEMBERSHIP: dict[str, ng.Membership] = {}


def membership_from_bytes(data: bytes) -> ng.Membership:
    key = hashlib.blake2b(data, digest_size=16).hexdigest()
    m = _MEMBERSHIP.get(key)
    if m is None:
        _MEMBERSHIP.clear()
        m = _MEMBERSHIP[key] = ng.Membership.from_bytes(data)
    return m


@lru_cache(maxsize=256)
def load_partition_file(path: str) -> ng.Partition:
    with gc_paused():
        part = ng.load_partition(storage.read_bytes(path))
        gc.freeze()
    return part


def let_go(*caches: Any, membership: bool = False) -> bool:
    """Empty the per-process ``caches`` (``lru_cache`` functions) and, with ``membership``, the
    scan's membership; where any of them held something, give the freed memory back to the
    system (:func:`release_freed_memory`): a process that runs the stages one after another
    (the local runner's driver) would otherwise carry each stage's freed caches into the
    next stage's peak (a 20 MB eval row: 1.2 GB instead of under 1). Returns whether anything was let go."""
    held = any(c.cache_info().currsize for c in caches) or (membership and bool(_MEMBERSHIP))
    if held:
        for c in caches:
            c.cache_clear()
        if membership:
            _MEMBERSHIP.clear()
        release_freed_memory()
    return held


# ---------------------------------------------------------------------------------------
# index
# ---------------------------------------------------------------------------------------

class EvalSlice(TypedDict, total=False):
    """An eval slice unit's payload: an eval file (``file``: its place in the eval order) or a
    slice of it (:func:`plan_train_units`'s payloads)."""

    path: str
    relpath: str
    kind: str
    file: int
    slice: int
    lo: int
    hi: int


def eval_slice_file(unit_id: str, what: str) -> str:
    """A file of eval slice unit ``unit_id``: ``rows`` (its rows' catalog lines, slice-local
    numbers), ``meta`` (:data:`.eval_slices.ROW_META`), ``bad`` (its bad-row counts),
    ``windows`` (its window blocks, :class:`.eval_slices.SliceWindows`), ``text`` (the prepared text)."""
    ext = {"rows": "jsonl", "meta": "npy", "bad": "json", "windows": "bin", "text": "bin"}[what]
    return f"eval/{unit_id}.{what}.{ext}"


class EvalStage(Stage[EvalSlice, dict[str, Any]]):
    """The eval files in slices, in parallel (:mod:`.ngrams.eval_slices`): each unit reads its
    rows and writes them, their text hashes and their n-gram windows by hash partition; the
    ``index`` stage merges them. No unit holds more than its slice."""

    name = "eval"

    def __init__(self, settings: DeconSettings, eval_files: list[storage.InputFile]):
        self.s = settings
        self.eval_files = eval_files

    def traits(self) -> Traits:
        # unchained: the index's outputs are a function of the eval files and settings its own hash
        # covers (the slicing changes none of their bytes), so its hash, and every later stage's, is the
        # one of the index before it was cut into slices: outputs made before keep their receipts
        return Traits(title="Read eval sets", chained=False, driver_only=("eval_files",))

    def config(self) -> StageConfig:
        return StageConfig({**IndexStage.settings_of(self.s), "eval_slice_bytes": self.s.eval_slice_bytes},
                           [f.fingerprint() for f in self.eval_files], {"tokenizer": self.s.splitter.identity()})

    def make_plan(self) -> list[Unit[EvalSlice]]:
        return cast("list[Unit[EvalSlice]]", plan_train_units(self.eval_files, self.s.eval_slice_bytes))

    def run_unit(self, unit: Unit[EvalSlice], ctx: UnitContext) -> dict[str, Any]:
        t0 = time.perf_counter()
        pl, cap = unit.payload, self.s.max_row_bytes
        if pl["kind"] == "bytes":
            rows = iter_rows(pl["path"], byte_range=(pl["lo"], pl["hi"]), max_row_bytes=cap)
        elif pl["kind"] == "row_groups":
            rows = iter_rows(pl["path"], row_groups=(pl["lo"], pl["hi"]), max_row_bytes=cap)
        else:
            rows = iter_rows(pl["path"], max_row_bytes=cap)
        numbered = 0

        def read(path: str) -> Iterator[Row]:
            nonlocal numbered
            for row in rows:
                numbered += 1
                yield row

        tok = self.s.splitter
        with gc_paused():
            eval_rows, bad = ng.make_eval_rows([pl["path"]], read, self.s.eval_text, self.s.id_field, tok,
                                               self.s.eval_dataset_field)
            meta = es.row_meta(eval_rows, self.s.min_eval_tokens)
            windows = es.slice_windows(eval_rows, meta, self.s.ns, tok, self.s.partitions)
            ctx.write_bytes(ctx.part_path(eval_slice_file(unit.id, "rows")), es.row_lines(eval_rows))
        ctx.write_bytes(ctx.part_path(eval_slice_file(unit.id, "meta")), meta.tobytes())
        ctx.write_bytes(ctx.part_path(eval_slice_file(unit.id, "bad")), json.dumps(bad, sort_keys=True).encode())
        ctx.write_bytes(ctx.part_path(eval_slice_file(unit.id, "windows")), windows.data.astype("<i8").tobytes())
        ctx.write_bytes(ctx.part_path(eval_slice_file(unit.id, "text")), windows.buffer)
        return {"eval_rows": len(eval_rows), "rows": numbered, "windows": len(windows.data),
                "part_at": windows.part_at, "text_bytes": sum(len(r.text) for r in eval_rows),
                "seconds": time.perf_counter() - t0, "peak_rss_mb": _peak_rss_mb()}


@dataclass(frozen=True)
class SliceReceipts:
    """What the index reads of the eval stage's finished units, in eval order: each unit's id,
    its first row's global number, its first row's number in its file, and its receipt's stats."""

    ids: list[str]
    first_idx: list[int]
    row_base: list[int]
    stats: list[dict[str, Any]]

    @classmethod
    def of(cls, run: StageRun) -> "SliceReceipts":
        plan = run.stage.plan()
        receipts = run.completed_receipts()
        missing = [u.id for u in plan if u.id not in receipts]
        if missing:
            raise RuntimeError(f"eval slice units not completed: {missing[:5]}")
        ids: list[str] = []
        first: list[int] = []
        base: list[int] = []
        stats: list[dict[str, Any]] = []
        total, rows_before = 0, cast("dict[int, int]", {})
        for u in plan:
            st = receipts[u.id]["stats"]
            f = u.payload["file"]
            ids.append(u.id)
            first.append(total)
            base.append(rows_before.get(f, 0) if u.payload["kind"] == "bytes" else 0)
            stats.append(st)
            total += int(st["eval_rows"])
            rows_before[f] = rows_before.get(f, 0) + int(st["rows"])
        return cls(ids, first, base, stats)

    def path(self, run: StageRun, k: int, what: str) -> str:
        return storage.join(run.parts_dir, eval_slice_file(self.ids[k], what))

    def metas(self, run: StageRun) -> list[np.ndarray]:
        return [np.frombuffer(storage.read_bytes(self.path(run, k, "meta")), dtype=es.ROW_META)
                for k in range(len(self.ids))]

    def block(self, run: StageRun, k: int, p: int) -> np.ndarray:
        """Slice ``k``'s windows of partition ``p`` (a ranged read of its windows file)."""
        at = self.stats[k]["part_at"]
        lo, hi = int(at[p]), int(at[p + 1])
        if hi == lo:
            return np.zeros((0, len(es.WINDOW_FIELDS)), dtype=np.int64)
        data = storage.read_range(self.path(run, k, "windows"), lo * es.WINDOW_BYTES, hi * es.WINDOW_BYTES)
        return np.frombuffer(data, dtype="<i8").reshape(hi - lo, len(es.WINDOW_FIELDS)).astype(np.int64)

    def hashes(self, run: StageRun, k: int, keep: np.ndarray, lengths: set[int]) -> np.ndarray:
        """Slice ``k``'s window hashes of the rows ``keep`` holds; their lengths added to ``lengths``."""
        n = int(self.stats[k]["windows"])
        if not n:
            return np.zeros(0, dtype=np.uint64)
        data = np.frombuffer(storage.read_bytes(self.path(run, k, "windows")), dtype="<i8").reshape(
            n, len(es.WINDOW_FIELDS))
        mask = keep[data[:, 1] + self.first_idx[k]]
        lengths.update(np.unique(data[mask, 6]).tolist())
        hashes: np.ndarray = data[mask, 0].astype(np.int64).view(np.uint64)
        return hashes


class IndexStage(Stage[PartitionPayload, dict[str, Any]]):
    """The eval slices merged (:class:`EvalStage`): ``catalog`` writes the eval rows, their bad-row
    counts and the membership; ``partition-P`` the records of hash partition P."""

    name = "index"

    def __init__(self, settings: DeconSettings, eval_files: list[storage.InputFile]):
        self.s = settings
        self.eval_files = eval_files

    def traits(self) -> Traits:
        return Traits(title="Index eval sets", driver_only=("eval_files",))

    def config(self) -> StageConfig:
        return StageConfig(self.settings_of(self.s), self._inputs(), self._identity())

    @staticmethod
    def settings_of(s: DeconSettings) -> dict[str, Any]:
        # {"text_field": F} as before templates, so outputs made with a field keep their hashes
        return {"format": FORMAT_VERSION, "ns": s.ns, **s.eval_text.identity(),
                "id_field": s.id_field, "partitions": s.partitions, **s.row_cap(),
                "text_normalization": TEXT_NORMALIZATION, "min_eval_tokens": s.min_eval_tokens,
                # absent without the flag: the hashes of outputs made before it are kept
                **({"dataset_field": s.eval_dataset_field} if s.eval_dataset_field is not None else {})}

    def _inputs(self) -> list[Any]:
        return [f.fingerprint() for f in self.eval_files]

    def _identity(self) -> dict[str, Any]:
        return {"tokenizer": self.s.splitter.identity()}  # its match fold included

    def make_plan(self) -> list[Unit[PartitionPayload]]:
        return [Unit("catalog", PartitionPayload())] + [Unit(f"partition-{p:05d}", {"p": p})
                                                        for p in range(self.s.partitions)]

    def run_unit(self, unit: Unit[PartitionPayload], ctx: UnitContext) -> dict[str, Any]:
        run = ctx.upstream("eval")
        slices = SliceReceipts.of(run)
        keep = es.indexed_rows(slices.metas(run))
        if unit.id == "catalog":
            return self._catalog(ctx, run, slices, keep)
        p = unit.payload["p"]
        buffers = es.SliceBuffers([slices.path(run, k, "text") for k in range(len(slices.ids))])
        try:
            with gc_paused():
                recs = es.partition_records(p, self.s.partitions,
                                            ((slices.block(run, k, p), slices.first_idx[k])
                                             for k in range(len(slices.ids))), keep, buffers)
                data = ng.dumps_partition(recs)
        finally:
            buffers.close()
        ctx.write_bytes(ctx.part_path(partition_file(p)), data)
        return {"test_ngrams": len(recs), "peak_rss_mb": _peak_rss_mb()}

    def _catalog(self, ctx: UnitContext, run: StageRun, slices: SliceReceipts, keep: np.ndarray) -> dict[str, Any]:
        with ctx.open_write(ctx.part_path(EVAL_ROWS_FILE)) as out:
            with gzip.GzipFile(fileobj=cast(IO[bytes], out), mode="wb", mtime=0, compresslevel=6) as gz:
                for k in range(len(slices.ids)):
                    with storage.open_read(slices.path(run, k, "rows")) as f:
                        for line in es.renumbered(f, slices.first_idx[k], slices.row_base[k]):
                            gz.write(line)
        bad = es.merge_bad((json.loads(storage.read_bytes(slices.path(run, k, "bad"))), slices.row_base[k])
                           for k in range(len(slices.ids)))
        ctx.write_bytes(ctx.part_path(EVAL_SUMMARY_FILE), json.dumps(bad, sort_keys=True).encode())
        windows = sum(int(st["windows"]) for st in slices.stats)
        lengths: set[int] = set()  # of the indexed windows (a row shorter than n gives n-grams of its length)
        hashes = es.membership_hashes(lambda k: slices.hashes(run, k, keep, lengths), len(slices.ids), windows)
        membership = ng.Membership(hashes, lengths, {"tokenizer": self.s.tokenizer, "match_fold": self.s.match_fold,
                                                     "partitions": self.s.partitions, "ns": self.s.ns})
        ctx.write_bytes(ctx.part_path(MEMBERSHIP_FILE), membership.to_bytes())
        return {"eval_rows": sum(int(st["eval_rows"]) for st in slices.stats), "test_ngrams": len(membership),
                "membership_bytes": membership.hashes.nbytes, "membership_loaded_bytes": membership.nbytes,
                "lengths": list(membership.lengths), "peak_rss_mb": _peak_rss_mb(),
                **({"bad_rows_warning": warning} if (warning := bad_rows_warning(bad)) else {})}



# ---------------------------------------------------------------------------------------
# scan
# ---------------------------------------------------------------------------------------

def plan_train_units(files: list[storage.InputFile], slice_bytes: int) -> list[Unit[TrainSlice]]:
    units: list[Unit[TrainSlice]] = []
    for fi, f in enumerate(files):
        if storage.has_suffix(f.path, ".jsonl") and f.size > slice_bytes:
            k = -(-f.size // slice_bytes)
            for si in range(k):
                lo, hi = si * slice_bytes, min(f.size, (si + 1) * slice_bytes)
                units.append(Unit(f"f{fi:05d}-s{si:04d}", {"path": f.path, "relpath": f.relpath, "kind": "bytes",
                                                         "file": fi, "slice": si, "lo": lo, "hi": hi}))
        elif storage.has_suffix(f.path, ".parquet") and f.size > slice_bytes:
            groups = parquet_row_groups(f.path)
            per = max(1, int(len(groups) * slice_bytes // max(1, f.size)))
            for si, g in enumerate(range(0, len(groups), per)):
                units.append(Unit(f"f{fi:05d}-s{si:04d}", {"path": f.path, "relpath": f.relpath,
                                                         "kind": "row_groups", "file": fi, "slice": si, "lo": g,
                                                         "hi": min(len(groups), g + per)}))
        else:
            units.append(Unit(f"f{fi:05d}-s0000", {"path": f.path, "relpath": f.relpath, "kind": "file", "file": fi,
                                                   "slice": 0}))
    return units


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class ScanStage(Stage[TrainSlice, dict[str, Any]]):
    name = "scan"

    def __init__(self, settings: DeconSettings, train_files: list[storage.InputFile], index_stage: IndexStage):
        self.s = settings
        self.train_files = train_files
        self.index_stage = index_stage

    def traits(self) -> Traits:
        return Traits(title="Scan training data", driver_only=("train_files",), progress_text=self._progress_text,
                      wiring=ScanWiring())

    def config(self) -> StageConfig:
        return StageConfig(self._settings(), self._inputs(), self._identity())

    def _settings(self) -> dict[str, Any]:
        # unread_rows: each unit lists the rows it could not read (unread_file), for the drop list's side file
        return {"format": FORMAT_VERSION, **self.s.train_text.identity(), "id_field": self.s.id_field,
                "slice_bytes": self.s.slice_bytes, "unread_rows": 1, **self.s.row_cap(),
                "text_normalization": TEXT_NORMALIZATION, "row_ids": "relpath:row"}  # row_ids: formats.row_ids

    def _inputs(self) -> list[Any]:
        return [f.fingerprint() for f in self.train_files]

    def _identity(self) -> dict[str, Any]:
        return {"tokenizer": self.s.splitter.identity()}  # its match fold included

    def make_plan(self) -> list[Unit[TrainSlice]]:
        return plan_train_units(self.train_files, self.s.slice_bytes)

    @staticmethod
    def membership_path(run: StageRun) -> str:
        """The index's membership file, upstream of the scan bound as ``run``."""
        return storage.join(run.upstream["index"].parts_dir, MEMBERSHIP_FILE)

    def _progress_text(self, stats: Mapping[str, Any], seconds: float) -> str:
        read = stats.get("text_bytes", 0)
        return ", ".join(filter(None, [human_bytes(read), rate(read / 1e6, seconds, "MB")]))

    def run_unit(self, unit: Unit[TrainSlice], ctx: UnitContext) -> dict[str, Any]:
        t0 = time.perf_counter()
        c0 = time.thread_time()
        data = ctx.side.get("membership")
        if data is None:  # run without Beam (tests, local stage runners)
            data = storage.read_bytes(self.membership_path(ctx.run))
        membership = membership_from_bytes(data)
        index_parts = ctx.upstream("index").parts_dir
        partitions = int(membership.meta.get("partitions", self.s.partitions))

        def lookup(p: int) -> ng.Partition:
            return load_partition_file(storage.join(index_parts, partition_file(p)))

        pl = unit.payload
        cap = self.s.max_row_bytes
        if pl["kind"] == "bytes":
            rows = iter_rows(pl["path"], byte_range=(pl["lo"], pl["hi"]), max_row_bytes=cap)
        elif pl["kind"] == "row_groups":
            rows = iter_rows(pl["path"], row_groups=(pl["lo"], pl["hi"]), max_row_bytes=cap)
        else:
            rows = iter_rows(pl["path"], max_row_bytes=cap)
        stats = ng.ScanStats()
        rows = _reporting(rows, ctx, lambda: {"rows": stats.rows, "text_bytes": stats.text_bytes})
        unread = 0
        tok = self.s.splitter
        held: list[ng.HitGroups] = []
        frames: list[list[int]] = []
        size = 0
        with ctx.open_write(ctx.part_path(hits_file(unit.id))) as out, \
                ctx.open_write(ctx.part_path(unread_file(unit.id))) as unread_out, gc_paused():
            def listed(rows: Iterator[Row]) -> Iterator[Row]:
                """``rows``, each one the reader could not read written to ``unread_out`` first."""
                nonlocal unread
                for row in rows:
                    if row[2] is not None:
                        unread_out.write(json.dumps([row[0], row[2]]).encode() + b"\n")
                        unread += 1
                    yield row

            def flush() -> None:
                nonlocal size
                if held:
                    for p, block in ng.hit_blocks(held):
                        frame = compress_frame(msgpack.packb(block, use_bin_type=True, unicode_errors="surrogatepass"))
                        frames.append([p, size, len(frame)])
                        out.write(frame)
                        size += len(frame)
                held.clear()

            chars = 0
            for hits in ng.scan_rows(listed(rows), text_field=self.s.train_text, tokenizer=tok, membership=membership,
                                     lookup=lookup, partitions=partitions, stats=stats, batch_bytes=self.s.batch_bytes):
                # a hit-dense batch has many more snippet characters than text: made a piece at a time
                for piece in ng.split_hits(hits, HELD_CHARS // 4):
                    held.append(ng.hit_groups(piece, self.s.id_field, pl.get("relpath")))
                    chars += sum(map(len, held[-1].snippet))
                    if chars > HELD_CHARS:
                        flush()
                        chars = 0
            flush()
        return {**stats.__dict__, "frames": frames, "unread_rows": unread, "seconds": time.perf_counter() - t0,
                "cpu_seconds": time.thread_time() - c0,
                "peak_rss_mb": _peak_rss_mb(), "membership_loaded_bytes": membership.nbytes,
                "test_ngrams": len(membership)}


def _reporting(rows: Iterator[Row], ctx: UnitContext, counts: Callable[[], dict[str, Any]]) -> Iterator[Row]:
    """``rows``, unchanged, publishing ``counts()`` (:meth:`UnitContext.report_progress`)
    every 1,024 rows: the scan yields only batches with hits, the progress display must move
    on every batch."""
    for i, row in enumerate(rows):
        if not i & 1023:
            ctx.report_progress(counts())
        yield row


# ---------------------------------------------------------------------------------------
# reduce: one unit per eval partition
# ---------------------------------------------------------------------------------------

def details_file(p: int) -> str:
    """Eval partition ``p``'s detail records: one complete gzip member (the merge concatenates them)."""
    return f"details/part-{p:05d}.jsonl.gz"


def unread_file(unit_id: str) -> str:
    """A scan unit's training rows that could not be read (too large, not JSON, a corrupt
    file's end): one JSON line ``[row, reason]`` each, rows numbered as the unit read them."""
    return f"unread/{unit_id}.jsonl"


def results_file(p: int) -> str:
    """Eval partition ``p``'s share of the results (:func:`ngrams.reduce_partition`), msgpack."""
    return f"results/part-{p:05d}.msgpack"


def row_share_file(p: int) -> str:
    """Eval partition ``p``'s row share: its training rows' side of the results
    (:func:`.row_shares.encode_row_share`), which the merge reads a window at a time."""
    return f"results/rows-{p:05d}.bin"


def row_share_part(result: dict[str, Any], eval_rows: list[ng.EvalRow], tokenizer: ng.WordSplitter) -> bytes:
    """The row-share file of a reduce unit's ``result``, taken out of it (the merge never holds
    every partition's rows), and the training rows of its ``by_path`` left out (the merge
    counts them from the row shares)."""
    data = rs.encode_row_share(result.pop("train_rows"), result.pop("windows"), eval_rows, tokenizer)
    result["by_path"] = [[path, ds, n, ids, []] for path, ds, n, ids, _ in result["by_path"]]
    return data


def scan_frames(scan_run: StageRun) -> dict[str, Any]:
    """Where each partition's hits are: ``units`` lists each scan unit in plan order as
    ``[unit id, training path, row base]`` (the rows of the byte slices of its file before
    it), ``frames`` maps a partition to its ``[unit index, offset, length]`` frames."""
    plan = scan_run.stage.plan()
    receipts = scan_run.completed_receipts(plan)
    missing = [u.id for u in plan if u.id not in receipts]
    if missing:
        raise RuntimeError(f"scan units not completed: {missing[:5]}")
    units: list[list[Any]] = []
    frames: dict[int, list[Any]] = {}
    rows_before: dict[int, int] = {}
    for i, u in enumerate(plan):
        f = u.payload["file"]
        units.append([u.id, u.payload["path"], rows_before.get(f, 0) if u.payload["kind"] == "bytes" else 0])
        rows_before[f] = rows_before.get(f, 0) + int(receipts[u.id]["stats"].get("rows", 0))
        for p, offset, length in receipts[u.id]["stats"]["frames"]:
            frames.setdefault(p, []).append([i, offset, length])
    return {"units": units, "frames": frames}


@lru_cache(maxsize=2)
def load_eval_rows(path: str) -> list[ng.EvalRow]:
    with gc_paused():
        return [ng.EvalRow(**r) for r in ng.loads_jsonl_gz(storage.read_bytes(path))]


@lru_cache(maxsize=2)
def load_same_text(path: str) -> ng.SameText:
    """The eval rows of ``path`` that share a text (once per process, for all reduce units)."""
    return ng.same_text(load_eval_rows(path))


@lru_cache(maxsize=2)
def load_eval_columns(path: str) -> dt.EvalColumns:
    """The eval side of Parquet detail rows for the eval rows of ``path`` (once per process)."""
    return dt.EvalColumns.of(load_eval_rows(path), load_same_text(path))


class ReduceStage(Stage[PartitionPayload, dict[str, Any]]):
    name = "reduce"

    def traits(self) -> Traits:
        return Traits(title="Reduce partitions", light=self._light(), final_outputs=self._final_outputs(),
                      wiring=ReduceWiring())

    def config(self) -> StageConfig:
        return StageConfig(self._settings())

    def _final_outputs(self) -> bool:
        """Parquet details are user-facing files of this stage (``stats/overlap_details/``)."""
        return self.s.details_format == "parquet"

    def _light(self) -> bool:
        """Its work grows with the scan's hits: after a scan of one slice of training data,
        not worth starting a pool of worker processes for."""
        return len(self.scan_stage.plan()) <= 1

    def __init__(self, settings: DeconSettings, scan_stage: ScanStage):
        self.s = settings
        self.scan_stage = scan_stage

    def _settings(self) -> dict[str, Any]:
        return {"format": FORMAT_VERSION, "ns": self.s.ns, "max_train_count": self.s.max_train_count,
                "max_ngram_details": self.s.max_ngram_details,
                # 1: results list the rows hit; 2: with their records, shared texts once; 3: and their spans;
                # 4: in a row-share file of their own (row_share_file)
                "train_rows": 4,
                # absent for jsonl: the hash of a jsonl run made before --details-format is kept
                **({"details_format": "parquet"} if self.s.details_format == "parquet" else {}),
                # with --max-train-count: results name the instances of the ignored n-grams (ignored_evals)
                **({"ignored_evals": 1} if self.s.max_train_count is not None else {})}

    def make_plan(self) -> list[Unit[PartitionPayload]]:
        return [Unit(f"partition-{p:05d}", {"p": p}) for p in range(self.s.partitions)]

    def run_unit(self, unit: Unit[PartitionPayload], ctx: UnitContext) -> dict[str, Any]:
        p = unit.payload["p"]
        let_go(membership=True)  # a process that ran the index and scan too (the driver, a light reduce)
        index_run, scan_run = ctx.upstream("index"), ctx.upstream("scan")
        table = ctx.side["frames"] if "frames" in ctx.side else scan_frames(scan_run)
        records = load_partition_file(storage.join(index_run.parts_dir, partition_file(p))).records
        eval_rows = load_eval_rows(storage.join(index_run.parts_dir, EVAL_ROWS_FILE))
        same = load_same_text(storage.join(index_run.parts_dir, EVAL_ROWS_FILE))
        unpack = dict(raw=False, unicode_errors="surrogatepass", strict_map_key=False)

        def blocks() -> Iterator[tuple[int, str, int, dict[str, Any]]]:
            for i, offset, length in table["frames"].get(p, []):
                unit_id, path, base = table["units"][i]
                hits = storage.join(scan_run.parts_dir, hits_file(unit_id))
                frame = storage.read_range(hits, offset, offset + length)
                data = decompress_frame(frame, f"{hits} frame at bytes {offset}-{offset + length}")
                yield i, path, base, msgpack.unpackb(data, **unpack)

        if self.s.details_format == "parquet":  # straight into the user-facing folder, listed in the receipt
            columns = load_eval_columns(storage.join(index_run.parts_dir, EVAL_ROWS_FILE))
            with ctx.open_write(ctx.output_path(dt.details_part(p))) as raw, gc_paused():
                rows_out = dt.DetailRows(raw, columns)
                result = ng.reduce_partition(records, eval_rows, self.s.ns, blocks, self.s.max_train_count, None,
                                             self.s.max_ngram_details, same, rows_out=rows_out)
                rows_out.close()
        else:
            with ctx.open_write(ctx.part_path(details_file(p))) as raw, gc_paused():
                with _gzip_writer(fileobj=raw, mode="wb", mtime=0, compresslevel=1) as gz:
                    result = ng.reduce_partition(records, eval_rows, self.s.ns, blocks, self.s.max_train_count,
                                                 gz.write, self.s.max_ngram_details, same)
        share = row_share_part(cast(dict[str, Any], result), eval_rows, ng.get_tokenizer(self.s.tokenizer))
        ctx.write_bytes(ctx.part_path(row_share_file(p)), share)
        packed = msgpack.packb(result, use_bin_type=True, unicode_errors="surrogatepass")
        ctx.write_bytes(ctx.part_path(results_file(p)), packed)
        return {"details": result["details"], "ignored_ngrams": result["ignored"],
                "capped_ngrams": len(result["capped"])}


# ---------------------------------------------------------------------------------------
# merge: the stats files and reports
# ---------------------------------------------------------------------------------------

class MergeReportsStage(Stage[PartitionPayload, dict[str, Any]]):
    name = "merge"

    def __init__(self, settings: DeconSettings, reduce_stage: ReduceStage):
        self.s = settings
        self.reduce_stage = reduce_stage

    def traits(self) -> Traits:
        return Traits(title="Merge reports", light=True, final_outputs=True)

    def config(self) -> StageConfig:
        return StageConfig(self._settings())

    def _settings(self) -> dict[str, Any]:
        # drop_list 2: its lines name the row and its n only; train_files.jsonl records how the text was read;
        # 3: contaminated_train_spans.jsonl beside it; 4: each line's max_coverage per n (--exclude-min-coverage)
        return {"format": FORMAT_VERSION, "report_examples": self.s.report_examples, "drop_list": DROP_LIST_VERSION,
                "clean_subsets": 1,  # stats/clean/<dataset>/n=<n>.jsonl.gz (ngrams.clean)
                **({"inputs_sha256": True} if self.s.verify_inputs_by_content else {})}

    def make_plan(self) -> list[Unit[PartitionPayload]]:
        return [Unit("merge", {})]

    def run_unit(self, unit: Unit[PartitionPayload], ctx: UnitContext) -> dict[str, Any]:
        # the eval index and the partitions are not read here: a process that built or read them (the driver
        # runs the index, a direct run everything) lets them go before the merge's own peak
        let_go(load_partition_file, load_eval_columns, membership=True)
        storage.remove(ctx.output_path("stats/report.html"), root=ctx.output)  # never beside details of another run
        index_run, scan_run, reduce_run = ctx.upstream("index"), ctx.upstream("scan"), ctx.upstream("reduce")
        plan = reduce_run.stage.plan()
        missing = [u.id for u in plan if not reduce_run.check(u.id).done]
        if missing:
            raise RuntimeError(f"reduce units not completed: {missing[:5]}")
        eval_rows = load_eval_rows(storage.join(index_run.parts_dir, EVAL_ROWS_FILE))
        bad = json.loads(storage.read_bytes(storage.join(index_run.parts_dir, EVAL_SUMMARY_FILE)))
        scan_totals: dict[str, float] = {}
        for r in scan_run.completed_receipts().values():
            for k, v in r["stats"].items():
                if isinstance(v, (int, float)) and k not in ("peak_rss_mb", "membership_loaded_bytes", "test_ngrams"):
                    scan_totals[k] = scan_totals.get(k, 0) + v
        if self.s.details_format == "parquet":  # the reduce units wrote their parts: none of another run stays
            remove_stale_details(ctx.output, {dt.details_part(u.payload["p"]) for u in plan})
        else:
            storage.remove_tree(ctx.output_path(dt.DETAILS_DIR), root=ctx.output)
            with ctx.open_write(ctx.output_path(dt.DETAILS_JSONL)) as out:
                for u in plan:  # gzip members, each checked, concatenated in partition order
                    path = storage.join(reduce_run.parts_dir, details_file(u.payload["p"]))
                    with storage.open_read(path) as member:
                        copy_gzip_member(member, out, path)
        same = load_same_text(storage.join(index_run.parts_dir, EVAL_ROWS_FILE))
        # the merged result is many small dicts and sets, kept to the end: the collector, left on, walks
        # them again and again as the stats and reports are built (0.9 s of 2.3 on a 47 MB scan's hits)
        with gc_paused():
            result = self.merge_results(ctx, reduce_run, plan, eval_rows, same, bad)
            short = short_rows(eval_rows, self.s.min_eval_tokens)  # not indexed: counted and named
            note_short_rows(result.overlap_stats, result.summary, short)
            short_warning = short_rows_warning(short, self.s.min_eval_tokens)
            cl.note_clean(result.overlap_stats, eval_rows, self.s.min_eval_tokens)
            ctx.write_bytes(ctx.output_path("stats/overlap_instances.jsonl.gz"),
                            ng.dumps_jsonl_gz(ng.overlap_instances(eval_rows, result.overlaps, same, result.metrics)))
            ctx.write_bytes(ctx.output_path("stats/overlap_stats.jsonl"), jsonl(result.overlap_stats))
            clean = cl.write_clean_subsets(eval_rows, result.overlap_stats, self.s.min_eval_tokens,
                                           cl.unchanged_reader(index_run.input_fingerprints(), self.s.max_row_bytes),
                                           self.s.id_field, lambda rel: ctx.open_write(ctx.output_path(rel)))
            cl.remove_stale_clean(ctx.output, {cl.clean_file(ds, n) for ds, n in clean})
            ctx.write_bytes(ctx.output_path("stats/overlap_stats_by_train_path.jsonl"), jsonl(result.by_train_path))
            ctx.write_bytes(ctx.output_path("stats/overlap_metrics.jsonl"), jsonl(result.metrics))
            ctx.write_bytes(ctx.output_path("stats/eval_summary.jsonl"), jsonl(result.summary))
            if reasons := bad_row_reasons(bad):  # --eval-dataset-field: each bad eval row with its reason
                ctx.write_bytes(ctx.output_path(EVAL_BAD_ROWS), jsonl(reasons))
            else:  # none of an earlier run stays
                storage.remove(ctx.output_path(EVAL_BAD_ROWS), root=ctx.output)
            self.write_drop_lists(ctx, scan_run)
            ctx.write_bytes(ctx.output_path("stats/report.md"),
                            ng.render_report(result, scan_totals, self.s.max_train_count,
                                             top=self.s.report_examples,  # the HTML page's count of instances
                                             max_ngram_details=self.s.max_ngram_details, eval_rows=eval_rows)
                            .encode() + (f"\n**Warning:** {short_warning}\n".encode() if short_warning else b""))
            report = ng.contamination_report(result, eval_rows, self.s.ns, self.s.report_examples,
                                              self.report_settings(), self.report_inputs(index_run, scan_run),
                                              scan_totals)
            ctx.write_bytes(ctx.output_path("stats/report.html"), render_html(report).encode("utf-8"))
        ctx.write_bytes(ctx.output_path(".SUCCESS"), b"")
        return {"details": sum(int(r["stats"]["details"]) for r in reduce_run.completed_receipts(plan).values()),
                "ignored_ngrams": result.ignored_ngrams,
                "capped_ngrams": len(result.capped), "details_left_out": sum(c[3] - c[2] for c in result.capped),
                "capped_warning": ng.capped_warning(result.capped, self.s.max_ngram_details),
                "short_warning": short_warning,
                "ignored_only_warning": ng.ignored_only_warning(result.overlap_stats, self.s.max_train_count),
                **({"steering": result.steering.record()} if result.steering else {}),
                "contaminated": {f"{s['eval_dataset']}/{s['n']}": len(s["instance_ids"]) for s in result.overlap_stats},
                "scan": scan_totals}

    def merge_results(self, ctx: UnitContext, reduce_run: StageRun, plan: list[Unit[PartitionPayload]],
                      eval_rows: list[ng.EvalRow], same: ng.SameText, bad: dict[str, Any]) -> ReduceResult:
        """The partitions' results merged (:func:`.ngrams.merge_partitions`), the drop list and its
        spans written on the way: the instances' HELM metrics first, since each drop-list line
        names the largest coverage of the instances its row overlaps."""
        unpack = dict(raw=False, unicode_errors="surrogatepass", strict_map_key=False)
        results = (msgpack.unpackb(storage.read_bytes(storage.join(reduce_run.parts_dir, results_file(u.payload["p"]))),
                                   **unpack)
                   for u in plan)
        got = ng.gather_partitions(results)
        ns, tok = sorted(set(self.s.ns)), self.s.splitter
        helm = ng.helm_metrics(eval_rows, ns, got.overlaps, tok, same)
        train = self.merge_train_rows(ctx, reduce_run, plan, eval_rows, same, tok,
                                      ng.coverage_table(helm, len(eval_rows), ns))
        return ng.merge_partitions(eval_rows, ns, got, tok, bad, same, self.s.max_train_count, train, helm)

    def merge_train_rows(self, ctx: UnitContext, reduce_run: StageRun, plan: list[Unit[PartitionPayload]],
                         eval_rows: list[ng.EvalRow], same: ng.SameText, tok: ng.WordSplitter,
                         coverage: np.ndarray) -> rs.TrainRowTotals:
        """The drop list and its spans (what ``prep --exclude-overlaps`` and ``refinery clean``
        read: span mode cuts the spans out), written from the reduce units' row shares a window
        of training rows at a time (:func:`.row_shares.merge_train_rows`), each line with the
        largest ``coverage`` of the instances its row overlaps at each n, with the longest
        matches and row counts the rest of the merge needs."""
        shares = []
        for u in plan:
            path = storage.join(reduce_run.parts_dir, row_share_file(u.payload["p"]))
            shares.append(rs.RowShare(rs.file_reader(path), path))
        with ctx.open_write(ctx.output_path(CONTAMINATED_DOCS)) as drop, \
                ctx.open_write(ctx.output_path(CONTAMINATED_SPANS)) as spans:
            return rs.merge_train_rows(shares, eval_rows, same, self.s.ns, tok, drop.write, spans.write,
                                       coverage=coverage)

    def write_drop_lists(self, ctx: UnitContext, scan_run: StageRun) -> None:
        """Beside the drop list: the rows decon could not read (a few lines at a time: they may
        be many) and the training files it scanned."""
        with ctx.open_write(ctx.output_path(UNREAD_ROWS)) as out:
            for chunk in unread_rows(scan_run):
                out.write(chunk)
        ctx.write_bytes(ctx.output_path(TRAIN_FILES), jsonl(self.train_files(scan_run, self.s)))

    @staticmethod
    def train_files(scan_run: StageRun, settings: DeconSettings) -> list[TrainFile]:
        """``stats/train_files.jsonl``: every training file scanned (``scan_run``'s inputs), as
        given and resolved (a local path made absolute, links followed), with the size and
        version it was scanned at, how its text was read (:class:`ReadSpec`: text field or
        template, normalization version, row cap), the match fold its n-grams were compared
        under (``match_fold``: the consumers say it) and, with ``verify_inputs_by_content``, the
        sha256 of its bytes (read again here; a file whose size or version changed since the
        scan is an error): what ``prep --exclude-overlaps`` matches its inputs against."""
        spec = ReadSpec(settings.train_text.identity(), TEXT_NORMALIZATION, settings.max_row_bytes)
        out: list[TrainFile] = []
        for f in scan_run.input_fingerprints():
            row: TrainFile = {"train_path": f["path"], "resolved": storage.resolved(f["path"]), "size": f["size"],
                              "version": f["version"], "text": dict(spec.text), "normalization": spec.normalization,
                              "max_row_bytes": spec.max_row_bytes,  # ReadSpec.record(), typed
                              "match_fold": settings.match_fold}
            if settings.verify_inputs_by_content:
                row["sha256"] = file_sha256(f["path"])
                now = storage.expand_inputs([f["path"]])
                if [(g.size, g.version) for g in now] != [(f["size"], f["version"])]:
                    raise storage.InputError(f"{f['path']}: changed since decon scanned it (size {f['size']:,}, "
                                             f"version {f['version']}); run the same decon command again")
            out.append(row)
        return out

    def report_settings(self) -> tuple[tuple[str, str], ...]:
        s = self.s
        (eval_what, eval_text), (train_what, train_text) = s.eval_text.describe(), s.train_text.describe()
        return (("n", " ".join(map(str, s.ns))), ("tokenizer", s.tokenizer), ("match fold", s.match_fold),
                ("max-train-count", "none" if s.max_train_count is None else str(s.max_train_count)),
                ("max-ngram-details", "none" if s.max_ngram_details is None else str(s.max_ngram_details)),
                (f"eval {eval_what}", eval_text), (f"train {train_what}", train_text),
                ("id field", s.id_field), ("partitions", str(s.partitions)),
                ("report examples", f"{s.report_examples} per eval dataset and n"))

    @staticmethod
    def report_inputs(index_run: StageRun, scan_run: StageRun) -> tuple[tuple[str, str, str], ...]:
        return tuple((side, f["path"], fingerprint_text(f["size"], f["version"], storage.is_remote(f["path"])))
                     for side, run in (("eval", index_run), ("train", scan_run)) for f in run.input_fingerprints())


def unread_rows(scan_run: StageRun) -> Iterator[bytes]:
    """``stats/unread_train_rows.jsonl``, a few lines at a time: the rows each scan unit could
    not read (:func:`unread_file`, checked against the unit's receipt), in plan order, each
    ``{"train_path", "train_row", "reason"}`` with its row numbered in its file (the rows of
    the byte slices before it added)."""
    plan = scan_run.stage.plan()
    receipts = scan_run.completed_receipts(plan)
    rows_before: dict[int, int] = {}
    for u in plan:
        receipt = receipts.get(u.id)
        if receipt is None:
            raise RuntimeError(f"scan unit {u.id} is not complete")
        f = u.payload["file"]
        base = rows_before.get(f, 0) if u.payload["kind"] == "bytes" else 0
        rows_before[f] = rows_before.get(f, 0) + int(receipt["stats"].get("rows", 0))
        path = storage.join(scan_run.parts_dir, unread_file(u.id))
        data = storage.read_bytes(path)
        rel = path[len(scan_run.output.rstrip("/")) + 1:]
        want = next((e["sha256"] for e in receipt["files"] if e["path"] == rel), None)
        if want is None or hashlib.sha256(data).hexdigest() != want:
            raise ValueError(f"{path}: not what its scan unit wrote (its receipt records "
                             f"{'no such file' if want is None else 'another sha256'}); {REBUILD_HINT}")
        out = []
        for line in data.splitlines():
            row, reason = json.loads(line)
            out.append({"train_path": u.payload["path"], "train_row": base + int(row), "reason": reason})
        if out:
            yield jsonl(out)


def remove_stale_details(output: str, current: set[str], jsonl_too: bool = True) -> list[str]:
    """Remove what ``--details-format jsonl`` wrote (unless not ``jsonl_too``) and every Parquet
    part under ``OUTPUT/stats/overlap_details/`` not in ``current`` (relative paths: the current
    plan's parts; a run with more partitions wrote more, a copy of a part was planted). Only
    names decon writes there (:data:`DETAILS_PART`) are removed: another file is not decon's
    to delete (:func:`foreign_details` names it). Returns the relative paths removed."""
    if jsonl_too:
        storage.remove(storage.join(output, dt.DETAILS_JSONL), root=output)
    removed = []
    for path in storage.listdir(storage.join(output, dt.DETAILS_DIR)):
        rel = f"{dt.DETAILS_DIR}/{storage.basename(path)}"
        if DETAILS_PART.fullmatch(storage.basename(path)) and rel not in current:
            storage.remove(path, root=output)
            removed.append(rel)
    return removed


DETAILS_PART = re.compile(r"part-\d{5,}\.parquet")  # the names of dt.details_part: all decon writes there


def foreign_details(output: str) -> list[str]:
    """The files under ``OUTPUT/stats/overlap_details/`` whose names decon never writes there
    (not a part, nor a temp file of a write): a reader of the folder takes their rows for
    detail records, and decon does not delete what is not its own."""
    names = [storage.basename(path) for path in storage.listdir(storage.join(output, dt.DETAILS_DIR))]
    return sorted(f"{dt.DETAILS_DIR}/{name}" for name in names
                  if not DETAILS_PART.fullmatch(name) and not storage.is_temp_name(name))


def expand_as_given(args: list[str], skipped: list[str] | None = None) -> list[storage.InputFile]:
    """:func:`storage.expand_inputs`, but each file's path spelled from the argument the user gave
    (a relative folder stays relative), so that output paths are as given; one file named
    several ways is one input (:func:`storage.one_per_file`). Files skipped for their
    extension are appended to ``skipped``."""
    import glob as globlib

    out: list[storage.InputFile] = []
    for arg in args:
        for f in storage.expand_inputs([arg], skipped=skipped):
            if globlib.has_magic(arg):
                head = arg[: min(arg.index(c) for c in "*?[" if c in arg)]
                root = head.rsplit("/", 1)[0] if "/" in head else ""
                path = f"{root}/{f.relpath}" if root else f.relpath
            elif f.relpath == storage.basename(f.path) and storage.basename(arg.rstrip("/")) == f.relpath \
                    and not storage.isdir(arg):  # the file itself was named (local or remote)
                path = arg
            else:
                path = f"{arg.rstrip('/')}/{f.relpath}"
            out.append(storage.InputFile(path, f.relpath, f.size, f.version))
    return storage.one_per_file(out)


def input_stages(stages: list[Stage[Any, Any]]) -> tuple[IndexStage, ScanStage]:
    """The index and scan stages of :func:`build_stages`'s list (they hold the eval and training files)."""
    index, scan = stages[1], stages[2]
    if not (isinstance(index, IndexStage) and isinstance(scan, ScanStage)):
        raise TypeError(f"not decon's stages: {type(index).__name__}, {type(scan).__name__}")
    return index, scan


def build_stages(settings: DeconSettings, skipped: list[str] | None = None) -> list[Stage[Any, Any]]:
    eval_files = expand_as_given(settings.eval_paths, skipped)
    train_files = expand_as_given(settings.train_paths, skipped)
    index = IndexStage(settings, eval_files)
    scan = ScanStage(settings, train_files, index)
    reduce = ReduceStage(settings, scan)
    return [EvalStage(settings, eval_files), index, scan, reduce, MergeReportsStage(settings, reduce)]


class ScanWiring(StageWiring):
    """The scan's Beam wiring: the index's membership file, read once the index is done, as a
    side input (every scan unit tests its n-grams against it)."""

    def side_inputs(self, run: StageRun, start: Any) -> dict[str, Any]:
        import apache_beam as beam  # lazy: Beam loads with the job, not with the command

        path = ScanStage.membership_path(run)
        membership = start | "ReadMembership" >> beam.Map(lambda _, p: storage.read_bytes(p), path)
        return {"membership": beam.pvalue.AsSingleton(membership, default_value=None)}


class ReduceWiring(StageWiring):
    """The reduce's Beam wiring: the scan's frames, once the scan is done, as a side input."""

    def side_inputs(self, run: StageRun, start: Any) -> dict[str, Any]:
        import apache_beam as beam  # lazy: Beam loads with the job, not with the command

        frames = start | "ScanFrames" >> beam.Map(lambda _, scan_run: scan_frames(scan_run), run.upstream["scan"])
        return {"frames": beam.pvalue.AsSingleton(frames, default_value=None)}
