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
MATH_HEADER = _CSRC / "cpu_math.h"  # the scalar helpers every native op includes (`build(headers=...)`)
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


def build_key(csrc: Path = _CSRC, name: str = _NAME, sources: tuple[str, ...] = _SOURCES,
              headers: tuple[str | Path, ...] = _HEADERS) -> str:
    """What a built module depends on, hashed: its name, the sources' and headers' names and bytes, the
    flags, torch's version, the Python ABI and the machine. The same for every clone of the same code on one
    machine (a header given by absolute path, e.g. `MATH_HEADER`, counts by its file name)."""
    digest = hashlib.sha256(name.encode() + b"\0")
    for file in (*sources, *headers):
        digest.update(Path(file).name.encode() + b"\0" + (csrc / file).read_bytes() + b"\0")
    for part in (*_FLAGS, torch.__version__, sys.implementation.cache_tag, platform.machine()):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def build_directory(csrc: Path = _CSRC, name: str = _NAME, sources: tuple[str, ...] = _SOURCES,
                    headers: tuple[str | Path, ...] = _HEADERS) -> Path:
    """The cache folder of one build: torch's extension cache, named by `build_key`."""
    from torch.utils import cpp_extension

    root = Path(cpp_extension._get_build_directory(name, verbose=False)).parent
    return root / f"{name}-{build_key(csrc, name, sources, headers)}"


@functools.cache
def load() -> ModuleType | None:
    """The native ops module (built on first use), or None when disabled or unbuildable. Functions:
    `paged_decode(...)`, `add_rms_norm_(x, residual, weight, eps)` / `rms_norm_(x, weight, eps)`
    (in place), `rotary_(x, positions, cos_sin_cache)` (in place), `silu_and_mul(x)`."""
    if not enabled():
        return None
    return load_from(_CSRC)


def load_from(csrc: Path) -> ModuleType | None:
    """The attention and small ops built from the sources in `csrc` (see `build`)."""
    module = build(_NAME, csrc, _SOURCES, _HEADERS, "attention and small ops")
    if module is not None:
        logger.info("native CPU ops loaded (paged decode attention, add + RMSNorm, RoPE, SiLU-and-mul)")
    return module


def build(name: str, csrc: Path, sources: tuple[str, ...], headers: tuple[str | Path, ...],
          fallback: str) -> ModuleType | None:
    """The extension `name` compiled from `sources` (files of `csrc`, which may include `headers`: files of
    `csrc`, or absolute paths such as `MATH_HEADER`, included by file name) with this
    module's flags: imported from its cache folder when any clone built it there, else compiled there first
    (the files are copied in, so the build never names a clone's path). None, logged with what stays in
    torch (`fallback`), when it cannot be built."""
    where = build_directory(csrc, name, sources, headers)
    built = _import_built(where, name)
    if built is not None:
        return built
    if not can_build():
        logger.warning("native CPU op %s: no ninja or C++ compiler; %s stay in torch", name, fallback)
        return None
    from torch.utils import cpp_extension

    try:
        copied = _copy_sources(csrc, (*sources, *headers), where / "src")
        return cpp_extension.load(name, [str(copied / s) for s in sources], extra_cflags=_FLAGS,
                                  extra_ldflags=["-fopenmp"], build_directory=str(where), verbose=False)
    except Exception as exc:  # a failed build must not stop the engine: the torch path is correct
        logger.warning("native CPU op %s did not build (%s); %s stay in torch", name, exc, fallback)
        return None


def _import_built(where: Path, name: str) -> ModuleType | None:
    """The module already built in `where`, imported without torch's builder (None when there is none)."""
    library = where / f"{name}.so"
    if not library.is_file():
        return None
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def _copy_sources(csrc: Path, files: tuple[str | Path, ...], into: Path) -> Path:
    """`files` (of `csrc`, or absolute paths) copied into `into` by file name (files whose bytes are already
    there are left alone, so their modification times stay); returns `into`."""
    into.mkdir(parents=True, exist_ok=True)
    for file in files:
        data = (csrc / file).read_bytes()
        target = into / Path(file).name
        if not target.is_file() or target.read_bytes() != data:
            tmp = target.with_suffix(target.suffix + f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            tmp.replace(target)
    return into


def for_tensor(x: torch.Tensor) -> ModuleType | None:
    """The native ops when they apply to `x` (a CPU float32 / bfloat16 tensor) and are built, else None."""
    if x.device.type != "cpu" or x.dtype not in _DTYPES:
        return None
    return load()


if __name__ == "__main__":  # `python -m engine_svc.attention.cpu_paged`: build (or find) the cached op
    logging.basicConfig(level=logging.INFO)
    sys.exit(0 if load() is not None else 1)
