"""Tokenize units of about --unit-mb of input whatever the layout, and pack's reads bounded by the
merge stage: the shards are byte-identical in every case."""
from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

import pytest
from helpers import gsm8k_texts, run_prep, tree_digest, write_jsonl

from refinery.transforms.io import storage
from refinery.transforms.prep import stages as prep_stages
from refinery.transforms.prep.stages import PrepConfig, TokenizeStage
from refinery.transforms.prep.stages import count as prep_count
from refinery.transforms.resumable import Unit, UnitContext


def _tokenize_units(out: Path) -> list[str]:
    run = json.loads((out / ".refinery" / "run.json").read_text())
    (h,) = [st["stage_hash"] for st in run["stages"] if st["name"] == "tokenize"]
    return sorted(p.stem for p in (out / ".refinery" / "tokenize" / h / "receipts").glob("*.json"))


def test_rows_before_each_range_are_counted_like_the_reader(tmp_path: Path) -> None:
    from refinery.transforms.io.rows import iter_rows

    p = tmp_path / "x.jsonl"
    lines = [b'{"text": "a"}', b"", b'{"text": "bb"}\r', b"not json", b'{"text": "' + b"c" * 100 + b'"}', b'{"t": 1}']
    p.write_bytes(b"\n".join(lines))  # no newline at the end
    size = p.stat().st_size
    for step in (1, 3, 7, 16, 50, size):
        ranges = prep_stages.byte_ranges(size, step)
        counts = [prep_stages.range_newlines(str(p), *prep_stages.count_span(ranges, k))
                  for k in range(len(ranges) - 1)]
        rows = []
        for (lo, hi), base in zip(ranges, prep_stages.row_bases(counts), strict=True):
            rows += [(base + r, rec, err) for r, rec, err in iter_rows(str(p), byte_range=(lo, hi))]
        assert rows == list(iter_rows(str(p))), step


def test_the_driver_does_not_read_a_big_file_to_number_its_rows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The rows of a big .jsonl's byte ranges are counted by the count stage's units, inside the
    job: planning reads none of the file, and the run's step names show the stage."""
    big = write_jsonl(tmp_path / "in" / "big.jsonl", [{"text": t} for t in gsm8k_texts(300)])
    cfg = PrepConfig(storage.expand_inputs([str(big)]), str(tmp_path / "o"), "d", unit_bytes=16 << 10)
    monkeypatch.setattr(prep_count, "range_newlines", lambda *a: pytest.fail("read while planning"))
    stages = prep_stages.build_stages(cfg)
    assert [s.name for s in stages] == ["count", "tokenize", "pack", "manifest"]
    count, tokenize = stages[0].plan(), stages[1].plan()
    assert len(count) == len(tokenize) - 1 > 3 and not any("row_base" in u.payload["pieces"][0] for u in tokenize)


