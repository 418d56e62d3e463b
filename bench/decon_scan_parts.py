"""Where decon's scan spends its CPU time, step by step, on ``bench/decon.py``'s corpora.

Run ``bench/decon.py --workdir DIR`` first (it writes the sparse and dense corpora and their
decon outputs there), then

    .venv/bin/python bench/decon_scan_parts.py --workdir DIR [--corpus sparse dense]

For each corpus, in this one process (no Beam, no profiler): the rows read from the JSON
lines file, then the scan over those rows held in memory, its CPU seconds split by step
(each step's function wrapped with a timer, the steps it calls not counted in it): lowering
and encoding the text; tokenizing a batch; hashing the windows; probing the membership set;
loading the index partitions the hits fall in; verifying the hash hits against the test
n-grams' text; their offsets into the rows' text; making the hit groups and blocks a scan
unit writes; and the rest (batching, normalizing, sorting). The stage's figure in ``bench/decon.py``
is about the read plus the scan plus writing its frames.
"""
from __future__ import annotations

import argparse
import functools
import os
import time
from typing import Any, Callable

from refinery.transforms.decon import ngrams as ng
from refinery.transforms.decon.ngrams import membership, scan
from refinery.transforms.decon.stages import load_partition_file, membership_from_bytes, partition_file
from refinery.transforms.io import storage
from refinery.transforms.io.rows import iter_rows

STEPS = {  # (module or class, function) -> the step it is
    (scan, "tokenize_batch"): "tokenize, hash tokens",
    (scan, "batch_prefix"): "window hashes",
    (scan, "batch_all_window_hashes"): "window hashes",
    (scan, "window_hashes_at"): "window hashes",
    (membership.Membership, "contains"): "probe the membership set",
    (scan, "verify_windows"): "verify hits",
    (scan, "char_offsets"): "offsets into the text",
}


_INNER = [0.0]  # seconds of the timed steps running inside the current one


def timed(seconds: dict[str, float], step: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, its CPU seconds added to ``seconds[step]``, less those of the timed steps it calls
    (loading a partition inside verification counts as loading)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0, outer = time.process_time(), _INNER[0]
        _INNER[0] = 0.0
        try:
            return fn(*args, **kwargs)
        finally:
            took = time.process_time() - t0
            seconds[step] = seconds.get(step, 0.0) + took - _INNER[0]
            _INNER[0] = outer + took
    return wrapper


def index_of(out: str) -> tuple[str, str]:
    """(membership file, index folder) of the decon output ``out``."""
    for folder, _, files in os.walk(os.path.join(out, ".refinery", "index")):
        if "membership.bin" in files:
            return os.path.join(folder, "membership.bin"), folder
    raise SystemExit(f"{out}: no decon index here; run bench/decon.py --workdir {os.path.dirname(out)} first")


def measure(workdir: str, corpus: str) -> None:
    out = os.path.join(workdir, "out-sparse" if corpus == "sparse" else "out-dense-parquet")
    train = os.path.join(workdir, corpus, "docs.jsonl")
    membership_path, index_dir = index_of(out)
    members = membership_from_bytes(storage.read_bytes(membership_path))
    t0 = time.process_time()
    rows = list(iter_rows(train))
    read_s = time.process_time() - t0
    tokenizer = ng.TOKENIZERS["default"]
    t0 = time.process_time()
    for _, record, _ in rows:
        if record is not None:
            tokenizer.prepare(record["text"])
    prepare_s = time.process_time() - t0

    seconds: dict[str, float] = {}
    originals = [(owner, name, getattr(owner, name)) for owner, name in STEPS]
    for owner, name, fn in originals:
        setattr(owner, name, timed(seconds, STEPS[(owner, name)], fn))
    stats, groups_s = ng.ScanStats(), 0.0
    try:
        t0 = time.process_time()
        load = timed(seconds, "load index partitions", load_partition_file)
        for hits in ng.scan_rows(iter(rows), text_field="text", tokenizer=tokenizer, membership=members,
                                 lookup=lambda p: load(os.path.join(index_dir, partition_file(p))),
                                 partitions=int(members.meta["partitions"]), stats=stats):
            t1 = time.process_time()
            list(ng.hit_blocks([ng.hit_groups(hits, "id")]))
            groups_s += time.process_time() - t1
        scan_s = time.process_time() - t0
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)
    print(f"{corpus}: {stats.text_bytes / 1e6:.1f} MB, {stats.rows:,} rows, {stats.verified_hits:,} verified hits")
    print(f"  read the rows (JSON lines)   {read_s:5.2f} s")
    print(f"  scan, rows in memory         {scan_s:5.2f} s, of which:")
    print(f"    lower and encode the text  {prepare_s:5.2f} s")
    for step, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(f"    {step:<27}{s:5.2f} s")
    print(f"    hit groups and blocks      {groups_s:5.2f} s")
    print(f"    the rest                   {scan_s - prepare_s - groups_s - sum(seconds.values()):5.2f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True, help="the --workdir of an earlier bench/decon.py run")
    ap.add_argument("--corpus", nargs="+", choices=("sparse", "dense"), default=["sparse", "dense"])
    a = ap.parse_args()
    for corpus in a.corpus:
        measure(a.workdir, corpus)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
