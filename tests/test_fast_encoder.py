"""The fast encoders (gigatoken's and bpe-openai's Rust BPE) give tiktoken's tokens, token for token.

tiktoken is the reference: on the suite's corpora and on seeded fuzz (tests/encoder_fuzz.py:
special-token text, combining marks, controls, astral and unassigned characters, runs of
spaces and digits, a 1 MB token, documents over 200,000 tokens), for o200k_harmony, o200k_base
and cl100k_base, one document at a time and in batches; what an encoder refuses is encoded by
tiktoken and counted; prep's shards are the same bytes with every encoder; gigatoken's encoder
works in a forked child without starting a thread, and its cache is bounded.
"""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from array import array
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import tiktoken
from encoder_fuzz import fuzz_texts, long_texts
from helpers import gsm8k_rows, run_prep, tree_digest

from refinery.transforms.formats import tiktoken_vocab as tk
from refinery.transforms.formats.bpe_encoder import FastTiktokenTokenizer
from refinery.transforms.formats.encoders import load_tokenizer
from refinery.transforms.formats.tokenizer_choice import DEFAULT, TiktokenTokenizer, resolve_tokenizer
from refinery.transforms.formats.unassigned import has_unassigned
from refinery.transforms.io.text import normalize_text
from refinery.transforms.prep.documents import encode_document, encode_documents

gigatoken = pytest.importorskip("gigatoken", reason="gigatoken-cachefix is installed on Linux x86-64 only")
from refinery.transforms.formats.gigatoken_encoder import (  # noqa: E402 - after the skip
    GigatokenTokenizer,
    batch_buffers,
    gigatoken_backend,
)

ROOT = Path(__file__).resolve().parents[1]
ENCODINGS = ["o200k_harmony", "o200k_base", "cl100k_base"]


def _corpus_texts() -> list[str]:
    texts = []
    for split in ("train", "test"):
        texts += [r["question"] + "\n\n" + r["answer"] for r in gsm8k_rows(split)]
    for path in sorted((ROOT / "examples" / "sample_corpus").glob("*.jsonl*")):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                try:
                    text = json.loads(line).get("text")
                except ValueError:
                    continue
                if isinstance(text, str):
                    texts.append(text)
    return texts


def _long_texts(seed: int) -> list[str]:
    texts: list[str] = long_texts(seed, [w for r in gsm8k_rows("test")[:200] for w in r["question"].split()])
    return texts


def _tiktoken(encoding: str) -> tiktoken.Encoding:
    return tk.get_encoding() if encoding == tk.ENCODING_NAME else tk.get_tiktoken(encoding)


def _batches(texts: list[str], size: int) -> list[list[str]]:
    return [texts[i:i + size] for i in range(0, len(texts), size)]


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_gigatoken_gives_tiktokens_tokens(encoding: str) -> None:
    fast = load_tokenizer(resolve_tokenizer(encoding), "fast")
    assert isinstance(fast, GigatokenTokenizer)
    enc = _tiktoken(encoding)
    texts = _corpus_texts() + fuzz_texts(seed=7, n=1500) + fuzz_texts(seed=17, n=3000, assigned=True) + \
        _long_texts(seed=3)
    assert any(len(enc.encode_ordinary(t)) > 200_000 for t in texts[-5:])
    before = fast.fallbacks
    for batch in _batches(texts, 500):  # the batch path, as prep's units encode
        tokens, offsets = fast.encode_flat(batch)
        assert tokens.dtype == np.uint32 and offsets.dtype == np.int64 and len(offsets) == len(batch) + 1
        for i, text in enumerate(batch):
            assert tokens[offsets[i]:offsets[i + 1]].tolist() == enc.encode_ordinary(text), (encoding, text[:200])
    odd = sum(has_unassigned(t) for t in texts)
    assert odd > 100 and fast.fallbacks - before == odd  # those went to tiktoken, and only those
    for text in texts[-40:]:  # one document at a time
        assert fast.encode(text).tolist() == enc.encode_ordinary(text)


