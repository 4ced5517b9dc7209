"""The native CPU paged decode-attention op (csrc/cpu_paged_decode.cpp), built once and cached.

`load()` compiles the op with torch.utils.cpp_extension (g++ and ninja; `make install` builds it ahead)
into torch's extension cache (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), keyed by the
source and flags, so later processes only load it. It is built for the host CPU (-march=native): the
cache is per machine. When the op cannot be built (no compiler, no ninja) or TANDEM_CPU_PAGED_ATTENTION=0,
`load()` returns None and the torch backend keeps its pure-torch decode path (same results, slower).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "cpu_paged_decode.cpp"
_NAME = "tandem_cpu_paged_decode"
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


@functools.cache
def load() -> ModuleType | None:
    """The compiled module (its `paged_decode(query, kv_cache, block_table, seq_lens, scale)`), or None
    when disabled or unbuildable (logged once)."""
    if not enabled():
        return None
    if not (_ensure_ninja_on_path() and shutil.which(os.environ.get("CXX", "c++"))):
        logger.warning("CPU paged attention: no ninja or C++ compiler; decode attention stays in torch")
        return None
    from torch.utils import cpp_extension

    try:
        module = cpp_extension.load(_NAME, [str(_SOURCE)], extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                                    verbose=False)
    except Exception as exc:  # a failed build must not stop the engine: the torch path is correct
        logger.warning("CPU paged attention did not build (%s); decode attention stays in torch", exc)
        return None
    logger.info("CPU paged attention: the native decode op is loaded")
    return module


if __name__ == "__main__":  # `python -m engine_svc.attention.cpu_paged`: build (or find) the cached op
    logging.basicConfig(level=logging.INFO)
    sys.exit(0 if load() is not None else 1)
