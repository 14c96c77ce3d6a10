"""Context parallelism without Lightning: layouts, batch sharding, block plans and both exchanges (ring, Ulysses)
against the single-process eager attention, forward and backward, on gloo ranks.

Model-level training parity (CP=2 ring/Ulysses, causal and packed documents, and the 2x2 meshes) is in
``tests/strategies/test_nd_parallel.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_llmopt.models.attention import AttentionMask, attention, positions_from_doc_ids
from lightning_llmopt.parallel.context_parallel import (
    ContextParallelAttention,
    ContextParallelSpec,
    shard_batch,
    validate_cp,
)
from lightning_llmopt.parallel.mesh import ParallelDims
from lightning_llmopt.parallel.parallelize import NDConfig, validate
from lightning_llmopt.parallel.ring_attention import Block, causal_blocks
from lightning_llmopt.testing.triton import triton_available

TOL = 1e-6  # fp32; measured ~2e-7 (the online-softmax merge sums in another order than one softmax)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# ------------------------------------------------------------------ layouts (pure)
def test_load_balanced_layout_holds_a_head_and_a_tail_chunk() -> None:
    assert ContextParallelSpec(2, 0).indices(8).tolist() == [0, 1, 6, 7]
    assert ContextParallelSpec(2, 1).indices(8).tolist() == [2, 3, 4, 5]
    assert ContextParallelSpec(4, 1).indices(16).tolist() == [2, 3, 12, 13]
    assert ContextParallelSpec(2, 1, load_balance=False).indices(8).tolist() == [4, 5, 6, 7]
    x = torch.arange(3 * 24).view(3, 24)
    for spec in (ContextParallelSpec(4, 0), ContextParallelSpec(3, 0, load_balance=False)):
        parts = [ContextParallelSpec(spec.cp, r, spec.load_balance).shard(x) for r in range(spec.cp)]
        assert torch.equal(spec.unshard(parts), x)
    with pytest.raises(ValueError, match=r"sequence length \(10\) must be divisible by 4 for context_parallel \(2\)"):
        ContextParallelSpec(2, 0).indices(10)


def test_shard_batch_keeps_whole_row_positions() -> None:
    docs = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1]])
    batch = {"input_ids": torch.arange(8)[None], "labels": torch.arange(1, 9)[None], "doc_ids": docs, "meta": 3}
    out = shard_batch(batch, ContextParallelSpec(2, 0))
    assert out["input_ids"].tolist() == [[0, 1, 6, 7]] and out["labels"].tolist() == [[1, 2, 7, 8]]
    assert out["positions"].tolist() == [[0, 1, 0, 1]]  # per document, computed on the whole row first
    assert out["doc_ids"].tolist() == [[0, 0, 1, 1]] and out["meta"] == 3
    plain = shard_batch({"input_ids": torch.zeros(2, 8, dtype=torch.long)}, ContextParallelSpec(2, 1))
    assert plain["positions"].tolist() == [[2, 3, 4, 5]] * 2
    with pytest.raises(
        ValueError,
        match=r"sequence length \(8\) must be divisible by 2\*context_parallel\*"
        r"tensor_parallel \(sequence parallelism\) = 16 \(context_parallel=2, "
        r"tensor_parallel=4\)",
    ):
        shard_batch(batch, ContextParallelSpec(2, 0), multiple_of=4)


def test_causal_blocks_balance_the_work() -> None:
    assert causal_blocks(0, 2, True) == [Block("causal"), Block("full", q="tail")]
    assert causal_blocks(1, 2, True) == [Block("causal"), Block("full", k="head")]
    assert causal_blocks(0, 2, False) == [Block("causal"), Block("skip")]
    # every rank computes one causal block and cp-1 half blocks: the same work everywhere
    for rank in range(4):
        blocks = causal_blocks(rank, 4, True)
        assert blocks[0].kind == "causal" and all(b.kind == "full" and "all" in (b.q, b.k) for b in blocks[1:])


def test_validation_names_the_values() -> None:
    with pytest.raises(
        ValueError,
        match=r"query heads per tensor-parallel rank \(6\) must be divisible by "
        r"context_parallel \(4\)",
    ):
        validate_cp(6, 2, 4, "ulysses")
    with pytest.raises(ValueError, match=r"context_parallel_mode \('zigzag'\) must be one of"):
        validate_cp(8, 2, 2, "zigzag")
    validate_cp(6, 2, 4, "ring")  # the ring has no head constraint
    validate_cp(8, 1, 4, "ulysses")  # one kv head is repeated to 4
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with pytest.raises(
        NotImplementedError,
        match=r"context_parallel \(2\) supports lightning_llmopt Llama models; "
        r"got LlamaForCausalLM",
    ):
        validate(transformers.LlamaForCausalLM(cfg), ParallelDims.resolve(2, context_parallel=2), NDConfig())


# ------------------------------------------------------------------ exchanges against one process
def _inputs(B: int, H: int, H_kv: int, T: int, D: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q, do = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    k, v = torch.randn(B, H_kv, T, D, generator=g), torch.randn(B, H_kv, T, D, generator=g)
    docs = torch.sort(torch.randint(0, 4, (B, T), generator=g), dim=1).values
    return q, k, v, do, docs


def _mask(case: str, positions: torch.Tensor, docs: torch.Tensor) -> AttentionMask:
    if case == "docs":
        return AttentionMask(positions, positions, docs, docs)
    return AttentionMask(positions, positions, window=5 if case == "window" else None)


def _whole(case: str, shape: tuple[int, ...]) -> list[torch.Tensor]:
    q, k, v, do, docs = _inputs(*shape)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    B, T = q.shape[0], q.shape[2]
    pos = positions_from_doc_ids(docs) if case == "docs" else torch.arange(T).expand(B, T)
    out = attention(*leaves, _mask(case, pos, docs), backend="eager")
    out.backward(do)
    return [out.detach(), *[t.grad for t in leaves]]


def _sharded(mode: str, cases: list[str], shape: tuple[int, ...], ring_impl: str = "auto") -> list[list[torch.Tensor]]:
    """Worker: this rank's output and q/k/v gradients for each mask case."""
    backend = ContextParallelAttention(dist.group.WORLD, mode, inner="eager", ring_impl=ring_impl)
    spec = backend.spec
    q, k, v, do, docs = _inputs(*shape)
    B, T = q.shape[0], q.shape[2]
    results = []
    for case in cases:
        leaves = [spec.shard(t, 2).clone().requires_grad_() for t in (q, k, v)]
        pos = positions_from_doc_ids(docs) if case == "docs" else torch.arange(T).expand(B, T)
        mask = _mask(case, spec.shard(pos, 1), spec.shard(docs, 1))
        out = backend(*leaves, mask, 1 / shape[-1] ** 0.5)
        out.backward(spec.shard(do, 2))
        results.append([out.detach(), *[t.grad for t in leaves]])
    return results


