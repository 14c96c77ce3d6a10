"""KV groups (producers with different windows) and cross-layer KV sharing through the decode-row layout the CUDA
graphs replay (``DecodeGraphs(capture=False)``: the same static buffers and inputs, run eagerly on the CPU): greedy
output equals naive full recompute, batched, past the windows, with prefix hits, multi-step runs and speculative
decoding; and the split of a KV byte budget between the groups (:mod:`~lightning_llmopt.inference.kv_group_sizing`)
against hand-computed counts."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_llmopt.inference import KVScales, LLMEngine, SamplingParams
from lightning_llmopt.inference.config import EngineConfig
from lightning_llmopt.inference.cuda_graphs import DecodeGraphs
from lightning_llmopt.inference.kv_group_sizing import group_pool_sizes, split_blocks
from lightning_llmopt.inference.kv_groups import group_blocks, kv_groups
from lightning_llmopt.inference.speculative import SpeculativeConfig
from lightning_llmopt.models import LlamaConfig, StaticKVCache
from lightning_llmopt.models.layer_pattern import cla_kv_sources, kv_producers
from lightning_llmopt.testing.triton import triton_available, triton_interpreter_enabled

PATTERNS = {
    # two local windows (8 and 5, neither a multiple of the block size) and a global layer: 2 local groups
    "groups": dict(n_layers=3, layer_types=["local:8", "local:5", "global"]),
    # local and global layers, each pair sharing its lower layer's K/V: 1 local group
    "groups_shared": dict(
        n_layers=4, sliding_window=6, layer_types=["local", "local", "global", "global"], kv_sources=[0, 0, 2, 2]
    ),
    # cross-layer KV sharing alone (one pool)
    "cla": dict(n_layers=4, kv_sources=cla_kv_sources(4, 2)),
}
SIZES = (1, 2, 4, 8, 16, 32)


class _Rows(DecodeGraphs):
    """Eager static-buffer steps that count what they served and whether a local table had released entries."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, capture=False, **kw)
        self.steps = self.multi = self.chained = self.released = 0

    def run(self, work):
        self.steps += 1
        self.multi += any(w.num_tokens > 1 for w in work)
        self.released += any(0 in t for w in work for t in getattr(w.seq, "group_tables", []))
        return super().run(work)

    def replay_rows(self, meta, n, ids=None):
        self.chained += 1
        return super().replay_rows(meta, n, ids)


def _engine(model, graphs=True, **kw) -> LLMEngine:
    kw = {"block_size": 4, "num_blocks": 96, "max_num_batched_tokens": 16, "max_num_seqs": 4, **kw}
    engine = LLMEngine(model, **kw)
    for alloc in getattr(engine.blocks, "locals", []):  # local block ids unlike group 0's (they would coincide)
        alloc._free.reverse()
    if graphs:
        width = engine.blocks.blocks_for(engine.max_model_len)
        engine.graphs = _Rows(engine.runner, SIZES, width, engine.max_model_len)
        if engine.spec is not None:
            engine.spec.device_rounds = False  # the host path's verify rows (device rounds: below)
    return engine


def _check(engine, model, reference, prompts, max_tokens):
    outs = engine.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    for p, m, o in zip(prompts, max_tokens, outs, strict=True):
        assert o.token_ids == reference(model, p, m), f"prompt of {len(p)} tokens"
    return outs


def _all_back(engine):
    engine.prefix_cache.clear()
    alloc = engine.blocks.allocator
    assert alloc.num_free == alloc.capacity
    for local in getattr(engine.blocks, "locals", []):
        assert local.num_free == local.capacity


@pytest.mark.parametrize("name", ["groups", "groups_shared"])
def test_row_layout_with_groups_matches_full_recompute(name, model_factory, reference, prompts_factory):
    model = model_factory(seed=5, **PATTERNS[name])
    engine = _engine(model)
    assert engine.graphs.n_local == len(engine.pool.pools) - 1 > 0
    prompts = prompts_factory([3, 11, 20, 29, 9], 320, seed=6)  # more requests than slots: late admissions
    _check(engine, model, reference, prompts, [18, 12, 16, 10, 14])
    assert engine.graphs.steps > 0 and engine.graphs.released > 0, "no row step with released local entries"
    again = [p + [7, 8, 9] for p in prompts[1:4]]  # prefix hits past the windows, then new tokens
    outs = _check(engine, model, reference, again, [12, 9, 15])
    assert sum(o.metrics.cached_tokens for o in outs) > 0
    _all_back(engine)


