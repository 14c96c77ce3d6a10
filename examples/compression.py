"""Distil a half-depth student from a teacher, then prune it: magnitude, SparseGPT, 2:4 and structured.

    python examples/compression.py            # a tiny teacher trained for a minute on the standard library

Public API only: ``lightning_llmopt.compression``, ``lightning_llmopt.callbacks``, ``lightning_llmopt.models``,
``lightning_llmopt.data`` and ``lightning_llmopt.quantization`` (evaluation).
"""

from __future__ import annotations

import argparse
import copy

import lightning as L
import torch

from lightning_llmopt import CausalLMModule
from lightning_llmopt.callbacks.distillation import Distillation
from lightning_llmopt.callbacks.pruning import Pruning
from lightning_llmopt.compression import plan_structured, prune_model, prune_structured
from lightning_llmopt.data import TextDataModule
from lightning_llmopt.quantization import perplexity


def fit(module: CausalLMModule, dm: TextDataModule, steps: int, callbacks: list) -> CausalLMModule:
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(module, datamodule=dm)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=150)
    args = p.parse_args()
    torch.manual_seed(0)
    dm = TextDataModule(seq_len=128, batch_size=8, max_bytes=2_000_000)
    dm.setup("fit")
    val = [dm.val_dataset[i]["input_ids"][None] for i in range(8)]
    val = [torch.cat([v, dm.val_dataset[i]["labels"][None, -1:]], 1) for i, v in enumerate(val)]  # (1, T + 1)
    calib = [dm.train_dataset[i]["input_ids"][None] for i in range(16)]

    teacher = fit(CausalLMModule("debug-1m", learning_rate=3e-3, warmup_steps=10), dm, args.steps, []).model
    assert teacher is not None
    print(f"teacher (4 blocks):        ppl {perplexity(teacher, val):.3f}")

    # distillation: the callback holds the frozen teacher; only the student is optimized
    student = CausalLMModule("debug-1m", model_overrides={"n_layers": 2}, learning_rate=3e-3, warmup_steps=10)
    fit(student, dm, args.steps, [Distillation(teacher, temperature=2.0, alpha=0.5)])
    print(f"distilled student (2):     ppl {perplexity(student.model, val):.3f}")

    # one-shot pruning at 50%
    for method in ("magnitude", "sparsegpt"):
        for pattern in ("unstructured", "2:4"):
            model = copy.deepcopy(teacher)
            prune_model(model, 0.5, method, pattern, calibration=calib if method == "sparsegpt" else None)
            print(f"{method:9s} {pattern:12s}    ppl {perplexity(model, val):.3f}")

    # gradual magnitude pruning during fine-tuning
    module = CausalLMModule("debug-1m", learning_rate=1e-3, warmup_steps=0)
    module.configure_model()
    module.model.load_state_dict(teacher.state_dict())
    fit(module, dm, 60, [Pruning(sparsity=0.5, start_step=0, end_step=40, frequency=10)])
    print(f"gradual 50% + fine-tune:   ppl {perplexity(module.model, val):.3f}")

    # structured: drop one of the two key/value groups and half the MLP channels; the model really shrinks
    small = prune_structured(copy.deepcopy(teacher), plan_structured(teacher, n_kv_heads=1, ffn_hidden_dim=192))
    print(
        f"structured {small.num_params()} / {teacher.num_params()} params: ppl {perplexity(small, val):.3f} "
        f"(n_heads={small.config.n_heads}, n_kv_heads={small.config.n_kv_heads}, ffn={small.config.ffn_hidden_dim})"
    )


if __name__ == "__main__":
    main()
