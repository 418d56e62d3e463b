"""Text normalization applied to every document before tokenization.

NFC; ``\\r\\n`` and ``\\r`` become ``\\n``; Unicode category Cc characters are dropped except
``\\n`` and ``\\t``; leading and trailing whitespace is stripped.
"""
from __future__ import annotations

import re
import unicodedata

# Every Cc code point (C0, DEL, C1) except \t and \n maps to None. \r is handled first.
_DROP_CC = {cp: None for cp in range(0xA0)  # every Cc code point lies below U+00A0
            if unicodedata.category(chr(cp)) == "Cc" and chr(cp) not in "\t\n"}


_ASCII_TO_FIX = re.compile("[\x00-\x08\x0b-\x1f\x7f]")  # ASCII Cc except \t \n, and \r


def normalize_text(text: str) -> str:
    """The normalized form of a document's text ('' means the document is empty)."""
    if text.isascii():  # the common case: ASCII is already NFC and has no C1 controls
        if _ASCII_TO_FIX.search(text) is None:
            return text.strip()
    elif not unicodedata.is_normalized("NFC", text):
        text = unicodedata.normalize("NFC", text)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text.translate(_DROP_CC).strip()
