"""The engine's paged cache for multi-head latent attention (MLA): a latent pool and the absorbed-form runner.

Under MLA (:mod:`lightning_llmopt.models.mla`) a token's cache entry is one vector ``[c, k_rope]`` of
``kv_lora_rank + qk_rope_head_dim`` numbers per layer, shared by every head. :class:`LatentKVPool` stores exactly
that: ``data[layer, 0, block, 0, slot, :]``, one tensor where a GQA pool has keys and values, so a token costs

    n_layers * (kv_lora_rank + qk_rope_head_dim) * dtype bytes

and the same block manager, prefix cache and copy-on-write work unchanged on it.

:class:`MLARunner` writes each new token's latent to the pool, then

- decode rows (memory-bound) run in the absorbed form: each head's query becomes ``[W_UK_h^T q_nope_h, q_rope_h]``
  and attends, as multi-query attention with one key/value head, to the latent pages serving as both keys and
  values, through the unchanged paged kernel (:func:`~lightning_llmopt.kernels.paged_attention`); the output's last
  ``qk_rope_head_dim`` channels are dropped, then ``W_UV`` and ``wo`` apply;
- prefill chunks (compute-bound) run in the naive form: per-head keys and values expanded from the new tokens'
  latents and, for chunks with cached context, from the context's latents read back from the pool, through the
  varlen flash kernel with ``v`` zero-padded to the key width (head dims of 192 for DeepSeek's shapes, where the
  absorbed form's 576-wide heads would be far outside the flash kernel's tuned range).

Both use the model's softmax scale ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lightning_llmopt.inference.kv_pool import KVPool, blocks_from_free_memory
from lightning_llmopt.inference.runner import ModelRunner
from lightning_llmopt.inference.step_inputs import StepInputs
from lightning_llmopt.kernels.flash_attention import flash_attention
from lightning_llmopt.kernels.paged_attention import paged_attention
from lightning_llmopt.models.llama import Llama

__all__ = ["LatentKVPool", "MLARunner", "check_mla_engine", "kv_bytes_per_token", "latent_block_bytes", "latent_pool"]


def kv_bytes_per_token(model_cfg: Any, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes the engine's paged cache holds per token of context, from the config alone: MLA
    ``n_layers * (kv_lora_rank + qk_rope_head_dim) * b``; GQA/MHA ``2 * n_layers * n_kv_heads * head_dim * b``
    (``b`` the bytes of ``dtype``)."""
    b = torch.empty((), dtype=dtype).element_size()
    if model_cfg.mla is not None:
        return int(model_cfg.n_layers * model_cfg.mla.latent_dim * b)
    return int(2 * model_cfg.n_layers * model_cfg.n_kv_heads * model_cfg.head_dim * b)


