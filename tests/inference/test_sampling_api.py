"""Sampling parameters, the sampler, parallel sampling (copy-on-write forks), stop tokens, streaming, cancellation."""

from __future__ import annotations

import pytest
import torch

from lightning_llmopt.inference import LLMEngine, SamplingParams, sample
from lightning_llmopt.inference.sampling import _filter


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=2.5), "max_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-3), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.2), "top_p"),
        (dict(seed=-1), "seed"),
        (dict(stop_token_ids=(1, -2)), "stop_token_ids"),
        (dict(n=0), "n \\(0\\)"),
        (dict(n=3), "needs temperature > 0"),
    ],
)
def test_invalid_params_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_filter_top_k_top_p():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    assert torch.isfinite(_filter(logits, 2, 1.0)).tolist() == [True, True, False, False]
    # top-p 0.7: 0.5 < 0.7, then 0.75 >= 0.7 -> keep the two most likely
    assert torch.isfinite(_filter(logits, None, 0.7)).tolist() == [True, True, False, False]
    assert torch.isfinite(_filter(logits, None, 0.5)).tolist() == [True, False, False, False]
    assert torch.isfinite(_filter(logits, None, 0.01)).tolist() == [True, False, False, False]  # argmax survives


def test_sampler_statistics_and_seeds():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]])).repeat(4000, 1)
    params = [SamplingParams(temperature=1.0)] * 4000
    g = torch.Generator().manual_seed(0)
    draws = torch.tensor(sample(logits, params, [g] * 4000))
    freq = torch.bincount(draws, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.03)  # 4000 draws: 3 sigma ~ 0.023
    greedy = sample(logits[:2], [SamplingParams(), SamplingParams(temperature=0.5, top_k=1)], [None, g])
    assert greedy == [0, 0]


def test_seeded_requests_do_not_depend_on_the_batch(model_factory, prompts_factory):
    model = model_factory()
    prompts = prompts_factory([5, 9, 13], 320, seed=1)
    p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    alone = LLMEngine(model, num_blocks=64, block_size=8).generate([prompts[1]], p)[0].token_ids
    other = SamplingParams(max_tokens=6, temperature=1.2)
    together = LLMEngine(model, num_blocks=64, block_size=8).generate(prompts, [other, p, other])[1].token_ids
    assert alone == together


def test_parallel_sampling_forks_share_the_prompt(model_factory, prompts_factory):
    model = model_factory()
    prompt = prompts_factory([13], 320, seed=2)[0]  # 13 tokens, block 8: the second block is shared partially
    engine = LLMEngine(model, num_blocks=64, block_size=8, enable_prefix_caching=False)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=4))
    engine.step()  # the prompt, then four first tokens from one set of logits
    seqs = engine._requests[rid].seqs
    assert len(seqs) == 4
    shared = seqs[0].block_table
    assert all(s.block_table == shared for s in seqs)
    assert engine.blocks.allocator.refcount[shared[1]] == 4
    engine.step()  # every sequence writes its next key into block 1: copy-on-write gives each its own
    assert len({s.block_table[1] for s in seqs}) == 4 and len({s.block_table[0] for s in seqs}) == 1
    while engine.has_unfinished():
        engine.step()
    out = engine.result(rid)
    assert [o.index for o in out.outputs] == [0, 1, 2, 3] and len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert engine.blocks.allocator.num_free == engine.blocks.allocator.capacity


def test_stop_tokens_and_streaming(model_factory, reference, prompts_factory):
    model = model_factory()
    prompts = prompts_factory([6, 11], 320, seed=4)
    expected = [reference(model, p, 16) for p in prompts]
    stop = expected[0][5]
    engine = LLMEngine(model, num_blocks=64, block_size=8)
    params = SamplingParams(max_tokens=16, stop_token_ids=(stop,))
    outs = engine.generate(prompts, params)
    first_stop = expected[0].index(stop)
    assert outs[0].token_ids == expected[0][:first_stop] and outs[0].outputs[0].finish_reason == "stop"
    streamed: dict[str, list[int]] = {}
    reasons = {}
    for event in engine.stream(prompts, params):
        streamed.setdefault(event.request_id, []).extend(event.token_ids)
        if event.finished:
            reasons[event.request_id] = event.finish_reason
    assert sorted(streamed.values()) == sorted(o.token_ids for o in outs)
    assert sorted(reasons.values()) == sorted(o.outputs[0].finish_reason for o in outs)


def test_cancel_mid_stream_returns_blocks(model_factory, prompts_factory):
    model = model_factory()
    engine = LLMEngine(model, num_blocks=64, block_size=8, enable_prefix_caching=False)
    prompts = prompts_factory([20, 30], 320, seed=5)
    for i, _event in enumerate(engine.stream(prompts, SamplingParams(max_tokens=30))):
        if i == 3:
            break  # leaving the iterator cancels what is left
    assert not engine.has_unfinished()
    assert engine.blocks.allocator.num_free == engine.blocks.allocator.capacity
    rid = engine.add_request(prompts[0], SamplingParams(max_tokens=30))
    engine.step()
    assert engine.cancel(rid) and not engine.cancel(rid)
    assert engine.result(rid).outputs[0].finish_reason == "cancelled"
    assert engine.blocks.allocator.num_free == engine.blocks.allocator.capacity


def test_string_prompts_need_a_tokenizer(model_factory):
    from lightning_llmopt.data.tokenizers import ByteTokenizer

    model = model_factory()
    with pytest.raises(ValueError, match="needs a tokenizer"):
        LLMEngine(model, num_blocks=16).generate(["hi"])
    engine = LLMEngine(model, ByteTokenizer(), num_blocks=32, block_size=8)
    out = engine.generate("hello", SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert out.prompt_token_ids == list(b"hello") and isinstance(out.text, str) and len(out.token_ids) == 5


def test_pinned_prefix_survives_eviction(model_factory, prompts_factory):
    model = model_factory()
    engine = LLMEngine(model, num_blocks=12, block_size=4)
    system = engine.pin_prefix(prompts_factory([10], 320, seed=6)[0])
    for p in prompts_factory([12, 9, 14, 11], 320, seed=7):  # unrelated traffic fills and cycles the pool
        engine.generate([p], SamplingParams(max_tokens=4))
    assert engine.prefix_cache is not None and engine.prefix_cache.num_evicted > 0
    out = engine.generate([system + [5, 6]], SamplingParams(max_tokens=2))[0]
    assert out.metrics.cached_tokens == len(system)
    engine.unpin_prefix(system)
    engine.prefix_cache.clear()
    assert engine.blocks.allocator.num_free == engine.blocks.allocator.capacity
