"""Greedy decoding through the engine is token-identical to naive full recompute with the reference model (fp32 CPU).

Every case runs a mixed-length batch through the engine under a different stress (chunked prefill, preemption,
prefix-cache hits, sliding window, the Triton kernels in the interpreter) and compares each output with
``greedy_generate(..., use_cache=False)``, which re-runs the whole sequence through the unmodified model each step.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_llmopt.inference import EngineConfig, LLMEngine, SamplingParams
from lightning_llmopt.testing.triton import triton_available, triton_interpreter_enabled

LENGTHS = [1, 2, 7, 16, 17, 33, 50]


def _run(engine, model, prompts, reference, max_tokens):
    params = [SamplingParams(max_tokens=m) for m in max_tokens]
    outs = engine.generate(prompts, params)
    for p, m, o in zip(prompts, max_tokens, outs, strict=True):
        assert o.outputs[0].finish_reason == "length"
        assert o.token_ids == reference(model, p, m), f"prompt of {len(p)} tokens"
    return outs


def _all_blocks_back(engine):
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()
    alloc = engine.blocks.allocator
    assert alloc.num_free == alloc.capacity
    assert all(rc == 0 for rc in alloc.refcount)


def test_mixed_lengths(model_factory, reference, prompts_factory):
    model = model_factory()
    prompts = prompts_factory(LENGTHS, 320, seed=1)
    engine = LLMEngine(model, block_size=8, num_blocks=128, max_num_batched_tokens=256)
    _run(engine, model, prompts, reference, [20, 3, 11, 20, 1, 9, 14])
    _all_blocks_back(engine)


def test_chunked_prefill_and_small_budget(model_factory, reference, prompts_factory):
    """A 7-token budget: prompts are computed in chunks, interleaved with other sequences' decodes."""
    model = model_factory(seed=1, n_kv_heads=4)  # MHA
    prompts = prompts_factory(LENGTHS, 320, seed=2)
    engine = LLMEngine(model, block_size=4, num_blocks=256, max_num_batched_tokens=7, max_num_seqs=3)
    _run(engine, model, prompts, reference, [12] * len(prompts))
    assert engine.stats.steps > sum(LENGTHS) / 7  # really chunked
    _all_blocks_back(engine)


def test_preemption_by_recompute(model_factory, reference, prompts_factory):
    """A pool too small for every sequence at once: the lowest-priority sequences are preempted and recomputed."""
    model = model_factory(seed=2)
    prompts = prompts_factory([9, 14, 20, 5, 11, 17], 320, seed=3)
    engine = LLMEngine(
        model, block_size=4, num_blocks=22, max_num_batched_tokens=64, max_num_seqs=6, enable_prefix_caching=False
    )
    _run(engine, model, prompts, reference, [24] * len(prompts))
    assert engine.stats.preemptions > 0
    _all_blocks_back(engine)


def test_admission_batch_groups_prefills(model_factory, reference, prompts_factory):
    """``admission_batch=3`` with 4 slots and 9 requests: while sequences run, waiting ones are admitted only once
    3 slots are free (or all that wait fit), so fewer steps carry a prefill than with ``admission_batch=1``; output
    stays token-identical and every block comes back."""
    model = model_factory(seed=5)
    prompts = prompts_factory([9, 3, 14, 6, 11, 2, 17, 5, 8], 320, seed=6)
    max_tokens = [3, 17, 6, 12, 2, 9, 4, 15, 7]
    prefill_steps = {}
    for group in (1, 3):
        engine = LLMEngine(model, block_size=4, num_blocks=128, max_num_seqs=4, admission_batch=group)
        seen = []
        schedule = engine.scheduler.schedule

        def spy(schedule=schedule, seen=seen):
            out = schedule()  # a step with prefill work: a prompt chunk, or the only token of a 1-token prompt
            seen.append(any(w.num_tokens > 1 or w.seq.num_output == 0 for w in out.work))
            return out

        engine.scheduler.schedule = spy
        _run(engine, model, prompts, reference, max_tokens)
        prefill_steps[group] = sum(seen)
        _all_blocks_back(engine)
    assert prefill_steps[3] < prefill_steps[1], prefill_steps
    with pytest.raises(ValueError, match=r"admission_batch \(5\) must be <= max_num_seqs \(4\)"):
        LLMEngine(model, block_size=4, num_blocks=16, max_num_seqs=4, admission_batch=5)
    # the default follows max_num_seqs (min(8, max_num_seqs)), also when an override changes it
    assert EngineConfig().admission == 8 and EngineConfig(max_num_seqs=3).admission == 3
    assert EngineConfig(admission_batch=2).admission == 2
    engine = LLMEngine(model, config=EngineConfig(max_num_seqs=64), block_size=4, num_blocks=16, max_num_seqs=2)
    assert engine.scheduler.admission_batch == 2


