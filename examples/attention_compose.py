"""MLA and layer patterns with the rest of the training stack, on the CPU in a few seconds.

    python examples/attention_compose.py

1. builds three tiny 4-block models (MLA with a low-rank query, Gemma-style local/global windows, CLA-2 shared K/V) with
   and without the fused kernels (``fused_kernels=["all"]``, the CUDA default; their PyTorch reference path on
   CPU) and prints the loss difference and what the kernel step swapped in;
2. prints the memory estimator's parameter count beside the built model's, and its activation estimate;
3. prints the pipeline cost model's per-block costs and the 2-stage split it picks.

The strategies (ZeRO-3, PP, TP, CP) under these options are exercised by tests/strategies/test_nd_mla.py and
test_nd_patterns_fused.py (gloo process groups); docs/mla.md and docs/layer_patterns.md list what composes.
"""

from __future__ import annotations

import os

import torch

from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.models.layer_pattern import cla_kv_sources, pattern_layers
from lightning_llmopt.parallel.memory import estimate_memory
from lightning_llmopt.parallel.pipeline_split import block_costs, split_stages

MODELS = {
    "MLA (q_lora_rank 24)": dict(
        mla=dict(kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=24)
    ),
    "local x3 + global, windows of 8": dict(
        sliding_window=8, layer_types=pattern_layers(["local"] * 3 + ["global"], 4)
    ),
    "CLA-2 (layers 1, 3 read 0, 2)": dict(kv_sources=cla_kv_sources(4, 2)),
}


def fused_vs_plain(overrides: dict) -> None:
    torch.manual_seed(0)
    plain = Llama(LlamaConfig.from_preset("tiny", n_layers=4, **overrides))
    fused = Llama(LlamaConfig.from_preset("tiny", n_layers=4, fused_kernels=["all"], **overrides))
    fused.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, 320, (2, 33), generator=torch.Generator().manual_seed(1))
    a, b = plain.loss(tokens[:, :-1], tokens[:, 1:]), fused.loss(tokens[:, :-1], tokens[:, 1:])
    print(f"  loss plain {a.item():.6f}  fused {b.item():.6f}  (diff {abs(a - b).item():.1e})")
    print(f"  swapped in: {fused.llmopt_fused}")


def estimates(overrides: dict) -> None:
    config = LlamaConfig.from_preset("tiny", n_layers=4, **overrides)
    est = estimate_memory(config, stage=3, world_size=2, precision="bf16-mixed", micro_batch=2, seq_len=64)
    print(f"  parameters: estimator {est.num_params:,}  built model {Llama(config).num_params():,}")
    print(f"  activations per rank (bf16-mixed, 2 x 64 tokens): {est.activations / 2**20:.2f} MiB")
    blocks, _, _ = block_costs(config, seq_len=64)
    split = split_stages(config, 2, split="cost", seq_len=64)
    print(f"  block costs {[round(c, 4) for c in blocks]}  -> 2-stage split {split.ranges}")


def main() -> None:
    os.environ.setdefault("LLMOPT_FUSED_BACKEND", "reference")  # the Triton kernels need a GPU (or the interpreter)
    for name, overrides in MODELS.items():
        print(name)
        fused_vs_plain(overrides)
        estimates(overrides)


if __name__ == "__main__":
    main()
