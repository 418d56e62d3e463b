"""One process that runs decon's stages one after another (the local runner's driver, a direct
run) lets each stage's caches go, and gives their memory back to the system, before the next
stage's peak: a 20 MB eval row's driver peaked at 1.2 GB, each stage alone under 700 MB."""
from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import write_jsonl

from refinery.transforms.decon import ngrams as ng
from refinery.transforms.decon import stages as ds
from refinery.transforms.decon.ngrams import hashes, normalized
from refinery.transforms.io.gc_pause import release_freed_memory
from refinery.transforms.resumable import execute_unit
from refinery.transforms.resumable.planner import bind_stages


def test_the_merge_starts_with_no_cache_of_the_earlier_stages_and_their_memory_given_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the scan's membership and the reduce's eval columns stayed loaded through the
    merge, and the partitions the merge let go (4 MB each on a 20 MB row) stayed in the C heap's
    resident pages, under the merge's own peak."""
    rnd = random.Random(0)
    words = [f"w{rnd.randrange(500)}" for _ in range(3_000)]
    write_jsonl(tmp_path / "eval/ds/test.jsonl", [{"id": "e0", "text": " ".join(words)}])
    write_jsonl(tmp_path / "train/t.jsonl", [{"text": " ".join(words[j * 50:j * 50 + 30])} for j in range(20)])
    settings = ds.DeconSettings(eval_paths=[str(tmp_path / "eval")], train_paths=[str(tmp_path / "train")],
                                ns=[13], partitions=4)
    events: list[str] = []

    def release() -> bool:
        events.append("released")
        return True

    monkeypatch.setattr(ds, "release_freed_memory", release)
    for cache in (ds.load_partition_file, ds.load_eval_rows, ds.load_same_text, ds.load_eval_columns):
        cache.cache_clear()  # a fresh process
    ds._MEMBERSHIP.clear()
    read_rows = ds.load_eval_rows

    def merge_reads_rows(path: str) -> list[ng.EvalRow]:  # the merge's first read after its let-go
        if runs[-1] is current[0]:
            events.append("merge reads" if not (ds._MEMBERSHIP
                                               or ds.load_partition_file.cache_info().currsize
                                               or ds.load_eval_columns.cache_info().currsize) else "merge holds")
        return read_rows(path)

    monkeypatch.setattr(ds, "load_eval_rows", merge_reads_rows)
    runs = bind_stages(ds.build_stages(settings), str(tmp_path / "out"))
    current: list[object] = [None]
    held: dict[str, bool] = {}
    for run in runs:
        current[0] = run
        events.append(run.name)
        for unit in run.stage.plan():
            assert execute_unit(run, unit)["status"] == "completed", (run.name, unit.id)
        held[run.name] = bool(ds._MEMBERSHIP) or ds.load_partition_file.cache_info().currsize > 0
    assert held == {"eval": False, "index": False, "scan": True, "reduce": True, "merge": False}  # each its caches
    # the eval and index stages keep nothing (slices, a partition at a time); the membership is let go at the
    # reduce, the rest at the merge: each given back
    assert events == ["eval", "index", "scan", "reduce", "released", "merge", "released", "merge reads"], events
    assert (tmp_path / "out/.SUCCESS").exists()


FRAGMENTED = """
import sys
from refinery.transforms.io.gc_pause import release_freed_memory

def rss_kb():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS"))

big = bytes(16 << 20)  # freed: glibc serves blocks of up to its size from its heap from now on
del big
blocks, pins = [], []
for i in range(32):  # 4 MB blocks in the heap, each followed by a small block that stays
    blocks.append(bytes([i]) * (4 << 20))
    pins.append(bytes([i]) * 4096)
held = rss_kb()
del blocks
freed = rss_kb()
assert release_freed_memory()
print(held - freed, freed - rss_kb())
"""


def test_memory_freed_in_the_middle_of_the_heap_is_given_back() -> None:
    """Before, with nothing but ``gc.collect()``: 128 MB of freed 4 MB blocks below a block that
    stays were still resident (glibc gives back only the top of its heap by itself)."""
    if not sys.platform.startswith("linux") or not release_freed_memory():
        return  # no glibc: nothing to give back this way
    done = subprocess.run([sys.executable, "-c", FRAGMENTED], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    by_free, by_release = map(int, done.stdout.split())
    assert by_free < 32 << 10, (by_free, by_release)  # free() alone kept most of them resident
    assert by_release > 96 << 10, (by_free, by_release)  # the release gave back most of the 128 MB


def test_let_go_of_empty_caches_releases_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker process that never loaded them (most units): no call into the C library per unit."""
    calls: list[int] = []

    def release() -> bool:
        calls.append(1)
        return True

    monkeypatch.setattr(ds, "release_freed_memory", release)
    ds.load_partition_file.cache_clear()
    ds._MEMBERSHIP.clear()
    assert not ds.let_go(ds.load_partition_file, membership=True)
    assert calls == []


def test_a_long_text_is_tokenized_as_before_with_equal_tokens_one_string() -> None:
    """Before: the merge's HELM metrics of a 20 MB eval row held its 3 million tokens as as many
    strings (about 200 MB over the list); now one string per word, the same list of tokens."""
    rnd = random.Random(2)
    chars = list("abcΣσİi .,'-:\t\n!?Äx ")
    for _ in range(2_000):  # cut anywhere, runs of separators at either end of a piece
        text = "".join(rnd.choice(chars) for _ in range(rnd.randrange(60)))
        for tok in ng.TOKENIZERS.values():
            for piece in (1, 2, 3, 7):
                assert tok.tokenize_shared(text, piece) == tok.tokenize(text), (tok.name, text, piece)
    words = [f"W{i}" for i in range(300)]
    text = "".join(f"{rnd.choice(words)}{rnd.choice([' ', '. ', ', '])}" for _ in range(50_000))
    tok = ng.get_tokenizer("default")
    shared = tok.tokenize_shared(text, piece=4096)
    assert shared == tok.tokenize(text) and len(shared) > 50_000
    assert len({id(t) for t in shared}) <= 301  # the words and the empty token at the end
    assert normalized.tokens(tok, text) == shared


def test_the_powers_of_a_batch_of_millions_of_tokens_are_not_kept() -> None:
    """Before: the index of one 3 million token eval row left 55 MB of powers in its process
    (the local runner's driver) through the scan, the reduce and the merge."""
    keep = hashes._Powers(hashes._M_TOKEN, keep=1 << 12)
    grown = hashes._Powers(hashes._M_TOKEN, keep=1 << 30)
    for size in (10, 5_000, 1 << 12, 100_000, 300):
        (f, i), (gf, gi) = keep.get(size), grown.get(size)
        assert len(f) == size and np.array_equal(f, gf) and np.array_equal(i, gi), size
        assert len(keep.fwd) <= 1 << 12
    assert len(grown.fwd) >= 100_000
    assert hashes._TOKEN_POWERS.keep <= 1 << 20
