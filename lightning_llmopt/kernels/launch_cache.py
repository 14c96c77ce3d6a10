"""Launch a Triton kernel that was compiled before without ``JITFunction.run``'s per-call work.

Each ``kernel[grid](*args, **constexprs)`` call binds every argument, specializes it (pointer dtype and 16-byte
alignment of each tensor, ``== 1`` / multiple-of-16 / 32-bit range of each integer), turns the options into a
cache key string and looks the compiled kernel up. For a flash-attention pass with about 35 arguments that is most
of the host time of a launch, and at short sequences (16 sequences of 1k tokens, head dim 128, causal) the forward +
backward became host-bound on an H100 whose host was slower (docs/flash_attention.md).

:class:`LaunchCache` keeps the compiled kernel of a call under the caller's own key, with a signature of the
arguments that changes whenever Triton's specialization of them would (:func:`arg_signature`, a superset of what
Triton looks at). A later call with the same key and signature goes straight to the compiled kernel's launcher
(``compiled.run``, the call ``JITFunction.run`` ends with). Anything else goes through ``JITFunction`` as before:
a launch hook set by a profiler, a pre-run hook on the kernel, an argument kind without a signature. A new
signature replaces the cached kernel. ``LLMOPT_TRITON_LAUNCH_CACHE=0`` turns the cache off (every launch through
``JITFunction``).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from torch import Tensor

_I32_MIN, _I32_MAX, _U64_MIN = -(2**31), 2**31 - 1, 2**63


def arg_signature(args: tuple) -> tuple | None:
    """What Triton's specialization depends on, per argument: a tensor's dtype and whether its address is 16-byte
    aligned; an integer's equality to 1, divisibility by 16 and type (32-bit, 64-bit or unsigned 64-bit); a bool's
    value; a float's type; ``None``; a TMA descriptor's type. ``None`` (no signature) for any other kind of
    argument, which the cache then does not take. Written for speed: it runs on every launch (about 35 arguments
    for a flash-attention pass)."""
    sig: list[Any] = []
    for a in args:
        kind = type(a)
        if kind is int:
            sig.append((a == 1, a & 15 == 0, 0 if _I32_MIN <= a <= _I32_MAX else 1 if a < _U64_MIN else 2))
        elif kind is Tensor or isinstance(a, Tensor):
            sig.append((a.dtype, a.data_ptr() & 15 == 0))
        elif kind is float:
            sig.append(float)
        elif kind is bool or a is None:
            sig.append(a)
        elif hasattr(a, "block_shape") and hasattr(a, "layout") and isinstance(getattr(a, "base", None), Tensor):
            # a host-side TMA descriptor (Gluon's or Triton's TensorDescriptor): its type is what Triton specializes
            # on (the base's dtype, the block shape, the shared-memory layout, the padding); shape and strides are
            # encoded at every launch
            sig.append((kind, a.base.dtype, tuple(a.block_shape), a.layout, getattr(a, "padding", None)))
        else:
            return None
    return tuple(sig)


# Triton release lines (major.minor) on which the cached launch, which calls Triton's private launcher, was run on a
# GPU against the JIT path (tests/kernels/test_launch_cache.py). Other versions launch through the JIT function.
LAUNCHER_TESTED = ("3.6",)


@functools.cache
def _launcher_tested() -> bool:
    import triton

    return ".".join(triton.__version__.split(".")[:2]) in LAUNCHER_TESTED


def _current_device() -> int:
    """The device Triton launches on (its driver's current device)."""
    from triton.runtime import driver

    return driver.active.get_current_device()


def _hooked(*hooks: Any) -> bool:
    """Whether any launch hook is attached: Triton's launch hooks are ``HookChain`` objects from Triton 3.5 on (empty
    unless a profiler attached one), plain callables or ``None`` before; a JIT function's pre-run hooks are
    callables."""
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


def _current_stream(device: int) -> int:
    from triton.runtime import driver

    return driver.active.get_current_stream(device)


class _Entry:
    __slots__ = ("compiled", "signature", "constexprs")

    def __init__(self, compiled: Any, signature: tuple, constexprs: tuple) -> None:
        self.compiled, self.signature, self.constexprs = compiled, signature, constexprs


class LaunchCache:
    """Compiled kernels of one ``@triton.jit`` function, by caller key (see the module docstring).

    The key must fix everything the compile depends on besides the arguments' signature: the constexpr values and
    the options (``num_warps``, ``num_stages``, ...). The device is added here.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple, _Entry] = {}

    @staticmethod
    def enabled() -> bool:
        """On by default only with the Triton release line whose private launcher call (``CompiledKernel.run``'s
        argument list) was run on a GPU (:data:`LAUNCHER_TESTED`); ``LLMOPT_TRITON_LAUNCH_CACHE=1`` forces it on,
        ``0`` off."""
        setting = os.environ.get("LLMOPT_TRITON_LAUNCH_CACHE")
        if setting is not None:
            return setting != "0"
        return _launcher_tested()

    def launch(self, fn: Any, key: tuple, grid: tuple, args: tuple, constexprs: dict[str, Any],
               options: dict[str, Any]) -> None:
        """``fn[grid](*args, **constexprs, **options)``, through the cached compiled kernel where it is valid.

        ``args`` are the leading positional parameters of ``fn``; every later parameter must be in ``constexprs``.
        """
        from triton import knobs

        signature = arg_signature(args) if self.enabled() else None
        runtime = getattr(knobs, "runtime", None)  # feature-detected: a missing hook counts as none attached
        if signature is None or _hooked(getattr(runtime, "launch_enter_hook", None),
                                        getattr(runtime, "launch_exit_hook", None),
                                        *getattr(fn, "pre_run_hooks", ())):
            fn[grid](*args, **constexprs, **options)
            return
        full_key = (_current_device(), *key)
        entry = self._entries.get(full_key)
        if entry is not None and entry.signature == signature:
            # what JITFunction.run ends with, without launch metadata (no hook is attached: checked above)
            kernel, g = entry.compiled, (*grid, 1, 1)
            kernel.run(g[0], g[1], g[2], _current_stream(full_key[0]), kernel.function, kernel.packed_metadata, None,
                       None, None, *args, *entry.constexprs)
            return
        compiled = fn[grid](*args, **constexprs, **options)
        tail = fn.arg_names[len(args):]
        if compiled is not None and all(name in constexprs for name in tail):
            compiled = compiled.result() if hasattr(compiled, "result") else compiled
            self._entries[full_key] = _Entry(compiled, signature, tuple(constexprs[name] for name in tail))


__all__ = ["LaunchCache", "arg_signature"]
