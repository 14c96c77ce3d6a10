"""Layer patterns through Hugging Face interop: Qwen2 ``layer_types`` mixing sliding and full attention (5.x and the
4.x ``max_window_layers`` spelling) against transformers' logits in both directions, the engine against
transformers' greedy tokens, and clear refusals of what does not map (Gemma 2/3, Qwen3, cross-layer KV sharing)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_llmopt.models import Llama, LlamaConfig  # noqa: E402
from lightning_llmopt.models.hf import config_from_hf, config_to_hf, from_hf, to_hf  # noqa: E402

INIT, SEQ, WINDOW = 0.15, 17, 4
ATOL = 1e-4  # fp32 both sides, same math in another op order (as tests/models/test_hf.py)
TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
BASE: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    initializer_range=INIT,
)


def _qwen2(**extra: Any) -> Any:
    cfg = transformers.Qwen2Config(**{**BASE, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, INIT)
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "extra, kinds",
    [
        (
            dict(use_sliding_window=True, sliding_window=WINDOW, layer_types=TYPES),
            ["local", "global", "local", "local"],
        ),
        (dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2), ["global"] * 2 + ["local"] * 2),
    ],
)
@torch.no_grad()
def test_qwen2_layer_types_match_transformers(extra: dict[str, Any], kinds: list[str], tmp_path: Path) -> None:
    hf = _qwen2(**extra)
    tokens = _tokens()
    expected = hf(input_ids=tokens).logits
    ours = from_hf(hf, attn_backend="eager").eval()
    assert ours.config.layer_types == kinds and ours.config.sliding_window == WINDOW
    torch.testing.assert_close(ours(tokens), expected, atol=ATOL, rtol=0)
    # the pattern matters: the same weights with every layer global are far off
    flat = from_hf(hf, attn_backend="eager", layer_types=None, sliding_window=None).eval()
    assert (flat(tokens) - expected).abs().max() > 100 * ATOL
    # and back: our export loads in transformers as the same pattern and logits
    to_hf(ours, tmp_path, arch="qwen2")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert list(again.config.layer_types) == ["full_attention" if k == "global" else "sliding_attention" for k in kinds]
    torch.testing.assert_close(again(input_ids=tokens).logits, expected, atol=ATOL, rtol=0)


@torch.no_grad()
def test_ours_to_hf_pattern_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(3)
    cfg = LlamaConfig(
        vocab_size=128,
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden_dim=96,
        max_seq_len=64,
        init_std=INIT,
        qkv_bias=True,
        sliding_window=WINDOW,
        layer_types=["global", "local"] * 2,
    )
    ours = Llama(cfg).eval()
    for name, p in ours.named_parameters():
        if name.endswith("bias"):
            p.normal_(0.0, INIT)
    to_hf(ours, tmp_path)  # arch chosen from the config: qwen2
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert hf.config.model_type == "qwen2"
    tokens = _tokens()
    torch.testing.assert_close(hf(input_ids=tokens).logits, ours(tokens), atol=ATOL, rtol=0)
    back = from_hf(tmp_path)
    assert back.config.layer_types == cfg.layer_types
    assert all(torch.equal(back.state_dict()[k], v) for k, v in ours.state_dict().items())


def test_engine_serves_a_qwen2_pattern_like_transformers() -> None:
    from lightning_llmopt.inference import LLMEngine, SamplingParams

    hf = _qwen2(use_sliding_window=True, sliding_window=WINDOW, layer_types=TYPES)
    ours = from_hf(hf).eval()
    prompts = [[5, 9, 100, 3, 7, 7, 12], [1, 2], list(range(20, 31))]
    engine = LLMEngine(ours, block_size=4, num_blocks=64, max_num_batched_tokens=8)
    outs = engine.generate(prompts, SamplingParams(max_tokens=10))
    for p, o in zip(prompts, outs, strict=True):
        seq = torch.tensor([p])
        with torch.no_grad():
            for _ in range(10):  # transformers' own full recompute, argmax
                seq = torch.cat([seq, hf(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
        assert o.token_ids == seq[0, len(p) :].tolist()


@pytest.mark.parametrize(
    "model_type, match",
    [
        ("gemma2", "soft-caps attention and final logits"),
        ("gemma3_text", "rope_local_base_freq"),
        ("gemma3", "per-head q/k norms"),
        ("qwen3", r"q_norm, k_norm"),
    ],
)
def test_unmapped_architectures_say_why(model_type: str, match: str) -> None:
    cfg = dict(BASE, model_type=model_type, sliding_window=WINDOW)
    with pytest.raises(NotImplementedError, match=match):
        config_from_hf(cfg)


def test_gemma2_from_transformers_config_is_refused() -> None:
    cfg = transformers.Gemma2Config(**BASE, head_dim=16)
    with pytest.raises(NotImplementedError, match="Gemma 2 does not map"):
        config_from_hf(cfg)


def test_export_refusals() -> None:
    base = dict(vocab_size=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden_dim=96, max_seq_len=64)
    with pytest.raises(ValueError, match="cross-layer KV sharing has no transformers architecture"):
        config_to_hf(LlamaConfig(**base, kv_sources=[0, 0, 2, 2]), "llama")
    with pytest.raises(ValueError, match=r"different windows \(\[3, 5\]\)"):
        config_to_hf(
            LlamaConfig(**base, qkv_bias=True, layer_types=["local:3", "local:5", "global", "global"]), "qwen2"
        )
    with pytest.raises(ValueError, match="export only as 'qwen2'"):
        config_to_hf(LlamaConfig(**base, sliding_window=4, layer_types=["local", "global"] * 2), "mistral")
    # all local with one window is Mistral
    out = config_to_hf(LlamaConfig(**base, sliding_window=4, layer_types=["local"] * 4), "mistral")
    assert out["sliding_window"] == 4 and out["model_type"] == "mistral"