@pytest.mark.parametrize("encoding", ["o200k_harmony", "cl100k_base"])
def test_bpe_openai_gives_tiktokens_tokens(encoding: str) -> None:
    spec = resolve_tokenizer(encoding)
    fast, ref = load_tokenizer(spec, "bpe-openai"), load_tokenizer(spec, "tiktoken")
    assert isinstance(fast, FastTiktokenTokenizer) and type(ref) is TiktokenTokenizer
    enc = _tiktoken(encoding)
    texts = _corpus_texts()[::4] + fuzz_texts(seed=8, n=2000) + _long_texts(seed=4)
    before = fast.fallbacks
    for i, text in enumerate(texts):
        got = fast.encode(text)
        assert got == ref.encode(text), (encoding, i, text[:200])
        assert got.tolist() == enc.encode_ordinary(text), (encoding, i, text[:200])
    assert fast.fallbacks == before  # nothing here needed tiktoken


@pytest.mark.parametrize("encoder", ["fast", "bpe-openai", "tiktoken"])
def test_encode_documents_is_encode_document_for_each(encoder: str) -> None:
    tok = load_tokenizer(DEFAULT, encoder)
    texts = fuzz_texts(seed=9, n=300) + ["x"]
    tokens, lengths = encode_documents(tok, texts)
    expected = [encode_document(tok, t) for t in texts]
    assert lengths.dtype == np.uint32 and lengths.tolist() == [len(e) for e in expected]
    assert tokens.dtype == np.uint32 and tokens.tolist() == [t for e in expected for t in e]
    empty_tokens, empty_lengths = encode_documents(tok, [])
    assert len(empty_tokens) == 0 and len(empty_lengths) == 0


class _Refusing:
    """A fast encoder that refuses any document holding "refuse" (and a batch holding one)."""

    def __init__(self) -> None:
        self.enc = tk.get_encoding()

    def encode(self, text: str) -> npt.NDArray[np.uint32]:
        if "refuse" in text:
            raise ValueError("cannot")
        return self.enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())

    def encode_batch(self, texts: list[str], parallel: bool = True) -> Any:  # gigatoken's (untyped) batch result
        assert parallel is False  # never the thread pool
        if any("refuse" in t for t in texts):
            raise ValueError("cannot")
        return gigatoken.Tokenizer.from_tiktoken(str(tk.tiktoken_cache_path()), "o200k").encode_batch(
            texts, parallel=False)


def test_what_the_fast_encoders_refuse_tiktoken_encodes_and_it_is_counted() -> None:
    ref = load_tokenizer(DEFAULT, "tiktoken")
    tok = FastTiktokenTokenizer(DEFAULT, tk.get_encoding(), _Refusing())
    assert tok.encode("please refuse this") == ref.encode("please refuse this")
    assert tok.encode("fine") == ref.encode("fine")
    assert tok.fallbacks == 1

    giga = GigatokenTokenizer(DEFAULT, tk.get_encoding, _Refusing())
    texts = ["fine", "please refuse this", "also fine <|endoftext|>", "refuse again", "ok\U000332db%s"]
    tokens, offsets = giga.encode_flat(texts)  # the batch is refused: each document on its own
    assert [tokens[offsets[i]:offsets[i + 1]].tolist() for i in range(len(texts))] == [ref.encode(t).tolist()
                                                                                      for t in texts]
    assert giga.fallbacks == 3  # two refused, one with a code point unassigned in Unicode 14.0
    tokens, offsets = giga.encode_flat(["fine", "ok\U000332db%s", "x"])  # one batch call, one to tiktoken
    assert [tokens[offsets[i]:offsets[i + 1]].tolist() for i in range(3)] == [
        ref.encode(t).tolist() for t in ["fine", "ok\U000332db%s", "x"]]
    assert giga.fallbacks == 4


