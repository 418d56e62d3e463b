"""bpe-openai's encoder: tiktoken's exact tokens from GitHub's Rust ``bpe`` crate, a document
at a time (``--encoder bpe-openai``, and the fast encoder's fallback where gigatoken is not
usable)."""
from __future__ import annotations

import functools
import hashlib
import json
import logging
from array import array
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable

from refinery.transforms.formats.tokenizer_choice import (
    _PROBE_SHA256,
    _PROBES,
    FAST_ENCODINGS,
    PrepTokenizer,
    TiktokenTokenizer,
    TokenizerSpec,
)

if TYPE_CHECKING:
    from tiktoken import Encoding


class FastTiktokenTokenizer(TiktokenTokenizer):
    """tiktoken's exact tokens from bpe-openai's Rust BPE (GitHub's ``bpe`` crate): about 1.3x
    tiktoken's speed on one core, and linear on long runs without spaces. A document it
    cannot take (it raises) is encoded by tiktoken instead, counted in ``fallbacks``. tiktoken
    itself (``enc``) is loaded only when needed: a fallback, or ``decode``."""

    _enc: Encoding | Callable[[], Encoding]

    def __init__(self, spec: TokenizerSpec, enc: Encoding | Callable[[], Encoding], fast: Any):
        PrepTokenizer.__init__(self, spec)
        self.enc = enc  # tiktoken, or what loads it on first use
        self.fast = fast
        self.fallbacks = 0

    @property
    def enc(self) -> Encoding:
        if callable(self._enc):
            self._enc = self._enc()
        return self._enc

    @enc.setter
    def enc(self, value: Encoding | Callable[[], Encoding]) -> None:
        self._enc = value

    def encode(self, text: str) -> array[int]:
        try:
            return array("I", self.fast.encode(text))
        except Exception:  # noqa: BLE001 - whatever the fast encoder refuses, tiktoken encodes
            self.fallbacks += 1
            return super().encode(text)

    encode_flat = PrepTokenizer.encode_flat  # each text by :meth:`encode` (not tiktoken's own loop)


@functools.lru_cache(maxsize=1)
def _bpe_bindings() -> ModuleType:
    """bpe-openai's Rust extension module, loaded by itself: importing the ``bpe_openai``
    package first would build its Python tiktoken shims, parsing three vocab files (about a
    second per process) that the Rust encoder does not use."""
    import importlib.machinery
    import importlib.util
    from pathlib import Path

    package = importlib.util.find_spec("bpe_openai")
    if package is None or not package.submodule_search_locations:
        raise ImportError("bpe-openai is not installed")
    folder = Path(list(package.submodule_search_locations)[0])
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = folder / f"_bindings{suffix}"
        if path.exists():
            loader = importlib.machinery.ExtensionFileLoader("bpe_openai._bindings", str(path))
            spec = importlib.util.spec_from_loader(loader.name, loader)
            if spec is None:
                raise ImportError(f"{path}: no module spec for bpe_openai._bindings")
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
            return module
    raise ImportError(f"no bpe_openai._bindings extension in {folder}")


def _fast_backend(spec: TokenizerSpec) -> Any:
    """bpe-openai's encoder for ``spec``'s encoding, if installed, known to it and giving
    tiktoken's tokens on :data:`_PROBES`; else None (tiktoken is used)."""
    name = FAST_ENCODINGS.get(spec.name) if spec.kind == "tiktoken" else None
    if name is None:
        return None
    try:
        fast = _bpe_bindings().tokenizer_for_encoding(name)
        tokens = json.dumps([list(fast.encode(p)) for p in _PROBES]).encode()
        if hashlib.sha256(tokens).hexdigest() == _PROBE_SHA256[name]:
            return fast
    except Exception:  # noqa: BLE001 - no usable fast encoder: tiktoken alone
        pass
    logging.getLogger("refinery").warning("bpe-openai's encoder is not usable for %s here; encoding with tiktoken",
                                          spec.name)
    return None
