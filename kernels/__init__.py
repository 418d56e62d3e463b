"""refinery.kernels: the gpt-oss MXFP4 inference engine (torch; Triton kernels for CUDA in
``triton_moe``, ``triton_attention``, ``triton_norm`` and ``triton_rope``, chosen once per
model through ``ops``; launch counting in ``launches``; see docs/ENGINE.md for the decode step).

Importing this package does not import torch; the names below load on first use.

* :class:`Transformer` (``refinery.kernels.model``) and :class:`BatchedGenerator` (``refinery.kernels.batching``)
* :class:`ModelConfig` (``refinery.kernels.config``, torch-free)

Harmony prompt rendering and parsing is a token format: :mod:`refinery.transforms.formats.harmony`.
"""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Transformer": "model",
    "BatchedGenerator": "batching",
    "ModelConfig": "config",
    "load_config": "config",
    "Kernels": "ops",
    "kernels_for": "ops",
    "triton_kernels": "ops",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f"{__name__}.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
