"""Flash attention: the public function, its autograd function and its ``torch.library`` custom ops.

Layers (CONVENTIONS.md, "three layers per kernel"):

- Triton kernels and launchers: :mod:`~lightning_llmopt.kernels.flash_attention_fwd` and
  :mod:`~lightning_llmopt.kernels.flash_attention_bwd` (imported on first use, so importing this module imports no
  Triton);
- the custom ops ``lightning_llmopt::flash_attn_fwd`` / ``lightning_llmopt::flash_attn_bwd`` with fake (meta)
  implementations, so ``torch.compile`` traces through them without graph breaks;
- :class:`FlashAttnFunction` (``torch.autograd.Function``) tying the two ops together;
- :func:`flash_attention`, which validates the inputs and picks the Triton path or the pure-PyTorch reference
  (:func:`~lightning_llmopt.kernels.flash_attention_ref.flash_attention_ref`).

Backend switch: the ``backend`` argument, else the ``LLMOPT_FLASH_BACKEND`` environment variable, else ``"auto"``:
``"triton"`` forces the kernels (on CPU only under ``TRITON_INTERPRET=1``), ``"reference"`` forces PyTorch,
``"auto"`` takes Triton for CUDA tensors when Triton is installed and the reference otherwise.
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

from lightning_llmopt._triton_env import triton_available, triton_interpreter_enabled
from lightning_llmopt.kernels.flash_attention_common import geometry
from lightning_llmopt.kernels.flash_attention_ref import flash_attention_ref

__all__ = ["FlashAttnFunction", "flash_attention", "resolve_backend"]

_ENV = "LLMOPT_FLASH_BACKEND"
_BACKENDS = ("auto", "triton", "reference")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------- custom ops


def _geo(q: Tensor, k: Tensor, cu_seqlens: Tensor | None, max_seqlen: int):  # type: ignore[no-untyped-def]
    return geometry(q, k, cu_seqlens, max_seqlen if cu_seqlens is not None else None)


def _fwd_impl(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor | None, max_seqlen: int, causal: bool,
              softmax_scale: float, window: int) -> tuple[Tensor, Tensor]:
    from lightning_llmopt.kernels.flash_attention_fwd import flash_fwd

    return flash_fwd(q, k, v, _geo(q, k, cu_seqlens, max_seqlen), causal, softmax_scale,
                     window if window > 0 else None)


def _bwd_impl(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor | None,
              max_seqlen: int, causal: bool, softmax_scale: float, window: int) -> tuple[Tensor, Tensor, Tensor]:
    from lightning_llmopt.kernels.flash_attention_bwd import flash_bwd

    return flash_bwd(do, q, k, v, out, lse, _geo(q, k, cu_seqlens, max_seqlen), causal, softmax_scale,
                     window if window > 0 else None)


def _launch_directly(*tensors: Tensor | None) -> bool:
    """Whether to call the launchers without the dispatcher round trip of the custom ops.

    Only in plain eager execution: nothing is being compiled, no ``TorchDispatchMode`` (FLOP counter, fake mode)
    is active, and every tensor is a plain ``torch.Tensor`` (no fake, functional or distributed subclass). There the
    custom op only adds host time (the dispatcher and the op wrapper's checks), which at 16 sequences of 1k tokens
    made a forward + backward host-bound on an H100.
    """
    if torch.compiler.is_compiling() or _current_dispatch_mode() is not None:
        return False
    return all(t is None or type(t) is Tensor for t in tensors)


@torch.library.custom_op("lightning_llmopt::flash_attn_fwd", mutates_args=())
def flash_attn_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor | None, max_seqlen: int, causal: bool,
                   softmax_scale: float, window: int) -> tuple[Tensor, Tensor]:
    """Forward kernel: ``(out, lse)``; ``window <= 0`` means no window."""
    return _fwd_impl(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, window)


@flash_attn_fwd.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor | None, max_seqlen: int, causal: bool,
      softmax_scale: float, window: int) -> tuple[Tensor, Tensor]:
    if cu_seqlens is None:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return torch.empty_like(q), lse


@torch.library.custom_op("lightning_llmopt::flash_attn_bwd", mutates_args=())
def flash_attn_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor | None,
                   max_seqlen: int, causal: bool, softmax_scale: float, window: int) -> tuple[Tensor, Tensor, Tensor]:
    """Backward kernels: ``(dq, dk, dv)``."""
    return _bwd_impl(do, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, softmax_scale, window)


@flash_attn_bwd.register_fake
def _(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor | None,
      max_seqlen: int, causal: bool, softmax_scale: float, window: int) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class FlashAttnFunction(torch.autograd.Function):
    """Autograd over the two custom ops. ``lse`` is returned but not differentiable (its gradient is ignored)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor | None, max_seqlen: int,  # type: ignore
                causal: bool, softmax_scale: float, window: int) -> tuple[Tensor, Tensor]:
        fwd = _fwd_impl if _launch_directly(q, k, v, cu_seqlens) else torch.ops.lightning_llmopt.flash_attn_fwd
        out, lse = fwd(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, window)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.set_materialize_grads(False)  # lse is not differentiable: no zero-filled gradient for it
        ctx.params = (max_seqlen, causal, softmax_scale, window)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, dlse: Tensor | None):  # type: ignore[override]
        if dout is None:  # grads are not materialized: the output got none (lse never has one)
            return None, None, None, None, None, None, None, None
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        max_seqlen, causal, softmax_scale, window = ctx.params
        bwd = _bwd_impl if _launch_directly(dout, q, k, v, cu_seqlens) else torch.ops.lightning_llmopt.flash_attn_bwd
        dq, dk, dv = bwd(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, softmax_scale, window)
        return dq, dk, dv, None, None, None, None, None


