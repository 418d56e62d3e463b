"""Running this package's Triton kernels in Triton's interpreter, on CPU tensors.

For tests and for counting launches on a machine without a GPU (``bench/inference.py
--tiny``). Triton decides at decoration time whether a ``@triton.jit`` function is compiled or
interpreted, so :func:`interpreted_triton_kernels` sets ``TRITON_INTERPRET=1`` and switches
over what was imported before: triton's own language helpers (e.g. ``tl.zeros`` when
transformers imported triton first) are wrapped as interpreted functions, and this package's
kernel modules are reloaded.
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from . import ops
from .ops import Kernels

KERNEL_MODULES = ("triton_moe", "triton_attention", "triton_norm", "triton_rope")


def interpreted_triton_kernels() -> Kernels:
    """``ops.triton_kernels()`` running in Triton's interpreter (sets ``TRITON_INTERPRET=1``
    for this process)."""
    os.environ["TRITON_INTERPRET"] = "1"
    importlib.import_module("triton.language")
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    _index_scalars_as_triton_3_7()

    for name, module in list(sys.modules.items()):
        if name == "triton.language" or name.startswith("triton.language."):
            for attr, value in list(vars(module).items()):
                if isinstance(value, JITFunction):
                    setattr(module, attr, InterpretedFunction(value.fn))

    # dependencies first: triton_attention imports names from triton_moe
    for short in KERNEL_MODULES:
        module = importlib.import_module(f"{__package__}.{short}")
        if any(isinstance(v, JITFunction) for v in vars(module).values()):
            importlib.reload(module)
    return ops.triton_kernels()


def _index_scalars_as_triton_3_7() -> None:
    """Make Triton 3.6's interpreter index with a loaded scalar as 3.7's does.

    A loop bounded by loaded values (``range(lo, hi, BLOCK)`` in the attention kernels) calls
    the scalar's ``__index__``, which 3.6 writes as ``int(array)`` of a 1-element array, refused
    by NumPy >= 2.4 ("only 0-dimensional arrays can be converted to Python scalars"); 3.7
    squeezes the array first. The GPU image has Triton 3.6 (issue 45's lease: 40 kernel tests
    failed there for this alone). Newer Triton is left untouched."""
    import triton
    from triton.runtime import interpreter

    major_minor = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if major_minor >= (3, 7) or original is None or getattr(original, "__name__", "") == _SQUEEZING:
        return

    def _patch_lang_tensor_squeezing_index(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    vars(interpreter)["_patch_lang_tensor"] = _patch_lang_tensor_squeezing_index


_SQUEEZING = "_patch_lang_tensor_squeezing_index"
