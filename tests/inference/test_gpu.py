"""bf16 on the GPU: the engine (Triton paged decode, flash varlen prefill, fused kernels, CUDA graphs, chunked
prefill, prefix hits) is token-identical to naive full recompute with the reference model in bf16.

Why a trained model: in bf16 two correct implementations round differently, and a randomly initialised model's top
two logits are often closer than that rounding, so greedy tokens would diverge for reasons that are not bugs (even
the reference's own cached and uncached paths do). The model here is first trained for a few seconds to continue a
period-16 pattern, a task solved by attending 15 positions back (across KV blocks), so its greedy choices have wide
margins while every token still depends on the right keys and values being found in the paged cache.
"""

from __future__ import annotations

import pytest
import torch

from lightning_llmopt.inference import LLMEngine, SamplingParams
from lightning_llmopt.models import Llama, LlamaConfig, greedy_generate

pytestmark = pytest.mark.gpu
PERIOD, VOCAB = 16, 64


def _periodic(g: torch.Generator, batch: int, length: int) -> torch.Tensor:
    base = torch.randint(0, VOCAB, (batch, PERIOD), generator=g)
    return base.repeat(1, length // PERIOD + 1)[:, :length]


def _trained_model(**overrides) -> Llama:
    torch.manual_seed(0)
    values = dict(vocab_size=VOCAB, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=256, max_seq_len=256)
    cfg = LlamaConfig(**{**values, **overrides})
    model = Llama(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    for _ in range(400):
        x = _periodic(g, 64, 176).cuda()
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits[:, PERIOD - 1 :].reshape(-1, VOCAB).float(), x[:, PERIOD:].reshape(-1)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05, f"the copy task did not train (loss {loss.item():.3f})"
    return model.to(torch.bfloat16).eval()


def _full_recompute(model, prompts, new):
    """Greedy continuations of ``prompts`` by the reference model without a cache (the engine's yardstick)."""
    return [
        greedy_generate(model, torch.tensor([p], device="cuda"), new, use_cache=False)[0, len(p) :].tolist()
        for p in prompts
    ]


def test_bf16_greedy_matches_full_recompute():
    model = _trained_model()
    g = torch.Generator().manual_seed(2)
    lengths = [17, 21, 33, 48, 70, 90]
    prompts = [_periodic(g, 1, n)[0].tolist() for n in lengths]
    new = 64
    refs = _full_recompute(model, prompts, new)
    for p, r in zip(prompts, refs, strict=True):  # the task is solved: the reference continues the pattern
        assert r == [p[(len(p) + i) % PERIOD] for i in range(new)]
    engine = LLMEngine(model, block_size=16, num_blocks=256, max_num_batched_tokens=64, max_num_seqs=8)
    assert engine.graphs is not None and engine.runner.fused
    for _ in range(2):  # the second pass hits the prefix cache
        outs = engine.generate(prompts, [SamplingParams(max_tokens=new)] * len(prompts))
        assert [o.token_ids for o in outs] == refs
    assert engine.graphs.graphs, "no decode step ran from a CUDA graph"
    assert outs[-1].metrics.cached_tokens == len(prompts[-1]) - 1
    engine.runner.linear.force = True  # batch 1: every matrix product through the Triton GEMV
    for p, r in zip(prompts, refs, strict=True):
        assert engine.generate([p], SamplingParams(max_tokens=new))[0].token_ids == r
    engine.prefix_cache.clear()
    assert engine.blocks.allocator.num_free == engine.blocks.allocator.capacity


def test_greedy_runs_of_captured_steps_match_full_recompute():
    """decode_steps=8 on the GPU: runs of eight graph replays with the argmax fed back on the device, token-identical
    to full recompute in bf16, at batch 1 and across a mixed-length batch."""
    model = _trained_model()
    g = torch.Generator().manual_seed(5)
    prompts = [_periodic(g, 1, n)[0].tolist() for n in (18, 35, 61)]
    new = 64
    refs = _full_recompute(model, prompts, new)
    engine = LLMEngine(model, block_size=16, num_blocks=256, max_num_seqs=8, decode_steps=8)
    assert engine.graphs is not None
    assert [o.token_ids for o in engine.generate(prompts, [SamplingParams(max_tokens=new)] * 3)] == refs
    assert engine.generate(prompts[:1], SamplingParams(max_tokens=new))[0].token_ids == refs[0]
    engine.prefix_cache.clear()
    assert engine.blocks.allocator.num_free == engine.blocks.allocator.capacity


def test_quantized_model_batch1_through_fused_decode(monkeypatch):
    """A quantized model on the fused CUDA decode path: QuantizedLinear layers have no dense ``weight`` and must run
    their own kernels at batch 1 (this crashed once with AttributeError in the GEMV chooser). Without the kernels'
    configuration search (it took minutes here: every length bucket of the full-recompute reference, every shape)."""
    from lightning_llmopt.quantization import QuantConfig, quantize_model

    monkeypatch.setenv("LLMOPT_QUANT_TUNE", "0")

    model = _trained_model()
    quantize_model(model, QuantConfig(bits=8, group_size=None))
    g = torch.Generator().manual_seed(3)
    prompt = _periodic(g, 1, 40)[0].tolist()
    ref = greedy_generate(model, torch.tensor([prompt], device="cuda"), 32, use_cache=False)[0, len(prompt) :]
    engine = LLMEngine(model, block_size=16, num_blocks=64, max_num_seqs=1)
    assert engine.runner.fused
    assert engine.generate([prompt], SamplingParams(max_tokens=32))[0].token_ids == ref.tolist()


def test_speculative_steps_replay_cuda_graphs():
    """Speculation on the GPU replays CUDA graphs: greedy steps as device-side rounds (draft passes, verify pass and
    acceptance in one graph), and on the host path the verify steps (1 + k rows per sequence) and the draft model's
    steps. Greedy output still equals full recompute in bf16 (self-drafting: every draft is accepted; an int8 copy:
    some are rejected)."""
    from lightning_llmopt.inference.speculative import SpeculativeConfig

    model = _trained_model()
    g = torch.Generator().manual_seed(4)
    prompts = [_periodic(g, 1, n)[0].tolist() for n in (19, 40, 66)]
    new = 48
    refs = _full_recompute(model, prompts, new)
    for spec, device_rounds in (
        (SpeculativeConfig("draft", draft_model=model, num_tokens=4, adaptive=False), True),
        (SpeculativeConfig("draft", draft_model=model, num_tokens=4, adaptive=False), False),
        (SpeculativeConfig("self_quantized", quant_bits=8, num_tokens=4, adaptive=False), True),
    ):
        engine = LLMEngine(  # captured on first use, so the sizes that ran are the sizes captured
            model, block_size=16, num_blocks=256, max_num_seqs=4, speculative=spec, capture_graphs_at_start=False
        )
        engine.spec.device_rounds = device_rounds
        outs = engine.generate(prompts, SamplingParams(max_tokens=new))
        got = [o.token_ids for o in outs]
        assert got == refs, f"{spec.method}, device rounds {device_rounds}: {got} != {refs}"
        assert engine.stats.spec_verifications > 0
        if device_rounds:
            assert engine.spec.device_runs > 0
            assert any(g.graph is not None for g in engine.spec.round_graphs.values()), "no round replayed a graph"
        else:
            assert engine.spec.device_runs == 0
            assert any(b > 4 for b in engine.graphs.graphs), "no verify step was replayed from a graph"
            assert engine.spec.drafter.graphs is not None and engine.spec.drafter.graphs.graphs


def test_graphs_captured_at_start_serve_identically():
    """By default every graph size (the drafter's too) is captured when the engine is built; output is unchanged."""
    from lightning_llmopt.inference.speculative import SpeculativeConfig

    model = _trained_model()
    g = torch.Generator().manual_seed(5)
    prompts = [_periodic(g, 1, n)[0].tolist() for n in (21, 37)]
    refs = _full_recompute(model, prompts, 32)
    spec = SpeculativeConfig("draft", draft_model=model, num_tokens=3)
    engine = LLMEngine(model, block_size=16, num_blocks=256, max_num_seqs=4, speculative=spec)
    assert set(engine.graphs.graphs) == set(engine.graphs.sizes)
    assert set(engine.spec.drafter.graphs.graphs) == set(engine.spec.drafter.graphs.sizes)
    outs = engine.generate(prompts, SamplingParams(max_tokens=32))
    assert [o.token_ids for o in outs] == refs


def test_kv_groups_replay_cuda_graphs():
    """Local layers of two windows (wide enough for the period) and a global layer: KV groups, with the decode
    steps and greedy runs replayed from CUDA graphs (each group's blocks and tables static inputs), token-identical
    to full recompute (the pool sized from free memory through the group split)."""
    model = _trained_model(n_layers=3, layer_types=["local:20", "local:24", "global"])
    g = torch.Generator().manual_seed(3)
    prompts = [_periodic(g, 1, n)[0].tolist() for n in (18, 35, 61, 90)]
    new = 64
    refs = _full_recompute(model, prompts, new)
    for steps in (1, 8):
        engine = LLMEngine(model, block_size=16, max_num_seqs=4, max_num_batched_tokens=64, decode_steps=steps)
        assert engine.graphs is not None and engine.graphs.n_local == 2
        assert engine.pool.pools[0].num_blocks == 4 * 4 * 16 + 1  # the budget split, capped at the useful bound
        for _ in range(2):  # the second pass hits the prefix cache
            outs = engine.generate(prompts, [SamplingParams(max_tokens=new)] * len(prompts))
            assert [o.token_ids for o in outs] == refs
        assert engine.graphs.graphs, "no decode step ran from a CUDA graph"
        engine.prefix_cache.clear()
        assert engine.blocks.allocator.num_free == engine.blocks.allocator.capacity