# --------------------------------------------------------------------------- public function


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """``"triton"`` or ``"reference"`` for a call on ``device`` (see the module docstring for the rule)."""
    name = (backend or os.environ.get(_ENV) or "auto").lower()
    if name not in _BACKENDS:
        raise ValueError(f"flash attention backend ({name!r}) must be one of {_BACKENDS} (argument or ${_ENV})")
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "reference"
    if name == "triton":
        if not triton_available():
            raise RuntimeError("flash attention backend 'triton' needs the triton package (pip install triton)")
        if device.type != "cuda" and not triton_interpreter_enabled():
            raise RuntimeError(f"flash attention backend 'triton' on {device.type} tensors needs TRITON_INTERPRET=1 "
                               "set before the kernels are first imported")
    return name


def _validate(q: Tensor, k: Tensor, v: Tensor, causal: bool, window: int | None,
              cu_seqlens: Tensor | None) -> None:
    want = 3 if cu_seqlens is not None else 4
    layout = "(total, H, D)" if cu_seqlens is not None else "(B, S, H, D)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != want:
            raise ValueError(f"{name} must be {layout} ({want}-D), got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head dims differ: q {q.shape[-1]} vs k {k.shape[-1]}")
    if q.shape[-2] % k.shape[-2] != 0:
        raise ValueError(f"query heads ({q.shape[-2]}) must be a multiple of key/value heads ({k.shape[-2]})")
    if cu_seqlens is None and q.shape[0] != k.shape[0]:
        raise ValueError(f"batch sizes differ: q {q.shape[0]} vs k {k.shape[0]}")
    if cu_seqlens is not None and q.shape[0] != k.shape[0]:
        raise ValueError(f"packed q ({q.shape[0]} tokens) and k ({k.shape[0]} tokens) must have the same length")
    if window is not None and (not causal or window < 1):
        raise ValueError(f"window ({window}) must be >= 1 and needs causal=True (it counts keys to the left)")


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: int | None = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    return_lse: bool = False,
    backend: str | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """``softmax(q k^T * scale + mask) v`` without materializing the score matrix (FlashAttention-2).

    Layout (flash-attn's, tokens before heads):

    - dense: ``q`` ``(B, S_q, H, D)``, ``k``/``v`` ``(B, S_k, H_kv, D)``; returns ``(B, S_q, H, D)``.
      Our model's ``(B, H, S, D)`` tensors are passed as ``x.transpose(1, 2)`` views (no copy: any strides work as
      long as the head dim is contiguous).
    - packed (``cu_seqlens`` given): ``q`` ``(total, H, D)``, ``k``/``v`` ``(total, H_kv, D)``; ``cu_seqlens``
      ``(N + 1,)`` int offsets starting at 0; no attention crosses documents. ``max_seqlen`` is the longest document
      (computed with a host sync when omitted).

    Arguments:
        causal: query ``i`` sees keys ``j <= i + S_k - S_q`` (bottom-right aligned, as flash-attn >= 2.1).
        softmax_scale: default ``1 / sqrt(D)``.
        window: sliding window of ``window`` keys *including the query's own* (``i - j < window``); needs causal.
            The same convention as :class:`~lightning_llmopt.models.attention.AttentionMask`; flash-attn's
            ``window_size=(w, 0)`` corresponds to ``window = w + 1``.
        return_lse: also return the fp32 log-sum-exp (natural log) of the scaled scores, ``(B, H, S_q)`` dense or
            ``(H, total)`` packed; ``-inf`` for a query that sees no key (whose output is 0). Not differentiable.
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (default: ``$LLMOPT_FLASH_BACKEND`` or ``"auto"``).

    dtypes: fp16/bf16 (fp32 accumulation) or fp32 (exact ``ieee`` dots; for tests). H % H_kv == 0 (GQA/MQA).
    """
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    _validate(q, k, v, causal, window, cu_seqlens)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
        if max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
    if resolve_backend(backend, q.device) == "reference" or q.dtype not in _DTYPES:
        return flash_attention_ref(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window,
                                   cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, return_lse=return_lse)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out, lse = FlashAttnFunction.apply(q, k, v, cu_seqlens, max_seqlen or 0, causal, float(softmax_scale),
                                       window if window is not None else 0)
    return (out, lse) if return_lse else out
