"""THE packer: a shard's documents, held in spills (:mod:`~refinery.transforms.prep.spill`), ->
its ``.npy`` + ``.idx`` + ``.docs.parquet``.

Both ways of writing token shards call :func:`write_shard_files`: the command's pack units
(``PackStage``: the shard's rows of every tokenize or merge spill, in input order) and the
``WriteTokenShards`` sink (:func:`sorted_spill`: a shard's documents, as Beam groups them,
spilled to a local folder and put in :func:`~refinery.transforms.prep.documents.order_key`
order). So the same documents in the same order give the same bytes either way, and
memory holds only the documents' table rows, never their tokens.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterable, Iterator, Mapping, TypedDict

import msgpack
import numpy as np

from refinery.transforms.formats import provenance, shards
from refinery.transforms.io import storage
from refinery.transforms.io.arrow_columns import Utf8Column
from refinery.transforms.prep import spill
from refinery.transforms.prep.documents import TokenizedDocument, order_key

OpenWrite = Callable[[str], ContextManager[storage.BinaryWriter]]
SpillFiles = Mapping[str, str]  # a spill's files by kind: "tokens", "docs", "shards", "meta", "names"
SINK_RUN_TOKENS = 1 << 20  # a sink's spill writes its tokens every 4 MB (a worker sorts several shards at once)


class ShardWritten(TypedDict):
    """What :func:`write_shard_files` wrote: the shard's tokens and documents."""

    tokens: int
    docs: int


@dataclass(frozen=True)
class ShardPiece:
    """A shard's documents in one spill, in the shard's order: their rows of the spill's
    documents table (:data:`~.spill.DOC_DTYPE`) and, aligned, of its names table
    (:data:`~.spill.META_DTYPE`)."""

    files: SpillFiles
    rows: np.ndarray
    meta: np.ndarray


def read_shard_piece(files: SpillFiles, shard: int, budget_left: int | None) -> ShardPiece | None:
    """The documents of ``shard`` in the spill ``files`` that stay within the token budget
    left (None: no budget), read with a seek per table; None when the spill has none."""
    with storage.open_read(files["shards"]) as f:
        starts = np.load(f, allow_pickle=False)
    if starts[shard] == starts[shard + 1]:
        return None  # no document of this shard: the table and tokens need no read
    with storage.open_read(files["docs"]) as f:
        rows = spill.read_shard_rows(f, starts, shard)
    with storage.open_read(files["meta"]) as f:
        meta = spill.read_shard_rows(f, starts, shard, spill.META_DTYPE)
    keep = spill.budget_mask(rows, budget_left)
    piece = ShardPiece(files, rows, meta) if keep is None else ShardPiece(files, rows[keep], meta[keep])
    return piece if len(piece.rows) else None


def sorted_spill(docs: Iterable[TokenizedDocument | None], files: SpillFiles) -> list[ShardPiece]:
    """One shard's documents (in any order; ``None`` is skipped: the marker that makes an
    empty shard a group) spilled to the local files ``files["tokens"]`` and ``files["names"]``,
    as one piece in :func:`order_key` order (ties: by the tokens' sha1); no piece when there
    are no documents."""
    keys: list[tuple[str, int, str, bytes, int]] = []
    with open(files["tokens"], "wb") as tokens_out, open(files["names"], "wb") as names_out:
        writer = spill.SpillWriter(tokens_out, SINK_RUN_TOKENS, names_out)
        for doc in docs:
            if doc is None:
                continue
            writer.add(0, doc.tokens, name=(doc.row, doc.doc_id, doc.source))
            keys.append((*order_key(doc), hashlib.sha1(shards.u32_bytes(doc.tokens)).digest(), len(keys)))
        table = writer.close()
    if not keys:
        return []
    keys.sort()
    order = np.fromiter((k[4] for k in keys), dtype=np.int64, count=len(keys))
    return [ShardPiece(files, table[order], writer.meta[order])]


def shard_lengths(pieces: list[ShardPiece]) -> np.ndarray:
    """Each document's length (tokens, EOS included), in shard order."""
    return np.concatenate([p.rows["length"] for p in pieces]) if pieces else np.zeros(0, np.uint32)


def token_chunks(pieces: list[ShardPiece]) -> Iterator[bytes]:
    """The documents' little-endian uint32 tokens, in shard order, in bounded chunks."""
    for p in pieces:
        with storage.open_read(p.files["tokens"]) as f:
            yield from spill.iter_token_chunks(f, spill.contiguous_ranges(p.rows))


def doc_batches(pieces: list[ShardPiece]) -> Iterator[provenance.DocBatch]:
    """The documents' (ids, sources, rows, lengths), in shard order, in bounded batches."""
    for p in pieces:
        with storage.open_read(p.files["names"]) as f:
            for lo in range(0, len(p.meta), spill.NAMES_BATCH):
                part = p.meta[lo:lo + spill.NAMES_BATCH]
                ids, sources = spill.read_name_columns(f, part)
                yield ids, sources, part["row"], p.rows["length"][lo:lo + spill.NAMES_BATCH]


def content_digest(pieces: list[ShardPiece]) -> str:
    """sha256 of what the shard's files will hold: the lengths (uint64), then the tokens,
    then each document's (source, row, id) (msgpack): the sink's receipt records it, and a
    shard whose documents changed is written again."""
    h = hashlib.sha256(shard_lengths(pieces).astype("<u8").tobytes())
    for chunk in token_chunks(pieces):
        h.update(chunk)
    for ids, sources, rows, _ in doc_batches(pieces):
        for doc_id, source, row in zip(Utf8Column.of(ids).strings(), Utf8Column.of(sources).strings(),
                                       np.asarray(rows).tolist()):
            h.update(msgpack.packb((source, row, doc_id), use_bin_type=True, unicode_errors="surrogatepass"))
    return h.hexdigest()


def write_shard_files(open_write: OpenWrite, npy_path: str, idx_path: str, pieces: list[ShardPiece],
                      dtype: str) -> ShardWritten:
    """THE shard's files from its documents: ``.npy`` + ``.idx`` (:func:`shards.write_shard`,
    in ``dtype``) and the provenance sidecar ``.docs.parquet`` (:func:`provenance.write_docs`),
    through ``open_write`` (atomic, listed in the unit's receipt). Raises ValueError if the
    sidecar names another number of documents than the shard holds."""
    written = shards.write_shard(open_write, npy_path, idx_path, shard_lengths(pieces), token_chunks(pieces),
                                 dtype=dtype)
    docs_path = provenance.docs_path_for(npy_path)
    docs = provenance.write_docs(open_write, docs_path, doc_batches(pieces))
    if docs != written["docs"]:
        raise ValueError(f"{docs_path}: {docs} documents named, the shard holds {written['docs']}")
    return {"tokens": int(written["tokens"]), "docs": int(written["docs"])}
