"""Reading token shards: the ``.idx`` reader/writer and a memory-mapped document reader.

Formats are those of :mod:`refinery.transforms.formats.shards` (``shared/reference/FORMATS.md``):
an ``.npy`` of uint32 tokens, documents back to back each ending in one EOS, and an
``.idx`` with a 32-byte header and ``uint64 (start, end)`` per document.

- :class:`IndexReader`: ``num_docs``, ``get_document(i) -> (start, end)``; a local ``.idx``
  is memory-mapped, so opening one costs nothing whatever its size.
- :class:`IndexWriter`: streams document lengths, writes the ``.idx`` atomically on close,
  through :func:`shards.write_idx` (the one writer prep uses too).
- :class:`ShardReader`: a shard's tokens (memory-mapped) + its index; ``document(i)``.
- :func:`regenerate_index`: an ``.idx`` rebuilt from a shard's EOS positions, scanning the
  memory-mapped tokens in chunks; byte-identical to the one prep wrote.
"""
from __future__ import annotations

import os
from array import array

import numpy as np

from refinery.transforms.core import io
from refinery.transforms.formats import shards

SCAN_CHUNK_TOKENS = 1 << 24


def index_path_for(npy_path: str) -> str:
    """``.../name.npy`` -> ``.../name.idx``."""
    if not npy_path.endswith(".npy"):
        raise ValueError(f"{npy_path}: not a .npy shard")
    return npy_path[: -len(".npy")] + ".idx"


class IndexReader:
    """A shard's ``.idx``: ``num_docs``, ``bounds`` ((num_docs, 2) uint64) and ``get_document(i)``.

    Raises ValueError naming the file if the header or size is wrong.
    """

    def __init__(self, path: str):
        self.path = path
        if io.is_remote(path):
            try:
                self.bounds = shards.read_idx(path)
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None
        else:
            self.bounds = self._mmap(path)
        self.num_docs = int(len(self.bounds))

    @staticmethod
    def _mmap(path: str) -> np.ndarray:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            header = f.read(shards.IDX_HEADER.size)
        if len(header) < shards.IDX_HEADER.size:
            raise ValueError(f"{path}: idx is {size} bytes, shorter than its 32-byte header")
        magic, version, num_docs, _ = shards.IDX_HEADER.unpack(header)
        if magic != shards.IDX_MAGIC:
            raise ValueError(f"{path}: idx has magic {magic!r}, expected {shards.IDX_MAGIC!r}")
        if version != shards.IDX_VERSION:
            raise ValueError(f"{path}: idx has version {version}, expected {shards.IDX_VERSION}")
        if size != shards.IDX_HEADER.size + 16 * num_docs:
            raise ValueError(f"{path}: idx is {size} bytes, header says {num_docs} docs "
                             f"({shards.IDX_HEADER.size + 16 * num_docs} bytes)")
        if num_docs == 0:
            return np.zeros((0, 2), dtype="<u8")
        return np.memmap(path, dtype="<u8", mode="r", offset=shards.IDX_HEADER.size, shape=(num_docs, 2))

    def __len__(self) -> int:
        return self.num_docs

    def get_document(self, i: int) -> tuple[int, int]:
        """[start, end) token offsets of document ``i`` (end exclusive, EOS included)."""
        if not -self.num_docs <= i < self.num_docs:
            raise IndexError(f"{self.path}: document {i} out of range (0..{self.num_docs - 1})")
        start, end = self.bounds[i]
        return int(start), int(end)

    def lengths(self) -> np.ndarray:
        """Token count of every document (EOS included), uint64."""
        return (self.bounds[:, 1] - self.bounds[:, 0]).astype(np.uint64)


