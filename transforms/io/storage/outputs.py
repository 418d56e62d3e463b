"""Output folders: whether a path can be one, and removal that never leaves it through a link."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile

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
