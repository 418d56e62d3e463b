"""tiktoken's exact tokens from gigatoken's Rust BPE, a batch of documents at a time, as buffers.

``--encoder fast`` (the default) encodes o200k_harmony, o200k_base and cl100k_base with the
PyPI package ``gigatoken-cachefix`` (an unofficial build of gigatoken with bounded encode
caches; the import is ``gigatoken``) when it is installed and gives tiktoken's tokens on the
load-time probes; else with bpe-openai (:class:`~refinery.transforms.formats.bpe_encoder.FastTiktokenTokenizer`),
else tiktoken.

How it is used, and why each rule is there:

- **Ordinary tokens only.** The encoder is built from the tiktoken vocab file with its
  pretokenizer named (``o200k``, ``cl100k``) and no special tokens, so special-token text in a
  document (``<|endoftext|>``) is ordinary text, as ``encode_ordinary`` keeps it.
- **One thread.** Every batch is encoded with ``parallel=False``, on the calling thread: the
  process-global thread pool is never started, so a worker forked after a load (the warm pool,
  ``runners/warm_workers.py``) cannot wait on a pool that has no threads in it, and workers do
  not oversubscribe the cores.
- **Buffers, not lists.** ``encode_batch`` returns an awkward array; its layout holds the
  batch's tokens as one flat uint32 numpy buffer and the documents' int64 offsets, read here
  without one Python object per document (:meth:`GigatokenTokenizer.encode_flat`).
- **Bounded memory.** The encoder caches every pretoken it has merged; unbounded, one instance
  grew ~350 MB over 54 M characters of distinct text. ``gigatoken-cachefix`` bounds that cache
  (:data:`MAX_CACHE_BYTES`, set when the encoder is built; a full cache is wiped, which changes
  no token). An installed ``gigatoken`` without that bound is not used.
- **Unicode versions.** gigatoken's character classes are a newer Unicode's than tiktoken's:
  a character assigned since (``U+1ACF``) is a letter to one and unassigned to the other, and
  the text around it splits differently. A document holding a code point unassigned in Unicode
  14.0 (:mod:`.unassigned`; every differing code point found is one) goes to tiktoken.
- **Checked.** At load, the probes of :mod:`~refinery.transforms.formats.tokenizer_choice` must give
  tiktoken's tokens (their sha256), else a warning and the next encoder. A batch the encoder
  raises on is encoded document by document, and a document it refuses by tiktoken. Every
  document tiktoken encodes is counted in ``fallbacks`` (the tokenize receipts'
  ``encoder_fallbacks``).
"""
from __future__ import annotations

import hashlib
import json
import logging
from array import array
from typing import Any, Callable, Sequence

import numpy as np

from refinery.transforms.formats import tiktoken_vocab as tk
from refinery.transforms.formats.bpe_encoder import FastTiktokenTokenizer
from refinery.transforms.formats.tokenizer_choice import (
    _PROBE_SHA256,
    _PROBES,
    DEFAULT,
    FAST_ENCODINGS,
    TiktokenTokenizer,
    TokenizerSpec,
    join_encoded,
)
from refinery.transforms.formats.unassigned import has_unassigned

log = logging.getLogger("refinery")

# gigatoken's name of each encoding's split pattern (its pretokenizer), by the base encoding
PRETOKENIZERS = {"o200k_base": "o200k", "cl100k_base": "cl100k"}
# The encode cache's budget, per process. Measured (bench/encoders.py cache, 200 MB, one pass):
# on web-like text every budget from 64 MiB to 512 MiB encodes alike (RSS +235 to +279 MB); on
# distinct words (a new piece each) 64 / 128 / 256 / 512 MiB take 6.7 / 5.3 / 4.4 / 4.5 s with
# RSS +222 / +257 / +328 / +471 MB. Smaller budgets wipe often, and each wipe re-seeds the vocab.
MAX_CACHE_BYTES = 256 << 20

_U32 = np.dtype(np.uint32)
_I64 = np.dtype(np.int64)


class GigatokenTokenizer(FastTiktokenTokenizer):
    """tiktoken's tokens from gigatoken's BPE (``fast``: its ``BPETokenizer``). ``encode_flat``
    encodes a batch in one call and hands back its buffers; ``encode`` one document. tiktoken
    (loaded only then) encodes a document holding a code point unassigned in Unicode 14.0
    (:mod:`.unassigned`: there the two encoders' Unicode tables disagree) and one the encoder
    refuses; each such document is counted in ``fallbacks``."""

    def encode(self, text: str) -> array[int]:
        if has_unassigned(text):
            return self._tiktoken(text)
        try:
            tokens = np.ascontiguousarray(self.fast.encode(text), _U32)
        except Exception:  # noqa: BLE001 - whatever the fast encoder refuses, tiktoken encodes
            return self._tiktoken(text)
        out = array("I")
        out.frombytes(tokens.data.cast("B"))
        return out

    def _tiktoken(self, text: str) -> array[int]:
        self.fallbacks += 1
        return TiktokenTokenizer.encode(self, text)

    def encode_flat(self, texts: Sequence[str], plain: Sequence[bool] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, offsets) of ``texts``: one uint32 array of every text's ordinary tokens back
        to back, and int64 offsets (``len(texts) + 1``; text ``i``'s tokens are
        ``tokens[offsets[i]:offsets[i + 1]]``). One encoder call for the texts it may take;
        tiktoken for the others (a code point unassigned in Unicode 14.0: looked for unless
        ``plain[i]`` says there is none). If the call raises, or its result is not the two
        buffers expected, the texts are encoded one by one (:meth:`encode`)."""
        if not isinstance(texts, list):
            texts = list(texts)
        odd = {i for i, t in enumerate(texts) if not (plain is not None and plain[i]) and has_unassigned(t)}
        fast = [t for i, t in enumerate(texts) if i not in odd] if odd else texts
        try:
            tokens, offsets = batch_buffers(self.fast.encode_batch(fast, parallel=False), len(fast))
        except Exception:  # noqa: BLE001 - the batch as documents, each with its own fallback
            return super().encode_flat(texts)
        if not odd:
            return tokens, offsets
        parts: list[array[int] | np.ndarray] = []
        j = 0
        for i, text in enumerate(texts):
            if i in odd:
                parts.append(self._tiktoken(text))
            else:
                parts.append(tokens[offsets[j]:offsets[j + 1]])
                j += 1
        return join_encoded(parts)


def batch_buffers(result: Any, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens uint32, offsets int64) of an ``encode_batch`` result of ``count`` documents, read
    from its awkward layout (a ``ListOffsetArray`` over a ``NumpyArray``) without importing
    awkward; raises ``ValueError`` when the result is not that layout with offsets from 0."""
    layout = result.layout
    offsets, tokens = layout.offsets.data, layout.content.data
    if not (isinstance(tokens, np.ndarray) and isinstance(offsets, np.ndarray) and tokens.dtype == _U32
            and offsets.dtype == _I64 and offsets.shape == (count + 1,) and tokens.ndim == 1):
        raise ValueError(f"unexpected encode_batch result: {type(layout).__name__}")
    if count and (offsets[0] != 0 or offsets[-1] != len(tokens)):
        raise ValueError("encode_batch offsets do not cover its tokens")
    return np.ascontiguousarray(tokens), offsets


