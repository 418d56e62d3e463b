"""Doc-id addressed documents in prep shards: the address, and reading a document by it.

A document of a prep output is addressed as ``{source}//{relpath}#s={start}:e={end}``
(``docs/FORMATS.md``): ``relpath`` is its ``.npy`` relative to the data root,
``[start, end)`` its token span (EOS included), ``source`` the dataset name (from the
nearest ``manifest.json`` at or above the shard within the root, else the first folder of
``relpath``). HYDRA's slices list such ids, and generate and hydra read documents by them.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Iterator

from refinery.transforms.formats import shards
from refinery.transforms.formats.tiktoken_vocab import EOS_TOKEN_ID
from refinery.transforms.io import storage

DOCID_RE = re.compile(r"^(?P<source>.*?)//(?P<relpath>.+)#s=(?P<start>\d+):e=(?P<end>\d+)$")


@dataclass(frozen=True)
class DocAddress:
    source: str
    relpath: str
    start: int
    end: int

    @property
    def doc_id(self) -> str:
        return f"{self.source}//{self.relpath}#s={self.start}:e={self.end}"


def parse_doc_id(doc_id: str) -> DocAddress:
    m = DOCID_RE.match(doc_id)
    if not m:
        raise ValueError(f"not a doc id of the form {{source}}//{{relpath}}#s={{start}}:e={{end}}: {doc_id!r}")
    try:  # a relpath must stay under the data root: relative, no '..' escape, a .npy shard
        relpath = storage.safe_relpath(m["relpath"])
    except ValueError as e:
        raise ValueError(f"doc id {doc_id!r}: {e}") from None
    if not relpath.endswith(".npy"):
        raise ValueError(f"doc id {doc_id!r}: {relpath!r} is not a .npy shard")
    a = DocAddress(m["source"], relpath, int(m["start"]), int(m["end"]))
    if a.end <= a.start:
        raise ValueError(f"doc id {doc_id!r}: empty span")
    return a


def find_shards(data_root: str) -> list[tuple[str, str]]:
    """(source, relpath) of every ``.npy`` with an ``.idx`` under ``data_root`` (hidden
    folders such as ``.refinery`` skipped), sorted by relpath."""
    root = data_root.rstrip("/")
    out = []
    for path in shards.find_shards(root):
        if storage.exists(shards.index_path_for(path)):
            relpath = path[len(root) + 1:]
            out.append((source_of(root, relpath), relpath))
    return sorted(out, key=lambda x: x[1])


def source_of(root: str, relpath: str) -> str:
    parts = relpath.split("/")[:-1]
    for depth in range(len(parts), -1, -1):
        manifest = storage.join(root, *parts[:depth], "manifest.json")
        if storage.exists(manifest):
            try:
                name = storage.read_json(manifest).get("dataset")
            except (ValueError, OSError):
                name = None
            if name:
                return str(name)
    return parts[0] if parts else storage.basename(root)


def shard_doc_ids(data_root: str, source: str, relpath: str) -> Iterator[str]:
    """Doc ids of one shard, in document order (from its ``.idx``)."""
    idx_path = storage.join(data_root, relpath[: -len(".npy")] + ".idx")
    try:
        bounds = shards.read_idx(idx_path)
    except ValueError as e:
        raise ValueError(f"{idx_path}: {e}") from None
    for start, end in bounds.tolist():
        yield DocAddress(source, relpath, int(start), int(end)).doc_id


_SHARDS = shards.TokenFiles(64)  # inputs are fingerprinted: a shard does not change during a run


def read_doc_tokens(data_root: str, doc_id: str, strip_eos: int | None = EOS_TOKEN_ID) -> list[int]:
    """The tokens of a doc-id addressed document (its trailing EOS removed). Only that
    document's tokens are read (a memory map locally, one ranged read on an object store)."""
    a = parse_doc_id(doc_id)
    path = storage.join(data_root, a.relpath)
    try:
        tokens = _SHARDS.get(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"doc {doc_id}: shard {path} not found (is --data-root right?)") from None
    if a.end > len(tokens):
        raise ValueError(f"doc {doc_id}: span ends at {a.end}, past the {len(tokens)} tokens of {path}")
    out = [int(t) for t in tokens[a.start:a.end]]
    if strip_eos is not None and out and out[-1] == strip_eos:
        out.pop()
    return out


def read_docid_file(path: str) -> Iterator[tuple[int, str]]:
    """(line number, doc id) of a doc-id JSONL (``{"doc_id": ...}`` rows) or plain-text file.
    A doc id is not checked here: one that does not address a shard under the data root
    becomes an error row naming it when its tokens are read (:func:`read_doc_tokens`)."""
    with storage.open_read(path, compression="infer") as f:
        for n, line in enumerate(f, 1):
            text = line.decode("utf-8").strip()
            if not text:
                continue
            if text.startswith("{"):
                try:
                    doc_id = json.loads(text)["doc_id"]
                except (ValueError, KeyError) as e:
                    raise ValueError(f"{path}:{n}: not a doc-id row ({type(e).__name__}: {e})") from None
            else:
                doc_id = text
            yield n, doc_id
