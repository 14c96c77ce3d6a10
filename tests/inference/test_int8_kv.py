"""int8 KV cache: calibrated per-head scales, no silent unit scales, and exactness against fake quantization.

Oracle: the unmodified reference model decoding through a :class:`StaticKVCache` that rounds every key and value to
int8 with the same scales and back ("fake quantization"). With a one-token budget every engine step reads all its
keys from the int8 pool, so the engine must then reproduce the oracle's greedy tokens exactly.
"""

from __future__ import annotations

import pytest
import torch

from lightning_llmopt.inference import KVScales, LLMEngine, SamplingParams, calibrate_kv_scales
from lightning_llmopt.models import StaticKVCache


class FakeQuantCache(StaticKVCache):
    def __init__(self, scales: KVScales, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scales = scales

    def update(self, layer_id, k, v, positions):
        def qdq(x, s):
            s = s.view(1, -1, 1, 1)
            return torch.round(x / s).clamp(-127, 127) * s

        return super().update(layer_id, qdq(k, self.scales.k[layer_id]), qdq(v, self.scales.v[layer_id]), positions)


@torch.no_grad()
def _fake_quant_greedy(model, prompt, n, scales):
    cfg = model.config
    cache = FakeQuantCache(scales, cfg.n_layers, 1, len(prompt) + n, cfg.n_kv_heads, cfg.head_dim)
    tokens = list(prompt)
    for t in range(len(prompt) + n - 1):  # one token at a time, as the engine with a budget of 1
        logits = model(torch.tensor([[tokens[t]]]), positions=torch.tensor([[t]]), kv_cache=cache)
        if t >= len(prompt) - 1:
            tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def test_uncalibrated_int8_is_an_error(model_factory):
    engine = LLMEngine(model_factory(), kv_dtype="int8", num_blocks=32, block_size=8)
    with pytest.raises(RuntimeError, match="no calibrated scales"):
        engine.generate([[1, 2, 3]])
    with pytest.raises(ValueError, match="finite and > 0"):
        KVScales(torch.zeros(2, 2), torch.ones(2, 2))
    with pytest.raises(ValueError, match="at least one non-empty prompt"):
        engine.calibrate_kv([])


def test_int8_engine_equals_fake_quantized_reference(model_factory, prompts_factory):
    model = model_factory(seed=1)
    calib = prompts_factory([40, 25, 33], 320, seed=2)
    prompts = prompts_factory([3, 12, 20], 320, seed=3)
    engine = LLMEngine(model, kv_dtype="int8", num_blocks=64, block_size=8, max_num_batched_tokens=1)
    scales = engine.calibrate_kv(calib)
    assert engine.pool.data.dtype == torch.int8
    outs = engine.generate(prompts, SamplingParams(max_tokens=10))
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == _fake_quant_greedy(model, p, 10, scales)


def test_calibrated_scales_beat_unit_scales(model_factory, prompts_factory):
    """Logit error of the int8 cache vs the float cache: calibrated scales are far better than unit scales."""
    model = model_factory(seed=2)
    prompts = prompts_factory([30, 18], 320, seed=4)
    scales = calibrate_kv_scales(model, prompts)
    ones = KVScales(torch.ones_like(scales.k), torch.ones_like(scales.v))

    def logits(kv_scales):
        cfg = model.config
        out = []
        for p in prompts:
            cache = FakeQuantCache(kv_scales, cfg.n_layers, 1, len(p), cfg.n_kv_heads, cfg.head_dim)
            with torch.no_grad():
                out.append(model(torch.tensor([p]), kv_cache=cache)[0])
        return torch.cat(out)

    with torch.no_grad():
        exact = torch.cat([model(torch.tensor([p]))[0] for p in prompts])
    calibrated = (logits(scales) - exact).abs().mean()
    unit = (logits(ones) - exact).abs().mean()
    assert calibrated * 10 < unit


def test_recalibration_writes_the_scales_in_place(model_factory, prompts_factory):
    """Captured CUDA graphs read the pool's scale tensors, so a second calibration writes into them rather than
    replacing them (and the pool never aliases the caller's :class:`KVScales`). An engine built without scales
    defers its graph capture to the first calibration (on CUDA; the GPU smoke run's ``engine:*`` int8 paths)."""
    engine = LLMEngine(model_factory(seed=1), kv_dtype="int8", num_blocks=64, block_size=8)
    first = engine.calibrate_kv(prompts_factory([40], 320, seed=2))
    held = engine.pool.scales.k
    assert held is not first.k and torch.equal(held, first.k)
    second = engine.calibrate_kv(prompts_factory([25, 33, 60], 320, seed=5))
    assert not torch.equal(first.k, second.k)
    assert engine.pool.scales.k is held and torch.equal(held, second.k)
    assert len(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4))[0].token_ids) == 4
