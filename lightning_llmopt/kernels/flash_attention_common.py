"""Shapes, strides and tuning tables shared by the flash-attention launchers (imports no Triton)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class Geometry:
    """Sizes of one call. Dense: ``(B, S, H, D)`` tensors; packed: ``(total, H, D)`` with ``cu_seqlens``.

    Arguments:
        batch: number of sequences (``B`` dense, documents when packed).
        seq_q, seq_k: sequence lengths (dense); the longest document (packed, both equal).
        num_heads, group: query heads and query heads per key/value head.
        head_dim, block_d: head dim and its padding to a power of two (at least 16, the smallest ``tl.dot``).
        cu_seqlens: ``(batch + 1,)`` int32 document offsets when packed.
        total: packed token count (0 when dense).
    """

    batch: int
    seq_q: int
    seq_k: int
    num_heads: int
    group: int
    head_dim: int
    block_d: int
    cu_seqlens: Tensor | None = None
    total: int = 0

    @property
    def max_q(self) -> int:
        return self.seq_q

    @property
    def max_k(self) -> int:
        return self.seq_k

    @property
    def lse_shape(self) -> tuple[int, ...]:
        if self.cu_seqlens is not None:
            return (self.num_heads, self.total)
        return (self.batch, self.num_heads, self.seq_q)

    @property
    def tune_args(self) -> tuple[int, int]:
        """``(tune_q, tune_k)``: the lengths rounded up to powers of two (at least 16), the autotuning key.

        Keyed on the exact lengths, every new length re-ran the whole configuration search (tens of milliseconds);
        an inference engine's mixed and verification steps, and packed training batches, bring a new longest
        sequence nearly every call. One search per power of two serves them all.
        """
        return tune_bucket(self.seq_q), tune_bucket(self.seq_k)

    def strides(self, t: Tensor) -> tuple[int, int, int]:
        """(batch, token, head) strides in elements; the head dim must be contiguous."""
        if self.cu_seqlens is not None:
            return 0, t.stride(0), t.stride(1)
        return t.stride(0), t.stride(1), t.stride(2)

    def lse_strides(self, lse: Tensor) -> tuple[int, int]:
        """(batch, head) strides of an lse/delta tensor; the token stride is 1."""
        if self.cu_seqlens is not None:
            return 0, lse.stride(0)
        return lse.stride(0), lse.stride(1)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def geometry(q: Tensor, k: Tensor, cu_seqlens: Tensor | None, max_seqlen: int | None) -> Geometry:
    """The :class:`Geometry` of ``q``/``k`` (shapes already validated by the caller)."""
    head_dim = q.shape[-1]
    block_d = max(16, next_pow2(head_dim))
    if cu_seqlens is None:
        B, s_q, H, _ = q.shape
        return Geometry(B, s_q, k.shape[1], H, H // k.shape[2], head_dim, block_d)
    assert max_seqlen is not None
    H = q.shape[1]
    return Geometry(cu_seqlens.numel() - 1, max_seqlen, max_seqlen, H, H // k.shape[1], head_dim, block_d,
                    cu_seqlens, q.shape[0])


TUNE_KEY = ["tune_q", "tune_k", "HEAD_D", "IS_CAUSAL", "HAS_WINDOW", "IS_VARLEN"]


def tune_bucket(n: int) -> int:
    """``n`` rounded up to a power of two, at least 16 (one autotuning search per bucket)."""
    return 1 << max(4, (max(int(n), 1) - 1).bit_length())


def use_interpreter_config(t: Tensor) -> bool:
    """Fixed small blocks (no autotuning) when running in the Triton interpreter."""
    return t.device.type == "cpu" or os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreter_block(n: int) -> int:
    """Block size under the interpreter: 16 keeps tests of the masking paths cheap; 32 for longer sequences."""
    return 16 if n <= 64 else 32


def fwd_configs() -> list[tuple[dict[str, int], int, int]]:
    """Forward autotuning list: ``({BLOCK_M, BLOCK_N}, num_warps, num_stages)`` (Hopper-oriented, kept short)."""
    return [
        ({"BLOCK_M": 128, "BLOCK_N": 64}, 4, 3),
        ({"BLOCK_M": 128, "BLOCK_N": 64}, 8, 3),
        ({"BLOCK_M": 128, "BLOCK_N": 128}, 8, 3),
        ({"BLOCK_M": 64, "BLOCK_N": 64}, 4, 4),
    ]


def bwd_configs() -> list[tuple[dict[str, int], int, int]]:
    """Backward (dK/dV and dQ passes) autotuning list; ``BLOCK_N`` is the tile owned by the program."""
    return [
        ({"BLOCK_M": 32, "BLOCK_N": 128}, 4, 3),
        ({"BLOCK_M": 64, "BLOCK_N": 128}, 8, 3),
        ({"BLOCK_M": 64, "BLOCK_N": 64}, 4, 3),
    ]


def dq_configs() -> list[tuple[dict[str, int], int, int]]:
    """dQ pass: ``BLOCK_M`` queries per program, ``BLOCK_N`` keys per step."""
    return [
        ({"BLOCK_M": 128, "BLOCK_N": 32}, 4, 3),
        ({"BLOCK_M": 128, "BLOCK_N": 64}, 8, 3),
        ({"BLOCK_M": 64, "BLOCK_N": 64}, 4, 3),
    ]


def device_is_cuda(t: Tensor) -> bool:
    return t.device.type == "cuda" and torch.cuda.is_available()
