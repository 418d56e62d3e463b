"""prep: corpora -> uint32 token shards.

Public, composable PTransforms (see :mod:`refinery.transforms.prep.beam`)::

    from refinery.transforms.prep import Normalize, Tokenize, AssignShard, WriteTokenShards

and ``PrepPipeline(config)``, the whole ``refinery prep`` flow as one composite.

and the element types they pass (:mod:`refinery.transforms.prep.documents`). The CLI's
resumable stages (:mod:`refinery.transforms.prep.stages`) call the same per-element code.
Importing this package does not import Beam until a transform is used.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from refinery.transforms.io.rows import SourceRow
from refinery.transforms.prep.documents import Document, Rejected, TokenizedDocument

if TYPE_CHECKING:  # what __getattr__ hands out, for the type checker
    from refinery.transforms.prep.beam import (
        AssignShard,
        Normalize,
        PrepPipeline,
        ReadRows,
        RejectedRowError,
        Tokenize,
        WriteTokenShards,
    )

_TRANSFORMS = ("AssignShard", "Normalize", "PrepPipeline", "ReadRows", "RejectedRowError", "Tokenize",
               "WriteTokenShards")

__all__ = ["AssignShard", "Document", "Normalize", "PrepPipeline", "ReadRows", "Rejected", "RejectedRowError",
           "SourceRow", "TokenizedDocument", "Tokenize", "WriteTokenShards"]  # _TRANSFORMS and the element types


def __getattr__(name: str) -> object:
    if name in _TRANSFORMS:
        from refinery.transforms.prep import beam  # lazy: importing the package must not import Beam

        return getattr(beam, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
