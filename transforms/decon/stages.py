"""The three stages of ``refinery decon``: index -> scan -> reduce (thin wiring).

The logic lives in :mod:`refinery.transforms.decon.ngrams`; this module binds it to the
stage/receipt machinery of :mod:`refinery.transforms.core.stages`.

- ``index`` (units: ``catalog`` + one per hash partition): eval rows -> n-grams. The
  ``catalog`` unit writes the compact membership file (``membership.bin``: sorted uint64
  n-gram hashes) and the eval rows table; ``partition-XXXXX`` writes the detail records of
  the n-grams whose ``ngram_hash % P == XXXXX`` (text, eval rows, eval offsets).
- ``scan`` (units: training file slices): each unit streams its slice, probes the
  membership structure (a Beam side input: the membership file's bytes, broadcast), verifies
  each hash hit against the exact n-gram text of the partition it falls in (partitions are
  loaded only when hit, cached per worker process), and writes one part file of overlap
  events. Training n-grams never enter a shuffle.
- ``reduce`` (local, one unit): parts -> ``stats/overlap_stats.jsonl``,
  ``stats/overlap_details.jsonl.gz``, ``stats/overlap_stats_by_train_path.jsonl``,
  ``stats/overlap_metrics.jsonl``, ``stats/eval_summary.jsonl``, ``stats/report.md``, then
  ``.SUCCESS`` last.
"""
from __future__ import annotations

import gc
import gzip
import hashlib
import json
import resource
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator

import msgpack
import zstandard

from refinery.transforms.core import io
from refinery.transforms.core.rows import iter_rows, parquet_row_groups
from refinery.transforms.decon import ngrams as ng
from refinery.transforms.core.stages import Stage, Unit, UnitContext, bind_stages

FORMAT_VERSION = 1
MEMBERSHIP_FILE = "membership.bin"
EVAL_ROWS_FILE = "eval_rows.jsonl.gz"
EVAL_SUMMARY_FILE = "eval_bad_rows.json"


def events_file(unit_id: str) -> str:
    """A scan unit's overlap events: a zstd-compressed stream of msgpack maps
    ``{row, doc_id, text, hits: [{n, ngram, partition, offsets}]}`` (row within the unit)."""
    return f"events/{unit_id}.msgpack.zst"


def read_events(path: str) -> Iterator[dict]:
    with io.open_read(path) as raw:
        reader = zstandard.ZstdDecompressor().stream_reader(raw)
        unpacker = msgpack.Unpacker(reader, raw=False, unicode_errors="surrogatepass", max_buffer_size=1 << 31)
        yield from unpacker


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
    slice_bytes: int = 256 << 20
    batch_bytes: int = 1 << 20

    def __post_init__(self):
        self.ns = sorted(set(int(n) for n in self.ns))
        if not self.ns or self.ns[0] < 1:
            raise ValueError("--ngrams needs positive integers")
        if self.partitions < 1:
            raise ValueError("--partitions must be >= 1")
        ng.get_tokenizer(self.tokenizer)


# ---------------------------------------------------------------------------------------
# Per-process caches (a worker process serves many units)
# ---------------------------------------------------------------------------------------

_EVAL_LOCK = threading.Lock()


@lru_cache(maxsize=2)
def _eval_index(files: tuple[tuple[str, int, str], ...], text_field: str, id_field: str, tokenizer: str,
                ns: tuple[int, ...], partitions: int) -> ng.NgramIndex:
    """The eval index, built once per worker process for all index units.
    ``files`` = (path, size, version): a changed file is a different key."""
    with ng.gc_paused():
        rows, bad = ng.make_eval_rows([f[0] for f in files], iter_rows, text_field, id_field,
                                      ng.get_tokenizer(tokenizer))
        index = ng.NgramIndex.build(rows, bad, ns, tokenizer, partitions)
    gc.freeze()  # millions of long-lived objects: keep them out of every later GC pass
    return index


_MEMBERSHIP: dict[str, ng.Membership] = {}


def membership_from_bytes(data: bytes) -> ng.Membership:
    key = hashlib.blake2b(data, digest_size=16).hexdigest()
    m = _MEMBERSHIP.get(key)
    if m is None:
        _MEMBERSHIP.clear()
        m = _MEMBERSHIP[key] = ng.Membership.from_bytes(data)
    return m


@lru_cache(maxsize=256)
def load_partition_file(path: str) -> dict:
    with ng.gc_paused():
        part = ng.load_partition(io.read_bytes(path))
    gc.freeze()
    return part


