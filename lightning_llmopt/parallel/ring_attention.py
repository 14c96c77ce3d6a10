"""Ring attention: exact attention over a sequence sharded across context-parallel ranks.

Ring attention (Liu, Zaharia & Abbeel, arXiv 2310.01889) keeps each rank's queries in place and passes key/value
blocks around a ring of ``cp`` ranks. Forward, on rank ``r`` (blocks are described by :class:`Block`):

1. start with ``out = 0``, ``lse = -inf`` (fp32) and the local ``(k, v)``;
2. for step ``s = 0..cp-1`` (the block held now came from rank ``(r - s) mod cp``): post the point-to-point send of
   the block to rank ``r+1`` and the receive from ``r-1`` for the next step, compute the partial attention of the
   local queries to the held block, ``(o_s, lse_s)``, and merge it online (the log-sum-exp rule of FlashAttention)::

       lse' = logaddexp(lse, lse_s);   out = out * exp(lse - lse') + o_s * exp(lse_s - lse')

   then wait for the next block;
3. save ``q, k, v``, the merged output and ``lse`` for backward.

Backward passes the blocks around again; the gradient of a block uses the *merged* output and log-sum-exp
(``P = exp(S - lse)``, ``dS = P * (dP - rowsum(dO * O))``), so per-block gradients add up exactly. ``dq`` stays local;
the ``(dk, dv)`` accumulator of a block travels with it: after each step the rank sends the accumulator to ``r+1``
and receives the one of the block it holds next, and after the last step one more hop brings every accumulator home.

Causal load balancing (Brandon et al. "Striped Attention", arXiv 2311.09431 and the "zigzag" layout of later ring
implementations): the sequence is cut into ``2*cp`` chunks and rank ``r`` holds chunks ``r`` and ``2cp-1-r``. With
plain causal attention every step then has the same work: the own block is causal, a block from a lower rank is seen
fully by all local queries but only through its first chunk, and a block from a higher rank is seen fully by the
second local chunk only (:func:`causal_blocks`). Other masks (packed documents, sliding windows) use a dense visibility
mask per block built from positions and document ids, and blocks with nothing visible are skipped
(:func:`masked_blocks`).

Block kernels: on CUDA with Triton, the flash-attention custom ops (which return the log-sum-exp; causal and full
blocks); elsewhere, and for dense-mask blocks, an fp32 PyTorch reference that returns the log-sum-exp too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Block", "RingAttention", "causal_blocks", "masked_blocks", "ring_attention", "visible"]


@dataclass(frozen=True)
class Block:
    """The work of one ring step: ``kind`` is ``"causal"`` (same-length diagonal block), ``"full"`` (no mask),
    ``"masked"`` (dense ``mask`` ``(B, 1, Tq, Tk)`` bool) or ``"skip"``; ``q``/``k`` select the local query rows and
    the block's key rows that take part: ``"all"``, or the ``"head"``/``"tail"`` half (the two chunks of the
    load-balanced layout)."""

    kind: str
    q: str = "all"
    k: str = "all"
    mask: Tensor | None = None


def causal_blocks(rank: int, cp: int, load_balance: bool) -> list[Block]:
    """Blocks for plain causal attention in the load-balanced (chunks ``r`` and ``2cp-1-r``) or contiguous layout."""
    blocks = []
    for step in range(cp):
        src = (rank - step) % cp
        if step == 0:
            blocks.append(Block("causal"))
        elif load_balance:
            blocks.append(Block("full", k="head") if src < rank else Block("full", q="tail"))
        else:
            blocks.append(Block("full") if src < rank else Block("skip"))
    return blocks


def _rows(selector: str, n: int) -> slice:
    """Rows of a local sequence of length ``n`` (two chunks of ``n // 2`` in the load-balanced layout)."""
    return {"all": slice(0, n), "head": slice(0, n // 2), "tail": slice(n // 2, n)}[selector]


def visible(q_pos: Tensor, k_pos: Tensor, q_doc: Tensor | None, k_doc: Tensor | None, window: int | None) -> Tensor:
    """``(B, 1, Tq, Tk)`` bool: the :class:`~lightning_llmopt.models.attention.AttentionMask` rule for these rows."""
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]
    allowed = (kp >= 0) & (kp <= qp)
    if window is not None:
        allowed &= (qp - kp) < window
    if q_doc is not None and k_doc is not None:
        allowed &= q_doc[:, :, None] == k_doc[:, None, :]
    return allowed[:, None]


def masked_blocks(
    rank: int, q_pos: Tensor, q_doc: Tensor | None, k_pos: list[Tensor], k_doc: list[Tensor] | None, window: int | None
) -> list[Block]:
    """Dense-mask blocks from every rank's positions and document ids (one host sync per block to skip empty ones)."""
    cp = len(k_pos)
    blocks = []
    for step in range(cp):
        src = (rank - step) % cp
        mask = visible(q_pos, k_pos[src], q_doc, k_doc[src] if k_doc is not None else None, window)
        blocks.append(Block("masked", mask=mask) if bool(mask.any()) else Block("skip"))
    return blocks


# --------------------------------------------------------------------------- block kernels


def _block_mask(blk: Block, tq: int, tk: int, device: torch.device) -> Tensor | None:
    if blk.kind == "masked":
        return blk.mask
    if blk.kind == "causal":
        return torch.ones(tq, tk, dtype=torch.bool, device=device).tril(tk - tq)
    return None


def _ref_scores(q: Tensor, k: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    rep = q.shape[1] // k.shape[1]
    s = torch.matmul(q.float(), k.float().repeat_interleave(rep, dim=1).transpose(-1, -2)) * scale  # (B, H, Tq, Tk)
    return s.masked_fill(~mask, float("-inf")) if mask is not None else s


def _probs(s: Tensor, lse: Tensor) -> Tensor:
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # rows without a key: p = 0, not NaN
    return torch.exp(s - finite[..., None])


def _group_sum(x: Tensor, kv_heads: int) -> Tensor:
    B, H, T, D = x.shape
    return x.view(B, kv_heads, H // kv_heads, T, D).sum(dim=2)


def ref_block_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """fp32 partial attention: q ``(B, H, Tq, D)``, k/v ``(B, H_kv, Tk, D)`` -> out ``(B, H, Tq, D)``, lse
    ``(B, H, Tq)`` (``-inf`` and a zero output where a query sees no key)."""
    s = _ref_scores(q, k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    rep = q.shape[1] // k.shape[1]
    return torch.matmul(_probs(s, lse), v.float().repeat_interleave(rep, dim=1)), lse


def ref_block_backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor, mask: Tensor | None, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 gradients of one block given the merged ``lse`` and ``delta = rowsum(dO * O)`` ``(B, H, Tq)``."""
    rep, kv_heads = q.shape[1] // k.shape[1], k.shape[1]
    kf, vf, dof = k.float().repeat_interleave(rep, dim=1), v.float().repeat_interleave(rep, dim=1), do.float()
    p = _probs(_ref_scores(q, k, mask, scale), lse)  # (B, H, Tq, Tk)
    dv = torch.matmul(p.transpose(-1, -2), dof)
    ds = p * (torch.matmul(dof, vf.transpose(-1, -2)) - delta[..., None])
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.float()) * scale
    return dq, _group_sum(dk, kv_heads), _group_sum(dv, kv_heads)


def _flash_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    import lightning_llmopt.kernels.flash_attention  # noqa: F401  (registers the custom ops)

    out, lse = torch.ops.lightning_llmopt.flash_attn_fwd(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, 0, causal, scale, 0
    )  # (B, T, H, D), (B, H, T)
    return out.transpose(1, 2).float(), lse


def _flash_backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    t = [x.transpose(1, 2) for x in (do, q, k, v, out)]
    t = [x if x.stride(-1) == 1 else x.contiguous() for x in t]
    dq, dk, dv = torch.ops.lightning_llmopt.flash_attn_bwd(*t, lse.contiguous(), None, 0, causal, scale, 0)
    return dq.transpose(1, 2).float(), dk.transpose(1, 2).float(), dv.transpose(1, 2).float()


# --------------------------------------------------------------------------- communication


class _Ring:
    """Point-to-point neighbours of this rank in ``group``: send to ``r+1``, receive from ``r-1``."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (rank - 1) % self.size)

    def start(self, sends: list[Tensor]) -> tuple[list[Tensor], list[Any]]:
        """Post every send to ``next`` and a receive of the same shape from ``prev``; returns buffers and works."""
        if not sends:
            return [], []
        recvs = [torch.empty_like(t) for t in sends]
        ops = []
        for s, r in zip(sends, recvs, strict=True):
            ops += [dist.P2POp(dist.isend, s, self.next, self.group), dist.P2POp(dist.irecv, r, self.prev, self.group)]
        return recvs, dist.batch_isend_irecv(ops)


def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


# --------------------------------------------------------------------------- autograd


class RingAttention(torch.autograd.Function):
    """``RingAttention.apply(q, k, v, blocks, group, scale, impl)``: see the module docstring."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        blocks: list[Block],
        group: Any,  # type: ignore[override]
        scale: float,
        impl: str,
    ) -> Tensor:
        ring = _Ring(group)
        B, H, T, D = q.shape
        out = q.new_zeros((B, H, T, D), dtype=torch.float32)
        lse = q.new_full((B, H, T), float("-inf"), dtype=torch.float32)
        kv = torch.stack((k, v))  # (2, B, H_kv, T, D): one message per step
        for step, blk in enumerate(blocks):
            nxt, works = ring.start([kv] if step + 1 < len(blocks) else [])
            if blk.kind != "skip":
                qs, ks = _rows(blk.q, T), _rows(blk.k, T)
                o, o_lse = _block_forward(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], blk, scale, impl)
                _merge_(out, lse, qs, o, o_lse)
            _wait(works)
            kv = nxt[0] if nxt else kv
        out_q = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out_q, lse)
        ctx.blocks, ctx.group, ctx.scale, ctx.impl = blocks, group, scale, impl
        return out_q

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        blocks, scale, impl = ctx.blocks, ctx.scale, ctx.impl
        ring = _Ring(ctx.group)
        T = q.shape[2]
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(dim=-1)  # (B, H, T)
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = torch.stack((k, v))
        dkv = torch.zeros_like(kv, dtype=torch.float32)  # accumulator of the block held now
        for step, blk in enumerate(blocks):
            # the kv block for the next step, and the accumulator of the previous block on to its next holder
            sends = ([kv] if step + 1 < len(blocks) else []) + ([dkv] if step > 0 else [])
            recvs, works = ring.start(sends)
            grads = None
            if blk.kind != "skip":
                qs, ks = _rows(blk.q, T), _rows(blk.k, T)
                grads = _block_backward(
                    dout[:, :, qs],
                    q[:, :, qs],
                    kv[0][:, :, ks],
                    kv[1][:, :, ks],
                    out[:, :, qs],
                    lse[:, :, qs],
                    delta[:, :, qs],
                    blk,
                    scale,
                    impl,
                )
                dq[:, :, qs] += grads[0]
            _wait(works)
            if step > 0:
                dkv = recvs[-1]
            if grads is not None:
                dkv[0][:, :, ks] += grads[1]
                dkv[1][:, :, ks] += grads[2]
            if step + 1 < len(blocks):
                kv = recvs[0]
        recvs, works = ring.start([dkv]) if len(blocks) > 1 else ([dkv], [])
        _wait(works)
        dkv = recvs[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _use_flash(blk: Block, impl: str) -> bool:
    return impl == "flash" and blk.kind in ("causal", "full")


def _block_forward(q: Tensor, k: Tensor, v: Tensor, blk: Block, scale: float, impl: str) -> tuple[Tensor, Tensor]:
    if _use_flash(blk, impl):
        return _flash_forward(q, k, v, blk.kind == "causal", scale)
    return ref_block_forward(q, k, v, _block_mask(blk, q.shape[2], k.shape[2], q.device), scale)


def _block_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    delta: Tensor,
    blk: Block,
    scale: float,
    impl: str,
) -> tuple[Tensor, Tensor, Tensor]:
    if _use_flash(blk, impl):
        return _flash_backward(do, q, k, v, out, lse, blk.kind == "causal", scale)
    return ref_block_backward(do, q, k, v, lse, delta, _block_mask(blk, q.shape[2], k.shape[2], q.device), scale)


def _merge_(out: Tensor, lse: Tensor, rows: slice, o: Tensor, o_lse: Tensor) -> None:
    """Online-softmax merge of a partial result into ``out[:, :, rows]``/``lse[:, :, rows]`` (fp32, in place)."""
    cur = lse[:, :, rows]
    new = torch.logaddexp(cur, o_lse)
    base = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # both -inf: weights exp(-inf) = 0, not NaN
    out[:, :, rows] = out[:, :, rows] * torch.exp(cur - base)[..., None] + o * torch.exp(o_lse - base)[..., None]
    lse[:, :, rows] = new


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, blocks: list[Block], group: Any, scale: float, impl: str = "reference"
) -> Tensor:
    """Attention of local queries ``(B, H, T, D)`` to the keys/values ``(B, H_kv, T, D)`` of every rank of ``group``
    (``len(blocks)`` ranks), block by block as ``blocks`` say; ``impl`` is ``"flash"`` or ``"reference"``.

    Returns ``(B, H, T, D)`` in ``q.dtype``; differentiable in q, k and v.
    """
    if len(blocks) != dist.get_world_size(group):
        raise ValueError(
            f"blocks ({len(blocks)}) must have one entry per rank of the group ({dist.get_world_size(group)})"
        )
    if impl not in ("flash", "reference"):
        raise ValueError(f"impl ({impl!r}) must be 'flash' or 'reference'")
    return RingAttention.apply(q, k, v, blocks, group, scale, impl)
