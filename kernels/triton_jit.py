"""``@triton.jit`` as mypy can read it: Triton ships no type information, so its decorator
would leave every kernel untyped.

    @jit                                   # @triton.jit
    def _kernel(x_ptr: tl.tensor, n: tl.tensor, BLOCK: tl.constexpr) -> None: ...

    @jit(do_not_specialize=["n"])          # @triton.jit(do_not_specialize=["n"])
    def ...

The kernel is what ``triton.jit`` returns, unchanged (a ``JITFunction``, or an
``InterpretedFunction`` under ``TRITON_INTERPRET=1``, decided here at decoration time as
Triton decides it); only its type is :class:`TritonKernel`. Kernel parameters are annotated
``tl.tensor`` (a value in a kernel: pointers and scalars alike) or ``tl.constexpr``: Triton
reads annotations, and these two mean to it what they meant before (nothing, and a
compile-time constant).
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, overload

import triton

Grid = tuple[int, ...]
"""A launch grid: programs along each axis."""


class TritonKernel(Protocol):
    """A ``@triton.jit`` function: launched as ``kernel[grid](*args)`` (in this package, through
    :func:`~.launches.launch`), or called from another kernel."""

    def __getitem__(self, grid: Grid) -> Callable[..., object]: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


@overload
def jit(fn: Callable[..., object], /) -> TritonKernel: ...


@overload
def jit(*, do_not_specialize: Sequence[str]) -> Callable[[Callable[..., object]], TritonKernel]: ...


def jit(fn: Callable[..., object] | None = None, /, *, do_not_specialize: Sequence[str] | None = None
        ) -> TritonKernel | Callable[[Callable[..., object]], TritonKernel]:
    """``triton.jit(fn)``, or ``triton.jit(do_not_specialize=...)`` as a decorator, typed."""
    if fn is not None:
        kernel: TritonKernel = triton.jit(fn)
        return kernel
    names = list(do_not_specialize or ())

    def decorate(f: Callable[..., object]) -> TritonKernel:
        kernel: TritonKernel = triton.jit(do_not_specialize=names)(f)
        return kernel

    return decorate