class IndexWriter:
    """Collects document lengths (8 bytes each) and writes the ``.idx`` atomically on close.

    ``with IndexWriter(path) as w: w.add_document(num_tokens)`` (EOS included).
    """

    def __init__(self, path: str):
        self.path = path
        self._lengths = array("Q")
        self.closed = False

    def add_document(self, num_tokens: int) -> None:
        if num_tokens < 1:
            raise ValueError(f"{self.path}: a document holds at least its EOS (got {num_tokens} tokens)")
        self._lengths.append(num_tokens)

    def add_lengths(self, lengths) -> None:
        lengths = np.asarray(lengths, dtype=np.uint64)
        if len(lengths) and int(lengths.min()) < 1:
            raise ValueError(f"{self.path}: a document holds at least its EOS (got a length of 0)")
        self._lengths.frombytes(lengths.astype(np.uint64).tobytes())

    @property
    def num_docs(self) -> int:
        return len(self._lengths)

    def close(self) -> None:
        if self.closed:
            return
        with io.atomic_open(self.path) as out:
            shards.write_idx(out, np.frombuffer(self._lengths, dtype=np.uint64))
        self.closed = True

    def __enter__(self) -> "IndexWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()


class ShardReader:
    """A shard's tokens (memory-mapped when local) and index: ``document(i)`` -> uint32 tokens."""

    def __init__(self, npy_path: str, idx_path: str | None = None):
        self.npy_path = npy_path
        self.idx_path = idx_path or index_path_for(npy_path)
        self.tokens = shards.open_tokens(npy_path)
        if self.tokens.dtype != shards.TOKEN_DTYPE or self.tokens.ndim != 1:
            raise ValueError(f"{npy_path}: dtype {self.tokens.dtype} ndim {self.tokens.ndim}, expected 1-D <u4")
        self.index = IndexReader(self.idx_path)
        self.num_docs = self.index.num_docs
        self.num_tokens = int(len(self.tokens))

    def __len__(self) -> int:
        return self.num_docs

    def document(self, i: int) -> np.ndarray:
        """The tokens of document ``i`` (EOS included), a view into the memory map."""
        start, end = self.index.get_document(i)
        if end > self.num_tokens:
            raise ValueError(f"{self.idx_path}: document {i} ends at {end}, "
                             f"past the {self.num_tokens} tokens of {self.npy_path}")
        return self.tokens[start:end]

    __getitem__ = document

    def __iter__(self):
        for i in range(self.num_docs):
            yield self.document(i)


def find_shards(root: str) -> list[str]:
    """Every ``**/*.npy`` under ``root``, hidden files and folders (``.refinery``) skipped, sorted."""
    if io.is_remote(root):
        fs, p = io.filesystem(root)
        prefix = root.split("://", 1)[0] + "://"
        found = [prefix + f for f in fs.glob(p.rstrip("/") + "/**/*.npy")]
        return sorted(f for f in found if not any(part.startswith(".") for part in f[len(root):].split("/")))
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found += [os.path.join(dirpath, f) for f in filenames if f.endswith(".npy") and not f.startswith(".")]
    return sorted(found)


def eos_document_lengths(tokens: np.ndarray, eos_token_id: int,
                         chunk: int = SCAN_CHUNK_TOKENS) -> tuple[np.ndarray, int]:
    """(document lengths ending at each EOS, tokens after the last EOS), scanning in chunks."""
    ends = []
    for lo in range(0, len(tokens), chunk):
        part = np.asarray(tokens[lo:lo + chunk])
        ends.append(np.flatnonzero(part == eos_token_id).astype(np.uint64) + np.uint64(lo + 1))
    ends_all = np.concatenate(ends) if ends else np.zeros(0, np.uint64)
    lengths = np.diff(np.concatenate(([0], ends_all)).astype(np.uint64))
    trailing = len(tokens) - (int(ends_all[-1]) if len(ends_all) else 0)
    return lengths, trailing


def regenerate_index(npy_path: str, eos_token_id: int) -> bytes:
    """The ``.idx`` bytes of a shard, from its EOS positions.

    Raises ValueError if tokens follow the last EOS: they belong to no document, and an
    ``.idx`` that dropped them would not describe the shard.
    """
    tokens = shards.open_tokens(npy_path)
    if tokens.ndim != 1:
        raise ValueError(f"{npy_path}: {tokens.ndim}-D array, expected 1-D tokens")
    lengths, trailing = eos_document_lengths(tokens, eos_token_id)
    if trailing:
        raise ValueError(f"{npy_path}: {trailing} token(s) after the last EOS ({eos_token_id}); "
                         f"wrong --eos-token-id or a truncated shard")
    buf = bytearray()

    class _Sink:
        def write(self, b) -> int:
            buf.extend(b)
            return len(b)

    shards.write_idx(_Sink(), lengths)
    return bytes(buf)