# ---------------------------------------------------------------------------------------
# index
# ---------------------------------------------------------------------------------------

class IndexStage(Stage):
    name = "index"

    def __init__(self, settings: DeconSettings, eval_files: list[io.InputFile]):
        self.s = settings
        self.eval_files = eval_files

    def config(self) -> dict:
        return {"format": FORMAT_VERSION, "ns": self.s.ns, "text_field": self.s.eval_text_field,
                "id_field": self.s.id_field, "partitions": self.s.partitions}

    def fingerprints(self) -> list:
        return [f.fingerprint() for f in self.eval_files]

    def identity(self) -> dict:
        return {"tokenizer": ng.get_tokenizer(self.s.tokenizer).identity()}

    def plan(self) -> list[Unit]:
        return [Unit("catalog", {})] + [Unit(f"partition-{p:05d}", {"p": p}) for p in range(self.s.partitions)]

    def _index(self) -> ng.NgramIndex:
        with _EVAL_LOCK:  # units of one process may run in parallel threads: build once
            return _eval_index(tuple((f.path, f.size, f.version) for f in self.eval_files), self.s.eval_text_field,
                               self.s.id_field, self.s.tokenizer, tuple(self.s.ns), self.s.partitions)

    def run_unit(self, unit: Unit, ctx: UnitContext) -> dict:
        index = self._index()
        if unit.id == "catalog":
            membership = index.membership
            ctx.write_bytes(ctx.part_path(MEMBERSHIP_FILE), membership.to_bytes())
            ctx.write_bytes(ctx.part_path(EVAL_ROWS_FILE), ng.dumps_jsonl_gz(r.to_json() for r in index.rows))
            ctx.write_bytes(ctx.part_path(EVAL_SUMMARY_FILE), json.dumps(index.bad, sort_keys=True).encode())
            return {"eval_rows": len(index.rows), "test_ngrams": index.num_ngrams,
                    "membership_bytes": membership.hashes.nbytes,
                    "membership_loaded_bytes": membership.nbytes,
                    "lengths": list(membership.lengths)}
        p = unit.payload["p"]
        recs = index.records.get(p, [])
        ctx.write_bytes(ctx.part_path(partition_file(p)), ng.dumps_partition(recs))
        return {"test_ngrams": len(recs)}


# ---------------------------------------------------------------------------------------
# scan
# ---------------------------------------------------------------------------------------

