"""Pause Python's cyclic garbage collector around loops that make many small objects."""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


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
