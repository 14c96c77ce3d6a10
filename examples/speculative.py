"""Speculative decoding: train a target and a smaller draft on the default corpus, then measure the speedup.

    python examples/speculative.py                 # a few minutes on CPU
    python examples/speculative.py --steps 20      # a quick look

Both models are byte-level Llamas trained on the Python standard library (the default corpus); the draft is
distilled from the trained target (KL to its next-token distribution), which raises how often the target accepts
its guesses over a draft trained on the text alone. The engine decodes
the same prompts greedily without speculation, with the draft model, with the target's own int8 copy and with prompt
lookup; outputs are identical and the wall time, acceptance rate and tokens per target pass are printed. On CPU a
small model's decode step costs little more than Python overhead, so the speedup here is modest; the GPU figures are
produced by ``benchmarks/bench_speculative.py``. Public API only.
"""

from __future__ import annotations

import argparse
import time

import torch

from lightning_llmopt import CausalLMModule
from lightning_llmopt.compression import distillation_loss
from lightning_llmopt.data import TextDataModule
from lightning_llmopt.inference import LLMEngine, SamplingParams, SpeculativeConfig
from lightning_llmopt.models import Llama, LlamaConfig


def train(config: LlamaConfig, dm: TextDataModule, steps: int, seed: int, teacher: Llama | None = None) -> Llama:
    torch.manual_seed(seed)
    model = Llama(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = iter(torch.utils.data.DataLoader(dm.train_dataset, batch_size=16, shuffle=True))
    for step in range(steps):
        batch = next(loader)
        if teacher is None:
            loss = CausalLMModule.loss_fn(model(batch["input_ids"]), batch["labels"])
        else:
            with torch.no_grad():
                soft = teacher(batch["input_ids"])
            loss = distillation_loss(model(batch["input_ids"]), soft, batch["labels"], temperature=1.0, alpha=0.9)[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"  step {step}: loss {loss.item():.3f}")
    return model.eval()


def run(model: Llama, prompts: list[list[int]], max_tokens: int, spec: SpeculativeConfig | None):
    engine = LLMEngine(model, speculative=spec, max_num_seqs=len(prompts), num_blocks=256, block_size=16)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    engine.stats.reset()
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    return [o.token_ids for o in outs], time.perf_counter() - start, engine.stats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    dm = TextDataModule(seq_len=128, batch_size=16, max_bytes=2_000_000)
    dm.setup("fit")
    base = dict(vocab_size=320, max_seq_len=512, tie_embeddings=True, multiple_of=32)
    print("training the target")
    target = train(LlamaConfig(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, **base), dm, args.steps, 0)
    print("distilling the draft from the target")
    draft = train(LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, **base), dm, args.steps, 1, target)
    val = next(iter(dm.val_dataloader()))["input_ids"]
    prompts = [val[i, :48].tolist() for i in range(args.batch)]

    torch.set_num_threads(1)  # small models: threads only add synchronisation
    ref, plain_s, _ = run(target, prompts, args.max_tokens, None)
    print(f"plain decoding: {plain_s:.2f} s")
    variants = {
        "draft model": SpeculativeConfig("draft", draft_model=draft, num_tokens=4),
        "int8 self-draft": SpeculativeConfig("self_quantized", quant_bits=8, num_tokens=4),
        "prompt lookup": SpeculativeConfig("prompt_lookup", num_tokens=4),
    }
    for name, spec in variants.items():
        out, secs, st = run(target, prompts, args.max_tokens, spec)
        same = "identical" if out == ref else "DIFFERENT"
        print(
            f"{name:16s} {secs:.2f} s  speedup {plain_s / secs:.2f}x  acceptance {st.acceptance_rate:.2f}  "
            f"tokens/pass {st.tokens_per_step:.2f}  output {same}"
        )


if __name__ == "__main__":
    main()
