"""Input listing: the data files a user's arguments (files, folders, globs) name."""
from __future__ import annotations

import fnmatch
import glob as globlib
import logging
import os
import posixpath
import stat
from dataclasses import dataclass
from typing import Any, Iterable

from .paths import (
    InputError,
    _local,
    basename,
    exists,
    filesystem,
    has_suffix,
    is_remote,
    join,
    offline_state,
    read_json,
    safe_relpath,
)

DATA_SUFFIXES = (
    ".jsonl", ".jsonl.gz", ".jsonl.zst",
    ".json", ".json.gz", ".json.zst",
    ".parquet",
    ".arrow",  # Arrow IPC, as Hugging Face datasets' save_to_disk writes it
)


@dataclass(frozen=True)
class InputFile:
    """One input data file. ``relpath`` is relative to the root the user named."""

    path: str
    relpath: str
    size: int
    version: str  # mtime (local) or object generation (GCS): changes when the file does

    def fingerprint(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "version": self.version}


def has_data_suffix(path: str, suffixes: tuple[str, ...] = DATA_SUFFIXES) -> bool:
    return has_suffix(path, *suffixes)


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


def skipped_note(skipped: list[str], shown: int = 5) -> str:
    """One line naming the files :func:`expand_inputs` skipped for their extension."""
    skipped = list(dict.fromkeys(skipped))
    names = ", ".join(skipped[:shown]) + (f" and {len(skipped) - shown} more" if len(skipped) > shown else "")
    return f"skipped {len(skipped)} file(s) with unsupported extensions: {names}"


def _version(info: dict[str, Any]) -> str:
    for key in ("generation", "mtime", "LastModified", "updated", "last_modified"):
        if info.get(key) not in (None, ""):
            return str(info[key])
    return ""


def _target_info(path: str, info: dict[str, Any]) -> dict[str, Any]:
    """``info`` of a local file with its size, mtime and type taken from what it names: a
    symbolic link's target, never the link itself. THE rule of a file's fingerprint, so that
    a listing (fsspec's folder listings stat a link without following it) and a later check
    of the one file agree, and an edit of a link's target changes its fingerprint. A dangling
    link keeps its own info (reading it fails its unit, naming it)."""
    if not info.get("islink") or is_remote(path):
        return info
    try:
        st = os.stat(_local(path))
    except OSError:
        return info
    kind = "directory" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else "other"
    return {**info, "size": st.st_size, "mtime": st.st_mtime, "type": kind}


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


def normalized_local(path: str) -> str:
    """The absolute local ``path`` (a glob's too) written without ``.`` and ``..`` components
    (``/home/me/refinery/../data/x`` -> ``/home/me/data/x``) when that names the same place, else
    as it is: past a link to a folder, ``link/..`` is the target's parent, which the spelling
    does not say."""
    if not any(part in (".", "..") for part in path.split("/")):
        return path
    norm = os.path.normpath(path)
    magic = [path.index(c) for c in "*?[" if c in path]
    fixed = path[: min(magic)].rsplit("/", 1)[0] if magic else path  # the part no glob expands
    fixed_norm = norm[: min(norm.index(c) for c in "*?[" if c in norm)].rsplit("/", 1)[0] if magic else norm
    return norm if os.path.realpath(fixed or "/") == os.path.realpath(fixed_norm or "/") else path


