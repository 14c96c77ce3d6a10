"""``StepInputs``: the device tensors of one forward step (built by :mod:`~lightning_llmopt.inference.runner`, read
by the runner's attention and by the fused forward of :mod:`~lightning_llmopt.inference.decode_kernels`)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

__all__ = ["StepInputs"]


@dataclass
class StepInputs:
    """Device tensors of one step (``N`` packed tokens: ``num_decode`` decodes, then prefill chunks).

    Prefill attention is one variable-length flash-attention call over *segments*, one per prefill chunk: a chunk
    at positions ``start .. start + n - 1`` whose keys from ``lo`` (0, or the window's left edge) are needed gets a
    segment of ``start - lo`` context rows (keys/values read back from the pool, dummy all-zero queries whose outputs
    are dropped) followed by its ``n`` new rows. With equal query and key lengths per segment the causal (and
    window) masks line up, so one kernel call serves fresh prompts, chunked prefills and prefix hits alike.
    """

    input_ids: Tensor  # (N,) int64
    positions: Tensor  # (N,) int64
    blocks: Tensor  # (N,) int64: block of each token's key/value
    slots: Tensor  # (N,) int64: slot in that block
    num_decode: int
    dec_tables: Tensor  # (num_decode, max_blocks) int32
    dec_ctx: Tensor  # (num_decode,) int32, query's own key included
    dec_max_ctx: int
    logits_idx: Tensor  # (S,) int64 rows whose logits are returned
    seg_cu: Tensor | None = None  # (P + 1,) int32 segment offsets (None: no prefill)
    seg_max: int = 0  # bucketed longest segment
    seg_total: int = 0  # rows of all segments
    seg_new: Tensor | None = None  # (N - num_decode,) segment row of each new prefill token (None: no context)
    seg_ctx: Tensor | None = None  # (C,) segment row of each context key
    ctx_blocks: Tensor | None = None  # (C,) block of each context key
    ctx_slots: Tensor | None = None  # (C,) slot of each context key
    # KV groups (producers with different windows): the same step with each group's block fields,
    # group 0 first (:func:`~lightning_llmopt.inference.kv_groups.group_inputs`); None with one pool.
    groups: list[StepInputs] | None = None
