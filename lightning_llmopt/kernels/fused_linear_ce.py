"""Fused linear + cross-entropy: the loss of ``hidden @ weight.T`` without materializing the ``(N, V)`` logits.

Algorithm (the gradient of a scalar loss is known in the forward, so it is computed there, chunk by chunk; the
same idea as Wijmans et al., "Cut your losses in large-vocabulary language models", arXiv 2411.09009, with cuBLAS
matmuls and Triton row kernels):

1. ``n_valid = sum(labels != ignore_index)``; ``scale = 1 / n_valid`` (mean) or 1 (sum), kept on the device.
2. For each chunk of ``C`` rows (``C * V`` logits, 1 GiB of bf16 by default, at most half of the rows):
   a. ``logits = h_c @ W.T`` into one reused ``(C, V)`` buffer in the compute dtype (bf16 under autocast);
   b. Triton: per row ``max``, ``sumexp`` and the target logit (fp32);
   c. vocab-parallel TP (``process_group``): ``all_reduce(max, MAX)``, then ``all_reduce([sumexp * exp(max_local -
      max), target], SUM)``: every rank gets the full-vocabulary log-sum-exp;
   d. ``loss_row = lse - target`` (0 on ignored rows);
   e. Triton: overwrite the logits with ``dlogits = (softmax - onehot) * scale`` (0 on ignored rows);
   f. ``dh_c = dlogits @ W`` (written into its rows of ``dh``) and ``dW += dlogits.T @ h_c`` (fp32 accumulator,
      through cuBLAS's fp32-output matmul where the build has it).
3. ``loss = scale * sum(loss_row)``; with TP, ``dh`` is summed over the group (``hidden`` is replicated there, so its
   gradient is the sum of every shard's contribution, as in Megatron-LM's vocab-parallel cross-entropy).

The backward multiplies the saved ``dh``/``dW`` by the incoming gradient. Peak extra memory: one logits chunk, the
fp32 ``dW`` accumulator and ``dh``, instead of the fp32 logits, their softmax and their gradient.

Layers: kernels in :mod:`~lightning_llmopt.kernels.fused_linear_ce_triton`; custom op
``lightning_llmopt::fused_linear_ce`` (fake implementation included; the TP group travels as its name, resolved
inside the op); :class:`FusedLinearCrossEntropyFunction`; :func:`fused_linear_cross_entropy`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_llmopt.kernels.fused_common import KERNEL_DTYPES, autocast_dtype, resolve_backend
from lightning_llmopt.kernels.fused_ref import fused_linear_cross_entropy_ref

__all__ = ["FusedLinearCrossEntropyFunction", "default_chunk_rows", "fused_linear_cross_entropy"]

CHUNK_ELEMENTS = 2**29  # logits per chunk by default: 1 GiB in bf16
REDUCTIONS = ("mean", "sum")
_MM_OUT_DTYPE: list[bool] = []  # [ok] once probed: cuBLAS bf16 x bf16 -> fp32 accumulate (torch.addmm out_dtype)


def default_chunk_rows(n: int, vocab: int) -> int:
    """Rows per chunk: ``CHUNK_ELEMENTS / vocab`` rounded down to 128, and at most half the rows when ``n > 256``
    (so the full logits never exist at once)."""
    rows = max(128, (CHUNK_ELEMENTS // max(vocab, 1)) // 128 * 128)
    if n > 256:
        rows = min(rows, -(-n // 2))
    return max(1, min(rows, n))


def _accumulate(acc: Tensor, a: Tensor, b: Tensor, first: bool) -> None:
    """``acc (+)= a @ b`` with ``acc`` fp32 and ``a``, ``b`` possibly bf16/fp16 (fp32 accumulation either way)."""
    if a.dtype == acc.dtype:
        if first:
            torch.mm(a, b, out=acc)
        else:
            acc.addmm_(a, b)
        return
    if acc.is_cuda and _MM_OUT_DTYPE != [False]:
        try:
            if first:
                torch.mm(a, b, out_dtype=acc.dtype, out=acc)  # type: ignore[call-arg]
            else:
                torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)  # type: ignore[call-arg]
            _MM_OUT_DTYPE[:] = [True]
            return
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_OUT_DTYPE[:] = [False]
    part = torch.mm(a, b)
    if first:
        acc.copy_(part)
    else:
        acc.add_(part)


def _combine(m: Tensor, sumexp: Tensor, target: Tensor, group: dist.ProcessGroup) -> tuple[Tensor, Tensor, Tensor]:
    """Full-vocabulary max / sumexp / target logit from each rank's slice (two all-reduces)."""
    gmax = m.clone()
    dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
    both = torch.stack((sumexp * torch.exp(m - gmax), target))
    dist.all_reduce(both, group=group)
    return gmax, both[0], both[1]