def vocab_file(spec: TokenizerSpec) -> str:
    """The verified, decompressed ``.tiktoken`` file of ``spec``'s encoding in tiktoken's cache
    (put there from the offline sources first, as the tiktoken path does); raises
    :class:`~refinery.transforms.formats.tiktoken_vocab.VocabError` when there is none."""
    base = FAST_ENCODINGS[spec.name]
    if base == "o200k_base":
        tk.resolve_vocab()  # --vocab-file / $REFINERY_VOCAB_FILE, the cache, bpe-openai's copy
    else:
        tk.resolve_tiktoken_files(base)
    path = tk.tiktoken_cache_path(tk.TIKTOKEN_FILES[base][0])
    if path is None or not path.exists():
        raise tk.VocabError(f"{base}: no verified vocab file in tiktoken's cache")
    return str(path)


def probe_digest(encode_batch: Callable[[list[str]], tuple[np.ndarray, np.ndarray]]) -> str:
    """sha256 of the JSON token lists that ``encode_batch`` (texts -> (tokens, offsets)) gives
    for the load-time probes: compared with tiktoken's (``_PROBE_SHA256``)."""
    tokens, offsets = encode_batch(list(_PROBES))
    lists = [tokens[offsets[i]:offsets[i + 1]].tolist() for i in range(len(_PROBES))]
    return hashlib.sha256(json.dumps(lists).encode()).hexdigest()


# encoders built ahead (:func:`preload`), by (base encoding, cache budget)
_PRELOADED: dict[tuple[str, int], Any] = {}


def preload(spec: TokenizerSpec | None = None) -> bool:
    """Build the encoder of ``spec`` (default: prep's default tokenizer) now, for the processes
    forked from this one (the warm worker pool) to share; returns whether it was built. Quiet:
    where it cannot be, a worker builds its own and says why."""

    spec = spec or DEFAULT
    base = FAST_ENCODINGS.get(spec.name)
    quiet = log.disabled
    log.disabled = True
    try:
        fast = gigatoken_backend(spec)
    finally:
        log.disabled = quiet
    if fast is not None and base is not None:  # a built encoder has a base encoding
        _PRELOADED[(base, MAX_CACHE_BYTES)] = fast
    return fast is not None


def gigatoken_backend(spec: TokenizerSpec, max_cache_bytes: int = MAX_CACHE_BYTES) -> Any:
    """gigatoken's encoder for ``spec``'s encoding with a bounded cache, when installed and
    giving tiktoken's tokens on the probes (or built ahead by :func:`preload`); else None, with
    a warning saying why."""
    base = FAST_ENCODINGS.get(spec.name) if spec.kind == "tiktoken" else None
    if base not in PRETOKENIZERS:
        return None
    if (base, max_cache_bytes) in _PRELOADED:
        return _PRELOADED[(base, max_cache_bytes)]
    try:
        import gigatoken
    except ImportError:
        return None  # not installed (a platform without its wheel): bpe-openai, quietly
    why = "it gives other tokens than tiktoken on the probes"
    try:
        if not hasattr(gigatoken, "set_max_cache_bytes"):
            why = "its encode cache is not bounded (install gigatoken-cachefix rather than gigatoken)"
            raise LookupError(why)
        from gigatoken.gigatoken_rs import BPETokenizer

        path = vocab_file(spec)
        before = gigatoken.get_max_cache_bytes()
        gigatoken.set_max_cache_bytes(max_cache_bytes)  # process-global, read when an encoder is built
        try:
            fast = BPETokenizer.from_tiktoken(path, PRETOKENIZERS[base], None)  # no special tokens
        finally:
            gigatoken.set_max_cache_bytes(before)
        digest = probe_digest(lambda texts: batch_buffers(fast.encode_batch(texts, parallel=False), len(texts)))
        if digest == _PROBE_SHA256[base]:
            return fast
    except LookupError:
        pass
    except Exception as e:  # noqa: BLE001 - no usable encoder: the next one
        why = f"{type(e).__name__}: {e}"
    log.warning("gigatoken's encoder is not usable for %s here (%s); encoding with bpe-openai", spec.name, why)
    return None
