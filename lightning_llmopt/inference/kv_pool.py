"""The preallocated KV pool: one tensor for every layer's keys and values, and the int8 variant's scales.

Layout: ``data[layer, 0 | 1, block, kv_head, slot, dim]`` (keys, values): a block of one head is a contiguous
``[block_size, head_dim]`` tile, which is what the decode kernel reads. Token ``t`` of a sequence lives at
``(table[t // block_size], slot t % block_size)``.

Sizing: ``num_blocks`` explicitly, or on CUDA from free memory: ``fraction`` of the memory free after the model is
loaded, minus a reserve for activations and CUDA graphs, divided by the bytes of one block over all layers.

int8 (``dtype=torch.int8``): each layer's keys and values are stored as ``round(x / scale)`` clamped to
[-127, 127], with one fp32 scale per (layer, key/value head) from :func:`~lightning_llmopt.inference.quant
.calibrate_kv_scales`. There is no default: a pool without calibrated scales refuses to be written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["KVPool", "KVScales", "block_bytes", "blocks_from_free_memory", "kv_budget_bytes", "pool_blocks"]


@dataclass
class KVScales:
    """Per-(layer, key/value head) fp32 scales of an int8 KV cache: ``k``, ``v`` ``(n_layers, n_kv_heads)``."""

    k: Tensor
    v: Tensor

    def __post_init__(self) -> None:
        if self.k.shape != self.v.shape or self.k.ndim != 2:
            raise ValueError(
                f"k and v scales must both be (n_layers, n_kv_heads), got {tuple(self.k.shape)} and "
                f"{tuple(self.v.shape)}"
            )
        for name, t in (("k", self.k), ("v", self.v)):
            bad = ~torch.isfinite(t) | (t <= 0)
            if bool(bad.any()):
                layer, head = (int(i) for i in bad.nonzero()[0])
                raise ValueError(
                    f"{name} scale of layer {layer}, head {head} is {float(t[layer, head])}: scales must "
                    "be finite and > 0 (calibrate on prompts that exercise every head)"
                )
        self.k = self.k.float()
        self.v = self.v.float()

    def to(self, device: torch.device | str) -> KVScales:
        return KVScales(self.k.to(device), self.v.to(device))


def block_bytes(n_layers: int, n_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers (keys and values)."""
    return 2 * n_layers * n_kv_heads * block_size * head_dim * torch.empty((), dtype=dtype).element_size()


