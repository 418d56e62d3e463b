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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .ops import Kernels

KERNEL_MODULES = ("triton_moe", "triton_attention", "triton_norm", "triton_rope")


def interpreted_triton_kernels() -> Kernels:
    """``ops.triton_kernels()`` running in Triton's interpreter (sets ``TRITON_INTERPRET=1``
    for this process)."""
    os.environ["TRITON_INTERPRET"] = "1"
    importlib.import_module("triton.language")
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for name, module in list(sys.modules.items()):
        if name == "triton.language" or name.startswith("triton.language."):
            for attr, value in list(vars(module).items()):
                if isinstance(value, JITFunction):
                    setattr(module, attr, InterpretedFunction(value.fn))

    from . import ops

    # dependencies first: triton_attention imports names from triton_moe
    for short in KERNEL_MODULES:
        module = importlib.import_module(f"{__package__}.{short}")
        if any(isinstance(v, JITFunction) for v in vars(module).values()):
            importlib.reload(module)
    return ops.triton_kernels()
