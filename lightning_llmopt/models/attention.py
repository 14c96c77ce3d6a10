"""Attention backends and the mask description they share: :func:`attention` runs a registered backend.

The mask rule, the registry and the ``"sdpa"`` and ``"eager"`` backends are in
:mod:`~lightning_llmopt.models.attention_registry` (re-exported here); importing this module also registers the
``"flex"`` (:mod:`~lightning_llmopt.models.attention_flex`) and ``"triton"``
(:mod:`~lightning_llmopt.models.attention_triton`) backends, which sit above the registry.
"""

from __future__ import annotations

import math

from torch import Tensor

# The "flex" backend registers itself on import; it imports flex_attention only on its first call.
from lightning_llmopt.models import attention_flex as _attention_flex  # noqa: F401

# The "triton" backend (our flash-attention kernel) registers itself the same way; Triton loads on first use.
from lightning_llmopt.models import attention_triton as _attention_triton  # noqa: F401
from lightning_llmopt.models.attention_registry import (
    AttentionFn,
    AttentionMask,
    doc_ids_from_cu_seqlens,
    get_backend,
    positions_from_doc_ids,
    register_backend,
    registered_backends,
)

__all__ = [
    "AttentionFn",
    "AttentionMask",
    "attention",
    "doc_ids_from_cu_seqlens",
    "get_backend",
    "positions_from_doc_ids",
    "register_backend",
    "registered_backends",
]


def attention(
    q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, backend: str = "sdpa", scale: float | None = None
) -> Tensor:
    """Run the named backend. Shapes: q ``(B, H, T, D)``, k/v ``(B, H_kv, S, D)``; returns ``(B, H, T, D)``."""
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    return get_backend(backend)(q, k, v, mask, scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
