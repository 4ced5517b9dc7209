"""Which package may import which (docs/architecture.md, "Layout: which package may import which").

- `frontend_svc` never imports torch, triton, `engine_svc` or `entrypoints` (a frontend image has none of
  them).
- `engine_svc` never imports `frontend_svc` or `entrypoints`: the engine service runs without the
  frontend's code. What composes the two (the `tandem` command, the offline `LLM`) is `entrypoints`, the
  only package that imports both.
- `kernels` depends on neither service.
- No package has an import cycle between its modules, counting the imports made only for type checking
  (a cycle there is still two modules that cannot be read, or changed, one without the other).
- `shared_runtime` (the torch-free code both services use) depends on neither service and needs no torch.

Every `import` statement is checked, including ones inside functions, by reading the source (nothing
is imported, so the test is fast and sees imports that a lazy code path would hide).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PACKAGES = ("engine_svc", "frontend_svc", "shared_runtime", "entrypoints", "kernels")


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


@pytest.mark.parametrize("forbidden", ["torch", "triton", "engine_svc", "kernels", "entrypoints"])
def test_frontend_imports_no_engine_code(forbidden: str) -> None:
    assert importers("frontend_svc", forbidden) == set()


@pytest.mark.parametrize("forbidden", ["frontend_svc", "entrypoints"])
def test_engine_imports_neither_the_frontend_nor_what_composes_them(forbidden: str) -> None:
    offenders = importers("engine_svc", forbidden)
    assert offenders == set(), "the engine service must not depend on it; shared code goes in shared_runtime/"


@pytest.mark.parametrize(("module", "forbidden"), [
    ("engine_svc.api.server", ("frontend_svc", "entrypoints")),
    ("engine_svc.cli", ("frontend_svc", "entrypoints")),
    ("frontend_svc.server", ("engine_svc", "entrypoints", "torch")),
    ("frontend_svc.cli", ("engine_svc", "entrypoints", "torch")),
])
def test_a_service_loads_without_the_other(module: str, forbidden: tuple[str, ...]) -> None:
    """What the interpreter actually loads, lazy imports of imported libraries included."""
    code = (f"import sys, {module}; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(forbidden)!r}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing {module} loaded {out.stdout.strip()}"


def module_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (any import, type-checking-only ones too)."""
    paths: dict[str, Path] = {}
    for package in PACKAGES:
        for path in modules(package):
            parts = path.relative_to(ROOT).with_suffix("").parts
            paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names if alias.name in paths)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    found.add(full if full in paths else node.module)
        graph[name] = (found & paths.keys()) - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles() -> None:
    assert cycles(module_graph()) == []


def test_the_cycle_finder_finds_a_cycle_through_type_checking_imports() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


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
