"""Train/test n-gram overlap ("decon"), the HELM data-overlap method with full provenance.

Pure functions only; the Beam wiring lives in :mod:`refinery.transforms.decon.stages`.

Method (HELM): index the n-grams of the TEST (eval) side, stream the TRAINING side and look
up each of its n-grams; an eval instance overlaps at n when it shares at least one n-gram.
See ``docs/DECON.md`` for the exact facts this module implements.

Pieces, in the order the pipeline uses them:

- Tokenizers (:data:`TOKENIZERS`): ``default`` is exactly
  ``re.compile(rf"[\\s{re.escape(string.punctuation)}]+").split(text.lower())`` with empty
  strings kept; ``no_lowercase`` is the same split without ``lower()``; ``whitespace``
  lowercases and splits on runs of ``\\s`` only. :meth:`Tokenizer.tokenize_with_offsets`
  returns the same tokens plus ``[start, end)`` code-point offsets into the ORIGINAL text
  (``str.lower()`` can change length: ``'İ'.lower()`` has 2 characters).
- N-grams (:func:`eval_ngrams`): tokens joined by one space; an eval row with fewer than n
  tokens contributes its one ``min(n, len)``-gram (the *effective* length); n-grams whose
  tokens are all empty strings are skipped.
- Names and ids: :func:`eval_dataset_name`, :func:`record_id` (``str(record[id])`` or the
  blake2b-of-msgpack hash of the recursively key-sorted record).
- Hashes: :func:`token_hash` and :func:`ngram_hash` are stable 64-bit hashes (polynomial
  over UTF-8 bytes, then over token hashes, each followed by a 64-bit finalizer). They are
  defined so that :func:`batch_window_hashes` computes the very same values for all windows
  of a batch of training rows with a handful of numpy operations (no Python object per
  token). ``partition = ngram_hash(n, ngram) % P``.
- :class:`Membership`: the compact structure the scan probes: the sorted unique uint64
  n-gram hashes (8 bytes per test n-gram on disk) plus a packed bitmap built at load time
  (at most 8 bytes more per n-gram) that rejects most misses with one gather. Hash hits are
  then verified against the exact n-gram text in the hash partition's detail records, so
  there are no false positives.
- :func:`scan_rows`: the training-side join (batching, probing, verification, offsets),
  giving :class:`ScanHits`; :func:`hit_blocks` groups them by hash partition, each
  (training row, n-gram) with its doc id and a snippet of the training text.
- :func:`reduce_partition`: one hash partition's hits joined with its eval records (detail
  records, training document counts for ``max_train_count``, by-path sets, report samples);
  its detail records are streamed, one per distinct eval text (:func:`same_text`), at most
  ``max_ngram_details`` per n-gram, n-grams and snippets cut at 1,000 characters;
  :func:`merge_partitions`: the stats and HELM metrics (binary, jaccard, token; jaccard and
  token also weighted by 1/train count) of the whole run; :func:`render_report` (markdown)
  and :func:`contamination_report` (what ``report.html`` shows).
- :func:`reference_overlap`: a straightforward pure-Python implementation of the same
  method (dict of test n-grams, stream training) used by tests and ``bench/decon.py``.
"""
from __future__ import annotations

import contextlib
import gc
import gzip
import hashlib
import io as _pyio
import json
import math
import os
import re
import string
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import repeat
from operator import itemgetter
from typing import Callable, Iterable, Iterator

import msgpack
import numpy as np

from refinery.transforms.decon import report_html as rh

# ---------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------

DEFAULT_SEPARATORS = rf"\s{re.escape(string.punctuation)}"
WHITESPACE_SEPARATORS = r"\s"


@dataclass(frozen=True)
class Tokenizer:
    """``pattern.split(text.lower() if lowercase else text)``, empty strings kept.

    ``separators`` is the body of a regex character class; a run of such characters
    separates tokens. Tokens therefore never contain a separator and, for every tokenizer
    here, never contain whitespace, so an n-gram string (tokens joined by one space)
    determines its tokens.
    """

    name: str
    lowercase: bool
    separators: str

    @property
    def pattern(self) -> re.Pattern:
        return _compiled(self.separators)

    def identity(self) -> dict:
        return {"name": self.name, "lowercase": self.lowercase, "separators": self.separators}

    def tokenize(self, text: str) -> list[str]:
        """The exact tokenizer (reference semantics)."""
        return self.pattern.split(text.lower() if self.lowercase else text)

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
    def nonascii_separators(self) -> re.Pattern:
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
def _compiled(separators: str) -> re.Pattern:
    return re.compile(rf"[{separators}]+")


@lru_cache(maxsize=None)
def _byte_table(separators: str) -> bytes:
    one = re.compile(rf"[{separators}]")
    return bytes(0x20 if (b < 128 and one.match(chr(b))) else b for b in range(256))


@lru_cache(maxsize=None)
def _nonascii_separators(separators: str) -> re.Pattern:
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


TOKENIZERS: dict[str, Tokenizer] = {
    "default": Tokenizer("default", True, DEFAULT_SEPARATORS),
    "no_lowercase": Tokenizer("no_lowercase", False, DEFAULT_SEPARATORS),
    "whitespace": Tokenizer("whitespace", True, WHITESPACE_SEPARATORS),
}


def get_tokenizer(name: str) -> Tokenizer:
    try:
        return TOKENIZERS[name]
    except KeyError:
        raise ValueError(f"unknown tokenizer {name!r}; choose one of {', '.join(TOKENIZERS)}") from None


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


# ---------------------------------------------------------------------------------------
# Names and ids
# ---------------------------------------------------------------------------------------

_DATA_FILE_RE = re.compile(r"\.(jsonl|json|parquet)(\.gz|\.zst)?$")
_HEX_SUFFIX_RE = re.compile(r"-[0-9a-f]{6}$")


def eval_dataset_name(path: str) -> str:
    """``decontamination/gsm8k-dolma-3fa9c1/test.jsonl`` -> ``gsm8k``.

    Basename; for a data file (``.jsonl``/``.json``/``.parquet``, optionally ``.gz``/``.zst``)
    its parent folder's name instead; strip ``-`` + 6 lowercase hex chars; strip ``-dolma``.
    """
    parts = [p for p in path.rstrip("/").split("/") if p]
    name = parts[-1] if parts else path
    if _DATA_FILE_RE.search(name) and len(parts) >= 2:
        name = parts[-2]
    name = _HEX_SUFFIX_RE.sub("", name)
    if name.endswith("-dolma"):
        name = name[: -len("-dolma")]
    return name


_NESTED = (dict, list, tuple)


def sort_keys_recursive(obj):
    if isinstance(obj, dict):
        return {k: sort_keys_recursive(v) if isinstance(v, _NESTED) else v for k, v in sorted(obj.items())}
    if isinstance(obj, (list, tuple)):
        return [sort_keys_recursive(v) for v in obj]
    return obj


_ID_PACKERS = threading.local()  # one msgpack Packer per thread: packb builds a new one per call


def record_hash_id(record: dict) -> str:
    """blake2b-64 (decimal) of the msgpack of the recursively key-sorted record. Values msgpack
    cannot encode (a parquet timestamp or decimal) are hashed as their ``str()``."""
    packer = getattr(_ID_PACKERS, "packer", None)
    if packer is None:
        packer = _ID_PACKERS.packer = msgpack.Packer(use_bin_type=True, unicode_errors="surrogatepass", default=str)
    packed = packer.pack(sort_keys_recursive(record))
    return str(int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "big"))


def record_id(record: dict, id_field: str = "id") -> str:
    """``str(record[id_field])`` when present and not None, else :func:`record_hash_id` of
    the whole record as read (every field, ``"id": null`` included)."""
    value = record.get(id_field)
    if value is not None:
        return str(value)
    return record_hash_id(record)


# ---------------------------------------------------------------------------------------
# Stable hashes (pure-Python definitions; numpy twins below compute the same values)
# ---------------------------------------------------------------------------------------

MASK64 = (1 << 64) - 1
_M_BYTE = 0x100000001B3            # odd: invertible mod 2**64
_M_TOKEN = 0x9E3779B97F4A7C15      # odd
_C_LEN = 0xC2B2AE3D27D4EB4F
_C_NGRAM = 0x165667B19E3779F9
_F1 = 0xFF51AFD7ED558CCD
_F2 = 0xC4CEB9FE1A85EC53


def mix64(z: int) -> int:
    z ^= z >> 33
    z = (z * _F1) & MASK64
    z ^= z >> 33
    z = (z * _F2) & MASK64
    z ^= z >> 33
    return z


LONG_TOKEN_BYTES = 64


