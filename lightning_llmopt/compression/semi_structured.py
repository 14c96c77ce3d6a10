"""2:4 weights on NVIDIA sparse tensor cores through ``torch.sparse.to_sparse_semi_structured``.

On CUDA devices of compute capability 8.0 or newer (Ampere, Hopper) a 2:4-sparse fp16/bf16 weight converted with
:func:`to_semi_structured` is stored compressed (values + metadata) and ``F.linear`` dispatches to the CUTLASS or
cuSPARSELt sparse GEMM. Elsewhere (CPU, older GPUs) :func:`semi_structured_available` is False and the pruned
layer stays a dense ``nn.Linear`` with zeros, which computes the same function.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from lightning_llmopt.compression.masks import is_nm_sparse


def semi_structured_available(device: torch.device | str | None = None) -> bool:
    """True when torch has semi-structured sparse tensors and ``device`` (default: current CUDA) supports them."""
    if not torch.cuda.is_available() or not hasattr(torch.sparse, "to_sparse_semi_structured"):
        return False
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    return dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 0)


@torch.no_grad()
def to_semi_structured(model: nn.Module, names: Iterable[str]) -> list[str]:
    """Replace the weights of the named 2:4-sparse linear layers by semi-structured sparse tensors (inference only).

    Layers must be on CUDA in fp16/bf16 with 2:4-sparse weights (e.g. after ``prune_model(pattern="2:4")``);
    returns the names converted. Raises if the device lacks support.
    """
    if not semi_structured_available():
        raise RuntimeError("semi-structured sparse kernels need a CUDA GPU of compute capability >= 8.0")
    done = []
    for name in names:
        linear = model.get_submodule(name)
        w = linear.weight
        if w.device.type != "cuda" or w.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"{name}: semi-structured weights must be fp16/bf16 on CUDA (got {w.dtype} on {w.device})")
        if not is_nm_sparse(w != 0, 2, 4):
            raise ValueError(f"{name}: the weight is not 2:4 sparse")
        linear.weight = nn.Parameter(torch.sparse.to_sparse_semi_structured(w.detach()), requires_grad=False)
        done.append(name)
    return done


__all__ = ["semi_structured_available", "to_semi_structured"]
