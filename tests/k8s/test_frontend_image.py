"""The frontend image's dependency set: ``pip install .[frontend]`` must not bring torch.

Builds what docker/frontend.Dockerfile builds, without Docker: a fresh virtual environment (no
system site-packages), the project installed from a copy of this checkout with only the
``frontend`` extra (through pip's configured indexes), then every ``frontend_svc`` module is
imported and torch / triton / engine_svc must be neither installed nor imported.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Top-level paths that are not part of the Python distribution (the .dockerignore list, roughly).
SKIP_TOP = {
    ".git", ".venv", "node_modules", "tests", "bench", "k8s", "docs", "docker", ".ci",
    "build", "dist", ".tiny-models", ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis",
}  # fmt: skip
FORBIDDEN = ("torch", "triton", "engine_svc")

IMPORT_CHECK = """
import importlib, pkgutil, sys
import frontend_svc
assert not frontend_svc.__file__.startswith({root!r}), frontend_svc.__file__
for mod in pkgutil.walk_packages(frontend_svc.__path__, "frontend_svc."):
    importlib.import_module(mod.name)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {forbidden!r})
assert not loaded, f"frontend imports {{loaded}}"
for name in {forbidden_installed!r}:
    assert importlib.util.find_spec(name) is None, f"{{name}} is installed in the frontend env"
print("frontend-ok")
"""


def _ignore(directory: str, names: list[str]) -> set[str]:
    skipped = {n for n in names if n == "__pycache__" or n.endswith((".pyc", ".egg-info"))}
    if Path(directory) == ROOT:
        skipped |= SKIP_TOP & set(names)
    return skipped


def _clean_env() -> dict[str, str]:
    """The caller's environment minus anything that would leak the dev venv into the new one."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"}}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PIP_NO_INPUT"] = "1"
    return env


def _run(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_frontend_extra_installs_and_imports_without_torch(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=_ignore)
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False, clear=True).create(env_dir)
    python = env_dir / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")

    install = _run([str(python), "-m", "pip", "install", f"{src}[frontend]"], cwd=tmp_path, timeout=840)
    installed = [line for line in install.stdout.splitlines() if line.startswith("Successfully installed")]
    assert installed, install.stdout[-2000:]
    pulled = [p for p in installed[-1].split()[2:] if p.lower().startswith(("torch", "triton", "nvidia-"))]
    assert not pulled, f"the frontend extra pulled {pulled}"
    assert _run([str(python), "-m", "pip", "show", "tandem"], cwd=tmp_path, timeout=60).stdout

    check = IMPORT_CHECK.format(root=str(ROOT), forbidden=FORBIDDEN, forbidden_installed=FORBIDDEN[:2])
    proc = _run([str(python), "-c", check], cwd=tmp_path, timeout=120)
    assert proc.stdout.strip().endswith("frontend-ok")
