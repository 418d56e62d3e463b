"""Which encoder gives a worker its tokens (``--encoder``): every one gives the reference's
tokens (tiktoken ``encode_ordinary``, or ``tokenizers`` for a ``tokenizer.json``), the fast
ones faster, and a document a fast one refuses is encoded by the reference and counted."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from refinery.transforms.formats.bpe_encoder import FastTiktokenTokenizer, _fast_backend
from refinery.transforms.formats.gigatoken_encoder import GigatokenTokenizer, gigatoken_backend
from refinery.transforms.formats.tokenizer_choice import (
    PrepTokenizer,
    TiktokenTokenizer,
    TokenizerError,
    TokenizerSpec,
    plain_tokenizer,
    tiktoken_encoding,
)

if TYPE_CHECKING:
    from tiktoken import Encoding

# --encoder: "fast" is gigatoken where it is installed and passes the probes, else bpe-openai;
# "bpe-openai" that one alone; "tiktoken" the reference. Every one gives the same tokens.
ENCODERS = ("fast", "bpe-openai", "tiktoken")


@functools.lru_cache(maxsize=8)
def load_tokenizer(spec: TokenizerSpec, encoder: str = "tiktoken") -> PrepTokenizer:
    """The tokenizer ``spec`` names, once per process. For a tiktoken encoding the fast
    encoders know (:data:`~.tokenizer_choice.FAST_ENCODINGS`), ``encoder="fast"`` gives gigatoken's
    (:class:`~refinery.transforms.formats.gigatoken_encoder.GigatokenTokenizer`) when it is
    installed and passes the probes, else bpe-openai's (:class:`FastTiktokenTokenizer`), and
    ``"bpe-openai"`` the latter: the same tokens as tiktoken, which encodes what they refuse.
    Otherwise, and for a ``tokenizer.json``, :func:`~.tokenizer_choice.plain_tokenizer`. Raises
    :class:`TokenizerError` for an unknown encoder, or when a ``tokenizer.json`` is missing
    or no longer has the planned sha256."""
    if encoder not in ENCODERS:
        raise TokenizerError(f"--encoder {encoder!r}: one of {', '.join(ENCODERS)}")
    if spec.kind != "tiktoken" or encoder == "tiktoken":
        return plain_tokenizer(spec)

    def encoding() -> Encoding:
        return tiktoken_encoding(spec)

    if encoder == "fast":
        giga = gigatoken_backend(spec)
        if giga is not None:
            return GigatokenTokenizer(spec, encoding, giga)  # tiktoken loaded if ever needed
    fast = _fast_backend(spec)
    if fast is None:
        return TiktokenTokenizer(spec, encoding())
    return FastTiktokenTokenizer(spec, encoding, fast)  # tiktoken loaded if ever needed
