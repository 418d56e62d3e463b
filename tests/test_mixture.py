"""Mixture TOML parsing and budgets, `refinery prep-mixture` (dry run, real runs, failures), and
build_loader over its output."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import gsm8k_texts, write_jsonl

from refinery.beam_pipelines.cli import main
from refinery.beam_pipelines.prep_mixture import hf_split_files
from refinery.transforms.loader import mixture as mx

REPO = Path(__file__).resolve().parents[1]


def _parse(text: str, path: str = "/cfg/mix.toml") -> mx.MixtureFile:
    import tomllib
    return mx.parse_mixture_file(tomllib.loads(text), path)


SEED_EXAMPLE = """
[mixtures.pretrain_mix]
total_tokens_b = 100.0
sample_temperature = 1.0

[[mixtures.pretrain_mix.sources]]
id = "fineweb"
tokens_b = 80.0
percent = 80.0
hf_dataset = "HuggingFaceFW/fineweb-edu"
hf_subset = "sample-10BT"
hf_split = "train"
hf_valid_split = "train[:1%]"
text_field = "text"

[[mixtures.pretrain_mix.sources]]
id = "code"
tokens_b = 20.0
percent = 20.0
hf_dataset = "bigcode/the-stack-v2"
hf_subset = "python"
hf_split = "train"
"""


def test_seed_example_parses_and_budgets_follow_flows() -> None:
    mf = _parse(SEED_EXAMPLE)
    m = mx.select_mixture(mf, "pretrain")
    fw, code = m.sources
    assert fw.is_hf and fw.hf_subset == "sample-10BT" and fw.text_field == "text"
    assert fw.hf_splits["valid"] == mx.SplitSlice("train", 0.0, 1.0) and str(fw.hf_splits["valid"]) == "train[:1%]"
    assert not code.has_split("valid") and code.has_split("train")
    assert mx.fixed_point_weights(mx.source_fractions(m)) == [800000, 200000]
    assert mx.flow_target(mf, m, "dev") == 100_000_000
    assert mx.flow_target(mf, m, "research") == 10**9 and mx.flow_target(mf, m, "ablation") == 6 * 10**9
    assert mx.flow_target(mf, m, None) == 100 * 10**9  # the full mixture
    assert mx.source_budgets(m, 100_000_000) == {"fineweb": 80_000_000, "code": 20_000_000}
    assert mx.source_budgets(m, 10**9, max_tokens=1_000_001) == {"fineweb": 800_001, "code": 200_000}
    plans, skipped = mx.plan_mixture(m, "gs://b/data", ["train", "valid"], 100_000_000, valid_percent=1.0)
    assert [(p.label, p.output, p.budget) for p in plans] == [
        ("fineweb/train", "gs://b/data/fineweb/train", 80_000_000),
        ("fineweb/valid", "gs://b/data/fineweb/valid", 800_000),
        ("code/train", "gs://b/data/code/train", 20_000_000)]
    assert skipped and skipped[0].startswith("code/valid: the source defines no valid split")


def test_tokens_b_weights_temperature_caps_and_relative_paths() -> None:
    mf = _parse("""
