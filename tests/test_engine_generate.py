"""Paged KV cache, chunked prefill and continuous batching against the cache-free forward."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the inference extra (torch) is not installed")
pytest.importorskip("safetensors", reason="the inference extra (safetensors) is not installed")

from engine_fixtures import random_weights, tiny_config, write_hf, write_original  # noqa: E402

from refinery.kernels.batching import BatchedGenerator  # noqa: E402
from refinery.kernels.model import Transformer  # noqa: E402


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    config = tiny_config()
    weights = random_weights(config, seed=1)
    root = tmp_path_factory.mktemp("gen")
    return {"hf": write_hf(root / "hf", config, weights), "original": write_original(root / "orig", config, weights)}


@pytest.fixture(scope="module")
def model64(paths: dict[str, Path]) -> Transformer:
    return Transformer.from_checkpoint(paths["original"], dtype=torch.float64)


@pytest.fixture(scope="module")
def model32(paths: dict[str, Path]) -> Transformer:
    return Transformer.from_checkpoint(paths["original"], dtype=torch.float32)


def _tokens(n: int, seed: int, vocab: int = 160) -> list[int]:
    out: list[int] = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return out


def _greedy_no_cache(model: Transformer, prompt: list[int], n: int) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(n):
        out.append(int(model(torch.tensor(seq))[-1].argmax()))
        seq.append(out[-1])
    return out


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_incremental_decode_equals_full_forward(model64: Transformer, model32: Transformer, dtype: str) -> None:
    model = model64 if dtype == "float64" else model32
    window = model.config.sliding_window
    seq = _tokens(6 * window, seed=2)
    full = model(torch.tensor(seq))
    gen = BatchedGenerator(model, max_seq_len=64, max_batch=2, block_size=4, prefill_chunk=5)
    sid = gen.add(seq[:13], max_tokens=1000)  # a 13-token prompt: prefilled in chunks of 5
    got = {}
    pos = 13
    bound = math.ceil((window + 5 - 1) / 4) + 1
    while True:
        step = gen.step()
        assert step is not None
        logits, ids = step
        assert ids == [sid]
        got[pos - 1] = logits[0]
        if pos == len(seq):
            break
        gen.update(sid, seq[pos])
        pos += 1
        held = gen.cache.blocks_held(sid)
        assert held["sliding"] <= bound and held["full"] == math.ceil((pos - 1) / 4)
    scale = full.abs().max().item()
    err = max((got[p] - full[p]).abs().max().item() for p in got)
    tol = 1e-10 if dtype == "float64" else 1e-4
    assert err <= tol * scale, f"{err:.3g} vs scale {scale:.3g}"
    assert len(got) == len(seq) - 12


def test_ragged_batch_equals_one_at_a_time(model32: Transformer) -> None:
    prompts = [_tokens(n, seed=10 + n) for n in (3, 17, 30, 9, 1, 22)]
    batched = BatchedGenerator(model32, max_seq_len=64, max_batch=3, block_size=4, prefill_chunk=7)
    together = batched.generate_batch(prompts, max_tokens=14)
    assert batched.idle
    alone = [
        BatchedGenerator(model32, max_seq_len=64, max_batch=1, block_size=16, prefill_chunk=64)
        .generate_batch([p], max_tokens=14)[0]
        for p in prompts
    ]
    assert together == alone
    assert all(len(t) == 14 for t in together)
    assert together[:2] == [_greedy_no_cache(model32, p, 14) for p in prompts[:2]]
    # every block went back to the pool
    assert not batched.cache.tables
    assert all(len(free) == batched.cache.k[kind].shape[1] for kind, free in batched.cache.free.items())


def test_continuous_batching_mid_way(model32: Transformer) -> None:
    a, b, c = _tokens(20, seed=20), _tokens(11, seed=21), _tokens(26, seed=22)
    gen = BatchedGenerator(model32, max_seq_len=64, max_batch=2, block_size=4, prefill_chunk=6)
    outputs: dict[str, list[int]] = {}
    ids = {gen.add(a, max_tokens=12): "a"}
    steps = 0
    while not gen.idle:
        step = gen.step()
        assert step is not None
        logits, seq_ids = step
        steps += 1
        if steps == 4:
            ids[gen.add(b, max_tokens=10)] = "b"  # joins while a decodes
            ids[gen.add(c, max_tokens=8)] = "c"  # waits for a free slot
        for row, sid in enumerate(seq_ids):
            token = int(logits[row].argmax())
            outputs.setdefault(ids[sid], []).append(token)
            gen.update(sid, token, finished=False)  # max_tokens ends each sequence
    assert {k: len(v) for k, v in outputs.items()} == {"a": 12, "b": 10, "c": 8}
    for name, prompt, n in (("a", a, 12), ("b", b, 10), ("c", c, 8)):
        assert outputs[name] == _greedy_no_cache(model32, prompt, n), name


def test_seed_example_loop_and_layouts(paths: dict[str, Path]) -> None:
    # The seed's usage: a checkpoint path, add / step / update until idle.
    gen = BatchedGenerator(str(paths["hf"]), max_seq_len=48, max_batch=1, dtype=torch.float32)
    tokens = _tokens(9, seed=30)
    seq_id = gen.add(tokens, max_tokens=6)
    generated = []
    while not gen.idle:
        result = gen.step()
        if not result:
            break
        logits, seq_ids = result
        assert logits.shape == (1, 160) and seq_ids == [seq_id]
        next_token = int(logits[0].argmax().item())
        generated.append(next_token)
        gen.update(seq_ids[0], next_token, finished=len(generated) >= 6)
    other = BatchedGenerator(str(paths["original"]), max_seq_len=48, max_batch=1, dtype=torch.float32)
    assert generated == other.generate_batch([tokens], max_tokens=6)[0]


def test_stop_tokens_sampling_and_limits(model32: Transformer) -> None:
    prompt = _tokens(5, seed=40)
    gen = BatchedGenerator(model32, max_seq_len=64, max_batch=4, block_size=8)
    greedy = gen.generate_batch([prompt], max_tokens=10)[0]
    stop = greedy[3]
    first = greedy.index(stop)
    assert gen.generate_batch([prompt], max_tokens=10, stop_tokens=[stop])[0] == greedy[: first + 1]
    s1 = gen.generate_batch([prompt] * 3, max_tokens=10, temperature=1.0, seed=5)
    s2 = gen.generate_batch([prompt] * 3, max_tokens=10, temperature=1.0, seed=5)
    assert s1 == s2 and len({tuple(s) for s in s1}) > 1
    # max_seq_len ends a sequence: 60 prompt tokens + at most 4 more positions
    assert len(gen.generate_batch([_tokens(60, seed=41)], max_tokens=50)[0]) == 4
    with pytest.raises(ValueError):
        gen.add(_tokens(65, seed=42), max_tokens=1)


def test_bfloat16_generation(paths: dict[str, Path]) -> None:
    model = Transformer.from_checkpoint(paths["hf"], dtype=torch.bfloat16)
    gen = BatchedGenerator(model, max_seq_len=64, max_batch=2, block_size=4, prefill_chunk=8)
    assert gen.cache.k["full"].dtype == torch.bfloat16
    prompts = [_tokens(n, seed=50 + n) for n in (4, 19, 12)]
    out = gen.generate_batch(prompts, max_tokens=5)
    assert [len(o) for o in out] == [5, 5, 5] and gen.idle
    gen.add(prompts[0], max_tokens=2)
    step = gen.step()
    assert step is not None
    logits, _ = step
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
