"""The whole HYDRA chain on a tiny random model: prep -> slices -> oracle-label (constrained to
the JSON answer) -> calibrate -> train probe + judge -> grade (DirectRunner)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

import pytest

torch = pytest.importorskip("torch", reason="the inference extra (torch) is not installed")

from engine_fixtures import write_harmony_checkpoint  # noqa: E402
from helpers import run_prep  # noqa: E402

from refinery.beam_pipelines import hydra  # noqa: E402
from refinery.transforms.formats.docids import read_doc_tokens  # noqa: E402
from refinery.transforms.hydra.oracle import DIMENSIONS  # noqa: E402

DIRECT = ["--runner=DirectRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1"]
ENGINE = ["--dtype", "float32", "--device", "cpu", "--max-batch", "8"]


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_hydra_end_to_end(tmp_path: Path, small_corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = str(write_harmony_checkpoint(tmp_path / "ckpt", num_hidden_layers=2))
    data = tmp_path / "prep"
    assert run_prep(small_corpus, data, "--num-shards", "2") == 0

    # slices: idempotent
    slices = tmp_path / "slices"
    assert hydra.main(["slices", "--data-root", str(data), "--output", str(slices)]) == 0
    split = {s: _jsonl(slices / f"docids_{s}.jsonl") for s in ("train", "val", "test")}
    assert sum(len(v) for v in split.values()) == 70 and all(split.values())
    first = {s: (slices / f"docids_{s}.jsonl").read_bytes() for s in split}
    assert hydra.main(["slices", "--data-root", str(data), "--output", str(slices)]) == 0
    assert "up to date" in capsys.readouterr().out
    assert first == {s: (slices / f"docids_{s}.jsonl").read_bytes() for s in split}
    doc = split["train"][0]["doc_id"]
    assert doc.startswith("small//shard_000") and len(read_doc_tokens(str(data), doc)) > 10

    # oracle-label with a random model: nothing parses, every failure is recorded with a reason
    labels = tmp_path / "labels_val"
    assert hydra.main(["oracle-label", "--checkpoint", ckpt, "--input-docids", str(slices / "docids_val.jsonl"),
                       "--data-root", str(data), "--output", str(labels), "--max-tokens", "4",
                       "--max-seq-len", "1024", "--docs-per-unit", "4", "--no-progress", *ENGINE], DIRECT) == 0
    summary = json.loads((labels / "summary.json").read_text())
    failures = _jsonl(labels / "failures.jsonl")
    assert summary["documents"] == len(split["val"]) == len(failures) + summary["parsed"]
    assert all(f["error"] for f in failures) and "parse rate" in capsys.readouterr().out

    # constrained decoding: the same random model's answers are forced into the JSON, its logits
    # picking each digit; every document parses (the labels are noise, but the chain runs on them)
    oracle = ["oracle-label", "--checkpoint", ckpt, "--data-root", str(data), "--constrained-json",
              "--max-seq-len", "1024", "--docs-per-unit", "16", "--no-progress", *ENGINE]
    assert hydra.main([*oracle, "--input-docids", str(slices / "docids_val.jsonl"), "--output",
                       str(tmp_path / "too_short"), "--max-tokens", "8"], DIRECT) == 2
    assert "--constrained-json needs --max-tokens of at least 38" in capsys.readouterr().err

    def oracle_labels(split_name: str) -> tuple[str, list[dict[str, Any]]]:
        out = tmp_path / f"labels_{split_name}_json"
        assert hydra.main([*oracle, "--input-docids", str(slices / f"docids_{split_name}.jsonl"),
                           "--output", str(out), "--max-tokens", "40"], DIRECT) == 0
        summary = json.loads((out / "summary.json").read_text())
        assert summary["parse_rate"] == 1.0 and summary["parsed"] == len(split[split_name])
        assert (out / "failures.jsonl").read_text() == ""
        rows = _jsonl(out / "labels.jsonl")
        assert [r["doc_id"] for r in rows] == [r["doc_id"] for r in split[split_name]]
        assert all(set(r["scores"]) == set(DIMENSIONS) and all(v in (0, 1, 2, 3, 4) for v in r["scores"].values())
                   for r in rows)
        return str(out / "labels.jsonl"), rows

    val_labels, val_rows = oracle_labels("val")
    assert "parse rate 100.0%" in capsys.readouterr().out
    train_labels, train_rows = oracle_labels("train")
    # the digits come from the model's logits, so they vary with the document
    assert len({tuple(r["scores"].values()) for r in val_rows + train_rows}) > 1

    cal = tmp_path / "cal"
    assert hydra.main(["calibrate", "--labels", val_labels, "--output", str(cal), "--target-keep", "0.5"]) == 0
    calibration = json.loads((cal / "calibration_summary.json").read_text())
    assert calibration["num_labels"] == len(split["val"]) and calibration["tau_drop"] <= calibration["tau_keep"]
    assert abs(sum(calibration["weights"].values()) - 1) < 1e-9

    heads = tmp_path / "heads"
    common = ["--labels", train_labels, "--data-root", str(data), "--output", str(heads), "--checkpoint", ckpt,
              "--max-ctx", "64", "--epochs", "3", "--batch-size", "16", "--warmup-steps", "2", *ENGINE]
    # layer indices are checked against the model's depth (2 here); the defaults (18/24) are for 20b
    assert hydra.main(["train", "probe", *common]) == 2
    assert "layer 18 is not valid for a model with 2 layers" in capsys.readouterr().err
    assert hydra.main(["train", "probe", "--layer", "1", *common]) == 0
    assert hydra.main(["train", "judge", "--layer", "2", "--mid-dim", "32", *common]) == 0
    for kind in ("probe", "judge"):
        log = json.loads((heads / f"train_{kind}.json").read_text())
        assert log["documents"] == len(split["train"]) and log["steps"] == 3 * -(-len(split["train"]) // 16)

    out = tmp_path / "quality"
    argv = ["grade", "--checkpoint", ckpt, "--heads-dir", str(heads), "--calibration", str(cal),
            "--input-docids", str(slices / "docids_test.jsonl"), str(slices / "docids_val.jsonl"),
            "--data-root", str(data), "--output", str(out), "--max-ctx", "64", "--no-progress", *ENGINE]
    assert hydra.main(argv, DIRECT) == 0
    rows = _jsonl(out / "quality_scores.jsonl")
    summary = json.loads((out / "summary.json").read_text())
    assert [r["doc_id"] for r in rows] == [r["doc_id"] for r in split["test"] + split["val"]]
    assert summary["documents"] == len(rows) == summary["drop"] + summary["band"] + summary["keep"]
    for r in rows:
        assert set(r["scores"]) == set(DIMENSIONS) and all(0 <= v <= 4 for v in r["scores"].values())
        assert r["decision"] in ("drop", "band", "keep")
        assert r["judged"] == (r["probe_aggregated"] >= calibration["tau_drop"])
        if r["decision"] == "keep":
            assert r["aggregated"] >= calibration["tau_keep"]
    _grade_equals_heads_on_backbone(rows, ckpt, str(data), heads, calibration, max_ctx=64)
    before = (out / "quality_scores.jsonl").read_bytes()
    assert hydra.main(argv, DIRECT) == 0  # rerun: all units done, same output
    assert (out / "quality_scores.jsonl").read_bytes() == before


def _grade_equals_heads_on_backbone(rows: list[dict[str, Any]], ckpt: str, data: str, heads: Path,
                                    calibration: dict[str, Any], max_ctx: int) -> None:
    """Each graded document's scores are the trained heads applied to the backbone's states
    at the heads' layers: recomputed here from the checkpoint and the head files, without the
    grader or the engine."""
    import numpy as np

    from refinery.kernels.model import Transformer
    from refinery.transforms.hydra.heads import judge_preprocess, load_head, probe_features

    model = Transformer.from_checkpoint(ckpt, device="cpu", dtype=torch.float32)
    probe, pmeta = load_head(str(heads / "hydra_probe.pt"))
    judge, jmeta = load_head(str(heads / "hydra_judge.pt"))
    weights = np.asarray([calibration["weights"][d] for d in DIMENSIONS])
    with torch.no_grad():
        for r in rows:
            tokens = torch.tensor(read_doc_tokens(data, r["doc_id"])[:max_ctx], dtype=torch.long)
            hidden = model.hidden_states(tokens, [pmeta["layer"], jmeta["layer"]])
            p = probe(probe_features(hidden[pmeta["layer"]].float()).unsqueeze(0))[0].clamp(0, 4).double().numpy()
            assert abs(float(p @ weights) - r["probe_aggregated"]) < 1e-5
            want = p
            if r["judged"]:
                features = judge_preprocess(hidden[jmeta["layer"]].float()).unsqueeze(0)
                want = judge(features)[0].clamp(0, 4).double().numpy()
            assert np.allclose([r["scores"][d] for d in DIMENSIONS], want, atol=1e-5), r["doc_id"]
            assert abs(float(want @ weights) - r["aggregated"]) < 1e-5


def test_slices_go_through_the_command_runner(tmp_path: Path, small_corpus: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed slices unit exits 1 with the command that resumes it, like every other step;
    the rerun finishes the job."""
    from refinery.transforms.hydra.slices import SlicesStage

    data, out = tmp_path / "prep", tmp_path / "slices"
    assert run_prep(small_corpus, data, "--num-shards", "2") == 0
    real = SlicesStage.run_unit

    def broken(self: SlicesStage, unit: object, ctx: object) -> NoReturn:
        raise OSError("disk full")

    monkeypatch.setattr(SlicesStage, "run_unit", broken)
    assert hydra.main(["slices", "--data-root", str(data), "--output", str(out)]) == 1
    err = capsys.readouterr().err
    assert "slices: failed: OSError disk full" in err and "run the same command again" in err
    monkeypatch.setattr(SlicesStage, "run_unit", real)
    assert hydra.main(["slices", "--data-root", str(data), "--output", str(out)]) == 0
    assert "slices built: train" in capsys.readouterr().out and (out / "docids_train.jsonl").exists()
