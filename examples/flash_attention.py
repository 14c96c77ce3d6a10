"""Flash attention through the public API: dense causal GQA, a packed batch of documents, and the lse output.

Runs on a CUDA GPU with the Triton kernels, or on CPU with the PyTorch reference (``backend="auto"``); set
``TRITON_INTERPRET=1`` and ``LLMOPT_FLASH_BACKEND=triton`` to run the kernels on CPU in the Triton interpreter.

    python examples/flash_attention.py
"""

from __future__ import annotations

import torch

from lightning_llmopt.kernels import flash_attention, flash_attention_ref
from lightning_llmopt.layers import FlashAttention


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)

    # Dense, causal, GQA 4:1: q (B, S, H, D), k/v (B, S, H_kv, D).
    q = torch.randn(2, 256, 8, 64, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 256, 2, 64, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 256, 2, 64, device=device, dtype=dtype, requires_grad=True)
    out, lse = flash_attention(q, k, v, causal=True, window=128, return_lse=True)
    out.float().square().mean().backward()
    ref = flash_attention_ref(q.detach().double(), k.detach().double(), v.detach().double(), causal=True, window=128)
    print(f"dense: out {tuple(out.shape)}, lse {tuple(lse.shape)}, max |out - fp64 ref| = "
          f"{(out.detach().double() - ref).abs().max().item():.2e}, |dq| = {q.grad.norm().item():.3f}")

    # Packed documents of 100, 37 and 119 tokens: (total, H, D) with cumulative lengths; no cross-document attention.
    cu_seqlens = torch.tensor([0, 100, 137, 256], device=device, dtype=torch.int32)
    layer = FlashAttention(causal=True)
    packed = layer(q.detach()[0], k.detach()[0], v.detach()[0], cu_seqlens=cu_seqlens, max_seqlen=119)
    alone = layer(q.detach()[:1, 100:137], k.detach()[:1, 100:137], v.detach()[:1, 100:137])[0]
    print(f"packed: document 2 alone vs in the pack, max diff = {(packed[100:137] - alone).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
