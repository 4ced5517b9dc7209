"""Triton availability, and kernel launching that never imports triton before the first launch.

Why: `triton.jit` decides at *decoration* time whether a function runs compiled (GPU) or through the
CPU interpreter (`TRITON_INTERPRET=1`), and `import triton` decorates triton.language's own helpers
(tl.sum, tl.max, tl.cdiv, ...) right then. So the interpreter only works when TRITON_INTERPRET is set
before triton is first imported in the process.

Invariants kept here:
- importing `kernels.*` (or the triton attention backend) does not import triton;
- kernel bodies are plain functions wrapped in `LazyKernel`; at first launch it imports triton, binds
  the module-global `tl` of the kernel's module to `triton.language`, and jit-compiles, once per mode;
- launching under TRITON_INTERPRET when triton was imported before the variable was set raises a
  RuntimeError saying so (instead of triton's obscure "Cannot call @triton.jit'd outside ...").
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None

_MISSING_MSG = "triton is not installed: pip install 'tandem[triton]' or use --attention-backend torch"
_LATE_INTERPRET_MSG = (
    "TRITON_INTERPRET=1 was set after triton had been imported in this process; the triton interpreter "
    "needs it in the environment before the first `import triton` (e.g. at the top of tests/conftest.py)"
)


def require_triton() -> None:
    """Raise a RuntimeError with install advice when triton is not installed."""
    if not HAS_TRITON:
        raise RuntimeError(_MISSING_MSG)


def _triton() -> Any:
    require_triton()
    import triton

    return triton


def interpret_mode() -> bool:
    """Whether launches go through the CPU interpreter (imports triton; call at launch time only)."""
    return bool(_triton().knobs.runtime.interpret)


def interpreter_ready() -> bool:
    """False when TRITON_INTERPRET is on but triton.language was set up for compiled kernels."""
    if not interpret_mode():
        return True
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_triton().language.sum, InterpretedFunction)


def check_device(t: torch.Tensor) -> None:
    """Kernels need CUDA tensors, or CPU tensors under the interpreter; anything else is a clear error."""
    if t.device.type == "cpu" and not interpret_mode():
        raise RuntimeError(
            "triton kernels got CPU tensors: set TRITON_INTERPRET=1 to run them on CPU (slow) "
            "or use --attention-backend torch"
        )


class LazyKernel:
    """A kernel function jit-compiled at first launch, once per mode (compiled / interpreted).

    `kernel[grid](*args, **constexprs)` mirrors triton's launch syntax. The kernel's module must
    declare a global `tl` (placeholder); it is bound to `triton.language` here. `launches` counts
    launches from Python (CUDA-graph replays are not seen), so tests can prove a kernel ran.
    """

    def __init__(self, fn: Callable[..., None]) -> None:
        self._fn = fn
        self._jitted: dict[bool, Any] = {}
        self.launches = 0

    def __getitem__(self, grid: Sequence[int]) -> Callable[..., Any]:
        self.launches += 1
        triton = _triton()
        mode = interpret_mode()
        jitted = self._jitted.get(mode)
        if jitted is None:
            if not interpreter_ready():
                raise RuntimeError(_LATE_INTERPRET_MSG)
            self._fn.__globals__["tl"] = triton.language
            jitted = triton.jit(self._fn)
            self._jitted[mode] = jitted
        return jitted[tuple(grid)]


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << (max(n, 1) - 1).bit_length()
