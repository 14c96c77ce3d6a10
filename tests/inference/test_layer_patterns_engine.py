"""The engine with layer patterns (interleaved local/global windows) and cross-layer KV sharing: greedy output is
token-identical to full recompute through the unmodified model, batched, with the prefix cache, past the windows;
the pool holds keys/values of the producing layers only."""

from __future__ import annotations

import math

import pytest

from lightning_llmopt.inference import LLMEngine, SamplingParams
from lightning_llmopt.models.layer_pattern import cla_kv_sources, kv_producers

PATTERNS = {
    # Gemma-3-like 2 local : 1 global, local windows of their own
    "pattern": dict(n_layers=3, sliding_window=5, layer_types=["local", "local:3", "global"]),
    # CLA-2 over 4 layers
    "cla": dict(n_layers=4, kv_sources=cla_kv_sources(4, 2)),
    # both: layers 0-1 local (window 4) sharing layer 0's K/V, layers 2-3 global sharing layer 2's
    "both": dict(
        n_layers=4, sliding_window=4, layer_types=["local", "local", "global", "global"], kv_sources=[0, 0, 2, 2]
    ),
    # all local with two windows: blocks are released past the widest (Mistral-like with mixed windows)
    "all_local": dict(n_layers=3, sliding_window=6, layer_types=["local", "local:3", "local"], kv_sources=[0, 1, 0]),
}


def _check(engine, model, prompts, reference, n):
    outs = engine.generate(prompts, [SamplingParams(max_tokens=n)] * len(prompts))
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == reference(model, p, n), f"prompt of {len(p)} tokens"
    return outs


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_greedy_matches_full_recompute(name, model_factory, reference, prompts_factory):
    model = model_factory(seed=3, **PATTERNS[name])
    prompts = prompts_factory([1, 7, 17, 26], 320, seed=4)
    engine = LLMEngine(model, block_size=4, num_blocks=96, max_num_batched_tokens=12, max_num_seqs=3)
    assert engine.pool.n_layers == len(kv_producers(model.config))
    _check(engine, model, prompts, reference, 14)
    # the prefix cache: the same prompts again hit every block computed above, then diverge
    again = [p + [5, 6] for p in prompts[1:]]
    outs = _check(engine, model, again, reference, 6)
    assert sum(o.metrics.cached_tokens for o in outs) > 0
    engine.prefix_cache.clear()
    assert engine.blocks.allocator.num_free == engine.blocks.allocator.capacity


def test_pool_holds_producers_only(model_factory):
    model = model_factory(n_layers=6, kv_sources=cla_kv_sources(6, 3))
    engine = LLMEngine(model, block_size=4, num_blocks=10)
    cfg = model.config
    assert engine.pool.data.shape == (2, 2, 10, cfg.n_kv_heads, 4, cfg.head_dim)  # 2 producers of 6 layers
    assert engine.pool.nbytes == 2 * 2 * 10 * cfg.n_kv_heads * 4 * cfg.head_dim * 4  # fp32


def test_all_local_releases_past_widest_window(model_factory, reference, prompts_factory):
    bs = 4
    model = model_factory(seed=7, **PATTERNS["all_local"])
    prompts = prompts_factory([3, 21, 30], 320, seed=5)
    engine = LLMEngine(model, block_size=bs, num_blocks=64, max_num_batched_tokens=8, enable_prefix_caching=False)
    ids = [engine.add_request(p, SamplingParams(max_tokens=20)) for p in prompts]
    chunk = 8
    limit = math.ceil((6 - 1 + chunk) / bs) + 1  # the widest window plus the chunk being written, unaligned
    assert [g.window for g in engine.pool.groups] == [6, 3]  # the window-3 layer has a group of its own
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            assert len([b for b in seq.block_table if b != 0]) <= limit
            assert len([b for b in seq.group_tables[0] if b != 0]) <= math.ceil((3 - 1 + chunk) / bs) + 1
    for rid, p in zip(ids, prompts, strict=True):
        assert engine.result(rid).token_ids == reference(model, p, 20)
