"""Output folders: whether a path can be one, and removal that never leaves it through a link."""
from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import re
import shutil
import tempfile
from collections import deque

from .paths import _local, filesystem, is_remote


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


def remove_empty_folder(path: str, root: str | None = None) -> bool:
    """Remove a local folder if it is empty (an object store has no folders: nothing to do);
    whether it was removed."""
    _check_removal(path, root)
    if is_remote(path):
        return False
    try:
        os.rmdir(_local(path))
    except OSError:  # not empty, not there, or not a folder
        return False
    return True


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


RUN_MARKERS = ("manifest.json", ".refinery")  # what a run's output folder holds: prep's manifest, any run's record
SHARD_FOLDER = re.compile(r"shard_\d{4,}")  # prep's own shard folders: files only, never another run


def folders_holding(root: str, names: tuple[str, ...] = RUN_MARKERS, limit: int = 3,
                    max_listings: int | None = None) -> list[str]:
    """The first ``limit`` folders strictly below ``root`` that hold an entry named one of
    ``names`` (a run's output: :data:`RUN_MARKERS`), in breadth-first, sorted order; a folder
    found is not looked into. Bounded: hidden folders, links and prep's ``shard_NNNN`` folders
    are not descended into, and at most ``max_listings`` folders are listed (default 2,000
    local, 100 on an object store: one LIST call each), so a huge tree can hide a run deep in
    it, never stall the check."""
    remote = is_remote(root)
    budget = max_listings if max_listings is not None else (100 if remote else 2_000)
    found: list[str] = []
    queue = deque([root.rstrip("/") or root])
    first = True
    while queue and budget > 0 and len(found) < limit:
        folder = queue.popleft()
        budget -= 1
        entries = _entries(folder)
        if not first and any(name in names for name, _ in entries):
            found.append(folder)
            continue
        first = False
        queue += [path for name, path in entries
                  if path and not name.startswith(".") and not SHARD_FOLDER.fullmatch(name)]
    return found


def _entries(folder: str) -> list[tuple[str, str]]:
    """(name, path if it is a folder to descend into else "") of each entry of ``folder``,
    sorted by name; [] for a folder that cannot be listed."""
    if is_remote(folder):
        fs, p = filesystem(folder)
        try:
            infos = fs.ls(p, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        for info in infos:
            name = posixpath.basename(str(info["name"]).rstrip("/"))
            out.append((name, posixpath.join(folder, name) if info.get("type") == "directory" else ""))
        return sorted(out)
    try:
        with os.scandir(_local(folder)) as it:
            return sorted((e.name, e.path if e.is_dir(follow_symlinks=False) else "") for e in it)
    except OSError:
        return []


def runs_above(path: str, names: tuple[str, ...] = RUN_MARKERS) -> list[str]:
    """``path``'s parent folders (nearest first) that hold an entry named one of ``names``: the
    runs whose output ``path`` lies inside. A local path is resolved (links, ``..``) first; an
    object store's parents are its prefixes up to the bucket (two lookups a level)."""
    if is_remote(path):
        scheme, rest = path.split("://", 1)
        parts = [p for p in posixpath.normpath("/" + rest).split("/") if p]
        parents = [f"{scheme}://{'/'.join(parts[:k])}" for k in range(len(parts) - 1, 0, -1)]
    else:
        current = os.path.realpath(_local(path))
        parents = []
        while (parent := os.path.dirname(current)) != current:
            parents.append(parent)
            current = parent
    return [p for p in parents if any(_has_entry(p, name) for name in names)]


def _has_entry(folder: str, name: str) -> bool:
    if is_remote(folder):
        fs, p = filesystem(folder)
        return bool(fs.exists(posixpath.join(p, name)))
    return os.path.lexists(os.path.join(folder, name))
