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

from typing import Any, Sequence

import numpy as np

from refinery.transforms.io.text import normalize_text, normalized_offsets, raw_spans

from .arrays import run_starts
from .hashes import TokenBatch
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


def _byte_to_char(prepared: bytes) -> np.ndarray:
    """Code points before each byte offset of the UTF-8 ``prepared`` (one more entry than its
    bytes): byte offsets become character offsets by indexing it."""
    lead = (np.frombuffer(prepared, dtype=np.uint8) & 0xC0) != 0x80
    chars = np.zeros(len(lead) + 1, dtype=np.int64)
    np.cumsum(lead, out=chars[1:])
    return chars


def token_spans(tokenizer: WordSplitter, text: str, prepared: bytes, starts: np.ndarray, ends: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Each token's ``[start, end)`` code-point span in ``text`` (the row's text as read), from
    its byte span in ``prepared`` (:func:`.normalized.prepare` of ``text``): what
    :func:`.normalized.tokens_with_offsets` gives, without a Python object per token."""
    norm = normalize_text(text)
    same = norm is text or norm == text
    if len(prepared) == len(norm):  # ASCII: bytes are characters
        s, e = starts, ends
    elif len(norm.lower() if tokenizer.lowercase else norm) == len(norm):
        chars = _byte_to_char(prepared)
        s, e = chars[starts], chars[ends]
    else:  # lowering changed the length ('İ'): the exact tokenizer's offsets (rare)
        spans = np.array(tokens_with_offsets(tokenizer, text)[1], dtype=np.int64).reshape(-1, 2)
        return spans[:, 0].copy(), spans[:, 1].copy()
    if not same:
        return to_raw(text, norm, np.asarray(s, dtype=np.int64), np.asarray(e, dtype=np.int64))
    return np.asarray(s, dtype=np.int64), np.asarray(e, dtype=np.int64)


def char_offsets(batch: TokenBatch, pos: np.ndarray, lens: np.ndarray, rows: np.ndarray,
                 pending: Sequence[tuple[int, Any, str]], prepared: list[bytes], normed: list[str],
                 tokenizer: WordSplitter) -> tuple[np.ndarray, np.ndarray]:
    """``[start, end)`` of each window (its first token ``pos``, ``lens`` tokens, in batch row
    ``rows``) as code-point offsets into its row's text: byte offsets, mapped per row where
    those are not code points (non-ASCII text, lowering that changes the length, a text the
    normalization changed)."""
    base = batch.row_base[rows] + 1
    start = batch.starts[pos] - base
    end = batch.ends[pos + lens - 1] - base
    by_row = np.argsort(rows, kind="stable")
    firsts = run_starts(rows[by_row])
    bounds = np.append(firsts, len(rows)).tolist()
    for j, r in enumerate(rows[by_row[firsts]].tolist()):  # rows whose byte offsets are not code points
        raw, text = pending[r][2], normed[r]
        same = text is raw or text == raw  # (normalize_text hands a clean text back as it is)
        if len(prepared[r]) == len(text) and same:
            continue
        at = by_row[bounds[j]:bounds[j + 1]]  # the row's hits
        if len(prepared[r]) == len(text):
            pass
        elif len(text.lower() if tokenizer.lowercase else text) == len(text):
            chars = _byte_to_char(prepared[r])
            start[at], end[at] = chars[start[at]], chars[end[at]]
        else:  # lowering changed the length ('İ'): the exact tokenizer maps offsets
            spans = np.array(tokenizer.tokenize_with_offsets(text)[1], dtype=np.int64).reshape(-1, 2)
            i = pos[at] - batch.row_first[r]
            start[at], end[at] = spans[i, 0], spans[i + lens[at] - 1, 1]
        if not same:  # offsets into the normalized text -> into the row's text
            start[at], end[at] = to_raw(raw, text, start[at], end[at])
    return start, end