data_root = "out"
[stages]
mid = "b"
[flows.proxy]
total_tokens_b = 0.5
[mixtures.a]
sample_temperature = 2.0
[[mixtures.a.sources]]
id = "x"
tokens_b = 9.0
path = "corpus/x"
[[mixtures.a.sources]]
id = "y"
tokens_b = 1.0
path = ["gs://bucket/y/*.jsonl.zst", "/abs/y"]
valid_path = "held/y"
[mixtures.b]
[[mixtures.b.sources]]
id = "z"
tokens_b = 0.0001
path = "z"
""")
    assert mf.data_root == "/cfg/out"
    a = mf.mixtures["a"]
    # temperature 2: weights 9 ** 0.5 : 1 ** 0.5 = 3 : 1
    assert mx.fixed_point_weights(mx.source_fractions(a)) == [750000, 250000]
    assert a.sources[0].path_splits == {"train": ("/cfg/corpus/x",)}
    assert a.sources[1].path_splits == {"train": ("gs://bucket/y/*.jsonl.zst", "/abs/y"), "valid": ("/cfg/held/y",)}
    assert mx.flow_target(mf, a, "proxy") == 500_000_000
    assert mx.select_mixture(mf, "mid").name == "b"
    assert mx.select_mixture(mf, None, "a").name == "a"
    # a source's tokens_b caps its own budget
    assert mx.source_budgets(mf.mixtures["b"], 10**9) == {"z": 100_000}
    budgets = mx.source_budgets(a, 1_000_003)
    assert budgets == {"x": 750_002, "y": 250_001} and sum(budgets.values()) == 1_000_003
    with pytest.raises(mx.MixtureError, match="cannot tell which mixture stage 'pretrain'"):
        mx.select_mixture(mf, "pretrain")
    with pytest.raises(mx.MixtureError, match=r"unknown flow 'fast'.*add \[flows.fast\]"):
        mx.flow_target(mf, a, "fast")


@pytest.mark.parametrize("body, message", [
    ("[[mixtures.m.sources]]\nid='a'\npercent=60.0\npath='p'\n[[mixtures.m.sources]]\nid='b'\npercent=30.0\npath='q'",
     "percents sum to 90, not 100"),
    ("[[mixtures.m.sources]]\nid='a'\npercent=60.0\npath='p'\n[[mixtures.m.sources]]\nid='b'\npath='q'",
     r"every source needs percent.*\['b'\]"),
    ("[[mixtures.m.sources]]\nid='a'\npercent=100.0\npath='p'\nhf_dataset='d'", "exactly one of hf_dataset or path"),
    ("[[mixtures.m.sources]]\nid='a'\npercent=50.0\npath='p'\n[[mixtures.m.sources]]\nid='a'\npercent=50.0\npath='q'",
     r"duplicate source id\(s\) \['a'\]"),
    ("[[mixtures.m.sources]]\nid='a'\npercent=100.0\npath='p'\nweight=3", r"source #1 \(id 'a'\): unknown key"),
    ("[[mixtures.m.sources]]\nid='a'\npercent=100.0\nhf_dataset='d'\nhf_valid_split='train[:100]'",
     "row-count slices are not supported"),
    ("[[mixtures.m.sources]]\nid='a/b'\npercent=100.0\npath='p'", "id must be a name"),
    ("[[mixtures.m.sources]]\nid='a'\npercent='lots'\npath='p'", "percent must be a number"),
])
def test_invalid_mixtures_are_refused_naming_the_entry(body: str, message: str) -> None:
    with pytest.raises(mx.MixtureError, match=message) as e:
        _parse("[mixtures.m]\n" + body)
    assert "/cfg/mix.toml" in str(e.value)


class FakeHub:
    """Stands in for huggingface_hub's HfFileSystem/HfApi (the hub is unreachable here)."""

    def __init__(self, files: list[str]) -> None:
        self.files = files

    def glob(self, pattern: str) -> list[str]:
        import fnmatch
        return [f for f in self.files if fnmatch.fnmatch(f, pattern)]

    def dataset_info(self, name: str, revision: str | None = None) -> object:
        class Info:
            sha = "b" * 40
        return Info()


def test_hf_split_slices_select_a_share_of_the_pinned_parquet_files() -> None:
    sha = "b" * 40
    hub = FakeHub([f"datasets/org/web@{sha}/sample-10BT/{i:03d}_00000.parquet" for i in range(200)])
    src = _parse("""
[mixtures.m]
[[mixtures.m.sources]]
id = "web"
percent = 100.0
hf_dataset = "org/web"
hf_subset = "sample-10BT"
hf_valid_split = "train[:1%]"
hf_test_split = "train[99%:]"
""").mixtures["m"].sources[0]
    train, spec = hf_split_files(src, "train", fs=hub, api=hub)
    assert spec == "train" and len(train.files) == 200 and train.revision == sha
    valid, spec = hf_split_files(src, "valid", fs=hub, api=hub)
    assert spec == "train[:1%]" and [f.rsplit("/", 1)[1] for f in valid.files] == ["000_00000.parquet",
                                                                                    "001_00000.parquet"]
    test, _ = hf_split_files(src, "test", fs=hub, api=hub)
    assert [f.rsplit("/", 1)[1] for f in test.files] == ["198_00000.parquet", "199_00000.parquet"]
    assert mx.SplitSlice("train", 0, 1).select(["only"]) == ["only"]  # never empty


