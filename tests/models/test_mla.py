"""Multi-head latent attention (MLA) in the reference model: the absorbed decode form against the naive one, an
explicit fp64 re-derivation of the DeepSeek-V2 equations, training through our flash kernel against the plain torch
path (derived tolerance), a short training run, and the config's errors."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from lightning_llmopt.models import Llama, LlamaConfig, StaticKVCache
from lightning_llmopt.models.mla_config import MLAConfig
from lightning_llmopt.testing.triton import triton_available, triton_interpreter_enabled

# qk head dim 32 (24 + 8) differs from the value head dim 16, as DeepSeek's 192 vs 128.
MLA = dict(kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=16)


def _model(seed: int = 0, **overrides) -> Llama:
    torch.manual_seed(seed)
    values = dict(mla=dict(MLA), init_std=0.1)
    values.update(overrides)
    return Llama(LlamaConfig.from_preset("tiny", **values)).eval()


def _set_absorb(model: Llama, absorb: bool) -> None:
    for block in model.layers.values():
        block.attention.absorb = absorb


def _decode_logits(model: Llama, tokens: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits of every position: a prefill of ``prefill`` tokens, then one token per step, through a cache."""
    B, T = tokens.shape
    cache = StaticKVCache.for_model(model, B, T + 1)
    outs = [model(tokens[:, :prefill], positions=torch.arange(prefill).expand(B, prefill), kv_cache=cache)]
    for i in range(prefill, T):
        outs.append(model(tokens[:, i : i + 1], positions=torch.full((B, 1), i), kv_cache=cache))
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_absorbed_decode_equals_naive(q_lora_rank):
    model = _model(mla=dict(MLA, q_lora_rank=q_lora_rank))
    tokens = torch.randint(0, 320, (2, 17))
    with torch.no_grad():
        _set_absorb(model, False)
        naive = _decode_logits(model, tokens, prefill=6)
        _set_absorb(model, True)
        absorbed = _decode_logits(model, tokens, prefill=6)
        full = model(tokens)
    scale = naive.abs().max()
    assert (absorbed - naive).abs().max() / scale <= 1e-5
    assert (naive - full).abs().max() / scale <= 1e-5  # the cached naive decode is the model's forward


def _reference_attention(attn, x: torch.Tensor, theta: float) -> torch.Tensor:
    """DeepSeek-V2's MLA equations (arXiv 2405.04434, eq. 37-47) written out per head in fp64, with the rotate-half
    RoPE computed from scratch: an oracle that shares no code with ``models/mla.py``."""
    H, r, dn, dr, dv = attn.n_heads, attn.r, attn.d_n, attn.d_r, attn.d_v
    B, T, _ = x.shape
    x = x.double()
    w = {k: v.detach().double() for k, v in attn.state_dict().items()}

    def rms(t, g):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * g

    def rot(t):  # (..., T, dr)
        inv = theta ** (-torch.arange(0, dr, 2, dtype=torch.float64) / dr)
        ang = torch.arange(T, dtype=torch.float64)[:, None] * inv
        a, b = t[..., : dr // 2], t[..., dr // 2 :]
        return torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], -1)

    q = (x @ w["wq.weight"].T).view(B, T, H, dn + dr)
    kv = x @ w["wkv_a.weight"].T
    c, k_pe = rms(kv[..., :r], w["kv_norm.weight"]), rot(kv[..., r:])
    up = (c @ w["wkv_b.weight"].T).view(B, T, H, dn + dv)
    outs = []
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for h in range(H):
        qh = torch.cat([q[:, :, h, :dn], rot(q[:, :, h, dn:])], -1)
        kh = torch.cat([up[:, :, h, :dn], k_pe], -1)
        s = (qh @ kh.transpose(1, 2)) / math.sqrt(dn + dr)
        outs.append(torch.softmax(s.masked_fill(~causal, float("-inf")), -1) @ up[:, :, h, dn:])
    return torch.cat(outs, -1) @ w["wo.weight"].T


def test_attention_matches_fp64_equations():
    model = _model(attn_backend="eager")
    attn = model.layers["0"].attention
    x = torch.randn(2, 11, 64)
    pos = torch.arange(11).expand(2, 11)
    from lightning_llmopt.models.attention import AttentionMask

    out = attn(x, model.rope, pos, AttentionMask.causal(2, 11, x.device))
    ref = _reference_attention(attn, x, model.config.rope_theta)
    assert (out.double() - ref).abs().max() / ref.abs().max() < 1e-5


needs_triton = pytest.mark.skipif(
    not triton_available() or not (torch.cuda.is_available() or triton_interpreter_enabled()),
    reason="needs triton (and TRITON_INTERPRET=1 without CUDA)",
)


