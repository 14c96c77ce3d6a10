"""Distillation losses against float64 references written here from the formulas, and attention-map capture
against the model's own eager backend."""

from __future__ import annotations

import pytest
import torch

from lightning_llmopt.compression import (
    FeatureProjector,
    LayerCapture,
    attention_map_loss,
    default_layer_map,
    distillation_loss,
    feature_loss,
    kl_distillation_loss,
)
from lightning_llmopt.models import Llama, LlamaConfig


def _kl_ref(s: torch.Tensor, t: torch.Tensor, temp: float, mask: torch.Tensor) -> torch.Tensor:
    """float64 sum_v p_t (log p_t - log p_s), loops over tokens."""
    s, t = s.double() / temp, t.double() / temp
    vals = []
    for idx in mask.nonzero():
        ps = torch.exp(s[tuple(idx)] - torch.logsumexp(s[tuple(idx)], 0))
        pt = torch.exp(t[tuple(idx)] - torch.logsumexp(t[tuple(idx)], 0))
        vals.append((pt * (pt.log() - ps.log())).sum())
    return torch.stack(vals).mean() * temp**2


def test_kl_zero_for_identical_logits_and_matches_float64() -> None:
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 7, 33, generator=g) * 3
    t = torch.randn(2, 7, 33, generator=g) * 3
    labels = torch.randint(0, 33, (2, 7), generator=g)
    labels[0, :3] = -100
    assert kl_distillation_loss(s, s.clone(), 2.0, labels).abs().item() < 1e-6
    for temp in (0.5, 1.0, 4.0):
        ours = kl_distillation_loss(s, t, temp, labels).double()
        ref = _kl_ref(s, t, temp, labels != -100)
        # fp32 log-softmax of O(10) logits: a few ulps of the summands; the fp32 rounding of the inputs is shared
        assert abs(ours - ref) <= 1e-5 * max(1.0, float(ref))
    assert float(kl_distillation_loss(s, t, 2.0)) > 0


def test_kl_gradient_and_mixing() -> None:
    g = torch.Generator().manual_seed(1)
    s = torch.randn(3, 5, 11, generator=g, requires_grad=True)
    t = torch.randn(3, 5, 11, generator=g)
    labels = torch.randint(0, 11, (3, 5), generator=g)
    total, kl, ce = distillation_loss(s, t, labels, temperature=2.0, alpha=0.3)
    assert torch.allclose(total, 0.3 * kl + 0.7 * ce)
    ce_ref = torch.nn.functional.cross_entropy(s.double().flatten(0, 1), labels.flatten())
    assert abs(float(ce.detach()) - float(ce_ref)) < 1e-5
    # d KL / d s = T (p_s - p_t) / N_tokens at temperature T (times T^2 / T^2)
    kl_only = kl_distillation_loss(s, t, 2.0)
    (grad,) = torch.autograd.grad(kl_only, s)
    ref = 2.0 * (torch.softmax(s.double() / 2, -1) - torch.softmax(t.double() / 2, -1)) / 15
    assert torch.allclose(grad.double(), ref, atol=1e-6)
    with pytest.raises(ValueError, match="alpha"):
        distillation_loss(s, t, labels, alpha=1.5)


def test_feature_loss_with_projection() -> None:
    g = torch.Generator().manual_seed(2)
    hs = torch.randn(2, 4, 8, generator=g)
    ht = torch.randn(2, 4, 12, generator=g)
    proj = FeatureProjector(8, 12, 1)
    ref = (proj.proj[0](hs).double() - ht.double()).pow(2).mean()
    assert abs(float(feature_loss([hs], [ht], proj)) - float(ref)) < 1e-6
    assert float(feature_loss([ht], [ht.clone()])) == 0.0
    with pytest.raises(ValueError, match="projector"):
        feature_loss([hs], [ht])
    assert len(FeatureProjector(8, 8, 3).proj) == 0  # equal widths: identity
    assert default_layer_map(2, 4) == [(0, 1), (1, 3)]
    assert default_layer_map(3, 3) == [(0, 0), (1, 1), (2, 2)]


def test_attention_capture_matches_eager_backend_and_loss() -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig.from_preset("tiny", attn_backend="eager")
    model = Llama(cfg).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 17))
    with LayerCapture(model, hidden_layers=[0, 1], attention_layers=[1]) as cap:
        logits = model(tokens)
    probs = cap.attention_probs(1)  # (B, H, T, T)
    assert probs.shape == (2, cfg.n_heads, 17, 17)
    assert torch.allclose(probs.sum(-1), torch.ones(2, cfg.n_heads, 17))
    assert (probs.triu(1) == 0).all()  # causal
    # the probabilities reproduce the attention output of block 1 (eager backend, fp32)
    attn = model.layers["1"].attention
    x, rope, positions, mask = cap._attn_inputs[1]
    v = attn.wv(x).view(2, 17, -1, attn.head_dim).transpose(1, 2).repeat_interleave(cfg.n_rep, 1)
    out = attn.wo((probs @ v).transpose(1, 2).reshape(2, 17, -1))
    assert torch.allclose(out, attn(x, rope, positions, mask), atol=1e-6)
    assert cap.hidden[1].shape == (2, 17, cfg.dim) and torch.isfinite(logits).all()
    assert float(attention_map_loss([probs], [probs.clone()])) < 1e-6
    other = torch.softmax(torch.randn(2, 1, 17, 17).masked_fill(probs[:, :1] == 0, -torch.inf), -1)
    assert float(attention_map_loss([probs], [other])) > 0  # head counts differ: head-averaged maps
