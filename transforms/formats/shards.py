"""Token shards: the ``.npy`` + ``.idx`` pair, the manifest, and their verification.

Formats (``shared/reference/FORMATS.md``):

- ``.npy``: standard NPY, 1-D ``<u4``; documents back to back, each followed by one EOS.
- ``.idx``: header ``struct('<8sQQQ')`` = (``b"NMOEIDX\\x00"``, version 1, num_docs, 0), then
  ``uint64[num_docs * 2]`` of (start, end) token offsets, end exclusive, EOS included.
- ``manifest.json``: dataset, tokenizer, totals, row accounting and per-shard sha256.

Writers stream: the shard's length and document count are known before the body is
written, so neither file is ever held whole in memory.
"""
from __future__ import annotations

import json
import struct
from typing import IO

import numpy as np

from refinery.transforms.core import io

IDX_MAGIC = b"NMOEIDX\x00"
IDX_VERSION = 1
IDX_HEADER = struct.Struct("<8sQQQ")
TOKEN_DTYPE = np.dtype("<u4")
IDX_CHUNK_DOCS = 1 << 20


def npy_header(num_tokens: int) -> bytes:
    """The exact header ``numpy.save`` writes for a 1-D uint32 array of that length."""
    buf = _Buffer()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": np.lib.format.dtype_to_descr(TOKEN_DTYPE), "fortran_order": False, "shape": (num_tokens,)})
    return bytes(buf.data)


class _Buffer:
    def __init__(self):
        self.data = bytearray()

    def write(self, b) -> int:
        self.data += b
        return len(b)


def write_idx(out: IO[bytes], lengths: np.ndarray) -> None:
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


def idx_bytes_from_tokens(tokens: np.ndarray, eos_token_id: int) -> bytes:
    """Rebuild an ``.idx`` from a shard's tokens by its EOS positions."""
    ends = np.flatnonzero(np.asarray(tokens) == eos_token_id).astype(np.uint64) + 1
    lengths = np.diff(np.concatenate(([0], ends))).astype(np.uint64)
    buf = _Buffer()
    write_idx(buf, lengths)
    return bytes(buf.data)


def read_idx(path_or_bytes) -> np.ndarray:
    """(num_docs, 2) uint64 array of [start, end) per document; raises ValueError if malformed."""
    data = io.read_bytes(path_or_bytes) if isinstance(path_or_bytes, str) else path_or_bytes
    if len(data) < IDX_HEADER.size:
        raise ValueError(f"idx is {len(data)} bytes, shorter than its 32-byte header")
    magic, version, num_docs, _ = IDX_HEADER.unpack_from(data)
    if magic != IDX_MAGIC:
        raise ValueError(f"idx has magic {magic!r}, expected {IDX_MAGIC!r}")
    if version != IDX_VERSION:
        raise ValueError(f"idx has version {version}, expected {IDX_VERSION}")
    expected = IDX_HEADER.size + 16 * num_docs
    if len(data) != expected:
        raise ValueError(f"idx is {len(data)} bytes, header says {num_docs} docs ({expected} bytes)")
    return np.frombuffer(data, dtype="<u8", offset=IDX_HEADER.size).reshape(num_docs, 2)


def open_tokens(path: str) -> np.ndarray:
    """Memory-map a local shard (or read a remote one) as a 1-D uint32 array."""
    if io.is_remote(path):
        import io as pyio
        return np.load(pyio.BytesIO(io.read_bytes(path)), allow_pickle=False)
    return np.load(path, mmap_mode="r", allow_pickle=False)