def test_a_batch_result_of_another_layout_is_refused() -> None:
    class Layout:
        def __init__(self, tokens: object, offsets: object) -> None:
            self.content, self.offsets = type("C", (), {"data": tokens})(), type("O", (), {"data": offsets})()

    class Result:
        def __init__(self, tokens: object, offsets: object) -> None:
            self.layout = Layout(tokens, offsets)

    good = batch_buffers(Result(np.arange(5, dtype=np.uint32), np.array([0, 2, 5], np.int64)), 2)
    assert good[0].tolist() == [0, 1, 2, 3, 4] and good[1].tolist() == [0, 2, 5]
    for tokens, offsets in [(np.arange(5, dtype=np.int64), np.array([0, 2, 5])),    # int64 tokens
                            (np.arange(5, dtype=np.uint32), np.array([0, 5], np.int64)),   # one document
                            (np.arange(5, dtype=np.uint32), np.array([1, 2, 5], np.int64)),
                            (np.arange(5, dtype=np.uint32), np.array([0, 2, 4], np.int64))]:
        with pytest.raises(ValueError):
            batch_buffers(Result(tokens, offsets), 2)


def test_prep_writes_the_same_shards_with_every_encoder(tmp_path: Path) -> None:
    texts = fuzz_texts(seed=11, n=300) + _long_texts(seed=5)[:2] + ["x\U000332dby"]
    rows = [{"id": str(i), "text": t} for i, t in enumerate(texts)]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for encoder in ("fast", "bpe-openai", "tiktoken"):
        assert run_prep([tmp_path / "in"], tmp_path / encoder, "--num-shards", 3, "--encoder", encoder) == 0
    ref = tree_digest(tmp_path / "tiktoken")
    shards = {p for p in ref if p.endswith((".npy", ".idx", "manifest.json"))}
    for encoder in ("fast", "bpe-openai"):
        got = tree_digest(tmp_path / encoder)
        assert shards and {p: got[p] for p in shards} == {p: ref[p] for p in shards}, encoder
    receipts = [json.loads(p.read_text()) for p in (tmp_path / "fast").rglob("receipts/*.json")]
    fallbacks = sum(r["stats"]["encoder_fallbacks"] for r in receipts if r["stage"] == "tokenize")
    assert fallbacks == sum(has_unassigned(normalize_text(t)) for t in texts) > 0


FORK_CHILD = """
import os, sys, time
import numpy as np
from refinery.transforms.formats import tiktoken_vocab as tk
from refinery.transforms.formats.tokenizer_choice import DEFAULT
from refinery.transforms.formats.encoders import load_tokenizer
import apache_beam  # what a worker has imported (its threads are its own)

def threads():
    return len(os.listdir("/proc/self/task"))

texts = ["Hello, world! " * 50 + str(i) for i in range(2000)]
enc = tk.get_encoding()
before = threads()
tok = load_tokenizer(DEFAULT, "fast")  # loaded and used in the parent, as in the warm pool
tok.encode_flat(texts)
assert threads() == before, ("the encoder started threads", before, threads())
pid = os.fork()
if pid == 0:
    alone = threads()  # fork copies only the calling thread
    sample = [t + " in the child" for t in texts]
    tokens, offsets = tok.encode_flat(sample)
    ok = all(tokens[offsets[i]:offsets[i + 1]].tolist() == enc.encode_ordinary(t) for i, t in enumerate(sample))
    os._exit(0 if ok and threads() == alone else 3)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        sys.exit(os.waitstatus_to_exitcode(status))
    time.sleep(0.05)
os.kill(pid, 9)
sys.exit(4)  # the child hung: a deadlock after fork
"""