@lru_cache(maxsize=1 << 20)
def token_hash(token: str) -> int:
    """Stable 64-bit hash of a token's UTF-8 bytes.

    Up to 64 bytes: the bytes are read as little-endian 8-byte words w_0..w_k (the last one
    zero-padded) and ``h = (...(w_0 * M + w_1) * M + ...) + w_k`` (mod 2**64); longer tokens:
    ``h = blake2b(bytes, digest_size=8)`` (big-endian). Then ``mix64(h + len * C)``.
    """
    data = token.encode("utf-8", "surrogatepass")
    if len(data) > LONG_TOKEN_BYTES:
        h = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")
    else:
        h = 0
        for c in range(0, len(data), 8):
            h = (h * _M_BYTE + int.from_bytes(data[c:c + 8], "little")) & MASK64
    return mix64((h + len(data) * _C_LEN) & MASK64)


def ngram_hash(n: int, ngram: str) -> int:
    """Stable 64-bit hash of (n, n-gram): mix64(sum_j token_hash_j * M'^j + n * C')."""
    tokens = ngram.split(" ")
    if len(tokens) != n:
        raise ValueError(f"n-gram {ngram!r} does not have {n} tokens")
    h, p = 0, 1
    for tok in tokens:
        h = (h + token_hash(tok) * p) & MASK64
        p = (p * _M_TOKEN) & MASK64
    return mix64((h + n * _C_NGRAM) & MASK64)


def partition_of(n: int, ngram: str, partitions: int) -> int:
    return ngram_hash(n, ngram) % partitions


# ---------------------------------------------------------------------------------------
# Vectorized twins
# ---------------------------------------------------------------------------------------

_U = np.uint64


def _mix64_np(z: np.ndarray) -> np.ndarray:
    z = z ^ (z >> _U(33))
    z *= _U(_F1)
    z ^= z >> _U(33)
    z *= _U(_F2)
    z ^= z >> _U(33)
    return z


class _Powers:
    """Cached arrays of M^k and M^-k mod 2**64, grown on demand."""

    def __init__(self, m: int):
        self.m = m
        self.minv = pow(m, -1, 1 << 64)
        self.fwd = np.ones(0, dtype=np.uint64)
        self.inv = np.ones(0, dtype=np.uint64)

    def get(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self.fwd) < size:
            k = max(size, 2 * len(self.fwd), 1 << 16)
            fwd = np.full(k, _U(self.m), dtype=np.uint64)
            fwd[0] = 1
            inv = np.full(k, _U(self.minv), dtype=np.uint64)
            inv[0] = 1
            self.fwd = np.multiply.accumulate(fwd)
            self.inv = np.multiply.accumulate(inv)
        return self.fwd[:size], self.inv[:size]


_TOKEN_POWERS = _Powers(_M_TOKEN)


@dataclass
class TokenBatch:
    """Tokens of a batch of rows, as byte spans of one buffer (see :func:`tokenize_batch`)."""

    buf: bytes                 # translated buffer: separators are b' '
    starts: np.ndarray         # int64 [T]: token start in buf
    ends: np.ndarray           # int64 [T]: token end in buf
    row_of: np.ndarray         # int64 [T]: row (0-based in the batch) of each token
    row_first: np.ndarray      # int64 [R + 1]: index of each row's first token; [R] = T
    row_base: np.ndarray       # int64 [R]: offset of each row's first byte in buf
    hashes: np.ndarray         # uint64 [T]: token_hash of each token

    def token_bytes(self, k: int) -> bytes:
        return self.buf[self.starts[k]:self.ends[k]]


def tokenize_batch(prepared: list[bytes], table: bytes) -> TokenBatch:
    """Tokenize many rows at once (rows as :meth:`Tokenizer.prepare` returns them).

    The buffer is ``\\0 row0 \\0 ␠ \\0 row1 \\0 ...`` translated with ``table``. A token is a
    maximal run of non-space bytes; the marker bytes at each row's ends (found by position,
    not by value) are not part of tokens, which reproduces the empty tokens that
    ``re.split`` yields at the ends of a row.
    """
    lens = np.fromiter((len(p) for p in prepared), dtype=np.int64, count=len(prepared))
    buf = (b"\0" + b"\0 \0".join(prepared) + b"\0").translate(table)
    row_base = np.zeros(len(prepared), dtype=np.int64)
    if len(prepared) > 1:
        row_base[1:] = np.cumsum(lens[:-1] + 3)
    arr = np.frombuffer(buf, dtype=np.uint8)
    nonsp = np.zeros(len(arr) + 2, dtype=np.bool_)
    np.not_equal(arr, 0x20, out=nonsp[1:-1])
    edges = np.flatnonzero(nonsp[1:] != nonsp[:-1])  # run boundaries alternate: start, end, start, ...
    starts = edges[0::2].copy()
    ends = edges[1::2].copy()
    # Each row's first token starts at its start marker (non-space, after a space or the
    # buffer start) and its last token ends right after its end marker.
    row_first = np.empty(len(prepared) + 1, dtype=np.int64)
    row_first[:-1] = np.searchsorted(starts, row_base)
    row_first[-1] = len(starts)
    row_of = np.repeat(np.arange(len(prepared), dtype=np.int64), np.diff(row_first))
    starts[row_first[:-1]] += 1                                  # drop the row-start marker
    ends[row_first[1:] - 1] -= 1                                 # drop the row-end marker
    hashes = _token_hashes(buf, starts, ends)
    return TokenBatch(buf, starts, ends, row_of, row_first, row_base, hashes)


_WORD_MASKS = np.array([(1 << (8 * k)) - 1 for k in range(9)], dtype=np.uint64)


