"""Test helpers shipped for users' tests too.

- :mod:`lightning_llmopt.testing.distributed`: a reusable pool of gloo worker processes
  (:class:`DistributedPool`, :func:`run_distributed`).
- :mod:`lightning_llmopt.testing.markers`: ``RunIf``, ``gpu``/``multigpu`` markers (imports pytest).
- :mod:`lightning_llmopt.testing.triton`: running Triton kernels in the interpreter on CPU.
- :mod:`lightning_llmopt.testing.data`: :class:`RandomTokens`, synthetic batches for tests and benchmarks.
- :mod:`lightning_llmopt.testing.lightning_env`: :class:`PoolEnvironment`, a Trainer inside a pool worker.
- :mod:`lightning_llmopt.testing.scripts`: :func:`load_script`, a file outside a package (``benchmarks/``) as a module.

Importing this package imports neither pytest, triton nor Lightning (the kernels import ``testing.triton``, and
``llmopt generate`` must not pay for Lightning): ``RunIf`` and the markers load pytest on first access,
``PoolEnvironment`` loads Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_llmopt.testing.data import RandomTokens
from lightning_llmopt.testing.distributed import (
    DistributedPool,
    DistributedTaskError,
    DistributedTimeoutError,
    close_all_pools,
    get_pool,
    run_distributed,
)
from lightning_llmopt.testing.triton import (
    enable_interpreter_without_cuda,
    triton_available,
    triton_interpret,
    triton_interpreter_available,
    triton_interpreter_enabled,
)

if TYPE_CHECKING:
    from lightning_llmopt.testing.lightning_env import PoolEnvironment

_MARKER_NAMES = ("RunIf", "gpu", "multigpu", "requires_triton", "skip_unavailable", "register_markers")

__all__ = [
    "DistributedPool",
    "DistributedTaskError",
    "DistributedTimeoutError",
    "PoolEnvironment",
    "RandomTokens",
    "close_all_pools",
    "enable_interpreter_without_cuda",
    "get_pool",
    "run_distributed",
    "triton_available",
    "triton_interpret",
    "triton_interpreter_available",
    "triton_interpreter_enabled",
    *_MARKER_NAMES,
]


def __getattr__(name: str) -> Any:
    if name in _MARKER_NAMES:  # lazy: these need pytest
        from lightning_llmopt.testing import markers

        return getattr(markers, name)
    if name == "PoolEnvironment":  # lazy: Lightning
        from lightning_llmopt.testing.lightning_env import PoolEnvironment

        return PoolEnvironment
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