def test_preemption_with_prefix_cache(model_factory, reference, prompts_factory):
    model = model_factory(seed=2)
    shared = prompts_factory([13], 320, seed=4)[0]
    prompts = [shared + p for p in prompts_factory([3, 9, 1, 6, 12], 320, seed=5)]
    engine = LLMEngine(model, block_size=4, num_blocks=24, max_num_batched_tokens=64, max_num_seqs=5)
    _run(engine, model, prompts, reference, [20] * len(prompts))
    assert engine.stats.preemptions > 0
    _all_blocks_back(engine)


def test_prefix_cache_hits(model_factory, reference, prompts_factory):
    """Shared system prompts (shorter than, equal to and longer than a block) hit, and outputs stay identical."""
    model = model_factory(seed=3)
    systems = prompts_factory([5, 8, 19], 320, seed=6)
    suffixes = prompts_factory([1, 4, 9, 2, 7, 3], 320, seed=7)
    prompts = [systems[i % 3] + s for i, s in enumerate(suffixes)]
    engine = LLMEngine(model, block_size=8, num_blocks=128, max_num_batched_tokens=64)
    first = _run(engine, model, prompts, reference, [10] * len(prompts))
    second = _run(engine, model, prompts, reference, [10] * len(prompts))  # now everything is cached
    assert sum(o.metrics.cached_tokens for o in first) > 0
    for p, o in zip(prompts, second, strict=True):
        assert o.metrics.cached_tokens == len(p) - 1  # all but the last prompt token (it yields the logits)
    _all_blocks_back(engine)


def test_sliding_window_keeps_only_window_blocks(model_factory, reference, prompts_factory):
    window, bs = 6, 4
    model = model_factory(seed=4, sliding_window=window)
    prompts = prompts_factory([3, 21, 30, 9], 320, seed=8)
    engine = LLMEngine(model, block_size=bs, num_blocks=128, max_num_batched_tokens=16)
    params = [SamplingParams(max_tokens=25)] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    limit = math.ceil(window / bs) + 1  # blocks a window can straddle, plus the one being filled
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            live = [b for b in seq.block_table if b != 0]
            assert len(live) <= limit, (seq, seq.block_table)
    for rid, p in zip(ids, prompts, strict=True):
        assert engine.result(rid).token_ids == reference(model, p, 25)
    _all_blocks_back(engine)


def test_qkv_bias_tied_embeddings(model_factory, reference, prompts_factory):
    model = model_factory(seed=5, qkv_bias=True, tie_embeddings=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1)
    prompts = prompts_factory([4, 18, 31], 320, seed=9)
    engine = LLMEngine(model, block_size=16, num_blocks=64)
    _run(engine, model, prompts, reference, [15, 15, 15])


@pytest.mark.skipif(
    not triton_available() or not (torch.cuda.is_available() or triton_interpreter_enabled()),
    reason="needs triton (and TRITON_INTERPRET=1 without CUDA)",
)
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
def test_triton_kernels_in_interpreter(model_factory, reference, prompts_factory):
    """The GPU code path (paged kernel, flash varlen prefill, fused norm/RoPE/SiLU kernels); in fp32 under the
    interpreter on CPU, compiled on a GPU."""
    model = model_factory(seed=6, n_layers=1).to("cuda" if torch.cuda.is_available() else "cpu")
    prompts = prompts_factory([1, 19, 6], 320, seed=10)
    engine = LLMEngine(
        model, block_size=8, num_blocks=32, max_num_batched_tokens=12, attention_backend="triton", fused_kernels=True
    )
    _run(engine, model, prompts, reference, [6, 6, 6])
    # batch 1 with every product through the Triton GEMVs: norm + q/k/v and norm + gate/up in one launch each
    engine.runner.linear.force = True
    _run(engine, model, prompts[1:2], reference, [6])
    assert engine.runner.linear.fused_calls > 0


def test_an_engine_config_passed_as_the_tokenizer_is_named(model_factory):
    with pytest.raises(TypeError, match="got an EngineConfig as the tokenizer; pass it as config="):
        LLMEngine(model_factory(), EngineConfig(num_blocks=32, block_size=8))