def check_shard(npy_path: str, idx_path: str, eos_token_id: int,
                expected_tokens: int | None = None, expected_docs: int | None = None) -> list[str]:
    """Problems with one shard pair ([] if none): header, dtype, idx/npy consistency, EOS placement."""
    problems = []
    name = io.basename(npy_path)
    try:
        tokens = open_tokens(npy_path)
    except FileNotFoundError:
        return [f"{npy_path}: missing"]
    except Exception as e:  # noqa: BLE001 - any parse failure is a problem to report
        return [f"{npy_path}: not a readable .npy ({type(e).__name__}: {e})"]
    if tokens.dtype != TOKEN_DTYPE or tokens.ndim != 1:
        problems.append(f"{npy_path}: dtype {tokens.dtype} ndim {tokens.ndim}, expected 1-D <u4")
    try:
        bounds = read_idx(idx_path)
    except FileNotFoundError:
        return problems + [f"{idx_path}: missing"]
    except ValueError as e:
        return problems + [f"{idx_path}: {e}"]
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
            eos = np.flatnonzero(tokens == eos_token_id) + 1
            if len(eos) != len(ends) or np.any(eos.astype(np.uint64) != ends):
                problems.append(f"{npy_path}: EOS positions do not match {io.basename(idx_path)} "
                                f"({len(eos)} EOS, {len(ends)} documents; a double EOS or EOS inside a document)")
    elif n:
        problems.append(f"{idx_path}: no documents but {name} holds {n} tokens")
    return problems


def verify_manifest(manifest_path: str, checksums: bool = False) -> list[str]:
    """Every problem with a manifest and its shards ([] if none). Paths are named in each line."""
    try:
        manifest = io.read_json(manifest_path)
    except FileNotFoundError:
        return [f"{manifest_path}: missing"]
    except ValueError as e:
        return [f"{manifest_path}: not valid JSON ({e})"]
    root = io.dirname(manifest_path)
    eos = int(manifest.get("eos_token_id", 199999))
    problems: list[str] = []
    total_tokens = total_docs = 0
    for entry in manifest.get("shards", []):
        npy = io.join(root, entry["path"])
        idx = io.join(root, entry["index_path"])
        problems += check_shard(npy, idx, eos, entry["num_tokens"], entry["num_documents"])
        total_tokens += entry["num_tokens"]
        total_docs += entry["num_documents"]
        if checksums:
            for path, key in ((npy, "sha256"), (idx, "index_sha256")):
                if io.exists(path) and io.sha256_file(path) != entry[key]:
                    problems.append(f"{path}: sha256 does not match the manifest")
    if total_tokens != manifest.get("total_tokens") or total_docs != manifest.get("total_documents"):
        problems.append(f"{manifest_path}: totals ({manifest.get('total_tokens')} tokens, "
                        f"{manifest.get('total_documents')} docs) differ from the shards' sum "
                        f"({total_tokens}, {total_docs})")
    rows = manifest.get("rows", {})
    if rows and rows.get("read") != sum(rows.get(k, 0) for k in ("accepted", "empty", "rejected", "over_budget")):
        problems.append(f"{manifest_path}: row accounting does not add up: {rows}")
    listed = {io.join(root, e[k]) for e in manifest.get("shards", []) for k in ("path", "index_path")}
    for stray in find_shard_files(root):
        if stray not in listed:
            problems.append(f"{stray}: shard file not listed in the manifest")
    for tmp in io.find_temp_files(root):
        problems.append(f"{tmp}: stray temporary file (an interrupted write)")
    problems += verify_run_record(root, manifest, checksums)
    return problems


def verify_run_record(root: str, manifest: dict, checksums: bool = False) -> list[str]:
    """Problems with ``root/.refinery`` beside a manifest ([] if there is no run record,
    e.g. shards copied without it): every receipt of the recorded plan must verify, and the
    manifest must describe that plan (else the last run did not finish)."""
    from refinery.transforms.core.stages import META_DIR, verify_receipts

    run_json = io.join(root, META_DIR, "run.json")
    try:
        info = io.read_json(run_json)
    except FileNotFoundError:
        return []
    except ValueError as e:
        return [f"{run_json}: not valid JSON ({e})"]
    problems = verify_receipts(root, checksums)
    last = (info.get("stages") or [{}])[-1]
    if "plan_hash" in manifest and last.get("name") == "manifest" and last.get("stage_hash") != manifest["plan_hash"]:
        problems.append(f"{io.join(root, 'manifest.json')}: describes plan {manifest['plan_hash']}, but the last run "
                        f"({run_json}) planned {last.get('stage_hash')}: that run has not finished")
    return problems


def find_shard_files(root: str) -> list[str]:
    """Every ``.npy``/``.idx`` under the shard folders of an output root."""
    out = []
    for d in io.listdir(root):
        if io.basename(d).startswith("shard_"):
            out += [p for p in io.listdir(d) if p.endswith((".npy", ".idx"))]
    return out


def manifest_json(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=2) + "\n").encode()

