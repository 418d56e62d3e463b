"""The device-resident decode step: one host-to-device copy per step, block tables kept on the
device by incremental updates, sliding blocks freed by a watermark, fixed-shape (CUDA-graph
ready) decode buckets, and seeded sampling on the logits' device."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pytest

torch = pytest.importorskip("torch", reason="the inference extra (torch) is not installed")
if TYPE_CHECKING:
    from torch import Generator, Tensor
pytest.importorskip("safetensors", reason="the inference extra (safetensors) is not installed")

from engine_fixtures import random_weights, tiny_config, write_original  # noqa: E402

from refinery.kernels import sampling  # noqa: E402
from refinery.kernels.batching import BatchedGenerator, sample  # noqa: E402
from refinery.kernels.decode_graph import bucket_for, bucket_sizes  # noqa: E402
from refinery.kernels.kv_cache import PagedKVCache  # noqa: E402
from refinery.kernels.model import Transformer  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Transformer:
    config = tiny_config()
    path = write_original(tmp_path_factory.mktemp("step"), config, random_weights(config, seed=4))
    return Transformer.from_checkpoint(path, dtype=torch.float32)


def _tokens(n: int, seed: int) -> list[int]:
    out: list[int] = torch.randint(0, 160, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return out


def _host_tables(cache: PagedKVCache) -> Tensor:
    """What ``device_table`` must hold, rebuilt from the host lists."""
    want: Tensor = torch.full_like(cache.device_table, -1)
    for k, kind in enumerate(cache.kinds):
        if cache.scratch_row is not None:
            want[k, cache.scratch_row] = cache.scratch_block[kind]
        for sid, row in cache.row.items():
            table = cache.tables[sid][kind]
            want[k, row, : len(table)] = torch.tensor(table, dtype=torch.long)
    return want


def test_one_copy_per_step_and_tables_follow_the_host(model: Transformer) -> None:
    gen = BatchedGenerator(model, max_seq_len=64, max_batch=3, block_size=4, prefill_chunk=6)
    prompts = [_tokens(n, seed=n) for n in (5, 14, 9, 21)]
    ids = [gen.add(p, max_tokens=12) for p in prompts]
    steps = 0
    while not gen.idle:
        copies = gen.uploader.copies
        result = gen.step()
        assert gen.uploader.copies == copies + 1  # everything the step needs, in one copy
        assert result is not None
        logits, seq_ids = result
        for sid, token in zip(seq_ids, sample(logits, 0.0)):
            gen.update(sid, token)
        gen.cache.apply_updates(*gen.uploader.upload(gen.cache.take_updates()))  # frees queued by update()
        assert torch.equal(gen.cache.device_table, _host_tables(gen.cache)), f"step {steps}"
        steps += 1
    assert set(ids) == set(range(4)) and steps > 12
    assert (gen.cache.device_table == -1).all() and not gen.cache.row


def test_sliding_blocks_freed_by_a_watermark(model: Transformer) -> None:
    config = tiny_config(sliding_window=6)
    cache = PagedKVCache(config, max_batch=1, max_seq_len=80, max_chunk=1, block_size=2)
    cache.add_sequence(0)
    freed_per_step = []
    for pos in range(80):
        before = len(cache.free["sliding"])
        cache.reserve(0, pos, 1)
        freed_per_step.append(len(cache.free["sliding"]) - before + (1 if pos % 2 == 0 else 0))
        table = cache.tables[0]["sliding"]
        low = cache.low[0]
        assert all(b == -1 for b in table[:low]) and all(b >= 0 for b in table[low:])
        assert low == max(0, pos - 6 + 1) // 2  # everything no query from pos on can see
        assert cache.blocks_held(0)["sliding"] <= math.ceil((6 + 1 - 1) / 2) + 1
    assert max(freed_per_step) <= 1  # one block handed back at a time, never a rescan's batch
    index, value = cache.take_updates()
    # 40 blocks allocated in each kind, 37 sliding ones freed again (3 still visible): one
    # change per table entry, the last one queued
    assert len(index) == len(set(index)) == 80
    assert sum(v == -1 for v in value) == 37


def test_bucket_sizes() -> None:
    assert bucket_sizes(1) == [1] and bucket_sizes(6) == [1, 2, 4, 6] and bucket_sizes(8) == [1, 2, 4, 8]
    assert [bucket_for(b, 6) for b in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    with pytest.raises(ValueError):
        bucket_for(7, 6)


def test_fixed_shape_decode_equals_the_dynamic_step(model: Transformer) -> None:
    # continuous batching through shrinking and growing batches: buckets 4, 2, 1 and padding rows
    prompts = [_tokens(n, seed=40 + n) for n in (3, 17, 11, 26, 6)]

    def run(cuda_graph: bool) -> tuple[BatchedGenerator, list[list[int]]]:
        gen = BatchedGenerator(model, max_seq_len=64, max_batch=4, block_size=4, prefill_chunk=7,
                               cuda_graph=cuda_graph)
        return gen, gen.generate_batch(prompts, max_tokens=9)

    ref_gen, ref = run(False)
    gen, got = run(True)
    assert got == ref
    scratch = {kind: gen.cache.scratch_block[kind] for kind in gen.cache.kinds}
    assert scratch == {kind: ref_gen.cache.k[kind].shape[1] for kind in gen.cache.kinds}  # one block past the pool
    # no real sequence ever held the scratch block; its row points at it
    assert all(len(free) == gen.cache.k[kind].shape[1] - 1 for kind, free in gen.cache.free.items())
    assert all(scratch[kind] not in free for kind, free in gen.cache.free.items())
    assert (gen.cache.device_table[:, gen.cache.scratch_row] == torch.tensor(list(scratch.values()))[:, None]).all()


def test_fixed_shape_logits_match(model: Transformer) -> None:
    gen = BatchedGenerator(model, max_seq_len=48, max_batch=4, block_size=4, prefill_chunk=32, cuda_graph=True)
    ref = BatchedGenerator(model, max_seq_len=48, max_batch=4, block_size=4, prefill_chunk=32)
    for g in (gen, ref):
        for n in (4, 9, 13):
            g.add(_tokens(n, seed=n), max_tokens=4)
    for _ in range(4):
        step_a, step_b = gen.step(), ref.step()
        assert step_a is not None and step_b is not None
        (a, ids_a), (b, ids_b) = step_a, step_b
        assert ids_a == ids_b and a.shape == b.shape == (3, 160)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
        for sid, token in zip(ids_a, sample(b, 0.0)):
            gen.update(sid, token)
            ref.update(sid, token)


def _reference_rule(logits: Tensor, temperature: float, generators: list[Generator]) -> list[int]:
    """The pipelines' sampling rule as it was written on the host: one float64 uniform per row
    from the row's own generator, the first token whose float64 CDF exceeds u * total."""
    if temperature <= 0:
        greedy: list[int] = logits.argmax(dim=-1).tolist()
        return greedy
    cdf = torch.softmax(logits.double().cpu() / temperature, dim=-1).cumsum(dim=-1)
    return [min(int(torch.searchsorted(cdf[b], torch.rand((), generator=g, dtype=torch.float64) * cdf[b, -1],
                                       right=True)), cdf.shape[1] - 1) for b, g in enumerate(generators)]


def test_device_sampling_matches_the_pipelines_rule() -> None:
    from refinery.transforms.inference.handler import sample_rows

    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(5, 300, generator=g) * (1 + seed % 4)
        for temperature in (0.0, 0.3, 1.0, 1.7):
            def gens() -> list[Generator]:
                return [torch.Generator().manual_seed(100 * seed + b) for b in range(5)]

            want = _reference_rule(logits, temperature, gens())
            assert sampling.sample_rows(logits, temperature, gens()) == want == sample_rows(logits, temperature, gens())
    # the same per-row streams: a row's token does not depend on the other rows
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))

    def streams() -> list[Generator]:
        return [torch.Generator().manual_seed(s) for s in (1, 2, 3)]

    together = sampling.sample_rows(logits, 1.0, streams())
    assert together == [sampling.sample_rows(logits[i:i + 1], 1.0, [streams()[i]])[0] for i in range(3)]
    # on the device: a tensor, no host round trip
    u = sampling.draw_uniforms(streams())
    picked = sampling.sample_rows_device(logits, 1.0, u)
    assert picked.dtype == torch.long and picked.tolist() == together
