"""The kernels' typed ``@jit`` (kernels/triton_jit.py) is ``@triton.jit``: the annotations that
type the kernels for mypy (``tl.tensor``) mean nothing to Triton, and ``tl.constexpr`` still
marks exactly the compile-time constants (``test_triton_compile`` builds them for a GPU)."""
from __future__ import annotations

import ast
import importlib.util
import inspect
from typing import Any

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from refinery.kernels import triton_attention, triton_moe, triton_norm, triton_rope  # noqa: E402
from refinery.kernels.triton_jit import jit  # noqa: E402

MODULES = (triton_moe, triton_attention, triton_norm, triton_rope)


def _kernels() -> list[tuple[str, Any]]:  # Triton's objects (untyped)
    return [(f"{m.__name__}.{name}", value) for m in MODULES for name, value in vars(m).items()
            if isinstance(value, (JITFunction, InterpretedFunction))]


def _declared_constexprs(fn: Any) -> list[str]:
    """The parameters the source annotates ``tl.constexpr``."""
    tree = ast.parse(inspect.getsource(fn).lstrip())
    node = tree.body[0]
    assert isinstance(node, ast.FunctionDef)
    return [a.arg for a in node.args.args if a.annotation is not None and ast.unparse(a.annotation) == "tl.constexpr"]


def test_every_kernel_is_tritons_own_object() -> None:
    kernels = _kernels()
    assert len(kernels) == 14, [name for name, _ in kernels]  # 8 MoE, 4 attention, a norm, a RoPE


@pytest.mark.parametrize("name", [name for name, _ in _kernels()])
def test_triton_reads_the_annotations_as_before(name: str) -> None:
    kernel = dict(_kernels())[name]
    fn = kernel.fn  # both kinds keep the Python function
    params = JITFunction(fn).params
    assert [p.name for p in params if p.is_constexpr] == _declared_constexprs(fn)
    assert [p.name for p in params if p.is_const or p.annotation_type] == []  # no pointer const, no forced type


def test_jit_keeps_do_not_specialize() -> None:
    def add(x_ptr: Any, n: Any) -> None:  # a stand-in kernel
        pass

    plain, fixed = jit(add), jit(do_not_specialize=["n"])(add)
    assert isinstance(plain, (JITFunction, InterpretedFunction))
    assert isinstance(fixed, type(plain))
    if isinstance(fixed, JITFunction):  # compiled mode: Triton keeps the list
        assert [p.name for p in fixed.params if p.do_not_specialize] == ["n"]
