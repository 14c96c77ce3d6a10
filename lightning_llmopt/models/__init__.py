"""Reference decoder (Llama family), its configuration and presets, caches and Hugging Face interop."""

from lightning_llmopt.models.attention import (
    AttentionMask,
    attention,
    doc_ids_from_cu_seqlens,
    positions_from_doc_ids,
    register_backend,
    registered_backends,
)
from lightning_llmopt.models.config import PRESETS, LlamaConfig, RopeScaling
from lightning_llmopt.models.generate import greedy_generate
from lightning_llmopt.models.hf import config_from_hf, config_to_hf, from_hf, to_hf
from lightning_llmopt.models.kv_cache import KVCache, StaticKVCache
from lightning_llmopt.models.llama import Llama, RMSNorm, TransformerBlock
from lightning_llmopt.models.mla_config import MLAConfig
from lightning_llmopt.models.moe_config import MoEConfig

__all__ = [
    "PRESETS",
    "AttentionMask",
    "KVCache",
    "Llama",
    "LlamaConfig",
    "MLAConfig",
    "MoEConfig",
    "RMSNorm",
    "RopeScaling",
    "StaticKVCache",
    "TransformerBlock",
    "attention",
    "config_from_hf",
    "config_to_hf",
    "from_hf",
    "to_hf",
    "doc_ids_from_cu_seqlens",
    "greedy_generate",
    "positions_from_doc_ids",
    "register_backend",
    "registered_backends",
]
