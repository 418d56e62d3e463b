"""Where decon's reduce spends its CPU time, step by step, on ``bench/decon.py``'s corpora.

Run ``bench/decon.py --workdir DIR`` first (it writes the corpora and their decon outputs
there), then

    .venv/bin/python bench/decon_reduce_parts.py --workdir DIR [--corpus dense sparse] [--format parquet jsonl]

For each corpus, in this one process (no Beam, no profiler): the scan's hit blocks of every
partition made once and held as msgpack (as the scan units write them), then every
partition reduced as the reduce stage does (:func:`ng.reduce_partition`, its details into
memory), its CPU seconds split by step (each step's function wrapped with a timer): reading
the blocks (msgpack), a block's hits as columns, the per-record counts, the detail records
(Parquet row groups or JSON lines), the samples, the drop list's rows and the partition's
share of the results; and the CPU time per detail record. ``--reference`` also times the
loop per hit the columns replaced (kept in ``tests/test_decon_reduce_columnar.py``).
"""
from __future__ import annotations

import argparse
import functools
import importlib
import io
import os
import sys
import time
from typing import Any, Callable

import msgpack

from refinery.transforms.decon import ngrams as ng
from refinery.transforms.decon.ngrams import details as dt
from refinery.transforms.decon.ngrams import droplist, reduce
from refinery.transforms.decon.stages import (
    EVAL_ROWS_FILE,
    load_eval_rows,
    load_partition_file,
    load_same_text,
    membership_from_bytes,
    partition_file,
)
from refinery.transforms.io import storage
from refinery.transforms.io.rows import iter_rows

STEPS = {  # (module or class, function) -> the step it is
    (reduce, "counted_hits"): "a block's hits as columns",
    (reduce.Tally, "add"): "per-record counts",
    (dt.ParquetSink, "add"): "detail records",
    (dt.ParquetSink, "_write"): "detail records",
    (dt.JsonLinesSink, "add"): "detail records",
    (dt.JsonLinesSink, "end_block"): "detail records",
    (reduce.Sampler, "add"): "samples",
    (droplist.RowHits, "add"): "drop list rows",
    (reduce, "partition_result"): "the partition's results",
}


def timed(seconds: dict[str, float], step: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[step] = seconds.get(step, 0.0) + time.process_time() - t0
    return wrapper


def index_of(out: str) -> tuple[str, str]:
    """(membership file, index folder) of the decon output ``out``."""
    for folder, _, files in os.walk(os.path.join(out, ".refinery", "index")):
        if "membership.bin" in files:
            return os.path.join(folder, "membership.bin"), folder
    raise SystemExit(f"{out}: no decon index here; run bench/decon.py --workdir {os.path.dirname(out)} first")


def hit_blocks(train: str, index_dir: str, members: Any) -> dict[int, list[bytes]]:
    """Each partition's hit blocks, msgpack bytes, in scan order (one scan unit)."""
    blocks: dict[int, list[bytes]] = {}
    for hits in ng.scan_rows(iter_rows(train), text_field="text", tokenizer=ng.TOKENIZERS["default"],
                             membership=members,
                             lookup=lambda p: load_partition_file(os.path.join(index_dir, partition_file(p))),
                             partitions=int(members.meta["partitions"]), stats=ng.ScanStats()):
        for p, block in ng.hit_blocks([ng.hit_groups(hits, "id")]):
            blocks.setdefault(p, []).append(msgpack.packb(block, use_bin_type=True, unicode_errors="surrogatepass"))
    return blocks


def reduce_all(fn: Callable[..., Any], fmt: str, parts: int, blocks: dict[int, list[bytes]], index_dir: str,
               seconds: dict[str, float]) -> tuple[float, int]:
    """CPU seconds and detail records of every partition's reduce by ``fn``."""
    rows_file = os.path.join(index_dir, EVAL_ROWS_FILE)
    eval_rows, same = load_eval_rows(rows_file), load_same_text(rows_file)
    columns = dt.EvalColumns.of(eval_rows, same)
    unpack = dict(raw=False, unicode_errors="surrogatepass", strict_map_key=False)
    total, details = 0.0, 0
    for p in range(parts):
        records = load_partition_file(os.path.join(index_dir, partition_file(p))).records

        def read(p: int = p) -> Any:
            for data in blocks.get(p, []):
                t0 = time.process_time()
                block = msgpack.unpackb(data, **unpack)
                seconds["read the blocks (msgpack)"] = seconds.get("read the blocks (msgpack)", 0.0) + \
                    time.process_time() - t0
                yield 0, "dense/docs.jsonl", 0, block

        sink = io.BytesIO()
        t0 = time.process_time()
        if fmt == "parquet":
            out = dt.DetailRows(sink, columns)
            res = fn(records, eval_rows, [5, 9, 13], read, None, None, ng.DEFAULT_MAX_NGRAM_DETAILS, same,
                     rows_out=out)
            out.close()
        else:
            res = fn(records, eval_rows, [5, 9, 13], read, None, sink.write, ng.DEFAULT_MAX_NGRAM_DETAILS, same)
        total += time.process_time() - t0
        details += res["details"]
    return total, details


def measure(workdir: str, corpus: str, formats: list[str], reference: bool) -> None:
    out = os.path.join(workdir, "out-sparse" if corpus == "sparse" else "out-dense-parquet")
    membership_path, index_dir = index_of(out)
    members = membership_from_bytes(storage.read_bytes(membership_path))
    blocks = hit_blocks(os.path.join(workdir, corpus, "docs.jsonl"), index_dir, members)
    parts = int(members.meta["partitions"])
    for fmt in formats:
        seconds: dict[str, float] = {}
        originals = [(owner, name, getattr(owner, name)) for owner, name in STEPS]
        for owner, name, fn in originals:
            setattr(owner, name, timed(seconds, STEPS[(owner, name)], fn))
        try:
            total, details = reduce_all(ng.reduce_partition, fmt, parts, blocks, index_dir, seconds)
        finally:
            for owner, name, fn in originals:
                setattr(owner, name, fn)
        print(f"{corpus}, --details-format {fmt}: {details:,} detail records; reduce {total:5.2f} CPU s, "
              f"{total / max(details, 1) * 1e6:.2f} us per detail record, of which:")
        for step, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
            print(f"    {step:<30}{s:5.2f} s")
        print(f"    {'the rest':<30}{total - sum(seconds.values()):5.2f} s")
        if reference:
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
            old_reduce: Callable[..., Any] = importlib.import_module("test_decon_reduce_columnar")._old_reduce_partition

            ref_s, ref_details = reduce_all(old_reduce, fmt, parts, blocks, index_dir, {})
            print(f"  the loop per hit before (reference): {ref_s:5.2f} CPU s, "
                  f"{ref_s / max(ref_details, 1) * 1e6:.2f} us per detail record")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True, help="the --workdir of an earlier bench/decon.py run")
    ap.add_argument("--corpus", nargs="+", choices=("sparse", "dense"), default=["dense"])
    ap.add_argument("--format", nargs="+", choices=dt.DETAILS_FORMATS, default=list(dt.DETAILS_FORMATS))
    ap.add_argument("--reference", action="store_true", help="also time the loop per hit it replaced")
    a = ap.parse_args()
    for corpus in a.corpus:
        measure(a.workdir, corpus, a.format, a.reference)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
