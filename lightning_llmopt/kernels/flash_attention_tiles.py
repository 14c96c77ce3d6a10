"""Tile ranges shared by the Triton and the Gluon (Hopper) dK/dV passes of the flash-attention backward."""

from __future__ import annotations

import triton
import triton.language as tl

from lightning_llmopt.kernels.flash_attention_interp import ensure_interpreted_stdlib

ensure_interpreted_stdlib()  # before the function below is decorated


@triton.jit
def dkdv_query_range(start_n, seq_q, q_off, WINDOW, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """For the key tile at ``start_n``: the query tiles ``[lo, hi)`` that see some of its keys, and inside them
    ``[full_lo, full_hi)``, the tiles every pair of which is visible (no mask). A ragged last query tile is left out
    of the full band. ``q_off = seq_k - seq_q`` (queries aligned to the end of the keys)."""
    lo = 0
    hi = seq_q
    full_lo = 0
    full_hi = (seq_q // BLOCK_M) * BLOCK_M
    if IS_CAUSAL:
        lo = tl.maximum(0, start_n - q_off)
        lo = (lo // BLOCK_M) * BLOCK_M
        full_lo = tl.maximum(0, start_n + BLOCK_N - 1 - q_off)
        full_lo = tl.cdiv(full_lo, BLOCK_M) * BLOCK_M
    if HAS_WINDOW:
        hi = tl.minimum(seq_q, start_n + BLOCK_N - 1 + WINDOW - q_off)
        full_hi = tl.minimum(full_hi, (tl.maximum(0, start_n + WINDOW - q_off) // BLOCK_M) * BLOCK_M)
    hi = tl.maximum(hi, 0)
    full_lo = tl.maximum(full_lo, lo)
    full_hi = tl.minimum(full_hi, (hi // BLOCK_M) * BLOCK_M)
    return lo, hi, full_lo, full_hi
