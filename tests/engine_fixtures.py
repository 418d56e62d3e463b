"""Engine test helpers: the tiny random checkpoints (``refinery.kernels.tiny``) and the Triton
kernels in the interpreter.

Import only after ``pytest.importorskip("torch")``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from refinery.kernels.tiny import (  # noqa: F401
    TINY,
    hf_tensors,
    random_weights,
    tiny_config,
    write_harmony_checkpoint,
    write_hf,
    write_original,
)

if TYPE_CHECKING:
    from refinery.kernels.ops import Kernels


def interpreted_triton_kernels() -> Kernels:
    """``ops.triton_kernels()`` running in Triton's interpreter on CPU tensors (sets
    ``TRITON_INTERPRET=1`` for this process; see ``refinery.kernels.interpret``)."""
    from refinery.kernels.interpret import interpreted_triton_kernels as interpreted

    return interpreted()
