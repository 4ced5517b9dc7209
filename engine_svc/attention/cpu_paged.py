"""The native CPU ops (csrc/), built once and cached: paged decode attention (cpu_paged_decode.cpp) and
the fused small ops of a decoder layer, residual add + RMSNorm, RoPE and SiLU-and-mul (cpu_fused_ops.cpp).

`load()` compiles the op with torch.utils.cpp_extension (g++ and ninja; `make install` builds it ahead)
into torch's extension cache (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), keyed by the
source and flags, so later processes only load it. It is built for the host CPU (-march=native): the
cache is per machine. When the op cannot be built (no compiler, no ninja) or TANDEM_CPU_PAGED_ATTENTION=0,
`load()` returns None and the torch backend and layers keep their pure-torch paths (same results within
rounding, slower). `for_tensor(x)` is the module when x is a CPU float32/bfloat16 tensor and it is built.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [_CSRC / "cpu_paged_decode.cpp", _CSRC / "cpu_fused_ops.cpp"]  # + cpu_math.h, included by both
_DTYPES = (torch.float32, torch.bfloat16)
_NAME = "tandem_cpu_ops"
# -fopenmp: at::parallel_for is an OpenMP region compiled into the op (torch's CPU wheel parallelises with
# OpenMP); without it the op runs on one thread. The op links libgomp.so.1, the runtime torch already loaded.
_FLAGS = ["-O3", "-march=native", "-fopenmp"]


def enabled() -> bool:
    """False when TANDEM_CPU_PAGED_ATTENTION=0 asks for the pure-torch decode path."""
    return os.environ.get("TANDEM_CPU_PAGED_ATTENTION", "1") != "0"


def _ensure_ninja_on_path() -> bool:
    """torch's builder runs `ninja` from PATH; the venv's ninja (pip package) is found beside python."""
    if shutil.which("ninja"):
        return True
    venv_bin = Path(sys.executable).parent
    if (venv_bin / "ninja").exists():
        os.environ["PATH"] = f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"
        return True
    return False


def can_build() -> bool:
    """Whether ninja and a C++ compiler are there to build native ops."""
    return _ensure_ninja_on_path() and shutil.which(os.environ.get("CXX", "c++")) is not None


@functools.cache
def load() -> ModuleType | None:
    """The compiled module, or None when disabled or unbuildable (logged once). Its functions:
    `paged_decode(query, kv_cache, block_table, seq_lens, scale)`, `add_rms_norm_(x, residual, weight, eps)`
    (in place), `rotary_(x, positions, cos_sin_cache)` (in place), `silu_and_mul(x)`."""
    if not enabled():
        return None
    if not can_build():
        logger.warning("native CPU ops: no ninja or C++ compiler; attention and small ops stay in torch")
        return None
    module = build(_NAME, _SOURCES, "attention and small ops")
    if module is not None:
        logger.info("native CPU ops loaded (paged decode attention, add + RMSNorm, RoPE, SiLU-and-mul)")
    return module


def build(name: str, sources: list[Path], fallback: str) -> ModuleType | None:
    """Compile (or find in the cache) the extension `name` from `sources` with this module's flags; None,
    logged with what stays in torch (`fallback`), when it cannot be built."""
    from torch.utils import cpp_extension

    try:
        return cpp_extension.load(name, [str(p) for p in sources], extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                                  verbose=False)
    except Exception as exc:  # a failed build must not stop the engine: the torch path is correct
        logger.warning("native CPU op %s did not build (%s); %s stay in torch", name, exc, fallback)
        return None


def for_tensor(x: torch.Tensor) -> ModuleType | None:
    """The native ops when they apply to `x` (a CPU float32 / bfloat16 tensor) and are built, else None."""
    if x.device.type != "cpu" or x.dtype not in _DTYPES:
        return None
    return load()


if __name__ == "__main__":  # `python -m engine_svc.attention.cpu_paged`: build (or find) the cached op
    logging.basicConfig(level=logging.INFO)
    sys.exit(0 if load() is not None else 1)
