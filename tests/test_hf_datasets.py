"""Hugging Face ``datasets``: save_to_disk folders as inputs, decon eval sets by name (offline)."""
from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
from helpers import gsm8k_rows, gsm8k_texts, run_prep, write_jsonl

from refinery.beam_pipelines.cli import main


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def _shards(out: Path) -> dict[str, bytes]:
    """The tokens and bounds (a shard's .docs.parquet names the files read: other files, other bytes)."""
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.glob("shard_*/*"))
            if p.suffix in (".npy", ".idx")}


def test_save_to_disk_folder_is_an_input(tmp_path: Path) -> None:
    rows = [{"id": f"d{i}", "text": t} for i, t in enumerate(gsm8k_texts(60))]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    write_jsonl(tmp_path / "jsonl" / "rows.jsonl", rows)
    assert run_prep([tmp_path / "saved"], tmp_path / "a", "--num-shards", 3, "--dataset", "d") == 0
    assert run_prep([tmp_path / "jsonl"], tmp_path / "b", "--num-shards", 3, "--dataset", "d") == 0
    assert _shards(tmp_path / "a") == _shards(tmp_path / "b") and len(_shards(tmp_path / "a")) == 6
    m = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert m["rows"]["read"] == 60 and m["total_documents"] == 60


def test_a_saved_dataset_dict_asks_for_one_split(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "a"}]),
                          "test": datasets.Dataset.from_list([{"text": "b"}])}).save_to_disk(str(tmp_path / "dd"))
    assert run_prep([tmp_path / "dd"], tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "DatasetDict" in err and "train" in err and f"{tmp_path / 'dd'}/" in err


def _decon(args: list[str], out: Path) -> int:
    return main(["decon", *args, "--train", str(out.parent / "train"), "--output", str(out),
                 "--ngrams", "8", "13", "--runner", "direct", "--no-progress"])


def test_decon_eval_set_by_name_equals_the_same_rows_as_files(tmp_path: Path) -> None:
    test = gsm8k_rows("test")[:100]
    local = tmp_path / "gsm8k"  # a dataset folder as it would come from the hub
    write_jsonl(local / "data" / "test.jsonl", [{"id": f"q{i}", "question": r["question"]} for i, r in enumerate(test)])
    write_jsonl(tmp_path / "files" / "gsm8k" / "test.jsonl",
                [{"id": f"q{i}", "question": r["question"]} for i, r in enumerate(test)])
    train = [{"text": t + ("\n" + test[i]["question"] if i % 7 == 0 else "")} for i, t in enumerate(gsm8k_texts(80))]
    write_jsonl(tmp_path / "train" / "t.jsonl", train)

    by_name, by_file = tmp_path / "by_name", tmp_path / "by_file"
    assert _decon(["--eval-hf", f"{local}:test", "--eval-text-field", "question"], by_name) == 0
    assert _decon(["--eval", str(tmp_path / "files" / "gsm8k"), "--eval-text-field", "question"], by_file) == 0
    stats = [(by_name / "stats/overlap_stats.jsonl").read_text(), (by_file / "stats/overlap_stats.jsonl").read_text()]
    assert stats[0] == stats[1] and '"eval_dataset": "gsm8k"' in stats[0]
    assert len(json.loads(stats[0].splitlines()[-1])["instance_ids"]) == 12  # every 7th of 80 rows planted one

    # the split is loaded once, named by its revision; a rerun plans the same and runs nothing
    cached = list((by_name / ".refinery" / "eval-hf").rglob("*.parquet"))
    assert len(cached) == 1 and cached[0].parent.name == "gsm8k"
    stamp = cached[0].stat().st_mtime_ns
    receipts = sorted((by_name / ".refinery").rglob("receipts/*.json"))
    assert _decon(["--eval-hf", f"{local}:test", "--eval-text-field", "question"], by_name) == 0
    assert cached[0].stat().st_mtime_ns == stamp
    assert sorted((by_name / ".refinery").rglob("receipts/*.json")) == receipts


def test_unreachable_hub_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_jsonl(tmp_path / "train" / "t.jsonl", [{"text": "x"}])
    assert main(["prep", "--hf-dataset", "no-such-org/no-such-set", "--output", str(tmp_path / "p"),
                 "--runner", "direct"]) == 2
    assert _decon(["--eval-hf", "no-such-org/no-such-set:test"], tmp_path / "d") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("Hugging Face hub" in line and "Traceback" not in line for line in err)
