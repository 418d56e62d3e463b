"""Seeded fuzz texts for the encoders' exactness checks (tests/test_fast_encoder.py, bench/encoders.py).

:func:`fuzz_texts` draws strings that mix what BPE splitting is sensitive to: special-token
text (ordinary text to ``encode_ordinary``), combining marks (old and recently assigned),
control characters (C0, DEL, C1), whitespace of every kind, digits of several scripts,
astral characters (emoji, CJK extensions, private use, unassigned), contractions in any case,
long runs of one piece, runs of spaces and digits (up to 3,000), and any code point but a
surrogate. ``big=True`` makes one run in a hundred up to 200,000 long and adds, to one string
in 5,000, a 1 MB token (a million letters without a split).
"""
from __future__ import annotations

import random

import numpy as np
import numpy.typing as npt

SPECIALS = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|im_start|>",
            "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|endofprompt|>", "<|constrain|>", "<|call|>",
            "<|endoftext", "|endoftext|>", "<|", "|>", "<|reserved_200010|>"]
WHITESPACE = " \t\n\r\x0b\x0c\x85\xa0\u1680\u2000\u2001\u2007\u200a\u2028\u2029\u202f\u205f\u3000\u200b\ufeff"
DIGITS = "0123456789" + "٠١٢٣٤٥٦٧٨٩" + "०१२३४५६७८९" + "０１２３４５６７８９" + "²³¹¼½⅓Ⅻ"
# (lo, hi) code point ranges to draw from, by kind
MARKS = [(0x300, 0x36F), (0x483, 0x489), (0x591, 0x5C7), (0x64B, 0x65F), (0x900, 0x903), (0x93A, 0x94F),
         (0x1AB0, 0x1AFF), (0x1DC0, 0x1DFF), (0x20D0, 0x20FF), (0xFE20, 0xFE2F), (0x1E000, 0x1E02F)]
CONTROLS = [(0x0, 0x1F), (0x7F, 0x9F)]
ASTRAL = [(0x1F300, 0x1FAFF), (0x1F1E6, 0x1F1FF), (0x20000, 0x2A6DF), (0x2B740, 0x2B81F), (0x30000, 0x323AF),
          (0x323B0, 0x3347F), (0x10000, 0x1FFFF), (0xF0000, 0xF00FF), (0xE0000, 0xE007F), (0x10FF00, 0x10FFFF)]
WORDS = ["the", "The", "THE", "Straße", "naïve", "nai\u0308ve", "x²", "ΔT", "123,456", "don't", "DON'T", "I'll",
         "we'VE", "it's", "You'RE", "'s", "'d", "camelCase", "HTTPServer", "日本語", "한국어", "عربي", "ﷺ", "ǅungla",
         "ᾼ", "e\u0301", "👍🏽", "👨\u200d👩\u200d👧", "🇫🇷", "ℌ", "ⅷ", "_", "--", "...", "http://x.org/a?b=1"]
PIECES = ["a", "ab", "🙂", "日本", "é", "e\u0301", "0", "12", " ", "\n", "\t", " \n", "'s", "ـ", "<|endoftext|>", "ﷺ"]


def _from(rnd: random.Random, ranges: list[tuple[int, int]], assigned: bool = False) -> str:
    """A code point of one of ``ranges`` but a surrogate; ``assigned``: none unassigned in Unicode 14.0."""
    while True:
        lo, hi = rnd.choice(ranges)
        cp = rnd.randint(lo, hi)
        if not 0xD800 <= cp <= 0xDFFF and not (assigned and _unassigned()[cp]):
            return chr(cp)


def _unassigned() -> npt.NDArray[np.bool_]:
    from refinery.transforms.formats.unassigned import table

    return table()


def random_char(rnd: random.Random, assigned: bool = False) -> str:
    """One character: ASCII, whitespace, a digit, a control, a mark, an astral character, or any
    code point but a surrogate (prep rejects text holding one before it is encoded);
    ``assigned``: none unassigned in Unicode 14.0 (what gigatoken encodes itself)."""
    kind = rnd.random()
    if kind < 0.30:
        return chr(rnd.randrange(0x20, 0x7F))
    if kind < 0.40:
        return rnd.choice(WHITESPACE)
    if kind < 0.48:
        return rnd.choice(DIGITS)
    if kind < 0.53:
        return _from(rnd, CONTROLS)
    if kind < 0.63:
        return _from(rnd, MARKS, assigned)
    if kind < 0.73:
        return _from(rnd, ASTRAL, assigned)
    return _from(rnd, [(0x80, 0x3000)] * 3 + [(0, 0x10FFFF)], assigned)


def fuzz_text(rnd: random.Random, big: bool = False, assigned: bool = False) -> str:
    """One fuzz string (see the module doc); ``assigned``: no code point unassigned in Unicode 14.0."""
    parts = []
    for _ in range(rnd.randrange(1, 12)):
        r = rnd.random()
        if r < 0.45:
            parts.append("".join(random_char(rnd, assigned) for _ in range(rnd.randrange(1, 80))))
        elif r < 0.60:
            parts.append(rnd.choice(SPECIALS))
        elif r < 0.72:
            parts.append(rnd.choice(PIECES) * rnd.randrange(1, 400))
        elif r < 0.86:
            parts.append(rnd.choice([" ", "", "\n", "  "]).join(rnd.choice(WORDS) for _ in range(rnd.randrange(1, 30))))
        elif r < 0.93:  # runs of spaces or digits, with something after them
            run = rnd.choice([" ", "\n", " \t", "7", "0123456789", "١"])
            longest = 200_000 if big and rnd.random() < 0.01 else 3_000
            parts.append(run * rnd.randrange(1, longest) + rnd.choice(["x", " y", "\n", "1", ""]))
        else:
            parts.append(rnd.choice(WORDS) + _from(rnd, MARKS, assigned) * rnd.randrange(1, 20))
    if big and rnd.random() < 0.0002:  # a 1 MB token: one split piece of a million letters
        piece = rnd.choice(["a", "ab", "xyzw", None])
        parts.append(piece * (1_000_000 // len(piece)) if piece else
                     "".join(rnd.choices("abcdefghijklmnopqrstuvwxyz", k=1_000_000)))
    return "".join(parts)


def fuzz_texts(seed: int, n: int, big: bool = False, assigned: bool = False) -> list[str]:
    """``n`` fuzz strings from ``seed`` (:func:`fuzz_text`)."""
    rnd = random.Random(seed)
    return [fuzz_text(rnd, big, assigned) for _ in range(n)]


def long_texts(seed: int, words: list[str]) -> list[str]:
    """A few long documents: a 1 MB token (a million letters, one split piece), random
    letters, digits, over 200,000 tokens of words, lines of random characters."""
    rnd = random.Random(seed)
    return [
        "a" * 1_000_000,
        "".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(120_000)),
        "".join(rnd.choice("0123456789") for _ in range(50_000)),
        " ".join(rnd.choice(words) for _ in range(260_000)),
        "\n".join("".join(random_char(rnd) for _ in range(200)) for _ in range(1500)),
    ]
