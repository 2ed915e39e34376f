"""The package's layers, read from the source: ``core`` at the bottom, the front ends
(``stateful``, ``torch``, ``jax``, ``keras``) side by side above it, the engine adapters
(``deepspeed``, ``megatron``) above ``torch`` and beside each other, and no import circle."""

from __future__ import annotations

import ast
from pathlib import Path

from lossscale import _extras as extras

ROOT = Path(__file__).resolve().parents[1] / "src" / "lossscale"
FRONT_ENDS = {"stateful", "torch", "jax", "keras"}


def engines() -> dict[str, set[str]]:
    """Engine adapters (the table ``lossscale._extras.ADAPTERS``): each may build on these front
    ends (and core), never on another engine; no front end imports an engine."""
    return {adapter.name: set(adapter.builds_on) for adapter in extras.ADAPTERS}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("lossscale", *parts)).removesuffix(".__init__")


def _exists(module: str) -> bool:
    rel = Path(*module.split(".")[1:])
    return (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()


def _graph() -> dict[str, set[str]]:
    """Library module -> the lossscale modules it imports (anywhere in its body)."""
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        if path.name.endswith("_test.py") or path.name == "conftest.py":
            continue
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.startswith("lossscale"):
                    for alias in node.names:
                        full = f"{node.module}.{alias.name}"
                        deps.add(full if _exists(full) else node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("lossscale"))
        name = _module(path)
        graph[name] = deps - {name}
    return graph


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _violations(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    ENGINES = engines()
    for module, deps in graph.items():
        for dep in deps:
            here, there = _layer(module), _layer(dep)
            if here == "core" and there != "core":
                wrong.append(f"upward: {module} -> {dep}")
            if here in FRONT_ENDS and there in FRONT_ENDS and here != there:
                wrong.append(f"sideways: {module} -> {dep}")
            if here in FRONT_ENDS and there in ENGINES:
                wrong.append(f"upward: {module} -> {dep}")
            beside = there in ENGINES or there in FRONT_ENDS
            if here in ENGINES and there != here and beside and there not in ENGINES[here]:
                wrong.append(f"sideways: {module} -> {dep}")
    return wrong


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                circles.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    # a package's __init__ importing its own submodules is not a circle
    return [c for c in circles if not all(m.startswith(c[0] + ".") or m == c[0] for m in c[1:])]


def test_core_imports_no_front_end_and_front_ends_import_no_other() -> None:
    graph = _graph()
    assert len(graph) > 30 and "lossscale.torch._step" in graph  # the walk found the package
    assert not _violations(graph)


def test_numerics_sits_beside_core() -> None:
    """``lossscale.numerics`` imports core and itself only (front ends may import it), and
    core never imports it."""
    graph = _graph()
    numerics = {m: deps for m, deps in graph.items() if _layer(m) == "numerics"}
    assert "lossscale.numerics._report" in numerics
    for module, deps in numerics.items():
        assert {_layer(d) for d in deps} <= {"core", "numerics"}, (module, deps)
    for module, deps in graph.items():
        if _layer(module) == "core":
            assert all(_layer(d) != "numerics" for d in deps), module


def test_no_import_circle() -> None:
    assert not _circles(_graph())


def test_the_checks_see_a_planted_import() -> None:
    graph = _graph()
    graph["lossscale.core._rule"].add("lossscale.torch._step")
    graph["lossscale.torch._engine"].add("lossscale.jax._values")
    graph["lossscale.torch._state"].add("lossscale.torch._step")  # _step imports _state
    assert len(_violations(graph)) == 2
    graph["lossscale.torch._step"].add("lossscale.deepspeed._install")  # a front end -> engine
    graph["lossscale.megatron"] = {"lossscale.deepspeed", "lossscale.jax"}  # sideways twice
    graph["lossscale.deepspeed"] = {"lossscale.torch", "lossscale.core"}  # allowed
    assert len(_violations(graph)) == 5
    planted = {"lossscale.torch._state", "lossscale.torch._step"}
    assert any(planted <= set(circle) for circle in _circles(graph))
