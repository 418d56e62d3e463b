"""File IO shared by every pipeline: local or ``gs://`` paths, atomic writes, input listing.

Reading rows out of data files is :mod:`refinery.transforms.core.rows`.

Paths are strings. A path with a scheme (``gs://``, ``hf://``, ``memory://``) goes through
fsspec (gcsfs, huggingface_hub); anything else is a local path.

Atomic writes: locally, data goes to a unique hidden temp name beside the target
(``.NAME.tmp-<uuid>``) and is moved into place with ``os.replace``; on an object store a
single object upload is atomic, so the object is uploaded once, from a local spool, only
after the writer finished without error. Object stores have no atomic rename; nothing
here relies on one.
"""
from __future__ import annotations

import contextlib
import fnmatch
import glob as globlib
import gzip
import hashlib
import io
import json
import logging
import os
import posixpath
import re
import shutil
import socket
import tempfile
import uuid
from dataclasses import dataclass
from typing import IO, Iterator

import fsspec

try:
    from compression import zstd  # Python 3.14+
except ImportError:
    from backports import zstd

DATA_SUFFIXES = (
    ".jsonl", ".jsonl.gz", ".jsonl.zst",
    ".json", ".json.gz", ".json.zst",
    ".parquet",
    ".arrow",  # Arrow IPC, as Hugging Face datasets' save_to_disk writes it
)
TMP_MARKER = ".tmp-"


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

    def __init__(self):
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


def filesystem(path: str):
    """(fsspec filesystem, path as that filesystem spells it); :class:`RemoteNotRead` for a
    remote path inside :func:`offline`.

    ``gs://``: gcsfs's listing cache is off. Receipts and outputs are written by other
    processes (workers, another run of the same command); a listing cached in this process
    would hide them (``info``/``exists``/``open`` consult it), so a just-written receipt
    would read as missing and a rerun would not see what finished.
    """
    if _OFFLINE and is_remote(path):
        raise RemoteNotRead(f"{path}: not read ({_OFFLINE[-1].reason})")
    if path.startswith(("gs://", "gcs://")):
        _quiet_gcsfs()
        return fsspec.core.url_to_fs(path, use_listings_cache=False)
    return fsspec.core.url_to_fs(path)


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
        return fs.exists(p)
    return os.path.exists(_local(path))