def test_units_group_small_files_and_split_big_ones(tmp_path: Path) -> None:
    texts = gsm8k_texts(600)
    small = [write_jsonl(tmp_path / "in" / f"s{k:03d}.jsonl", [{"text": t}]) for k, t in enumerate(texts[:40])]
    big = write_jsonl(tmp_path / "in" / "zz-big.jsonl", [{"text": t} for t in texts[40:]])
    inputs = storage.expand_inputs([str(tmp_path / "in")])
    unit = 64 << 10
    plan = TokenizeStage(PrepConfig(inputs, str(tmp_path / "o"), "d", unit_bytes=unit)).plan()
    grouped = [u for u in plan if len(u.payload["pieces"]) > 1]
    ranges = [u for u in plan if "byte_range" in u.payload["pieces"][0]]
    assert sum(len(u.payload["pieces"]) for u in grouped) + len(plan) - len(grouped) - len(ranges) == len(small)
    assert len(ranges) == -(-big.stat().st_size // unit) and ranges[0].id.endswith("-r0000")
    per_file = TokenizeStage(PrepConfig(inputs, str(tmp_path / "o"), "d", unit_bytes=0)).plan()
    assert len(per_file) == 41 and all(len(u.payload["pieces"]) == 1 for u in per_file)


@pytest.mark.parametrize("layout", ["one big file", "many small files"])
def test_shards_are_the_same_bytes_whatever_the_units(tmp_path: Path, layout: str) -> None:
    texts = gsm8k_texts(500)
    root = tmp_path / "in"
    if layout == "one big file":  # no ids: documents are named "{relpath}:{row}", so rows must be numbered right
        write_jsonl(root / "all.jsonl", [{"text": t} for t in texts], raw_lines={7: "{broken", 300: ""})
    else:
        for k in range(100):
            write_jsonl(root / f"p{k:03d}.jsonl", [{"text": t} for t in texts[k * 5:(k + 1) * 5]])
    outs = {}
    for mb in ("0", "0.05"):
        out = tmp_path / f"out-{mb}"
        assert run_prep([root], out, "--num-shards", 3, "--dataset", "d", "--unit-mb", mb) == 0
        outs[mb] = out
    assert len(_tokenize_units(outs["0.05"])) > 1
    if layout == "one big file":
        assert _tokenize_units(outs["0"]) == ["00000"]
    else:
        assert len(_tokenize_units(outs["0"])) == 100 > len(_tokenize_units(outs["0.05"]))
    files = [{k: v for k, v in tree_digest(out).items() if k != "manifest.json"} for out in outs.values()]
    assert files[0] == files[1] and len(files[0]) == 10  # 3 shards (.npy, .idx, .docs.parquet) and rejects.jsonl
    manifests = [json.loads((out / "manifest.json").read_text()) for out in outs.values()]
    assert manifests[0]["shards"] == manifests[1]["shards"] and manifests[0]["rows"] == manifests[1]["rows"]


def test_pack_reads_are_bounded_by_the_merge_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """200 tiny tokenize units x 64 shards on an object store (fsspec memory://): without the
    merge stage pack opens one starts table per (unit, shard) plus two files per non-empty
    pair; with it, per (group, shard). The shards are identical. (`bench/prep.py --scale`
    runs the same with thousands of units.)"""
    import fsspec

    texts = gsm8k_texts(200)
    root = tmp_path / "in"
    for k, t in enumerate(texts):
        write_jsonl(root / f"f{k:04d}.jsonl", [{"id": f"d{k}", "text": t}])
    opened: dict[str, int] = {}
    real_open = storage.open_read
    real_run = prep_stages.PackStage.run_unit
    current: dict[str, str | None] = {"stage": None}

    def counting_open(path: str, *a: Any, **k: Any) -> IO[bytes]:
        stage = current["stage"]
        if stage:
            opened[stage] = opened.get(stage, 0) + 1
        return real_open(path, *a, **k)

    def counting_pack(self: prep_stages.PackStage, unit: Unit[prep_stages.ShardPayload],
                      ctx: UnitContext) -> prep_stages.PackStats:
        current["stage"] = "pack"
        try:
            return real_run(self, unit, ctx)
        finally:
            current["stage"] = None

    monkeypatch.setattr(storage, "open_read", counting_open)
    monkeypatch.setattr(prep_stages.PackStage, "run_unit", counting_pack)
    digests, pack_opens = {}, {}
    try:
        for label, limit in (("without merge", 1 << 40), ("with merge", 1 << 10)):
            monkeypatch.setattr(prep_stages, "MERGE_ABOVE", limit)
            opened.clear()
            out = f"memory://bucket/{label.replace(' ', '-')}"
            assert run_prep([root], out, "--num-shards", 64, "--dataset", "m", "--unit-mb", "0", runner="direct") == 0
            fs = fsspec.filesystem("memory")
            digests[label] = {p.split("/", 3)[-1]: fs.cat_file(p) for p in fs.find(f"/bucket/{label.replace(' ', '-')}")
                              if "/shard_" in p}
            pack_opens[label] = opened.pop("pack")
    finally:
        fsspec.filesystem("memory").rm("/bucket", recursive=True)
    assert digests["with merge"] == digests["without merge"]
    assert len(digests["with merge"]) == 192  # 64 x (.npy, .idx, .docs.parquet)
    assert pack_opens["without merge"] >= 200 * 64  # every (unit, shard) at least opens its starts table
    # one merge group: at most 5 files per shard (starts, documents, tokens; each document's row and
    # source for the provenance sidecar: .spillmeta, .spillnames)
    assert pack_opens["with merge"] <= 5 * 64
    print(f"pack opens, 200 units x 64 shards: {pack_opens['without merge']:,} without merge, "
          f"{pack_opens['with merge']:,} with merge")
