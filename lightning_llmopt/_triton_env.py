"""Whether Triton is installed and whether its interpreter is on: the availability flags the kernels read.

The lowest floor of the package (no package imports, no ``triton`` import): kernels, inference and
:mod:`lightning_llmopt.testing.triton` (which re-exports these and adds the interpreter helpers for tests) import it.
"""

from __future__ import annotations

import importlib.util
import os

__all__ = ["triton_available", "triton_interpreter_available", "triton_interpreter_enabled"]

_ENV = "TRITON_INTERPRET"


def triton_available() -> bool:
    """Whether the ``triton`` package is installed (not imported)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreter_available() -> bool:
    """Whether the installed Triton ships the interpreter (``triton.runtime.interpreter``)."""
    if not triton_available():
        return False
    try:
        return importlib.util.find_spec("triton.runtime.interpreter") is not None
    except ImportError:
        return False


def triton_interpreter_enabled() -> bool:
    """Whether kernels decorated from now on will run in the interpreter."""
    return os.environ.get(_ENV, "0").strip().lower() in ("1", "true", "on", "yes")
