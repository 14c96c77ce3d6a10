"""Fused training kernels through the public API: the functions, optimize_model on our Llama and on a transformers
Llama, and the config flag with Lightning.

Runs on a CUDA GPU with the Triton kernels, or on CPU with the PyTorch references (``backend="auto"``); set
``TRITON_INTERPRET=1`` and ``LLMOPT_FUSED_BACKEND=triton`` to run the kernels on CPU in the Triton interpreter.

    python examples/fused_kernels.py
"""

from __future__ import annotations

import copy

import torch

from lightning_llmopt import CausalLMModule
from lightning_llmopt.kernels.fused_linear_ce import fused_linear_cross_entropy
from lightning_llmopt.kernels.rmsnorm import rms_norm
from lightning_llmopt.kernels.rotary import apply_rotary_
from lightning_llmopt.kernels.swiglu import swiglu
from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.models.rope import rope_table
from lightning_llmopt.optimize import optimize_model


def functions(device: str, dtype: torch.dtype) -> None:
    x = torch.randn(4, 128, 256, device=device, dtype=dtype)
    y = rms_norm(x, torch.ones(256, device=device, dtype=dtype), eps=1e-5)  # (B, T, D)
    h = swiglu(
        torch.randn(4, 128, 512, device=device, dtype=dtype), torch.randn(4, 128, 512, device=device, dtype=dtype)
    )
    q = torch.randn(4, 128, 8, 64, device=device, dtype=dtype)  # (B, T, H, D), rotated in place
    table = rope_table(128, 64, 10000.0, device=device)  # (T, D/2, 2) fp32 cos/sin
    apply_rotary_(q, table[..., 0], table[..., 1], torch.arange(128, device=device).expand(4, 128))
    hidden = torch.randn(512, 256, device=device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(32000, 256, device=device, dtype=dtype) * 0.02).requires_grad_()
    labels = torch.randint(0, 32000, (512,), device=device)
    loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=128)  # never holds 512 x 32000 logits
    loss.backward()
    print(
        f"rms_norm {tuple(y.shape)}, swiglu {tuple(h.shape)}, rotary in place {tuple(q.shape)}, "
        f"fused CE loss {loss.item():.3f}, |d hidden| {hidden.grad.norm().item():.3f}"
    )


def reference_model(device: str) -> None:
    torch.manual_seed(0)
    plain = Llama(LlamaConfig.from_preset("tiny")).to(device)
    fused = optimize_model(copy.deepcopy(plain))  # same parameters, fused modules
    tokens = torch.randint(0, 320, (2, 64), device=device)
    a, b = plain.loss(tokens, tokens), fused.loss(tokens, tokens)
    print(f"Llama: replaced {fused.llmopt_fused}; loss plain {a.item():.6f} fused {b.item():.6f}")


def transformers_model(device: str) -> None:
    try:
        import transformers
    except ImportError:
        print("transformers not installed: skipping")
        return
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).to(device).train()
    ref = copy.deepcopy(hf)
    optimize_model(hf)  # norms, MLPs, rotary (per instance) and the training loss
    tokens = torch.randint(0, 128, (2, 32), device=device)
    a, b = ref(input_ids=tokens, labels=tokens).loss, hf(input_ids=tokens, labels=tokens).loss
    print(f"transformers LlamaForCausalLM: replaced {hf.llmopt_fused}; loss {a.item():.6f} vs fused {b.item():.6f}")


def lightning_flag() -> None:
    module = CausalLMModule("tiny", model_overrides={"fused_kernels": ["all"]})
    module.configure_model()
    print(f"CausalLMModule with fused_kernels=['all']: {module.model.llmopt_fused}")


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    functions(device, torch.bfloat16 if device == "cuda" else torch.float32)
    reference_model(device)
    transformers_model(device)
    lightning_flag()


if __name__ == "__main__":
    main()
