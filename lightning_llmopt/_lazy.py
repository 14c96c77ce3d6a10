"""Lazy package exports: a name is imported from its submodule on first access (PEP 562)."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str], namespace: dict[str, Any]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose name ``n`` lives in submodule ``exports[n]``; a resolved name
    is cached in the package ``namespace``.

    A name that is also its submodule's name (``parallel.parallelize``, the function in ``parallel/parallelize.py``)
    stays the exported object when the submodule is imported, as an eager ``from .parallelize import parallelize``
    in the package would leave it (the import system binds a submodule to its package's attribute).
    """
    shadowed = frozenset(name for name, module in exports.items() if name == module)
    if shadowed:
        namespace["_lazy_shadowed"] = shadowed
        sys.modules[package].__class__ = _ExportsOverSubmodules

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__


class _ExportsOverSubmodules(types.ModuleType):
    """A package whose submodule ``name``, once imported, binds the object ``name`` it defines, not itself."""

    def __setattr__(self, name: str, value: Any) -> None:
        if (
            isinstance(value, types.ModuleType)
            and name in self.__dict__.get("_lazy_shadowed", ())
            and value.__name__ == f"{self.__name__}.{name}"
        ):
            value = getattr(value, name)
        super().__setattr__(name, value)