def isdir(path: str) -> bool:
    if is_remote(path):
        fs, p = filesystem(path)
        return fs.isdir(p)
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
        raw = fs.open(p, "rb")
    else:
        raw = open(_local(path), "rb")
    if compression == "infer" and has_suffix(path, ".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if compression == "infer" and has_suffix(path, ".zst"):
        return zstd.ZstdFile(raw, "rb")
    return raw


def read_bytes(path: str) -> bytes:
    with open_read(path) as f:
        return f.read()


def read_json(path: str):
    return json.loads(read_bytes(path))


def read_range(path: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of a file: one ranged read (a single request on an object store)."""
    if is_remote(path):
        fs, p = filesystem(path)
        data = fs.cat_file(p, start=start, end=end)
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


class PathError(ValueError):
    """An output path that cannot be used, or a removal that would leave the output folder
    through a symbolic link; the message names the path (the CLI prints it as one line)."""


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _link_out_of(path: str, root: str) -> str | None:
    """The symbolic link among the folders from ``root`` down to ``path`` (``path`` itself
    excluded) that leads out of ``root``, spelled from ``root``, or None. ``path`` must be
    inside ``root``."""
    root_abs, path_abs = os.path.abspath(_local(root)), os.path.abspath(_local(path))
    if not _inside(path_abs, root_abs) or path_abs == root_abs:
        raise PathError(f"refusing to remove {path}: it is not inside {root}")
    root_real = os.path.realpath(root_abs)
    current = _local(root)
    for part in os.path.relpath(os.path.dirname(path_abs), root_abs).split(os.sep):
        if part in ("", "."):
            continue
        current = os.path.join(current, part)
        if os.path.islink(current) and not _inside(os.path.realpath(current), root_real):
            return current
    return None


def _check_removal(path: str, root: str | None) -> None:
    """:class:`PathError` if removing local ``path`` would follow a link out of ``root``."""
    if root is None or is_remote(path):
        return
    link = _link_out_of(path, root)
    if link is not None:
        raise PathError(f"refusing to remove {path}: {link} is a symbolic link to {os.readlink(link)}, "
                        f"outside {root}; remove or replace that link yourself")


def remove(path: str, root: str | None = None) -> None:
    """Remove a file if it exists (a symbolic link itself, never what it points to).

    ``root``: the folder the file belongs to (a run's OUTPUT); a path reached through a
    symbolic link leading out of it raises :class:`PathError` naming the link.
    """
    _check_removal(path, root)
    if is_remote(path):
        fs, p = filesystem(path)
        with contextlib.suppress(FileNotFoundError):
            fs.rm(p)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(_local(path))


def remove_tree(path: str, root: str | None = None) -> None:
    """Remove a folder and everything in it (or a file), if it exists; errors are raised, not
    swallowed.

    Symbolic links are never followed: ``path`` being a link removes the link itself, links
    inside the tree are removed as links, and with ``root`` (the run's OUTPUT) a ``path``
    reached through a link leading out of ``root`` raises :class:`PathError` naming it.
    """
    _check_removal(path, root)
    if is_remote(path):
        fs, p = filesystem(path)
        if fs.exists(p):
            fs.rm(p, recursive=True)
        return
    local = _local(path)
    if os.path.islink(local):
        logging.getLogger("refinery").warning("removing the symbolic link %s itself (to %s); what it points to "
                                              "is left as it is", path, os.readlink(local))
        os.remove(local)
        return
    with contextlib.suppress(FileNotFoundError):
        if os.path.isdir(local):
            shutil.rmtree(local)
        else:
            os.remove(local)


def output_folder_problem(path: str, probe: bool = True) -> str | None:
    """Why ``path`` cannot be a local output folder (``path`` is a file, or lies under one, or
    under a broken link; no folder can be made there), or None. ``probe``: make and remove a
    hidden empty folder in the nearest existing folder, the one sure test that folders can be
    created there (permissions, read-only mounts, ``/proc``). Object stores have no folders:
    a remote path is never a problem here."""
    if is_remote(path):
        return None
    path = os.path.normpath(_local(path))
    existing = path
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing) or "."
    if os.path.islink(existing) and not os.path.exists(existing):
        return f"{existing} is a symbolic link to {os.readlink(existing)}, which does not exist"
    if not os.path.isdir(existing):
        return "is a file; give a folder (it is created if missing)" if existing == path \
            else f"{existing} is a file, not a folder"
    if probe:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".refinery-probe-", dir=existing))
        except OSError as e:
            return f"cannot create a folder in {existing} ({e.strerror or e})"
    return None


def _parts(path: str) -> tuple[str, list[str]]:
    """(scheme, path components): local paths resolved (links, ``..``), remote ones normalized."""
    if is_remote(path):
        scheme, rest = path.split("://", 1)
        return ("gs" if scheme == "gcs" else scheme), [p for p in posixpath.normpath("/" + rest).split("/") if p]
    return "", [p for p in os.path.realpath(_local(path)).split(os.sep) if p]


def listing_reaches(arg: str, folder: str) -> bool:
    """Whether listing the input ``arg`` (a file, folder or glob, as :func:`expand_inputs` takes
    it) could take in files under ``folder``: ``folder`` is ``arg`` or inside it, or lies
    where the glob's pattern could descend (``d/*.jsonl`` reaches ``d`` but not ``d/out``;
    ``d/**`` reaches everything under ``d``)."""
    if not globlib.has_magic(arg):
        scheme, a = _parts(arg)
        other, f = _parts(folder)
        return scheme == other and f[:len(a)] == a
    prefix, _, rest = arg.partition("://") if is_remote(arg) else ("", "", _local(arg))
    pieces = rest.split("/")
    first = next(i for i, piece in enumerate(pieces) if globlib.has_magic(piece))
    fixed = "/".join(pieces[:first]) or ("/" if rest.startswith("/") else ".")
    scheme, a = _parts(f"{prefix}://{fixed}" if prefix else fixed)
    pattern = [piece for piece in pieces[first:] if piece]
    other, f = _parts(folder)
    if scheme != other or f[:len(a)] != a:
        return False
    below = f[len(a):]  # the folder's names under the glob's fixed part, matched name by name
    if "**" in pattern:  # any depth past it
        matched = pattern[:pattern.index("**")]
    elif len(below) < len(pattern):  # a file below the folder is deep enough for the pattern
        matched = pattern[:len(below)]
    else:
        return False
    return all(fnmatch.fnmatchcase(name, pat) for name, pat in zip(below, matched))


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

    def write(self, data) -> int:
        mv = memoryview(data).cast("B")
        self._raw.write(mv)
        self._sha.update(mv)
        self.bytes_written += mv.nbytes
        return mv.nbytes

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()


@contextlib.contextmanager
def atomic_open(path: str) -> Iterator[HashingWriter]:
    """Write a file so that its final name holds either nothing or the whole content.

    Yields a :class:`HashingWriter`; its ``sha256``/``bytes_written`` describe the file
    after the block ends. On an exception inside the block nothing appears under ``path``.
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


def atomic_write_json(path: str, obj) -> tuple[int, str]:
    return atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


# ---------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class InputFile:
    """One input data file. ``relpath`` is relative to the root the user named."""

    path: str
    relpath: str
    size: int
    version: str  # mtime (local) or object generation (GCS): changes when the file does

    def fingerprint(self) -> dict:
        return {"path": self.path, "size": self.size, "version": self.version}


def has_suffix(path: str, *suffixes: str) -> bool:
    """Whether ``path`` ends with one of ``suffixes`` (lower case), in any case: ``C.JSONL`` is a ``.jsonl``."""
    return path.lower().endswith(suffixes)


def has_data_suffix(path: str, suffixes=DATA_SUFFIXES) -> bool:
    return has_suffix(path, *suffixes)


def skipped_note(skipped: list[str], shown: int = 5) -> str:
    """One line naming the files :func:`expand_inputs` skipped for their extension."""
    skipped = list(dict.fromkeys(skipped))
    names = ", ".join(skipped[:shown]) + (f" and {len(skipped) - shown} more" if len(skipped) > shown else "")
    return f"skipped {len(skipped)} file(s) with unsupported extensions: {names}"


def _version(info: dict) -> str:
    for key in ("generation", "mtime", "LastModified", "updated", "last_modified"):
        if info.get(key) not in (None, ""):
            return str(info[key])
    return ""


def _is_hidden(relpath: str) -> bool:
    return any(part.startswith((".", "_")) for part in relpath.split("/"))


def saved_dataset_files(folder: str) -> list[str] | None:
    """The ``.arrow`` files of a Hugging Face ``datasets`` folder written by ``save_to_disk``
    (the ``_data_files`` of its ``state.json``), or None if ``folder`` is not one. A saved
    ``DatasetDict`` (``dataset_dict.json``) raises :class:`InputError` naming its splits: give
    one split's folder."""
    folder = folder.rstrip("/")
    try:
        splits = read_json(join(folder, "dataset_dict.json")).get("splits", [])
    except (FileNotFoundError, ValueError):
        splits = None
    if splits is not None:
        example = join(folder, splits[0]) if splits else join(folder, "SPLIT")
        raise InputError(f"{folder}: a datasets DatasetDict saved with save_to_disk (splits: "
                         f"{', '.join(splits) or 'none'}); give one split's folder, e.g. {example}")
    if not exists(join(folder, "dataset_info.json")):
        return None
    try:
        state = read_json(join(folder, "state.json"))
        files = [join(folder, safe_relpath(f["filename"])) for f in state["_data_files"]]
    except (FileNotFoundError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"{folder}: a datasets save_to_disk folder without a usable state.json ({e})") from None
    return files


def expand_inputs(paths: list[str], suffixes=DATA_SUFFIXES, skipped: list[str] | None = None) -> list[InputFile]:
    """Files named by the user's arguments: files, folders (recursive) or globs.

    Folders and globs keep only files with a data suffix (in any case: ``a.JSONL``) and skip
    hidden names (``.x``, ``_SUCCESS``); the other files they hold are appended to
    ``skipped`` (for :func:`skipped_note`). A folder written by ``datasets``' ``save_to_disk``
    gives its ``.arrow`` files. A file named explicitly must have a data suffix. Results
    are sorted by path and unique. Raises :class:`InputError` naming any argument that
    matches nothing. Inside :func:`offline`, remote arguments are not listed but kept in its
    ``unlisted``.
    """
    skipped = [] if skipped is None else skipped
    found: dict[str, InputFile] = {}
    for arg in paths:
        if _OFFLINE and is_remote(arg):
            _OFFLINE[-1].unlisted.append(arg)
            continue
        fs, p = filesystem(arg)
        proto = arg.split("://", 1)[0] + "://" if is_remote(arg) else ""
        matches: list[tuple[str, str, dict]] = []  # (full path, relpath, info)
        if globlib.has_magic(p):
            root = p[: min(p.index(c) for c in "*?[" if c in p)].rsplit("/", 1)[0]
            for q, info in sorted(fs.glob(p, detail=True).items()):
                if info.get("type") == "directory":
                    continue
                rel = q[len(root):].lstrip("/")
                if _is_hidden(rel):
                    continue
                if has_data_suffix(q, suffixes):
                    matches.append((proto + q, rel, info))
                else:
                    skipped.append(proto + q)
        elif fs.isdir(p) and suffixes == DATA_SUFFIXES and (saved := saved_dataset_files(proto + p)) is not None:
            for q in saved:  # a datasets save_to_disk folder: the files its state.json lists
                matches.append((q, basename(q), filesystem(q)[0].info(filesystem(q)[1])))
        elif fs.isdir(p):
            for q, info in sorted(fs.find(p, detail=True).items()):
                rel = q[len(p.rstrip("/")):].lstrip("/")
                if _is_hidden(rel):
                    continue
                if has_data_suffix(q, suffixes):
                    matches.append((proto + q, rel, info))
                else:
                    skipped.append(proto + q)
        elif fs.exists(p):
            if not has_data_suffix(p, suffixes):
                raise InputError(f"{arg}: not a supported data file (expected one of {', '.join(suffixes)})")
            matches.append((proto + p if proto else _local(arg), basename(p), fs.info(p)))
        else:
            raise InputError(f"{arg}: no such file, folder or glob match")
        if not matches:
            raise InputError(f"{arg}: contains no data files ({', '.join(suffixes)})")
        for full, rel, info in matches:
            found.setdefault(full, InputFile(full, rel, int(info.get("size") or 0), _version(info)))
    return sorted(found.values(), key=lambda f: f.path)