@pytest.mark.parametrize(
    ("world", "mode", "shape"),
    [
        (2, "ring", (2, 4, 2, 32, 8)),
        (2, "ulysses", (2, 4, 2, 32, 8)),
        (4, "ring", (1, 4, 1, 32, 8)),  # MQA; 8 chunks of 4 tokens
        (4, "ulysses", (1, 4, 1, 32, 8)),  # the one kv head is repeated to 4 for the all-to-all
    ],
)
def test_exchange_matches_whole_sequence_attention(
    dist_pool: Any, world: int, mode: str, shape: tuple[int, ...]
) -> None:
    cases = ["causal", "docs", "window"]
    per_rank = dist_pool(world).run(_sharded, mode, cases, shape)
    spec = ContextParallelSpec(world, 0, load_balance=mode == "ring")
    for i, case in enumerate(cases):
        expected = _whole(case, shape)
        for j, name in enumerate(("out", "dq", "dk", "dv")):
            got = spec.unshard([r[i][j] for r in per_rank], dim=2)
            assert _rel(got, expected[j]) <= TOL, (case, name)


@pytest.mark.skipif(not triton_available(), reason="needs triton (the kernels run in its interpreter on CPU)")
def test_ring_with_flash_kernel_blocks(dist_pool: Any) -> None:
    """The GPU path: causal and full blocks through the flash-attention custom ops (which return the log-sum-exp),
    here in the Triton interpreter in fp32, against the whole-sequence eager attention."""
    shape = (1, 4, 2, 16, 16)
    per_rank = dist_pool(2).run(_sharded, "ring", ["causal"], shape, "flash")
    expected = _whole("causal", shape)
    spec = ContextParallelSpec(2, 0)
    for j, name in enumerate(("out", "dq", "dk", "dv")):
        assert _rel(spec.unshard([r[0][j] for r in per_rank], dim=2), expected[j]) <= TOL, name
