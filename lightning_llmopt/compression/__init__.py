"""Model compression: knowledge distillation and pruning (magnitude, structured, 2:4, SparseGPT).

See docs/compression.md. The Lightning adapters are :class:`lightning_llmopt.callbacks.distillation.Distillation`
and :class:`lightning_llmopt.callbacks.pruning.Pruning`. SparseGPT reuses GPTQ's calibration and Cholesky code
from :mod:`lightning_llmopt.quantization`; this package is separate because pruning and distillation change which
weights exist or how a model is trained, not how weights are stored.

- distillation losses: :func:`kl_distillation_loss`, :func:`distillation_loss`, :func:`feature_loss` with
  :class:`FeatureProjector`, :func:`attention_map_loss` with maps from :class:`LayerCapture`;
- masks: :func:`magnitude_masks` (per layer / global), :func:`nm_mask` (2:4), :func:`apply_masks`,
  :func:`cubic_sparsity`;
- one-shot: :func:`sparsegpt_prune` (one layer), :func:`prune_model` (magnitude or SparseGPT, whole model);
- structured: :func:`plan_structured`, :func:`mask_structured`, :func:`prune_structured`;
- 2:4 on GPU: :func:`semi_structured_available`, :func:`to_semi_structured`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_llmopt._lazy import lazy_exports

if TYPE_CHECKING:
    from lightning_llmopt.compression.attention_maps import LayerCapture, eager_attention_probs
    from lightning_llmopt.compression.distill import (
        FeatureProjector,
        attention_map_loss,
        default_layer_map,
        distillation_loss,
        feature_loss,
        kl_distillation_loss,
    )
    from lightning_llmopt.compression.masks import (
        apply_masks,
        cubic_sparsity,
        global_magnitude_masks,
        is_nm_sparse,
        magnitude_mask,
        magnitude_masks,
        nm_mask,
        prunable_linears,
        sparsity_of,
    )
    from lightning_llmopt.compression.prune import PruneReport, prune_model
    from lightning_llmopt.compression.semi_structured import semi_structured_available, to_semi_structured
    from lightning_llmopt.compression.sparsegpt import SparseGPTResult, sparsegpt_prune
    from lightning_llmopt.compression.structured import (
        StructuredPlan,
        mask_structured,
        plan_structured,
        prune_structured,
    )

# Lazy (PEP 562), as lightning_llmopt.quantization: keeps the import cheap and free of cycles.
_EXPORTS: dict[str, str] = {
    "LayerCapture": "attention_maps",
    "eager_attention_probs": "attention_maps",
    "FeatureProjector": "distill",
    "attention_map_loss": "distill",
    "default_layer_map": "distill",
    "distillation_loss": "distill",
    "feature_loss": "distill",
    "kl_distillation_loss": "distill",
    "apply_masks": "masks",
    "cubic_sparsity": "masks",
    "global_magnitude_masks": "masks",
    "is_nm_sparse": "masks",
    "magnitude_mask": "masks",
    "magnitude_masks": "masks",
    "nm_mask": "masks",
    "prunable_linears": "masks",
    "sparsity_of": "masks",
    "PruneReport": "prune",
    "prune_model": "prune",
    "semi_structured_available": "semi_structured",
    "to_semi_structured": "semi_structured",
    "SparseGPTResult": "sparsegpt",
    "sparsegpt_prune": "sparsegpt",
    "StructuredPlan": "structured",
    "mask_structured": "structured",
    "plan_structured": "structured",
    "prune_structured": "structured",
}

__all__ = [
    "FeatureProjector",
    "LayerCapture",
    "PruneReport",
    "SparseGPTResult",
    "StructuredPlan",
    "apply_masks",
    "attention_map_loss",
    "cubic_sparsity",
    "default_layer_map",
    "distillation_loss",
    "eager_attention_probs",
    "feature_loss",
    "global_magnitude_masks",
    "is_nm_sparse",
    "kl_distillation_loss",
    "magnitude_mask",
    "magnitude_masks",
    "mask_structured",
    "nm_mask",
    "plan_structured",
    "prunable_linears",
    "prune_model",
    "prune_structured",
    "semi_structured_available",
    "sparsegpt_prune",
    "sparsity_of",
    "to_semi_structured",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
