"""The token-shard format, in one place: write, read, check, regenerate and find shards.

A shard is a pair of files (documented in ``docs/FORMATS.md``):

- ``.npy``: standard NPY, 1-D ``<u4`` (``<u2`` when the tokenizer's ids fit: the manifest's
  ``dtype``); documents back to back, each followed by one EOS.
- ``.idx``: header ``struct('<8sQQQ')`` = (``b"NMOEIDX\\x00"``, version 1, num_docs, 0), then
  ``uint64[num_docs * 2]`` of (start, end) token offsets, end exclusive, EOS included.

A prep output folder holds ``shard_NNNN/{dataset}-v1-shard-NNNNNN.{npy,idx}`` and
``manifest.json``: dataset, tokenizer, totals, row accounting and per-shard sha256 (under
both ``sha256`` and ``checksum``, the name nmoe's ``load_manifest`` reads), plus
``created_at``.

- Writing: :func:`write_shard` streams a shard (its length is known before the body is
  written, so neither file is ever held whole in memory); :class:`IndexWriter` writes an
  ``.idx`` from document lengths.
- Reading: :func:`read_idx`/:class:`IndexReader` (one header check,
  :func:`parse_idx_header`), :func:`open_tokens` (a local shard is memory-mapped; a remote
  one is read by byte ranges, see :class:`RemoteTokens`), :class:`ShardReader`.
- Regenerating: :func:`regenerate_index` rebuilds an ``.idx`` from EOS positions.
- Verifying: :func:`check_shard` (a manifest and its shards: :mod:`.manifests`).
- Finding: :func:`find_shards` (every ``.npy`` under a folder, hidden folders skipped) and
  :func:`shard_files` (the ``.npy``/``.idx``/``.docs.parquet`` of the ``shard_*`` folders of an output).

Each shard also has a provenance sidecar, ``.docs.parquet``: :mod:`.provenance`.
"""
from __future__ import annotations

import os
import re
import struct
from array import array
from collections import OrderedDict
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Iterator, Union

import numpy as np

from refinery.transforms.formats.tiktoken_vocab import EOS_TOKEN_ID
from refinery.transforms.io import storage

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

FORMAT_VERSION = "v1"
IDX_MAGIC = b"NMOEIDX\x00"
IDX_VERSION = 1
IDX_HEADER = struct.Struct("<8sQQQ")
TOKEN_DTYPE = np.dtype("<u4")  # the default tokenizer's (o200k_harmony)
# the manifest's dtype -> the NPY's
TOKEN_DTYPES: dict[str, np.dtype[Any]] = {"uint32": TOKEN_DTYPE, "uint16": np.dtype("<u2")}


def token_dtype(name: str) -> np.dtype[Any]:
    """The NPY dtype of a manifest's ``dtype`` (``uint32`` or ``uint16``); ValueError otherwise."""
    if name not in TOKEN_DTYPES:
        raise ValueError(f"token dtype {name!r}: expected one of {', '.join(TOKEN_DTYPES)}")
    return TOKEN_DTYPES[name]


def _is_token_array(tokens: TokenArray) -> bool:
    return tokens.dtype in TOKEN_DTYPES.values() and tokens.ndim == 1
IDX_CHUNK_DOCS = 1 << 20
SCAN_CHUNK_TOKENS = 1 << 24


# ---------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------

NAME_RULE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # a dataset or source name: one safe path component


def check_name(name: str, what: str = "dataset") -> str:
    """``name`` if it is a safe dataset/source name (letters, digits, ``_ . -``, starting with a
    letter or digit: it cannot name a folder or escape the output); else ValueError."""
    if not isinstance(name, str) or not NAME_RULE.match(name):
        raise ValueError(f"{what} name {name!r}: use letters, digits, '_', '.' and '-', "
                         "starting with a letter or digit")
    return name


def shard_dirname(shard: int) -> str:
    return f"shard_{shard:04d}"


def shard_basename(dataset: str, shard: int, version: str = FORMAT_VERSION) -> str:
    return f"{dataset}-{version}-shard-{shard:06d}"


