"""The Beam pipeline example of docs/TRANSFORMS.md ("refinery's transforms in your own Beam
pipeline", linked from the README) runs, as printed."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from helpers import gsm8k_rows

from refinery.beam_pipelines.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "beam_pipeline.py"


def test_the_transforms_page_shows_the_example_verbatim() -> None:
    page = (ROOT / "docs" / "TRANSFORMS.md").read_text()
    assert "docs/TRANSFORMS.md" in (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert EXAMPLE.read_text() in blocks


def test_example_writes_verifiable_shards_and_finds_the_planted_overlaps(tmp_path: Path) -> None:
    corpus = [json.loads(line) for line in (ROOT / "examples/sample_corpus/gsm8k_train_part1.jsonl").open()]
    test = gsm8k_rows("test")[:40]
    for i in range(0, 40, 4):  # ten eval questions appear in the training data
        corpus[i]["text"] += "\n\n" + test[i]["question"]
    (tmp_path / "corpus").mkdir()
    for k in range(2):
        part = corpus[k::2]
        pq.write_table(pa.table({"id": [r["id"] for r in part], "text": [r["text"] for r in part]}),
                       tmp_path / "corpus" / f"part-{k}.parquet")
    with (tmp_path / "eval.jsonl").open("w") as f:
        for i, r in enumerate(test):
            f.write(json.dumps({"id": f"test-{i}", "question": r["question"]}) + "\n")
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(EXAMPLE), "--parquet", str(tmp_path / "corpus" / "*.parquet"),
                    "--eval", str(tmp_path / "eval.jsonl"), "--output", str(out), "--runner=DirectRunner"],
                   check=True, cwd=tmp_path)
    assert main(["verify", str(out / "shards"), "--checksums"]) == 0
    manifest = json.loads((out / "shards" / "manifest.json").read_text())
    assert manifest["total_documents"] == 300 and manifest["rows"]["rejected"] == 0
    overlaps = [json.loads(line) for p in out.glob("overlaps*.jsonl") for line in p.read_text().splitlines()]
    assert {o["instance_id"] for o in overlaps} == {f"test-{i}" for i in range(0, 40, 4)}
    assert {o["train_doc_id"] for o in overlaps} == {corpus[i]["id"] for i in range(0, 40, 4)}
    assert all(o["n"] == 13 and o["eval_offsets"] and o["train_offsets"] for o in overlaps)