def _two_source_config(tmp_path: Path, bad_path: bool = False) -> Path:
    texts = gsm8k_texts(60)
    write_jsonl(tmp_path / "corpus" / "a.jsonl", [{"id": f"a{i}", "text": t} for i, t in enumerate(texts[:30])])
    write_jsonl(tmp_path / "corpus" / "a_valid.jsonl", [{"text": t} for t in texts[30:40]])
    write_jsonl(tmp_path / "corpus" / "b.jsonl", [{"text": t} for t in texts[40:60]])
    cfg = tmp_path / "mix.toml"
    cfg.write_text(f"""
data_root = "data"
[flows.tiny]
total_tokens_b = 0.000004
[mixtures.pretrain]
[[mixtures.pretrain.sources]]
id = "{'broken' if bad_path else 'alpha'}"
percent = 50.0
path = "{'corpus/missing' if bad_path else 'corpus/a.jsonl'}"
valid_path = "corpus/a_valid.jsonl"
[[mixtures.pretrain.sources]]
id = "beta"
percent = 50.0
path = "corpus/b.jsonl"
""")
    return cfg


def _mix(cfg: Path, *extra: object) -> int:
    return main(["prep-mixture", "--config", str(cfg), "--flow", "tiny", "--num-shards", "2", "--runner", "direct",
                 "--no-progress", "--valid-percent", "10", *map(str, extra)])


def test_prep_mixture_dry_run_run_resume_and_loader(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _two_source_config(tmp_path)
    data = tmp_path / "data"
    assert _mix(cfg, "--dry-run") == 0
    out = capsys.readouterr().out
    assert "4K tokens over 2 source(s)" in out and "skip beta/valid: the source defines no valid split" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if re.match(r"^(alpha|beta)/", line)}
    assert rows["alpha/train"][1:5] == ["0.5000", "2K", "2", "pending"]
    assert rows["alpha/valid"][2] == "200" and rows["beta/train"][2] == "2K"
    assert "tokenize 0/1, pack 0/2, manifest 0/1" in out
    assert not data.exists()  # a dry run writes nothing

    assert _mix(cfg) == 0
    err = capsys.readouterr().err
    assert "[3/3] beta/train" in err and "3/3 source/split(s) done" in err
    for sid, split, budget in (("alpha", "train", 2000), ("alpha", "valid", 200), ("beta", "train", 2000)):
        root = data / sid / split
        m = json.loads((root / "manifest.json").read_text())
        assert m["dataset"] == sid and m["max_tokens"] == budget and 0 < m["total_tokens"] <= budget
        assert m["rows"]["over_budget"] > 0  # the budget cut the source
        assert sorted(str(p.relative_to(root)) for p in root.glob("shard_*/*")) == [
            f"shard_0000/{sid}-v1-shard-000000.docs.parquet", f"shard_0000/{sid}-v1-shard-000000.idx",
            f"shard_0000/{sid}-v1-shard-000000.npy", f"shard_0001/{sid}-v1-shard-000001.docs.parquet",
            f"shard_0001/{sid}-v1-shard-000001.idx", f"shard_0001/{sid}-v1-shard-000001.npy"]
        assert main(["verify", str(root / "manifest.json"), "--checksums"]) == 0
    assert not (data / "beta" / "valid").exists()
    capsys.readouterr()

    # resume: nothing left to do; the dry run says so from the receipts
    assert _mix(cfg) == 0
    assert capsys.readouterr().err.count("units run: nothing (already done)") == 3
    assert _mix(cfg, "--dry-run") == 0
    assert capsys.readouterr().out.count(" done ") == 3
    # a deleted shard is redone, and only it
    shard = data / "beta" / "train" / "shard_0001" / "beta-v1-shard-000001.npy"
    before = shard.read_bytes()
    shard.unlink()
    assert _mix(cfg, "--dry-run") == 0
    out = capsys.readouterr().out
    assert re.search(r"beta/train .* partial .*pack 1/2", out), out
    assert _mix(cfg) == 0
    assert "units run: tokenize 0, pack 1" in capsys.readouterr().err
    assert shard.read_bytes() == before

    # the training loader reads what prep-mixture wrote, mixing by the file's weights
    from refinery.transforms.loader.deterministic import LoaderConfig, build_loader
    loader, plan = build_loader(LoaderConfig(str(cfg), seq_len=32, batch_size=4), rank=0, world_size=1, split="train")
    assert [s.id for s in plan.sources] == ["alpha", "beta"] and plan.quotas[0] == plan.quotas[1]
    x, y = loader.next()
    assert x.shape == (4, 32) and (x < 201088).all()
    # beta has no valid split: build_loader names it
    with pytest.raises(FileNotFoundError, match="source 'beta': no shards for split 'valid'"):
        build_loader(LoaderConfig(str(cfg), seq_len=16), 0, 1, "valid")