def _token_hashes(buf: bytes, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Vectorized :func:`token_hash` of ``buf[starts[k]:ends[k]]`` for every k."""
    padded = buf + b"\0" * (LONG_TOKEN_BYTES + 8)
    # words[i] = the 8 bytes at buf[i:i+8] as a little-endian uint64 (an overlapping view)
    words = np.ndarray(shape=(len(buf),), dtype="<u8", buffer=padded, offset=0, strides=(1,))
    lens = ends - starts
    h = words[starts] & _WORD_MASKS[np.minimum(lens, 8)]
    active = np.flatnonzero(lens > 8)
    for c in range(8, LONG_TOKEN_BYTES, 8):
        active = active[lens[active] > c]
        if not len(active):
            break
        w = words[starts[active] + c] & _WORD_MASKS[np.minimum(lens[active] - c, 8)]
        h[active] = h[active] * _U(_M_BYTE) + w
    for k in np.flatnonzero(lens > LONG_TOKEN_BYTES).tolist():
        h[k] = int.from_bytes(hashlib.blake2b(buf[starts[k]:ends[k]], digest_size=8).digest(), "big")
    h += lens.astype(np.uint64) * _U(_C_LEN)
    return _mix64_np(h)


def batch_prefix(batch: TokenBatch) -> np.ndarray:
    """prefix[k] = sum_{m<k} token_hash_m * M'^m (mod 2**64), shared by all window lengths."""
    t = len(batch.hashes)
    fwd, _ = _TOKEN_POWERS.get(t)
    prefix = np.zeros(t + 1, dtype=np.uint64)
    np.cumsum(batch.hashes * fwd, out=prefix[1:])
    return prefix


def batch_all_window_hashes(batch: TokenBatch, prefix: np.ndarray, length: int) -> np.ndarray:
    """Hashes of the windows starting at every token 0..T-length, including windows that
    cross a row boundary (callers drop those with :func:`window_in_row`)."""
    t = len(batch.hashes)
    w = t - length + 1
    if w <= 0:
        return np.zeros(0, dtype=np.uint64)
    _, inv = _TOKEN_POWERS.get(t)
    raw = prefix[length:] - prefix[:w]
    raw *= inv[:w]
    raw += _U((length * _C_NGRAM) & MASK64)
    return _mix64_np(raw)


def window_hashes_at(batch: TokenBatch, prefix: np.ndarray, pos: np.ndarray, length: int) -> np.ndarray:
    """Hashes of the windows of ``length`` tokens starting at ``pos`` (each ``<= T - length``)."""
    _, inv = _TOKEN_POWERS.get(len(batch.hashes))
    raw = prefix[pos + length] - prefix[pos]
    raw *= inv[pos]
    raw += _U((length * _C_NGRAM) & MASK64)
    return _mix64_np(raw)


def window_in_row(batch: TokenBatch, pos: np.ndarray, length: int) -> np.ndarray:
    return batch.row_of[pos] == batch.row_of[pos + length - 1]


def batch_window_hashes(batch: TokenBatch, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions, hashes) of every window of ``length`` tokens that lies in one row;
    ``hashes[k] == ngram_hash(length, ngram at positions[k])``."""
    h = batch_all_window_hashes(batch, batch_prefix(batch), length)
    pos = np.flatnonzero(window_in_row(batch, np.arange(len(h)), length))
    return pos, h[pos]


# ---------------------------------------------------------------------------------------
# Membership structure
# ---------------------------------------------------------------------------------------

MEMBERSHIP_MAGIC = b"REFINERY-DECON-MEMBERSHIP/1\n"


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """np.unique, via sort (much faster than np.unique for large uint64 arrays here)."""
    s = np.sort(a)
    if len(s) < 2:
        return s
    keep = np.empty(len(s), dtype=np.bool_)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


class Membership:
    """Sorted unique uint64 n-gram hashes + a packed bitmap prefilter (built on load).

    ``maybe(h)`` says which hashes are in the set (exactly, as hashes); hits must still be
    verified against the n-gram text (:func:`scan_rows` does).
    """

    def __init__(self, hashes: np.ndarray | Iterable[int], lengths: Iterable[int], meta: dict | None = None):
        if not isinstance(hashes, np.ndarray):
            hashes = np.fromiter(hashes, dtype=np.uint64)
        self.hashes = _sorted_unique(hashes.astype(np.uint64, copy=False))
        self.lengths = tuple(sorted(set(int(x) for x in lengths)))
        self.meta = dict(meta or {})
        count = max(1, len(self.hashes))
        self.bits = max(16, min(40, math.ceil(math.log2(count * 32))))  # <= 1/32 false hits
        self.shift = _U(64 - self.bits)
        bitmap = np.zeros(1 << self.bits, dtype=np.bool_)
        if len(self.hashes):
            bitmap[self.hashes >> self.shift] = True
        self.bitmap = np.packbits(bitmap, bitorder="little")

    def __len__(self) -> int:
        return len(self.hashes)

    @property
    def nbytes(self) -> int:
        return int(self.hashes.nbytes + self.bitmap.nbytes)

    def contains(self, h: np.ndarray) -> np.ndarray:
        """Boolean mask: which of the uint64 hashes ``h`` are in the set."""
        h = np.asarray(h, dtype=np.uint64)
        if len(h) == 0 or len(self.hashes) == 0:
            return np.zeros(len(h), dtype=np.bool_)
        slot = h >> self.shift
        mask = ((self.bitmap[slot >> _U(3)] >> (slot & _U(7)).astype(np.uint8)) & 1).astype(np.bool_)
        cand = np.flatnonzero(mask)
        if len(cand):
            hc = h[cand]
            idx = np.searchsorted(self.hashes, hc)
            idx[idx == len(self.hashes)] = 0
            mask[cand] = self.hashes[idx] == hc
        return mask

    def to_bytes(self) -> bytes:
        header = {"count": int(len(self.hashes)), "lengths": list(self.lengths), **self.meta}
        return (MEMBERSHIP_MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n"
                + self.hashes.astype("<u8").tobytes())

    @classmethod
    def from_bytes(cls, data: bytes) -> "Membership":
        if not data.startswith(MEMBERSHIP_MAGIC):
            raise ValueError("not a decon membership file")
        nl = data.index(b"\n", len(MEMBERSHIP_MAGIC))
        header = json.loads(data[len(MEMBERSHIP_MAGIC):nl])
        hashes = np.frombuffer(data, dtype="<u8", offset=nl + 1).astype(np.uint64)
        if len(hashes) != header["count"]:
            raise ValueError("truncated decon membership file")
        meta = {k: v for k, v in header.items() if k not in ("count", "lengths")}
        return cls(hashes, header["lengths"], meta)


# ---------------------------------------------------------------------------------------
# Eval side: rows and index
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EvalRow:
    eval_idx: int          # global index over all eval files (sorted paths, then rows)
    eval_dataset: str
    eval_path: str
    eval_row: int          # 0-based row within eval_path
    instance_id: str
    text: str
    num_tokens: int
    empty: bool            # only empty tokens: contributes no n-gram

    def to_json(self) -> dict:
        return self.__dict__.copy()


def make_eval_rows(files: list[str], read_rows: Callable[[str], Iterable[tuple[int, dict | None, str | None]]],
                   text_field: str, id_field: str, tokenizer: Tokenizer
                   ) -> tuple[list[EvalRow], dict[str, dict]]:
    """Eval rows of ``files`` (in the given order) + per-dataset counts of bad rows."""
    rows: list[EvalRow] = []
    bad: dict[str, dict] = {}
    for path in files:
        ds = eval_dataset_name(path if "/" in path else os.path.abspath(path))
        bad.setdefault(ds, {"bad_rows": 0})
        for row, record, error in read_rows(path):
            text = record.get(text_field) if record is not None else None
            if record is None or not isinstance(text, str):
                bad[ds]["bad_rows"] += 1
                continue
            tokens = tokenizer.tokenize(text)
            rows.append(EvalRow(len(rows), ds, path, row, record_id(record, id_field), text,
                                len(tokens), not any(tokens)))
    return rows, bad


@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic GC while building many small containers (it would rescan them all
    over and over); reference counting still frees everything."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def build_index(rows: list[EvalRow], ns: Iterable[int], tokenizer: Tokenizer
                ) -> dict[tuple[int, str], tuple[int, list[list]]]:
    """(effective length, n-gram) -> (ngram_hash, [[eval_idx, [[start, end], ...]], ...]) over
    all eval rows, in row order. Hashes come from the vectorized twin (equal to
    :func:`ngram_hash`)."""
    index: dict[tuple[int, str], tuple[int, list]] = {}
    ns = list(ns)
    chunk = 4096
    with gc_paused():
        for c in range(0, len(rows), chunk):
            part = rows[c:c + chunk]
            batch = tokenize_batch([tokenizer.prepare(r.text) for r in part], tokenizer.byte_table)
            prefix = batch_prefix(batch)
            window_hashes: dict[int, list[int]] = {}
            for k, r in enumerate(part):
                if r.empty:
                    continue
                tokens, spans = tokenizer.tokenize_with_offsets(r.text)
                first = int(batch.row_first[k])
                for length in effective_lengths(ns, len(tokens)):
                    if length not in window_hashes:
                        window_hashes[length] = batch_all_window_hashes(batch, prefix, length).tolist()
                    wh = window_hashes[length]
                    blank = " " * (length - 1)  # the n-gram of empty tokens only: skipped
                    seen: dict[str, list] = {}
                    for i, gram in enumerate([" ".join(tokens[i:i + length])
                                              for i in range(len(tokens) - length + 1)]):
                        offs = seen.get(gram)
                        if offs is None:
                            if gram == blank:
                                continue
                            offs = seen[gram] = []
                            key = (length, gram)
                            entry = index.get(key)
                            if entry is None:
                                entry = index[key] = (wh[first + i], [])
                            entry[1].append([r.eval_idx, offs])
                        offs.append([spans[i][0], spans[i + length - 1][1]])
    return index


def partition_records(index: dict, partitions: int) -> dict[int, list[list]]:
    """Partition -> detail records ``[n, ngram, hash, [[eval_idx, [[s, e], ...]], ...]]``,
    ordered by hash (ties in index order: deterministic)."""
    out: dict[int, list[list]] = defaultdict(list)
    with gc_paused():
        for (length, gram), (h, evals) in index.items():
            out[h % partitions].append([length, gram, h, evals])
        for recs in out.values():
            recs.sort(key=itemgetter(2))
    return out


@dataclass
class NgramIndex:
    """THE test-side index, hash-partitioned: eval rows, the membership set the scan probes,
    and per hash partition the detail records that verify a hit and give its eval offsets.

    Built by :meth:`build` for both ``refinery decon`` (its ``index`` stage writes one file
    per part) and ``BuildNgramIndex`` (one element, a Beam side input).
    """

    rows: list[EvalRow]
    bad: dict[str, dict]               # eval dataset -> {"bad_rows": count}
    ns: list[int]
    tokenizer: str
    num_partitions: int
    membership: Membership
    records: dict[int, list[list]]     # partition -> [n, ngram, hash, [[eval_idx, offsets], ...]], by hash
    num_ngrams: int = 0

    @classmethod
    def build(cls, rows: list[EvalRow], bad: dict[str, dict], ns: Iterable[int], tokenizer: str,
              num_partitions: int) -> "NgramIndex":
        ns = sorted(set(int(n) for n in ns))
        index = build_index(rows, ns, get_tokenizer(tokenizer))
        membership = Membership((v[0] for v in index.values()), {k[0] for k in index},
                                {"tokenizer": tokenizer, "partitions": num_partitions, "ns": ns})
        return cls(rows, bad, ns, tokenizer, num_partitions, membership,
                   dict(partition_records(index, num_partitions)), len(index))

    def lookup(self, p: int) -> Partition:
        """Partition ``p`` as :func:`load_partition` gives it (built on first use, then kept)."""
        cache = self.__dict__.setdefault("_parts", {})
        part = cache.get(p)
        if part is None:
            part = cache[p] = Partition(self.records.get(p, []))
        return part

    def to_bytes(self) -> bytes:
        with gc_paused():
            return msgpack.packb({
                "rows": [list(r.__dict__.values()) for r in self.rows], "bad": self.bad, "ns": self.ns,
                "tokenizer": self.tokenizer, "partitions": self.num_partitions,
                "membership": self.membership.to_bytes(), "records": self.records, "num_ngrams": self.num_ngrams,
            }, use_bin_type=True, unicode_errors="surrogatepass")

    @classmethod
    def from_bytes(cls, data: bytes) -> "NgramIndex":
        with gc_paused():
            d = msgpack.unpackb(data, raw=False, unicode_errors="surrogatepass", strict_map_key=False)
        return cls([EvalRow(*r) for r in d["rows"]], d["bad"], d["ns"], d["tokenizer"], d["partitions"],
                   Membership.from_bytes(d["membership"]), {int(k): v for k, v in d["records"].items()},
                   d["num_ngrams"])


JSON_ERRORS = "backslashreplace"  # a lone surrogate in a JSON string becomes its \\uXXXX escape


def dumps_jsonl_gz(records: Iterable[dict]) -> bytes:
    buf = _pyio.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, compresslevel=6) as gz:
        for rec in records:
            gz.write(json.dumps(rec, ensure_ascii=False).encode("utf-8", JSON_ERRORS) + b"\n")
    return buf.getvalue()


def loads_jsonl_gz(data: bytes) -> Iterator[dict]:
    for line in gzip.decompress(data).splitlines():
        if line:
            yield json.loads(line)


class Partition:
    """One hash partition of the test index: its records ``[n, ngram, hash, [[eval_idx,
    [[start, end], ...]], ...]]`` ordered by hash, and (built on first use) the lookup the
    scan verifies hash hits against: ``(n, UTF-8 n-gram) -> record index``."""

    def __init__(self, records: list[list]):
        self.records = records
        self._find: dict[tuple[int, bytes], int] | None = None

    @property
    def find(self) -> dict[tuple[int, bytes], int]:
        if self._find is None:
            self._find = {(r[0], r[1].encode("utf-8", "surrogatepass")): i for i, r in enumerate(self.records)}
        return self._find


def dumps_partition(records: list[list]) -> bytes:
    """Partition detail records (:func:`partition_records`) -> msgpack bytes."""
    with gc_paused():
        return msgpack.packb(records, use_bin_type=True, unicode_errors="surrogatepass")


def load_partition(data: bytes) -> Partition:
    """Partition file bytes -> :class:`Partition`."""
    with gc_paused():
        return Partition(msgpack.unpackb(data, raw=False, unicode_errors="surrogatepass", strict_map_key=False))


# ---------------------------------------------------------------------------------------
# Training side: the scan
# ---------------------------------------------------------------------------------------

@dataclass
class ScanStats:
    rows: int = 0
    bad_rows: int = 0
    text_bytes: int = 0
    windows: int = 0
    hash_hits: int = 0
    false_hits: int = 0
    verified_hits: int = 0
    rows_with_hits: int = 0

    def add(self, other: "ScanStats") -> None:
        for k, v in other.__dict__.items():
            setattr(self, k, getattr(self, k) + v)


@dataclass
class ScanHits:
    """The verified hits of one batch of training rows: one entry per occurrence of a test
    n-gram, sorted by (partition, row, record, start).

    ``rows`` are the batch's rows ``(row, record, text)``; ``row`` indexes them; ``record``
    is the n-gram's index in its partition's records; ``start``/``end`` are code-point
    offsets into the row's text.
    """

    rows: list[tuple[int, dict, str]]
    row: np.ndarray
    partition: np.ndarray
    record: np.ndarray
    start: np.ndarray
    end: np.ndarray

    def group_starts(self) -> np.ndarray:
        """Index of the first occurrence of each (partition, row, record) group, then ``len``."""
        k = len(self.row)
        new = np.ones(k, dtype=np.bool_)
        if k > 1:
            new[1:] = (np.diff(self.row) != 0) | (np.diff(self.partition) != 0) | (np.diff(self.record) != 0)
        return np.append(np.flatnonzero(new), k)


def scan_rows(rows: Iterable[tuple[int, dict | None, str | None]], *, text_field: str, tokenizer: Tokenizer,
              membership: Membership, lookup: Callable[[int], Partition], partitions: int, stats: ScanStats,
              batch_bytes: int = 1 << 20) -> Iterator[ScanHits]:
    """Stream training rows ``(row, record, error)`` in batches; yield the :class:`ScanHits` of
    each batch that has any.

    ``lookup(p)`` returns hash partition ``p`` (:func:`load_partition`); a hash hit counts
    only if its exact n-gram is in it (no false positives).
    """
    loaded: dict[int, Partition] = {}

    def partition(p: int) -> Partition:
        part = loaded.get(p)
        if part is None:
            part = loaded[p] = lookup(p)
        return part

    known: dict[int, dict[bytes, int]] = defaultdict(dict)  # verified windows, see _verify
    prepare = tokenizer.prepare

    def scan(pending: list[tuple[int, dict, str]]) -> ScanHits | None:
        prepared = [prepare(text) for _, _, text in pending]
        stats.text_bytes += sum(map(len, prepared))
        return _scan_batch(pending, prepared, tokenizer, membership, partition, partitions, stats, known)

    pending: list[tuple[int, dict, str]] = []
    size = 0
    for row, record, error in rows:
        stats.rows += 1
        text = record.get(text_field) if record is not None else None
        if not isinstance(text, str):
            stats.bad_rows += 1
            continue
        pending.append((row, record, text))
        size += len(text) + 3
        if size >= batch_bytes:
            hits = scan(pending)
            if hits is not None:
                yield hits
            pending, size = [], 0
    if pending:
        hits = scan(pending)
        if hits is not None:
            yield hits


MAX_KNOWN_WINDOWS = 1 << 20  # per length; the cache of verified windows is cleared past this
_NOT_FOUND = -1
_UNKNOWN = -2


def _verify(buf: bytes, starts: list[int], ends: list[int], parts: list[int], length: int,
            known: dict[bytes, int], lookup: Callable[[int], Partition]) -> np.ndarray:
    """``partition << 32 | record`` of each window ``buf[starts[k]:ends[k]]`` of ``length``
    tokens, or -1 where its n-gram is not in the test index.

    A window's bytes, from its first token's start to its last token's end (separator runs
    included), determine its n-gram when neither end token is empty (tokens never contain a
    separator): ``known`` caches the answer by those bytes.
    """
    if len(known) > MAX_KNOWN_WINDOWS:
        known.clear()
    raws = [buf[s:e] for s, e in zip(starts, ends)]
    ids = np.fromiter(map(known.get, raws, repeat(_UNKNOWN)), dtype=np.int64, count=len(raws))
    finds: dict[int, dict] = {}
    for k in np.flatnonzero(ids == _UNKNOWN).tolist():
        raw, part = raws[k], parts[k]
        find = finds.get(part)
        if find is None:
            find = finds[part] = lookup(part).find
        rec = find.get((length, b" ".join(raw.split())))
        ids[k] = known[raw] = _NOT_FOUND if rec is None else part << 32 | rec
    return ids


def _scan_batch(pending, prepared, tokenizer, membership, lookup, partitions, stats, known) -> ScanHits | None:
    batch = tokenize_batch(prepared, tokenizer.byte_table)
    prefix = batch_prefix(batch)
    buf, starts, ends = batch.buf, batch.starts, batch.ends
    pos_l, len_l, id_l = [], [], []
    n0 = min(membership.meta.get("ns") or [1])
    first_hits = None  # positions whose n0-gram is in the set
    for length in membership.lengths:
        stats.windows += max(0, len(batch.hashes) - length + 1)
        if first_hits is not None and length > n0:
            # An eval n-gram longer than n0 comes from an eval row of more than n0 tokens, whose
            # first n0 tokens are an eval n-gram too (n0 >= 2: never all empty): only windows
            # whose n0-gram is in the set need probing.
            pos = first_hits[first_hits + length <= len(batch.hashes)]
            h = window_hashes_at(batch, prefix, pos, length)
            found = membership.contains(h)
            pos, h = pos[found], h[found]
        else:
            h = batch_all_window_hashes(batch, prefix, length)
            pos = np.flatnonzero(membership.contains(h))
            h = h[pos]
            if length == n0 >= 2:
                first_hits = pos
        inrow = window_in_row(batch, pos, length)
        pos, h = pos[inrow], h[inrow]
        if not len(pos):
            continue
        stats.hash_hits += len(pos)
        last = pos + length - 1
        parts = (h % _U(partitions)).astype(np.int64)
        edge = (starts[pos] == ends[pos]) | (starts[last] == ends[last])
        ids = np.empty(len(pos), dtype=np.int64)
        inner = ~edge
        ids[inner] = _verify(buf, starts[pos[inner]].tolist(), ends[last[inner]].tolist(), parts[inner].tolist(),
                             length, known[length], lookup)
        for k in np.flatnonzero(edge).tolist():  # an empty token at an end: join the tokens
            p = int(pos[k])
            gram = b" ".join(buf[a:b] for a, b in zip(starts[p:p + length].tolist(), ends[p:p + length].tolist()))
            rec = lookup(int(parts[k])).find.get((length, gram))
            ids[k] = _NOT_FOUND if rec is None else int(parts[k]) << 32 | rec
        pos_l.append(pos)
        len_l.append(np.full(len(pos), length, dtype=np.int64))
        id_l.append(ids)
    if not pos_l:
        return None
    ids = np.concatenate(id_l)
    ok = ids >= 0
    stats.false_hits += int(len(ok) - ok.sum())
    stats.verified_hits += int(ok.sum())
    if not ok.any():
        return None
    pos, lens, ids = np.concatenate(pos_l)[ok], np.concatenate(len_l)[ok], ids[ok]
    last = pos + lens - 1
    rows = batch.row_of[pos]
    base = batch.row_base[rows] + 1
    start = starts[pos] - base
    end = ends[last] - base
    for r in np.unique(rows).tolist():  # rows whose byte offsets are not code-point offsets
        row, _, text = pending[r]
        if len(prepared[r]) == len(text):
            continue
        at = np.flatnonzero(rows == r)
        if len(text.lower() if tokenizer.lowercase else text) == len(text):
            lead = (np.frombuffer(prepared[r], dtype=np.uint8) & 0xC0) != 0x80
            chars = np.zeros(len(lead) + 1, dtype=np.int64)
            np.cumsum(lead, out=chars[1:])
            start[at], end[at] = chars[start[at]], chars[end[at]]
        else:  # lowering changed the length ('İ'): the exact tokenizer maps offsets
            spans = tokenizer.tokenize_with_offsets(text)[1]
            first = int(batch.row_first[r])
            for k in at.tolist():
                i = int(pos[k]) - first
                start[k], end[k] = spans[i][0], spans[i + int(lens[k]) - 1][1]
    part, rec = ids >> 32, ids & 0xFFFFFFFF
    order = np.lexsort((start, rec, rows, part))
    hits = ScanHits(pending, rows[order], part[order], rec[order], start[order], end[order])
    stats.rows_with_hits += len(np.unique(rows))
    return hits


# ---------------------------------------------------------------------------------------
# Reduce: stats, details, metrics, report
# ---------------------------------------------------------------------------------------

def instance_metrics(tokens: list[str], n: int, overlap_counts: dict[str, int]) -> dict:
    """HELM metrics of one instance at configured n.

    The instance's n-grams are its windows of ``L = min(n, len(tokens))`` tokens (all-empty
    windows skipped); a window overlaps if its n-gram is in ``overlap_counts`` (n-gram ->
    number of training documents containing it, after any frequency filter).

    - ``binary``: 1 if any window overlaps.
    - ``jaccard``: overlapping windows / all windows.
    - ``token``: tokens covered by an overlapping window / all tokens.
    - ``jaccard_weighted``: sum over overlapping windows of 1/count, / all windows.
    - ``token_weighted``: sum over tokens of the largest 1/count among the overlapping
      windows covering it, / all tokens.

    ``overlap_counts`` is keyed by :func:`overlap_key` (the n-gram itself unless it is very long).
    """
    if not overlap_counts:
        return {"binary": 0, "jaccard": 0.0, "token": 0.0, "jaccard_weighted": 0.0, "token_weighted": 0.0}
    length = min(n, len(tokens))
    grams = [" ".join(tokens[i:i + length]) for i in range(len(tokens) - length + 1)]
    total = len(grams) - grams.count(" " * (length - 1))  # the all-empty window is not an n-gram
    cover = [0.0] * len(tokens)
    covered = [False] * len(tokens)
    hits = 0
    wsum = 0.0
    for i, gram in enumerate(grams):
        c = overlap_counts.get(overlap_key(gram))
        if not c:
            continue
        hits += 1
        w = 1.0 / c
        wsum += w
        for k in range(i, i + length):
            covered[k] = True
            if w > cover[k]:
                cover[k] = w
    nt = len(tokens) or 1
    return {
        "binary": 1 if hits else 0,
        "jaccard": hits / total if total else 0.0,
        "token": sum(covered) / nt if total else 0.0,
        "jaccard_weighted": wsum / total if total else 0.0,
        "token_weighted": sum(cover) / nt if total else 0.0,
    }


# -- the scan's output, grouped by hash partition ---------------------------------------

SNIPPET_CONTEXT = 50  # characters of training text kept on each side of a hit's first occurrence
SNIPPET_MAX_CHARS = 1000  # a snippet is cut there (a huge token): ``train_snippet_truncated`` says so
NGRAM_MAX_CHARS = 1000  # a detail record's n-gram is cut there: ``ngram_truncated`` says so


def _i64(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<i8").tolist()


def _b64(values: np.ndarray) -> bytes:
    return np.ascontiguousarray(values, dtype="<i8").tobytes()


@dataclass
class HitGroups:
    """One entry per (training row, n-gram) of a batch's hits, in their order, as columns:
    ``partition``, ``row`` (the row number the reader gave), ``doc_id``, ``record`` (index in
    the partition's records), ``occurrences`` (count) with their ``start``/``end`` code-point
    offsets, and a ``snippet`` of the training text (:data:`SNIPPET_CONTEXT` characters
    either side of the first occurrence, at most :data:`SNIPPET_MAX_CHARS`) with its
    ``snippet_start``."""

    partition: np.ndarray
    row: np.ndarray
    doc_id: list[str]
    record: np.ndarray
    occurrences: np.ndarray
    start: np.ndarray
    end: np.ndarray
    snippet_start: np.ndarray
    snippet: list[str]


def hit_groups(hits: ScanHits, id_field: str) -> HitGroups:
    """The :class:`HitGroups` of a batch's hits."""
    g = hits.group_starts()
    first = g[:-1]
    grow = hits.row[first].tolist()
    lo = np.maximum(hits.start[first] - SNIPPET_CONTEXT, 0)
    rows = hits.rows
    doc_ids: dict[int, str] = {}
    for r in grow:
        if r not in doc_ids:
            doc_ids[r] = record_id(rows[r][1], id_field)
    texts = [text for _, _, text in rows]
    hi = np.minimum(hits.end[first] + SNIPPET_CONTEXT, lo + SNIPPET_MAX_CHARS).tolist()
    return HitGroups(hits.partition[first], np.array([rows[r][0] for r in grow], dtype=np.int64),
                     [doc_ids[r] for r in grow], hits.record[first], np.diff(g), hits.start, hits.end, lo,
                     [texts[r][s:e] for r, s, e in zip(grow, lo.tolist(), hi)])


def hit_blocks(groups: list[HitGroups]) -> Iterator[tuple[int, dict]]:
    """``(partition, block)`` for each partition of some batches' hit groups, ascending; a
    block holds the partition's groups in scan order, the :class:`HitGroups` columns but
    ``partition``, integer columns as little-endian int64 bytes."""
    part = np.concatenate([x.partition for x in groups])
    occ = np.concatenate([x.occurrences for x in groups])
    start, end = np.concatenate([x.start for x in groups]), np.concatenate([x.end for x in groups])
    row, record = np.concatenate([x.row for x in groups]), np.concatenate([x.record for x in groups])
    snip_start = np.concatenate([x.snippet_start for x in groups])
    doc_ids = [d for x in groups for d in x.doc_id]
    snippets = [s for x in groups for s in x.snippet]
    order = np.argsort(part, kind="stable")
    first_occ = np.cumsum(occ) - occ
    cuts = np.flatnonzero(np.diff(part[order])) + 1
    for sel in np.split(order, cuts):
        counts = occ[sel]
        at = np.repeat(first_occ[sel] - (np.cumsum(counts) - counts), counts) + np.arange(counts.sum())
        picked = sel.tolist()
        yield int(part[sel[0]]), {
            "row": _b64(row[sel]), "doc_id": [doc_ids[k] for k in picked], "record": _b64(record[sel]),
            "occurrences": _b64(counts), "start": _b64(start[at]), "end": _b64(end[at]),
            "snippet_start": _b64(snip_start[sel]), "snippet": [snippets[k] for k in picked],
        }


# -- reduce: one eval partition ---------------------------------------------------------

def _pairs(offsets: list) -> str:
    """``[[1, 2], [3, 4]]`` as ``json.dumps`` writes it."""
    if len(offsets) == 1:
        (s, e), = offsets
        return f"[[{s}, {e}]]"
    return "[" + ", ".join(f"[{s}, {e}]" for s, e in offsets) + "]"


def configured_ns(ns: list[int], num_tokens: int, length: int) -> list[int]:
    """The configured n whose effective length for a row of ``num_tokens`` tokens is ``length``."""
    return [n for n in ns if min(n, num_tokens) == length]


@dataclass(frozen=True)
class SameText:
    """Eval rows with exactly the same text (their n-grams and offsets are the same):
    ``others[i]``: the later rows of the text whose first row (eval order) is ``i``;
    ``first[j]``: that first row, for each later row ``j``. Rows with a text of their own are
    in neither."""

    others: dict[int, list[int]]
    first: dict[int, int]


def same_text(eval_rows: list[EvalRow]) -> SameText:
    """The :class:`SameText` of ``eval_rows`` (empty rows included: they have no records)."""
    seen: dict[str, int] = {}
    others: dict[int, list[int]] = {}
    first: dict[int, int] = {}
    for r in eval_rows:
        i = seen.setdefault(r.text, r.eval_idx)
        if i != r.eval_idx:
            others.setdefault(i, []).append(r.eval_idx)
            first[r.eval_idx] = i
    return SameText(others, first)


def overlap_key(gram: str) -> str:
    """An n-gram's key in the results' ``overlaps``: the n-gram itself, or, past
    :data:`NGRAM_MAX_CHARS`, its first characters and a blake2b digest of it (bounded, and
    never equal to a shorter n-gram)."""
    if len(gram) <= NGRAM_MAX_CHARS:
        return gram
    digest = hashlib.blake2b(gram.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    return f"{gram[:NGRAM_MAX_CHARS]} {digest}"


DEFAULT_MAX_NGRAM_DETAILS = 100_000  # detail records written per n-gram (--max-ngram-details)
PREFIX_CACHE_EVALS = 1024  # records with at most this many eval rows keep their detail-line heads
WRITE_LINES = 1024         # detail lines built at once for a record with many eval rows
WRITE_CHARS = 1 << 20      # detail text held before it is handed to ``write``


def reduce_partition(records: list[list], eval_rows: list[EvalRow], ns: list[int],
                     blocks: Callable[[], Iterable[tuple[int, str, int, dict]]], max_train_count: int | None,
                     write: Callable[[str], None], max_ngram_details: int | None = None,
                     same: SameText | None = None) -> dict:
    """Join one eval partition's records with the scan's hit blocks of that partition.

    ``blocks()`` yields ``(scan unit index, training path, row base, block)`` in scan order
    (the row base makes a byte slice's rows file-global); it is called twice when
    ``max_train_count`` is set (document counts first). ``write`` receives the detail records
    as JSON lines each ending in a newline, a few at a time (at most about
    :data:`WRITE_CHARS` characters, whatever the fan-out; keys in the documented order; lone
    surrogates are left for :data:`JSON_ERRORS`).

    Eval rows with the same text (``same``, default :func:`same_text`) get one detail record
    per (training row, n-gram): the first row's, with ``same_text`` (how many others). At most
    ``max_ngram_details`` detail records are written per n-gram (scan order, then eval
    order); the stats still count every one. N-grams and snippets are cut at
    :data:`NGRAM_MAX_CHARS` / :data:`SNIPPET_MAX_CHARS`, marked ``ngram_truncated`` /
    ``train_snippet_truncated``.

    Returns the partition's share of the results (msgpack-able): ``details`` (written),
    ``ignored`` (n-grams over ``max_train_count``), ``capped`` ([n, n-gram (cut), written,
    all] per n-gram over ``max_ngram_details``), ``overlaps`` (eval_idx -> n ->
    {:func:`overlap_key`: training documents}), ``by_path`` ([train_path, eval_dataset, n,
    eval_idx list, train rows]), ``spans`` (eval_idx -> eval offsets of its overlapping
    n-grams at the largest n) and ``samples`` (eval_idx -> its first two training rows at the
    largest n, each ``[unit, row, train_path, [[ngram hash, offsets, snippet_start,
    snippet], ...]]``; only for the first row of a shared text).
    """
    ns = sorted(set(ns))
    same = same_text(eval_rows) if same is None else same
    at_nmax = [min(ns[-1], r.num_tokens) for r in eval_rows]  # each eval row's n-gram length at the largest n
    ignored = None
    if max_train_count is not None:
        seen = np.zeros(len(records), dtype=np.int64)
        for _, _, _, block in blocks():
            seen += np.bincount(np.frombuffer(block["record"], dtype="<i8"), minlength=len(records))
        ignored = (seen > max_train_count).tolist()
    counts = [0] * len(records)   # training documents holding each n-gram
    written = [0] * len(records)  # detail records written of each n-gram
    quote = json.encoder.encode_basestring  # a JSON string, non-ASCII and lone surrogates kept as they are
    heads: dict[int, str] = {}
    kept: dict[int, list] = {}                # record -> its [eval_idx, offsets], one per distinct text
    middles: dict[int, str] = {}              # record -> its detail lines' n-gram part
    prefixes: dict[int, list[str]] = {}       # record -> its detail lines up to the training part (few eval rows)
    sampled: dict[int, list[int]] = {}        # record -> eval rows it is a largest-n n-gram of, still sampling
    samples: dict[int, dict[tuple[int, int], list]] = {}
    hit_rows: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))  # path -> record -> rows
    out: list[str] = []
    held = 0

    def head(eval_idx: int) -> str:
        h = heads.get(eval_idx)
        if h is None:
            er = eval_rows[eval_idx]
            h = heads[eval_idx] = (f'{{"eval_dataset": {quote(er.eval_dataset)}, "eval_path": '
                                   f'{quote(er.eval_path)}, "eval_row": {er.eval_row}, '
                                   f'"instance_id": {quote(er.instance_id)}')
            if eval_idx in same.others:
                h = heads[eval_idx] = f'{h}, "same_text": {len(same.others[eval_idx])}'
        return h

    def lines_of(rec: int, evals: list) -> list[str]:
        middle = middles[rec]
        return [f'{head(eval_idx)}, {middle}{_pairs(eval_offsets)}, ' for eval_idx, eval_offsets in evals]

    for unit, path, base, block in blocks():
        path_json = quote(path)
        recs, occ = _i64(block["record"]), _i64(block["occurrences"])
        starts, ends, snip = _i64(block["start"]), _i64(block["end"]), _i64(block["snippet_start"])
        rows, doc_ids, snippets = _i64(block["row"]), block["doc_id"], block["snippet"]
        o = 0
        rows_of_rec = hit_rows[path]
        for k, rec in enumerate(recs):
            a, o = o, o + occ[k]
            if ignored is not None and ignored[rec]:
                continue
            counts[rec] += 1
            row = base + rows[k]
            rows_of_rec[rec].append(row)
            evals = kept.get(rec)
            if evals is None:
                n, gram, _, evals = records[rec]
                if same.first:
                    evals = [e for e in evals if e[0] not in same.first]
                kept[rec] = evals
                cut = ', "ngram_truncated": true' if len(gram) > NGRAM_MAX_CHARS else ""
                middles[rec] = f'"n": {n}, "ngram": {quote(gram[:NGRAM_MAX_CHARS])}{cut}, "eval_offsets": '
                if len(evals) <= PREFIX_CACHE_EVALS:
                    prefixes[rec] = lines_of(rec, evals)
                sampled[rec] = [eval_idx for eval_idx, _ in evals if n == at_nmax[eval_idx]]
            offs = list(zip(starts[a:o], ends[a:o]))
            room = len(evals) if max_ngram_details is None else min(len(evals), max_ngram_details - written[rec])
            if room > 0:
                written[rec] += room
                cut = (', "train_snippet_truncated": true'
                       if offs[0][1] + SNIPPET_CONTEXT - snip[k] > SNIPPET_MAX_CHARS else "")
                tail = (f'"train_path": {path_json}, "train_row": {row}, "train_doc_id": {quote(doc_ids[k])}, '
                        f'"train_offsets": {_pairs(offs)}, "train_snippet_start": {snip[k]}, '
                        f'"train_snippet": {quote(snippets[k])}{cut}}}\n')
                cached = prefixes.get(rec)
                for c in range(0, room, WRITE_LINES):
                    lines = cached[c:room] if cached is not None else lines_of(rec, evals[c:min(room, c + WRITE_LINES)])
                    out.append(tail.join(lines) + tail)
                    held += len(out[-1])
                    if held >= WRITE_CHARS:
                        write("".join(out))
                        out.clear()
                        held = 0
            if sampled[rec]:
                key = (unit, row)
                hit = [records[rec][2], offs, snip[k], snippets[k]]
                for eval_idx in sampled[rec]:
                    rows_of = samples.setdefault(eval_idx, {})
                    if key in rows_of or len(rows_of) < 2:
                        rows_of.setdefault(key, [unit, row, path, []])[3].append(hit)
                # rows come in scan order: an eval row with two rows takes no later one from this record
                sampled[rec] = [eval_idx for eval_idx in sampled[rec] if len(samples[eval_idx]) < 2]
        if out:
            write("".join(out))
            out.clear()
            held = 0
    overlaps: dict[int, dict[int, dict[str, int]]] = {}
    spans: dict[int, list] = {}
    capped = []
    for rec in kept:
        n, gram, _, evals = records[rec]
        key = overlap_key(gram)
        for eval_idx, eval_offsets in evals:
            overlaps.setdefault(eval_idx, {}).setdefault(n, {})[key] = counts[rec]
            if n == at_nmax[eval_idx]:
                spans.setdefault(eval_idx, []).extend(eval_offsets)
        if counts[rec] * len(kept[rec]) > written[rec]:
            capped.append([n, gram[:NGRAM_MAX_CHARS], written[rec], counts[rec] * len(kept[rec])])
    path_ids: dict[tuple[str, str, int], set] = defaultdict(set)
    path_rows: dict[tuple[str, str, int], set] = defaultdict(set)
    keys_of: dict[int, dict[tuple[str, int], list[int]]] = {}  # record -> (eval_dataset, n) -> eval rows
    for path, rows_of_rec in hit_rows.items():
        for rec, rows in rows_of_rec.items():
            keys = keys_of.get(rec)
            if keys is None:
                keys = keys_of[rec] = {}
                n_rec = records[rec][0]
                for eval_idx, _ in records[rec][3]:
                    er = eval_rows[eval_idx]
                    for n in configured_ns(ns, er.num_tokens, n_rec):
                        keys.setdefault((er.eval_dataset, n), []).append(eval_idx)
            for (ds, n), ids in keys.items():
                path_ids[(path, ds, n)].update(ids)
                path_rows[(path, ds, n)].update(rows)
    return {"details": sum(written), "ignored": int(sum(ignored)) if ignored is not None else 0, "capped": capped,
            "overlaps": overlaps, "spans": spans,
            "by_path": [[*key, sorted(ids), sorted(path_rows[key])] for key, ids in sorted(path_ids.items())],
            "samples": {i: list(rows_of.values()) for i, rows_of in samples.items()}}


