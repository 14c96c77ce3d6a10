"""Paged-attention decode: the public function, its ``torch.library`` custom op and the backend switch.

Layers (CONVENTIONS.md, "three layers per kernel"; decode has no backward, so there is no autograd function):

- the Triton kernels and launcher in :mod:`~lightning_llmopt.kernels.paged_attention_kernel` (imported on first use,
  so importing this module imports no Triton);
- the custom op ``lightning_llmopt::paged_attention_decode`` with a fake (meta) implementation, so
  ``torch.compile`` traces through it and CUDA graphs capture it;
- :func:`paged_attention`, which validates the inputs, chooses the number of KV splits and picks the Triton path or
  the pure-PyTorch reference :func:`~lightning_llmopt.kernels.paged_attention_ref.paged_attention_ref`; outside
  ``torch.compile`` it calls the launcher directly, skipping the op's dispatch cost.

Backend switch: the ``backend`` argument, else ``$LLMOPT_PAGED_BACKEND``, else ``"auto"`` (Triton for CUDA tensors
when Triton is installed, the reference otherwise); ``"triton"`` on CPU tensors needs ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
import math
import os

import torch
from torch import Tensor

from lightning_llmopt._triton_env import triton_available, triton_interpreter_enabled
from lightning_llmopt.kernels.paged_attention_ref import paged_attention_ref

__all__ = ["choose_splits", "paged_attention", "resolve_paged_backend"]

_ENV = "LLMOPT_PAGED_BACKEND"
_BACKENDS = ("auto", "triton", "reference")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_TOKENS_PER_SPLIT = 256  # the grid gets no more splits than max_span / this (a split's fixed cost: q load, merge)
MIN_PIECE = 64  # a row's piece of keys is at least this long on CUDA (one key tile), whatever its length
PROGRAMS_PER_SM = 2


@torch.library.custom_op("lightning_llmopt::paged_attention_decode", mutates_args=())
def paged_attention_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    softmax_scale: float,
    window: int,
    num_splits: int,
    min_tokens_per_split: int,
) -> Tensor:
    """The Triton decode kernel; ``window <= 0`` means no window."""
    from lightning_llmopt.kernels.paged_attention_kernel import paged_decode

    return paged_decode(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        softmax_scale,
        window,
        k_scale,
        v_scale,
        num_splits,
        min_tokens_per_split,
    )


@paged_attention_decode.register_fake
def _(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    softmax_scale: float,
    window: int,
    num_splits: int,
    min_tokens_per_split: int,
) -> Tensor:
    return torch.empty_like(q)


def resolve_paged_backend(backend: str | None, device: torch.device) -> str:
    """``"triton"`` or ``"reference"`` for a call on ``device`` (rule in the module docstring)."""
    name = (backend or os.environ.get(_ENV) or "auto").lower()
    if name not in _BACKENDS:
        raise ValueError(f"paged attention backend ({name!r}) must be one of {_BACKENDS} (argument or ${_ENV})")
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "reference"
    if name == "triton":
        if not triton_available():
            raise RuntimeError("paged attention backend 'triton' needs the triton package (pip install triton)")
        if device.type != "cuda" and not triton_interpreter_enabled():
            raise RuntimeError(
                f"paged attention backend 'triton' on {device.type} tensors needs TRITON_INTERPRET=1 "
                "set before the kernels are first imported"
            )
    return name


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_splits(
    batch: int, kv_heads: int, max_span: int, device: torch.device, num_splits: int | None = None
) -> int:
    """The number of KV splits for a launch of ``batch * kv_heads`` groups over at most ``max_span`` keys a row.

    Without an explicit ``num_splits``: about :data:`PROGRAMS_PER_SM` programs per multiprocessor (``round(2 * SMs /
    groups)``, at least 1), and no more than ``ceil(max_span / MIN_TOKENS_PER_SPLIT)``. One split on CPU. The kernel
    then cuts each row's own visible keys into that many pieces. Measured on an H100 (``benchmarks/sweep_paged.py``,
    256 MB to 1 GB of bf16 KV, 2026-11-25): 2 programs per SM was best or within 1.2% of the best split count at
    every shape, where the earlier 4 (rounded up) lost up to 10% to the tail of a second wave.
    """
    span = max(int(max_span), 1)
    if num_splits is None:
        if device.type != "cuda":
            return 1
        sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
        num_splits = max(1, min(round(PROGRAMS_PER_SM * sms / max(batch * kv_heads, 1)),
                                math.ceil(span / MIN_TOKENS_PER_SPLIT)))
    if num_splits < 1:
        raise ValueError(f"num_splits ({num_splits}) must be >= 1")
    return min(num_splits, span)


def _validate(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    window: int | None,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
) -> None:
    if q.ndim != 3:
        raise ValueError(f"q must be (B, H, D), got shape {tuple(q.shape)}")
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
            "(num_blocks, H_kv, block_size, D)"
        )
    B, H, D = q.shape
    if k_cache.shape[3] != D:
        raise ValueError(f"head dims differ: q {D} vs cache {k_cache.shape[3]}")
    if H % k_cache.shape[1]:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({k_cache.shape[1]})")
    if block_tables.ndim != 2 or block_tables.shape[0] != B or context_lens.shape != (B,):
        raise ValueError(
            f"block_tables must be (B={B}, max_blocks) and context_lens (B,), got "
            f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}"
        )
    if window is not None and window < 1:
        raise ValueError(f"window ({window}) must be >= 1")
    if k_cache.dtype == torch.int8:
        if k_scale is None or v_scale is None:
            raise ValueError("an int8 KV cache needs its calibrated k_scale and v_scale (H_kv,) tensors")
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s.shape != (k_cache.shape[1],):
                raise ValueError(f"{name} must be (H_kv={k_cache.shape[1]},), got {tuple(s.shape)}")
    elif k_cache.dtype != q.dtype:
        raise ValueError(f"cache dtype ({k_cache.dtype}) must be q's ({q.dtype}) or int8")


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    *,
    softmax_scale: float | None = None,
    window: int | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    max_context: int | None = None,
    num_splits: int | None = None,
    backend: str | None = None,
) -> Tensor:
    """One query per sequence against its paged keys/values: ``softmax(q k^T * scale) v`` over the visible keys.

    Arguments:
        q: ``(B, H, D)`` fp16/bf16/fp32 (fp32 dots are exact ``ieee``; for tests).
        k_cache, v_cache: ``(num_blocks, H_kv, block_size, D)`` in ``q``'s dtype, or int8 with ``k_scale`` and
            ``v_scale`` ``(H_kv,)`` fp32 (value = int8 * scale).
        block_tables: ``(B, max_blocks)`` int32 physical block ids.
        context_lens: ``(B,)`` int32 tokens per sequence, the query's own key included (0: a padding row, output 0).
        softmax_scale: default ``1 / sqrt(D)``.
        window: sliding window of ``window`` keys, the query's own included.
        max_context: an upper bound of ``context_lens`` known on the host (sizes the split-KV grid without a device
            sync; default ``max_blocks * block_size``). Keep it fixed across CUDA-graph replays.
        num_splits: force the number of KV splits (default: :func:`choose_splits`).
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (default ``$LLMOPT_PAGED_BACKEND`` or ``"auto"``).

    Returns: ``(B, H, D)`` in ``q``'s dtype. Layout and mask rule: :mod:`~lightning_llmopt.kernels.paged_attention_ref`.
    """
    _validate(q, k_cache, v_cache, block_tables, context_lens, window, k_scale, v_scale)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if resolve_paged_backend(backend, q.device) == "reference" or q.dtype not in _FLOAT_DTYPES:
        return paged_attention_ref(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            softmax_scale=scale,
            window=window,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    bound = max_context if max_context is not None else block_tables.shape[1] * k_cache.shape[2]
    span = min(bound, window) if window is not None else bound
    splits = choose_splits(q.shape[0], k_cache.shape[1], span, q.device, num_splits)
    if q.stride(-1) != 1:
        q = q.contiguous()
    scales: tuple[Tensor | None, Tensor | None] = (None, None)
    if k_cache.dtype == torch.int8:
        assert k_scale is not None and v_scale is not None  # checked by _validate
        scales = (k_scale.float().contiguous(), v_scale.float().contiguous())
    tables, lens = block_tables.to(torch.int32), context_lens.to(torch.int32)
    win, min_piece = (window if window is not None else 0), (MIN_PIECE if q.device.type == "cuda" else 1)
    if torch.compiler.is_compiling():
        return torch.ops.lightning_llmopt.paged_attention_decode(
            q, k_cache, v_cache, tables, lens, scales[0], scales[1], float(scale), win, splits, min_piece
        )
    # Eager (and CUDA-graph capture): the launcher directly, as quant_matmul does; the custom op's dispatch costs
    # host time comparable to a 256 MB call's 0.09 ms of kernel (eager calls measured host-bound, record decode-kernel)
    from lightning_llmopt.kernels.paged_attention_kernel import paged_decode

    return paged_decode(q, k_cache, v_cache, tables, lens, float(scale), win, scales[0], scales[1], splits, min_piece)
