"""Interleaved local/global attention and cross-layer KV sharing: train a tiny model, serve it, count the cache.

    python examples/layer_patterns.py                 # CPU, about ten seconds
    python examples/layer_patterns.py --table         # only the KV-cache bytes table of docs/layer_patterns.md

The model is Gemma-3-like (five local layers with a window of 16 keys, then a global one) with cross-layer KV
sharing in the first four (layers 1 and 3 read the keys/values of layers 0 and 2). It trains a few steps, then the
engine serves it: its greedy tokens are checked against full recompute through the model, and its pools are
printed (global producers: every block; local producers: their window only). The same requests then go through
the CUDA-graph row layout with multi-step decoding, and through speculative decoding (an int8 copy drafting).
"""

from __future__ import annotations

import argparse
import math

import torch

from lightning_llmopt.inference import LLMEngine, SamplingParams
from lightning_llmopt.models import Llama, LlamaConfig, greedy_generate
from lightning_llmopt.models.layer_pattern import cla_kv_sources, kv_cache_bytes, pattern_layers


def table(context: int = 32768) -> str:
    """KV-cache bytes per sequence at ``context`` tokens (bf16) for a few layouts of two presets."""
    rows = ["| model | layout | KV producers | cache per sequence | vs all-global |", "|---|---|---|---|---|"]
    for preset in ("1b", "llama3-8b"):
        base = LlamaConfig.from_preset(preset)
        n = base.n_layers
        layouts = {
            "all global": {},
            "5 local (1024) : 1 global": dict(
                sliding_window=1024, layer_types=pattern_layers(["local"] * 5 + ["global"], n)
            ),
            "1 local (4096) : 1 global": dict(sliding_window=4096, layer_types=pattern_layers(["local", "global"], n)),
            "all local (4096)": dict(sliding_window=4096),
            "CLA-2": dict(kv_sources=cla_kv_sources(n, 2)),
        }
        full = kv_cache_bytes(base, context)
        for name, overrides in layouts.items():
            cfg = LlamaConfig.from_preset(preset, **overrides)
            size = kv_cache_bytes(cfg, context)
            producers = n if cfg.kv_sources is None else sum(s == i for i, s in enumerate(cfg.kv_sources))
            rows.append(f"| {preset} | {name} | {producers}/{n} | {size / 2**30:.3f} GiB | {size / full:.3f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--table", action="store_true", help="print the KV-cache table and exit")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if args.table:
        print(table())
        return
    torch.manual_seed(0)
    n_layers, window, bs = 6, 16, 8
    cfg = LlamaConfig.from_preset(
        "tiny",
        n_layers=n_layers,
        sliding_window=window,
        layer_types=["local"] * 5 + ["global"],
        kv_sources=[0, 0, 2, 2, 4, 5],  # layers 1 and 3 read the K/V of 0 and 2 (a reader keeps its source's window)
        max_seq_len=512,
    )
    model = Llama(cfg)
    print(f"{model.num_params():,} parameters; windows {[cfg.layer_window(i) for i in range(n_layers)]}")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)  # learnable rows: arithmetic progressions modulo the vocabulary
    start, stride = torch.randint(0, cfg.vocab_size, (64, 1), generator=g), torch.randint(1, 4, (64, 1), generator=g)
    data = (start + stride * torch.arange(65)) % cfg.vocab_size
    for step in range(args.steps):
        batch = data[(step * 8) % 64 : (step * 8) % 64 + 8]
        loss = model.loss(batch[:, :-1], batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.3f}")

    model.eval()
    engine = LLMEngine(model, block_size=bs, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=32)
    prompts = [data[i, :40].tolist() for i in range(4)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=24))
    for p, o in zip(prompts, outs, strict=True):
        ref = greedy_generate(model, torch.tensor([p]), 24, use_cache=False)[0, len(p) :].tolist()
        assert o.token_ids == ref, "engine and full recompute disagree"
    print("engine greedy == full recompute for", len(prompts), "requests of 64 tokens (windows of 16 exceeded)")
    pools = getattr(engine.pool, "pools", [engine.pool])
    for group, pool in zip(getattr(engine.pool, "groups", [None]), pools, strict=True):
        kind = "global" if group is None or group.window is None else f"local (window {group.window})"
        layers = group.layers if group is not None else "all"
        print(f"pool {kind}: producers {layers}, {pool.num_blocks} blocks, {pool.nbytes / 2**10:.0f} KiB")
    per_seq, cached = math.ceil((window - 1 + 32) / bs) + 1, math.ceil((window - 1) / bs) + 1
    print(
        f"local blocks: 4 sequences x {per_seq} + 4 cached windows x {cached} + the null block = "
        f"{4 * per_seq + 4 * cached + 1}"
    )
    fast_paths(model, prompts, bs)
    print()
    print(table())


def fast_paths(model: Llama, prompts: list[list[int]], bs: int) -> None:
    """The same requests through the CUDA-graph row layout (captured on a GPU; off it, ``capture=False`` runs the
    same static buffers eagerly) with four greedy steps per round trip, then with speculative decoding (an int8 copy
    of the model drafting)."""
    from lightning_llmopt.inference.cuda_graphs import DecodeGraphs
    from lightning_llmopt.inference.speculative import SpeculativeConfig

    refs = [greedy_generate(model, torch.tensor([p]), 24, use_cache=False)[0, len(p) :].tolist() for p in prompts]
    spec = SpeculativeConfig("self_quantized", quant_bits=8, num_tokens=3, adaptive=False)
    for name, extra in (("graph rows, decode_steps=4", dict(decode_steps=4)), ("speculative", dict(speculative=spec))):
        engine = LLMEngine(model, block_size=bs, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=32, **extra)
        if engine.graphs is None:  # off the GPU: the graphs' layout, run eagerly
            width = engine.blocks.blocks_for(engine.max_model_len)
            engine.graphs = DecodeGraphs(engine.runner, (1, 2, 4, 8, 16), width, engine.max_model_len, capture=False)
            if engine.spec is not None:
                engine.spec.device_rounds = False
        outs = engine.generate(prompts, SamplingParams(max_tokens=24))
        assert [o.token_ids for o in outs] == refs, f"{name}: engine and full recompute disagree"
        st = engine.stats
        print(f"{name}: greedy == full recompute ({st.steps} steps, {st.spec_verifications} verifications)")


if __name__ == "__main__":
    main()
