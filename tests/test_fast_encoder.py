"""The fast encoder (bpe-openai's Rust BPE) gives tiktoken's tokens, token for token.

tiktoken is the reference: on the suite's corpora and on seeded fuzz (any Unicode, special-token
text, long runs without spaces, documents over 200,000 tokens), for o200k_harmony and
cl100k_base; a document the fast encoder refuses is encoded by tiktoken and counted; prep's
shards are the same bytes with either encoder.
"""
from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest
from helpers import gsm8k_rows, run_prep, tree_digest

from refinery.transforms.formats import tokenizer as tk
from refinery.transforms.formats.tokenizers import (
    DEFAULT,
    FastTiktokenTokenizer,
    TiktokenTokenizer,
    load_tokenizer,
    resolve_tokenizer,
)

ROOT = Path(__file__).resolve().parents[1]
SPECIALS = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|im_start|>",
            "<|fim_prefix|>", "<|endofprompt|>", "<|constrain|>", "<|call|>"]


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


def _random_char(rnd: random.Random) -> str:
    kind = rnd.random()
    if kind < 0.35:
        return chr(rnd.randrange(0x20, 0x7F))
    if kind < 0.45:
        return rnd.choice(" \t\n\r\x0b\x0c\u00a0\u2028\u3000")
    if kind < 0.55:
        return rnd.choice("0123456789")
    while True:  # any code point but a surrogate (no UTF-8 for it: prep rejects such text first)
        cp = rnd.randrange(0x110000) if rnd.random() < 0.3 else rnd.randrange(0x80, 0x3000)
        if not 0xD800 <= cp <= 0xDFFF:
            return chr(cp)


def _fuzz_texts(seed: int, n: int) -> list[str]:
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rnd.randrange(1, 12)):
            r = rnd.random()
            if r < 0.5:
                parts.append("".join(_random_char(rnd) for _ in range(rnd.randrange(1, 80))))
            elif r < 0.65:
                parts.append(rnd.choice(SPECIALS))
            elif r < 0.8:
                piece = rnd.choice(["a", "ab", "🙂", "日本", "é", "0", " ", "\n", "'s", "ـ"])
                parts.append(piece * rnd.randrange(1, 400))
            else:
                parts.append(" ".join(rnd.choice(["the", "Straße", "naïve", "x²", "ΔT", "123,456", "don't"])
                                      for _ in range(rnd.randrange(1, 30))))
        out.append("".join(parts))
    return out


def _long_texts(seed: int) -> list[str]:
    rnd = random.Random(seed)
    words = [w for r in gsm8k_rows("test")[:200] for w in r["question"].split()]
    return [
        "a" * 400_000,                                                          # one run, no spaces
        "".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(120_000)),
        "".join(rnd.choice("0123456789") for _ in range(50_000)),
        " ".join(rnd.choice(words) for _ in range(260_000)),                   # over 200,000 tokens
        "\n".join("".join(_random_char(rnd) for _ in range(200)) for _ in range(1500)),
    ]


@pytest.mark.parametrize("encoding", ["o200k_harmony", "cl100k_base"])
def test_fast_encoder_gives_tiktokens_tokens(encoding):
    spec = resolve_tokenizer(encoding)
    fast, ref = load_tokenizer(spec, "fast"), load_tokenizer(spec, "tiktoken")
    assert isinstance(fast, FastTiktokenTokenizer) and type(ref) is TiktokenTokenizer
    enc = tk.get_encoding() if encoding == tk.ENCODING_NAME else tk.get_tiktoken(encoding)
    texts = _corpus_texts() + _fuzz_texts(seed=7, n=3000) + _long_texts(seed=3)
    assert any(len(enc.encode_ordinary(t)) > 200_000 for t in texts[-5:])
    before = fast.fallbacks
    for i, text in enumerate(texts):
        got = fast.encode(text)
        assert got == ref.encode(text), (encoding, i, text[:200])
        assert got.tolist() == enc.encode_ordinary(text), (encoding, i, text[:200])
    assert fast.fallbacks == before  # nothing here needed tiktoken


def test_what_the_fast_encoder_refuses_tiktoken_encodes_and_it_is_counted():
    class Refusing:
        def encode(self, text):
            if "refuse" in text:
                raise ValueError("cannot")
            return tk.get_encoding().encode_ordinary(text)

    tok = FastTiktokenTokenizer(DEFAULT, tk.get_encoding(), Refusing())
    assert tok.encode("please refuse this") == load_tokenizer(DEFAULT).encode("please refuse this")
    assert tok.encode("fine") == load_tokenizer(DEFAULT).encode("fine")
    assert tok.fallbacks == 1


def test_prep_writes_the_same_shards_with_either_encoder(tmp_path):
    rows = [{"id": str(i), "text": t} for i, t in enumerate(_fuzz_texts(seed=11, n=300) + _long_texts(seed=5)[:2])]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for encoder in ("fast", "tiktoken"):
        assert run_prep([tmp_path / "in"], tmp_path / encoder, "--num-shards", 3, "--encoder", encoder) == 0
    fast, ref = tree_digest(tmp_path / "fast"), tree_digest(tmp_path / "tiktoken")
    shards = {p for p in ref if p.endswith((".npy", ".idx", "manifest.json"))}
    assert shards and {p: fast[p] for p in shards} == {p: ref[p] for p in shards}
    receipts = [json.loads(p.read_text()) for p in (tmp_path / "fast").rglob("receipts/*.json")]
    tokenize = [r for r in receipts if r["stage"] == "tokenize"]
    assert tokenize and all(r["stats"]["encoder_fallbacks"] == 0 for r in tokenize)
