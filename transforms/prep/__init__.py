"""prep: corpora -> uint32 token shards.

Public, composable PTransforms (see :mod:`refinery.transforms.prep.beam`)::

    from refinery.transforms.prep import Normalize, Tokenize, AssignShard, WriteTokenShards

and ``PrepPipeline(config)``, the whole ``refinery prep`` flow as one composite.

and the element types they pass (:mod:`refinery.transforms.prep.documents`). The CLI's
resumable stages (:mod:`refinery.transforms.prep.stages`) call the same per-element code.
Importing this package does not import Beam until a transform is used.
"""
from __future__ import annotations

from refinery.transforms.io.rows import SourceRow
from refinery.transforms.prep.documents import Document, Rejected, TokenizedDocument

_TRANSFORMS = ("AssignShard", "Normalize", "PrepPipeline", "ReadRows", "RejectedRowError", "Tokenize",
               "WriteTokenShards")

__all__ = ["Document", "Rejected", "SourceRow", "TokenizedDocument", *_TRANSFORMS]


def __getattr__(name: str):
    if name in _TRANSFORMS:
        from refinery.transforms.prep import beam

        return getattr(beam, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
