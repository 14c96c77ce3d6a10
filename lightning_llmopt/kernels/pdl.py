"""Programmatic dependent launch (PDL, Hopper and later) for the decode-sized kernels.

A kernel launched as a programmatic dependent may be scheduled while the kernel before it drains. Kernels that opt
in (a ``PDL`` constexpr) call ``gdc_wait()`` (``griddepcontrol.wait``) before their first write of global memory and
before their first read of anything a kernel may have written, which makes every write of the kernel before them
visible (the quantized word kernel reads its first tile of weights, which no kernel writes, before it waits, so that
their latency overlaps the drain of the kernel before it), and ``gdc_launch_dependents()`` to let the next
kernel be scheduled once every program of this one has called it: at their start for kernels of about one wave
(the GEMVs, the quantized word kernel), after the main loop for kernels of several waves whose waiting dependents
would otherwise take SM resources from the later waves (the quantized tensor-core kernel). Launchers pass
``launch_pdl=True`` (:func:`launch_kwargs`) when :func:`pdl_enabled` says so.
"""

from __future__ import annotations

import os

import torch

try:  # grid dependency control
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton
    gdc_launch_dependents = gdc_wait = None

__all__ = ["gdc_launch_dependents", "gdc_wait", "launch_kwargs", "pdl_enabled"]

_HOPPER: dict[int, bool] = {}  # device index -> compute capability 9.0 or later


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch as programmatic dependents (``LLMOPT_PDL=0`` turns it off). Needs
    compute capability 9.0 or later, a Triton with ``gdc_wait`` and a compiled kernel (not the interpreter)."""
    if gdc_wait is None or device.type != "cuda" or os.environ.get("LLMOPT_PDL", "1") == "0":
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _HOPPER:
        _HOPPER[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _HOPPER[index]


def launch_kwargs(pdl: bool) -> dict[str, bool]:
    """The launch options of a kernel whose ``PDL`` constexpr is ``pdl``."""
    return {"launch_pdl": True} if pdl else {}
