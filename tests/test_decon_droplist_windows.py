"""decon's merge of the training-row side holds a window of rows, not the run's (issue 58, item 7).

The merge held every partition's drop-list share (a training row in most of them: its doc id,
records and spans each time) with sets of rows per training path: about 4.4 KB per contaminated
training row, 4.39 GB in the driver for a million. Each reduce unit now writes its share as a
column file (``transforms/decon/ngrams/row_shares.py``) and the merge reads them a window of
rows at a time. Here: any window size gives the bytes of the whole-shares merge (the drop
list, its spans, the longest matches, the row counts), a window holds at most its size of
each partition's rows, and the merge stage's peak does not grow with the contaminated rows.
"""
from __future__ import annotations

import random
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import gsm8k_rows, write_jsonl
from test_decon_longest import DEFAULT, eval_rows, reduce_all

from refinery.transforms.decon import ngrams as ng
from refinery.transforms.decon.ngrams import row_shares as rs
from refinery.transforms.decon.ngrams.droplist import DropList
from refinery.transforms.decon.ngrams.longest import longest_matches


def _corpus(seed: int) -> tuple[list[ng.EvalRow], list[str]]:
    rng = random.Random(seed)
    words = [f"w{k}" for k in range(12)]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 14))) for _ in range(10)]
    train = [" ".join(rng.choice(words) for _ in range(rng.randint(2, 40))) for _ in range(30)]
    train += [f"copy {j}: {texts[j % len(texts)]}" for j in range(12)]
    return eval_rows(texts), train


def _old_counts(parts: list[dict[str, Any]], ns: list[int]) -> tuple[dict[tuple[str, str, int], int], dict[int, int]]:
    """The row counts as the merge made them from the results' by_path rows."""
    by_path: dict[tuple[str, str, int], set[int]] = defaultdict(set)
    for part in parts:
        for path, ds, n, _, rows in part["by_path"]:
            by_path[(path, ds, n)].update(rows)
    at_n: dict[tuple[str, int], set[int]] = defaultdict(set)
    for (path, _, n), rows in by_path.items():
        at_n[(path, n)].update(rows)
    return ({k: len(v) for k, v in by_path.items()},
            {n: sum(len(r) for (_, m), r in at_n.items() if m == n) for n in ns})


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_window_size_gives_the_whole_merges_bytes(seed: int) -> None:
    rows, train = _corpus(seed)
    ns = [3, 5]
    parts = reduce_all(rows, train, ns, 5)
    same = ng.same_text(rows)
    shares = [(p["train_rows"], p["windows"]) for p in parts]
    whole = DropList([s for s, _ in shares], rows, same)
    want_drop, want_spans = b"".join(whole.chunks()), b"".join(whole.span_chunks())
    want_longest = longest_matches(shares, rows, ns, DEFAULT)
    want_by_path, want_at_n = _old_counts(parts, ns)
    assert want_drop.count(b"\n") > 20 and want_spans and want_longest.max() > 3
    encoded = [rs.encode_row_share(r, w, rows, DEFAULT) for r, w in shares]
    files = [rs.RowShare(rs.bytes_reader(data), f"share {i}") for i, data in enumerate(encoded)]
    for rows_at_once in (1, 2, 5, 10 ** 9):
        drop, spans = bytearray(), bytearray()
        got = rs.merge_train_rows(files, rows, same, ns, DEFAULT, drop.extend, spans.extend, rows_at_once)
        assert bytes(drop) == want_drop and bytes(spans) == want_spans, rows_at_once
        assert (got.longest == want_longest).all(), rows_at_once
        assert got.rows_by_path == want_by_path and got.rows_at_n == want_at_n, rows_at_once
        assert got.largest_window <= rows_at_once * len(files)  # one window's rows, never the run's
        if rows_at_once <= 2:
            assert got.windows > 5


def test_a_share_file_of_another_format_is_refused() -> None:
    with pytest.raises(ValueError, match="not a row-share file of this version"):
        rs.RowShare(lambda a, b: b"x" * (b - a), "results/rows-00003.bin")


STAGE = r"""
import resource, sys
from refinery.beam_pipelines import decon
from refinery.transforms.resumable import bind_stages, execute_unit
from refinery.transforms.decon.stages import build_stages
from refinery.transforms.decon.ngrams import row_shares
row_shares.ROWS_AT_ONCE = 128  # both sizes' windows full: the merge's peak is then the same
stage, argv = sys.argv[1], sys.argv[2:]
args = decon.build_parser().parse_args(argv)
run, = [r for r in bind_stages(build_stages(decon.settings_from_args(args)), args.output) if r.name == stage]
assert all(execute_unit(run, u)["status"] == "completed" for u in run.stage.plan())
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def _merge_peak_kb(root: Path, n_train: int) -> int:
    """The merge stage's peak RSS (KB), in a process of its own, for ``n_train`` training rows
    each holding one of 300 GSM8K questions (each row in most of the 64 partitions)."""
    qs = [r["question"] for r in gsm8k_rows("test")[:300]]
    write_jsonl(root / "eval/gsm8k/test.jsonl", [{"id": f"t{i}", "text": q} for i, q in enumerate(qs)])
    write_jsonl(root / "train/t.jsonl", [{"text": f"Doc {j}. {qs[j % len(qs)]} Answer: {j}."}
                                         for j in range(n_train)])
    argv = ["--eval", str(root / "eval"), "--train", str(root / "train"), "--output", str(root / "out")]
    peak = 0
    for stage in ("eval", "index", "scan", "reduce", "merge"):
        done = subprocess.run([sys.executable, "-c", STAGE, stage, *argv], capture_output=True, text=True,
                              timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        peak = int(done.stdout.split()[-1])
    drop = (root / "out/stats/contaminated_train_docs.jsonl").read_bytes()
    assert drop.count(b"\n") == n_train
    return peak


def test_the_merges_peak_does_not_grow_with_the_contaminated_rows(tmp_path: Path) -> None:
    """Before: 6.7 KB more per contaminated training row (131 MB from 4,000 to 24,000 rows)."""
    small, large = _merge_peak_kb(tmp_path / "small", 4_000), _merge_peak_kb(tmp_path / "large", 24_000)
    per_row = (large - small) * 1024 / 20_000
    assert per_row < 1500, f"the merge's peak grew by {per_row:.0f} bytes per contaminated training row"
    assert np.isfinite(per_row)
