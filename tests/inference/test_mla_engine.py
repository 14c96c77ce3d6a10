"""The engine on MLA models: greedy output equals full recompute by the plain model (token-exact, fp32 CPU), batched,
chunked, with prefix-cache hits, through the Triton kernels in the interpreter and in the CUDA-graph row layout;
the pool holds exactly ``n_layers * (kv_lora_rank + qk_rope_head_dim)`` numbers per token; unsupported options are
refused by name."""

from __future__ import annotations

import pytest
import torch

from lightning_llmopt.inference import LLMEngine, SamplingParams
from lightning_llmopt.inference.cuda_graphs import DecodeGraphs
from lightning_llmopt.inference.mla_cache import LatentKVPool, kv_bytes_per_token
from lightning_llmopt.inference.speculative import SpeculativeConfig
from lightning_llmopt.testing.triton import triton_available, triton_interpreter_enabled

MLA = dict(kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=16)
LENGTHS = [1, 2, 7, 16, 17, 33]
MAX_TOKENS = [12, 3, 9, 12, 1, 7]


def _mla_model(model_factory, seed: int = 0, **mla):
    return model_factory(seed=seed, mla=dict(MLA, **mla))


def _check(engine, model, reference, prompts, max_tokens):
    outs = engine.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    for p, m, o in zip(prompts, max_tokens, outs, strict=True):
        assert o.token_ids == reference(model, p, m), f"prompt of {len(p)} tokens"
    return outs


def test_pool_is_latent_and_bytes_follow_formula(model_factory):
    model = _mla_model(model_factory)
    engine = LLMEngine(model, block_size=8, num_blocks=40)
    pool = engine.pool
    assert isinstance(pool, LatentKVPool)
    cfg = model.config
    per_token = cfg.n_layers * (MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]) * 4  # fp32
    assert pool.nbytes == per_token * pool.num_blocks * pool.block_size
    assert pool.data.untyped_storage().nbytes() == pool.nbytes  # nothing else allocated behind the view
    # the same model with GQA attention would hold 2 * n_kv_heads * head_dim per layer and token
    gqa = LLMEngine(model_factory(seed=0), block_size=8, num_blocks=40).pool
    assert gqa.nbytes == cfg.n_layers * 2 * 2 * 16 * 4 * 40 * 8  # tiny preset: 2 KV heads of 16
    # the config-only formula of the docs' table agrees with both pools
    for eng_pool, model_cfg in ((pool, cfg), (gqa, model_factory(seed=0).config)):
        assert (
            kv_bytes_per_token(model_cfg, torch.float32) * eng_pool.num_blocks * eng_pool.block_size == eng_pool.nbytes
        )


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_batched_greedy_matches_full_recompute(model_factory, reference, prompts_factory, q_lora_rank):
    model = _mla_model(model_factory, seed=1, q_lora_rank=q_lora_rank)
    prompts = prompts_factory(LENGTHS, 320, seed=1)
    engine = LLMEngine(model, block_size=8, num_blocks=128, max_num_batched_tokens=256, enable_prefix_caching=False)
    _check(engine, model, reference, prompts, MAX_TOKENS)
    assert engine.stats.steps < sum(MAX_TOKENS)  # requests really shared steps


def test_chunked_prefill_reads_latent_context(model_factory, reference, prompts_factory):
    """A 7-token budget: later chunks of a prompt attend to earlier chunks read back from the latent pool."""
    model = _mla_model(model_factory, seed=2)
    prompts = prompts_factory(LENGTHS, 320, seed=2)
    engine = LLMEngine(model, block_size=4, num_blocks=256, max_num_batched_tokens=7, max_num_seqs=3)
    _check(engine, model, reference, prompts, [8] * len(prompts))
    assert engine.stats.steps > sum(LENGTHS) / 7


def test_prefix_cache_hits(model_factory, reference, prompts_factory):
    model = _mla_model(model_factory, seed=3)
    systems = prompts_factory([5, 8, 19], 320, seed=6)
    suffixes = prompts_factory([1, 4, 9, 2, 7, 3], 320, seed=7)
    prompts = [systems[i % 3] + s for i, s in enumerate(suffixes)]
    engine = LLMEngine(model, block_size=8, num_blocks=128, max_num_batched_tokens=64, enable_prefix_caching=True)
    first = _check(engine, model, reference, prompts, [8] * len(prompts))
    second = _check(engine, model, reference, prompts, [8] * len(prompts))
    assert sum(o.metrics.cached_tokens for o in first) > 0
    for p, o in zip(prompts, second, strict=True):
        assert o.metrics.cached_tokens == len(p) - 1
    engine.prefix_cache.clear()
    assert engine.blocks.allocator.num_free == engine.blocks.allocator.capacity


def test_graph_row_layout(model_factory, reference, prompts_factory):
    """The layout CUDA graphs replay (one paged-decode row per token), run eagerly on the CPU."""
    model = _mla_model(model_factory, seed=4)
    engine = LLMEngine(model, block_size=4, num_blocks=96, max_num_batched_tokens=64)
    width = engine.blocks.blocks_for(engine.max_model_len)
    engine.graphs = DecodeGraphs(engine.runner, (1, 2, 4, 8), width, engine.max_model_len, capture=False)
    calls = []
    run = engine.graphs.run
    engine.graphs.run = lambda work: calls.append(len(work)) or run(work)
    _check(engine, model, reference, prompts_factory([3, 9, 14], 320, seed=5), [10, 6, 9])
    assert calls


@pytest.mark.skipif(not triton_available() or not triton_interpreter_enabled(), reason="needs TRITON_INTERPRET=1")
def test_triton_kernels_in_interpreter(model_factory, reference, prompts_factory):
    """The paged decode kernel reads the latent pages (one key/value head of 40 channels) and the varlen flash kernel
    runs the absorbed prefill."""
    model = _mla_model(model_factory, seed=5)
    prompts = prompts_factory([3, 10, 6], 320, seed=9)
    engine = LLMEngine(model, block_size=4, num_blocks=64, max_num_batched_tokens=8, attention_backend="triton")
    _check(engine, model, reference, prompts, [4, 3, 4])


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(kv_dtype="int8"), "kv_dtype \\('int8'\\) is not supported with MLA"),
        (dict(speculative=SpeculativeConfig("prompt_lookup", num_tokens=2)), "speculative decoding is not supported"),
        (dict(fused_kernels=True), "fused_kernels=True is not supported with MLA"),
    ],
)
def test_refused_options(model_factory, overrides, match):
    with pytest.raises(ValueError, match=match):
        LLMEngine(_mla_model(model_factory), block_size=8, num_blocks=16, **overrides)


def test_paged_cache_adapter_over_latent_pool(model_factory):
    """The protocol-level ``PagedKVCache`` on a ``LatentKVPool``: the plain model decodes over paged latents (both
    forms) with the logits of its full forward."""
    from lightning_llmopt.inference.block_manager import BlockManager
    from lightning_llmopt.inference.paged_cache import PagedKVCache

    model = _mla_model(model_factory, seed=6)
    tokens = torch.randint(0, 320, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        for absorb in (True, False):
            for block in model.layers.values():
                block.attention.absorb = absorb
            pool = LatentKVPool(model.config.n_layers, 40, 16, 4, torch.float32, "cpu")
            cache = PagedKVCache(pool, BlockManager(16, 4), batch_size=2)
            outs = [model(tokens[:, :5], positions=torch.arange(5).expand(2, 5), kv_cache=cache)]
            for i in range(5, 13):
                outs.append(model(tokens[:, i : i + 1], positions=torch.full((2, 1), i), kv_cache=cache))
            torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-5)