@pytest.mark.skipif(not hasattr(os, "fork") or not os.path.isdir("/proc/self/task"), reason="needs fork and /proc")
def test_gigatoken_encodes_in_a_forked_child_without_threads() -> None:
    res = subprocess.run([sys.executable, "-c", FORK_CHILD], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


CACHE_RSS = """
import random, sys
from refinery.transforms.formats.tokenizer_choice import DEFAULT
from refinery.transforms.formats.gigatoken_encoder import gigatoken_backend, batch_buffers
import gigatoken

def rss_mb():
    return int([x for x in open("/proc/self/status") if x.startswith("VmRSS")][0].split()[1]) / 1024

budget = gigatoken.get_max_cache_bytes()
fast = gigatoken_backend(DEFAULT, int(sys.argv[1]))
assert gigatoken.get_max_cache_bytes() == budget  # the process-wide setting is left as it was
rnd = random.Random(0)
letters = "abcdefghijklmnopqrstuvwxyzéüßжщ"

def batch():
    return [" ".join("".join(rnd.choices(letters, k=rnd.randint(3, 12))) for _ in range(300)) for _ in range(200)]

fast.encode_batch(batch(), parallel=False)
start = rss_mb()
for _ in range(int(sys.argv[2])):  # distinct words: every pretoken new to the cache
    fast.encode_batch(batch(), parallel=False)
print(rss_mb() - start)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RSS from /proc")
def test_gigatokens_encode_cache_is_bounded() -> None:
    def growth(budget: int) -> float:
        res = subprocess.run([sys.executable, "-c", CACHE_RSS, str(budget), "12"], capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        return float(res.stdout.split()[-1])

    bounded, unbounded = growth(32 << 20), growth(1 << 40)  # 32 MiB: little above the vocab's seed
    assert bounded < 20 and unbounded > bounded + 30, (bounded, unbounded)


def test_the_unassigned_ranges_are_unicode_14s() -> None:
    import unicodedata

    from refinery.transforms.formats import unassigned

    assert not has_unassigned("plain ASCII") and not has_unassigned("日本語 naïve 👍") and has_unassigned("\u1acf")
    assert has_unassigned("x\U000332db") and has_unassigned("\U000e01f0") and not has_unassigned("\U0010fffd")
    if unicodedata.unidata_version != unassigned.UNICODE_VERSION:
        pytest.skip(f"this Python's unicodedata is {unicodedata.unidata_version}")
    assert unassigned.ranges() == unassigned.ranges_of(unicodedata)


def test_array_and_buffer_agree() -> None:
    tok = load_tokenizer(DEFAULT, "fast")
    one = tok.encode("Hello <|endoftext|> world")
    assert isinstance(one, array) and one.typecode == "I"
    tokens, offsets = tok.encode_flat(["Hello <|endoftext|> world"])
    assert tokens.tolist() == one.tolist() and offsets.tolist() == [0, len(one)]


def test_an_encoder_failing_the_probes_is_not_used_and_that_is_said(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    from refinery.transforms.formats import encoders, gigatoken_encoder
    from refinery.transforms.formats import tokenizer_choice as tokenizers

    spec = resolve_tokenizer("o200k_base")
    monkeypatch.setattr(gigatoken_encoder, "_PRELOADED", {})
    monkeypatch.setattr(gigatoken_encoder, "_PROBE_SHA256", {"o200k_base": "0" * 64, "cl100k_base": "0" * 64})
    with caplog.at_level("WARNING", logger="refinery"):
        assert gigatoken_backend(spec) is None
    assert "gigatoken's encoder is not usable for o200k_base" in caplog.text and "probes" in caplog.text
    encoders.load_tokenizer.cache_clear()
    try:
        assert type(load_tokenizer(spec, "fast")) is FastTiktokenTokenizer  # bpe-openai's, the next one
    finally:
        encoders.load_tokenizer.cache_clear()

    monkeypatch.setattr(gigatoken_encoder, "_PROBE_SHA256", tokenizers._PROBE_SHA256)
    monkeypatch.delattr(gigatoken, "set_max_cache_bytes")  # the official gigatoken: an unbounded cache
    caplog.clear()
    with caplog.at_level("WARNING", logger="refinery"):
        assert gigatoken_backend(spec) is None
    assert "not bounded" in caplog.text
