"""Keep the Triton interpreter usable when ``triton`` was imported before ``TRITON_INTERPRET=1`` was set.

``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates. Triton's own library functions written in Triton
(``tl.max``, ``tl.sum``, ``tl.cdiv``, the reduction combine functions of ``triton.language.standard``) are decorated
when ``triton`` is imported; torch >= 2.13 imports ``triton`` as a side effect of ``import torch._dynamo`` (which
``lightning`` does), so a test suite that sets the variable at conftest time finds them compiled for the GPU, and any
interpreted kernel calling them fails with "Cannot call @triton.jit'd outside of the scope of a kernel".
:func:`ensure_interpreted_stdlib` re-wraps those functions for the interpreter; it does nothing unless the
interpreter is enabled. Imported only by the kernel modules (it imports Triton).
"""

from __future__ import annotations

import functools
import os


@functools.cache
def ensure_interpreted_stdlib() -> None:
    if os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("1", "true", "on", "yes"):
        return
    import triton.language as tl
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for module in (standard, tl, tl.math):
        for name, obj in list(vars(module).items()):
            if isinstance(obj, JITFunction):
                setattr(module, name, InterpretedFunction(obj.fn))
