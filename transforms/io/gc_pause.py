"""Pause Python's cyclic garbage collector around loops that make many small objects; give freed memory back."""
from __future__ import annotations

import contextlib
import gc
from typing import Callable, Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Automatic cyclic garbage collection off for a block, back on after it (if it was on).

    Loops that build or keep many small containers (tokenize's rows and token arrays, decon's
    index records and hit groups) make only acyclic objects, which reference counting frees;
    yet the many they keep alive trigger full collections that walk the whole heap again and
    again (about 2 s of a 200 MB prep in Beam's worker)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


_MALLOC_TRIM: list[Callable[[int], object] | None] = []  # [glibc's malloc_trim, or None where none], looked up once


def release_freed_memory() -> bool:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim(0)``); False where
    the C library has no such call (not glibc). Large buffers freed in the middle of the heap
    (a stage's cached partitions, 4 MB each) otherwise stay in the process's resident size,
    and the objects made next (Python's small objects: arenas of their own) are counted on top."""
    if not _MALLOC_TRIM:
        import ctypes

        try:
            _MALLOC_TRIM.append(ctypes.CDLL(None).malloc_trim)
        except (AttributeError, OSError):
            _MALLOC_TRIM.append(None)
    if _MALLOC_TRIM[0] is None:
        return False
    _MALLOC_TRIM[0](0)
    return True