def _loss_and_grads(model: Llama, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model.loss(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.detach().double(), {n: p.grad.double() for n, p in model.named_parameters()}


@needs_triton
def test_training_through_flash_kernel_matches_torch(monkeypatch):
    """Forward and backward with ``attn_backend="triton"`` (v padded from 16 to the qk width 32, output sliced)
    against fp64: the error is at most 2x (+ a rounding floor) the error of the fp32 SDPA path."""
    fa = importlib.import_module("lightning_llmopt.kernels.flash_attention")  # the module, not the function

    calls = []
    real = fa.flash_attention
    monkeypatch.setattr(fa, "flash_attention", lambda *a, **k: calls.append(a[2].shape) or real(*a, **k))
    flash = _model(attn_backend="triton").train()
    sdpa = _model(attn_backend="sdpa").train()
    ref = _model(attn_backend="eager").double().train()
    tokens = torch.randint(0, 320, (2, 19))
    l_ref, g_ref = _loss_and_grads(ref, tokens)
    l_sdpa, g_sdpa = _loss_and_grads(sdpa, tokens)
    l_fl, g_fl = _loss_and_grads(flash, tokens)
    assert calls and all(s[-1] == 32 for s in calls)  # the kernel ran, on v padded to the qk head dim
    assert abs(l_fl - l_ref) <= 2 * abs(l_sdpa - l_ref) + 1e-6
    for name, g in g_ref.items():
        err_fl = (g_fl[name] - g).abs().max()
        err_sdpa = (g_sdpa[name] - g).abs().max()
        assert err_fl <= 2 * err_sdpa + 1e-6 * g.abs().max(), name  # floor: fp32 rounding of the largest entry


def test_short_training_run_loss_decreases():
    torch.manual_seed(0)
    model = _model(init_std=0.02, mla=dict(MLA, q_lora_rank=24)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.arange(33).repeat(4, 1) % 17  # a learnable periodic sequence
    losses = []
    for _ in range(30):
        loss = model.loss(data[:, :-1], data[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_shapes_and_parameter_names():
    model = _model(mla=dict(MLA, q_lora_rank=24))
    names = {n.split("attention.")[1] for n in model.state_dict() if ".attention." in n}
    assert names == {
        "wq_a.weight",
        "q_norm.weight",
        "wq_b.weight",
        "wkv_a.weight",
        "kv_norm.weight",
        "wkv_b.weight",
        "wo.weight",
    }
    assert model.rope.shape[1] == MLA["qk_rope_head_dim"] // 2
    cache = StaticKVCache.for_model(model, 1, 8)
    assert cache.k[0].shape == (1, 1, 8, MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"])


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (dict(qk_rope_head_dim=7), "qk_rope_head_dim \\(7\\) must be even"),
        (dict(kv_lora_rank=0), "kv_lora_rank \\(0\\) must be a positive"),
        (dict(q_lora_rank=-1), "q_lora_rank \\(-1\\)"),
    ],
)
def test_config_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        MLAConfig(**dict(MLA, **bad))


def test_config_refuses_sliding_window():
    with pytest.raises(ValueError, match="sliding_window \\(8\\)"):
        LlamaConfig.from_preset("tiny", mla=MLA, sliding_window=8)


def test_config_refuses_layer_patterns_and_kv_sharing():
    with pytest.raises(ValueError, match="layer_types \\(\\['local:4', 'global'\\]\\)"):
        LlamaConfig.from_preset("tiny", mla=MLA, layer_types=["local:4", "global"])
    with pytest.raises(ValueError, match="kv_sources \\(\\[0, 0\\]\\)"):
        LlamaConfig.from_preset("tiny", mla=MLA, kv_sources=[0, 0])


def test_config_roundtrip():
    cfg = LlamaConfig.from_preset("tiny", mla=MLA)
    again = LlamaConfig.from_dict(cfg.to_dict())
    assert again.mla == cfg.mla and isinstance(again.mla, MLAConfig)


def test_tensor_parallel_plan_refuses_mla():
    from lightning_llmopt.parallel.tp_plans import find_family

    with pytest.raises(ValueError, match="tensor parallelism has no plan for multi-head latent attention"):
        find_family(_model())
    assert find_family(Llama(LlamaConfig.from_preset("tiny"))).name == "llmopt-llama"


def test_context_parallel_refuses_mla():
    from lightning_llmopt.parallel.context_parallel import _attention_modules

    with pytest.raises(NotImplementedError, match="context parallelism does not support multi-head latent attention"):
        _attention_modules(_model())
    assert len(_attention_modules(Llama(LlamaConfig.from_preset("tiny")))) == 2


def test_lightning_module_trains_and_restores_mla(tmp_path):
    """``CausalLMModule`` with an MLA config: the loss falls under the Trainer and a checkpoint restores the model."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_llmopt import CausalLMModule

    L.seed_everything(0)
    rows = [(torch.arange(40) + i) % 7 for i in range(32)]
    data = [{"input_ids": r[:-1], "labels": r[1:]} for r in rows]
    module = CausalLMModule(
        "tiny", model_overrides={"vocab_size": 64, "mla": dict(MLA)}, learning_rate=3e-3, warmup_steps=2
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=25,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    batch = torch.stack([d["input_ids"] for d in data[:4]])
    module.configure_model()  # builds the model (fit keeps it)
    with torch.no_grad():
        before = module.model.loss(batch, torch.stack([d["labels"] for d in data[:4]])).item()
    trainer.fit(module, DataLoader(data, batch_size=8, shuffle=True))
    module.eval()
    with torch.no_grad():
        after = module.model.loss(batch, torch.stack([d["labels"] for d in data[:4]])).item()
    assert after < 0.5 * before
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    restored = CausalLMModule.load_from_checkpoint(tmp_path / "m.ckpt").eval()
    assert restored.config == module.config and restored.config.mla is not None
    torch.testing.assert_close(restored(batch), module(batch), rtol=0, atol=0)


def test_optimize_model_sets_the_mla_attention_backend():
    from lightning_llmopt.optimize import optimize_model

    model = _model()
    optimize_model(model, rmsnorm=False, rope=False, swiglu=False, fused_ce=False, attention="eager")
    assert {block.attention.backend for block in model.layers.values()} == {"eager"}
    assert model.config.attn_backend == "eager"