def shard_relpaths(dataset: str, shard: int, version: str = FORMAT_VERSION) -> tuple[str, str]:
    """(``.npy``, ``.idx``) paths of a shard, relative to the output folder."""
    stem = f"{shard_dirname(shard)}/{shard_basename(dataset, shard, version)}"
    return f"{stem}.npy", f"{stem}.idx"


def index_path_for(npy_path: str) -> str:
    """``.../name.npy`` -> ``.../name.idx``."""
    if not npy_path.endswith(".npy"):
        raise ValueError(f"{npy_path}: not a .npy shard")
    return npy_path[: -len(".npy")] + ".idx"


# ---------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------

class _Buffer:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, b: ReadableBuffer, /) -> int:
        view = memoryview(b).cast("B")
        self.data += view
        return view.nbytes


def npy_header(num_tokens: int, dtype: str = "uint32") -> bytes:
    """The exact header ``numpy.save`` writes for a 1-D uint32 (uint16) array of that length."""
    buf = _Buffer()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": np.lib.format.dtype_to_descr(token_dtype(dtype)), "fortran_order": False,
              "shape": (num_tokens,)})
    return bytes(buf.data)


def write_idx(out: storage.BinaryWriter, lengths: np.ndarray | Iterable[int]) -> None:
    """Write an ``.idx`` for documents of the given token lengths (EOS included)."""
    lengths = np.asarray(lengths, dtype=np.uint64)
    out.write(IDX_HEADER.pack(IDX_MAGIC, IDX_VERSION, len(lengths), 0))
    base = 0
    for i in range(0, len(lengths), IDX_CHUNK_DOCS):
        chunk = lengths[i:i + IDX_CHUNK_DOCS]
        ends = base + np.cumsum(chunk, dtype=np.uint64)
        starts = np.concatenate(([base], ends[:-1])).astype(np.uint64)
        out.write(np.stack([starts, ends], axis=1).astype("<u8").tobytes())
        base = int(ends[-1])


def idx_bytes(lengths: np.ndarray | Iterable[int]) -> bytes:
    """The ``.idx`` of documents of the given lengths, in memory."""
    buf = _Buffer()
    write_idx(buf, lengths)
    return bytes(buf.data)


def write_shard(open_write: Callable[[str], ContextManager[storage.BinaryWriter]], npy_path: str, idx_path: str,
                lengths: np.ndarray | Iterable[int], token_chunks: Iterable[bytes],
                dtype: str = "uint32") -> dict[str, Any]:
    """THE shard writer: ``.npy`` (header, then ``token_chunks``: little-endian uint32 bytes
    of the documents in order, EOS included) and then its ``.idx`` from ``lengths``.
    ``dtype="uint16"`` writes the tokens as uint16 (ValueError if one does not fit).

    ``open_write(path)`` is an atomic writer (``UnitContext.open_write`` or
    ``storage.atomic_open``). Raises ValueError if the chunks do not hold ``sum(lengths)`` tokens
    (nothing is then left under either name). Returns ``{"tokens", "docs"}``.
    """
    lengths = np.asarray(lengths, dtype=np.uint64)
    num_tokens = int(lengths.sum(dtype=np.uint64))
    narrow = token_dtype(dtype) != TOKEN_DTYPE
    with open_write(npy_path) as out:
        out.write(npy_header(num_tokens, dtype))
        written = 0
        for chunk in token_chunks:
            if narrow:
                wide = np.frombuffer(chunk, dtype="<u4")
                if len(wide) and int(wide.max()) > 0xFFFF:
                    raise ValueError(f"{npy_path}: token id {int(wide.max())} does not fit {dtype}")
                out.write(wide.astype("<u2").tobytes())
            else:
                out.write(chunk)
            written += len(chunk)
        if written != 4 * num_tokens:
            raise ValueError(f"{npy_path}: {written // 4} tokens written, the documents hold {num_tokens}")
    with open_write(idx_path) as out:
        write_idx(out, lengths)
    return {"tokens": num_tokens, "docs": int(len(lengths))}


def u32_bytes(tokens: np.ndarray | array[int] | Iterable[int]) -> bytes:
    """Little-endian uint32 bytes of a token sequence (``array('I')``, numpy array or list)."""
    if isinstance(tokens, np.ndarray):
        return tokens.astype("<u4", copy=False).tobytes()
    ids = tokens if isinstance(tokens, array) else array("I", tokens)
    if np.little_endian:
        return ids.tobytes()
    swapped = array(ids.typecode, ids)
    swapped.byteswap()
    return swapped.tobytes()


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

    def add_lengths(self, lengths: np.ndarray | Iterable[int]) -> None:
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
        with storage.atomic_open(self.path) as out:
            write_idx(out, np.frombuffer(self._lengths, dtype=np.uint64))
        self.closed = True

    def __enter__(self) -> "IndexWriter":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()


# ---------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------

def parse_idx_header(header: bytes, size: int) -> int:
    """THE ``.idx`` header check: the number of documents, or ValueError saying what is wrong
    (``size`` is the whole file's size in bytes)."""
    if len(header) < IDX_HEADER.size:
        raise ValueError(f"idx is {size} bytes, shorter than its {IDX_HEADER.size}-byte header")
    magic, version, num_docs, _ = IDX_HEADER.unpack_from(header)
    if magic != IDX_MAGIC:
        raise ValueError(f"idx has magic {magic!r}, expected {IDX_MAGIC!r}")
    if version != IDX_VERSION:
        raise ValueError(f"idx has version {version}, expected {IDX_VERSION}")
    if size != IDX_HEADER.size + 16 * num_docs:
        raise ValueError(f"idx is {size} bytes, header says {num_docs} docs ({IDX_HEADER.size + 16 * num_docs} bytes)")
    return int(num_docs)


def read_idx(path_or_bytes: str | bytes) -> np.ndarray:
    """(num_docs, 2) uint64 array of [start, end) per document; raises ValueError if malformed."""
    data = storage.read_bytes(path_or_bytes) if isinstance(path_or_bytes, str) else path_or_bytes
    num_docs = parse_idx_header(data[:IDX_HEADER.size], len(data))
    return np.frombuffer(data, dtype="<u8", offset=IDX_HEADER.size).reshape(num_docs, 2)


class IndexReader:
    """A shard's ``.idx``: ``num_docs``, ``bounds`` ((num_docs, 2) uint64) and ``get_document(i)``.

    A local ``.idx`` is memory-mapped, so opening one costs nothing whatever its size.
    Raises ValueError naming the file if the header or size is wrong.
    """

    def __init__(self, path: str):
        self.path = path
        try:
            if storage.is_remote(path):
                self.bounds = read_idx(path)
            else:
                size = os.path.getsize(path)
                with open(path, "rb") as f:
                    num_docs = parse_idx_header(f.read(IDX_HEADER.size), size)
                self.bounds = (np.zeros((0, 2), dtype="<u8") if num_docs == 0 else
                               np.memmap(path, dtype="<u8", mode="r", offset=IDX_HEADER.size, shape=(num_docs, 2)))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        self.num_docs = int(len(self.bounds))

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
        lengths: np.ndarray = (self.bounds[:, 1] - self.bounds[:, 0]).astype(np.uint64)
        return lengths


def _read_npy_header(f: IO[bytes]) -> tuple[tuple[int, ...], np.dtype[Any], int]:
    """(shape, dtype, header bytes) of an open NPY file positioned at its start."""
    version = np.lib.format.read_magic(f)
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read_header(f)
    return tuple(shape), dtype, f.tell()


def npy_extent(path: str) -> tuple[int, int]:
    """(tokens, bytes the file must have) of a shard, from its NPY header only (one small read,
    local or remote)."""
    with storage.open_read(path) as f:
        shape, dtype, offset = _read_npy_header(f)
    if dtype not in TOKEN_DTYPES.values() or len(shape) != 1:
        raise ValueError(f"{path}: dtype {dtype} shape {shape}, expected 1-D <u4 or <u2 tokens")
    return int(shape[0]), offset + int(shape[0]) * dtype.itemsize


def npy_token_count(path: str) -> int:
    """Tokens in a shard, from its NPY header only (one small read, local or remote)."""
    return npy_extent(path)[0]