# -- merge: all partitions --------------------------------------------------------------

@dataclass
class ReduceResult:
    overlap_stats: list[dict]
    by_train_path: list[dict]
    metrics: list[dict]
    summary: list[dict]
    ignored_ngrams: int
    overlaps: dict[int, dict[int, dict[str, int]]]   # eval_idx -> n -> {ngram: training documents}
    spans: dict[int, list]                           # eval_idx -> eval offsets at the largest n
    samples: dict[int, list]                         # eval_idx -> first training rows at the largest n
    capped: list = field(default_factory=list)       # [n, n-gram, written, all] per n-gram over max_ngram_details


def merge_partitions(eval_rows: list[EvalRow], ns: list[int], parts: Iterable[dict], tokenizer: Tokenizer,
                     eval_bad_rows: dict[str, dict] | None = None) -> ReduceResult:
    """The stats, HELM metrics and report inputs of a run from its partitions' results
    (:func:`reduce_partition`); a partition's n-grams are its own, so the overlaps of an
    instance are the union of its partitions' (metrics need all of them)."""
    ns = sorted(set(ns))
    overlaps: dict[int, dict[int, dict[str, int]]] = defaultdict(dict)
    spans: dict[int, list] = defaultdict(list)
    samples: dict[int, dict[tuple[int, int], list]] = defaultdict(dict)
    by_path: dict[tuple[str, str, int], tuple[set, set]] = {}
    ignored = 0
    capped: list = []
    for part in parts:
        ignored += part["ignored"]
        capped += part.get("capped", [])
        for eval_idx, per_n in part["overlaps"].items():
            for n, grams in per_n.items():
                overlaps[eval_idx].setdefault(n, {}).update(grams)
        for eval_idx, offsets in part["spans"].items():
            spans[eval_idx].extend(offsets)
        for eval_idx, rows in part["samples"].items():
            for unit, row, path, hits in rows:
                samples[eval_idx].setdefault((unit, row), [unit, row, path, []])[3].extend(hits)
        for path, ds, n, ids, rows in part["by_path"]:
            got = by_path.setdefault((path, ds, n), (set(), set()))
            got[0].update(ids)
            got[1].update(rows)
    datasets = sorted({r.eval_dataset for r in eval_rows} | set(eval_bad_rows or {}))
    all_ids: dict[str, set] = defaultdict(set)
    empty_ids: dict[str, set] = defaultdict(set)
    hit_ids: dict[tuple[str, int], set] = defaultdict(set)
    for r in eval_rows:
        all_ids[r.eval_dataset].add(r.instance_id)
        if r.empty:
            empty_ids[r.eval_dataset].add(r.instance_id)
        for length in overlaps.get(r.eval_idx, {}):
            for n in configured_ns(ns, r.num_tokens, length):
                hit_ids[(r.eval_dataset, n)].add(r.instance_id)
    stats = [{"eval_dataset": ds, "n": n, "num_instances": len(all_ids[ds]),
              "instance_ids": sorted(hit_ids[(ds, n)])} for ds in datasets for n in ns]
    paths = []
    for (path, ds, n), (ids, rows) in sorted(by_path.items()):
        instance_ids = sorted({eval_rows[i].instance_id for i in ids})
        paths.append({"train_path": path, "eval_dataset": ds, "n": n, "num_instances": len(instance_ids),
                      "instance_ids": instance_ids, "num_train_rows": len(rows)})
    metrics = []
    for r in eval_rows:
        tokens = tokenizer.tokenize(r.text) if r.eval_idx in overlaps else None
        for n in ns:
            if tokens is None:
                m = {"binary": 0, "jaccard": 0.0, "token": 0.0, "jaccard_weighted": 0.0, "token_weighted": 0.0}
            else:
                m = instance_metrics(tokens, n, overlaps[r.eval_idx].get(min(n, r.num_tokens), {}))
            metrics.append({"eval_dataset": r.eval_dataset, "eval_path": r.eval_path, "eval_row": r.eval_row,
                            "instance_id": r.instance_id, "n": n, **m})
    summary = []
    for ds in datasets:
        summary.append({
            "eval_dataset": ds,
            "num_rows": sum(1 for r in eval_rows if r.eval_dataset == ds),
            "num_instances": len(all_ids[ds]),
            "num_empty_instances": len(empty_ids[ds]),
            "num_bad_rows": (eval_bad_rows or {}).get(ds, {}).get("bad_rows", 0),
        })
    return ReduceResult(stats, paths, metrics, summary, ignored, dict(overlaps), dict(spans),
                        {i: [rows_of[k] for k in sorted(rows_of)[:2]] for i, rows_of in samples.items()},
                        sorted(capped, key=lambda c: (-c[3], c[0], c[1])))