def kv_budget_bytes(device: torch.device, fraction: float, reserve_bytes: int) -> int:
    """Bytes the KV cache may take: ``fraction`` of the free memory of ``device`` minus ``reserve_bytes``."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * fraction) - reserve_bytes


def blocks_from_free_memory(device: torch.device, per_block: int, fraction: float, reserve_bytes: int) -> int:
    """How many blocks fit in ``fraction`` of the free memory of ``device`` minus ``reserve_bytes``."""
    free, _ = torch.cuda.mem_get_info(device)
    usable = kv_budget_bytes(device, fraction, reserve_bytes)
    if usable < 2 * per_block:
        raise RuntimeError(
            f"only {free / 2**30:.2f} GiB free on {device}: not enough for a KV cache of blocks of "
            f"{per_block / 2**20:.1f} MiB (lower the reserve or free memory)"
        )
    return usable // per_block


def useful_blocks(config: Any, max_model_len: int) -> int:
    """The most blocks worth having: four full-length contexts per sequence slot, and the null block."""
    return 4 * config.max_num_seqs * math.ceil(max_model_len / config.block_size) + 1


def pool_blocks(model_cfg: Any, config: Any, max_model_len: int, device: torch.device, kv_dtype: torch.dtype) -> int:
    """The engine's pool size: ``config.num_blocks`` when set; else what fits in free GPU memory
    (``gpu_memory_fraction`` of it, minus ``reserve_gib``), at most four full-length contexts per sequence slot (and
    at most 4,096 blocks off the GPU)."""
    useful = useful_blocks(config, max_model_len)
    if config.num_blocks is not None:
        return config.num_blocks
    if device.type != "cuda":
        return min(useful, 4096)
    from lightning_llmopt.models.layer_pattern import kv_producers

    n_cached = len(kv_producers(model_cfg))  # cross-layer KV sharing: producers only
    per = block_bytes(n_cached, model_cfg.n_kv_heads, model_cfg.head_dim, config.block_size, kv_dtype)
    fitting = blocks_from_free_memory(device, per, config.gpu_memory_fraction, int(config.reserve_gib * 2**30))
    return min(fitting, useful)


class KVPool:
    """Storage of the paged KV cache for every layer.

    Arguments:
        n_layers, n_kv_heads, head_dim: model sizes.
        num_blocks: physical blocks (block 0 is the null block, see the block manager).
        block_size: token slots per block.
        dtype: storage dtype: the model's float dtype, or ``torch.int8`` (then ``scales`` is required before use).
        device: where the pool lives.
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.device = torch.device(device)
        self.data = torch.zeros(n_layers, 2, num_blocks, n_kv_heads, block_size, head_dim, dtype=dtype, device=device)
        self.scales: KVScales | None = None

    @property
    def quantized(self) -> bool:
        return self.dtype == torch.int8

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def set_scales(self, scales: KVScales) -> None:
        if tuple(scales.k.shape) != (self.n_layers, self.n_kv_heads):
            raise ValueError(f"scales are {tuple(scales.k.shape)}, the pool needs ({self.n_layers}, {self.n_kv_heads})")
        if self.scales is not None:  # in place: captured CUDA graphs read these tensors
            self.scales.k.copy_(scales.k)
            self.scales.v.copy_(scales.v)
            return
        self.scales = KVScales(scales.k.to(self.device, copy=True), scales.v.to(self.device, copy=True))

    def check_ready(self) -> None:
        if self.quantized and self.scales is None:
            raise RuntimeError(
                "the int8 KV cache has no calibrated scales: call engine.calibrate_kv(prompts) or pass "
                "kv_scales= (unit scales would silently destroy accuracy)"
            )

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        """Key and value caches of layer ``i``: ``(num_blocks, H_kv, block_size, D)`` views."""
        return self.data[i, 0], self.data[i, 1]

    def layer_scales(self, i: int) -> tuple[Tensor | None, Tensor | None]:
        if not self.quantized:
            return None, None
        assert self.scales is not None
        return self.scales.k[i], self.scales.v[i]

    def quantize(self, x: Tensor, scale: Tensor | None) -> Tensor:
        """``x`` ``(N, H_kv, D)`` in the storage dtype (int8: ``round(x / scale)`` clamped to +-127)."""
        if scale is None:
            return x.to(self.dtype)
        return torch.round(x.float() / scale.view(1, -1, 1)).clamp_(-127, 127).to(torch.int8)

    def write(self, layer: int, k: Tensor, v: Tensor, blocks: Tensor, slots: Tensor) -> None:
        """Store ``k``, ``v`` ``(N, H_kv, D)`` of ``N`` tokens at ``(blocks[i], slots[i])``."""
        kc, vc = self.layer(layer)
        ks, vs = self.layer_scales(layer)
        kc[blocks, :, slots] = self.quantize(k, ks)
        vc[blocks, :, slots] = self.quantize(v, vs)

    def read(self, layer: int, blocks: Tensor, slots: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Keys and values ``(N, H_kv, D)`` at ``(blocks[i], slots[i])``, dequantized to ``dtype``."""
        kc, vc = self.layer(layer)
        k, v = kc[blocks, :, slots], vc[blocks, :, slots]
        ks, vs = self.layer_scales(layer)
        if ks is not None and vs is not None:
            return (k.float() * ks.view(1, -1, 1)).to(dtype), (v.float() * vs.view(1, -1, 1)).to(dtype)
        return k.to(dtype), v.to(dtype)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block ``dst`` becomes a copy of block ``src`` in every layer."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        self.data[:, :, dst] = self.data[:, :, src]