def _resolve_group(name: str) -> dist.ProcessGroup | None:
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)  # type: ignore[arg-type]


def _fused_impl(
    h: Tensor,
    w: Tensor,
    labels: Tensor,
    ignore_index: int,
    chunk_rows: int,
    reduction: str,
    group_name: str,
    compute_dtype: torch.dtype,
    need_dh: bool,
    need_dw: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    from lightning_llmopt.kernels.fused_linear_ce_triton import ce_grad_launch, ce_stats_launch

    n, v = h.shape[0], w.shape[0]
    group = _resolve_group(group_name)
    vocab_start = dist.get_rank(group) * v if group is not None else 0
    hc = h if h.dtype == compute_dtype else h.to(compute_dtype)
    wc = w if w.dtype == compute_dtype else w.to(compute_dtype)
    valid = labels != ignore_index
    scale = 1.0 / valid.sum().float() if reduction == "mean" else torch.ones((), device=h.device)
    loss_rows = torch.empty(n, device=h.device, dtype=torch.float32)
    dh = torch.empty_like(h, memory_format=torch.contiguous_format) if need_dh else h.new_empty(0)
    dw = torch.empty(w.shape, device=w.device, dtype=torch.float32) if need_dw else w.new_empty(0)
    buf = torch.empty((min(chunk_rows, n), v), device=h.device, dtype=compute_dtype)
    for start in range(0, n, chunk_rows):
        end = min(n, start + chunk_rows)
        logits = buf[: end - start]  # (C, V)
        torch.mm(hc[start:end], wc.t(), out=logits)
        lab = labels[start:end]
        m, sumexp, target = ce_stats_launch(logits, lab, vocab_start, ignore_index)
        if group is not None:
            m, sumexp, target = _combine(m, sumexp, target, group)
        lse = m + torch.log(sumexp)
        loss_rows[start:end] = torch.where(valid[start:end], lse - target, 0.0)
        if not (need_dh or need_dw):
            continue
        ce_grad_launch(logits, lab, lse, scale, vocab_start, ignore_index)  # logits now hold dlogits
        if need_dh:
            if dh.dtype == compute_dtype:
                torch.mm(logits, wc, out=dh[start:end])
            else:
                dh[start:end] = torch.mm(logits, wc)
        if need_dw:
            _accumulate(dw, logits.t(), hc[start:end], first=start == 0)
    del buf
    if group is not None and need_dh:
        dist.all_reduce(dh, group=group)
    loss = loss_rows.sum() * scale
    return loss, dh, (dw.to(w.dtype) if need_dw and w.dtype != dw.dtype else dw)


@torch.library.custom_op("lightning_llmopt::fused_linear_ce", mutates_args=())
def fused_linear_ce(
    h: Tensor,
    w: Tensor,
    labels: Tensor,
    ignore_index: int,
    chunk_rows: int,
    reduction: str,
    group_name: str,
    compute_dtype: torch.dtype,
    need_dh: bool,
    need_dw: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss, dh, dw)``: fp32 scalar loss, ``dh`` like ``h`` ``(N, H)``, ``dw`` like ``w`` ``(V, H)`` (empty when
    not needed)."""
    return _fused_impl(h, w, labels, ignore_index, chunk_rows, reduction, group_name, compute_dtype, need_dh, need_dw)


@fused_linear_ce.register_fake
def _(
    h: Tensor,
    w: Tensor,
    labels: Tensor,
    ignore_index: int,
    chunk_rows: int,
    reduction: str,
    group_name: str,
    compute_dtype: torch.dtype,
    need_dh: bool,
    need_dw: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    dh = torch.empty_like(h, memory_format=torch.contiguous_format) if need_dh else h.new_empty(0)
    dw = torch.empty_like(w) if need_dw else w.new_empty(0)
    return h.new_empty((), dtype=torch.float32), dh, dw


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """The loss under autograd: the forward computes the gradients, the backward scales them."""

    @staticmethod
    def forward(
        ctx,
        h: Tensor,
        w: Tensor,
        labels: Tensor,
        ignore_index: int,
        chunk_rows: int,  # type: ignore
        reduction: str,
        group_name: str,
        compute_dtype: torch.dtype,
    ) -> Tensor:
        need_dh, need_dw = bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1])
        loss, dh, dw = torch.ops.lightning_llmopt.fused_linear_ce(
            h, w, labels, ignore_index, chunk_rows, reduction, group_name, compute_dtype, need_dh, need_dw
        )
        ctx.save_for_backward(dh, dw)
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        dh, dw = ctx.saved_tensors
        gh = dh * grad.to(dh.dtype) if ctx.needs_input_grad[0] else None
        gw = dw * grad.to(dw.dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None, None, None, None


def _validate(hidden: Tensor, weight: Tensor, labels: Tensor, reduction: str) -> None:
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be (V, H) with H = hidden's last dim ({hidden.shape[-1]})")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} must have hidden's leading shape {tuple(hidden.shape[:-1])}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction ({reduction!r}) must be one of {REDUCTIONS}")


def fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int | None = None,
    process_group: dist.ProcessGroup | None = None,
    compute_dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> Tensor:
    """``cross_entropy(hidden @ weight.T, labels)`` computed chunk by chunk, never holding the full logits.

    Shapes: ``hidden`` ``(..., H)``, ``weight`` ``(V_local, H)`` (the output head, not transposed), ``labels``
    ``hidden.shape[:-1]`` int64 ids of the full vocabulary; returns an fp32 scalar. Gradients flow to ``hidden``
    and ``weight`` (in their own dtypes; ``weight``'s is accumulated in fp32).

    Arguments:
        ignore_index: label of tokens that count neither in the loss nor in the mean.
        reduction: ``"mean"`` over non-ignored tokens (NaN when there are none, as PyTorch; gradients are then 0)
            or ``"sum"``.
        chunk_size: rows per chunk (default :func:`default_chunk_rows`: 2^29 logits, at most half of the rows).
        process_group: vocab-parallel tensor parallelism: ``weight`` is rank ``r``'s slice
            ``[r * V_local, (r + 1) * V_local)`` of the vocabulary and ``hidden``/``labels`` are the same on every
            rank; the softmax statistics are all-reduced per chunk and ``hidden``'s gradient is summed over the group.
        compute_dtype: dtype of the matmuls (default: the autocast dtype when autocast is on, else hidden's dtype).
            Softmax statistics are always fp32.
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (default ``$LLMOPT_FUSED_BACKEND`` or ``"auto"``); the
            reference is the unfused :func:`~lightning_llmopt.kernels.fused_ref.fused_linear_cross_entropy_ref`.
    """
    _validate(hidden, weight, labels, reduction)
    cdt = compute_dtype or autocast_dtype(hidden.device.type) or hidden.dtype
    if (
        resolve_backend(backend, hidden.device, "fused_linear_cross_entropy") == "reference"
        or cdt not in KERNEL_DTYPES
        or hidden.dtype not in KERNEL_DTYPES
        or weight.dtype not in KERNEL_DTYPES
    ):
        return fused_linear_cross_entropy_ref(
            hidden.reshape(-1, hidden.shape[-1]),
            weight,
            labels.reshape(-1),
            ignore_index=ignore_index,
            reduction=reduction,
            process_group=process_group,
            compute_dtype=cdt,
        )
    h2 = hidden.reshape(-1, hidden.shape[-1])
    h2 = h2 if h2.stride(-1) == 1 else h2.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    lab = labels.reshape(-1).contiguous()
    rows = chunk_size or default_chunk_rows(h2.shape[0], w.shape[0])
    if rows < 1:
        raise ValueError(f"chunk_size ({chunk_size}) must be positive")
    name = process_group.group_name if process_group is not None else ""
    return FusedLinearCrossEntropyFunction.apply(h2, w, lab, int(ignore_index), int(rows), reduction, name, cdt)
