"""Multi-head latent attention (MLA, DeepSeek-V2/V3) end to end on the CPU, in a few seconds.

    python examples/mla.py

1. builds a tiny Llama whose attention is MLA (``LlamaConfig(mla=...)``: a 32-wide key/value latent plus an 8-wide
   decoupled RoPE key; query/key heads of 24 + 8 channels, value heads of 16);
2. trains it for a few steps on a repeating sequence and prints the loss;
3. checks that decoding in the absorbed form (the cache holds only the latent) gives the naive form's logits;
4. serves it with :class:`~lightning_llmopt.inference.LLMEngine` (paged latent cache, prefix cache) and compares the
   greedy output with full recompute;
5. prints the cache bytes per token, against the same model with GQA attention.
"""

from __future__ import annotations

import torch

from lightning_llmopt.inference import LLMEngine, SamplingParams
from lightning_llmopt.inference.mla_cache import kv_bytes_per_token
from lightning_llmopt.models import Llama, LlamaConfig, StaticKVCache, greedy_generate

MLA = dict(kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=24)


def train(model: Llama, steps: int = 40) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.arange(65).repeat(8, 1) % 23
    for step in range(steps):
        loss = model.loss(data[:, :-1], data[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step:3d}  loss {loss.item():.3f}")


@torch.no_grad()
def absorbed_vs_naive(model: Llama, tokens: torch.Tensor) -> float:
    """Max relative difference of cached decoding in the absorbed and naive forms."""
    outs = []
    for absorb in (False, True):
        for block in model.layers.values():
            block.attention.absorb = absorb
        cache = StaticKVCache.for_model(model, 1, tokens.shape[1])
        logits = [
            model(tokens[:, i : i + 1], positions=torch.tensor([[i]]), kv_cache=cache) for i in range(tokens.shape[1])
        ]
        outs.append(torch.cat(logits, 1))
    return float((outs[1] - outs[0]).abs().max() / outs[0].abs().max())


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig.from_preset("tiny", mla=MLA)
    model = Llama(config)
    print(f"MLA model: {model.num_params():,} parameters")
    train(model)
    model.eval()
    prompt = (torch.arange(12) % 23)[None]
    print(f"absorbed vs naive decode: max relative difference {absorbed_vs_naive(model, prompt):.1e}")

    engine = LLMEngine(model, block_size=8, num_blocks=64, enable_prefix_caching=True)
    prompts = [prompt[0].tolist(), prompt[0, :5].tolist()]
    outs = engine.generate(prompts, SamplingParams(max_tokens=12))
    for p, o in zip(prompts, outs, strict=True):
        ref = greedy_generate(model, torch.tensor([p]), 12, use_cache=False)[0, len(p) :].tolist()
        print(f"engine {o.token_ids} {'==' if o.token_ids == ref else '!='} full recompute")

    pool = engine.pool
    per_token = pool.nbytes // (pool.num_blocks * pool.block_size)
    gqa = LlamaConfig.from_preset("tiny")
    print(
        f"cache bytes/token (fp32): MLA {per_token} (formula {kv_bytes_per_token(config, torch.float32)}), "
        f"the GQA tiny preset {kv_bytes_per_token(gqa, torch.float32)}"
    )


if __name__ == "__main__":
    main()