def overlap_instance(r: EvalRow) -> dict:
    """The line of ``overlap_instances.jsonl.gz`` for an eval row: its text, written once."""
    return {"eval_dataset": r.eval_dataset, "eval_path": r.eval_path, "eval_row": r.eval_row,
            "instance_id": r.instance_id, "eval_text": r.text}


def overlap_instances(eval_rows: list[EvalRow], overlaps: dict, same: SameText | None = None) -> Iterator[dict]:
    """The lines of ``overlap_instances.jsonl.gz``: each overlapping eval row with its text, in
    eval order; a text shared by several rows once, on its first row's line, which lists the
    others under ``same_text`` (their detail records are that row's)."""
    same = same_text(eval_rows) if same is None else same
    for r in eval_rows:
        if r.eval_idx not in overlaps or r.eval_idx in same.first:
            continue
        line = overlap_instance(r)
        if r.eval_idx in same.others:
            line["same_text"] = [{k: v for k, v in overlap_instance(eval_rows[i]).items() if k != "eval_text"}
                                 for i in same.others[r.eval_idx]]
        yield line


def capped_warning(capped: list, max_ngram_details: int | None) -> str:
    """One sentence on the n-grams whose detail records were capped ("" when none was)."""
    if not capped:
        return ""
    left_out = sum(c[3] - c[2] for c in capped)
    n, gram, _, total = capped[0]
    shown = gram if len(gram) <= 60 else gram[:59] + "…"
    return (f"{len(capped):,} n-gram(s) had more than {max_ngram_details:,} detail records (eval rows x training "
            f"rows); {left_out:,} records were left out of overlap_details.jsonl.gz (the stats and metrics count "
            f"them all). The largest: {shown!r} (n={n}, {total:,} records). Raise --max-ngram-details to keep "
            f"them, or ignore such n-grams with --max-train-count.")


