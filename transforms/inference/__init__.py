"""inference: the gpt-oss engine in Beam's RunInference, and generate's resumable stages.

    from refinery.transforms.inference import GptOssModelHandler, EngineSettings, GenerationParams
    results = prompts | RunInference(KeyedModelHandler(GptOssModelHandler(EngineSettings("ckpt/"))))

The handler is :mod:`refinery.transforms.inference.handler`; generate's stages (infer ->
merge) are :mod:`refinery.transforms.inference.stages`. Importing this package imports
neither torch nor Beam's ML package: ``GptOssModelHandler`` (in :mod:`.model_handler`) is
imported on first access.
"""
from __future__ import annotations

from refinery.transforms.inference.handler import EngineSettings, GenerationParams, doc_seed

__all__ = ["EngineSettings", "GenerationParams", "GptOssModelHandler", "doc_seed"]


def __getattr__(name: str):
    if name == "GptOssModelHandler":  # its module imports Beam's ML package, and torch
        from refinery.transforms.inference.model_handler import GptOssModelHandler

        return GptOssModelHandler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
