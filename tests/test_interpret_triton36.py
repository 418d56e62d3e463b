"""The interpreter shim for Triton 3.6 (the GPU image's): a loaded scalar indexes as in 3.7."""
from __future__ import annotations

import types

import numpy as np
import pytest

pytest.importorskip("triton")

from refinery.kernels import interpret  # noqa: E402


class _Scope:
    def set_attr(self, cls: type, name: str, value: object) -> None:
        setattr(cls, name, value)


def _fake_interpreter(version: str, monkeypatch: pytest.MonkeyPatch) -> tuple[type, types.ModuleType]:
    import triton
    from triton.runtime import interpreter

    class Tensor:
        def __init__(self, data: np.ndarray) -> None:
            self.handle = types.SimpleNamespace(data=data)

    def patch_lang_tensor_3_6(tensor: type, scope: _Scope) -> None:  # what Triton 3.6 sets
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    monkeypatch.setattr(triton, "__version__", version)
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor_3_6)
    return Tensor, interpreter


def test_triton_3_6_indexes_a_one_element_array(monkeypatch: pytest.MonkeyPatch) -> None:
    tensor, interpreter = _fake_interpreter("3.6.0", monkeypatch)
    interpreter._patch_lang_tensor(tensor, _Scope())
    with pytest.raises(TypeError, match="0-dimensional"):  # NumPy >= 2.4 refuses, as on the device
        list(range(tensor(np.array([2]))))
    interpret._index_scalars_as_triton_3_7()
    interpreter._patch_lang_tensor(tensor, _Scope())
    assert list(range(tensor(np.array([2])), 4)) == [2, 3]
    patched = interpreter._patch_lang_tensor
    interpret._index_scalars_as_triton_3_7()  # twice: wrapped once
    assert interpreter._patch_lang_tensor is patched


def test_newer_triton_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    _, interpreter = _fake_interpreter("3.7.1", monkeypatch)
    before = interpreter._patch_lang_tensor
    interpret._index_scalars_as_triton_3_7()
    assert interpreter._patch_lang_tensor is before
