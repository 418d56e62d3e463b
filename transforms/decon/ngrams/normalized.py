"""decon reads the text prep trains on, folded to its match key: n-grams of that, offsets into the row's.

prep trains on :func:`~refinery.transforms.io.text.normalize_text` of a row's text (``\\r\\n``
and ``\\r`` as ``\\n``, Cc controls but ``\\t`` ``\\n`` dropped, NFC, ends stripped). decon
tokenizes that same text, on both sides, so a row that differs from an eval question only
in what the normalization removes (NFD accents, a C1 control inside each word, CR LF line
ends) is the same text to both commands. Then the tokenizer's match fold
(:func:`~refinery.transforms.io.text.fold_text`, ``--match-fold``; ``nfkc-cf`` by default:
format characters dropped, NFKC) makes text that is the same to a reader the same to the
matcher (fullwidth letters, ligatures, soft hyphens and zero-width characters inside words);
``none`` matches the normalized text itself. :func:`match_text` is that text. Offsets stay
code-point offsets into the row's text as read (``docs/FORMATS.md``): a span of the match
text is mapped back through both steps (:func:`match_offsets`; only for a text they change:
a clean text is its own match text).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from refinery.transforms.io.text import (
    fold_text,
    fold_texts,
    folded_offsets,
    normalize_text,
    normalized_offsets,
    raw_spans,
    then,
)

from .arrays import run_starts
from .hashes import TokenBatch
from .word_split import WordSplitter


def match_text(tokenizer: WordSplitter, text: str) -> str:
    """The text decon tokenizes of a row's ``text``: its normalized form, folded with the
    tokenizer's match fold (a clean ASCII text comes back as it is, the same object)."""
    return fold_text(normalize_text(text), tokenizer.fold)


def match_texts(tokenizer: WordSplitter, texts: list[str]) -> list[str]:
    """``[match_text(tokenizer, t) for t in texts]``, the scan's rows folded as one batch
    (:func:`~refinery.transforms.io.text.fold_texts`)."""
    return fold_texts([normalize_text(t) for t in texts], tokenizer.fold)


def match_offsets(tokenizer: WordSplitter, text: str) -> tuple[str, np.ndarray, np.ndarray]:
    """``(match_text(tokenizer, text), start, end)``: each code point ``i`` of the match text
    comes from ``text[start[i]:end[i]]`` (the normalization's map, then the fold's)."""
    norm, start, end = normalized_offsets(text)
    return then(start, end, folded_offsets(norm, tokenizer.fold))


def tokens(tokenizer: WordSplitter, text: str) -> list[str]:
    """The tokens of ``text`` as decon counts them: :meth:`WordSplitter.tokenize` of its match
    text (equal tokens of a long text one string: :meth:`WordSplitter.tokenize_shared`)."""
    return tokenizer.tokenize_shared(match_text(tokenizer, text))


def prepare(tokenizer: WordSplitter, text: str) -> bytes:
    """:meth:`WordSplitter.prepare` of the match text of ``text`` (the fast path's bytes)."""
    return tokenizer.prepare(match_text(tokenizer, text))


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
    key = match_text(tokenizer, text)
    toks, spans = tokenizer.tokenize_with_offsets(key)
    if key is text or key == text:
        return toks, spans
    pairs = np.array(spans, dtype=np.int64).reshape(-1, 2)
    s, e = to_raw(tokenizer, text, key, pairs[:, 0], pairs[:, 1])
    return toks, list(zip(s.tolist(), e.tolist()))


def to_raw(tokenizer: WordSplitter, text: str, key: str, start: np.ndarray, end: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray]:
    """``[start, end)`` code-point spans of ``key`` (``match_text(tokenizer, text)``) -> spans
    of ``text``: from the raw start of a span's first character to the raw end of its last."""
    mapped, starts, ends = match_offsets(tokenizer, text)
    if mapped != key:  # pragma: no cover - the text and its map are tested equal
        raise ValueError(f"the offset map of a text of {len(text)} characters does not give its match text")
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
    norm = match_text(tokenizer, text)
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
        return to_raw(tokenizer, text, norm, np.asarray(s, dtype=np.int64), np.asarray(e, dtype=np.int64))
    return np.asarray(s, dtype=np.int64), np.asarray(e, dtype=np.int64)


def char_offsets(batch: TokenBatch, pos: np.ndarray, lens: np.ndarray, rows: np.ndarray,
                 pending: Sequence[tuple[int, Any, str]], prepared: list[bytes], normed: list[str],
                 tokenizer: WordSplitter) -> tuple[np.ndarray, np.ndarray]:
    """``[start, end)`` of each window (its first token ``pos``, ``lens`` tokens, in batch row
    ``rows``) as code-point offsets into its row's text: byte offsets, mapped per row where
    those are not code points (non-ASCII text, lowering that changes the length, a text the
    normalization or the fold changed). ``normed``: each row's :func:`match_text`."""
    base = batch.row_base[rows] + 1
    start = batch.starts[pos] - base
    end = batch.ends[pos + lens - 1] - base
    by_row = np.argsort(rows, kind="stable")
    firsts = run_starts(rows[by_row])
    bounds = np.append(firsts, len(rows)).tolist()
    for j, r in enumerate(rows[by_row[firsts]].tolist()):  # rows whose byte offsets are not code points
        raw, text = pending[r][2], normed[r]
        same = text is raw or text == raw  # (match_text hands a clean text back as it is)
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
        if not same:  # offsets into the match text -> into the row's text
            start[at], end[at] = to_raw(tokenizer, raw, text, start[at], end[at])
    return start, end
