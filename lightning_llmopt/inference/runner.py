"""The paged forward pass: the reference model's weights, run over one packed batch of scheduled tokens.

A step computes ``N`` tokens from many sequences at once, packed into one row: first the decode tokens (one per
sequence, each attending to its paged cache through :func:`~lightning_llmopt.kernels.paged_attention`), then prefill
chunks, all of them in one variable-length flash-attention call with ``cu_seqlens`` (chunks with cached context get
their context keys read back from the pool; see :class:`StepInputs`). Every linear layer, norm and MLP runs
once over all ``N`` tokens; logits are computed only for tokens whose next token is sampled.

The math is the reference model's (:class:`~lightning_llmopt.models.llama.Llama`): the same modules and weights
(nothing is copied), RoPE in fp32, RMSNorm in fp32. On CUDA the per-token elementwise work runs in fused Triton
kernels (:mod:`~lightning_llmopt.inference.decode_kernels`); on CPU plain PyTorch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_llmopt.inference.kv_group_rows import group_rows
from lightning_llmopt.inference.kv_groups import GroupedPool, group_inputs
from lightning_llmopt.inference.kv_pool import KVPool
from lightning_llmopt.inference.scheduler import Work
from lightning_llmopt.inference.step_inputs import StepInputs
from lightning_llmopt.kernels.flash_attention import flash_attention
from lightning_llmopt.kernels.paged_attention import paged_attention
from lightning_llmopt.models.layer_pattern import kv_producers, kv_window, layer_windows
from lightning_llmopt.models.llama import Llama
from lightning_llmopt.models.rope import apply_rope

__all__ = ["ModelRunner", "StepInputs", "decode_rows", "sampled_rows", "seqlen_bucket", "to_device"]


def seqlen_bucket(n: int) -> int:
    """``max_seqlen`` handed to the flash kernel: a power of two >= 64 (an upper bound is all the varlen kernel
    needs, and a few distinct values keep its autotuner from re-tuning for every new prompt length)."""
    return max(64, 1 << max(0, (n - 1).bit_length()))


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """``t`` (on the host) on ``device`` without waiting for the device: a blocking copy, or one from pageable memory,
    may first drain the stream, which leaves the GPU idle while the host prepares what follows. On CUDA the copy goes
    through pinned memory (PyTorch's caching host allocator keeps the block until the copy has run)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def decode_rows(work: list[Work], block_size: int) -> tuple[np.ndarray, list[list[int]]]:
    """Every token of ``work`` as its own decode row: ``(5, R)`` int64 of token, position, block, slot and context
    length (the row's own key included), and each row's block table.

    A work of several tokens (a speculative verify: the last accepted token plus the drafts) becomes consecutive
    rows of one sequence. That is exact: each layer writes the keys/values of all rows to the pool before any row
    attends, and row ``j`` sees keys up to its own position only, which is the causal mask of the multi-token
    forward."""
    n = sum(w.num_tokens for w in work)
    rows = np.zeros((5, n), dtype=np.int64)
    tables: list[list[int]] = []
    r = 0
    for w in work:
        seq, table = w.seq, w.seq.block_table
        for p in range(w.start, w.start + w.num_tokens):
            rows[:, r] = (seq.tokens[p], p, table[p // block_size], p % block_size, p + 1)
            tables.append(table)
            r += 1
    return rows, tables


def sampled_rows(work: list[Work]) -> list[int] | None:
    """Rows of a :func:`decode_rows` layout that :meth:`ModelRunner.forward` would return logits for (the last
    ``num_logits`` tokens of each work that samples), or ``None`` when that is every row in order."""
    out: list[int] = []
    r = 0
    for w in work:
        if w.samples:
            out.extend(range(r + w.num_tokens - w.num_logits, r + w.num_tokens))
        r += w.num_tokens
    return None if len(out) == r else out


class ModelRunner:
    """Runs :class:`Llama` weights over paged KV storage.

    Arguments:
        model: the reference model (complete: embedding, blocks, norm, head).
        pool: the KV pool.
        backend: attention backend: ``"auto"``, ``"triton"`` or ``"reference"``.
        fused: use the fused Triton elementwise kernels (default: on CUDA with Triton).
    """

    def __init__(self, model: Llama, pool: KVPool, backend: str = "auto", fused: bool | None = None) -> None:
        if model.tok_embeddings is None or model.norm is None or model.output is None:
            raise ValueError("the engine needs a complete model (embedding, final norm and output head)")
        self.model = model
        self.cfg = model.config
        self.pool = pool
        self.block_size = pool.block_size
        self.device = pool.device
        self.dtype = model.tok_embeddings.weight.dtype
        self.backend = backend
        # Layer patterns: each layer's own window; prefill context reaches back as far as the widest needs.
        self.windows = layer_windows(self.cfg)
        self.window = kv_window(self.cfg)
        # Cross-layer KV sharing: the pool holds producers only; layer i reads pool layer slot[kv_source(i)].
        producers = kv_producers(self.cfg)
        self.slot = [producers.index(self.cfg.kv_source(i)) for i in range(self.cfg.n_layers)]
        if pool.n_layers != len(producers):
            raise ValueError(f"the pool holds {pool.n_layers} layers, the model produces K/V in {len(producers)}")
        if fused is None:
            from lightning_llmopt.testing.triton import triton_available

            fused = self.device.type == "cuda" and triton_available() and backend != "reference"
            fused = fused and getattr(self.cfg, "moe", None) is None  # the fused path knows dense SwiGLU blocks only
        self.fused = fused
        self.linear = None
        if fused:
            from lightning_llmopt.inference.linear_chooser import LinearChooser

            self.linear = LinearChooser()

    # ------------------------------------------------------------------ inputs
    def _slots(self, table: list[int], lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        pos = np.arange(lo, hi)
        return np.asarray(table, dtype=np.int64)[pos // self.block_size], pos % self.block_size

    @staticmethod
    def order(work: list[Work]) -> list[Work]:
        """The packing order :meth:`prepare` expects: decodes first, then prefill chunks.

        Logit rows follow this order (restricted to the work that samples, ``num_logits`` rows each)."""
        return [w for w in work if w.num_tokens == 1] + [w for w in work if w.num_tokens > 1]

    def prepare(self, work: list[Work]) -> StepInputs:
        """Pack work given in :meth:`order` (decodes, then prefills) into device tensors."""
        nd = sum(1 for w in work if w.num_tokens == 1)
        dec, pre = work[:nd], work[nd:]
        if any(w.num_tokens != 1 for w in dec):
            raise ValueError("work must be in ModelRunner.order(...)")
        ids: list[int] = []
        pos, blk, slot = [], [], []
        logits_idx: list[int] = []
        for w in work:
            s = w.seq
            ids.extend(s.tokens[w.start : w.start + w.num_tokens])
            pos.append(np.arange(w.start, w.start + w.num_tokens))
            b, o = self._slots(s.block_table, w.start, w.start + w.num_tokens)
            blk.append(b)
            slot.append(o)
            if w.samples:
                logits_idx.extend(range(len(ids) - w.num_logits, len(ids)))
        dev = self.device
        max_blocks = max((len(w.seq.block_table) for w in dec), default=1)
        tables = np.zeros((nd, max_blocks), dtype=np.int32)
        for r, w in enumerate(dec):
            tables[r, : len(w.seq.block_table)] = w.seq.block_table
        ctx = [w.start + 1 for w in dec]
        cat = np.concatenate
        inp = StepInputs(
            input_ids=to_device(torch.tensor(ids, dtype=torch.long), dev),
            positions=to_device(torch.from_numpy(cat(pos)), dev),
            blocks=to_device(torch.from_numpy(cat(blk)), dev),
            slots=to_device(torch.from_numpy(cat(slot)), dev),
            num_decode=nd,
            dec_tables=to_device(torch.from_numpy(tables), dev),
            dec_ctx=to_device(torch.tensor(ctx, dtype=torch.int32), dev),
            dec_max_ctx=max(ctx, default=1),
            logits_idx=to_device(torch.tensor(logits_idx, dtype=torch.long), dev),
        )
        if pre:
            self._segments(pre, inp)
        if isinstance(self.pool, GroupedPool):  # KV groups: each group's blocks for the same rows
            inp.groups = [inp] + [group_inputs(self, work, inp, g) for g in range(1, len(self.pool.pools))]
        return inp

    def _inputs_for(self, inp: StepInputs, layer: int) -> StepInputs:
        """The step's inputs with the block fields of ``layer``'s KV group."""
        if inp.groups is None:
            return inp
        assert isinstance(self.pool, GroupedPool)
        return inp.groups[self.pool.group_of(self.slot[layer])]

    def prepare_rows(self, work: list[Work]) -> StepInputs:
        """Pack ``work`` (any order) as decode rows only (:func:`decode_rows`): paged attention for every token,
        logits for every row. The layout :class:`~lightning_llmopt.inference.cuda_graphs.DecodeGraphs` replays;
        eager here for checks on any device."""
        rows, tables = decode_rows(work, self.block_size)
        n = rows.shape[1]
        meta = to_device(torch.from_numpy(rows), self.device)
        inp = StepInputs(
            input_ids=meta[0],
            positions=meta[1],
            blocks=meta[2],
            slots=meta[3],
            num_decode=n,
            dec_tables=self._row_tables(tables),
            dec_ctx=meta[4].to(torch.int32),
            dec_max_ctx=int(rows[4].max()) if n else 1,
            logits_idx=torch.arange(n, device=self.device),
        )
        if isinstance(self.pool, GroupedPool):  # KV groups: each local group's key blocks and tables, same rows
            n_local = len(self.pool.pools) - 1
            blocks, local = group_rows(work, self.block_size, n_local)
            dev_blocks = to_device(torch.from_numpy(blocks), self.device)
            inp.groups = [inp] + [
                dataclasses.replace(inp, blocks=dev_blocks[g], dec_tables=self._row_tables(local[g]))
                for g in range(n_local)
            ]
        return inp

    def _row_tables(self, tables: list[list[int]]) -> Tensor:
        """One block table per row, zero-padded to the widest, on the device."""
        width = max((len(t) for t in tables), default=1)
        tab = np.zeros((len(tables), max(width, 1)), dtype=np.int32)
        for r, t in enumerate(tables):
            tab[r, : len(t)] = t
        return to_device(torch.from_numpy(tab), self.device)

    def _segments(self, pre: list[Work], inp: StepInputs) -> None:
        """Fill the prefill segment fields of ``inp`` (layout in :class:`StepInputs`)."""
        dev = self.device
        lens, new_rows, ctx_rows, ctx_blk, ctx_slot = [], [], [], [], []
        row = 0
        for w in pre:
            lo = max(0, w.start - self.window + 1) if self.window is not None else 0
            c = w.start - lo
            if c:
                b, o = self._slots(w.seq.block_table, lo, w.start)
                ctx_blk.append(b)
                ctx_slot.append(o)
                ctx_rows.append(np.arange(row, row + c))
            new_rows.append(np.arange(row + c, row + c + w.num_tokens))
            lens.append(c + w.num_tokens)
            row += c + w.num_tokens
        inp.seg_cu = to_device(torch.tensor(np.cumsum([0, *lens]), dtype=torch.int32), dev)
        inp.seg_max = seqlen_bucket(max(lens))
        inp.seg_total = row
        if ctx_rows:
            cat = np.concatenate
            inp.seg_new = to_device(torch.from_numpy(cat(new_rows)), dev)
            inp.seg_ctx = to_device(torch.from_numpy(cat(ctx_rows)), dev)
            inp.ctx_blocks = to_device(torch.from_numpy(cat(ctx_blk)), dev)
            inp.ctx_slots = to_device(torch.from_numpy(cat(ctx_slot)), dev)

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, inp: StepInputs, max_context: int | None = None) -> Tensor:
        """Logits ``(S, vocab)`` fp32 of the rows in ``inp.logits_idx``.

        ``max_context`` bounds the decode context lengths for the split-KV grid (fixed under CUDA graphs)."""
        model = self.model
        assert model.tok_embeddings is not None and model.norm is not None and model.output is not None
        if self.fused:
            from lightning_llmopt.inference.decode_kernels import fused_forward

            h = fused_forward(self, inp, max_context)
            assert self.linear is not None
            return self.linear(h, model.output).float()
        else:
            h = model.tok_embeddings(inp.input_ids)  # (N, dim)
            step_kv: dict[int, tuple[Tensor, Tensor]] = {}  # this step's K/V of each producer (shared K/V)
            for i, block in enumerate(model.layers.values()):
                h = self._block(i, block, h, inp, max_context, step_kv)
            h = model.norm(h[inp.logits_idx])
        return model.output(h).float()

    def _block(
        self,
        i: int,
        block: Any,
        h: Tensor,
        inp: StepInputs,
        max_context: int | None,
        step_kv: dict[int, tuple[Tensor, Tensor]],
    ) -> Tensor:
        attn = block.attention
        x = block.attention_norm(h)
        N = x.shape[0]
        D = attn.head_dim
        q = attn.wq(x).view(N, -1, D)  # (N, H, D)
        q = apply_rope(q.transpose(0, 1)[None], self.model.rope, inp.positions[None])[0].transpose(0, 1)
        src = self.cfg.kv_source(i)
        if src == i:
            k = attn.wk(x).view(N, -1, D)  # (N, H_kv, D)
            v = attn.wv(x).view(N, -1, D)
            k = apply_rope(k.transpose(0, 1)[None], self.model.rope, inp.positions[None])[0].transpose(0, 1)
            ginp = self._inputs_for(inp, i)
            self.pool.write(self.slot[i], k, v, ginp.blocks, ginp.slots)
            step_kv[i] = (k, v)
        else:  # a layer reading another layer's K/V: nothing to compute or store
            k, v = step_kv[src]
        o = self.attention(i, q, k, v, inp, max_context)
        h = h + attn.wo(o.reshape(N, -1))
        return h + block.feed_forward(block.ffn_norm(h))

    def attention(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, inp: StepInputs, max_context: int | None = None
    ) -> Tensor:
        """Attention of the packed step: q ``(N, H, D)``, the step's own k/v ``(N, H_kv, D)`` -> ``(N, H, D)``.

        ``layer`` is the model's layer: it reads its K/V source's pool slot, with its own window."""
        window = self.windows[layer]
        inp = self._inputs_for(inp, layer)
        layer = self.slot[layer]
        kc, vc = self.pool.layer(layer)
        ks, vs = self.pool.layer_scales(layer)
        nd = inp.num_decode
        if nd and inp.seg_cu is None:
            return paged_attention(
                q,
                kc,
                vc,
                inp.dec_tables,
                inp.dec_ctx,
                window=window,
                k_scale=ks,
                v_scale=vs,
                max_context=max_context or inp.dec_max_ctx,
                backend=self.backend,
            )
        o = torch.empty_like(q)
        if nd:
            o[:nd] = paged_attention(
                q[:nd],
                kc,
                vc,
                inp.dec_tables,
                inp.dec_ctx,
                window=window,
                k_scale=ks,
                v_scale=vs,
                max_context=max_context or inp.dec_max_ctx,
                backend=self.backend,
            )
        if inp.seg_cu is None:
            return o
        sl = slice(nd, q.shape[0])
        qs, kk, vv = q[sl], k[sl], v[sl]
        if inp.seg_new is not None:  # segments with context rows: scatter the new rows, read the context back
            assert inp.seg_ctx is not None and inp.ctx_blocks is not None and inp.ctx_slots is not None
            T = inp.seg_total
            qs = q.new_zeros(T, q.shape[1], q.shape[2])
            qs[inp.seg_new] = q[sl]
            kk = k.new_empty(T, k.shape[1], k.shape[2])
            vv = v.new_empty(T, v.shape[1], v.shape[2])
            kk[inp.seg_new] = k[sl]
            vv[inp.seg_new] = v[sl]
            k_ctx, v_ctx = self.pool.read(layer, inp.ctx_blocks, inp.ctx_slots, q.dtype)
            kk[inp.seg_ctx] = k_ctx
            vv[inp.seg_ctx] = v_ctx
        out = flash_attention(
            qs,
            kk,
            vv,
            causal=True,
            window=window,
            cu_seqlens=inp.seg_cu,
            max_seqlen=inp.seg_max,
            backend=None if self.backend == "auto" else self.backend,
        )
        assert isinstance(out, Tensor)
        o[sl] = out[inp.seg_new] if inp.seg_new is not None else out
        return o