def latent_block_bytes(n_layers: int, latent_dim: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block of the latent pool across all layers."""
    return n_layers * block_size * latent_dim * torch.empty((), dtype=dtype).element_size()


class LatentKVPool(KVPool):
    """A :class:`KVPool` holding one latent vector per token and layer instead of keys and values.

    Arguments:
        n_layers: model layers.
        latent_dim: ``kv_lora_rank + qk_rope_head_dim``.
        num_blocks, block_size, dtype, device: as :class:`KVPool` (float dtypes only).

    :meth:`layer` returns the same ``(num_blocks, 1, block_size, latent_dim)`` tensor as keys and values;
    :meth:`write` stores ``k`` (the latent) and ignores ``v``.
    """

    def __init__(
        self,
        n_layers: int,
        latent_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if not dtype.is_floating_point:
            raise ValueError(f"the MLA latent cache stores floats, got kv dtype {dtype} (int8 KV is GQA-only)")
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, 1, latent_dim
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.device = torch.device(device)
        self.data = torch.zeros(n_layers, 1, num_blocks, 1, block_size, latent_dim, dtype=dtype, device=device)
        self.scales = None

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        return self.data[i, 0], self.data[i, 0]

    def write(self, layer: int, k: Tensor, v: Tensor, blocks: Tensor, slots: Tensor) -> None:
        """Store the latent ``k`` ``(N, 1, latent_dim)`` at ``(blocks[i], slots[i])`` (``v`` is the same)."""
        self.data[layer, 0][blocks, :, slots] = k.to(self.dtype)

    def read(self, layer: int, blocks: Tensor, slots: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        lat = self.data[layer, 0][blocks, :, slots].to(dtype)
        return lat, lat


def latent_pool(
    model_cfg: Any, config: Any, max_model_len: int, device: torch.device, dtype: torch.dtype
) -> LatentKVPool:
    """The engine's latent pool: ``config.num_blocks`` blocks, else what fits in free GPU memory (the rule of
    :func:`~lightning_llmopt.inference.kv_pool.pool_blocks`, with the latent's block bytes)."""
    mla = model_cfg.mla
    useful = 4 * config.max_num_seqs * math.ceil(max_model_len / config.block_size) + 1
    if config.num_blocks is not None:
        n = config.num_blocks
    elif device.type != "cuda":
        n = min(useful, 4096)
    else:
        per = latent_block_bytes(model_cfg.n_layers, mla.latent_dim, config.block_size, dtype)
        reserve = int(config.reserve_gib * 2**30)
        n = min(useful, blocks_from_free_memory(device, per, config.gpu_memory_fraction, reserve))
    return LatentKVPool(model_cfg.n_layers, mla.latent_dim, n, config.block_size, dtype, device)


def check_mla_engine(config: Any) -> None:
    """Refuse engine options the latent cache does not support, naming them."""
    if config.kv_dtype == "int8":
        raise ValueError("kv_dtype ('int8') is not supported with MLA: the latent cache stores the model's dtype")
    if config.speculative is not None:
        raise ValueError("speculative decoding is not supported with MLA models (speculative must be None)")


class MLARunner(ModelRunner):
    """:class:`ModelRunner` for MLA models over a :class:`LatentKVPool` (module docstring): decode rows in the absorbed
    form through the paged kernel, prefill chunks in the naive form through the varlen flash kernel. The elementwise
    fused path is off (it knows GQA blocks only)."""

    def __init__(self, model: Llama, pool: KVPool, backend: str = "auto", fused: bool | None = None) -> None:
        if model.config.mla is None:
            raise ValueError("MLARunner needs a model with config.mla set")
        if not isinstance(pool, LatentKVPool):
            raise TypeError(f"MLARunner needs a LatentKVPool, got {type(pool).__name__}")
        if fused:
            raise ValueError("fused_kernels=True is not supported with MLA models (the fused decode is GQA-only)")
        super().__init__(model, pool, backend, fused=False)

    def _block(
        self,
        i: int,
        block: Any,
        h: Tensor,
        inp: StepInputs,
        max_context: int | None,
        step_kv: dict[int, tuple[Tensor, Tensor]] | None = None,
    ) -> Tensor:
        """One block on the packed step; ``step_kv`` (cross-layer KV sharing) is unused: MLA refuses ``kv_sources``."""
        attn = block.attention
        x = block.attention_norm(h)[None]  # (1, N, dim): the packed step as one row
        pos = inp.positions[None]
        q_nope, q_rope = attn.queries(x, self.model.rope, pos)  # (1, H, N, d_n), (1, H, N, d_r)
        lat = attn.latent(x, self.model.rope, pos)[0].transpose(0, 1)  # (N, 1, r + d_r)
        self.pool.write(i, lat, lat, inp.blocks, inp.slots)
        nd = inp.num_decode
        outs = []
        if nd:
            outs.append(self._decode(i, attn, q_nope[:, :, :nd], q_rope[:, :, :nd], inp, max_context))
        if inp.seg_cu is not None:
            outs.append(self._prefill(i, attn, q_nope[0, :, nd:], q_rope[0, :, nd:], lat[nd:], inp))
        h = h + (outs[0] if len(outs) == 1 else torch.cat(outs))
        return h + block.feed_forward(block.ffn_norm(h))

    def _decode(
        self, i: int, attn: Any, q_nope: Tensor, q_rope: Tensor, inp: StepInputs, max_context: int | None
    ) -> Tensor:
        """Absorbed form of the ``nd`` decode rows: ``(nd, dim)``."""
        q = attn.absorbed_query(q_nope, q_rope)[0].transpose(0, 1).contiguous()  # (nd, H, r + d_r)
        kc, vc = self.pool.layer(i)  # the same latent pages: keys, and values whose last d_r channels are dropped
        o = paged_attention(
            q,
            kc,
            vc,
            inp.dec_tables,
            inp.dec_ctx,
            softmax_scale=attn.scale,
            max_context=max_context or inp.dec_max_ctx,
            backend=self.backend,
        )
        return attn.absorbed_output(o[..., : attn.r])

    def _prefill(self, i: int, attn: Any, q_nope: Tensor, q_rope: Tensor, lat: Tensor, inp: StepInputs) -> Tensor:
        """Naive form of the prefill chunks (``q_*`` ``(H, P, .)``, their latents ``(P, 1, r + d_r)``): ``(P, dim)``.

        Segments with cached context get the context's latents read back from the pool and expanded like the new
        tokens'; ``v`` is zero-padded to the key width for the flash kernel and the output sliced back."""
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)  # (P, H, d_n + d_r)
        if inp.seg_new is not None:
            assert inp.seg_ctx is not None and inp.ctx_blocks is not None and inp.ctx_slots is not None
            rows = inp.seg_total
            q_all = q.new_zeros(rows, *q.shape[1:])
            q_all[inp.seg_new] = q
            lat_all = lat.new_empty(rows, *lat.shape[1:])
            lat_all[inp.seg_new] = lat
            lat_all[inp.seg_ctx] = self.pool.read(i, inp.ctx_blocks, inp.ctx_slots, lat.dtype)[0]
            q, lat = q_all, lat_all
        k, v = attn.expand_kv(lat.transpose(0, 1)[None])  # (1, H, T, d_n + d_r), (1, H, T, d_v)
        k, v = k[0].transpose(0, 1), v[0].transpose(0, 1)  # (T, H, d_n + d_r), (T, H, d_v)
        width = max(k.shape[-1], v.shape[-1])
        pad = torch.nn.functional.pad
        out = flash_attention(
            pad(q, (0, width - q.shape[-1])),
            pad(k, (0, width - k.shape[-1])),
            pad(v, (0, width - v.shape[-1])),
            causal=True,
            softmax_scale=attn.scale,
            cu_seqlens=inp.seg_cu,
            max_seqlen=inp.seg_max,
            backend=None if self.backend == "auto" else self.backend,
        )
        assert isinstance(out, Tensor)
        out = out[..., : attn.d_v]
        if inp.seg_new is not None:
            out = out[inp.seg_new]
        return attn.wo(out.reshape(out.shape[0], -1))