class RemoteTokens:
    """A remote shard's tokens, read by byte range: ``len()``, ``dtype``, ``ndim`` and slicing
    (``tokens[a:b]`` -> a numpy array, one ranged read) like the local memory map, so that
    no remote shard is ever read whole into memory."""

    def __init__(self, path: str):
        self.path = path
        with storage.open_read(path) as f:
            shape, self.dtype, self.offset = _read_npy_header(f)
        self.ndim = len(shape)
        self.shape = tuple(shape)
        self._len = int(shape[0]) if shape else 0

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, key: int | np.integer[Any] | slice) -> Any:
        if isinstance(key, (int, np.integer)):
            k = int(key) + (self._len if key < 0 else 0)
            if not 0 <= k < self._len:
                raise IndexError(f"{self.path}: token {key} out of range")
            return self[k:k + 1][0]
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("remote tokens support integer indices and contiguous slices only")
        start, stop, _ = key.indices(self._len)
        if stop <= start:
            return np.zeros(0, dtype=self.dtype)
        data = storage.read_range(self.path, self.offset + start * self.dtype.itemsize,
                             self.offset + stop * self.dtype.itemsize)
        return np.frombuffer(data, dtype=self.dtype)

    def __array__(self, dtype: np.dtype[Any] | None = None, copy: bool | None = None) -> np.ndarray:
        a: np.ndarray = self[0:self._len]
        return a if dtype is None else a.astype(dtype)


# a shard's tokens: the memory map of a local shard or the ranged reader of a remote one
TokenArray = Union[np.ndarray, RemoteTokens]


def open_tokens(path: str) -> TokenArray:
    """A shard's tokens as a 1-D uint32 (or uint16) array-like: a memory map (local) or
    :class:`RemoteTokens` (remote: the header is read now, tokens on slicing)."""
    if not storage.is_remote(path):
        tokens: np.ndarray = np.load(path, mmap_mode="r", allow_pickle=False)
        return tokens
    return RemoteTokens(path)


class TokenFiles:
    """At most ``capacity`` open shards (:func:`open_tokens` handles, least recently used
    dropped first): for readers that fetch one document at a time from many shards. A handle
    holds no token data, so memory does not grow with shard size."""

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self._open: OrderedDict[str, TokenArray] = OrderedDict()

    def get(self, path: str) -> TokenArray:
        tokens = self._open.pop(path, None)
        if tokens is None:
            tokens = open_tokens(path)
        self._open[path] = tokens
        while len(self._open) > self.capacity:
            self._open.popitem(last=False)
        return tokens


class ShardReader:
    """A shard's tokens (memory-mapped when local) and index: ``document(i)`` -> tokens in the
    NPY's dtype (uint32, or uint16)."""

    def __init__(self, npy_path: str, idx_path: str | None = None):
        self.npy_path = npy_path
        self.idx_path = idx_path or index_path_for(npy_path)
        self.tokens = open_tokens(npy_path)
        if not _is_token_array(self.tokens):
            raise ValueError(f"{npy_path}: dtype {self.tokens.dtype} ndim {self.tokens.ndim}, expected 1-D <u4 or <u2")
        self.index = IndexReader(self.idx_path)
        self.num_docs = self.index.num_docs
        self.num_tokens = int(len(self.tokens))

    def __len__(self) -> int:
        return self.num_docs

    def document(self, i: int) -> np.ndarray:
        """The tokens of document ``i`` (EOS included): a view into the memory map, or one ranged read."""
        start, end = self.index.get_document(i)
        if end > self.num_tokens:
            raise ValueError(f"{self.idx_path}: document {i} ends at {end}, "
                             f"past the {self.num_tokens} tokens of {self.npy_path}")
        document: np.ndarray = self.tokens[start:end]
        return document

    __getitem__ = document

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(self.num_docs):
            yield self.document(i)


# ---------------------------------------------------------------------------------------
# Regenerating an index
# ---------------------------------------------------------------------------------------

