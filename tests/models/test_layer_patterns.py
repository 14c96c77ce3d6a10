"""Layer patterns (per-layer windows) and cross-layer KV sharing in the model: config checks, an fp64 reference
written out layer by layer, the KV-cache decode, our flash-attention (Triton) path in training, checkpointing."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_llmopt.models import Llama, LlamaConfig, StaticKVCache
from lightning_llmopt.models.layer_pattern import (
    cla_kv_sources,
    kv_cache_bytes,
    kv_producers,
    layer_windows,
    pattern_layers,
)
from lightning_llmopt.testing.triton import triton_available, triton_interpreter_enabled

BOTH = dict(n_layers=4, sliding_window=5, layer_types=["local", "local", "local:3", "global"], kv_sources=[0, 0, 2, 3])


def _cfg(**overrides):
    return LlamaConfig.from_preset("tiny", **overrides)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(layer_types=["local", "global"]), "sliding_window is None"),
        (dict(layer_types=["global"]), "layer_types has 1 entries but n_layers is 2"),
        (dict(layer_types=["local:0", "global"]), "window must be a positive integer"),
        (dict(layer_types=["sliding", "global"]), r"layer_types\[0\] \('sliding'\)"),
        (dict(kv_sources=[0, 2]), r"kv_sources\[1\] \(2\) must name this layer or one below"),
        (dict(n_layers=3, kv_sources=[0, 0, 1]), r"names layer 1, which reads layer 0's K/V itself"),
        (dict(layer_types=["local:4", "global"], kv_sources=[0, 0]), "must have the same window"),
    ],
)
def test_config_names_bad_values(overrides, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**overrides)


def test_helpers():
    assert pattern_layers(["local"] * 2 + ["global"], 5) == ["local", "local", "global", "local", "local"]
    assert cla_kv_sources(5, 2) == [0, 0, 2, 2, 4]
    cfg = _cfg(**BOTH)
    assert layer_windows(cfg) == [5, 5, 3, None] and kv_producers(cfg) == [0, 2, 3]
    # bytes: producers 0 (window 5), 2 (window 3), 3 (global), bf16, 2 kv heads of 16
    assert kv_cache_bytes(cfg, context=100) == 2 * 2 * 16 * 2 * (5 + 3 + 100)
    model = Llama(cfg)
    assert model.layers["1"].attention.wk is None and "layers.1.attention.wv.weight" not in model.state_dict()


def _reference(model: Llama, tokens: torch.Tensor) -> torch.Tensor:
    """fp64 forward written out from the definitions: per-layer window mask, K/V taken from the source layer."""
    cfg = model.config
    sd = {k: v.double() for k, v in model.state_dict().items()}
    B, T = tokens.shape
    D, H, Hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]  # (T, D/2)
    cos, sin = ang.cos(), ang.sin()

    def rope(x):  # (B, h, T, D): channel c paired with c + D/2 ("rotate half")
        x0, x1 = x[..., : D // 2], x[..., D // 2 :]
        return torch.cat([x0 * cos - x1 * sin, x1 * cos + x0 * sin], -1)

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * w

    i_idx, j_idx = torch.arange(T)[:, None], torch.arange(T)[None]
    h = sd["tok_embeddings.weight"][tokens]
    kv = {}
    for layer in range(cfg.n_layers):
        p = f"layers.{layer}."
        x = norm(h, sd[p + "attention_norm.weight"])
        q = rope((x @ sd[p + "attention.wq.weight"].T).view(B, T, H, D).transpose(1, 2))
        src = cfg.kv_source(layer)
        if src == layer:
            k = rope((x @ sd[p + "attention.wk.weight"].T).view(B, T, Hkv, D).transpose(1, 2))
            v = (x @ sd[p + "attention.wv.weight"].T).view(B, T, Hkv, D).transpose(1, 2)
            kv[layer] = (k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1))
        k, v = kv[src]
        w = cfg.layer_window(layer)
        allowed = (j_idx <= i_idx) & ((i_idx - j_idx < w) if w is not None else True)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        o = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v
        h = h + o.transpose(1, 2).reshape(B, T, -1) @ sd[p + "attention.wo.weight"].T
        x = norm(h, sd[p + "ffn_norm.weight"])
        f = F.silu(x @ sd[p + "feed_forward.w1.weight"].T) * (x @ sd[p + "feed_forward.w3.weight"].T)
        h = h + f @ sd[p + "feed_forward.w2.weight"].T
    return norm(h, sd["norm.weight"]) @ sd["output.weight"].T


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_model_matches_fp64_reference(backend):
    torch.manual_seed(0)
    model = Llama(_cfg(attn_backend=backend, init_std=0.1, **BOTH))
    tokens = torch.randint(0, 320, (2, 19))
    ref = _reference(model, tokens)
    plain = Llama(_cfg(attn_backend=backend, init_std=0.1, n_layers=4))
    err = (model(tokens).double() - ref).abs().max()
    # the same fp32 model without the pattern, against its own fp64 evaluation, bounds the rounding error
    err_plain = (plain(tokens).double() - _reference(plain, tokens)).abs().max()
    assert err_plain < 1e-4 and err <= 4 * err_plain + 1e-6, (err, err_plain)
    # and the pattern matters: dropping it changes the logits by far more than rounding
    other = Llama(_cfg(attn_backend=backend, init_std=0.1, n_layers=4, kv_sources=[0, 0, 2, 2]))
    assert (other(tokens).double() - ref).abs().max() > 100 * err


def test_kv_cache_decode_matches_full_forward():
    torch.manual_seed(1)
    model = Llama(_cfg(init_std=0.1, **BOTH)).eval()
    tokens = torch.randint(0, 320, (2, 17))
    full = model(tokens)
    cache = StaticKVCache.for_model(model, batch_size=2, max_seq_len=32)
    out = [model(tokens[:, :9], kv_cache=cache)]
    for t in range(9, 17):
        out.append(model(tokens[:, t : t + 1], positions=torch.full((2, 1), t), kv_cache=cache))
    torch.testing.assert_close(torch.cat(out, 1), full, atol=1e-5, rtol=1e-4)


def test_activation_checkpointing_keeps_gradients():
    from lightning_llmopt.parallel.activation_checkpointing import apply_activation_checkpointing

    torch.manual_seed(2)
    model = Llama(_cfg(**BOTH))
    ckpt = Llama(_cfg(**BOTH))
    ckpt.load_state_dict(model.state_dict())
    apply_activation_checkpointing(ckpt, "full")
    tokens = torch.randint(0, 320, (2, 13))
    model.loss(tokens, tokens).backward()
    ckpt.loss(tokens, tokens).backward()
    for (name, p), q in zip(model.named_parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.skipif(
    not triton_available() or not (torch.cuda.is_available() or triton_interpreter_enabled()),
    reason="needs triton (and TRITON_INTERPRET=1 without CUDA)",
)
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
def test_training_through_flash_attention_matches_eager(monkeypatch):
    """Two SGD steps with our flash-attention kernel (each layer its own window) against the eager softmax."""
    import importlib

    fa = importlib.import_module("lightning_llmopt.kernels.flash_attention")  # the module, not the function

    calls = []
    original = fa.flash_attention

    def counting(*args, **kwargs):
        calls.append(kwargs.get("window"))
        return original(*args, **kwargs)

    monkeypatch.setattr(fa, "flash_attention", counting)
    torch.manual_seed(3)
    models = [Llama(_cfg(attn_backend=b, **BOTH)) for b in ("triton", "eager")]
    models[1].load_state_dict(models[0].state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in models]  # linear in the gradients
    for step in range(2):
        tokens = torch.randint(0, 320, (2, 11), generator=torch.Generator().manual_seed(step))
        losses = []
        for m, opt in zip(models, opts, strict=True):
            loss = m.loss(tokens, tokens)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss)
        torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=1e-5)
    assert set(calls) == {5, 3, None}  # the kernel ran with every layer's own window
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=name)
