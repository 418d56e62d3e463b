"""Tokenizers and the n-grams of their tokens (the HELM split, with offsets into the original text)."""
from __future__ import annotations

import re
import string
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Iterable, Iterator

from refinery.transforms.io.text import DEFAULT_MATCH_FOLD, MATCH_FOLDS

DEFAULT_SEPARATORS = rf"\s{re.escape(string.punctuation)}"
WHITESPACE_SEPARATORS = r"\s"


@dataclass(frozen=True)
class WordSplitter:
    """``pattern.split(text.lower() if lowercase else text)``, empty strings kept.

    ``separators`` is the body of a regex character class; a run of such characters
    separates tokens. Tokens therefore never contain a separator and, for every tokenizer
    here, never contain whitespace, so an n-gram string (tokens joined by one space)
    determines its tokens.

    ``fold``: the match key of the text decon splits (``--match-fold``,
    :data:`~refinery.transforms.io.text.MATCH_FOLDS`): :mod:`.normalized` folds a row's
    normalized text with it before splitting, on both sides; the methods here split the text
    they are given.
    """

    name: str
    lowercase: bool
    separators: str
    fold: str = DEFAULT_MATCH_FOLD

    @property
    def pattern(self) -> re.Pattern[str]:
        return _compiled(self.separators)

    def identity(self) -> dict[str, str | bool]:
        return {"name": self.name, "lowercase": self.lowercase, "separators": self.separators, "match_fold": self.fold}

    def tokenize(self, text: str) -> list[str]:
        """The exact tokenizer (reference semantics)."""
        return self.pattern.split(text.lower() if self.lowercase else text)

    def tokenize_shared(self, text: str, piece: int = 1 << 20) -> list[str]:
        """:meth:`tokenize`, equal tokens one string object where ``text`` is over ``piece``
        characters: the lowered text split a piece at a time (each cut after a run of
        separators), each token replaced by the first string equal to it. A 20 MB row's 3
        million tokens of a few thousand words: a list of 28 MB, not 200 MB more of strings."""
        low = text.lower() if self.lowercase else text  # whole: lowering a piece differs (final sigma)
        if len(low) <= piece:
            return self.pattern.split(low)
        seen: dict[str, str] = {}
        out: list[str] = []
        at = 0
        while True:
            cut = self.pattern.search(low, at + piece) if at + piece < len(low) else None
            end = cut.end() if cut else len(low)  # after a whole run: low[at] is never a separator's
            part = self.pattern.split(low[at:end])
            if end < len(low):
                part.pop()  # the empty token after the cut: the next piece starts with the next token
            out.extend([seen.setdefault(t, t) for t in part])
            if end == len(low):
                return out
            at = end

    def tokenize_with_offsets(self, text: str) -> tuple[list[str], list[tuple[int, int]]]:
        """(tokens, spans): tokens equal :meth:`tokenize`; spans index the ORIGINAL text.

        Tokens come from lowering the whole string (as the exact tokenizer does; per-token
        lowering differs for the Greek final sigma), spans are found on the lowered string
        and mapped back through the per-character lowering lengths. An empty token at the
        start/end of the text has the span ``(0, 0)`` / ``(len, len)``.
        """
        low = text.lower() if self.lowercase else text
        tokens: list[str] = []
        spans: list[tuple[int, int]] = []
        pos = 0
        for m in self.pattern.finditer(low):
            s, e = m.span()
            tokens.append(low[pos:s])
            spans.append((pos, s))
            pos = e
        tokens.append(low[pos:])
        spans.append((pos, len(low)))
        if len(low) != len(text):
            spans = _map_spans_to_original(text, low, spans)
        return tokens, spans

    # -- fast path used by the scan (see batch_window_hashes) --------------------------

    @property
    def byte_table(self) -> bytes:
        """bytes.translate table: ASCII separator bytes -> b' ', every other byte unchanged."""
        return _byte_table(self.separators)

    @property
    def nonascii_separators(self) -> re.Pattern[str]:
        """Matches the non-ASCII characters of the separator class (Unicode whitespace)."""
        return _nonascii_separators(self.separators)

    def prepare(self, text: str) -> bytes:
        """UTF-8 bytes of the text as the fast path sees it: lowered (if the tokenizer
        lowers), non-ASCII separators replaced by a space. Splitting these bytes on runs of
        ASCII separator bytes gives exactly the UTF-8 encodings of :meth:`tokenize`."""
        low = text.lower() if self.lowercase else text
        if low.isascii():
            return low.encode("ascii")
        low = self.nonascii_separators.sub(" ", low)
        return low.encode("utf-8", "surrogatepass")


