"""No two modules under ``services/`` import each other, even through a lazy import inside a function: the
composition root (``services.container``) builds the LLM stack (``services.llm.factory``) and the QA engines, and
nothing it builds reaches back for it. Read from the source, so a lazy import counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def services_imported(path: Path, known: set[str]) -> set[str]:
    """The ``services`` modules ``path`` imports, wherever the import sits (``from pkg import module`` counts as
    the module when it is one)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in known:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known)
    return out


def import_graph() -> dict[str, set[str]]:
    """Each ``services`` module and the ``services`` modules it imports."""
    paths = sorted((ROOT / "services").rglob("*.py"))
    known = {module_name(p) for p in paths}
    return {module_name(p): services_imported(p, known) - {module_name(p)} for p in paths}


def reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = {start}, [start]
    while todo:
        for other in graph.get(todo.pop(), set()) - seen:
            if other == goal:
                return True
            seen.add(other)
            todo.append(other)
    return False


def test_the_container_and_the_llm_factory_do_not_import_each_other() -> None:
    graph = import_graph()
    assert "services.llm.factory" in graph["services.container"]
    assert not reaches(graph, "services.llm.factory", "services.container")


@pytest.mark.parametrize("package", ["services.qa", "services.llm"])
def test_no_two_modules_import_each_other(package: str) -> None:
    graph = import_graph()
    pairs = [(a, b) for a, imports in graph.items() if a.startswith(package) for b in imports if a in graph[b]]
    assert pairs == []


def test_the_graph_sees_a_lazy_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from services.container import build_engine\n    import services.llm.task\n")
    known = {"services.container", "services.llm.task", "services.llm"}
    assert services_imported(module, known) == {"services.container", "services.llm.task"}
