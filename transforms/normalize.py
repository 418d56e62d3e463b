"""Text normalization applied to every document before tokenization.

NFC; ``\\r\\n`` and ``\\r`` become ``\\n``; Unicode category Cc characters are dropped except
``\\n`` and ``\\t``; leading and trailing whitespace is stripped.
"""
from __future__ import annotations

import sys
import unicodedata

# Every Cc code point (C0, DEL, C1) except \t and \n maps to None. \r is handled first.
_DROP_CC = {cp: None for cp in range(sys.maxunicode + 1)
            if cp < 0x250 and unicodedata.category(chr(cp)) == "Cc" and chr(cp) not in "\t\n"}


def normalize_text(text: str) -> str:
    """The normalized form of a document's text ('' means the document is empty)."""
    if not unicodedata.is_normalized("NFC", text):
        text = unicodedata.normalize("NFC", text)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text.translate(_DROP_CC).strip()
