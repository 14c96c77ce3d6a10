"""Triton SwiGLU (Shazeer, arXiv 2002.05202) forward and backward kernels and their launchers.

Forward: ``h = silu(a) * b = a * sigmoid(a) * b`` in fp32, one rounding to the output dtype (eager PyTorch rounds
``silu(a)`` first, then the product). Backward recomputes ``sigmoid(a)`` instead of saving ``silu(a)``:

    da = dh * b * s * (1 + a * (1 - s)),    db = dh * a * s,    s = sigmoid(a)

Both are one pass over ``(rows, F)`` tensors (flattened to one row when contiguous), ``BLOCK`` elements a program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_llmopt.kernels import precompile
from lightning_llmopt.kernels import shared_memory as smem
from lightning_llmopt.kernels.flash_attention_interp import ensure_interpreted_stdlib
from lightning_llmopt.kernels.fused_common import use_interpreter

ensure_interpreted_stdlib()  # before the kernels below are decorated


@triton.jit
def _swiglu_fwd_kernel(A, B, H, sa, sb, sh, n_cols, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(n_cols, BLOCK)
    row = (pid // n_blocks).to(tl.int64)
    cols = (pid % n_blocks).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    a = tl.load(A + row * sa + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + row * sb + cols, mask=mask, other=0.0).to(tl.float32)
    h = a * tl.sigmoid(a) * b
    tl.store(H + row * sh + cols, h.to(H.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DH, A, B, DA, DB, sdh, sa, sb, sda, sdb, n_cols, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(n_cols, BLOCK)
    row = (pid // n_blocks).to(tl.int64)
    cols = (pid % n_blocks).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dh = tl.load(DH + row * sdh + cols, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + row * sa + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + row * sb + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(a)
    silu = a * s
    tl.store(DA + row * sda + cols, (dh * b * (s + silu * (1.0 - s))).to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + row * sdb + cols, (dh * silu).to(DB.dtype.element_ty), mask=mask)


def _configs() -> list[triton.Config]:
    return [triton.Config({"BLOCK": blk}, num_warps=w) for blk, w in ((1024, 4), (2048, 4), (2048, 8), (4096, 8))]


def smem_bytes(block: int, num_warps: int) -> int:
    """Shared memory (bytes) of a SwiGLU program: none. Each element is loaded, computed and stored by the thread
    that owns it: no ``tl.dot``, no reduction, no loop to pipeline, so no layout conversion goes through shared
    memory whatever ``BLOCK`` and ``num_warps``."""
    return 0


for _name in ("_swiglu_fwd_kernel", "_swiglu_bwd_kernel"):
    smem.register(_name)(lambda p: smem_bytes(p["BLOCK"], p["num_warps"]))


def _prune(configs, named_args, **kwargs):  # type: ignore[no-untyped-def]
    device = smem.first_device(named_args)
    return smem.fit("swiglu", configs, lambda c: smem_bytes(c.kwargs["BLOCK"], c.num_warps),
                    smem.device_limit(device) if device is not None else None)


_tuned: dict[str, object] = {}


def _kernel(which: str):  # type: ignore[no-untyped-def]
    if which not in _tuned:
        base = _swiglu_fwd_kernel if which == "fwd" else _swiglu_bwd_kernel
        _tuned[which] = precompile.autotune(configs=_configs(), key=["n_cols"],
                                        prune_configs_by={"early_config_prune": _prune})(base)
    return _tuned[which]


def _as_rows(*ts: Tensor) -> tuple[list[Tensor], int, int]:
    """Views ``(rows, cols)``: one row when every tensor is contiguous, else the last dim (contiguous) as cols."""
    if all(t.is_contiguous() for t in ts):
        return [t.reshape(1, -1) for t in ts], 1, ts[0].numel()
    out = [t.reshape(-1, t.shape[-1]) if t.stride(-1) == 1 else t.reshape(-1, t.shape[-1]).contiguous() for t in ts]
    return out, out[0].shape[0], out[0].shape[1]


def _launch(which: str, base, tensors: list[Tensor], n_rows: int, n_cols: int) -> None:  # type: ignore
    strides = [t.stride(0) for t in tensors]
    if use_interpreter(tensors[0]):
        blk = 1024  # few programs: the interpreter's cost is per program
        base[(n_rows * triton.cdiv(n_cols, blk),)](*tensors, *strides, n_cols, BLOCK=blk)
        return
    _kernel(which)[lambda meta: (n_rows * triton.cdiv(n_cols, meta["BLOCK"]),)](*tensors, *strides, n_cols)


def swiglu_fwd_launch(a: Tensor, b: Tensor) -> Tensor:
    """``silu(a) * b`` for ``a``, ``b`` of the same shape (last dim contiguous); returns a's dtype, contiguous."""
    h = torch.empty(a.shape, device=a.device, dtype=a.dtype)
    if a.numel() == 0:
        return h
    (a2, b2, h2), n_rows, n_cols = _as_rows(a, b, h)
    _launch("fwd", _swiglu_fwd_kernel, [a2, b2, h2], n_rows, n_cols)
    return h


def swiglu_bwd_launch(dh: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``(da, db)`` like ``a`` and ``b`` (contiguous)."""
    da = torch.empty(a.shape, device=a.device, dtype=a.dtype)
    db = torch.empty(b.shape, device=b.device, dtype=b.dtype)
    if a.numel() == 0:
        return da, db
    (dh2, a2, b2, da2, db2), n_rows, n_cols = _as_rows(dh, a, b, da, db)
    _launch("bwd", _swiglu_bwd_kernel, [dh2, a2, b2, da2, db2], n_rows, n_cols)
    return da, db


__all__ = ["swiglu_bwd_launch", "swiglu_fwd_launch"]