def test_a_failing_source_stops_the_run_unless_continue_on_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _two_source_config(tmp_path, bad_path=True)
    assert _mix(cfg, "--splits", "train") == 1
    err = capsys.readouterr().err
    assert "FAILED broken/train" in err and "not run: beta/train" in err
    assert not (tmp_path / "data" / "beta").exists()
    assert _mix(cfg, "--splits", "train", "--continue-on-error") == 1
    err = capsys.readouterr().err
    assert "1/2 source/split(s) done" in err and "failed source/split(s):\n  broken/train:" in err
    assert (tmp_path / "data" / "beta" / "train" / "manifest.json").exists()


def test_dry_run_lists_hf_sources_without_the_hub(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    class Unreachable:
        def dataset_info(self, *a: object, **k: object) -> None:
            raise ConnectionError("hub unreachable (test)")

    monkeypatch.setattr(huggingface_hub, "HfApi", Unreachable)
    cfg = tmp_path / "seed.toml"
    cfg.write_text(SEED_EXAMPLE)
    assert main(["prep-mixture", "--config", str(cfg), "--flow", "dev", "--data-root", str(tmp_path / "d"),
                 "--max-tokens", "10M", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "10M tokens (flow target 100M, capped by --max-tokens)" in out
    assert re.search(r"fineweb/train +0\.8000 +8M +64  unresolved hf:HuggingFaceFW/fineweb-edu \(sample-10BT\) "
                     r"split train: HubError: Hugging Face hub: resolving HuggingFaceFW/fineweb-edu: "
                     r"ConnectionError: hub unreachable", out)
    assert re.search(r"fineweb/valid +0\.8000 +80K .* split train\[:1%\]", out)
    assert re.search(r"code/train +0\.2000 +2M ", out)
    assert main(["prep-mixture", "--config", str(cfg), "--flow", "nope", "--data-root", "x", "--dry-run"]) == 2
    assert "unknown flow 'nope'" in capsys.readouterr().err


def test_example_mixture_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prep-mixture", "--config", str(REPO / "examples" / "mix.toml"), "--data-root", str(tmp_path),
                 "--flow", "tiny", "--num-shards", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "gsm8k_a/train" in out and "gsm8k_b/valid" in out and "30K" in out and "20K" in out


def test_prep_mixture_on_portable_runner(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _two_source_config(tmp_path)
    rc = main(["prep-mixture", "--config", str(cfg), "--flow", "tiny", "--splits", "train", "--mixture", "pretrain",
               "--num-shards", "1", "--runner", "portable", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    for sid in ("alpha", "beta"):
        assert main(["verify", str(tmp_path / "data" / sid / "train" / "manifest.json")]) == 0


def test_prep_mixture_shows_rejected_rows_and_fails_a_source_that_accepts_none(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _two_source_config(tmp_path)
    with open(tmp_path / "corpus" / "a.jsonl", "a") as f:
        f.write('{"id": "bad", "text": 3}\n')
    write_jsonl(tmp_path / "corpus" / "b.jsonl", [{"text": 3}] * 4)
    assert _mix(cfg, "--splits", "train", "--continue-on-error") == 1
    err = capsys.readouterr().err
    alpha = tmp_path / "data" / "alpha" / "train"
    assert re.search(r"alpha/train: .*\n    rows: read \d+ = accepted \d+ \+ empty 0 \+ rejected 1 \+ over budget \d+  "
                     rf"\(reasons in {alpha}/rejects/rejects.jsonl\)", err), err
    assert "FAILED beta/train: no rows accepted of 4 read (4 rejected; reasons in " in err
    assert "1/2 source/split(s) done" in err
    assert _mix(cfg, "--splits", "train", "--max-reject-rate", "1") == 0