def test_prepare_rows_with_groups_equals_prepare(model_factory, prompts_factory):
    """The eager row inputs (``ModelRunner.prepare_rows``) give the logits of the packed decode step."""
    model = model_factory(seed=2, **PATTERNS["groups"])
    engine = _engine(model, graphs=False, enable_prefix_caching=False)
    assert engine.blocks.locals[0].free_blocks()[0] != engine.blocks.allocator.free_blocks()[0]
    for p in prompts_factory([13, 22], 320, seed=1):
        engine.add_request(p, SamplingParams(max_tokens=30))
    for _ in range(12):  # prefill, then decodes past the windows
        engine.step()
    sched = engine.scheduler.schedule()
    work = engine.runner.order(sched.work)
    assert all(w.num_tokens == 1 for w in work)
    a = engine.runner.forward(engine.runner.prepare(work))
    b = engine.runner.forward(engine.runner.prepare_rows(work))
    assert any(0 in t for w in work for t in w.seq.group_tables)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["groups", "groups_shared"])
def test_multi_step_runs_with_groups(name, model_factory, reference, prompts_factory):
    model = model_factory(seed=8, **PATTERNS[name])
    engine = _engine(model, decode_steps=5)
    prompts = prompts_factory([4, 17, 26], 320, seed=2)
    _check(engine, model, reference, prompts, [21, 15, 19])
    assert engine.graphs.chained > 0, "no multi-step run"
    _all_back(engine)


def _spec(method, model_factory):
    if method == "draft":
        draft = model_factory(seed=9, n_layers=1, dim=32, n_heads=2)
        return SpeculativeConfig("draft", draft_model=draft, num_tokens=3, adaptive=False)
    if method == "int8":  # the target's own pattern (or sharing) in the drafter's plain pool
        return SpeculativeConfig("self_quantized", quant_bits=8, num_tokens=3, adaptive=False)
    return SpeculativeConfig("prompt_lookup", num_tokens=3, adaptive=False)


