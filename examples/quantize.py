"""Quantize a model, compare perplexities, export GPTQ and compressed-tensors checkpoints and load them back.

    python examples/quantize.py                      # a tiny model trained for a minute on the standard library
    python examples/quantize.py --hf path/to/model   # a Hugging Face Llama/Mistral/Qwen2 folder instead

Public API only: ``lightning_llmopt.quantization`` and ``lightning_llmopt.models``/``data``.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from collections import Counter
from pathlib import Path

import torch

from lightning_llmopt import CausalLMModule
from lightning_llmopt.data import TextDataModule
from lightning_llmopt.models import Llama, LlamaConfig, from_hf
from lightning_llmopt.quantization import (
    QuantConfig,
    QuantSpec,
    allocate_bits,
    layer_sensitivity,
    load_quantized,
    perplexity,
    quantize_model,
    save_compressed_tensors,
    save_gptq,
)


def train_tiny(dm: TextDataModule, steps: int) -> Llama:
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_preset("debug-1m", max_seq_len=256))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = iter(torch.utils.data.DataLoader(dm.train_dataset, batch_size=16, shuffle=True))
    for step in range(steps):
        batch = next(loader)
        loss = CausalLMModule.loss_fn(model(batch["input_ids"]), batch["labels"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0:
            print(f"step {step}: loss {loss.item():.3f}")
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf", default=None, help="a Hugging Face checkpoint folder (default: train a tiny model)")
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    dm = TextDataModule(seq_len=128, batch_size=16, max_bytes=2_000_000)  # bytes of the Python standard library
    dm.setup("fit")
    model = from_hf(args.hf).eval() if args.hf else train_tiny(dm, args.steps)
    val = [next(iter(dm.val_dataloader()))]
    calib = [b["input_ids"] for b, _ in zip(dm.train_dataloader(), range(4), strict=False)]

    print(f"float                     ppl {perplexity(model, val):.4f} (token-level)")
    variants = {
        "int8 RTN per channel": QuantConfig(bits=8, group_size=None),
        "int4 RTN g128": QuantConfig(bits=4, group_size=128),
        "int4 RTN g128, MSE clip": QuantConfig(bits=4, group_size=128, observer="mse"),
        "int4 GPTQ g128": QuantConfig(bits=4, group_size=128, method="gptq", scale_dtype=torch.float16),
    }
    quantized = {}
    for name, config in variants.items():
        q = copy.deepcopy(model)
        quantize_model(q, config, calibration=calib)
        quantized[name] = q
        print(f"{name:25s} ppl {perplexity(q, val):.4f}")

    # Mixed precision: per-layer sensitivity, then the best allocation under 5 bits per weight.
    options = [None, QuantSpec(8, "channel"), QuantSpec(4, "group", 128)]
    sens = layer_sensitivity(model, val, [o for o in options if o is not None])
    shapes = {n: tuple(model.get_submodule(n).weight.shape) for n in sens}
    budget = int(5.0 * sum(n * k for n, k in shapes.values()) / 8)
    plan = allocate_bits(sens, shapes, options, budget)
    mixed = copy.deepcopy(model)
    quantize_model(mixed, QuantConfig().with_overrides(plan.plan))
    counts = Counter(plan.summary().values())
    print(f"{'mixed (5 bits/weight)':25s} ppl {perplexity(mixed, val):.4f}; layers per format {dict(counts)}")

    out = Path(tempfile.mkdtemp(prefix="llmopt-quant-"))
    gptq_dir = save_gptq(quantized["int4 GPTQ g128"], out / "gptq")  # vLLM / transformers GPTQ layout
    ct_dir = save_compressed_tensors(mixed, out / "compressed-tensors")  # transformers + compressed-tensors
    for folder in (gptq_dir, ct_dir):
        back = load_quantized(folder, dtype=torch.float32)
        print(f"reloaded {folder.name}: ppl {perplexity(back, val):.4f}")


if __name__ == "__main__":
    main()
