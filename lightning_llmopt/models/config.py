"""Typed configuration of the reference decoder (Llama family) and its named presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from lightning_llmopt.models.mla_config import MLAConfig
from lightning_llmopt.models.moe_config import MoEConfig

ATTENTION_BACKENDS = ("sdpa", "eager")
ROPE_SCALING_TYPES = ("linear", "llama3")


@dataclass
class RopeScaling:
    """Rotary-embedding frequency scaling for context extension.

    Arguments:
        type: ``"linear"`` divides every frequency by ``factor`` (position interpolation); ``"llama3"`` leaves high
            frequencies alone, divides low frequencies by ``factor`` and blends in between (Llama 3.1).
        factor: the context-extension factor.
        low_freq_factor: ``llama3`` only: wavelengths above ``original_max_position_embeddings / low_freq_factor``
            are fully scaled.
        high_freq_factor: ``llama3`` only: wavelengths below ``original_max_position_embeddings / high_freq_factor``
            are not scaled.
        original_max_position_embeddings: ``llama3`` only: the context length the model was trained with.
    """

    type: str = "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.type not in ROPE_SCALING_TYPES:
            raise ValueError(f"rope_scaling.type ({self.type!r}) must be one of {ROPE_SCALING_TYPES}")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor ({self.factor}) must be > 0")
        if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(
                f"rope_scaling needs high_freq_factor ({self.high_freq_factor}) > low_freq_factor "
                f"({self.low_freq_factor}) > 0"
            )


@dataclass
class LlamaConfig:
    """Shape and options of a Llama-family decoder (Llama 2/3, Mistral, Qwen2).

    Arguments:
        vocab_size: number of token ids.
        dim: hidden size.
        n_layers: number of transformer blocks.
        n_heads: query heads.
        n_kv_heads: key/value heads; ``None`` means ``n_heads`` (MHA), 1 is MQA, anything between is GQA.
        head_dim: size of one head; ``None`` means ``dim // n_heads``.
        ffn_hidden_dim: SwiGLU inner size; ``None`` derives it as Llama does from ``dim``, ``ffn_dim_multiplier``
            and ``multiple_of``.
        multiple_of: rounding of the derived ``ffn_hidden_dim``.
        ffn_dim_multiplier: optional multiplier of the derived ``ffn_hidden_dim``.
        norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base.
        rope_scaling: optional :class:`RopeScaling`.
        max_seq_len: longest sequence the model serves (sizes the RoPE table).
        sliding_window: if set, a query attends to at most this many keys: itself and the ``sliding_window - 1``
            keys before it (Mistral's convention).
        qkv_bias: bias on the q/k/v projections (Qwen2).
        tie_embeddings: share the output head's weight with the token embedding.
        attn_backend: ``"sdpa"`` (``torch.nn.functional.scaled_dot_product_attention``) or ``"eager"`` (explicit
            softmax in fp32, the numerical reference); later kernels register more names.
        init_std: standard deviation of the normal initialisation of linear and embedding weights; output
            projections of each block are further scaled by ``1/sqrt(2 * n_layers)``.
        fused_kernels: fused Triton kernels swapped in at construction, a subset of :data:`FUSED_KERNELS`
            (``"rmsnorm"``, ``"rope"``, ``"swiglu"``, ``"fused_ce"``) or ``["all"]``; a comma-separated string is
            accepted. Parameters and the state dict are the same either way (see
            :func:`lightning_llmopt.optimize.optimize_model`).
        moe: Mixture-of-Experts feed-forward layers (:class:`~lightning_llmopt.models.moe_config.MoEConfig` or a
            dict of its fields); ``None`` keeps every block dense.
        mla: multi-head latent attention (:class:`~lightning_llmopt.models.mla_config.MLAConfig` or a dict of its
            fields) in every block instead of GQA; ``n_kv_heads`` and ``head_dim`` then play no part (see
            ``docs/mla.md``).
        layer_types: optional per-layer attention kinds, ``"global"``, ``"local"`` (window ``sliding_window``) or
            ``"local:<w>"``; ``None``: every layer uses ``sliding_window`` (see
            :mod:`~lightning_llmopt.models.layer_pattern`).
        kv_sources: optional per-layer index of the layer whose keys/values it attends over (cross-layer KV
            sharing); ``kv_sources[i] == i`` for layers that compute their own.
    """

    vocab_size: int = 32000
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    head_dim: int | None = None
    ffn_hidden_dim: int | None = None
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 4096
    sliding_window: int | None = None
    qkv_bias: bool = False
    tie_embeddings: bool = False
    attn_backend: str = "sdpa"
    init_std: float = 0.02
    fused_kernels: list[str] = field(default_factory=list)
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    layer_types: list[str] | None = None
    kv_sources: list[int] | None = None
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        if isinstance(self.moe, dict):
            self.moe = MoEConfig(**self.moe)
        if isinstance(self.mla, dict):
            self.mla = MLAConfig(**self.mla)
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len", "multiple_of"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} ({value!r}) must be a positive integer")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim is None:
            if self.dim % self.n_heads != 0:
                raise ValueError(
                    f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads}) unless head_dim is set"
                )
            self.head_dim = self.dim // self.n_heads
        if self.head_dim <= 0 or self.head_dim % 2 != 0:
            raise ValueError(f"head_dim ({self.head_dim}) must be a positive even number (RoPE rotates pairs)")
        if self.ffn_hidden_dim is None:
            self.ffn_hidden_dim = _llama_ffn_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)
        if self.ffn_hidden_dim <= 0:
            raise ValueError(f"ffn_hidden_dim ({self.ffn_hidden_dim}) must be positive")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window ({self.sliding_window}) must be positive or None")
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps ({self.norm_eps}) must be positive")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta ({self.rope_theta}) must be positive")
        if self.init_std <= 0:
            raise ValueError(f"init_std ({self.init_std}) must be positive")
        _check_attn_backend(self.attn_backend)
        if self.mla is not None and (self.sliding_window is not None or self.qkv_bias):
            raise ValueError(
                f"mla does not support sliding_window ({self.sliding_window}) or qkv_bias ({self.qkv_bias})"
            )
        if self.mla is not None and (self.layer_types is not None or self.kv_sources is not None):
            raise ValueError(
                f"mla does not support layer_types ({self.layer_types}) or kv_sources ({self.kv_sources})"
            )
        from lightning_llmopt.models.layer_pattern import normalize_layer_pattern

        normalize_layer_pattern(self)
        self.fused_kernels = _check_fused_kernels(self.fused_kernels)

    @property
    def n_rep(self) -> int:
        """Query heads per key/value head (the GQA group size)."""
        assert self.n_kv_heads is not None
        return self.n_heads // self.n_kv_heads

    @property
    def rope_dim(self) -> int:
        """Channels RoPE rotates per head: ``head_dim``, or ``mla.qk_rope_head_dim`` under MLA."""
        assert self.head_dim is not None
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    def layer_window(self, layer_id: int) -> int | None:
        """Sliding window of layer ``layer_id`` (``None``: global attention)."""
        from lightning_llmopt.models.layer_pattern import layer_windows

        return layer_windows(self)[layer_id]

    def kv_source(self, layer_id: int) -> int:
        """The layer whose keys/values layer ``layer_id`` attends over (itself unless K/V are shared)."""
        return layer_id if self.kv_sources is None else self.kv_sources[layer_id]

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        """Build a preset by name (see :data:`PRESETS`), optionally overriding fields."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        values = dict(PRESETS[name])
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown LlamaConfig field(s) {sorted(unknown)} in overrides for preset {name!r}")
        values.update(overrides)
        values.setdefault("name", name)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> LlamaConfig:
        return cls(**values)


def _check_attn_backend(name: str) -> None:
    from lightning_llmopt.models.attention import registered_backends

    if name not in registered_backends():
        raise ValueError(f"attn_backend ({name!r}) must be one of {sorted(registered_backends())}")


FUSED_KERNELS = ("rmsnorm", "rope", "swiglu", "fused_ce")


def _check_fused_kernels(value: Any) -> list[str]:
    names = [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value or [])
    names = [n for n in names if n]
    if "all" in names:
        names = [n for n in names if n != "all"] + list(FUSED_KERNELS)
    unknown = sorted(set(names) - set(FUSED_KERNELS))
    if unknown:
        raise ValueError(f"fused_kernels ({unknown}) must name kernels of {FUSED_KERNELS} or 'all'")
    return [n for n in FUSED_KERNELS if n in names]


def _llama_ffn_dim(dim: int, multiple_of: int, multiplier: float | None) -> int:
    """Llama's SwiGLU width: 2/3 of 4*dim, scaled, rounded up to ``multiple_of``."""
    hidden = int(2 * (4 * dim) / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


PRESETS: dict[str, dict[str, Any]] = {
    # A few thousand parameters: unit tests.
    "tiny": dict(vocab_size=320, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=256),
    # About one million parameters (byte-level vocabulary): the CPU training job.
    "debug-1m": dict(
        vocab_size=320, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden_dim=384, max_seq_len=1024,
        tie_embeddings=True,
    ),
    # GPT-2-small sized Llama with a 32k vocabulary: ~124M parameters (tied embeddings).
    "125m": dict(
        vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_hidden_dim=2560, max_seq_len=4096,
        tie_embeddings=True,
    ),
    # ~1.1B parameters (TinyLlama-like shape).
    "1b": dict(
        vocab_size=32000, dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_hidden_dim=5632, max_seq_len=4096,
        rope_theta=10000.0,
    ),
    "llama2-7b": dict(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_hidden_dim=11008, max_seq_len=4096,
        norm_eps=1e-5, rope_theta=10000.0,
    ),
    "llama3-8b": dict(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden_dim=14336, max_seq_len=8192,
        norm_eps=1e-5, rope_theta=500000.0,
    ),
}
