"""inference: the gpt-oss engine in Beam's RunInference, and generate's resumable stages.

    from refinery.transforms.inference import EngineSettings, GptOssModelHandler, KeyedGptOssModelHandler
    results = prompts | RunInference(KeyedGptOssModelHandler(GptOssModelHandler(EngineSettings("ckpt/"))))

The handler is :mod:`refinery.transforms.inference.handler`; generate's stages (infer ->
merge) are :mod:`refinery.transforms.inference.stages`. Importing this package imports
neither torch nor Beam's ML package: ``GptOssModelHandler`` and ``KeyedGptOssModelHandler``
(in :mod:`.model_handler`) are imported on first access.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from refinery.transforms.inference.handler import EngineSettings, GenerationParams, doc_seed

if TYPE_CHECKING:  # at run time, __getattr__ imports them when asked for
    from refinery.transforms.inference.model_handler import GptOssModelHandler, KeyedGptOssModelHandler

__all__ = ["EngineSettings", "GenerationParams", "GptOssModelHandler", "KeyedGptOssModelHandler", "doc_seed"]


def __getattr__(name: str) -> type[GptOssModelHandler] | type[KeyedGptOssModelHandler]:
    if name in ("GptOssModelHandler", "KeyedGptOssModelHandler"):  # their module imports Beam's ML package, and torch
        from refinery.transforms.inference import model_handler  # lazy: Beam's ML package and torch

        if name == "GptOssModelHandler":
            return model_handler.GptOssModelHandler
        return model_handler.KeyedGptOssModelHandler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
