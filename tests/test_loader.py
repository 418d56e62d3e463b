"""DeterministicLoader: SWRR mixing, world-size invariance, exact resume, refusal of foreign states."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from refinery.transforms.formats import shards
from refinery.transforms.loader.deterministic import (
    DeterministicLoader,
    LoaderConfig,
    LoaderStateError,
    build_loader,
    epoch_quotas,
    permute,
    swrr_step,
)
from refinery.transforms.loader.mixture import largest_remainder

SEQ = 8  # each sequence reads SEQ + 1 = 9 tokens
BASES = {"alpha": 1_000_000, "beta": 2_000_000, "gamma": 3_000_000}


def _mix_toml(path: Path, percents: tuple[float, float, float] = (50.0, 30.0, 20.0)) -> Path:
    lines = ["[mixtures.pre]", "total_tokens_b = 1.0"]
    for sid, pct in zip(BASES, percents):
        lines += ["[[mixtures.pre.sources]]", f'id = "{sid}"', f"percent = {pct}", f'path = "/nowhere/{sid}"']
    path.write_text("\n".join(lines) + "\n")
    return path


def _data_root(root: Path, tokens: dict[str, int] | None = None) -> Path:
    """Per source, two shards whose token values encode (source, position) in its stream."""
    tokens = tokens or {"alpha": 9 * 40 + 3, "beta": 9 * 25, "gamma": 9 * 30 + 5}
    for sid, n in tokens.items():
        values = np.arange(n, dtype=np.int64) + BASES[sid]
        cut = n // 3
        for k, part in enumerate((values[:cut], values[cut:])):
            npy = root / sid / "train" / f"shard_{k:04d}" / f"{sid}-v1-shard-{k:06d}.npy"
            npy.parent.mkdir(parents=True, exist_ok=True)
            np.save(npy, part.astype("<u4"))
            with open(npy.with_suffix(".idx"), "wb") as f:
                shards.write_idx(f, [len(part)])
        _write_manifest(root / sid / "train")
    return root


def _write_manifest(folder: Path) -> None:
    """A manifest.json listing the shards of ``folder`` (the loader reads only what one lists)."""
    import hashlib

    entries = [{"shard": k, "path": str(npy.relative_to(folder)), "num_tokens": shards.npy_token_count(str(npy)),
                "sha256": hashlib.sha256(npy.read_bytes()).hexdigest()}
               for k, npy in enumerate(sorted(folder.glob("shard_*/*.npy")))]
    (folder / "manifest.json").write_text(json.dumps({"shards": entries}))


@pytest.fixture
def setup(tmp_path: Path) -> LoaderConfig:
    toml = _mix_toml(tmp_path / "mix.toml")
    root = _data_root(tmp_path / "data")
    return LoaderConfig(str(toml), str(root), seq_len=SEQ, batch_size=2, seed=7)


def _ident(row: npt.NDArray[np.int64]) -> tuple[str, int]:
    """(source, sequence index) of a (SEQ + 1)-token row."""
    for sid, base in BASES.items():
        if base <= row[0] < base + 1_000_000:
            off = int(row[0]) - base
            assert off % (SEQ + 1) == 0 and list(row) == list(range(row[0], row[0] + SEQ + 1)), row
            return sid, off // (SEQ + 1)
    raise AssertionError(row)


def _take(loader: DeterministicLoader, steps: int) -> list[tuple[str, int]]:
    out = []
    for _ in range(steps):
        x, y = loader.next()
        assert x.shape == y.shape == (loader.batch_size, SEQ) and x.dtype == np.int64
        assert np.array_equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
        out += [_ident(np.concatenate([xi, yi[-1:]])) for xi, yi in zip(x, y)]
    return out


def test_union_of_ranks_is_the_same_global_stream_for_1_2_4_ranks(setup: LoaderConfig) -> None:
    total_steps_w1 = 28  # 56 sequences: crosses the 50-sequence epoch boundary
    streams = {}
    for world in (1, 2, 4):
        per_rank = [_take(build_loader(setup, r, world, "train")[0], total_steps_w1 // world) for r in range(world)]
        # step t of every rank, in rank order, is the global stream's batch t
        merged = []
        for t in range(total_steps_w1 // world):
            for r in range(world):
                merged += per_rank[r][t * 2:(t + 1) * 2]
        streams[world] = merged
        assert len({tuple(x) for x in per_rank[0]} & {tuple(x) for x in per_rank[-1]}) == 0 or world == 1
    assert streams[1] == streams[2] == streams[4]
    assert sorted(streams[1]) == sorted(streams[4]) and len(streams[1]) == 56


def test_epoch_has_largest_remainder_quotas_spread_by_swrr(setup: LoaderConfig) -> None:
    loader, plan = build_loader(setup, 0, 1, "train")
    assert plan.sequences == (40, 25, 30)
    # weights 50/30/20: the epoch is limited by alpha (40 sequences) -> E = 80 would need 24 of beta,
    # 16 of gamma; largest epoch that fits all three
    assert plan.quotas == tuple(largest_remainder([500000, 300000, 200000], plan.epoch_sequences))
    assert plan.epoch_sequences == 80 and plan.quotas == (40, 24, 16)
    seqs = _take(loader, plan.epoch_sequences // 2)
    counts = {sid: sum(1 for s, _ in seqs if s == sid) for sid in BASES}
    assert counts == {"alpha": 40, "beta": 24, "gamma": 16}
    assert len(set(seqs)) == len(seqs)  # no sequence twice in an epoch
    first_alpha = [i for s, i in seqs if s == "alpha"]
    assert first_alpha != sorted(first_alpha)  # shuffled within the source
    # smooth: every prefix stays within one sequence of its ideal share
    for k in range(1, len(seqs) + 1):
        got = sum(1 for s, _ in seqs[:k] if s == "gamma")
        assert abs(got - k * 16 / 80) <= 1
    nxt = _take(loader, plan.epoch_sequences // 2)  # epoch 2: same quotas, another order (and subset)
    assert nxt != seqs and [s for s, _ in nxt] == [s for s, _ in seqs]  # the SWRR pattern repeats
    assert {x for x in nxt if x[0] == "alpha"} == {("alpha", i) for i in range(40)}  # all of alpha, every epoch
    assert len({x for x in nxt if x[0] == "beta"}) == 24  # 24 of beta's 25, a fresh choice per epoch


def test_exact_resume_mid_epoch_and_across_epochs(setup: LoaderConfig) -> None:
    a, _ = build_loader(setup, 1, 2, "train")
    _take(a, 7)  # mid-epoch (28 of 80 global sequences)
    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON checkpoint
    assert state["position"] == 28 and state["epoch"] == 0
    expected = _take(a, 30)  # goes on into epoch 1
    b, _ = build_loader(setup, 1, 2, "train")
    _take(b, 3)  # wherever it was, loading the state puts it at the exact next sequence
    b.load_state_dict(state)
    assert _take(b, 30) == expected
    assert b.state_dict() == a.state_dict() and b.epoch == 1
    # every rank saves the same state; a world of 4 (same global batch position) continues the stream
    w1, _ = build_loader(setup, 0, 1, "train")
    _take(w1, 14)  # 28 global sequences
    assert w1.state_dict() == state
    cont = _take(w1, 4)
    ranks = []
    for r in range(4):
        lr, _ = build_loader(setup, r, 4, "train")
        lr.load_state_dict(state)
        ranks.append(_take(lr, 1))
    assert [s for rr in ranks for s in rr] == cont


def test_a_state_of_another_plan_is_refused(setup: LoaderConfig, tmp_path: Path) -> None:
    a, plan = build_loader(setup, 0, 1, "train")
    _take(a, 2)
    state = a.state_dict()
    other_weights = LoaderConfig(str(_mix_toml(tmp_path / "other.toml", (40.0, 40.0, 20.0))), setup.data_root,
                                 seq_len=SEQ, batch_size=2, seed=7)
    b, plan_b = build_loader(other_weights, 0, 1, "train")
    assert plan_b.plan_hash != plan.plan_hash
    with pytest.raises(LoaderStateError, match="mixture weights"):
        b.load_state_dict(state)
    c, _ = build_loader(LoaderConfig(setup.mixture_config, setup.data_root, seq_len=SEQ + 1, batch_size=2, seed=7))
    with pytest.raises(LoaderStateError, match="belongs to plan"):
        c.load_state_dict(state)
    # a shard file rewritten (other size) changes the plan
    npy = tmp_path / "data" / "beta" / "train" / "shard_0001" / "beta-v1-shard-000001.npy"
    np.save(npy, np.arange(500, dtype="<u4") + BASES["beta"])
    with pytest.raises(ValueError, match=f"{npy}: 500 tokens, not the 150 "):  # not what its manifest says
        build_loader(setup, 0, 1, "train")
    _write_manifest(npy.parent.parent)  # a new manifest listing it
    d, _ = build_loader(setup, 0, 1, "train")
    with pytest.raises(LoaderStateError, match="shard files"):
        d.load_state_dict(state)
    with pytest.raises(LoaderStateError, match="not a loader state"):
        a.load_state_dict({"position": 3})
    assert a.state_dict() == state  # refused states change nothing


def test_missing_split_and_too_little_data_are_clear_errors(setup: LoaderConfig, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"source 'alpha': no shards for split 'valid'"):
        build_loader(setup, 0, 1, "valid")
    with pytest.raises(ValueError, match="fewer than one sequence"):
        build_loader(LoaderConfig(setup.mixture_config, setup.data_root, seq_len=10_000), 0, 1, "train")
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        build_loader(setup, 2, 2, "train")


def test_pure_parts() -> None:
    for n in (1, 2, 3, 10, 97, 1000):
        assert sorted(permute(j, n, key=12345) for j in range(n)) == list(range(n))
    assert [permute(j, 50, 1) for j in range(50)] != [permute(j, 50, 2) for j in range(50)]
    quotas = [5, 3, 2]
    cur = [0, 0, 0]
    picks = [swrr_step(cur, quotas, 10) for _ in range(10)]
    assert [picks.count(i) for i in range(3)] == quotas and cur == [0, 0, 0]
    assert picks == [0, 1, 2, 0, 0, 1, 0, 2, 1, 0]  # nginx smooth WRR, ties to the earlier source
    assert epoch_quotas([500000, 300000, 200000], [40, 25, 30]) == [40, 24, 16]
    assert epoch_quotas([1, 0], [3, 0]) == [3, 0]
    assert largest_remainder([1, 1, 1], 10) == [4, 3, 3]


def test_a_plain_prep_output_is_read_without_a_mixture_file(tmp_path: Path, small_corpus: Path) -> None:
    """`refinery prep`'s output is one source: no TOML, no `{root}/{id}/train/` layout. Unshuffled,
    the stream is the shards' tokens in path order; the plan hash covers the manifest's sha256s."""
    from helpers import run_prep

    from refinery.transforms.loader.deterministic import prep_output_loader

    out = tmp_path / "out"
    assert run_prep([small_corpus], out, "--num-shards", "2") == 0
    loader, plan = prep_output_loader(str(out), seq_len=SEQ, batch_size=2, shuffle=False)
    stream = np.concatenate([np.load(p).astype(np.int64) for p in shards.find_shards(str(out))])
    inputs, targets = loader.next()
    assert inputs.tolist() == [list(stream[0:SEQ]), list(stream[SEQ + 1:2 * SEQ + 1])]
    assert (targets[:, :-1] == inputs[:, 1:]).all()
    assert [f["sha256"] is not None for f in plan.sources[0].files] == [True, True]
    again, _ = prep_output_loader(str(out / "manifest.json"), seq_len=SEQ, batch_size=2, shuffle=False)
    assert again.plan.plan_hash == plan.plan_hash
    with pytest.raises(FileNotFoundError, match="no manifest.json here"):
        prep_output_loader(str(tmp_path / "nothing"))


def test_an_epoch_shorter_than_a_global_batch_is_said(tmp_path: Path) -> None:
    """Before: two epochs were silently wrapped into one global batch."""
    from refinery.transforms.loader.deterministic import ShortEpochWarning

    toml = _mix_toml(tmp_path / "mix.toml")
    root = _data_root(tmp_path / "data", {"alpha": 9 * 2, "beta": 9 * 2, "gamma": 9 * 2})
    with pytest.warns(ShortEpochWarning, match=r"fewer than one global batch \(4 x 2 rank\(s\) = 8\)"):
        build_loader(LoaderConfig(str(toml), str(root), seq_len=SEQ, batch_size=4), rank=0, world_size=2)


def test_the_loader_reads_exactly_the_shards_its_manifest_lists(tmp_path: Path, small_corpus: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Before: a glob of **/*.npy read the shards of runs nested inside the output (and a stray
    .npy), and a folder without a manifest said only that it had none."""
    from helpers import run_prep

    from refinery.transforms.loader.deterministic import prep_output_loader

    parent = tmp_path / "runs"
    assert run_prep([small_corpus], parent / "a", "--num-shards", "2") == 0
    assert run_prep([small_corpus], parent / "b", "--num-shards", "3") == 0
    listed = json.loads((parent / "a" / "manifest.json").read_text())
    (parent / "b").rename(parent / "a" / "b")  # another run nested inside a (prep refuses to write one there)
    stray = parent / "a" / "extra" / "stray.npy"
    stray.parent.mkdir()
    np.save(stray, np.arange(100, dtype="<u4"))
    for given in (parent / "a", parent / "a" / "manifest.json"):
        _, plan = prep_output_loader(str(given), seq_len=SEQ)
        assert [f["path"] for f in plan.sources[0].files] == [f"a/{s['path']}" for s in listed["shards"]]
        assert plan.sources[0].total_tokens == listed["total_tokens"]
    (parent / "c").mkdir()
    (parent / "a").rename(parent / "c" / "a")
    with pytest.raises(FileNotFoundError, match=f"{parent / 'c'}: no manifest.json here.* other runs' outputs "
                                                f"\\({parent / 'c' / 'a' / 'manifest.json'}\\): give one of them"):
        prep_output_loader(str(parent / "c"), seq_len=SEQ)
    from refinery.beam_pipelines.cli import main

    capsys.readouterr()
    for command in ("verify", "info"):  # they name the runs below too
        assert main([command, str(parent / "c")]) == 2
        assert capsys.readouterr().err.strip().endswith(
            f"; it holds other runs' outputs below it: {parent / 'c' / 'a'} (give one of them)")
    shard = parent / "c" / "a" / listed["shards"][1]["path"]
    shard.write_bytes(shard.read_bytes()[:-8])  # cut short
    with pytest.raises(ValueError, match=f"{shard}: [0-9,]+ bytes, not the [0-9,]+ its [0-9,]+ tokens take "
                                         r"\(a shard cut short"):
        prep_output_loader(str(parent / "c" / "a"), seq_len=SEQ)
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"{shard}: listed in .*manifest.json, missing"):
        prep_output_loader(str(parent / "c" / "a"), seq_len=SEQ)


def test_a_mixture_source_without_a_manifest_is_refused(setup: LoaderConfig, tmp_path: Path) -> None:
    """A split folder of shards copied without their manifest: refused, naming it (before: globbed)."""
    (tmp_path / "data" / "gamma" / "train" / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"source 'gamma': no shards for split 'train': .*no manifest.json"):
        build_loader(setup, 0, 1, "train")


def test_a_mixture_source_of_a_failed_run_is_refused(setup: LoaderConfig, tmp_path: Path) -> None:
    """A split whose prep-mixture run failed (its FAILED.json, beside shards and even a manifest
    left by a kill before the manifest's removal): refused, naming the failure and the file."""
    from refinery.transforms.formats.failed_run import CorruptFile, FailedRunError, mark_failed

    split = tmp_path / "data" / "beta" / "train"
    corrupt: list[CorruptFile] = [{"path": "/in/cut.jsonl.gz", "reason": "corrupt file after 3 rows: EOFError"}]
    mark_failed(str(split), "prep-mixture", "1 input file(s) corrupt or cut short: ...", corrupt)
    with pytest.raises(FailedRunError, match=f"{split}: the refinery prep-mixture run failed .*/in/cut.jsonl.gz"):
        build_loader(setup, 0, 1, "train")
