"""Options of multi-head latent attention (MLA, DeepSeek-V2 arXiv 2405.04434, DeepSeek-V3 arXiv 2412.19437)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MLAConfig"]


@dataclass
class MLAConfig:
    """Multi-head latent attention of :class:`~lightning_llmopt.models.LlamaConfig` (field ``mla``).

    Keys and values of every head are up-projected from one shared latent ``c_kv`` (``kv_lora_rank`` channels,
    RMS-normed); each head's key is ``[k_nope_h, k_rope]`` where ``k_rope`` (``qk_rope_head_dim`` channels, rotated)
    is shared by all heads (the decoupled RoPE key). Only ``[c_kv, k_rope]`` is cached: ``kv_lora_rank +
    qk_rope_head_dim`` numbers per token and layer, whatever the number of heads.

    Arguments:
        kv_lora_rank: width of the compressed key/value latent.
        qk_nope_head_dim: per-head query/key channels without position encoding.
        qk_rope_head_dim: per-head query channels and shared key channels that carry RoPE (even).
        v_head_dim: per-head value width.
        q_lora_rank: if set, queries go through a low-rank latent of this width (``wq_a``, RMSNorm, ``wq_b``) as in
            DeepSeek-V2/V3; ``None`` projects queries directly (``wq``), as DeepSeek-V2-Lite.
    """

    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    q_lora_rank: int | None = None

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"mla.{name} ({value!r}) must be a positive integer")
        if self.qk_rope_head_dim % 2 != 0:
            raise ValueError(f"mla.qk_rope_head_dim ({self.qk_rope_head_dim}) must be even (RoPE rotates pairs)")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            raise ValueError(f"mla.q_lora_rank ({self.q_lora_rank!r}) must be a positive integer or None")

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Numbers cached per token and layer: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim
