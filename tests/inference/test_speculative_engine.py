"""Speculative decoding inside the engine: greedy output is token-identical with and without speculation, for every
drafter, on mixed-length batches (fp32 CPU), and no KV block (target or draft) leaks.

The oracle is naive full recompute with the reference model (``greedy_generate(..., use_cache=False)``), which the
engine without speculation already matches (test_engine_greedy.py). Prompts repeat a random motif so prompt lookup
finds matches; the draft models (a smaller random model, the target's int8 and int4 copies, the target itself)
range from rarely to always agreeing with the target, so acceptance, partial rejection and the bonus token all
occur.
"""

from __future__ import annotations

import pytest
import torch

from lightning_llmopt.inference import LLMEngine, SamplingParams
from lightning_llmopt.inference.speculative import SpeculativeConfig

LENGTHS = [1, 5, 12, 17, 30]
MAX_TOKENS = [14, 3, 20, 9, 17]


def _prompts(prompts_factory, seed):
    out = []
    for i, p in enumerate(prompts_factory(LENGTHS, 320, seed=seed)):
        motif = p[: max(1, len(p) // 3)]
        out.append((p + motif * 3)[: len(p) + 2 * i])  # repeated content: n-gram matches exist
    return out


def _all_blocks_back(engine):
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()
    alloc = engine.blocks.allocator
    assert alloc.num_free == alloc.capacity
    assert all(rc == 0 for rc in alloc.refcount)
    drafter = engine.spec.drafter
    if hasattr(drafter, "blocks"):
        assert drafter.blocks.allocator.num_free == drafter.blocks.allocator.capacity
        assert not drafter.state


def _spec(method, model_factory, target, **kw):
    if method == "draft":
        return SpeculativeConfig("draft", draft_model=model_factory(seed=9, n_layers=1, dim=32, n_heads=2), **kw)
    if method == "self_draft":  # the target drafting for itself: every draft is accepted (bonus token path)
        return SpeculativeConfig("draft", draft_model=target, **kw)
    if method == "int4":
        return SpeculativeConfig("self_quantized", quant_bits=4, quant_group_size=32, **kw)
    if method == "int8":
        return SpeculativeConfig("self_quantized", quant_bits=8, **kw)
    return SpeculativeConfig("prompt_lookup", **kw)


@pytest.mark.parametrize("method", ["draft", "self_draft", "int8", "int4", "prompt_lookup"])
def test_greedy_identical_with_speculation(method, model_factory, reference, prompts_factory):
    model = model_factory(seed=1)
    prompts = _prompts(prompts_factory, seed=3)
    spec = _spec(method, model_factory, model, num_tokens=4, adaptive=False)
    engine = LLMEngine(model, block_size=4, num_blocks=96, max_num_batched_tokens=64, speculative=spec)
    params = [SamplingParams(max_tokens=m) for m in MAX_TOKENS]
    outs = engine.generate(prompts, params)
    for p, m, o in zip(prompts, MAX_TOKENS, outs, strict=True):
        assert o.outputs[0].finish_reason == "length"
        assert o.token_ids == reference(model, p, m), f"prompt of {len(p)} tokens"
    st = engine.stats
    assert st.spec_draft_tokens > 0 and st.spec_verifications > 0
    if method == "self_draft":
        assert st.acceptance_rate == 1.0
    assert st.tokens_per_step >= 1.0
    _all_blocks_back(engine)


@pytest.mark.parametrize("method", ["draft", "prompt_lookup"])
def test_preemption_prefix_cache_and_stops(method, model_factory, reference, prompts_factory):
    """A pool too small for all sequences (preemption by recompute, with the prefix cache), adaptive length, and
    stop tokens inside accepted drafts: outputs still equal the oracle cut at the stop token; nothing leaks."""
    model = model_factory(seed=2)
    shared = prompts_factory([9], 320, seed=4)[0]
    prompts = [shared + p for p in _prompts(prompts_factory, seed=5)]
    spec = _spec(method, model_factory, model, num_tokens=3, adaptive=True, draft_cost=0.0)
    engine = LLMEngine(model, block_size=4, num_blocks=26, max_num_batched_tokens=48, max_num_seqs=5, speculative=spec)
    refs = [reference(model, p, 24) for p in prompts]
    stop = refs[2][5]  # a token the third sequence produces mid-way
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, stop_token_ids=(stop,)))
    for r, o in zip(refs, outs, strict=True):
        expect = r[: r.index(stop)] if stop in r else r
        assert o.token_ids == expect
        assert o.outputs[0].finish_reason == ("stop" if stop in r else "length")
    assert engine.stats.preemptions > 0
    _all_blocks_back(engine)


def test_cancel_releases_draft_blocks(model_factory, prompts_factory):
    model = model_factory(seed=3)
    spec = _spec("int8", model_factory, model, num_tokens=2, adaptive=False)
    engine = LLMEngine(model, block_size=4, num_blocks=64, speculative=spec)
    ids = [engine.add_request(p, SamplingParams(max_tokens=30)) for p in prompts_factory([6, 11, 3], 320, seed=6)]
    for _ in range(4):
        engine.step()
    assert engine.spec.drafter.state  # drafting is under way
    for rid in ids:
        engine.cancel(rid)
    _all_blocks_back(engine)


def test_sampling_with_speculation_is_exact(model_factory):
    """End to end through the engine (temperature 1, int4 self-drafter, partial acceptance): the second generated
    token's marginal over 3,000 requests matches the target's exact marginal sum_t1 p(t1) p(t2 | t1) (chi-square,
    p > 0.01). The first token comes from the prompt's prefill; the second from a speculative step."""
    from scipy import stats

    model = model_factory(seed=4, init_std=0.05)
    prompt = [5, 17, 99, 3]
    V = model.config.vocab_size
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt]))[0, -1].double(), -1)
        seqs = torch.cat([torch.tensor(prompt).expand(V, -1), torch.arange(V)[:, None]], 1)
        p2 = torch.softmax(model(seqs)[:, -1].double(), -1)  # (t1, t2)
    marginal = (p1[:, None] * p2).sum(0)
    spec = _spec("int4", model_factory, model, num_tokens=3, adaptive=False)
    engine = LLMEngine(model, block_size=4, num_blocks=2000, max_num_seqs=256, seed=1, speculative=spec)
    n = 3000
    outs = engine.generate([prompt] * n, SamplingParams(max_tokens=4, temperature=1.0))
    assert 0 < engine.stats.acceptance_rate < 1
    second = torch.bincount(torch.tensor([o.token_ids[1] for o in outs]), minlength=V).double()
    expected = marginal * n
    order = torch.argsort(expected, descending=True)  # pool the tail into one bin with expected count >= 5
    keep = order[expected[order] >= 5]
    rest = order[expected[order] < 5]
    obs = torch.cat([second[keep], second[rest].sum()[None]])
    exp = torch.cat([expected[keep], expected[rest].sum()[None]])
    pval = stats.chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue
    assert pval > 0.01, pval


def test_idle_steps_still_release_finished_sequences(model_factory, prompts_factory):
    """With speculation ruled out by cost (draft_cost 50), steps draft nothing except the periodic probes, and the
    engine skips releasing drafter state on steps where no sequence finished; every sequence that finishes on such a
    step is still released, so no draft block leaks. Output stays token-identical to plain decoding."""
    model = model_factory(seed=4)
    spec = _spec("draft", model_factory, model, num_tokens=3, draft_cost=50.0, probe_every=2)
    engine = LLMEngine(model, block_size=4, num_blocks=128, speculative=spec)
    plain = LLMEngine(model, block_size=4, num_blocks=128)
    prompts = prompts_factory([6, 11, 3, 9], 320, seed=8)
    params = [SamplingParams(max_tokens=n) for n in (5, 17, 9, 12)]  # finishing on different steps
    outs = [o.token_ids for o in engine.generate(prompts, params)]
    assert outs == [o.token_ids for o in plain.generate(prompts, params)]
    assert engine.stats.spec_draft_tokens > 0  # the probes drafted
    _all_blocks_back(engine)
