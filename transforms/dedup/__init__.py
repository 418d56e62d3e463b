"""dedup: exact and near-duplicate rows (MinHash), with provenance.

Public, composable PTransforms (see :mod:`refinery.transforms.dedup.beam`)::

    from refinery.transforms.dedup import DropDuplicates, FindDuplicates, MinHashSignatures

and ``DedupPipeline(config, inputs, output)``, the whole ``refinery dedup`` flow as one
composite. The arithmetic is in :mod:`.minhash` (words, shingles, signatures, Jaccard) and
:mod:`.graph` (buckets, pairs, components); the CLI's resumable stages (sign -> bucket ->
verify -> components -> report) in :mod:`.stages`. Importing this package does not import
Beam until a transform is used.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what __getattr__ hands out, as the type checker should see it
    from refinery.transforms.dedup.beam import DedupPipeline as DedupPipeline
    from refinery.transforms.dedup.beam import DropDuplicates as DropDuplicates
    from refinery.transforms.dedup.beam import Duplicate as Duplicate
    from refinery.transforms.dedup.beam import FindDuplicates as FindDuplicates
    from refinery.transforms.dedup.beam import MinHashSignatures as MinHashSignatures
    from refinery.transforms.dedup.beam import Signature as Signature

_TRANSFORMS = ("DedupPipeline", "DropDuplicates", "Duplicate", "FindDuplicates", "MinHashSignatures", "Signature")

__all__ = list(_TRANSFORMS)


def __getattr__(name: str) -> object:
    if name in _TRANSFORMS:
        from refinery.transforms.dedup import beam  # lazy: Beam is imported only when a transform is asked for

        return getattr(beam, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