def plan_train_units(files: list[io.InputFile], slice_bytes: int) -> list[Unit]:
    units = []
    for fi, f in enumerate(files):
        if f.path.endswith(".jsonl") and f.size > slice_bytes:
            k = -(-f.size // slice_bytes)
            for si in range(k):
                units.append(Unit(f"f{fi:05d}-s{si:04d}", {"path": f.path, "kind": "bytes", "file": fi, "slice": si,
                                                         "lo": si * slice_bytes, "hi": min(f.size, (si + 1) * slice_bytes)}))
        elif f.path.endswith(".parquet") and f.size > slice_bytes:
            groups = parquet_row_groups(f.path)
            per = max(1, int(len(groups) * slice_bytes // max(1, f.size)))
            for si, g in enumerate(range(0, len(groups), per)):
                units.append(Unit(f"f{fi:05d}-s{si:04d}", {"path": f.path, "kind": "row_groups", "file": fi,
                                                         "slice": si, "lo": g, "hi": min(len(groups), g + per)}))
        else:
            units.append(Unit(f"f{fi:05d}-s0000", {"path": f.path, "kind": "file", "file": fi, "slice": 0}))
    return units


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class ScanStage(Stage):
    name = "scan"

    def __init__(self, settings: DeconSettings, train_files: list[io.InputFile], index_stage: IndexStage,
                 output: str):
        self.s = settings
        self.train_files = train_files
        self.index_stage = index_stage
        self.output = output

    def config(self) -> dict:
        return {"format": FORMAT_VERSION, "text_field": self.s.train_text_field, "id_field": self.s.id_field,
                "slice_bytes": self.s.slice_bytes}

    def fingerprints(self) -> list:
        return [f.fingerprint() for f in self.train_files]

    def identity(self) -> dict:
        return {"tokenizer": ng.get_tokenizer(self.s.tokenizer).identity()}

    def plan(self) -> list[Unit]:
        return plan_train_units(self.train_files, self.s.slice_bytes)

    def membership_path(self) -> str:
        # index is the first stage: its bound hash does not depend on anything upstream
        return io.join(bind_stages([self.index_stage], self.output)[0].parts_dir, MEMBERSHIP_FILE)

    def side_inputs(self, pipeline) -> dict:
        import apache_beam as beam

        membership = (pipeline
                      | "MembershipPath" >> beam.Create([self.membership_path()])
                      | "ReadMembership" >> beam.Map(io.read_bytes))
        return {"membership": beam.pvalue.AsSingleton(membership)}

    def describe_progress(self, stats: dict, seconds: float) -> str:
        mb = stats.get("text_bytes", 0) / 1e6
        return f"{mb:.0f} MB, {mb / max(seconds, 1e-9):.1f} MB/s"

    def run_unit(self, unit: Unit, ctx: UnitContext) -> dict:
        t0 = time.perf_counter()
        c0 = time.thread_time()
        data = ctx.side.get("membership")
        if data is None:  # run without Beam (tests, local stage runners)
            data = io.read_bytes(self.membership_path())
        membership = membership_from_bytes(data)
        index_parts = ctx.upstream("index").parts_dir
        partitions = int(membership.meta.get("partitions", self.s.partitions))

        def lookup(p: int) -> dict:
            return load_partition_file(io.join(index_parts, partition_file(p)))

        pl = unit.payload
        if pl["kind"] == "bytes":
            rows = iter_rows(pl["path"], byte_range=(pl["lo"], pl["hi"]))
        elif pl["kind"] == "row_groups":
            rows = iter_rows(pl["path"], row_groups=(pl["lo"], pl["hi"]))
        else:
            rows = iter_rows(pl["path"])
        stats = ng.ScanStats()
        tok = ng.get_tokenizer(self.s.tokenizer)
        events = 0
        packer = msgpack.Packer(use_bin_type=True, unicode_errors="surrogatepass")
        with ctx.open_write(ctx.part_path(events_file(unit.id))) as raw, ng.gc_paused():
            with zstandard.ZstdCompressor(level=1).stream_writer(raw, closefd=False) as zw:
                for ev in ng.scan_rows(rows, text_field=self.s.train_text_field, id_field=self.s.id_field,
                                       tokenizer=tok, membership=membership, lookup=lookup,
                                       partitions=partitions, stats=stats, batch_bytes=self.s.batch_bytes):
                    zw.write(packer.pack(ev))
                    events += 1
        return {**stats.__dict__, "events": events, "seconds": time.perf_counter() - t0,
                "cpu_seconds": time.thread_time() - c0,
                "peak_rss_mb": _peak_rss_mb(), "membership_loaded_bytes": membership.nbytes,
                "test_ngrams": len(membership)}


# ---------------------------------------------------------------------------------------
# reduce
# ---------------------------------------------------------------------------------------

STATS_FILES = ("stats/overlap_stats.jsonl", "stats/overlap_details.jsonl.gz", "stats/overlap_stats_by_train_path.jsonl",
               "stats/overlap_metrics.jsonl", "stats/eval_summary.jsonl", "stats/report.md")


def _jsonl(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(r, ensure_ascii=False).encode("utf-8", ng.JSON_ERRORS) + b"\n" for r in rows)


class ReduceStage(Stage):
    name = "reduce"
    local = True
    final_outputs = True

    def __init__(self, settings: DeconSettings, scan_stage: ScanStage):
        self.s = settings
        self.scan_stage = scan_stage

    def config(self) -> dict:
        return {"format": FORMAT_VERSION, "ns": self.s.ns, "max_train_count": self.s.max_train_count}

    def plan(self) -> list[Unit]:
        return [Unit("reduce", {})]

    def run_unit(self, unit: Unit, ctx: UnitContext) -> dict:
        index_run = ctx.upstream("index")
        scan_run = ctx.upstream("scan")
        tok = ng.get_tokenizer(self.s.tokenizer)
        eval_rows = [ng.EvalRow(**r) for r in ng.loads_jsonl_gz(io.read_bytes(io.join(index_run.parts_dir, EVAL_ROWS_FILE)))]
        bad = json.loads(io.read_bytes(io.join(index_run.parts_dir, EVAL_SUMMARY_FILE)))
        plan = scan_run.stage.plan()
        receipts = scan_run.completed_receipts(plan)
        missing = [u.id for u in plan if u.id not in receipts]
        if missing:
            raise RuntimeError(f"scan units not completed: {missing[:5]}")
        # row base of each byte slice = rows of the preceding slices of the same file
        base: dict[str, int] = {}
        seen_rows: dict[int, int] = {}
        for u in plan:
            f = u.payload["file"]
            base[u.id] = seen_rows.get(f, 0) if u.payload["kind"] == "bytes" else 0
            seen_rows[f] = seen_rows.get(f, 0) + int(receipts[u.id]["stats"].get("rows", 0))
        scan_totals: dict[str, float] = {}
        for r in receipts.values():
            for k, v in r["stats"].items():
                if isinstance(v, (int, float)) and k not in ("peak_rss_mb", "membership_loaded_bytes", "test_ngrams", "lengths"):
                    scan_totals[k] = scan_totals.get(k, 0) + v

        def events() -> Iterator[ng.TrainEvent]:
            for u in plan:
                for ev in read_events(io.join(scan_run.parts_dir, events_file(u.id))):
                    yield ng.TrainEvent(u.payload["path"], base[u.id] + ev["row"], ev["doc_id"], ev["text"], ev["hits"])

        partitions: dict[int, dict] = {}

        def eval_detail(p: int, n: int, gram: str) -> list:
            part = partitions.get(p)
            if part is None:
                part = partitions[p] = load_partition_file(io.join(index_run.parts_dir, partition_file(p)))
            return part[(n, gram)]

        details_path = ctx.output_path("stats/overlap_details.jsonl.gz")
        n_details = 0
        with ctx.open_write(details_path) as raw, ng.gc_paused():
            with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=1) as gz:
                pending: list[str] = []
                size = 0

                def write_detail(line: str) -> None:
                    nonlocal n_details, size
                    pending.append(line)
                    size += len(line)
                    n_details += 1
                    if size > 1 << 20:
                        flush()

                def flush() -> None:
                    nonlocal size
                    if pending:
                        gz.write(("\n".join(pending) + "\n").encode("utf-8", ng.JSON_ERRORS))
                        pending.clear()
                    size = 0

                result = ng.reduce_overlaps(eval_rows, self.s.ns, events, eval_detail, tok, self.s.max_train_count,
                                            write_detail, bad)
                flush()
        ctx.write_bytes(ctx.output_path("stats/overlap_stats.jsonl"), _jsonl(result.overlap_stats))
        ctx.write_bytes(ctx.output_path("stats/overlap_stats_by_train_path.jsonl"), _jsonl(result.by_train_path))
        ctx.write_bytes(ctx.output_path("stats/overlap_metrics.jsonl"), _jsonl(result.metrics))
        ctx.write_bytes(ctx.output_path("stats/eval_summary.jsonl"), _jsonl(result.summary))
        ctx.write_bytes(ctx.output_path("stats/report.md"),
                        ng.render_report(result, scan_totals, self.s.max_train_count).encode())
        ctx.write_bytes(ctx.output_path(".SUCCESS"), b"")
        return {"details": n_details, "ignored_ngrams": result.ignored_ngrams,
                "contaminated": {f"{s['eval_dataset']}/{s['n']}": len(s["instance_ids"]) for s in result.overlap_stats},
                "scan": scan_totals}


def expand_as_given(args: list[str]) -> list[io.InputFile]:
    """:func:`io.expand_inputs`, but each file's path spelled from the argument the user gave
    (a relative folder stays relative), so that output paths are as given."""
    import glob as globlib

    out: dict[str, io.InputFile] = {}
    for arg in args:
        for f in io.expand_inputs([arg]):
            if globlib.has_magic(arg):
                head = arg[: min(arg.index(c) for c in "*?[" if c in arg)]
                root = head.rsplit("/", 1)[0] if "/" in head else ""
                path = f"{root}/{f.relpath}" if root else f.relpath
            elif f.relpath == io.basename(f.path) and io.basename(arg.rstrip("/")) == f.relpath \
                    and not (io.is_remote(arg) or __import__("os").path.isdir(arg)):
                path = arg
            else:
                path = f"{arg.rstrip('/')}/{f.relpath}"
            out.setdefault(path, io.InputFile(path, f.relpath, f.size, f.version))
    return sorted(out.values(), key=lambda f: f.path)


def build_stages(settings: DeconSettings, output: str) -> list[Stage]:
    eval_files = expand_as_given(settings.eval_paths)
    train_files = expand_as_given(settings.train_paths)
    index = IndexStage(settings, eval_files)
    scan = ScanStage(settings, train_files, index, output)
    return [index, scan, ReduceStage(settings, scan)]
