"""Which package may import which (docs/architecture.md, "Layout: which package may import which").

- `frontend_svc` never imports torch, triton or `engine_svc` (a frontend image has none of them).
- `engine_svc` imports `frontend_svc` only where the two are composed on purpose: the offline `LLM`
  API (`llm.py`, re-exported lazily by `__init__.py`) and command-line glue. The engine service itself
  (server, busy loop, core, telemetry, ...) must run without the frontend's code.
- `kernels` depends on neither service.
- `shared_runtime` (the torch-free code both services use) depends on neither service and needs no torch.

Every `import` statement is checked, including ones inside functions, by reading the source (nothing
is imported, so the test is fast and sees imports that a lazy code path would hide).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ENGINE_MODULES_THAT_MAY_USE_THE_FRONTEND = {
    "engine_svc/__init__.py",  # `from engine_svc import SamplingParams`, the offline API's names
    "engine_svc/llm.py",  # the offline API: frontend processing + an in-process EngineCore
    "engine_svc/cli.py",  # `tandem generate` dispatches to the frontend's client
    "engine_svc/offline_cli.py",  # `tandem offline`, a command around llm.py
    "engine_svc/demo_model.py",  # `tandem convert-gguf` / `make-demo-model` write the tokenizer files too
}


def imported_packages(path: Path) -> set[str]:
    """Top-level package of every absolute import in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def importers(package: str, forbidden: str) -> set[str]:
    return {str(p.relative_to(ROOT)) for p in modules(package) if forbidden in imported_packages(p)}


@pytest.mark.parametrize("forbidden", ["torch", "triton", "engine_svc", "kernels"])
def test_frontend_imports_no_engine_code(forbidden: str) -> None:
    assert importers("frontend_svc", forbidden) == set()


def test_engine_imports_the_frontend_only_for_the_offline_api_and_cli_glue() -> None:
    offenders = importers("engine_svc", "frontend_svc") - ENGINE_MODULES_THAT_MAY_USE_THE_FRONTEND
    assert offenders == set(), "the engine service must not depend on frontend_svc; shared code goes in shared_runtime/"


@pytest.mark.parametrize("forbidden", ["engine_svc", "frontend_svc"])
def test_kernels_depend_on_no_service(forbidden: str) -> None:
    assert importers("kernels", forbidden) == set()


def test_the_checker_sees_imports_inside_functions(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from frontend_svc.x import y\n    import torch.nn\n")
    assert imported_packages(module) == {"frontend_svc", "torch"}


@pytest.mark.parametrize("forbidden", ["torch", "triton", "engine_svc", "frontend_svc", "kernels"])
def test_shared_runtime_depends_on_no_service(forbidden: str) -> None:
    assert importers("shared_runtime", forbidden) == set()


def test_protos_package_holds_only_generated_code() -> None:
    hand_written = {str(p.relative_to(ROOT)) for p in (ROOT / "protos").rglob("*.py")
                    if not p.name.endswith(("_pb2.py", "_pb2_grpc.py")) and p.name != "__init__.py"}
    assert hand_written == set(), "hand-written runtime code belongs in shared_runtime/, not protos/"
