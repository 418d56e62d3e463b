"""decon reads the text prep trains on: n-grams of the normalized text, offsets into the row's.

prep trains on :func:`~refinery.transforms.io.text.normalize_text` of a row's text (NFC,
``\\r\\n`` and ``\\r`` as ``\\n``, Cc controls but ``\\t`` ``\\n`` dropped, ends stripped). decon
tokenizes that same text, on both sides, so a row that differs from an eval question only
in what the normalization removes (NFD accents, a C1 control inside each word, CR LF line
ends) is the same text to both commands. Offsets stay code-point offsets into the row's text
as read (``docs/FORMATS.md``): a span of the normalized text is mapped back through
:func:`~refinery.transforms.io.text.normalized_offsets` (only for a text the normalization
changes; a clean text is its own normalized form).
"""
from __future__ import annotations

import numpy as np

from refinery.transforms.io.text import normalize_text, normalized_offsets, raw_spans

from .word_split import WordSplitter


def tokens(tokenizer: WordSplitter, text: str) -> list[str]:
    """The tokens of ``text`` as decon counts them: :meth:`WordSplitter.tokenize` of its normalized
    form (equal tokens of a long text one string: :meth:`WordSplitter.tokenize_shared`)."""
    return tokenizer.tokenize_shared(normalize_text(text))


def prepare(tokenizer: WordSplitter, text: str) -> bytes:
    """:meth:`WordSplitter.prepare` of the normalized form of ``text`` (the fast path's bytes)."""
    return tokenizer.prepare(normalize_text(text))


def token_count(tokenizer: WordSplitter, text: str) -> tuple[int, bool]:
    """(``len(tokens(tokenizer, text))``, whether every one of them is empty), without making
    the tokens: one more than the runs of separators in the fast path's bytes (an eval row of
    20 MB is 3 million token strings, ~180 MB, where this needs two arrays of its size)."""
    sep = np.frombuffer(prepare(tokenizer, text).translate(tokenizer.byte_table), dtype=np.uint8) == 0x20
    if not len(sep):
        return 1, True
    runs = int(sep[0]) + int(np.count_nonzero(sep[1:] & ~sep[:-1]))
    return runs + 1, bool(sep.all())


def tokens_with_offsets(tokenizer: WordSplitter, text: str) -> tuple[list[str], list[tuple[int, int]]]:
    """(tokens, spans): :func:`tokens`, with each token's ``[start, end)`` in ``text`` (the row's
    text, before normalization; :func:`to_raw`)."""
    norm = normalize_text(text)
    toks, spans = tokenizer.tokenize_with_offsets(norm)
    if norm is text or norm == text:
        return toks, spans
    pairs = np.array(spans, dtype=np.int64).reshape(-1, 2)
    s, e = to_raw(text, norm, pairs[:, 0], pairs[:, 1])
    return toks, list(zip(s.tolist(), e.tolist()))


def to_raw(text: str, norm: str, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[start, end)`` code-point spans of ``norm`` (``normalize_text(text)``) -> spans of
    ``text``: from the raw start of a span's first character to the raw end of its last."""
    mapped, starts, ends = normalized_offsets(text)
    if mapped != norm:  # pragma: no cover - the two normalizations are tested equal
        raise ValueError(f"the offset map of a text of {len(text)} characters does not give its normalized text")
    return raw_spans(starts, ends, start, end, len(text))
