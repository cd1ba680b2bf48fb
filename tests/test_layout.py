"""The package layout of docs/DESIGN.md: imports between tandem's packages run one way.

Every import counts: function-level ones, and module paths named as strings (the loading registry,
the command table) that are imported by name. A package is a directory under `tandem/` with its
subpackages, or a top-level module (`tandem.llm`, `tandem.thinking`).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "tandem"
# Packages that the math of sampling and acceptance must never reach.
ABOVE_DECODING = (
    "tandem.grammars",
    "tandem.models",
    "tandem.engine",
    "tandem.serve",
    "tandem.demo",
    "tandem.training",
    "tandem.cli",
    "tandem.llm",
)


def _unit(module: str) -> str:
    """The package a module belongs to: `tandem.X`."""
    return ".".join(module.split(".")[:2])


def _is_module(name: str) -> bool:
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or path.is_dir()


def _module_name(file: Path) -> str:
    parts = file.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(file: Path) -> set[str]:
    """Every tandem module `file` imports, at any level of the code."""
    found = set()
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("tandem."):
            if node.value.replace(".", "").replace("_", "").isalnum() and _is_module(node.value):
                found.add(node.value)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("tandem"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tandem"):
            for alias in node.names:  # `from tandem.kernels import cpu_linear` imports the module
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if _is_module(candidate) else node.module)
    return found


def package_graph() -> dict[str, set[str]]:
    """package -> the other packages it imports."""
    graph: dict[str, set[str]] = defaultdict(set)
    for file in ROOT.rglob("*.py"):
        source = _unit(_module_name(file))
        graph[source]
        for target in _imports(file):
            target_unit = _unit(target)
            if target_unit != source and target_unit != "tandem":
                graph[source].add(target_unit)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_between_packages():
    cycle = _cycle(package_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_math_imports_nothing_above_it():
    graph = package_graph()
    for package in ("tandem.decoding", "tandem.core", "tandem.kernels"):
        reached = {p for p in graph[package] if p.startswith(ABOVE_DECODING)}
        assert not reached, f"{package} imports {sorted(reached)}"


def test_the_leaf_imports_nothing_from_tandem():
    assert package_graph()["tandem.core"] == set()
    assert package_graph()["tandem.kernels"] <= {"tandem.core"}


def test_training_sits_under_demo_and_cli():
    """`tandem.training` (draft training) may import models, engine and llm; demo and cli import it."""
    reached = {p for p in package_graph()["tandem.training"] if p in ("tandem.demo", "tandem.cli", "tandem.serve")}
    assert not reached, f"tandem.training imports {sorted(reached)}"


def test_the_checker_sees_function_level_imports(tmp_path):
    file = tmp_path / "m.py"
    file.write_text("def f():\n    from tandem.engine import Engine\n\nREGISTRY = {'x': 'tandem.models.llama3'}\n")
    assert _imports(file) == {"tandem.engine", "tandem.models.llama3"}
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def test_public_names_keep_working():
    import tandem
    import tandem.decoding

    for name in (
        "LLM",
        "SamplingParams",
        "RelaxedAcceptance",
        "SamplingTensors",
        "AcceptanceResult",
        "accept",
        "sample",
    ):
        assert getattr(tandem, name) is not None
    for name in ("accept", "sample", "SamplingTensors", "RelaxedAcceptance", "AcceptanceResult"):
        assert getattr(tandem.decoding, name) is getattr(tandem, name)
