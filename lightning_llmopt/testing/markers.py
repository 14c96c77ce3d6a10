"""Pytest markers that skip cleanly on machines without the hardware a test needs.

Two ways to use them::

    from lightning_llmopt.testing.markers import RunIf

    @RunIf(min_cuda_gpus=2)
    def test_tp_on_two_gpus(): ...

    @pytest.mark.gpu          # skipped without CUDA once ``skip_unavailable`` runs in conftest.py
    def test_kernel_bf16(): ...

For the marker form, call :func:`register_markers` from ``pytest_configure`` and :func:`skip_unavailable`
from ``pytest_collection_modifyitems`` in your ``conftest.py`` (this repository's ``tests/conftest.py`` does).
This module imports pytest; ``import lightning_llmopt.testing`` does not.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
import torch

from lightning_llmopt.testing.triton import triton_available, triton_interpreter_enabled

__all__ = [
    "MARKERS",
    "RunIf",
    "cuda_device_count",
    "gpu",
    "multigpu",
    "register_markers",
    "requires_triton",
    "skip_unavailable",
]

MARKERS: dict[str, str] = {
    "gpu": "needs one CUDA GPU (skipped without CUDA)",
    "multigpu": "needs two or more CUDA GPUs (skipped otherwise)",
    "slow": "slower CPU test, still part of CI",
}


def cuda_device_count() -> int:
    """Number of usable CUDA devices (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(c for c in piece if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def RunIf(  # noqa: N802 - named like Lightning's helper, used as a decorator
    min_cuda_gpus: int = 0,
    triton: bool = False,
    min_cuda_capability: tuple[int, int] | None = None,
    min_torch: str | None = None,
) -> Any:
    """A ``pytest.mark.skipif`` that skips unless every stated requirement holds.

    Arguments:
        min_cuda_gpus: at least this many CUDA devices.
        triton: Triton is installed and kernels can run: on a CUDA device, or in the interpreter
            (``TRITON_INTERPRET=1``) on CPU.
        min_cuda_capability: e.g. ``(9, 0)`` for Hopper-only features; implies one CUDA device.
        min_torch: e.g. ``"2.12"``.

    Returns:
        A ``pytest.MarkDecorator`` carrying the reasons, e.g. ``"needs 2 CUDA GPUs, found 0"``.
    """
    reasons = []
    n_gpus = cuda_device_count()
    if min_cuda_capability is not None:
        min_cuda_gpus = max(min_cuda_gpus, 1)
    if n_gpus < min_cuda_gpus:
        reasons.append(f"needs {min_cuda_gpus} CUDA GPU(s), found {n_gpus}")
    elif min_cuda_capability is not None:
        capability = torch.cuda.get_device_capability(0)
        if capability < min_cuda_capability:
            reasons.append(f"needs CUDA capability >= {min_cuda_capability}, found {capability}")
    if triton:
        if not triton_available():
            reasons.append("needs triton (pip install 'lightning_llmopt[triton]')")
        elif n_gpus == 0 and not triton_interpreter_enabled():
            reasons.append("needs a CUDA GPU or TRITON_INTERPRET=1 for triton kernels")
    if min_torch is not None and _version_tuple(torch.__version__) < _version_tuple(min_torch):
        reasons.append(f"needs torch >= {min_torch}, found {torch.__version__}")
    return pytest.mark.skipif(bool(reasons), reason="; ".join(reasons) or "requirements met")


gpu = pytest.mark.gpu
"""Marks a test that needs one CUDA GPU; :func:`skip_unavailable` skips it without one."""

multigpu = pytest.mark.multigpu
"""Marks a test that needs two or more CUDA GPUs; :func:`skip_unavailable` skips it otherwise."""

requires_triton = RunIf(triton=True)
"""Skips unless Triton kernels can run here (CUDA, or the interpreter on CPU)."""


def register_markers(config: pytest.Config) -> None:
    """Declare the ``gpu``/``multigpu``/``slow`` markers (call from ``pytest_configure``)."""
    for name, help_text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {help_text}")


def skip_unavailable(items: Iterable[pytest.Item]) -> None:
    """Add a skip with a reason to ``gpu``/``multigpu`` tests the machine cannot run.

    Call from ``pytest_collection_modifyitems``.
    """
    n_gpus = cuda_device_count()
    skip_gpu = pytest.mark.skip(reason=f"marked gpu: needs 1 CUDA GPU, found {n_gpus}")
    skip_multi = pytest.mark.skip(reason=f"marked multigpu: needs 2 CUDA GPUs, found {n_gpus}")
    for item in items:
        if n_gpus < 2 and item.get_closest_marker("multigpu") is not None:
            item.add_marker(skip_multi)
        elif n_gpus < 1 and item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)
