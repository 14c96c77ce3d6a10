"""Every third-party import of the package, its tests, examples and benchmarks is declared in pyproject.toml.

Run with the interpreter of an environment where ``.[dev]`` is installed: an imported module is mapped to the
distribution that provides it there (``importlib.metadata.packages_distributions``), and that distribution must be
named in ``[project] dependencies`` or one of the extras. ``pytest.importorskip("name")`` counts as an import: a test
that skips because a package is missing hides an undeclared dependency just as well as one that fails.

A module that no installed distribution provides is reported too (it is undeclared, or declared under another
name that was not installed). Exit status 1 lists each offending import with the files that make it.
"""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
import sys

import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
TREES = ("lightning_llmopt", "tests", "examples", "benchmarks")
# GPU peers that benchmarks import only on the device, where they travel as wheels (device README): never installed
# on CPU machines, and not dependencies of the package.
# The other grammar libraries that benchmarks/bench_structured.py --family backends measures llguidance against: peers
# installed by hand for that comparison (its docstring says how), not dependencies of the package.
DEVICE_ONLY = {"benchmarks": {"liger_kernel", "torchtitan", "xgrammar", "outlines_core"}}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    names = {_normalize(re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0]) for r in requirements}
    return names - {_normalize(project["name"])}


def imports(path: pathlib.Path) -> set[str]:
    """Top-level names of the absolute imports in one file, plus ``pytest.importorskip`` strings."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "importorskip"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.add(node.args[0].value.split(".")[0])
    return found


def main() -> int:
    names = declared()
    providers = importlib.metadata.packages_distributions()
    stdlib = set(sys.stdlib_module_names)
    problems: dict[str, set[str]] = {}
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            local = {p.stem for p in path.parent.glob("*.py")} | {p.name for p in path.parent.iterdir() if p.is_dir()}
            for module in imports(path) - stdlib - local - {"lightning_llmopt"} - DEVICE_ONLY.get(tree, set()):
                dists = {_normalize(d) for d in providers.get(module, [])}
                if not dists:
                    problems.setdefault(f"{module} (no installed distribution provides it)", set()).add(str(path))
                elif not dists & names:
                    problems.setdefault(f"{module} (from {', '.join(sorted(dists))})", set()).add(str(path))
    for what, files in sorted(problems.items()):
        shown = ", ".join(sorted(pathlib.Path(f).relative_to(ROOT).as_posix() for f in files)[:4])
        more = f" and {len(files) - 4} more" if len(files) > 4 else ""
        print(f"undeclared import: {what}, in {shown}{more}")
    if problems:
        print(f"{len(problems)} undeclared import(s): add each distribution to pyproject.toml, in the extra where it "
              "belongs")
        return 1
    print(f"imports: every third-party import of {', '.join(TREES)} is declared in pyproject.toml")
    return 0


if __name__ == "__main__":
    sys.exit(main())