def render_report(result: ReduceResult, scan_stats: dict, max_train_count: int | None, top: int = 5,
                  max_ngram_details: int | None = None) -> str:
    """A short human-readable report: per dataset and n, contamination and top files."""
    lines = ["# Train/test overlap report", ""]
    lines.append(f"training rows scanned: {scan_stats.get('rows', 0)}, "
                 f"text: {scan_stats.get('text_bytes', 0) / 1e6:.1f} MB, "
                 f"rows with overlaps: {scan_stats.get('rows_with_hits', 0)}")
    if max_train_count is not None:
        lines.append(f"n-grams ignored (in more than {max_train_count} training documents): {result.ignored_ngrams}")
    if result.capped:
        lines.append(f"detail records capped: {capped_warning(result.capped, max_ngram_details)}")
    lines.append("")
    summary = {s["eval_dataset"]: s for s in result.summary}
    top_files: dict[tuple[str, int], list] = defaultdict(list)
    for row in result.by_train_path:
        top_files[(row["eval_dataset"], row["n"])].append((row["num_instances"], row["train_path"]))
    lines.append("| eval_dataset | n | contaminated | instances | % | top training files (instances) |")
    lines.append("|---|---|---|---|---|---|")
    for s in result.overlap_stats:
        ds, n = s["eval_dataset"], s["n"]
        k, total = len(s["instance_ids"]), s["num_instances"]
        pct = 100.0 * k / total if total else 0.0
        files = sorted(top_files[(ds, n)], key=lambda x: (-x[0], x[1]))[:top]
        tops = ", ".join(f"{p} ({c})" for c, p in files) or "-"
        lines.append(f"| {ds} | {n} | {k} | {total} | {pct:.2f} | {tops} |")
    lines.append("")
    for ds, s in sorted(summary.items()):
        if s["num_empty_instances"] or s["num_bad_rows"]:
            lines.append(f"- {ds}: {s['num_empty_instances']} empty/punctuation-only instances (never counted "
                         f"as overlapping), {s['num_bad_rows']} unreadable rows or rows without text")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class MergedSnippet:
    text: str
    spans: list[tuple[int, int]]   # offsets relative to ``text``
    cut_before: bool               # the training text goes on before ``text``
    cut_after: bool                # ... and (as far as the hits tell) after it


