"""The native CPU ops are built once per machine, whatever the checkout: a second clone of the project loads
the module `make install` built (in any clone), and never compiles at engine start.

The build is keyed by what it depends on (sources, flags, torch, Python ABI, machine), not by the path of
the checkout or of its virtual environment (engine_svc/attention/cpu_paged.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine_svc.attention import cpu_paged

CSRC = Path(cpu_paged.__file__).with_name("csrc")


def _clone_of_csrc(tmp_path: Path, name: str) -> Path:
    target = tmp_path / name / "engine_svc" / "attention" / "csrc"
    shutil.copytree(CSRC, target)
    return target


def test_the_build_folder_does_not_depend_on_the_checkout(tmp_path: Path) -> None:
    first, second = _clone_of_csrc(tmp_path, "a"), _clone_of_csrc(tmp_path, "b-elsewhere")
    assert cpu_paged.build_directory(first) == cpu_paged.build_directory(second) == cpu_paged.build_directory()


def test_the_build_folder_follows_the_sources(tmp_path: Path) -> None:
    changed = _clone_of_csrc(tmp_path, "a")
    (changed / "cpu_math.h").write_text((changed / "cpu_math.h").read_text() + "\n// changed\n")
    assert cpu_paged.build_directory(changed) != cpu_paged.build_directory()


def test_a_second_clone_loads_the_built_module_without_compiling(tmp_path: Path) -> None:
    """`make install` built the module (its last step); a process whose sources live elsewhere (another clone)
    imports that build: torch's builder is never called (it would compile, or run ninja over another venv's
    include paths). Run in a fresh interpreter, as an engine starting would."""
    if cpu_paged.load() is None:
        pytest.fail("the native CPU ops did not build here; `make install` builds them (needs g++ and ninja)")
    library = cpu_paged.build_directory() / "tandem_cpu_ops.so"
    built_at = library.stat().st_mtime_ns
    clone = _clone_of_csrc(tmp_path, "clone2")
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from torch.utils import cpp_extension\n"
        "def refuse(*a, **k): raise SystemExit('compiled at start')\n"
        "cpp_extension.load = refuse\n"
        "from engine_svc.attention import cpu_paged\n"
        f"module = cpu_paged.load_from(Path({str(clone)!r}))\n"
        "assert module is not None and hasattr(module, 'paged_decode'), module\n"
        "print('loaded', module.__file__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(cpu_paged.__file__).parents[2])
    assert out.returncode == 0, out.stdout + out.stderr
    assert str(library) in out.stdout
    assert library.stat().st_mtime_ns == built_at  # nothing rebuilt it


def test_a_shared_header_keys_the_build_by_name_and_bytes(tmp_path: Path) -> None:
    """The LoRA and MoE ops include the attention ops' cpu_math.h by absolute path (`MATH_HEADER`): a clone
    elsewhere gets the same folder, a changed header a new one."""
    lora_csrc = Path(cpu_paged.__file__).parents[1] / "lora" / "csrc"
    sources = ("cpu_lora.cpp",)
    key = cpu_paged.build_key(lora_csrc, "tandem_cpu_lora", sources, (cpu_paged.MATH_HEADER,))
    same = _clone_of_csrc(tmp_path, "elsewhere") / "cpu_math.h"
    assert cpu_paged.build_key(lora_csrc, "tandem_cpu_lora", sources, (same,)) == key
    same.write_text(same.read_text() + "\n// changed\n")
    assert cpu_paged.build_key(lora_csrc, "tandem_cpu_lora", sources, (same,)) != key
    assert cpu_paged.build_key(lora_csrc, "tandem_cpu_lora", sources, ()) != key
