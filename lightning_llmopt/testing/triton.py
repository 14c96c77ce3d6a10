"""Running Triton kernels on CPU through the Triton interpreter.

With ``TRITON_INTERPRET=1`` a ``@triton.jit`` kernel is executed in Python with numpy on CPU tensors, which is
how the kernel tests run in CPU CI (small shapes, fp32/fp16; bf16 numerics and speed need a GPU).

Caveat: the variable is read when a kernel is *decorated* (Triton 3.x reads ``triton.knobs.runtime.interpret`` in
``triton.jit``; some older releases read it when ``triton`` is imported). A kernel module imported before the
variable was set keeps compiling for the GPU. Set it before importing kernel modules: ``tests/conftest.py``
does so at import time whenever CUDA is absent, via :func:`enable_interpreter_without_cuda`.
:func:`triton_interpret` only helps for kernels decorated inside the ``with`` block.

The availability flags (:func:`triton_available`, :func:`triton_interpreter_available`,
:func:`triton_interpreter_enabled`) live in :mod:`lightning_llmopt._triton_env`, which the kernels import, and are
re-exported here. This module never imports ``triton`` at import time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from lightning_llmopt._triton_env import (
    _ENV,
    triton_available,
    triton_interpreter_available,
    triton_interpreter_enabled,
)

__all__ = [
    "enable_interpreter_without_cuda",
    "triton_available",
    "triton_interpret",
    "triton_interpreter_available",
    "triton_interpreter_enabled",
]


@contextmanager
def triton_interpret(enabled: bool = True) -> Iterator[None]:
    """Set ``TRITON_INTERPRET`` inside the block and restore its previous value after.

    Affects only kernels decorated with ``triton.jit`` inside the block (see the module caveat).
    """
    previous = os.environ.get(_ENV)
    os.environ[_ENV] = "1" if enabled else "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(_ENV, None)
        else:
            os.environ[_ENV] = previous


def enable_interpreter_without_cuda() -> bool:
    """Set ``TRITON_INTERPRET=1`` when no CUDA device is present, unless the user already set it.

    Returns whether the interpreter is enabled afterwards. Call before any kernel module is imported.
    """
    import torch

    if _ENV not in os.environ and not torch.cuda.is_available():
        os.environ[_ENV] = "1"
    return triton_interpreter_enabled()
