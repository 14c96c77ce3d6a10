"""Imports flow one way through the package (CONVENTIONS rule 13): no import circle among its modules, and the folder
rules of issue 55.

The graph is read from the source with ``ast``: module-level, function-local and ``TYPE_CHECKING`` imports all count
(a circle that only a deferred import keeps from failing at import time is still a circle), relative imports are
resolved, and ``from pkg import name`` counts as importing ``pkg.name`` when that is a module. Package
``__init__`` files are neither nodes nor targets: they are re-export hubs, and an edge into one stands for the
submodule that defines the name.
"""

from __future__ import annotations

import ast
import functools
import pathlib

import pytest

import lightning_llmopt

ROOT = pathlib.Path(lightning_llmopt.__file__).parent
PACKAGE = "lightning_llmopt"


def _modules() -> dict[str, pathlib.Path]:
    """``{dotted name: path}`` of every module of the package, ``__init__`` files under their package's name."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = (PACKAGE, *path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts).removesuffix(".__init__")] = path
    return out


MODULES = _modules()
PACKAGES = {name for name, path in MODULES.items() if path.name == "__init__.py"}


def _targets(current: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dotted names one import statement of module ``current`` refers to (modules, or names inside one)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = current.split(".")
        package = base if current in PACKAGES else base[:-1]
        package = package[: len(package) - (node.level - 1)]
        module = ".".join([*package, *([node.module] if node.module else [])])
    else:
        module = node.module or ""
    return [f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES else module for alias in node.names]


def _resolve(name: str) -> str | None:
    """The package module ``name`` lives in (itself, or the longest module prefix), or None outside the package."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in MODULES and name.startswith(f"{PACKAGE}.") else None


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """``{module: modules it imports}`` over the package's modules, package ``__init__`` files left out (cached: do
    not modify)."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        if name in PACKAGES:
            continue
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _targets(name, node):
                    dep = _resolve(target)
                    if dep is not None and dep != name and dep not in PACKAGES:
                        deps.add(dep)
        graph[name] = deps
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as ``[a, b, ..., a]``, or None (depth-first search, iterative)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path = [start]
        stack = [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            dep = next(stack[-1], None)
            if dep is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            elif dep not in state:
                state[dep] = 1
                path.append(dep)
                stack.append(iter(sorted(graph.get(dep, ()))))
    return None


def _short(name: str) -> str:
    return name.removeprefix(f"{PACKAGE}.")


def test_the_graph_sees_every_kind_of_import():
    """The graph holds edges made by module-level, function-local and ``TYPE_CHECKING`` imports and by
    ``from pkg import module``; so a clean result below is not an empty graph."""
    graph = import_graph()
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300
    assert f"{PACKAGE}.models.blocks" in graph[f"{PACKAGE}.models.mla"]  # module level
    assert f"{PACKAGE}.kernels.quant_matmul_tune" in graph[f"{PACKAGE}.kernels.quant_matmul"]  # in a function
    assert f"{PACKAGE}.parallel.zero_buckets" in graph[f"{PACKAGE}.parallel.zero_state"]  # TYPE_CHECKING only
    # `from lightning_llmopt.models import attention_flex` names the module, not the package
    assert f"{PACKAGE}.models.attention_flex" in graph[f"{PACKAGE}.models.attention"]
    assert f"{PACKAGE}.models" not in graph[f"{PACKAGE}.models.attention"]


def test_relative_imports_resolve():
    def targets(module: str, code: str) -> list[str]:
        node = ast.parse(code).body[0]
        assert isinstance(node, ast.ImportFrom)
        return _targets(module, node)

    assert targets(f"{PACKAGE}.models.llama", "from .blocks import RMSNorm") == [f"{PACKAGE}.models.blocks"]
    assert targets(f"{PACKAGE}.models.llama", "from . import mla") == [f"{PACKAGE}.models.mla"]
    assert targets(f"{PACKAGE}.models.llama", "from ..kernels import rotary") == [f"{PACKAGE}.kernels.rotary"]
    assert targets(f"{PACKAGE}.models", "from .config import LlamaConfig") == [f"{PACKAGE}.models.config"]


def test_find_circle_reports_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_circle(graph) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None


def test_no_import_circles():
    circle = find_circle(import_graph())
    assert circle is None, "import circle: " + " -> ".join(map(_short, circle or []))


def _crossings(source: str, target: str) -> list[str]:
    """``"a -> b"`` for every import from a module under ``source/`` of a module under ``target/``."""
    graph = import_graph()
    src, dst = f"{PACKAGE}.{source}.", f"{PACKAGE}.{target}."
    return sorted(
        f"{_short(name)} -> {_short(dep)}"
        for name, deps in graph.items()
        if name.startswith(src)
        for dep in deps
        if dep.startswith(dst)
    )


@pytest.mark.parametrize(
    ("source", "target"),
    [("kernels", "testing"), ("kernels", "quantization"), ("parallel", "strategies"), ("inference", "cli")],
)
def test_folder_never_imports(source: str, target: str):
    """``kernels/`` sits below ``testing/`` and ``quantization/``, ``parallel/`` below ``strategies/``, ``inference/``
    below ``cli/``."""
    crossings = _crossings(source, target)
    assert not crossings, f"{source}/ must not import {target}/: " + ", ".join(crossings)
