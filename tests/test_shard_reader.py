"""IndexReader/IndexWriter, the memory-mapped ShardReader, and `refinery regenerate-index`."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import run_prep

from refinery.beam_pipelines.cli import main
from refinery.transforms.formats import shards
from refinery.transforms.formats.shards import IndexReader, IndexWriter, ShardReader, find_shards, regenerate_index

EOS = 199999


def write_shard(npy: Path, docs: list[list[int]], eos: int = EOS) -> tuple[Path, Path]:
    """A shard as prep writes it: docs + one EOS each; returns (npy, idx) paths."""
    npy.parent.mkdir(parents=True, exist_ok=True)
    tokens = np.array([t for d in docs for t in d + [eos]], dtype="<u4")
    np.save(npy, tokens)
    idx = npy.with_suffix(".idx")
    with open(idx, "wb") as f:
        shards.write_idx(f, [len(d) + 1 for d in docs])
    return npy, idx


def test_index_writer_matches_pack_and_reader_reads_it(tmp_path: Path) -> None:
    lengths = [5, 1, 300, 2]
    with IndexWriter(str(tmp_path / "a.idx")) as w:
        for n in lengths[:2]:
            w.add_document(n)
        w.add_lengths(np.array(lengths[2:]))
    with open(tmp_path / "b.idx", "wb") as f:
        shards.write_idx(f, lengths)
    assert (tmp_path / "a.idx").read_bytes() == (tmp_path / "b.idx").read_bytes()
    r = IndexReader(str(tmp_path / "a.idx"))
    assert r.num_docs == len(r) == 4
    assert r.get_document(0) == (0, 5) and r.get_document(2) == (6, 306) and r.get_document(-1) == (306, 308)
    assert r.lengths().tolist() == lengths
    with pytest.raises(IndexError, match="document 4 out of range"):
        r.get_document(4)
    with pytest.raises(ValueError, match="at least its EOS"):
        IndexWriter(str(tmp_path / "c.idx")).add_document(0)


def test_index_reader_rejects_malformed_files(tmp_path: Path) -> None:
    good = tmp_path / "g.idx"
    with open(good, "wb") as f:
        shards.write_idx(f, [3, 4])
    (tmp_path / "trunc.idx").write_bytes(good.read_bytes()[:-8])
    (tmp_path / "magic.idx").write_bytes(b"XXXXXXXX" + good.read_bytes()[8:])
    with pytest.raises(ValueError, match=r"trunc\.idx: idx is 56 bytes, header says 2 docs"):
        IndexReader(str(tmp_path / "trunc.idx"))
    with pytest.raises(ValueError, match=r"magic\.idx: idx has magic"):
        IndexReader(str(tmp_path / "magic.idx"))
    empty = tmp_path / "e.idx"
    with open(empty, "wb") as f:
        shards.write_idx(f, [])
    assert IndexReader(str(empty)).num_docs == 0


def test_shard_reader_returns_documents_by_index(tmp_path: Path) -> None:
    docs = [[1, 2, 3], [7], [9, 9, 9, 9, 9], [42, 43]]
    npy, _ = write_shard(tmp_path / "shard_0000" / "x-v1-shard-000000.npy", docs)
    r = ShardReader(str(npy))
    assert len(r) == 4 and r.num_tokens == (3 + 1) + (1 + 1) + (5 + 1) + (2 + 1)
    assert isinstance(r.tokens, np.memmap)  # memory-mapped, not read whole
    assert [d.tolist() for d in r] == [d + [EOS] for d in docs]
    assert r[2].tolist() == [9, 9, 9, 9, 9, EOS]
    write_shard(tmp_path / ".refinery" / "hidden.npy", [[1]])
    assert find_shards(str(tmp_path)) == [str(npy)]


def test_regenerate_index_is_byte_identical_on_a_real_prep_shard(
        tmp_path: Path, small_corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert run_prep(small_corpus, out, "--num-shards", "2") == 0
    idx_files = sorted(out.glob("shard_*/*.idx"))
    assert len(idx_files) == 2
    for idx in idx_files:
        original = idx.read_bytes()
        npy = idx.with_suffix(".npy")
        assert regenerate_index(str(npy), EOS) == original
        idx.unlink()
        assert main(["regenerate-index", str(npy), "--eos-token-id", str(EOS)]) == 0
        assert idx.read_bytes() == original
        assert ShardReader(str(npy)).num_docs == (len(original) - 32) // 16 > 0
    # an existing identical index is left alone; a differing one is not overwritten without --force
    assert main(["regenerate-index", str(npy)]) == 0
    assert "already identical" in capsys.readouterr().out
    idx.write_bytes(original[:-16])
    assert main(["regenerate-index", str(npy)]) == 1
    assert "differs" in capsys.readouterr().err and idx.read_bytes() == original[:-16]
    assert main(["regenerate-index", str(npy), "--force"]) == 0
    assert idx.read_bytes() == original
    assert main(["verify", str(out / "manifest.json"), "--checksums"]) == 0


def test_regenerate_index_refuses_tokens_after_the_last_eos(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    npy = tmp_path / "s.npy"
    np.save(npy, np.array([1, 2, EOS, 3, 4], dtype="<u4"))
    assert main(["regenerate-index", str(npy), "--eos-token-id", str(EOS)]) == 1
    assert "2 token(s) after the last EOS" in capsys.readouterr().err
    assert not (tmp_path / "s.idx").exists()
    assert main(["regenerate-index", str(tmp_path / "missing.npy")]) == 2
