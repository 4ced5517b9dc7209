"""The native CPU ops (csrc/), built once and cached: paged decode attention (cpu_paged_decode.cpp) and
the fused small ops of a decoder layer, residual add + RMSNorm, RoPE and SiLU-and-mul (cpu_fused_ops.cpp).

`load()` compiles the op with torch.utils.cpp_extension (g++ and ninja; `make install` builds it ahead)
into a folder of torch's extension cache (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions) named
by what the build depends on: the sources' bytes, the flags, torch's version, the Python ABI and the
machine (`build_key`). Not by the checkout's path or its virtual environment: any clone of the same code
with the same torch loads the module `make install` of any other clone built, without compiling (the
sources are copied into that folder, so the build itself never names a clone's path either). It is built
for the host CPU (-march=native): the cache is per machine. When the op cannot be built (no compiler, no
ninja) or TANDEM_CPU_PAGED_ATTENTION=0, `load()` returns None and the torch backend and layers keep their
pure-torch paths (same results within rounding, slower). `for_tensor(x)` is the module when x is a CPU
float32/bfloat16 tensor and it is built.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = ("cpu_paged_decode.cpp", "cpu_fused_ops.cpp")  # compiled; cpu_math.h is included by both
_HEADERS = ("cpu_math.h",)
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


def build_key(csrc: Path = _CSRC) -> str:
    """What the built module depends on, hashed: the sources' and headers' bytes, the flags, torch's version,
    the Python ABI and the machine. The same for every clone of the same code on one machine."""
    digest = hashlib.sha256()
    for name in (*_SOURCES, *_HEADERS):
        digest.update(name.encode() + b"\0" + (csrc / name).read_bytes() + b"\0")
    for part in (*_FLAGS, torch.__version__, sys.implementation.cache_tag, platform.machine()):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def build_directory(csrc: Path = _CSRC) -> Path:
    """The cache folder of this build: torch's extension cache, named by `build_key`."""
    from torch.utils import cpp_extension

    root = Path(cpp_extension._get_build_directory(_NAME, verbose=False)).parent
    return root / f"{_NAME}-{build_key(csrc)}"


@functools.cache
def load() -> ModuleType | None:
    """The compiled module, or None when disabled or unbuildable (logged once). Its functions:
    `paged_decode(query, kv_cache, block_table, seq_lens, scale)`, `add_rms_norm_(x, residual, weight, eps)`
    (in place), `rotary_(x, positions, cos_sin_cache)` (in place), `silu_and_mul(x)`."""
    if not enabled():
        return None
    return load_from(_CSRC)


def load_from(csrc: Path) -> ModuleType | None:
    """The module built from the sources in `csrc`: imported from its cache folder when it was built there
    (by any clone), else compiled there first."""
    where = build_directory(csrc)
    built = _import_built(where)
    if built is not None:
        logger.info("native CPU ops loaded (paged decode attention, add + RMSNorm, RoPE, SiLU-and-mul)")
        return built
    if not (_ensure_ninja_on_path() and shutil.which(os.environ.get("CXX", "c++"))):
        logger.warning("native CPU ops: no ninja or C++ compiler; attention and small ops stay in torch")
        return None
    from torch.utils import cpp_extension

    try:
        sources = _copy_sources(csrc, where / "src")
        module = cpp_extension.load(_NAME, [str(s) for s in sources], extra_cflags=_FLAGS,
                                    extra_ldflags=["-fopenmp"], build_directory=str(where), verbose=False)
    except Exception as exc:  # a failed build must not stop the engine: the torch path is correct
        logger.warning("native CPU ops did not build (%s); attention and small ops stay in torch", exc)
        return None
    logger.info("native CPU ops built and loaded (paged decode attention, add + RMSNorm, RoPE, SiLU-and-mul)")
    return module


def _import_built(where: Path) -> ModuleType | None:
    """The module already built in `where`, imported without torch's builder (None when there is none)."""
    library = where / f"{_NAME}.so"
    if not library.is_file():
        return None
    if _NAME in sys.modules:
        return sys.modules[_NAME]
    spec = importlib.util.spec_from_file_location(_NAME, library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[_NAME] = module
    return module


def _copy_sources(csrc: Path, into: Path) -> list[Path]:
    """The sources and headers copied into `into` (files whose bytes are already there are left alone, so
    their modification times stay); the compiled sources' new paths."""
    into.mkdir(parents=True, exist_ok=True)
    for name in (*_SOURCES, *_HEADERS):
        data = (csrc / name).read_bytes()
        target = into / name
        if not target.is_file() or target.read_bytes() != data:
            tmp = target.with_suffix(target.suffix + f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            tmp.replace(target)
    return [into / name for name in _SOURCES]


def for_tensor(x: torch.Tensor) -> ModuleType | None:
    """The native ops when they apply to `x` (a CPU float32 / bfloat16 tensor) and are built, else None."""
    if x.device.type != "cpu" or x.dtype not in _DTYPES:
        return None
    return load()


if __name__ == "__main__":  # `python -m engine_svc.attention.cpu_paged`: build (or find) the cached op
    logging.basicConfig(level=logging.INFO)
    sys.exit(0 if load() is not None else 1)
