"""When the warp-specialized Hopper forward (:mod:`flash_attention_fwd_ws`) takes a call, and how it sees a tensor
through TMA: host-side rules only, with no Gluon import, so the Triton forward asks here before any Gluon loads.

Which schedule, if any, takes a call (:func:`ws_plan`) comes from sweeps on an H100 and an H200 (B*S = 16k,
H*D = 2048, S 1k..16k, 2026-11-27; docs/flash_attention.md). Head dim 128: two consumers, plain, at every length
(see the persistent form below; the one-program-per-tile kernel alone was 1.1-1.4x the Triton forward from
S = 2048 but only ~1.03x at S = 1024 causal, where its launch also cost more host time). Head dim 64: three
consumers, ping-pong without a mask (1.05-1.25x from S = 2048, a tie at 1024) and plain with the causal one (ahead
only from S = 8192).
Packed input (16k-token packs, H100, 2026-11-27, benchmarks/results/sweeps/attention-ws-varlen-*): head dim 128
takes the kernel without a mask (1.02-1.20x the Triton forward) and under the causal one where documents average
1024 tokens or more (1.06-1.21x; 0.96-0.98x at 256 and 512); head dim 64 stays with the Triton forward (the kernel
measured 0.75x at 16 x 1k).
Head dim 128 runs the kernel's persistent form (:mod:`flash_attention_fwd_ws_persistent`, bit-identical
outputs) on dense calls and on packs of equal documents; since it did, head dim 128 dense takes the kernel at every
length (1.18x the Triton forward at S = 1024 causal, where the one-program-per-tile kernel was only ~1.03x).
``LLMOPT_FLASH_FWD`` overrides the choice: ``triton`` never takes the kernel, ``ws`` takes it wherever it applies.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
from torch import Tensor

from lightning_llmopt.kernels.flash_attention_common import Geometry, cuda_capability


class WsPlan(NamedTuple):
    """A launch of the warp-specialized forward: consumer warpgroups, ping-pong, key tile, stages, registers."""

    consumers: int
    pingpong: bool
    block_n: int
    stages: int
    maxnreg: int  # what every warp starts with: (consumers + 1) warpgroups of 128 threads share 64k registers
    consumer_regs: int
    persistent: bool = False  # flash_attention_fwd_ws_persistent where it applies (dense; packs of equal documents)


_HD128 = WsPlan(2, False, 128, 2, 168, 240, True)
_HD64 = WsPlan(3, True, 128, 3, 128, 160)
_HD64_CAUSAL = WsPlan(3, False, 128, 3, 128, 160)
# the shortest key length each (head dim, causal) takes this kernel from (module docstring)
_FROM = {(128, False): 0, (128, True): 0, (64, False): 2048, (64, True): 8192}
# packed input, by the mean document length (total tokens / documents); head dim 64 stays with the Triton forward
_PACKED_FROM = {(128, False): 0, (128, True): 1024}


def tma_rows(t: Tensor) -> tuple[int, int, int, int, int] | None:
    """How a dense ``(B, S, H, D)`` tensor ``t`` is seen as a 2-D row-major matrix for TMA: ``(rows, row_stride,
    row_per_b, row_per_h, col_per_h)`` (element ``(b, s, h, d)`` at row ``b row_per_b + h row_per_h + s``, column
    ``h col_per_h + d``), or ``None`` for other strides. ``(B, S, H, D)`` contiguous and ``(B, H, S, D)`` contiguous
    storage seen through ``transpose(1, 2)`` qualify. A packed ``(total, H, D)`` tensor (element ``(t, h, d)`` at
    row ``t``, column ``h D + d``) qualifies with its heads side by side in a row and any 16-byte multiple as the
    token stride (the rows of a fused QKV projection's output, say): ``(total, stride, 0, 0, D)``."""
    if t.dim() == 3:
        total, H, D = t.shape
        st, sh, sd = t.stride()
        aligned = (st * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
        return (total, st, 0, 0, D) if sd == 1 and sh == D and st >= H * D and aligned else None
    B, S, H, D = t.shape
    sb, ss, sh, sd = t.stride()
    if sd != 1 or (ss * t.element_size()) % 16 or t.data_ptr() % 16:
        return None
    if sh == D and ss == H * D and sb == S * H * D:  # (B, S, H, D)
        return B * S, ss, S, 0, D
    if ss == D and sh == S * D and sb == H * S * D:  # (B, H, S, D) storage
        return B * H * S, ss, H * S, S, 0
    return None


def ws_plan(q: Tensor, k: Tensor, v: Tensor, geo: Geometry, causal: bool, window: int | None) -> WsPlan | None:
    """The launch the warp-specialized forward takes the call with, or ``None`` for the Triton forward. It applies
    on a Hopper GPU (compute capability 9.0) to dense or packed fp16/bf16 inputs without a window, head dim 64 or
    128, TMA-compatible layouts (:func:`tma_rows`); there ``LLMOPT_FLASH_FWD`` (``auto``, the default; ``ws``;
    ``triton``) decides, ``auto`` by the measured rule of the module docstring."""
    mode = os.environ.get("LLMOPT_FLASH_FWD", "auto")
    if mode not in ("auto", "ws", "triton"):
        raise ValueError(f"LLMOPT_FLASH_FWD must be 'auto', 'ws' or 'triton', got {mode!r}")
    if mode == "triton" or q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    if window is not None or geo.head_dim not in (64, 128) or geo.seq_q == 0 or geo.batch == 0:
        return None
    packed = geo.cu_seqlens is not None
    plan = choose_plan(geo.head_dim, causal, geo.total // geo.batch if packed else geo.seq_k, mode, packed)
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if plan is None or cuda_capability(index) != (9, 0) or any(tma_rows(t) is None for t in (q, k, v)):
        return None
    return plan


def choose_plan(head_dim: int, causal: bool, length: int, mode: str = "auto", packed: bool = False) -> WsPlan | None:
    """The measured rule of the module docstring, for a call the kernel applies to (``mode="ws"``: any length).
    ``length``: the key length (dense) or the mean document length (packed)."""
    plan = _HD128 if head_dim == 128 else _HD64_CAUSAL if causal else _HD64
    from_len = (_PACKED_FROM if packed else _FROM).get((head_dim, causal))
    return plan if mode == "ws" or (from_len is not None and length >= from_len) else None


__all__ = ["WsPlan", "choose_plan", "tma_rows", "ws_plan"]
