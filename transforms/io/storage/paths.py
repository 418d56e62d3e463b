"""Paths, local or remote: one way to reach a file whatever its scheme, and read it.

A path is a string. One with a scheme (``gs://``, ``hf://``, ``memory://``) goes through
fsspec (gcsfs, huggingface_hub); anything else is a local path. Inside :func:`offline`
(a dry run) nothing remote is read.
"""
from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import posixpath
import sys
from dataclasses import dataclass
from typing import IO, Any, Iterator, cast

import fsspec

if sys.version_info >= (3, 14):
    from compression import zstd
else:  # setup.py installs backports.zstd before 3.14
    from backports import zstd

ZstdError = zstd.ZstdError  # damaged zstd content (rows.py counts it among the content errors)


class InputError(ValueError):
    """An input path or file that cannot be used; the message names it."""


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _local(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


class _OncePerMessage(logging.Filter):
    """Lets each distinct gcsfs bucket-type warning through once per process (gcsfs repeats
    "Could not determine bucket type" on every new client: on an emulator or without
    default credentials, dozens of times per run)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "bucket type" not in message and "storage layout" not in message:
            return True
        key = message.split(":", 1)[0]
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def _quiet_gcsfs() -> None:
    logger = logging.getLogger("gcsfs")
    if not any(isinstance(f, _OncePerMessage) for f in logger.filters):
        logger.addFilter(_OncePerMessage())


class RemoteNotRead(InputError):
    """A remote path touched while :func:`offline` is in force (a dry run)."""


@dataclass
class Offline:
    """While in force: why remote paths are not read, and the remote inputs left unlisted."""

    reason: str
    unlisted: list[str]


_OFFLINE: list[Offline] = []


@contextlib.contextmanager
def offline(reason: str) -> Iterator[Offline]:
    """Read nothing remote inside this block (a dry run touches no network): remote input
    arguments are not listed by :func:`expand_inputs` (they are kept in ``.unlisted``) and
    any other access to a remote path raises :class:`RemoteNotRead` naming it."""
    state = Offline(reason, [])
    _OFFLINE.append(state)
    try:
        yield state
    finally:
        _OFFLINE.remove(state)


def offline_state() -> Offline | None:
    """The :func:`offline` block in force, if any."""
    return _OFFLINE[-1] if _OFFLINE else None


def filesystem(path: str) -> tuple[Any, str]:
    """(fsspec filesystem, path as that filesystem spells it); :class:`RemoteNotRead` for a
    remote path inside :func:`offline`.

    ``gs://``: gcsfs's listing cache is off. Receipts and outputs are written by other
    processes (workers, another run of the same command); a listing cached in this process
    would hide them (``info``/``exists``/``open`` consult it), so a just-written receipt
    would read as missing and a rerun would not see what finished.
    """
    if _OFFLINE and is_remote(path):
        raise RemoteNotRead(f"{path}: not read ({_OFFLINE[-1].reason})")
    options = {}
    if path.startswith(("gs://", "gcs://")):
        _quiet_gcsfs()
        options["use_listings_cache"] = False
    fs, fs_path = fsspec.core.url_to_fs(path, **options)
    return fs, fs_path


def resolved(path: str) -> str:
    """A path as it names a file from anywhere: a local one absolute with links followed, a
    remote one as it is."""
    return path if is_remote(path) else os.path.realpath(_local(path))


def join(base: str, *parts: str) -> str:
    if is_remote(base):
        return posixpath.join(base, *parts)
    return os.path.join(_local(base), *parts)


def dirname(path: str) -> str:
    return posixpath.dirname(path) if is_remote(path) else os.path.dirname(_local(path))


def basename(path: str) -> str:
    return posixpath.basename(path.rstrip("/"))


def exists(path: str) -> bool:
    if is_remote(path):
        fs, p = filesystem(path)
        return bool(fs.exists(p))
    return os.path.exists(_local(path))


def isdir(path: str) -> bool:
    if is_remote(path):
        fs, p = filesystem(path)
        return bool(fs.isdir(p))
    return os.path.isdir(_local(path))


def file_size(path: str) -> int | None:
    """Size in bytes, or None if the file does not exist."""
    if is_remote(path):
        fs, p = filesystem(path)
        try:
            return int(fs.info(p)["size"])
        except FileNotFoundError:
            return None
    try:
        return os.stat(_local(path)).st_size
    except FileNotFoundError:
        return None


def open_read(path: str, compression: str | None = None) -> IO[bytes]:
    """A binary reader; ``compression='infer'`` decompresses ``.gz``/``.zst`` by suffix.

    Decompression is bounded per read: ``read(n)`` and ``readline(limit)`` decompress only
    about what they return (beside the decoder's own state: a zstd window is at most 128 MiB,
    zstd's default limit), so a small file that expands to gigabytes is never expanded in
    memory at once; a line is bounded only by the caller's limit. Every frame of a ``.zst``
    is read; a stream that ends mid-frame (a file cut short, an empty file) raises
    ``EOFError``, damaged content ``zstd.ZstdError``: a truncated file is reported, never
    taken as complete.
    """
    if is_remote(path):
        fs, p = filesystem(path)
        raw: IO[bytes] = fs.open(p, "rb")
    else:
        raw = open(_local(path), "rb")
    # GzipFile and ZstdFile are binary files, though typeshed does not call them IO[bytes]
    if compression == "infer" and has_suffix(path, ".gz"):
        return cast(IO[bytes], gzip.GzipFile(fileobj=raw, mode="rb"))
    if compression == "infer" and has_suffix(path, ".zst"):
        return cast(IO[bytes], zstd.ZstdFile(raw, "rb"))
    return raw


def read_bytes(path: str) -> bytes:
    with open_read(path) as f:
        return f.read()


def read_json(path: str) -> Any:
    return json.loads(read_bytes(path))


def read_range(path: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of a file: one ranged read (a single request on an object store)."""
    if is_remote(path):
        fs, p = filesystem(path)
        data: bytes = fs.cat_file(p, start=start, end=end)
    else:
        with open(_local(path), "rb") as f:
            f.seek(start)
            data = f.read(end - start)
    if len(data) != end - start:
        raise ValueError(f"{path}: wanted bytes {start}..{end}, the file ends at {start + len(data)}")
    return data


def safe_relpath(relpath: str) -> str:
    """``relpath`` normalized, if it stays inside the folder it is relative to; else ValueError.

    Receipts, manifests and checkpoint index files name files relative to a folder; one
    that names an absolute path, a ``..`` escape or a URL is refused, never followed.
    """
    if not isinstance(relpath, str) or not relpath or "\0" in relpath or "://" in relpath \
            or relpath.startswith(("/", "\\")) or (len(relpath) > 1 and relpath[1] == ":"):
        raise ValueError(f"refusing path {relpath!r}: not a relative path")
    norm = posixpath.normpath(relpath.replace("\\", "/"))
    if norm == ".." or norm.startswith("../") or norm == ".":
        raise ValueError(f"refusing path {relpath!r}: it leaves its folder")
    return norm


def listdir(path: str) -> list[str]:
    """Full paths of the entries directly under a directory ([] if it does not exist)."""
    if is_remote(path):
        fs, p = filesystem(path)
        try:
            names = fs.ls(p, detail=False)
        except FileNotFoundError:
            return []
        # Children are spelled from the parent as the caller spelled it, so that paths built
        # with join() and paths found by listing compare equal whatever the backend returns.
        return sorted(join(path, posixpath.basename(n.rstrip("/"))) for n in names)
    try:
        return sorted(os.path.join(_local(path), n) for n in os.listdir(_local(path)))
    except FileNotFoundError:
        return []


def has_suffix(path: str, *suffixes: str) -> bool:
    """Whether ``path`` ends with one of ``suffixes`` (lower case), in any case: ``C.JSONL`` is a ``.jsonl``."""
    return path.lower().endswith(suffixes)
