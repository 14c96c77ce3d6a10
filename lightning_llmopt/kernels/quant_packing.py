"""Bit packing of integer codes into int32 words: the one layout our kernels, GPTQ and compressed-tensors share.

**Dense LSB-first packing along the last dimension** (:func:`pack_bits` / :func:`unpack_bits`): row ``r`` of a
``(R, C)`` code tensor is a bit stream in which element ``c`` occupies bits ``[c * bits, (c + 1) * bits)``; bit
``p`` of the stream is bit ``p % 32`` of word ``p // 32``. So

- ``bits = 4``: word ``w`` holds elements ``8w .. 8w+7``, element ``8w + j`` in bits ``4j .. 4j+3``; on a
  little-endian machine the int32 tensor viewed as ``uint8`` ``(R, C / 2)`` holds element ``2b`` in the low nibble
  and ``2b + 1`` in the high nibble of byte ``b`` (what the Triton kernel reads);
- ``bits = 8``: the int32 tensor viewed as ``uint8`` ``(R, C)`` is the codes themselves;
- ``bits = 3`` (or 5, 6, 7): 32 elements fill exactly ``bits`` words and an element may straddle two words
  (AutoGPTQ's 3-bit layout, and compressed-tensors >= 0.20's ``pack_to_int32``).

Packed shape: ``(R, ceil(C * bits / 32))`` int32 (the last word zero-padded).

Where the formats put it:

- our :class:`~lightning_llmopt.layers.quantized_linear.QuantizedLinear` ``qweight``: codes ``(N, K)`` packed along
  ``K``, i.e. ``(N, K * bits / 32)``; this is bit-for-bit compressed-tensors' ``weight_packed`` (which stores the
  signed value plus ``2**(bits-1)``, equal to our code for a symmetric grid);
- GPTQ ``qweight`` ``(K * bits / 32, N)`` is the transpose of the same tensor; GPTQ ``qzeros``
  ``(K / G, N * bits / 32)`` packs zero points along ``N``.

It lives with the kernels, which read it (:mod:`~lightning_llmopt.kernels.quant_matmul`); the quantization package
re-exports it as :mod:`lightning_llmopt.quantization.packing`.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

_LITTLE = sys.byteorder == "little"


def packed_words(numel: int, bits: int) -> int:
    """int32 words holding ``numel`` codes of ``bits`` bits."""
    return (numel * bits + 31) // 32


def _check(codes: Tensor, bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bits ({bits}) must be in [1, 8]")
    if codes.ndim != 2:
        raise ValueError(f"codes must be 2-D (rows, columns), got shape {tuple(codes.shape)}")
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise TypeError(f"codes must be an integer tensor, got {codes.dtype}")


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Pack ``(R, C)`` integer codes in ``[0, 2**bits)`` into int32 ``(R, ceil(C * bits / 32))`` (module layout).

    Values outside the range raise ``ValueError`` (they would corrupt their neighbours).
    """
    _check(codes, bits)
    rows, cols = codes.shape
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= (1 << bits)):
        raise ValueError(f"codes must lie in [0, {1 << bits}), got [{int(codes.min())}, {int(codes.max())}]")
    words = packed_words(cols, bits)
    if _LITTLE and bits in (4, 8):  # fast path: byte view
        c = codes.to(torch.uint8)
        if bits == 4:
            if cols % 2:
                c = torch.nn.functional.pad(c, (0, 1))
            c = c[:, 0::2] | (c[:, 1::2] << 4)  # (R, ceil(C/2))
        out = torch.zeros((rows, words * 4), dtype=torch.uint8, device=c.device)  # standard strides for the view
        out[:, : c.shape[1]] = c
        return out.view(torch.int32)
    c = codes.to(torch.int64)
    padded = ((cols + 31) // 32) * 32
    if padded != cols:
        c = torch.nn.functional.pad(c, (0, padded - cols))
    c = c.reshape(rows, padded // 32, 32)  # 32 codes fill exactly `bits` words
    pos = torch.arange(32, device=c.device) * bits
    word, offset = pos // 32, pos % 32
    out = torch.zeros(rows, padded // 32, bits + 1, dtype=torch.int64, device=c.device)
    out.index_add_(2, word, c << offset)  # low part; bits above 32 spill and are masked below
    spill = offset + bits > 32
    if bool(spill.any()):
        out.index_add_(2, word[spill] + 1, c[..., spill] >> (32 - offset[spill]))
    out = out[..., :bits] & 0xFFFFFFFF
    out = torch.where(out >= 1 << 31, out - (1 << 32), out)  # two's complement int32
    return out.reshape(rows, -1)[:, :words].to(torch.int32).contiguous()


def unpack_bits(packed: Tensor, bits: int, cols: int) -> Tensor:
    """Inverse of :func:`pack_bits`: int32 ``(R, W)`` -> uint8 codes ``(R, cols)``."""
    if packed.dtype != torch.int32 or packed.ndim != 2:
        raise TypeError(f"packed must be a 2-D int32 tensor, got {packed.dtype} {tuple(packed.shape)}")
    if not 1 <= bits <= 8:
        raise ValueError(f"bits ({bits}) must be in [1, 8]")
    rows, words = packed.shape
    if words < packed_words(cols, bits):
        raise ValueError(f"{words} words per row cannot hold {cols} codes of {bits} bits")
    if _LITTLE and bits in (4, 8):
        b = packed.contiguous().view(torch.uint8)
        if bits == 4:
            b = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(rows, -1)
        return b[:, :cols].contiguous()
    w = packed.to(torch.int64) & 0xFFFFFFFF
    groups = (words + bits - 1) // bits
    if groups * bits != words:
        w = torch.nn.functional.pad(w, (0, groups * bits - words))
    w = torch.nn.functional.pad(w.reshape(rows, groups, bits), (0, 1))  # a zero word for the last spill
    pos = torch.arange(32, device=w.device) * bits
    word, offset = pos // 32, pos % 32
    value = (w[..., word] >> offset) | (w[..., word + 1] << (32 - offset))
    value = value & ((1 << bits) - 1)
    return value.reshape(rows, groups * 32)[:, :cols].to(torch.uint8).contiguous()


def as_kernel_bytes(packed: Tensor, bits: int, cols: int) -> Tensor:
    """The packed int32 ``(N, W)`` codes as the ``uint8`` ``(N, cols * bits / 8)`` view the Triton kernel reads
    (no copy; bits 4 or 8 on a little-endian machine)."""
    if bits not in (4, 8):
        raise ValueError(f"the kernel reads 4- or 8-bit codes, got bits={bits}")
    if not _LITTLE:
        raise RuntimeError("the byte view of packed codes assumes a little-endian machine")
    return packed.view(torch.uint8)[:, : cols * bits // 8]


__all__ = ["as_kernel_bytes", "pack_bits", "packed_words", "unpack_bits"]