def expand_inputs(paths: list[str], suffixes: tuple[str, ...] = DATA_SUFFIXES,
                  skipped: list[str] | None = None) -> list[InputFile]:
    """Files named by the user's arguments: files, folders (recursive) or globs.

    Folders and globs keep only files with a data suffix (in any case: ``a.JSONL``) and skip
    hidden names (``.x``, ``_SUCCESS``); the other files they hold are appended to
    ``skipped`` (for :func:`skipped_note`). A folder written by ``datasets``' ``save_to_disk``
    gives its ``.arrow`` files. A file named explicitly must have a data suffix. Results
    are sorted by path and unique, one per file however spelled (:func:`one_per_file`: a
    warning line names a file named twice). Raises :class:`InputError` naming any argument that
    matches nothing. Inside :func:`offline`, remote arguments are not listed but kept in its
    ``unlisted``.
    """
    skipped = [] if skipped is None else skipped
    found: list[InputFile] = []
    for arg in paths:
        if (state := offline_state()) is not None and is_remote(arg):
            state.unlisted.append(arg)
            continue
        fs, p = filesystem(arg)
        proto = arg.split("://", 1)[0] + "://" if is_remote(arg) else ""
        if not proto:  # fsspec lists a local folder as cwd + what was typed: ``/home/me/refinery/../data/x``
            p = normalized_local(p)
        matches: list[tuple[str, str, dict[str, Any]]] = []  # (full path, relpath, info)

        def listed(q: str, rel: str, info: dict[str, Any]) -> None:
            """A file a folder or glob listed: kept, skipped for its suffix (or a link to a
            folder, which listings do not follow), or hidden."""
            if _is_hidden(rel):
                return
            if info.get("type") == "directory":
                skipped.append(proto + q + "/")
                return
            if has_data_suffix(q, suffixes):
                matches.append((proto + q, rel, info))
            else:
                skipped.append(proto + q)

        if globlib.has_magic(p):
            root = p[: min(p.index(c) for c in "*?[" if c in p)].rsplit("/", 1)[0]
            for q, info in sorted(fs.glob(p, detail=True).items()):
                if info.get("type") != "directory":
                    listed(q, q[len(root):].lstrip("/"), _target_info(proto + q, info))
        elif fs.isdir(p) and suffixes == DATA_SUFFIXES and (saved := saved_dataset_files(proto + p)) is not None:
            for q in saved:  # a datasets save_to_disk folder: the files its state.json lists
                matches.append((q, basename(q), filesystem(q)[0].info(filesystem(q)[1])))
        elif fs.isdir(p):
            for q, info in sorted(fs.find(p, detail=True).items()):
                listed(q, q[len(p.rstrip("/")):].lstrip("/"), _target_info(proto + q, info))
        elif fs.exists(p):
            if not has_data_suffix(p, suffixes):
                raise InputError(f"{arg}: not a supported data file (expected one of {', '.join(suffixes)})")
            matches.append((proto + p if proto else _local(arg), basename(p), fs.info(p)))
        else:
            raise InputError(f"{arg}: no such file, folder or glob match")
        if not matches:
            raise InputError(f"{arg}: contains no data files ({', '.join(suffixes)})")
        for full, rel, info in matches:
            info = _target_info(full, info)
            found.append(InputFile(full, rel, int(info.get("size") or 0), _version(info)))
    return one_per_file(found)


def file_identity(path: str) -> tuple[str | int, ...]:
    """What makes two spellings one file: a local file's device and inode (links followed: a
    link and its target, a hard link, ``a/../a/x`` are one), its resolved path when it cannot
    be stat'ed (a dangling link); a remote object's path, its scheme's aliases as one."""
    if is_remote(path):
        scheme, rest = path.split("://", 1)
        return ("remote", "gs" if scheme == "gcs" else scheme, rest)
    try:
        st = os.stat(_local(path))
    except OSError:
        return ("path", os.path.realpath(_local(path)))
    return ("file", st.st_dev, st.st_ino)


def spelling_order(f: InputFile) -> tuple[int, str, bool, int, str]:
    """Which of one file's spellings is kept: the shortest relpath (what ``relpath:row`` ids are
    made of), then one that is the file's own path (no link, no ``..`` on the way), then the
    shortest path, then the first in order: the same one whatever the order of the arguments."""
    own = is_remote(f.path) or os.path.abspath(_local(f.path)) == os.path.realpath(_local(f.path))
    return (len(f.relpath), f.relpath, not own, len(f.path), f.path)


def one_per_file(files: Iterable[InputFile], shown: int = 3) -> list[InputFile]:
    """``files``, one per file however it is spelled (:func:`file_identity`), sorted by path. Of a
    file named several ways the spelling :func:`spelling_order` puts first is kept, and one
    warning line (for all of them) names the others: read twice, its rows would be two
    documents each."""
    by_file: dict[tuple[str | int, ...], list[InputFile]] = {}
    for f in files:
        by_file.setdefault(file_identity(f.path), []).append(f)
    kept, twice = [], []
    for spellings in by_file.values():
        spellings = sorted(set(spellings), key=spelling_order)
        kept.append(spellings[0])
        if len({f.path for f in spellings}) > 1:
            twice.append(f"{spellings[0].path} (also {', '.join(f.path for f in spellings[1:])})")
    if twice:
        logging.getLogger("refinery").warning(
            "%d input file(s) named more than once, each read once, as its first spelling here: %s%s", len(twice),
            "; ".join(sorted(twice)[:shown]), f"; and {len(twice) - shown} more" if len(twice) > shown else "")
    return sorted(kept, key=lambda f: f.path)
