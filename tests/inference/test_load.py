"""Load test: 1,000 random requests (random lengths, sampling settings, shared prefixes) with random cancellations,
bad requests mixed in, and a pool small enough to preempt; every block must come back to the pool."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_llmopt.inference import LLMEngine, SamplingParams
from lightning_llmopt.models import Llama, LlamaConfig


def test_thousand_requests_with_cancellations():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_preset("tiny", n_layers=1, dim=32, n_heads=2, n_kv_heads=1, max_seq_len=64)).eval()
    engine = LLMEngine(model, block_size=4, num_blocks=60, max_num_batched_tokens=48, max_num_seqs=16, max_model_len=64)
    rng = random.Random(0)
    systems = [[rng.randrange(320) for _ in range(n)] for n in (3, 6, 11)]
    total, added, rejected, cancelled = 1000, 0, 0, 0
    live: list[str] = []
    finished: dict[str, str] = {}
    while added < total or engine.has_unfinished():
        for _ in range(min(rng.randint(0, 6), total - added)):
            added += 1
            prompt = [rng.randrange(320) for _ in range(rng.randint(1, 20))]
            if rng.random() < 0.4:
                prompt = rng.choice(systems) + prompt
            if rng.random() < 0.03:
                prompt = []  # bad input: rejected without touching the others
            temperature = rng.choice([0.0, 0.0, 0.7, 1.3])
            try:
                params = SamplingParams(
                    max_tokens=rng.randint(1, 14),
                    temperature=temperature,
                    top_k=rng.choice([None, 5]),
                    top_p=rng.choice([1.0, 0.8]),
                    seed=rng.choice([None, rng.randrange(100)]),
                    n=rng.choice([1, 1, 1, 2]) if temperature > 0 else 1,
                    stop_token_ids=(rng.randrange(320),),
                )
                live.append(engine.add_request(prompt, params))
            except ValueError:
                rejected += 1
        for event in engine.step():
            if event.finished:
                finished[f"{event.request_id}.{event.index}"] = event.finish_reason or ""
        if live and rng.random() < 0.3:
            victim = live.pop(rng.randrange(len(live)))
            cancelled += engine.cancel(victim)
        live = [r for r in live if not engine._requests[r].finished]
    assert added == total and rejected > 0 and cancelled > 50
    assert engine.stats.preemptions > 0  # the small pool really was contended
    assert set(finished.values()) <= {"stop", "length"}
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.prefix_cache is not None and len(engine.prefix_cache) > 0
    engine.prefix_cache.clear()
    alloc = engine.blocks.allocator
    assert alloc.num_free == alloc.capacity, f"{alloc.capacity - alloc.num_free} blocks leaked"
    assert all(rc == 0 for rc in alloc.refcount)


@pytest.mark.parametrize("bad", ["empty", "too_long", "vocab", "params"])
def test_bad_input_does_not_disturb_running_requests(bad):
    """A bad request raises a clear error; a request already in flight finishes with its exact greedy output."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_preset("tiny", max_seq_len=64)).eval()
    engine = LLMEngine(model, block_size=8, num_blocks=32)
    good = list(range(10))
    rid = engine.add_request(good, SamplingParams(max_tokens=8))
    engine.step()
    messages = {
        "empty": "empty prompt",
        "too_long": "exceeds max_model_len",
        "vocab": "outside the vocabulary",
        "params": "top_p",
    }
    with pytest.raises(ValueError, match=messages[bad]):
        if bad == "empty":
            engine.add_request([], SamplingParams())
        elif bad == "too_long":
            engine.add_request(list(range(60)), SamplingParams(max_tokens=8))
        elif bad == "vocab":
            engine.add_request([1, 2, 999], SamplingParams())
        else:
            engine.add_request([1, 2], SamplingParams(top_p=1.5))
    with pytest.raises(ValueError, match="prompt 1: empty prompt"):  # generate validates every prompt first
        engine.generate([[1, 2], []])
    assert len(engine.scheduler.waiting) + len(engine.scheduler.running) == 1
    while engine.has_unfinished():
        engine.step()
    out = engine.result(rid)
    clean = LLMEngine(model, block_size=8, num_blocks=32).generate([good], SamplingParams(max_tokens=8))[0]
    assert out.token_ids == clean.token_ids and len(out.token_ids) == 8


def test_truncation_on_request():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_preset("tiny", max_seq_len=32)).eval()
    engine = LLMEngine(model, block_size=8, num_blocks=16)
    prompt = list(range(40))
    out = engine.generate([prompt], SamplingParams(max_tokens=4), truncate=True)[0]
    assert out.prompt_token_ids == prompt[-28:] and len(out.token_ids) == 4
    with pytest.raises(ValueError, match="truncate=True"):
        engine.generate([prompt], SamplingParams(max_tokens=4))
