"""decon: train/test n-gram overlap with provenance (the HELM method).

Public, composable PTransforms (see :mod:`refinery.transforms.decon.beam`)::

    from refinery.transforms.decon import BuildNgramIndex, DropOverlaps, FindOverlaps

(``DropOverlaps`` leaves out the training rows ``FindOverlaps`` found),
and ``DeconPipeline(settings, output)``, the whole ``refinery decon`` flow as one composite.

The logic is in :mod:`refinery.transforms.decon.ngrams`; the CLI's resumable stages
(index -> scan -> reduce -> merge) are in :mod:`refinery.transforms.decon.stages`. Importing this
package does not import Beam until a transform is used.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what __getattr__ hands out, as the type checker should see it
    from refinery.transforms.decon.beam import BuildNgramIndex as BuildNgramIndex
    from refinery.transforms.decon.beam import DeconPipeline as DeconPipeline
    from refinery.transforms.decon.beam import DropOverlaps as DropOverlaps
    from refinery.transforms.decon.beam import FindOverlaps as FindOverlaps
    from refinery.transforms.decon.beam import Overlap as Overlap

_TRANSFORMS = ("BuildNgramIndex", "DeconPipeline", "DropOverlaps", "FindOverlaps", "Overlap")

__all__ = list(_TRANSFORMS)


def __getattr__(name: str) -> object:
    if name in _TRANSFORMS:
        from refinery.transforms.decon import beam  # lazy: Beam is imported only when a transform is asked for

        return getattr(beam, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
