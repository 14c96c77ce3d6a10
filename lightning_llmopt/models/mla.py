"""Multi-head latent attention (MLA): DeepSeek-V2 (arXiv 2405.04434, section 2.1) and DeepSeek-V3 (arXiv 2412.19437).

For a token ``x`` (``dim``) and ``H`` heads, with ``r = kv_lora_rank``, ``d_n = qk_nope_head_dim``,
``d_r = qk_rope_head_dim``, ``d_v = v_head_dim``:

1. queries: ``q = wq x`` (or ``wq_b rmsnorm(wq_a x)`` with ``q_lora_rank``), split per head into ``q_nope``
   (``d_n``) and ``q_rope`` (``d_r``, rotated);
2. the latent: ``[c, k_rope] = wkv_a x`` with ``c = rmsnorm(c)`` (``r``) and ``k_rope`` (``d_r``, rotated, one for
   all heads): this pair is all that is cached;
3. naive form (training, prefill): ``[k_nope_h, v_h] = W_UK_h c, W_UV_h c`` from ``wkv_b``; head ``h`` attends
   with key ``[k_nope_h, k_rope]``, value ``v_h``, scale ``1 / sqrt(d_n + d_r)``; ``wo`` joins the heads;
4. absorbed form (decode): ``q_nope_h . k_nope_h = (W_UK_h^T q_nope_h) . c``, so each head's query becomes
   ``[W_UK_h^T q_nope_h, q_rope]`` (``r + d_r``) against the single shared key ``[c, k_rope]`` (MQA with one
   key/value head); the output is ``W_UV_h`` applied to the head's attention-weighted latent ``sum_j p_j c_j``
   (the value is ``[c, k_rope]`` too, its last ``d_r`` channels dropped). No per-head key or value ever exists.

Parameter names (DeepSeek's): ``wq`` or ``wq_a``/``q_norm``/``wq_b``, ``wkv_a``, ``kv_norm``, ``wkv_b``, ``wo``.
``wkv_b.weight`` is ``(H * (d_n + d_v), r)``: per head ``d_n`` key rows, then ``d_v`` value rows.

Backends whose kernels need equal key and value widths (our flash kernel, ``attn_backend="triton"``) get ``v``
zero-padded to ``d_n + d_r`` and the output sliced back (the padded channels compute zeros); SDPA and eager take
the two widths as they are.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_llmopt.models.attention import AttentionMask, attention
from lightning_llmopt.models.blocks import RMSNorm
from lightning_llmopt.models.config import LlamaConfig
from lightning_llmopt.models.kv_cache import KVCache
from lightning_llmopt.models.rope import apply_rope

__all__ = ["MLAttention"]

# Backends that take a value width different from the key width; others get v padded.
_UNEQUAL_V_BACKENDS = ("sdpa", "eager")


class MLAttention(nn.Module):
    """Multi-head latent attention block (module docstring for the math).

    Arguments:
        config: a :class:`LlamaConfig` with ``mla`` set.
        layer_id: index of the block (the cache key).

    Attributes:
        absorb: with a KV cache, attend in the absorbed form (the cache then holds ``[c, k_rope]`` only); False
            expands per-head keys and values from the cached latent (the naive form, the reference).
    """

    def __init__(self, config: LlamaConfig, layer_id: int) -> None:
        super().__init__()
        mla = config.mla
        assert mla is not None
        self.layer_id = layer_id
        self.n_heads = config.n_heads
        self.r, self.d_n = mla.kv_lora_rank, mla.qk_nope_head_dim
        self.d_r, self.d_v = mla.qk_rope_head_dim, mla.v_head_dim
        self.backend = config.attn_backend
        self.scale = 1.0 / math.sqrt(mla.qk_head_dim)
        self.absorb = True
        qk = self.n_heads * mla.qk_head_dim
        self.wq: nn.Linear | None = None
        self.wq_a: nn.Linear | None = None
        self.q_norm: nn.Module | None = None
        self.wq_b: nn.Linear | None = None
        if mla.q_lora_rank is None:
            self.wq = nn.Linear(config.dim, qk, bias=False)
        else:
            self.wq_a = nn.Linear(config.dim, mla.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(mla.q_lora_rank, config.norm_eps)
            self.wq_b = nn.Linear(mla.q_lora_rank, qk, bias=False)
        self.wkv_a = nn.Linear(config.dim, self.r + self.d_r, bias=False)
        self.kv_norm = RMSNorm(self.r, config.norm_eps)
        self.wkv_b = nn.Linear(self.r, self.n_heads * (self.d_n + self.d_v), bias=False)
        self.wo = nn.Linear(self.n_heads * self.d_v, config.dim, bias=False)
        # Hooks set by ``optimize_model``: a fused rotation (``rotary.rotate(x, table, positions)``; None:
        # ``apply_rope``) and one GEMM for both projections of ``x`` (``wq`` or ``wq_a``, and ``wkv_a``).
        self.rotary: nn.Module | None = None
        self.pack_qkv = False

    # ------------------------------------------------------------------ pieces
    def queries(self, x: Tensor, rope: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``q_nope`` ``(B, H, T, d_n)`` and rotated ``q_rope`` ``(B, H, T, d_r)`` of ``x`` ``(B, T, dim)``."""
        return self._queries(self.wq(x) if self.wq is not None else self._q_a(x), rope, positions)

    def latent(self, x: Tensor, rope: Tensor, positions: Tensor) -> Tensor:
        """The cached pair ``[rmsnorm(c), rope(k_rope)]`` ``(B, 1, T, r + d_r)`` of ``x`` ``(B, T, dim)``."""
        return self._latent(self.wkv_a(x), rope, positions)

    def _q_a(self, x: Tensor) -> Tensor:
        assert self.wq_a is not None
        return self.wq_a(x)

    def _queries(self, q: Tensor, rope: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """From ``wq x`` ``(B, T, H * (d_n + d_r))``, or ``wq_a x`` ``(B, T, q_lora_rank)`` with ``q_lora_rank``."""
        if self.wq is None:
            assert self.q_norm is not None and self.wq_b is not None
            q = self.wq_b(self.q_norm(q))
        B, T, _ = q.shape
        q = q.view(B, T, -1, self.d_n + self.d_r).transpose(1, 2)  # (B, H, T, d_n + d_r)
        q_nope, q_rope = q.split([self.d_n, self.d_r], dim=-1)
        return q_nope, self._rope(q_rope, rope, positions)

    def _latent(self, kv: Tensor, rope: Tensor, positions: Tensor) -> Tensor:
        """From ``wkv_a x`` ``(B, T, r + d_r)``."""
        c, k_rope = kv.split([self.r, self.d_r], dim=-1)  # (B, T, r), (B, T, d_r)
        k_rope = self._rope(k_rope[:, None], rope, positions)  # (B, 1, T, d_r)
        return torch.cat([self.kv_norm(c)[:, None], k_rope], dim=-1)

    def _rope(self, x: Tensor, rope: Tensor, positions: Tensor) -> Tensor:
        rotate = getattr(self.rotary, "rotate", None)  # the fused rotation, if set
        return rotate(x, rope, positions) if rotate is not None else apply_rope(x, rope, positions)

    def _packable(self) -> bool:
        """Whether both projections of ``x`` can be one GEMM: plain hook-free ``nn.Linear`` without bias, plain
        tensor weights of one dtype (not a sharded, LoRA or quantized module)."""
        lins = (self.wq if self.wq is not None else self.wq_a, self.wkv_a)
        if not all(type(m) is nn.Linear and not m._forward_hooks and not m._forward_pre_hooks for m in lins):
            return False
        weights = [m.weight for m in lins if m is not None]
        if any(type(w) not in (nn.Parameter, Tensor) for w in weights) or len({w.dtype for w in weights}) > 1:
            return False
        return all(m.bias is None for m in lins if m is not None)

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(wq x or wq_a x, wkv_a x)``; packed: one GEMM over the concatenated weights, split into views."""
        first = self.wq if self.wq is not None else self.wq_a
        assert first is not None
        if not (self.pack_qkv and self._packable()):
            return first(x), self.wkv_a(x)
        out = F.linear(x, torch.cat([first.weight, self.wkv_a.weight]))
        q, kv = out.split([first.weight.shape[0], self.wkv_a.weight.shape[0]], dim=-1)
        return q, kv

    def _up(self) -> tuple[Tensor, Tensor]:
        """``W_UK`` ``(H, d_n, r)`` and ``W_UV`` ``(H, d_v, r)``: views of ``wkv_b.weight``."""
        w = self.wkv_b.weight.view(-1, self.d_n + self.d_v, self.r)
        return w[:, : self.d_n], w[:, self.d_n :]

    def absorbed_query(self, q_nope: Tensor, q_rope: Tensor) -> Tensor:
        """``[W_UK_h^T q_nope_h, q_rope_h]`` ``(..., H, T, r + d_r)`` of ``(..., H, T, d_n)``, ``(..., H, T, d_r)``."""
        w_uk, _ = self._up()
        return torch.cat([torch.einsum("...htn,hnr->...htr", q_nope, w_uk), q_rope], dim=-1)

    def absorbed_output(self, o_latent: Tensor) -> Tensor:
        """``wo`` of the heads' ``W_UV_h o_h``: ``o_latent`` ``(..., H, r)`` per token -> ``(..., dim)``."""
        _, w_uv = self._up()
        o = torch.einsum("...hr,hvr->...hv", o_latent, w_uv)  # (..., H, d_v)
        return self.wo(o.flatten(-2))

    def expand_kv(self, latent: Tensor) -> tuple[Tensor, Tensor]:
        """Naive per-head keys ``(B, H, S, d_n + d_r)`` and values ``(B, H, S, d_v)`` of ``latent``
        ``(B, 1, S, r + d_r)``."""
        B, _, S, _ = latent.shape
        c, k_rope = latent[:, 0].split([self.r, self.d_r], dim=-1)  # (B, S, r), (B, S, d_r)
        kv = self.wkv_b(c).view(B, S, -1, self.d_n + self.d_v).transpose(1, 2)  # (B, H, S, d_n + d_v)
        k_nope, v = kv.split([self.d_n, self.d_v], dim=-1)
        k = torch.cat([k_nope, k_rope[:, None].expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        return k, v

    # ------------------------------------------------------------------ forward
    def forward(
        self, x: Tensor, rope: Tensor, positions: Tensor, mask: AttentionMask, kv_cache: KVCache | None = None
    ) -> Tensor:
        B, T, _ = x.shape
        q_in, kv_in = self._project(x)
        q_nope, q_rope = self._queries(q_in, rope, positions)
        latent = self._latent(kv_in, rope, positions)  # (B, 1, T, r + d_r)
        if kv_cache is not None:
            latent, _, k_positions = kv_cache.update(self.layer_id, latent, latent, positions)
            mask = AttentionMask(positions, k_positions)
            if self.absorb:
                q = self.absorbed_query(q_nope, q_rope)  # (B, H, T, r + d_r)
                o = attention(q, latent, latent, mask, backend=self.backend, scale=self.scale)[..., : self.r]
                return self.absorbed_output(o.transpose(1, 2))
        k, v = self.expand_kv(latent)
        out = self._attend(torch.cat([q_nope, q_rope], dim=-1), k, v, mask)  # (B, H, T, d_v)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask) -> Tensor:
        """Attention with key width ``d_n + d_r`` and value width ``d_v``; pads ``v`` for equal-width kernels."""
        width = q.shape[-1]
        if self.backend in _UNEQUAL_V_BACKENDS or self.d_v == width:
            return attention(q, k, v, mask, backend=self.backend, scale=self.scale)
        if self.d_v < width:
            out = attention(q, k, F.pad(v, (0, width - self.d_v)), mask, backend=self.backend, scale=self.scale)
            return out[..., : self.d_v]
        pad = (0, self.d_v - width)  # zero channels in q and k leave the scores unchanged
        return attention(F.pad(q, pad), F.pad(k, pad), v, mask, backend=self.backend, scale=self.scale)
