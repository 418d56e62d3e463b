"""Counting kernel launches: torch operators that run a kernel, plus Triton kernel launches.

Host overhead per decode step is roughly (launches x a few microseconds), so the count is
the figure to drive down before any CUDA graph. It is measured the same way on any device:

* torch: a ``TorchDispatchMode`` sees every aten operator that reaches a backend; views,
  allocations and metadata-only operators (which launch nothing) are left out, and reading a
  device scalar back (``.item()``, ``.tolist()``) is counted apart as a host sync;
* Triton: every launch in this package goes through :func:`launch`, which tallies the kernel
  while a counter is active (Triton's own launch hooks do not fire under the interpreter).

    with LaunchCounter() as count:
        gen.step()
    count.total, count.triton, count.aten, count.by_name

On CPU, run the Triton kernels under ``TRITON_INTERPRET=1`` (see ``interpret``) to count what
the CUDA path would launch; the interpreter's own torch calls are hidden from the counter.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence, cast

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from .triton_jit import Grid, TritonKernel

if TYPE_CHECKING:
    class _DispatchMode:
        """What this module uses of torch's ``TorchDispatchMode``, typed (torch's is unannotated)."""

        def __init__(self) -> None: ...

        def __enter__(self) -> LaunchCounter: ...

        def __exit__(self, *exc: object) -> None: ...
else:
    _DispatchMode = TorchDispatchMode

# Operators that launch no kernel: allocation, aliasing and metadata.
_NO_LAUNCH = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach",
    "alias", "set_", "resize_", "_reshape_alias", "is_same_size", "sym_size", "sym_stride", "sym_numel",
    "sym_storage_offset", "record_stream", "is_pinned", "_pin_memory", "pin_memory", "promote_types",
    "result_type", "can_cast",
}
_SYNC = {"_local_scalar_dense", "equal", "is_nonzero"}

_ACTIVE: list["LaunchCounter"] = []


class LaunchCounter(_DispatchMode):
    """Counts launches while active (a context manager; nesting is allowed)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_name: Counter[str] = Counter()
        self.syncs = 0
        self.triton = 0
        self.aten = 0

    @property
    def total(self) -> int:
        """Kernel launches: aten operators that run one plus Triton launches."""
        return self.aten + self.triton

    def __enter__(self) -> "LaunchCounter":
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: Sequence[type], args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        name = func.overloadpacket.__name__
        if name in _SYNC:
            self.syncs += 1
        elif not (func.is_view or name in _NO_LAUNCH):
            self.aten += 1
            self.by_name[f"aten.{name}"] += 1
        return func(*args, **(kwargs or {}))

    def record_triton(self, name: str) -> None:
        self.triton += 1
        self.by_name[f"triton.{name}"] += 1

    def summary(self) -> dict[str, Any]:
        return {"total": self.total, "triton": self.triton, "aten": self.aten, "syncs": self.syncs,
                "by_name": dict(sorted(self.by_name.items()))}


def launch(kernel: TritonKernel, grid: Grid, *args: Any, **kwargs: Any) -> object:
    """``kernel[grid](*args, **kwargs)``, tallied by every active :class:`LaunchCounter`.

    The launch itself runs with the counters' dispatch modes switched off: under the
    interpreter Triton moves its arguments with torch calls that are not kernel launches.
    """
    if not _ACTIVE:
        return kernel[grid](*args, **kwargs)
    name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "kernel")
    for counter in _ACTIVE:
        counter.record_triton(str(name))
    with _disable_current_modes():
        return kernel[grid](*args, **kwargs)


@contextlib.contextmanager
def counting() -> Iterator[LaunchCounter]:
    """``with counting() as c: ...`` — a fresh :class:`LaunchCounter`."""
    with LaunchCounter() as counter:
        yield counter


def per_layer(model: torch.nn.Module, fn: Callable[[], Any]) -> tuple[Any, LaunchCounter, list[int]]:
    """Run ``fn()`` counting launches, and also per transformer block of ``model``
    (``model.block``): returns (fn's result, the whole count, launches inside each block)."""
    layer_counts: list[int] = []
    counter = LaunchCounter()
    starts: dict[int, int] = {}

    def before(module: torch.nn.Module, _args: object) -> None:
        starts[id(module)] = counter.total

    def after(module: torch.nn.Module, _args: object, _out: object) -> None:
        layer_counts.append(counter.total - starts.pop(id(module)))

    hooks = []
    blocks = cast("Iterable[torch.nn.Module]", model.block)  # a ModuleList (nn.Module's __getattr__: Tensor | Module)
    for block in blocks:
        hooks.append(block.register_forward_pre_hook(before))
        hooks.append(block.register_forward_hook(after))
    try:
        with counter:
            result = fn()
    finally:
        for h in hooks:
            h.remove()
    return result, counter, layer_counts
