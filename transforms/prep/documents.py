"""prep's per-element code: the element types and the one normalize, tokenize and shard rule.

Both ways of running prep call these functions: the public PTransforms
(:mod:`refinery.transforms.prep.beam`: ``Normalize | Tokenize | AssignShard |
WriteTokenShards``) and the CLI's resumable ``tokenize`` stage
(:mod:`refinery.transforms.prep.stages`).

Element types (plain ``NamedTuple``s; deterministic Beam coders in ``prep.beam``):

- :class:`~refinery.transforms.io.rows.SourceRow` ``(path, row, record, relpath)``: a row
  with its provenance, as :func:`refinery.transforms.io.rows.iter_rows` reads it (defined
  there: decon reads such rows too).
- :class:`Document` ``(doc_id, text, source, row)``: a normalized, non-empty document.
  ``(source, row)`` is its **order key**: inside a shard, documents are ordered by
  ``(source, row, doc_id)``.
- :class:`TokenizedDocument` ``(doc_id, tokens, source, row)``: ``tokens`` is an
  ``array('I')`` (uint32; the shards hold uint16 when the tokenizer's ids fit) ending in
  exactly one EOS.
- :class:`Rejected` ``(path, row, reason, doc_id)``: a row that produced no document, with
  the reason; :data:`EMPTY` is the reason of a document that normalized to nothing.

Rules:

- **Text** (:func:`extract_text`): ``record[text_field]``, or a text template over several
  fields, chat message lists flattened (:class:`refinery.transforms.io.text.TextSpec`);
  it must be a string without unpaired surrogates.
- **Normalize** (:func:`normalize_text`, defined in :mod:`refinery.transforms.io.text`:
  decon n-grams the same text), in this order: ``\\r\\n`` and ``\\r`` become ``\\n``; Unicode
  Cc characters are dropped except ``\\n`` and ``\\t``; NFC; leading/trailing whitespace stripped.
- **Document id** (:func:`doc_id_for`): ``str(record[id_field])`` when present and not None;
  else ``"{relpath}:{row}"`` when the row's file is known; else :func:`content_id`, a hash
  of the row's canonical JSON.
- **Tokenize** (:func:`encode_document`): the tokenizer's ordinary encoding (special-token
  text stays ordinary text; o200k_harmony ``encode_ordinary`` by default, see
  :mod:`refinery.transforms.formats.tokenizer_choice`), then one EOS, the tokenizer's. Many
  documents at once (:func:`encode_documents`, :func:`encode_by_shard`): the same tokens,
  encoded in one call and handed back as one uint32 buffer with the documents' lengths.
- **Shard** (:func:`shard_of`): ``int(md5(doc_id).hexdigest()[:16], 16) % num_shards``: it
  depends on nothing but the id, never on workers or input splits.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import re
import unicodedata
from array import array
from typing import Any, Callable, NamedTuple, Protocol, Sequence, cast

import numpy as np
import tiktoken

from refinery.transforms.formats import unassigned
from refinery.transforms.formats.row_ids import content_id, doc_id_for  # noqa: F401  # THE row id rule, re-exported
from refinery.transforms.formats.tokenizer_choice import PrepTokenizer, wrap_encoding
from refinery.transforms.io.text import _ASCII_CLEAN, _CC_TO_DROP, TextSpec, normalize_text

EMPTY = "empty after normalization"


class _Digest(Protocol):
    def digest(self) -> bytes: ...


_md5: Callable[[bytes], _Digest]
try:  # CPython's own MD5: half the cost of OpenSSL's per short id (no EVP context), the same digest
    _md5 = importlib.import_module("_md5").md5  # (CPython's private module: no stub)
except ImportError:  # an interpreter built without it
    _md5 = hashlib.md5
_SURROGATE = re.compile("[\ud800-\udfff]")


class Document(NamedTuple):
    doc_id: str
    text: str
    source: str = ""
    row: int = 0


class TokenizedDocument(NamedTuple):
    doc_id: str
    tokens: array[int]  # array('I'): uint32 token ids, the last one EOS
    source: str = ""
    row: int = 0


class Rejected(NamedTuple):
    path: str
    row: int
    reason: str
    doc_id: str = ""

    @property
    def empty(self) -> bool:
        """A document that normalized to nothing: counted as ``empty``, not as a reject."""
        return self.reason == EMPTY

    def to_json(self) -> dict[str, str | int]:
        """The line ``rejects/rejects.jsonl`` holds for it (path, row, reason)."""
        return {"path": self.path, "row": self.row, "reason": self.reason}


# ---------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------

def extract_text(record: object, text_field: str | TextSpec) -> tuple[str | None, str | None]:
    """(text, None) or (None, reason) for a parsed record; ``text_field``: a field name or a
    :class:`TextSpec` (a template, chat rows: :mod:`refinery.transforms.io.text`)."""
    text, error = TextSpec.of(text_field).extract(record)
    if error is not None or text is None:  # a text, or else the reason there is none
        return None, error
    if not text.isascii() and _SURROGATE.search(text):
        return None, "text holds unpaired surrogates (not valid Unicode)"
    return text, None


# normalize_text, _CC_TO_DROP and _ASCII_CLEAN live in core.text: decon n-grams the same text
# what makes a non-ASCII text more than an NFC and a strip away from normalized (or a reject)
_SURROGATE_OR_CC = re.compile(_SURROGATE.pattern[:-1] + _CC_TO_DROP.pattern[1:])


_LOOK, _NFC, _UNASSIGNED = 1, 2, 4  # bits of _unit_flags


@functools.lru_cache(maxsize=1)
def _unit_flags() -> np.ndarray:
    """uint8[0x10000], a UTF-16 code unit's flags: ``_LOOK`` for a surrogate (half of an astral
    character, or a lone one) or a Cc character but ``\t`` ``\n``: the text needs the exact
    scan; ``_NFC`` for a character that is not NFC by itself (NFC_Quick_Check No), has a
    combining class other than 0, or may compose with the character before it (the second
    character of a canonical decomposition pair, a Hangul vowel or trailing consonant: Quick_Check
    Maybe). A text with none of these flags is NFC (UAX #15's quick check) with nothing to drop.
    Built from this interpreter's ``unicodedata``, the tables ``is_normalized`` itself uses.
    ``_UNASSIGNED``: a code point unassigned in Unicode 14.0 (fixed data,
    :mod:`~refinery.transforms.formats.unassigned`: such a document goes to tiktoken)."""
    flags = np.zeros(0x10000, np.uint8)
    flags[unassigned.table()[:0x10000]] |= _UNASSIGNED
    flags[0xD800:0xE000] = _LOOK
    for cp in range(0xA0):
        if _CC_TO_DROP.match(chr(cp)):
            flags[cp] |= _LOOK
    combining, decomposition = unicodedata.combining, unicodedata.decomposition
    for cp in [*range(0xD800), *range(0xE000, 0x10000)]:
        c = chr(cp)
        if combining(c):
            flags[cp] |= _NFC
        canonical = decomposition(c)
        if canonical and canonical[0] != "<":  # (a character without one is NFC by itself)
            if unicodedata.normalize("NFC", c) != c:
                flags[cp] |= _NFC
            parts = canonical.split()
            if len(parts) == 2 and int(parts[1], 16) < 0x10000:
                flags[int(parts[1], 16)] |= _NFC
    flags[0x1160:0x1200] |= _NFC  # Hangul jungseong and jongseong: compose with a syllable before them
    return flags


# ---------------------------------------------------------------------------------------
# Ids and shards
# ---------------------------------------------------------------------------------------

def order_key(doc: Document | TokenizedDocument) -> tuple[str, int, str]:
    """THE order of the documents inside a shard: (source file, row in it, doc id). The
    command's pack writes a shard's documents in this order (its plan lists the inputs sorted
    by path, a file's byte-range units by offset, and a unit spills its rows in order); the
    ``WriteTokenShards`` sink sorts by it. So both write the same bytes for the same rows
    (``tests/test_one_shard_writer.py``)."""
    return (doc.source, doc.row, doc.doc_id)


def shard_of(doc_id: str, num_shards: int) -> int:
    """The md5 rule: the first 8 bytes of md5(doc_id as UTF-8), big-endian, modulo num_shards."""
    return int.from_bytes(_md5(doc_id.encode("utf-8", "surrogatepass")).digest()[:8], "big") % num_shards


def shards_of(doc_ids: Sequence[str], num_shards: int) -> np.ndarray:
    """:func:`shard_of` of each id (uint32): the digests in one loop, their first 8 bytes
    read as big-endian uint64 and taken modulo ``num_shards`` by numpy."""
    md5 = _md5
    digests = b"".join([md5(i.encode("utf-8", "surrogatepass")).digest() for i in doc_ids])
    heads = np.frombuffer(digests, ">u8")[::2]  # each digest's first 8 of its 16 bytes
    return (heads % np.uint64(num_shards)).astype(np.uint32)


# ---------------------------------------------------------------------------------------
# One row -> one document
# ---------------------------------------------------------------------------------------

def normalize_row(record: dict[str, Any] | None, error: str | None, text_field: str | TextSpec, id_field: str,
                  path: str = "", row: int = 0, relpath: str | None = None) -> Document | Rejected:
    """THE normalize step: a read row (``error`` set when it could not be parsed) -> a
    :class:`Document`, or a :class:`Rejected` (reason :data:`EMPTY` for an empty document).
    ``text_field``: a field name or a :class:`TextSpec` (pass a spec in a loop: made once)."""
    if error is None:
        text, error = extract_text(record, text_field)
    if error is not None:
        return Rejected(path, row, error)
    assert isinstance(record, dict) and text is not None  # extract_text gives a text only of a JSON object
    doc_id = doc_id_for(record, id_field, relpath, row)
    text = normalize_text(text)
    if not text:
        return Rejected(path, row, EMPTY, doc_id)
    return Document(doc_id, text, path, row)


class RowNormalizer(Protocol):
    """What :func:`row_normalizer` returns: :func:`normalize_row` of ``(record, error, path, row,
    relpath)``, and ``plain``, set by each call."""

    plain: bool

    def __call__(self, record: dict[str, Any] | None, error: str | None, path: str, row: int,
                 relpath: str | None) -> Document | Rejected: ...


def row_normalizer(text_field: str | TextSpec, id_field: str) -> RowNormalizer:
    """:func:`normalize_row` for one text field or template and id field, as a function of
    ``(record, error, path, row, relpath)``, for a loop over many rows: a row whose text is a
    clean ASCII string (nothing to normalize but the ends) takes a short path, the same rule
    (tests compare it with :func:`normalize_row`), and so does one of other Unicode without
    surrogates or control characters but ``\\t`` and ``\\n`` (NFC and a strip); any other row goes through
    :func:`normalize_row` itself. After each call, ``normalize.plain`` is True when the
    document's text is known to hold no code point unassigned in Unicode 14.0 (ASCII, or no
    UTF-16 unit flagged so: the same lookup), which an encoder may then skip checking
    (:func:`encode_documents`); False when not known."""
    spec = TextSpec.of(text_field)
    field = spec.field if spec.template is None else None

    def normalize(record: dict[str, Any] | None, error: str | None, path: str, row: int,
                  relpath: str | None) -> Document | Rejected:
        normalizer.plain = False
        if field is not None and error is None and type(record) is dict:
            text = record.get(field)
            if type(text) is str:
                if text.isascii():
                    clean = plain = not text.encode("ascii").translate(None, _ASCII_CLEAN)
                else:  # one table lookup a UTF-16 unit says what needs a closer look (see _unit_flags)
                    units = np.frombuffer(text.encode("utf-16-le", "surrogatepass"), "<u2")
                    flags = int(np.bitwise_or.reduce(_unit_flags()[units]))
                    plain = not flags & (_LOOK | _UNASSIGNED)
                    # no surrogate, no Cc but \t \n (NFC neither makes nor removes them)
                    clean = plain or _SURROGATE_OR_CC.search(text) is None
                    if clean and flags & (_LOOK | _NFC) and not unicodedata.is_normalized("NFC", text):
                        text = unicodedata.normalize("NFC", text)
                if clean:
                    text = text.strip()
                    if text:
                        value = record.get(id_field)
                        doc_id = str(value) if value is not None else doc_id_for(record, id_field, relpath, row)
                        normalizer.plain = plain
                        return Document(doc_id, text, path, row)
        return normalize_row(record, error, spec, id_field, path, row, relpath)

    normalizer = cast(RowNormalizer, normalize)  # the function, with its attribute `plain`
    normalizer.plain = False
    return normalizer


def encode_document(tok: PrepTokenizer | tiktoken.Encoding, text: str) -> array[int]:
    """Tokens of a normalized document (uint32): the tokenizer's ordinary encoding
    (special-token text stays ordinary text) followed by exactly one EOS, the tokenizer's.
    ``tok``: a :class:`~refinery.transforms.formats.tokenizer_choice.PrepTokenizer`, or a tiktoken
    ``Encoding`` (its ``<|endoftext|>`` is the EOS)."""
    if not isinstance(tok, PrepTokenizer):
        tok = wrap_encoding(tok)
    out = tok.encode(text)
    out.append(tok.eos_id)
    return out


def tokenize_document(tok: PrepTokenizer, doc: Document) -> TokenizedDocument:
    """THE tokenize step."""
    return TokenizedDocument(doc.doc_id, encode_document(tok, doc.text), doc.source, doc.row)


# ---------------------------------------------------------------------------------------
# Many documents at once: the same tokens, as buffers
# ---------------------------------------------------------------------------------------

# Documents are encoded in batches of about this many characters (or at most this many
# documents), one encoder call each: a tokenize unit's, and the Tokenize transform's in a bundle
BATCH_CHARS = 1 << 20
BATCH_DOCS = 1 << 14

def encode_documents(tok: PrepTokenizer, texts: Sequence[str],
                     plain: Sequence[bool] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, lengths) of normalized documents: every document's tokens followed by one EOS
    (what :func:`encode_document` gives each), back to back as one uint32 array, and each
    document's uint32 length, EOS included. The tokenizer encodes them in one batch
    (``encode_flat``); the EOS is put in by numpy, with no Python object per document.
    ``plain``: per text, True when it is known to hold no code point unassigned in Unicode
    14.0 (``row_normalizer``'s ``plain``), so the encoder need not look."""
    if not isinstance(tok, PrepTokenizer):
        tok = wrap_encoding(tok)
    flat, offsets = tok.encode_flat(texts, plain)
    tokens = np.insert(np.asarray(flat, np.uint32), offsets[1:], np.uint32(tok.eos_id))
    lengths = np.diff(offsets).astype(np.uint32)
    lengths += 1
    return tokens, lengths


def encode_by_shard(tok: PrepTokenizer, texts: Sequence[str], shards: np.ndarray,
                    plain: Sequence[bool] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(order, tokens, lengths): documents encoded grouped by shard, as a unit's spill wants
    them. ``order``: the stable argsort of ``shards`` (a document's position in ``texts`` for
    each position in the result: shards ascending, each shard's documents in input order);
    ``tokens``, ``lengths``: :func:`encode_documents` of the texts in that order, so each
    shard's tokens are one contiguous slice. ``plain``: as :func:`encode_documents`'s."""
    order = np.argsort(shards, kind="stable")
    positions = order.tolist()
    tokens, lengths = encode_documents(tok, [texts[i] for i in positions],
                                       None if plain is None else [plain[i] for i in positions])
    return order, tokens, lengths


def tokenize_documents(tok: PrepTokenizer, docs: Sequence[Document]) -> list[TokenizedDocument]:
    """:func:`tokenize_document` of each document, encoded in one batch (:func:`encode_documents`)."""
    tokens, lengths = encode_documents(tok, [d.text for d in docs])
    out, lo = [], 0
    view = tokens.data.cast("B")  # native uint32, as array('I') holds them
    for doc, n in zip(docs, lengths.tolist()):
        a = array("I")
        a.frombytes(view[4 * lo:4 * (lo + n)])
        out.append(TokenizedDocument(doc.doc_id, a, doc.source, doc.row))
        lo += n
    return out
