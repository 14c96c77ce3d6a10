"""The key/value-cache interface the model's attention calls, and a contiguous reference cache.

The inference engine supplies its own (paged) implementation of :class:`KVCache`; the model only calls
:meth:`KVCache.update`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class KVCache(Protocol):
    """What a transformer block needs from a cache."""

    def update(self, layer_id: int, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Store new keys/values and return everything the layer may attend to.

        Arguments:
            layer_id: index of the block.
            k, v: ``(B, H_kv, T, D)`` keys (already rotated) and values of the new tokens.
            positions: ``(B, T)`` int64 positions of the new tokens.

        Returns:
            ``k_all``, ``v_all``: ``(B, H_kv, S, D)``; ``k_positions``: ``(B, S)`` int64, -1 for empty slots.
        """
        ...


class StaticKVCache:
    """A preallocated contiguous cache: slot ``p`` of row ``b`` holds the token at position ``p``.

    Arguments:
        n_layers, batch_size, max_seq_len, n_kv_heads, head_dim: sizes.
        dtype, device: of the stored tensors.
    """

    def __init__(self, n_layers: int, batch_size: int, max_seq_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.positions = [torch.full((batch_size, max_seq_len), -1, dtype=torch.long, device=device)
                          for _ in range(n_layers)]
        self.max_seq_len = max_seq_len

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch_size: int, max_seq_len: int | None = None) -> StaticKVCache:
        cfg: Any = model.config
        param = next(model.parameters())
        heads, width = (1, cfg.mla.latent_dim) if getattr(cfg, "mla", None) is not None else (cfg.n_kv_heads,
                                                                                              cfg.head_dim)
        return cls(cfg.n_layers, batch_size, max_seq_len or cfg.max_seq_len, heads, width, dtype=param.dtype,
                   device=param.device)

    def update(self, layer_id: int, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if int(positions.max()) >= self.max_seq_len or int(positions.min()) < 0:
            raise ValueError(f"positions must lie in [0, {self.max_seq_len}) for this cache")
        B, H, T, D = k.shape
        index = positions[:, None, :, None].expand(B, H, T, D)  # (B, H_kv, T, D)
        self.k[layer_id].scatter_(2, index, k.to(self.k[layer_id].dtype))
        self.v[layer_id].scatter_(2, index, v.to(self.v[layer_id].dtype))
        self.positions[layer_id].scatter_(1, positions, positions)
        return self.k[layer_id], self.v[layer_id], self.positions[layer_id]