@pytest.mark.parametrize("graphs", [True, False], ids=["rows", "eager"])
@pytest.mark.parametrize("method", ["draft", "int8", "prompt_lookup"])
@pytest.mark.parametrize("name", ["groups", "cla"])
def test_speculative_greedy_equals_plain(name, method, graphs, model_factory, reference, prompts_factory):
    model = model_factory(seed=4, **PATTERNS[name])
    engine = _engine(model, graphs=graphs, speculative=_spec(method, model_factory), max_num_batched_tokens=32)
    prompts = []
    for i, p in enumerate(prompts_factory([2, 9, 15, 24], 320, seed=7)):
        prompts.append((p + p[: max(1, len(p) // 3)] * 4)[: len(p) + 3 * i])  # repeats: prompt lookup matches
    _check(engine, model, reference, prompts, [16, 12, 18, 10])
    assert engine.stats.spec_verifications > 0
    if graphs:
        assert engine.graphs.multi > 0, "no verify step took the row layout"
    _all_back(engine)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("name", ["groups", "groups_shared"])
def test_device_rounds_with_groups(name, k, model_factory, reference, prompts_factory, monkeypatch):
    """Device-side speculative rounds (``spec_chain``): the verify rows' local blocks come from each group's
    tables on the device; greedy output equals full recompute over multi-round runs."""
    import lightning_llmopt.inference.spec_chain as chain

    model = model_factory(seed=6, **PATTERNS[name])
    draft = model_factory(seed=9, n_layers=1, dim=32, n_heads=2)
    spec = SpeculativeConfig("draft", draft_model=draft, num_tokens=k, adaptive=False)
    engine = _engine(model, speculative=spec, max_num_batched_tokens=64)
    drafter = engine.spec.drafter
    drafter.graphs = _Rows(drafter.runner, SIZES, drafter.blocks.blocks_for(engine.max_model_len), engine.max_model_len)
    engine.spec.device_rounds = True
    runs: list[int] = []
    real = chain._launch

    def spy(engine_, graph, seqs, k_, rounds, starts):
        runs.append(rounds)
        return real(engine_, graph, seqs, k_, rounds, starts)

    monkeypatch.setattr(chain, "_launch", spy)
    prompts = prompts_factory([2, 9, 15, 24], 320, seed=7)
    _check(engine, model, reference, prompts, [m + 3 * k for m in (16, 12, 18, 10)])
    assert runs and max(runs) > 1, "no multi-round device run"
    _all_back(engine)


# ---------------------------------------------------------------------------------------------- pool sizing
def test_split_blocks_hand_computed():
    # global blocks of 100 bytes, one local group of 40-byte blocks needing min(n, 7)
    local = [lambda n: min(n, 7)]
    # 7 local blocks cost 280; (10_000 - 280) // 100 = 97 global blocks
    assert split_blocks(10_000, [100, 40], local, 10**6) == [97, 7]
    assert split_blocks(10_000, [100, 40], local, 50) == [50, 7]  # the useful bound
    # small budget: the cap binds; n + 0.4 n <= 5.6 -> n = 4 (4*100 + 4*40 = 560)
    assert split_blocks(560, [100, 40], local, 10**6) == [4, 4]
    assert split_blocks(559, [100, 40], local, 10**6) == [3, 3]
    # two local groups
    two = [lambda n: min(n, 5), lambda n: min(n, 9)]
    assert split_blocks(2_000, [64, 16, 32], two, 10**6) == [(2_000 - 5 * 16 - 9 * 32) // 64, 5, 9]
    with pytest.raises(ValueError, match="holds no usable pool"):
        split_blocks(100, [100, 40], local, 10**6)
    with pytest.raises(ValueError, match="block_bytes has 3 groups"):
        split_blocks(100, [1, 2, 3], local, 10)


def test_group_pool_sizes_turn_savings_into_global_blocks():
    # layers 0, 1 local (window 8, then 5), layer 2 global; 2 KV heads of 16 dims, fp32
    cfg = LlamaConfig.from_preset("tiny", n_layers=3, layer_types=["local:8", "local:5", "global"])
    groups = kv_groups(cfg)
    assert [(g.window, g.layers) for g in groups] == [(None, [2]), (5, [1]), (8, [0])]
    config = EngineConfig(block_size=4, max_num_seqs=2, max_num_batched_tokens=16, enable_prefix_caching=True)
    per = 2 * 1 * 2 * 4 * 16 * 4  # k and v, one producer, 2 heads, 4 slots, 16 dims, 4 bytes: 1024
    need5 = 2 * (math.ceil((5 - 1 + 16) / 4) + 1) + 2 * (math.ceil((5 - 1) / 4) + 1) + 1  # 12 + 4 + 1 = 17
    need8 = 2 * (math.ceil((8 - 1 + 16) / 4) + 1) + 2 * (math.ceil((8 - 1) / 4) + 1) + 1  # 14 + 6 + 1 = 21
    assert (need5, need8) == (17, 21)
    budget = 1000 * per
    sizes = group_pool_sizes(groups, cfg, config, torch.float32, 10**6, budget)
    assert sizes == [1000 - 17 - 21, 17, 21]
    # before, every producer counted in a global block: 1000 // 3 = 333 global blocks from the same bytes
    assert sizes[0] > budget // (3 * per)
    assert group_pool_sizes(groups, cfg, config, torch.float32, 500, budget)[0] == 500  # the useful bound
    # the num_blocks override (budget None): group 0 as given, local groups their need capped at it
    assert group_pool_sizes(groups, cfg, config, torch.float32, 80) == [80, 17, 21]
    assert group_pool_sizes(groups, cfg, config, torch.float32, 10) == [10, 10, 10]
    assert group_blocks(5, 4, 2, 16, 10**6, True) == need5


def test_engine_num_blocks_override_with_groups(model_factory):
    model = model_factory(**PATTERNS["groups"])
    engine = LLMEngine(model, block_size=4, num_blocks=40, max_num_seqs=2, max_num_batched_tokens=16)
    assert [p.num_blocks for p in engine.pool.pools] == [40, 17, 21]


# ---------------------------------------------------------------------------------------------- int8 KV
class _FakeQuantCache(StaticKVCache):
    """The reference model's cache rounding every key/value to int8 with the producer's scales and back."""

    def __init__(self, scales, producers, *args) -> None:
        super().__init__(*args)
        self.scales, self.row = scales, {layer: r for r, layer in enumerate(producers)}

    def update(self, layer_id, k, v, positions):
        def qdq(x, s):
            s = s.view(1, -1, 1, 1)
            return torch.round(x / s).clamp(-127, 127) * s

        r = self.row[layer_id]
        return super().update(layer_id, qdq(k, self.scales.k[r]), qdq(v, self.scales.v[r]), positions)


@torch.no_grad()
def _fake_quant_greedy(model, prompt, n, scales):
    cfg = model.config
    producers = kv_producers(cfg)
    cache = _FakeQuantCache(scales, producers, cfg.n_layers, 1, len(prompt) + n, cfg.n_kv_heads, cfg.head_dim)
    tokens = list(prompt)
    for t in range(len(prompt) + n - 1):  # one token at a time, as the engine with a budget of 1
        logits = model(torch.tensor([[tokens[t]]]), positions=torch.tensor([[t]]), kv_cache=cache)
        if t >= len(prompt) - 1:
            tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("graphs", [True, False], ids=["rows", "eager"])
@pytest.mark.parametrize("name", ["groups", "groups_shared", "cla"])
def test_int8_kv_equals_fake_quantized_reference(name, graphs, model_factory, prompts_factory):
    """int8 KV with KV groups and with cross-layer KV sharing: calibrated per-producer scales, and with a one-token
    budget every step reads all its keys from the int8 pools, so greedy tokens equal the fake-quantized model's."""
    model = model_factory(seed=1, **PATTERNS[name])
    engine = _engine(model, graphs=graphs, kv_dtype="int8", max_num_batched_tokens=1)
    scales = engine.calibrate_kv(prompts_factory([40, 25, 33], 320, seed=2))
    assert scales.k.shape[0] == len(kv_producers(model.config))  # one row per cached layer
    pools = getattr(engine.pool, "pools", [engine.pool])
    assert all(p.data.dtype == torch.int8 for p in pools)
    prompts = prompts_factory([3, 12, 20], 320, seed=3)
    outs = engine.generate(prompts, SamplingParams(max_tokens=10))
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == _fake_quant_greedy(model, p, 10, scales)
    _all_back(engine)


def test_grouped_int8_scales_follow_producers(model_factory):
    model = model_factory(**PATTERNS["groups"])
    engine = LLMEngine(model, block_size=4, num_blocks=32, kv_dtype="int8")
    with pytest.raises(RuntimeError, match="no calibrated scales"):
        engine.generate([[1, 2, 3]])
    scales = KVScales(torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), torch.ones(3, 2))
    engine.pool.set_scales(scales)
    for slot in range(3):  # producer slot i is layer i here, in group 0 (global), 2 (window 8) or 1 (window 5)
        assert engine.pool.layer_scales(slot)[0].tolist() == scales.k[slot].tolist()
    with pytest.raises(ValueError, match=r"scales are \(2, 2\), the pool needs \(3, 2\)"):
        engine.pool.set_scales(KVScales(torch.ones(2, 2), torch.ones(2, 2)))


# ---------------------------------------------------------------------------------------------- fused path
@pytest.mark.skipif(
    not triton_available() or not (torch.cuda.is_available() or triton_interpreter_enabled()),
    reason="needs triton (and TRITON_INTERPRET=1 without CUDA)",
)
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
@pytest.mark.parametrize(("name", "graphs"), [("groups", True), ("groups_shared", False), ("cla", True)])
def test_fused_kernels_with_groups_and_shared_kv(name, graphs, model_factory, reference, prompts_factory):
    """The fused decode path (Triton norm/RoPE-store/SiLU kernels and GEMVs; interpreter on CPU): each producer
    stores into its group's pool at its group's blocks, a reader rotates its queries only and attends over its
    source's keys; greedy equals full recompute (eagerly or through the graph row layout with multi-step runs),
    then at batch 1 with every product through the fused GEMVs."""
    model = model_factory(seed=6, dim=32, n_heads=2, **PATTERNS[name])
    prompts = prompts_factory([1, 12], 320, seed=10)
    engine = _engine(model, graphs=graphs, attention_backend="triton", fused_kernels=True, decode_steps=3)
    assert engine.runner.fused
    _check(engine, model, reference, prompts, [9, 9])
    engine.runner.linear.force = True  # batch 1: norm + q(/k/v) and norm + gate/up each one launch
    _check(engine, model, reference, [prompts[1] + [3]], [6])
    assert engine.runner.linear.fused_calls > 0
    if graphs:
        assert engine.graphs.steps > 0 and engine.graphs.chained > 0
    _all_back(engine)
