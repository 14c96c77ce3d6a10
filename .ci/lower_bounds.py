"""Print pip constraints that pin every dependency of ``.[dev]`` to its declared lower bound's series.

``python3 .ci/lower_bounds.py`` reads ``pyproject.toml`` (the core dependencies and the ``dev`` extra with the extras it
names) and prints one constraint per distribution: ``name>=X.Y,<3`` becomes ``name==X.Y.*`` (the newest patch release
of the lower bound's series), ``name==V`` stays as written. The toolchain job (``.ci/toolchain_job.sh``) installs with
these constraints, so each lower bound in ``pyproject.toml`` is a version CI runs; the main job installs the newest.
``--requirements`` prints the requirements themselves (``pip install -r``: the dependencies before the package).
"""

from __future__ import annotations

import pathlib
import re
import sys

import tomllib

PYPROJECT = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"
_REQ = re.compile(r"^\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*(.*)$")


def requirements(extra: str = "dev") -> list[str]:
    """The core dependencies and those of ``extra``, following ``lightning_llmopt[...]`` self-references."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    extras, seen, pending = project["optional-dependencies"], set(), [extra]
    reqs = list(project["dependencies"])
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        for req in extras[name]:
            m = _REQ.match(req)
            if m and m.group(1).replace("-", "_") == project["name"]:
                pending.extend(e.strip() for e in m.group(2).strip("[]").split(","))
            else:
                reqs.append(req)
    return reqs


def constraint(req: str) -> str:
    """``"torch>=2.11,<2.14"`` -> ``"torch==2.11.*"``; ``"ruff==0.17.6"`` unchanged."""
    m = _REQ.match(req)
    if m is None:
        raise SystemExit(f"pyproject.toml: cannot read the requirement {req!r}")
    name, spec = m.group(1), m.group(3)
    pinned = re.search(r"==\s*([^,\s]+)", spec)
    if pinned:
        return f"{name}=={pinned.group(1)}"
    lower = re.search(r">=\s*([^,\s]+)", spec)
    if lower is None:
        raise SystemExit(f"pyproject.toml: {req!r} has no lower bound (>=) for the toolchain job to install")
    return f"{name}=={lower.group(1)}.*"


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--requirements"]:  # the requirements themselves (pip -r), for installing before the package
        print("\n".join(requirements(*args[1:2])))
    else:
        lines = {constraint(r).split("==")[0].lower(): constraint(r) for r in requirements(*args[:1])}
        print("\n".join(lines[k] for k in sorted(lines)))