@lru_cache(maxsize=None)
def _compiled(separators: str) -> re.Pattern[str]:
    return re.compile(rf"[{separators}]+")


@lru_cache(maxsize=None)
def _byte_table(separators: str) -> bytes:
    one = re.compile(rf"[{separators}]")
    return bytes(0x20 if (b < 128 and one.match(chr(b))) else b for b in range(256))


@lru_cache(maxsize=None)
def _nonascii_separators(separators: str) -> re.Pattern[str]:
    one = re.compile(rf"[{separators}]")
    # Non-ASCII members of \s are the characters for which str.isspace() is true; the
    # punctuation part of the class is ASCII. Each candidate is confirmed with the class.
    # (every Unicode whitespace character is below U+3100; a test checks the whole range)
    chars = [chr(c) for c in range(128, 0x3100) if chr(c).isspace() and one.match(chr(c))]
    if not chars:
        return re.compile(r"(?!x)x")
    return re.compile("[" + "".join(re.escape(c) for c in chars) + "]")


def _map_spans_to_original(text: str, low: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Map [start, end) spans of ``low`` (= text.lower()) back to ``text``.

    ``str.lower()`` is per character except for the final sigma, which keeps the length, so
    character i of ``text`` becomes ``len(text[i].lower())`` characters of ``low``.
    """
    orig_of: list[int] = []
    for i, c in enumerate(text):
        orig_of.extend([i] * len(c.lower()))
    if len(orig_of) != len(low):  # pragma: no cover - would mean a new Unicode lowering rule
        raise ValueError("cannot align lowered text with the original")
    orig_of.append(len(text))
    out = []
    for s, e in spans:
        start = orig_of[s]
        end = orig_of[e - 1] + 1 if e > s else start
        out.append((start, end))
    return out


TOKENIZERS: dict[str, WordSplitter] = {
    "default": WordSplitter("default", True, DEFAULT_SEPARATORS),
    "no_lowercase": WordSplitter("no_lowercase", False, DEFAULT_SEPARATORS),
    "whitespace": WordSplitter("whitespace", True, WHITESPACE_SEPARATORS),
}


def get_tokenizer(name: str, fold: str = DEFAULT_MATCH_FOLD) -> WordSplitter:
    """The tokenizer ``name`` (:data:`TOKENIZERS`) matching under ``fold`` (:data:`MATCH_FOLDS`)."""
    try:
        tokenizer = TOKENIZERS[name]
    except KeyError:
        raise ValueError(f"unknown tokenizer {name!r}; choose one of {', '.join(TOKENIZERS)}") from None
    if fold not in MATCH_FOLDS:
        raise ValueError(f"unknown match fold {fold!r}; choose one of {', '.join(MATCH_FOLDS)}")
    return tokenizer if fold == tokenizer.fold else replace(tokenizer, fold=fold)


def default_tokenize(text: str) -> list[str]:
    """HELM's DefaultTokenizer, verbatim semantics."""
    return TOKENIZERS["default"].tokenize(text)


# ---------------------------------------------------------------------------------------
# N-grams
# ---------------------------------------------------------------------------------------

def effective_lengths(ns: Iterable[int], num_tokens: int) -> dict[int, list[int]]:
    """Effective length L -> the configured n that map to it (``L = min(n, num_tokens)``)."""
    out: dict[int, list[int]] = {}
    for n in sorted(set(ns)):
        out.setdefault(min(n, num_tokens), []).append(n)
    return out


def configured_ns(ns: list[int], num_tokens: int, length: int) -> list[int]:
    """The configured n whose effective length for a row of ``num_tokens`` tokens is ``length``."""
    return [n for n in ns if min(n, num_tokens) == length]


def iter_ngrams(tokens: list[str], length: int) -> Iterator[tuple[int, str]]:
    """(token position, n-gram string) for every window of ``length`` tokens, skipping
    windows whose tokens are all empty strings."""
    for i in range(len(tokens) - length + 1):
        window = tokens[i:i + length]
        if any(window):
            yield i, " ".join(window)


def eval_ngrams(tokens: list[str], spans: list[tuple[int, int]], ns: Iterable[int]
                ) -> dict[tuple[int, str], list[tuple[int, int]]]:
    """(effective length, n-gram) -> [(start, end) char offsets of each occurrence] for one
    eval row. A row shorter than n contributes its one ``min(n, len)``-gram. Empty when the
    row has only empty tokens (an empty or punctuation-only row)."""
    out: dict[tuple[int, str], list[tuple[int, int]]] = {}
    for length in effective_lengths(ns, len(tokens)):
        for i, gram in iter_ngrams(tokens, length):
            out.setdefault((length, gram), []).append((spans[i][0], spans[i + length - 1][1]))
    return out
