"""Loading a Python file that is not part of a package (e.g. ``benchmarks/*.py``) as a module, for tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["load_script"]


def load_script(path: str | Path, name: str | None = None) -> ModuleType:
    """Import the file at ``path`` as a module named ``name`` (default ``_script_<stem>``), registered in
    ``sys.modules`` so that dataclasses and pickling inside it work; its own directory is not put on ``sys.path``."""
    path = Path(path)
    name = name or f"_script_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
