"""Context parallelism applied to a finished model: the sequence is sharded over ``cp`` ranks, attention is exchanged.

Two exchanges, chosen per model with :func:`apply_cp`:

- ``"ring"`` (:mod:`~lightning_llmopt.parallel.ring_attention`): key/value blocks travel around the ring by
  point-to-point sends and partial results are merged with their log-sum-exp. The sequence layout is load balanced
  for causal attention: it is cut into ``2*cp`` chunks and rank ``r`` holds chunks ``r`` and ``2cp-1-r``.
- ``"ulysses"`` (Jacobs et al., DeepSpeed-Ulysses, arXiv 2309.14509): an all-to-all turns sequence-sharded ``q, k,
  v`` ``(B, H, T/cp, D)`` into head-sharded ``(B, H/cp, T, D)``, the model's own attention backend runs on the whole
  sequence for ``H/cp`` heads, and a second all-to-all turns the output back. Needs ``H % cp == 0``; kv heads are
  repeated when fewer than ``cp``. The layout is contiguous (rank ``r`` holds chunk ``r``).

Both handle any :class:`~lightning_llmopt.models.attention.AttentionMask` (causal, packed documents, sliding window):
every rank's positions and document ids are all-gathered once per forward (cached on the mask object, which the
model shares between layers) and masks are rebuilt from them, so attention never crosses documents.

Steps for a user (the strategy does them): :func:`apply_cp` on the model; per batch :func:`shard_batch` (positions
are computed on the whole row first, so RoPE and per-document positions stay global); the loss of each rank is the
mean over its tokens and gradients are averaged over ``dp * cp`` ranks (:mod:`~lightning_llmopt.parallel.data_parallel`
or ZeRO over ``mesh["dp_cp"]``). Labels must be shifted in the batch (``labels[t]`` is the target of token ``t``),
as :class:`~lightning_llmopt.CausalLMModule` batches are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_llmopt.models.attention import AttentionMask, get_backend, positions_from_doc_ids, register_backend
from lightning_llmopt.parallel.ring_attention import causal_blocks, masked_blocks, ring_attention

__all__ = ["CP_MODES", "ContextParallelAttention", "ContextParallelSpec", "apply_cp", "shard_batch", "validate_cp"]

CP_MODES = ("ring", "ulysses")
_CACHE_ATTR = "_llmopt_cp_info"


@dataclass(frozen=True)
class ContextParallelSpec:
    """Which tokens of a row rank ``rank`` of ``cp`` holds (pure; no communication).

    Arguments:
        cp: context-parallel degree.
        rank: this rank's index in the context-parallel group.
        load_balance: chunks ``rank`` and ``2cp-1-rank`` of ``2cp`` (True) or chunk ``rank`` of ``cp`` (False).
    """

    cp: int
    rank: int
    load_balance: bool = True

    @property
    def multiple(self) -> int:
        """The sequence length must be a multiple of this."""
        return 2 * self.cp if self.load_balance else self.cp

    def chunks(self, rank: int | None = None) -> tuple[int, ...]:
        r = self.rank if rank is None else rank
        return (r, 2 * self.cp - 1 - r) if self.load_balance else (r,)

    def indices(self, seq_len: int, rank: int | None = None) -> Tensor:
        """Positions in the whole row of the tokens ``rank`` holds, in local order: ``(seq_len // cp,)`` int64."""
        n = len(self.chunks()) * self.cp
        if seq_len % n:
            raise ValueError(
                f"sequence length ({seq_len}) must be divisible by {n} for context_parallel ({self.cp})"
                + (" with load balancing (2*cp chunks)" if self.load_balance else "")
            )
        size = seq_len // n
        return torch.cat([torch.arange(c * size, (c + 1) * size) for c in self.chunks(rank)])

    def shard(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's tokens of ``x`` along ``dim``."""
        return x.index_select(dim, self.indices(x.shape[dim]).to(x.device))

    def unshard(self, parts: list[Tensor], dim: int = 1) -> Tensor:
        """Inverse of :meth:`shard` given every rank's part, in rank order."""
        total = sum(p.shape[dim] for p in parts)
        order = torch.cat([self.indices(total, r) for r in range(self.cp)]).to(parts[0].device)
        out = torch.empty_like(torch.cat(parts, dim=dim))
        return out.index_copy_(dim, order, torch.cat(parts, dim=dim))


def shard_batch(
    batch: dict[str, Any], spec: ContextParallelSpec, *, multiple_of: int = 1, seq_key: str = "input_ids"
) -> dict[str, Any]:
    """This rank's part of a dict batch: every tensor whose dim 1 is the row length is sharded along it.

    ``positions`` are added first when missing (``arange`` per row, or per document from ``doc_ids``), so they stay
    the positions in the whole row. ``multiple_of`` (e.g. the tensor-parallel degree under sequence parallelism)
    further divides the local length. Raises ``ValueError`` naming the sizes before any communication.
    """
    tokens = batch[seq_key]
    B, T = tokens.shape[:2]
    need = spec.multiple * multiple_of
    if T % need:
        factors = ["2*context_parallel" if spec.load_balance else "context_parallel"]
        if multiple_of > 1:
            factors.append("tensor_parallel (sequence parallelism)")
        raise ValueError(
            f"sequence length ({T}) must be divisible by {'*'.join(factors)} = {need} "
            f"(context_parallel={spec.cp}" + (f", tensor_parallel={multiple_of})" if multiple_of > 1 else ")")
        )
    out = dict(batch)
    if out.get("positions") is None:
        doc_ids = out.get("doc_ids")
        out["positions"] = (
            positions_from_doc_ids(doc_ids)
            if doc_ids is not None
            else torch.arange(T, device=tokens.device).expand(B, T)
        )
    for key, value in out.items():
        if isinstance(value, Tensor) and value.ndim >= 2 and value.shape[0] == B and value.shape[1] == T:
            out[key] = spec.shard(value, dim=1).contiguous()
    return out


def validate_cp(n_heads: int, n_kv_heads: int, cp: int, mode: str) -> None:
    """Raise ``ValueError`` naming the values (no collectives). Heads are the per-rank counts after TP."""
    if mode not in CP_MODES:
        raise ValueError(f"context_parallel_mode ({mode!r}) must be one of {CP_MODES}")
    if mode == "ulysses":
        if n_heads % cp:
            raise ValueError(
                f"query heads per tensor-parallel rank ({n_heads}) must be divisible by context_parallel "
                f"({cp}) for Ulysses"
            )
        g = math.gcd(n_kv_heads, cp)
        if n_heads % (n_kv_heads * (cp // g)):
            raise ValueError(
                f"kv heads per rank ({n_kv_heads}) cannot be repeated to a multiple of context_parallel "
                f"({cp}) that divides the query heads ({n_heads}) for Ulysses"
            )


# --------------------------------------------------------------------------- Ulysses


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over dim 0 (``cp`` equal chunks); its own adjoint."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def _seq_to_heads(x: Tensor, group: Any, cp: int) -> Tensor:
    B, H, T, D = x.shape
    y = _AllToAll.apply(x.view(B, cp, H // cp, T, D).transpose(0, 1), group)  # (cp, B, H/cp, T, D) by source rank
    return y.permute(1, 2, 0, 3, 4).reshape(B, H // cp, cp * T, D)


def _heads_to_seq(x: Tensor, group: Any, cp: int) -> Tensor:
    B, Hc, S, D = x.shape
    y = _AllToAll.apply(x.view(B, Hc, cp, S // cp, D).permute(2, 0, 1, 3, 4), group)  # (cp, B, H/cp, T, D)
    return y.transpose(0, 1).reshape(B, cp * Hc, S // cp, D)


# --------------------------------------------------------------------------- the attention backend


@dataclass
class _MaskInfo:
    key: tuple[Any, ...]
    blocks: list[Any] | None = None
    global_mask: AttentionMask | None = None


class ContextParallelAttention:
    """An attention backend (``fn(q, k, v, mask, scale)``) over the context-parallel group; see :func:`apply_cp`.

    Arguments:
        group: the context-parallel process group.
        mode: ``"ring"`` or ``"ulysses"``.
        load_balance: the layout of :class:`ContextParallelSpec` (default: True for ring, False for Ulysses).
        inner: the model's backend name, used by Ulysses on the gathered sequence.
        ring_impl: ``"auto"`` (flash kernels on CUDA with Triton, else the reference), ``"flash"``, ``"reference"``.
    """

    def __init__(
        self,
        group: Any,
        mode: str = "ring",
        load_balance: bool | None = None,
        inner: str = "sdpa",
        ring_impl: str = "auto",
    ) -> None:
        if mode not in CP_MODES:
            raise ValueError(f"context_parallel_mode ({mode!r}) must be one of {CP_MODES}")
        self.group, self.mode, self.inner, self.ring_impl = group, mode, inner, ring_impl
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.spec = ContextParallelSpec(self.cp, self.rank, mode == "ring" if load_balance is None else load_balance)
        self.name = f"cp-{mode}-{id(self):x}"

    def _impl(self, q: Tensor) -> str:
        if self.ring_impl != "auto":
            return self.ring_impl
        from lightning_llmopt.kernels.flash_attention import resolve_backend

        return "flash" if resolve_backend("auto", q.device) == "triton" else "reference"

    def _gather(self, t: Tensor) -> list[Tensor]:
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.cp)]
        dist.all_gather(parts, t, group=self.group)
        return parts

    def _info(self, mask: AttentionMask, q: Tensor) -> _MaskInfo:
        key = (id(self), tuple(mask.q_positions.shape), str(q.device))
        cached = getattr(mask, _CACHE_ATTR, None)
        if cached is not None and cached.key == key:
            return cached
        if mask.k_positions is not mask.q_positions and not torch.equal(mask.k_positions, mask.q_positions):
            raise ValueError("context parallelism needs self-attention masks (no KV cache)")
        pos = self._gather(mask.q_positions)
        docs = self._gather(mask.q_doc_ids) if mask.q_doc_ids is not None else None
        info = _MaskInfo(key)
        if self.mode == "ring":
            T = mask.q_positions.shape[1] * self.cp
            expected = torch.cat([self.spec.indices(T, r) for r in range(self.cp)]).to(q.device)
            plain = docs is None and mask.window is None and bool((torch.cat(pos, dim=1) == expected).all())
            info.blocks = (
                causal_blocks(self.rank, self.cp, self.spec.load_balance)
                if plain
                else masked_blocks(self.rank, mask.q_positions, mask.q_doc_ids, pos, docs, mask.window)
            )
        else:
            gpos = torch.cat(pos, dim=1)
            gdoc = torch.cat(docs, dim=1) if docs is not None else None
            T = gpos.shape[1]
            plain = gdoc is None and mask.window is None and bool((gpos == torch.arange(T, device=gpos.device)).all())
            info.global_mask = AttentionMask(gpos, gpos, gdoc, gdoc, window=mask.window, plain_causal=plain)
        if not torch.compiler.is_compiling():
            object.__setattr__(mask, _CACHE_ATTR, info)
        return info

    @torch.compiler.disable
    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float) -> Tensor:
        """q ``(B, H, T/cp, D)``, k/v ``(B, H_kv, T/cp, D)`` (this rank's tokens) -> ``(B, H, T/cp, D)``."""
        info = self._info(mask, q)
        if self.mode == "ring":
            assert info.blocks is not None
            return ring_attention(q, k, v, info.blocks, self.group, scale, self._impl(q))
        assert info.global_mask is not None
        H, H_kv = q.shape[1], k.shape[1]
        validate_cp(H, H_kv, self.cp, "ulysses")
        if H_kv % self.cp:
            rep = self.cp // math.gcd(H_kv, self.cp)
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        qh, kh, vh = (_seq_to_heads(t, self.group, self.cp) for t in (q, k, v))
        out = get_backend(self.inner)(qh, kh, vh, info.global_mask, scale)  # (B, H/cp, T, D)
        return _heads_to_seq(out, self.group, self.cp)


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    from lightning_llmopt.models.llama import Attention, Llama

    if not isinstance(model, Llama):
        raise NotImplementedError(
            f"context parallelism supports lightning_llmopt.models.Llama; got "
            f"{type(model).__name__} (transformers models: use tensor parallelism, or convert "
            "with lightning_llmopt.models.hf.from_hf)"
        )
    mla = getattr(model.config, "mla", None)
    if mla is not None:  # its attention modules are not Attention: they would silently stay unsharded
        raise NotImplementedError(f"context parallelism does not support multi-head latent attention (mla = {mla})")
    return [m for m in model.modules() if isinstance(m, Attention)]


def apply_cp(
    model: nn.Module,
    cp_mesh: Any,
    mode: str = "ring",
    *,
    load_balance: bool | None = None,
    ring_impl: str = "auto",
    tensor_parallel: int = 1,
) -> ContextParallelAttention:
    """Route every attention layer of ``model`` through a :class:`ContextParallelAttention` over ``cp_mesh``.

    Arguments:
        model: a :class:`~lightning_llmopt.models.Llama` (after tensor parallelism, if any).
        cp_mesh: the 1-D context-parallel ``DeviceMesh`` (``mesh["cp"]``).
        mode: ``"ring"`` or ``"ulysses"``.
        load_balance: sequence layout (default: load balanced for ring, contiguous for Ulysses).
        ring_impl: block kernels of the ring: ``"auto"``, ``"flash"`` or ``"reference"``.
        tensor_parallel: the TP degree already applied (heads per rank are ``n_heads / tensor_parallel``).

    Returns the backend; its ``spec`` says how to shard batches (:func:`shard_batch`).
    """
    attentions: list[Any] = _attention_modules(model)
    cfg: Any = model.config
    kv_local = max(cfg.n_kv_heads // tensor_parallel, 1)
    validate_cp(cfg.n_heads // tensor_parallel, kv_local, cp_mesh.size(), mode)
    inner: set[str] = {a.backend for a in attentions}
    if len(inner) > 1:
        raise ValueError(f"attention layers use different backends {sorted(inner)}; context parallelism needs one")
    backend = ContextParallelAttention(
        cp_mesh.get_group(), mode, load_balance, inner.pop() if inner else "sdpa", ring_impl
    )
    register_backend(backend.name, backend, overwrite=True)
    for a in attentions:
        a.backend = backend.name
    return backend