def merged_snippet(hits: list) -> MergedSnippet:
    """One snippet of a training row from its hits ``[ngram, offsets, snippet_start, snippet]``:
    the earliest snippet extended by those that overlap or touch it, and every occurrence
    inside it (offsets relative to the snippet). An occurrence longer than a snippet can
    hold (:data:`SNIPPET_MAX_CHARS`) is shown up to the snippet's end. ``cut_after`` is
    false when the last snippet is shorter than its hit asked for: the text ended there."""
    pieces = []
    for h in hits:
        want = h[1][0][1] + SNIPPET_CONTEXT - h[2]       # its first occurrence's end + the context
        pieces.append((h[2], h[3], want > SNIPPET_MAX_CHARS, len(h[3]) >= min(want, SNIPPET_MAX_CHARS)))
    pieces.sort()
    lo, text, clipped, goes_on = pieces[0]
    for start, piece, piece_clipped, piece_goes_on in pieces[1:]:
        end = lo + len(text)
        if start > end:
            break
        if start + len(piece) > end:
            text += piece[end - start:]
            clipped, goes_on = piece_clipped, piece_goes_on
    hi = lo + len(text)
    spans = [(s - lo, min(e, hi) - lo) for h in hits for s, e in h[1] if lo <= s and (e <= hi or clipped and s < hi)]
    return MergedSnippet(text, spans, lo > 0, goes_on)


