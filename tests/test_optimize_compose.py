"""Fused kernels (``fused_kernels=["all"]``, the CUDA default) with the attention options: MLA (with and without
``q_lora_rank``), ``layer_types`` mixing windows, and ``kv_sources`` cross-layer sharing. Each fused model (Triton
kernels through the interpreter on CPU) is compared with the same weights in the model without kernels and with an
fp64 copy of it.

Tolerance (derived, as CONVENTIONS.md asks): the fused fp32 model's relative error against the fp64 model, over
the loss and over all gradients, is at most twice the plain fp32 model's error plus 4 fp32 ulps (2.4e-7: both
errors are a few ulps here and the plain one can land near zero by chance).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from lightning_llmopt.layers.rotary import FusedRotary
from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.models.mla import MLAttention
from lightning_llmopt.testing.triton import triton_available, triton_interpreter_enabled

pytestmark = pytest.mark.skipif(
    not triton_available() or not (torch.cuda.is_available() or triton_interpreter_enabled()),
    reason="needs triton (and TRITON_INTERPRET=1 without CUDA)",
)
FLOOR = 4 * torch.finfo(torch.float32).eps
MLA = dict(kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=16)
CASES = {
    "mla": dict(mla=dict(MLA)),
    "mla_q_lora": dict(mla=dict(MLA, q_lora_rank=24)),
    "layer_types": dict(sliding_window=5, layer_types=["local", "global", "local:3"], n_layers=3),
    "kv_sources": dict(kv_sources=[0, 0, 2], n_layers=3),
    "kv_sources_windows": dict(
        sliding_window=4, layer_types=["local", "local", "global"], kv_sources=[0, 0, 2], n_layers=3
    ),
}
# What the kernel step swaps in (per model): K/V readers have no wk/wv, so nothing to pack there.
PACKED = {"mla": 2, "mla_q_lora": 2, "layer_types": 3, "kv_sources": 2, "kv_sources_windows": 2}


def _loss_and_grads(model: Any, tokens: torch.Tensor, labels: torch.Tensor, **kw: Any) -> torch.Tensor:
    """The loss followed by every gradient, flattened in parameter-name order, as fp64."""
    model.zero_grad(set_to_none=True)
    loss = model.loss(tokens, labels, **kw)
    loss.backward()
    grads = [p.grad.reshape(-1) for _, p in sorted(model.named_parameters())]
    return torch.cat([loss.detach().reshape(1), *grads]).double()


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).norm() / ref.norm())


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_kernels_match_the_plain_model(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMOPT_FUSED_BACKEND", "triton")
    rotations: list[int] = []
    rotate = FusedRotary.rotate
    monkeypatch.setattr(FusedRotary, "rotate", lambda self, *a: rotations.append(1) or rotate(self, *a))
    torch.manual_seed(0)
    plain = Llama(LlamaConfig.from_preset("tiny", **CASES[name]))
    fused = Llama(LlamaConfig.from_preset("tiny", fused_kernels=["all"], **CASES[name]))
    fused.load_state_dict(plain.state_dict())
    n_layers = plain.config.n_layers
    assert fused.llmopt_fused == {
        "rmsnorm": 2 * n_layers + 1 + (n_layers if "mla" in name else 0) + (n_layers if "q_lora" in name else 0),
        "rope": n_layers,
        "swiglu": n_layers,
        "fused_ce": 1,
        "attention": 0,
        "packed_qkv": PACKED[name],
    }
    ref64 = copy.deepcopy(plain).double()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 320, (2, 13), generator=g)
    labels = torch.randint(0, 320, (2, 13), generator=g)
    labels[0, :3] = -100
    docs = torch.tensor([[0] * 6 + [1] * 7, [0] * 13])  # packed rows: attention stays inside documents
    for kw in ({}, {"doc_ids": docs}):
        rotations.clear()
        want = _loss_and_grads(ref64, tokens, labels, **kw)
        got = _loss_and_grads(fused, tokens, labels, **kw)
        base = _loss_and_grads(plain, tokens, labels, **kw)
        # every layer's queries go through the fused rotation (MLA: its query and shared-key RoPE channels)
        assert len(rotations) == (2 * n_layers if "mla" in name or "kv" not in name else n_layers + 2), rotations
        err, err_plain = _rel(got, want), _rel(base, want)
        assert err <= 2 * err_plain + FLOOR, (name, kw.keys(), err, err_plain)


def test_mla_packed_projection_falls_back_for_hooked_modules() -> None:
    """MLA's packed projection (one GEMM over ``wq``/``wq_a`` and ``wkv_a``) gives the unpacked gradients; a hooked
    projection (a shard, an adapter) takes two GEMMs again."""
    from lightning_llmopt.optimize import optimize_model

    torch.manual_seed(0)
    plain = Llama(LlamaConfig.from_preset("tiny", mla=dict(MLA, q_lora_rank=24)))
    model = copy.deepcopy(plain)
    optimize_model(model, rmsnorm=False, rope=False, swiglu=False, fused_ce=False)
    attn = model.layers["0"].attention
    assert isinstance(attn, MLAttention) and attn.pack_qkv and attn._packable()
    tokens = torch.randint(0, 320, (2, 9), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(
        _loss_and_grads(model, tokens, tokens), _loss_and_grads(plain, tokens, tokens), atol=1e-6, rtol=1e-5
    )  # the same fp32 products, summed in another order
    calls: list[int] = []
    attn.wkv_a.register_forward_hook(lambda *a: calls.append(1))
    assert not attn._packable()
    torch.testing.assert_close(
        _loss_and_grads(model, tokens, tokens), _loss_and_grads(plain, tokens, tokens), atol=1e-6, rtol=1e-5
    )
    assert calls == [1]


@pytest.mark.parametrize("name", ["mla_q_lora", "kv_sources_windows"])
@pytest.mark.parametrize("policy", ["full", "selective"])
def test_fused_kernels_with_activation_checkpointing(name: str, policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused model under activation checkpointing (the blocks' forward recomputed in backward: MLA's fused
    rotation and packed GEMM, a K/V reader whose source block is recomputed) gives the fused model's own gradients.
    Same kernels, same order: 1e-6 covers the recomputation's different intermediate allocation only. The kernels'
    reference path (the Triton path's numerics are the test above; this one is about recomputing the fused modules
    and hooks, and the interpreter would take ten times as long)."""
    from lightning_llmopt.parallel.activation_checkpointing import apply_activation_checkpointing

    monkeypatch.setenv("LLMOPT_FUSED_BACKEND", "reference")
    torch.manual_seed(0)
    fused = Llama(LlamaConfig.from_preset("tiny", fused_kernels=["all"], **CASES[name]))
    checkpointed = copy.deepcopy(fused)
    apply_activation_checkpointing(checkpointed, policy)
    g = torch.Generator().manual_seed(4)
    tokens, labels = torch.randint(0, 320, (2, 13), generator=g), torch.randint(0, 320, (2, 13), generator=g)
    want = _loss_and_grads(fused, tokens, labels)
    got = _loss_and_grads(checkpointed, tokens, labels)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
