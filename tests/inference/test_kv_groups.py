"""KV groups: a model mixing local and global producers gets a pool per window, local layers keep only their
window (allocation and free-block counts checked against the formula every step), and greedy output stays
token-identical to full recompute through preemption, prefix-cache hits and blocks released mid-sequence."""

from __future__ import annotations

import math

import pytest

from lightning_llmopt.inference import LLMEngine, SamplingParams
from lightning_llmopt.inference.kv_groups import GroupedBlockManager, GroupedPool, group_blocks, kv_groups
from lightning_llmopt.models import LlamaConfig

# Gemma-3-like: two local windows and a global layer; layer 3 shares layer 2's K/V (both global)
PATTERN = dict(
    n_layers=4, sliding_window=5, layer_types=["local", "local:3", "global", "global"], kv_sources=[0, 1, 2, 2]
)


def test_groups_and_pool_sizes(model_factory):
    cfg = LlamaConfig.from_preset("tiny", **PATTERN)
    groups = kv_groups(cfg)
    assert [(g.window, g.layers) for g in groups] == [(None, [2]), (3, [1]), (5, [0])]
    model = model_factory(**PATTERN)
    bs, seqs, budget = 4, 3, 12
    engine = LLMEngine(
        model,
        block_size=bs,
        num_blocks=80,
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        enable_prefix_caching=False,
    )
    pool = engine.pool
    assert isinstance(pool, GroupedPool) and pool.n_layers == 3
    expect = [80] + [seqs * (math.ceil((w - 1 + budget) / bs) + 1) + 1 for w in (3, 5)]  # the documented formula
    assert [p.num_blocks for p in pool.pools] == expect == [80, 16, 16]
    assert [p.data.shape[0] for p in pool.pools] == [1, 1, 1]  # one producer per group; layer 3 has no cache
    per_block = 2 * 2 * bs * 16 * 4  # k and v, 2 kv heads, block of 4, head_dim 16, fp32
    assert pool.nbytes == per_block * sum(expect)
    assert group_blocks(1024, 16, 8, 2048, cap=10**6) == 8 * (math.ceil((1023 + 2048) / 16) + 1) + 1


def _run_checked(engine, prompts, params):
    """Step the engine, checking after every step each running sequence's local tables against their bound."""
    bs = engine.blocks.block_size
    budget = engine.config.max_num_batched_tokens
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    blocks: GroupedBlockManager = engine.blocks
    seen_release = False
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            for w, table in zip(blocks.windows, seq.group_tables, strict=True):
                live = [b for b in table if b != 0]
                assert len(live) <= math.ceil((w - 1 + budget) / bs) + 1, (w, table)
                seen_release |= len(live) < len(seq.block_table)
        for g in range(len(blocks.windows)):  # the allocator's own count agrees with the tables and the cache
            held = {b for s in engine.scheduler.running for b in s.group_tables[g] if b}
            cached = set(blocks.cache_held[g].values())  # companions the prefix cache keeps
            assert blocks.num_local_held(g) == len(held | cached)
    assert seen_release  # sequences outgrew the windows: local blocks were actually released
    return [engine.result(r) for r in ids]


def _all_back(engine):
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()
    blocks = engine.blocks
    assert blocks.allocator.num_free == blocks.allocator.capacity
    assert all(a.num_free == a.capacity for a in blocks.locals)
    assert all(not c for c in blocks.companion) and all(not o for o in blocks.owner)
    assert all(not h for h in blocks.cache_held)


@pytest.mark.parametrize("prefix", [False, True])
def test_windows_released_per_group_and_exact(prefix, model_factory, reference, prompts_factory):
    model = model_factory(seed=11, **PATTERN)
    prompts = prompts_factory([2, 13, 25, 9], 320, seed=12)
    engine = LLMEngine(
        model, block_size=4, num_blocks=80, max_num_seqs=3, max_num_batched_tokens=12, enable_prefix_caching=prefix
    )
    outs = _run_checked(engine, prompts, [SamplingParams(max_tokens=16)] * 4)
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == reference(model, p, 16)
    if prefix:  # the conversations go on (multi-turn): hits reach far past the local windows
        again = [p + o.token_ids + [7, 7] for p, o in zip(prompts, outs, strict=True)]
        outs2 = _run_checked(engine, again, [SamplingParams(max_tokens=8)] * 4)
        for p, o in zip(again, outs2, strict=True):
            assert o.token_ids == reference(model, p, 8)
        # hits reach far past the windows (a hit is cut where a local window lacks its keys: the cache keeps the
        # local companions of its blocks while the local pool has room, oldest dropped first)
        cached = [o.metrics.cached_tokens for o in outs2]
        assert sum(c > 5 for c in cached) >= 2, cached
    _all_back(engine)


def test_preemption_with_groups(model_factory, reference, prompts_factory):
    model = model_factory(seed=13, **PATTERN)
    prompts = prompts_factory([9, 14, 20, 5, 11], 320, seed=14)
    engine = LLMEngine(
        model, block_size=4, num_blocks=20, max_num_seqs=5, max_num_batched_tokens=16, enable_prefix_caching=False
    )
    outs = engine.generate(prompts, SamplingParams(max_tokens=20))
    assert engine.stats.preemptions > 0
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == reference(model, p, 20)
    _all_back(engine)


def test_hit_is_cut_where_local_keys_are_gone(model_factory):
    """A cached prefix whose local companions were dropped is only used up to where every window is whole."""
    blocks = GroupedBlockManager(num_blocks=16, block_size=4, windows=[3], local_blocks=[8])

    class _Seq:
        def __init__(self):
            self.block_table, self.num_computed = [], 0

    seq = _Seq()
    blocks.ensure(seq, 12)  # 3 blocks in each group
    primary, local = list(seq.block_table), list(seq.group_tables[0])
    for b in primary:
        blocks.allocator.incref(b)  # a second holder (as a cache hit takes)
    blocks.release_local(0, local[2])  # the last block's local keys are gone (held by the first sequence only)
    seq.group_tables[0][2] = 0
    assert primary[2] not in blocks.companion[0]  # freed local blocks are no block's companion any more
    other = _Seq()
    blocks.adopt(other, primary)
    assert other.group_tables == [[local[0], local[1], 0]]
    assert blocks.usable_hit(other, 11) == 8  # position 11 needs 9..10 (block 2): cut to two blocks
    assert other.block_table == primary[:2]
    assert blocks.usable_hit(other, 8) == 8  # position 8 needs 6..7, in block 1: whole
