"""The backend switch and small helpers shared by the fused training kernels (RMSNorm, rotary, SwiGLU, linear + CE).

Backend rule (the same as flash attention's, with its own variable): the ``backend`` argument, else
``$LLMOPT_FUSED_BACKEND``, else ``"auto"``.

- ``"auto"``: the Triton kernels for CUDA tensors when Triton is installed, the pure-PyTorch reference otherwise;
  for the elementwise and norm kernels (RMSNorm, residual add + RMSNorm, rotary, SwiGLU) also the reference while
  ``torch.compile`` traces the call, so that the compiler fuses them with the ops around them (the fused linear +
  cross-entropy keeps its kernel: its point is memory);
- ``"triton"``: always the kernels (on CPU only with ``TRITON_INTERPRET=1``, which is how the tests run them);
- ``"reference"``: always the PyTorch reference.

This module imports no Triton.
"""

from __future__ import annotations

import os

import torch

from lightning_llmopt._triton_env import triton_available, triton_interpreter_enabled

__all__ = ["BACKENDS", "ENV", "autocast_dtype", "next_pow2", "resolve_backend", "use_interpreter"]

ENV = "LLMOPT_FUSED_BACKEND"
BACKENDS = ("auto", "triton", "reference")
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def resolve_backend(
    backend: str | None, device: torch.device, what: str = "fused kernel", *, defer_to_compiler: bool = False
) -> str:
    """``"triton"`` or ``"reference"`` for a call on ``device`` (rule in the module docstring).

    ``defer_to_compiler``: ``"auto"`` gives the reference while ``torch.compile`` traces the call (elementwise and
    norm kernels: the compiler fuses the PyTorch ops with their neighbours, which an opaque kernel prevents)."""
    name = (backend or os.environ.get(ENV) or "auto").lower()
    if name not in BACKENDS:
        raise ValueError(f"{what} backend ({name!r}) must be one of {BACKENDS} (argument or ${ENV})")
    if name == "auto":
        if defer_to_compiler and torch.compiler.is_compiling():
            return "reference"
        return "triton" if device.type == "cuda" and triton_available() else "reference"
    if name == "triton":
        if not triton_available():
            raise RuntimeError(f"{what} backend 'triton' needs the triton package (pip install triton)")
        if device.type != "cuda" and not triton_interpreter_enabled():
            raise RuntimeError(
                f"{what} backend 'triton' on {device.type} tensors needs TRITON_INTERPRET=1 set "
                "before the kernels are first imported"
            )
    return name


def use_interpreter(t: torch.Tensor) -> bool:
    """Whether a launch on ``t`` runs in the Triton interpreter (fixed small blocks, no autotuning)."""
    return t.device.type == "cpu" or triton_interpreter_enabled()


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype when autocast is enabled for ``device_type`` (outside ``torch.compile`` too), else None."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)