def eos_document_lengths(tokens: TokenArray, eos_token_id: int,
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


def regenerate_index(npy_path: str, eos_token_id: int = EOS_TOKEN_ID) -> bytes:
    """The ``.idx`` bytes of a shard, from its EOS positions; byte-identical to the one prep wrote.

    Raises ValueError if tokens follow the last EOS: they belong to no document, and an
    ``.idx`` that dropped them would not describe the shard.
    """
    tokens = open_tokens(npy_path)
    if tokens.ndim != 1:
        raise ValueError(f"{npy_path}: {tokens.ndim}-D array, expected 1-D tokens")
    lengths, trailing = eos_document_lengths(tokens, eos_token_id)
    if trailing:
        raise ValueError(f"{npy_path}: {trailing} token(s) after the last EOS ({eos_token_id}); "
                         f"wrong --eos-token-id or a truncated shard")
    return idx_bytes(lengths)


# ---------------------------------------------------------------------------------------
# Verifying
# ---------------------------------------------------------------------------------------

def check_shard(npy_path: str, idx_path: str, eos_token_id: int, expected_tokens: int | None = None,
                expected_docs: int | None = None, expected_dtype: str | None = None) -> list[str]:
    """Problems with one shard pair ([] if none): header, dtype (the manifest's ``expected_dtype``
    when given), idx/npy consistency, EOS placement."""
    problems: list[str] = []
    name = storage.basename(npy_path)
    try:
        tokens = open_tokens(npy_path)
    except FileNotFoundError:
        return [f"{npy_path}: missing"]
    except Exception as e:  # noqa: BLE001 - any parse failure is a problem to report
        return [f"{npy_path}: not a readable .npy ({type(e).__name__}: {e})"]
    if not _is_token_array(tokens):
        return [f"{npy_path}: dtype {tokens.dtype} ndim {tokens.ndim}, expected 1-D <u4 or <u2"]
    if expected_dtype is not None and tokens.dtype != TOKEN_DTYPES.get(expected_dtype):
        return [f"{npy_path}: dtype {tokens.dtype}, the manifest says {expected_dtype}"]
    try:
        bounds = np.asarray(IndexReader(idx_path).bounds)
    except FileNotFoundError:
        return problems + [f"{idx_path}: missing"]
    except ValueError as e:
        return problems + [str(e)]
    n = len(tokens)
    if expected_tokens is not None and n != expected_tokens:
        problems.append(f"{npy_path}: {n} tokens, manifest says {expected_tokens}")
    if expected_docs is not None and len(bounds) != expected_docs:
        problems.append(f"{idx_path}: {len(bounds)} documents, manifest says {expected_docs}")
    if len(bounds):
        starts, ends = bounds[:, 0], bounds[:, 1]
        if starts[0] != 0 or ends[-1] != n or np.any(starts[1:] != ends[:-1]) or np.any(ends <= starts):
            problems.append(f"{idx_path}: document bounds are not contiguous over the {n} tokens of {name}")
        else:
            lengths, trailing = eos_document_lengths(tokens, eos_token_id)
            if trailing or len(lengths) != len(ends) or np.any(np.cumsum(lengths, dtype=np.uint64) != ends):
                problems.append(f"{npy_path}: EOS positions do not match {storage.basename(idx_path)} "
                                f"({len(lengths)} EOS, {len(ends)} documents; a double EOS or EOS inside a document)")
    elif n:
        problems.append(f"{idx_path}: no documents but {name} holds {n} tokens")
    return problems


# ---------------------------------------------------------------------------------------
# Finding shards
# ---------------------------------------------------------------------------------------

def find_shards(root: str) -> list[str]:
    """Every ``**/*.npy`` under ``root``, hidden files and folders (``.refinery``) skipped, sorted."""
    if storage.is_remote(root):
        fs, p = storage.filesystem(root)
        prefix = root.split("://", 1)[0] + "://"
        found = [prefix + f for f in fs.glob(p.rstrip("/") + "/**/*.npy")]
        return sorted(f for f in found if not any(part.startswith(".") for part in f[len(root):].split("/")))
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found += [os.path.join(dirpath, f) for f in filenames if f.endswith(".npy") and not f.startswith(".")]
    return sorted(found)


def shard_files(root: str) -> list[str]:
    """Every ``.npy``/``.idx``/``.docs.parquet`` (a shard's provenance sidecar) directly under the
    ``shard_*`` folders of an output root."""
    out = []
    for d in storage.listdir(root):
        if storage.basename(d).startswith("shard_"):
            out += [p for p in storage.listdir(d) if p.endswith((".npy", ".idx", ".docs.parquet"))]
    return out
