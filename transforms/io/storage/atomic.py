"""Atomic writes: a file's final name holds either nothing or the whole content.

Locally, data goes to a unique hidden temp name beside the target
(``.NAME.tmp-HOST-PID-UUID``) and is moved into place with ``os.replace``; on an object
store a single object upload is atomic, so the object is uploaded once, from a local
spool, only after the writer finished without error. Object stores have no atomic
rename; nothing here relies on one. Temp files of killed writers are found and removed
by the next run.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import socket
import tempfile
import uuid
from typing import IO, TYPE_CHECKING, Iterator, Protocol

from .paths import _local, basename, filesystem, is_remote, open_read

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

TMP_MARKER = ".tmp-"


class BinaryWriter(Protocol):
    """What a byte writer needs: ``write(bytes) -> int``. An open binary file, a
    :class:`HashingWriter` (not an ``IO[bytes]``) and an in-memory buffer all are one."""

    def write(self, data: ReadableBuffer, /) -> int: ...


def sha256_file(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open_read(path) as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class HashingWriter(io.RawIOBase):
    """Wraps a binary file; counts bytes and computes sha256 of everything written."""

    def __init__(self, raw: IO[bytes]):
        self._raw = raw
        self._sha = hashlib.sha256()
        self.bytes_written = 0

    def writable(self) -> bool:
        return True

    def write(self, data: ReadableBuffer) -> int:
        mv = memoryview(data).cast("B")
        self._raw.write(mv)
        self._sha.update(mv)
        self.bytes_written += mv.nbytes
        return mv.nbytes

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()


class AtomicGroup:
    """Local atomic writes made durable together (:func:`atomic_group`): each file of the
    group is written to its temp name and closed; at the group's end every one is fsynced at
    once (a thread each: the filesystem's journal commits them together, where one after
    another each waits for a commit of its own, 10-90 ms here), then each is moved into place
    and each folder fsynced once. Until then no final name holds any of them; if the group
    fails, none does."""

    def __init__(self) -> None:
        self.pending: list[tuple[str, str]] = []  # (temp path, final path)

    def commit(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        def sync(tmp: str) -> None:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        pending, self.pending = self.pending, []
        try:
            if len(pending) > 1:
                with ThreadPoolExecutor(min(len(pending), 16)) as pool:
                    list(pool.map(sync, [tmp for tmp, _ in pending]))
            elif pending:
                sync(pending[0][0])
            for tmp, path in pending:
                os.replace(tmp, path)
        except BaseException:
            self.discard(pending)
            raise
        folders = sorted({os.path.dirname(path) or "." for _, path in pending})
        for folder in folders:
            _fsync_dir(folder)

    def discard(self, pending: list[tuple[str, str]] | None = None) -> None:
        for tmp, _ in self.pending if pending is None else pending:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        if pending is None:
            self.pending = []


@contextlib.contextmanager
def atomic_group() -> Iterator[AtomicGroup]:
    """A group of :func:`atomic_open` writes (``atomic_open(path, group)``) made durable and
    moved into place together when the block ends without error (:class:`AtomicGroup`);
    on an error none of them appears."""
    group = AtomicGroup()
    try:
        yield group
    except BaseException:
        group.discard()
        raise
    group.commit()


@contextlib.contextmanager
def atomic_open(path: str, group: AtomicGroup | None = None) -> Iterator[HashingWriter]:
    """Write a file so that its final name holds either nothing or the whole content.

    Yields a :class:`HashingWriter`; its ``sha256``/``bytes_written`` describe the file
    after the block ends. On an exception inside the block nothing appears under ``path``.
    ``group`` (local files): the file is made durable and moved into place when the group
    commits (:func:`atomic_group`), with the group's other files, not when the block ends.
    """
    if is_remote(path):
        # One upload from a complete local spool (put_file: one request, or a resumable
        # upload finalized only at its end). Not fs.open(): its close() on an exception
        # (Ctrl-C mid-copy) would still commit the bytes written so far under ``path``.
        with tempfile.NamedTemporaryFile(prefix="refinery-upload-") as spool:
            writer = HashingWriter(spool)
            yield writer
            spool.flush()
            fs, p = filesystem(path)
            fs.put_file(spool.name, p)
        return
    path = _local(path)
    directory, name = os.path.split(path)
    os.makedirs(directory or ".", exist_ok=True)
    tmp = os.path.join(directory, temp_name(name))
    if group is not None:
        try:
            with open(tmp, "wb") as raw:
                yield HashingWriter(raw)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
            raise
        group.pending.append((tmp, path))
        return
    try:
        with open(tmp, "wb") as raw:
            writer = HashingWriter(raw)
            yield writer
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
        _fsync_dir(directory or ".")  # the rename itself survives a power loss
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def temp_name(name: str) -> str:
    """The hidden temp name a local atomic write of ``name`` uses: ``.NAME.tmp-HOST-PID-UUID``.

    Host and pid tell :func:`remove_dead_temp_files` whether the writer can still be alive.
    """
    host = socket.gethostname().replace("-", "_") or "host"
    return f".{name}{TMP_MARKER}{host}-{os.getpid()}-{uuid.uuid4().hex}"


def _fsync_dir(directory: str) -> None:
    with contextlib.suppress(OSError):  # some filesystems refuse fsync on a directory
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _pid_alive(pid: int) -> bool:
    """Whether a process of this host runs with that pid (a zombie, killed but not yet reaped
    by its parent, is dead: it writes nothing more)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<host>[^-/]+)-(?P<pid>\d+)-[0-9a-f]{32}$")


def is_temp_name(name: str) -> bool:
    """Whether a file name is one of ours (:func:`temp_name`): ``.NAME.tmp-HOST-PID-<32 hex>``.
    Nothing else is ever taken for a temp file (a user's ``draft.tmp-2024.txt`` is not)."""
    return TEMP_NAME.match(name) is not None


def temp_writer_dead(path: str) -> bool:
    """Whether the local temp file ``path`` (one of ours) belongs to a writer that is gone:
    written on this host by a pid that no longer runs. A temp of a live writer (a
    concurrent run) or of another host is never judged dead."""
    m = TEMP_NAME.match(basename(path))
    if m is None:
        return False
    host = socket.gethostname().replace("-", "_") or "host"
    return m["host"] == host and not _pid_alive(int(m["pid"]))


def find_temp_files(root: str) -> list[str]:
    """Every temp file (:func:`is_temp_name`) of an interrupted or running local write under
    ``root`` (recursive)."""
    if is_remote(root):
        return []  # object-store writes upload whole objects; no temp names appear there
    out = []
    for dirpath, _, names in os.walk(_local(root)):
        out += [os.path.join(dirpath, n) for n in names if is_temp_name(n)]
    return sorted(out)


def remove_dead_temp_files(root: str) -> list[str]:
    """Remove the temp files under ``root`` whose writer is dead (see :func:`temp_writer_dead`);
    returns their paths. Killed runs leave them; the next run calls this."""
    removed = []
    for path in find_temp_files(root):
        if temp_writer_dead(path):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            removed.append(path)
    return removed


def atomic_write_bytes(path: str, data: bytes) -> tuple[int, str]:
    """Atomically write ``data``; returns (bytes, sha256)."""
    with atomic_open(path) as f:
        f.write(data)
    return f.bytes_written, f.sha256


def atomic_write_json(path: str, obj: object) -> tuple[int, str]:
    return atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())