def contamination_report(result: ReduceResult, eval_rows: list[EvalRow], ns: list[int], examples: int,
                         settings: tuple[tuple[str, str], ...], inputs: tuple[tuple[str, str, str], ...],
                         scan_stats: dict) -> rh.ContaminationReport:
    """What ``stats/report.html`` shows (:mod:`~refinery.transforms.decon.report_html`).

    Per eval dataset and n: the counts and the means of HELM's metrics over its rows; the
    training files contributing most (instances contaminated at any n); the ``examples``
    most contaminated instances at the largest n (HELM's token metric, ties in eval order),
    each with its overlapping spans and its first two training rows (scan order) as
    snippets, from the partitions' bounded samples. A text shared by several instances of
    the dataset is shown once, saying how many others have it.
    """
    ns = sorted(set(ns))
    same = same_text(eval_rows)
    metrics = {(m["eval_dataset"], m["n"]): [] for m in result.metrics}
    for m in result.metrics:
        metrics[(m["eval_dataset"], m["n"])].append(m)
    per_n = {(s["eval_dataset"], s["n"]): s for s in result.overlap_stats}
    files: dict[str, dict[str, set]] = defaultdict(lambda: defaultdict(set))
    for row in result.by_train_path:
        files[row["eval_dataset"]][row["train_path"]].update(row["instance_ids"])
    at_max = {r.eval_idx: result.metrics[r.eval_idx * len(ns) + len(ns) - 1] for r in eval_rows}
    names = ("binary", "jaccard", "token", "jaccard_weighted", "token_weighted")
    datasets = []
    for s in result.summary:
        ds = s["eval_dataset"]
        rows = [r for r in eval_rows if r.eval_dataset == ds]
        results = []
        for n in ns:
            ms = metrics.get((ds, n), [])
            means = [sum(m[k] for m in ms) / len(ms) if ms else 0.0 for k in names]
            results.append(rh.NResult(n, per_n[(ds, n)]["num_instances"], len(per_n[(ds, n)]["instance_ids"]), *means))
        top = sorted(((p, len(ids)) for p, ids in files[ds].items()), key=lambda x: (-x[1], x[0]))
        ranked = sorted((r for r in rows if at_max[r.eval_idx]["binary"]),
                        key=lambda r: (-at_max[r.eval_idx]["token"], r.eval_idx))
        copies = Counter(r.text for r in ranked)
        chosen: dict[str, EvalRow] = {}
        for r in ranked:
            if len(chosen) == examples:
                break
            chosen.setdefault(r.text, r)
        shown = []
        for r in chosen.values():
            hits = []
            for _, row, path, row_hits in result.samples.get(same.first.get(r.eval_idx, r.eval_idx), []):
                snippet = merged_snippet(row_hits)
                hits.append(rh.TrainHit(path, row, snippet.text, tuple(rh.Span(a, b) for a, b in snippet.spans),
                                        len({h[0] for h in row_hits}), snippet.cut_before, snippet.cut_after))
            shown.append(rh.Example(r.instance_id, r.eval_row, r.text,
                                    tuple(rh.Span(a, b) for a, b in result.spans.get(r.eval_idx, [])),
                                    at_max[r.eval_idx]["token"], tuple(hits), copies[r.text] - 1))
        datasets.append(rh.DatasetReport(ds, tuple(sorted({r.eval_path for r in rows})), s["num_rows"],
                                         s["num_instances"], s["num_empty_instances"], s["num_bad_rows"],
                                         tuple(results), tuple(top), tuple(shown), ns[-1]))
    rows_read = (("eval rows", len(eval_rows)),
                 ("eval rows unreadable or without text", sum(s["num_bad_rows"] for s in result.summary)),
                 ("training rows", int(scan_stats.get("rows", 0))),
                 ("training rows unreadable or without text", int(scan_stats.get("bad_rows", 0))),
                 ("training rows with overlaps", int(scan_stats.get("rows_with_hits", 0))),
                 ("training text bytes", int(scan_stats.get("text_bytes", 0))))
    if result.capped:
        rows_read += (("detail records left out (over --max-ngram-details)", sum(c[3] - c[2] for c in result.capped)),)
    return rh.ContaminationReport("Train/test overlap report", settings, inputs, rows_read, tuple(datasets),
                                  "refinery decon")


# ---------------------------------------------------------------------------------------
# Reference implementation (pure Python, the HELM shape: dict of test n-grams, stream train)
# ---------------------------------------------------------------------------------------

def reference_overlap(eval_rows: list[EvalRow], train: Iterable[tuple[str, int, str]], ns: list[int],
                      tokenizer: Tokenizer) -> tuple[dict[tuple[str, int], list[str]], set]:
    """Straightforward implementation of the same method.

    ``train`` yields ``(train_path, train_row, text)``. Returns (instance ids per
    (dataset, configured n), sorted; the set of detail keys
    ``(eval_idx, train_path, train_row, effective n, ngram)``).
    """
    ns = sorted(set(ns))
    index: dict[tuple[int, str], list[EvalRow]] = {}
    for r in eval_rows:
        tokens = tokenizer.tokenize(r.text)
        for length in effective_lengths(ns, len(tokens)):
            for _, gram in iter_ngrams(tokens, length):
                bucket = index.setdefault((length, gram), [])
                if not bucket or bucket[-1] is not r:
                    bucket.append(r)
    lengths = sorted({k[0] for k in index})
    found: dict[tuple[str, int], set] = defaultdict(set)
    details: set = set()
    for path, row, text in train:
        tokens = tokenizer.tokenize(text)
        for length in lengths:
            for i in range(len(tokens) - length + 1):
                gram = " ".join(tokens[i:i + length])
                rows = index.get((length, gram))
                if rows:
                    for r in rows:
                        details.add((r.eval_idx, path, row, length, gram))
                        for n in ns:
                            if min(n, r.num_tokens) == length:
                                found[(r.eval_dataset, n)].add(r.instance_id)
    datasets = sorted({r.eval_dataset for r in eval_rows})
    return {(ds, n): sorted(found[(ds, n)]) for ds in datasets for n in ns}, details
