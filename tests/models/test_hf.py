"""Hugging Face interop: logits parity with transformers models built from tiny random configs, both directions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_llmopt.models import Llama, LlamaConfig, RopeScaling  # noqa: E402
from lightning_llmopt.models.hf import (  # noqa: E402
    config_from_hf,
    config_to_hf,
    from_hf,
    state_dict_from_hf,
    state_dict_to_hf,
    to_hf,
)

# A larger init than the usual 0.02 makes attention peaky, so a wrong RoPE, mask or head mapping moves the logits
# by O(1) instead of hiding in near-uniform attention.
INIT = 0.15
WINDOW = 5  # smaller than SEQ, so the sliding window masks real keys
SEQ = 17
# fp32 on both sides with the same math in a different op order: observed differences are ~1e-6 on logits of size
# ~1-10; 1e-4 leaves margin while staying far below the O(0.1+) effect of any mapping error.
ATOL = 1e-4

_HF_BASE: dict[str, Any] = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, initializer_range=INIT,
)
# name -> (transformers config class, extra config fields)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama-tied-llama3": ("LlamaConfig", dict(
        tie_word_embeddings=True, num_key_value_heads=1, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8),
    )),
    "mistral-window": ("MistralConfig", dict(sliding_window=WINDOW)),
    "qwen2-bias-window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0,
                                              tie_word_embeddings=True)),
}


def _hf_model(case: str) -> Any:
    cls_name, extra = CASES[case]
    cfg = getattr(transformers, cls_name)(**{**_HF_BASE, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    if cls_name == "Qwen2Config":  # transformers zero-initialises biases: make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0.0, INIT)
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def _hf_logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens).logits


@torch.no_grad()
def _our_logits(model: Llama, tokens: torch.Tensor) -> torch.Tensor:
    return model.eval()(tokens)


@pytest.mark.parametrize("case", list(CASES))
def test_hf_to_ours_matches_logits(case: str, tmp_path: Path) -> None:
    hf = _hf_model(case)
    tokens = _tokens()
    expected = _hf_logits(hf, tokens)
    assert expected.abs().max() > 0.5  # the comparison below is not vacuous
    from_instance = from_hf(hf, attn_backend="eager")
    torch.testing.assert_close(_our_logits(from_instance, tokens), expected, atol=ATOL, rtol=0)
    hf.save_pretrained(tmp_path)
    from_dir = from_hf(tmp_path)
    torch.testing.assert_close(_our_logits(from_dir, tokens), expected, atol=ATOL, rtol=0)
    assert from_dir.config.tie_embeddings == hf.config.tie_word_embeddings
    if from_dir.config.tie_embeddings:
        assert from_dir.output.weight is from_dir.tok_embeddings.weight


def _our_model(arch: str, **overrides: Any) -> Llama:
    values: dict[str, Any] = dict(
        vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=96, max_seq_len=64,
        init_std=INIT, norm_eps=1e-6, qkv_bias=arch == "qwen2",
    )
    values.update(overrides)
    torch.manual_seed(2)
    model = Llama(LlamaConfig(**values))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "norm.weight")):  # non-trivial biases and norm scales
                p.normal_(1.0 if name.endswith("norm.weight") else 0.0, INIT)
    return model


OUR_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-untied": ("llama", dict(tie_embeddings=False)),
    "llama-tied-llama3": ("llama", dict(
        tie_embeddings=True, n_kv_heads=1, rope_theta=500000.0,
        rope_scaling=RopeScaling(type="llama3", factor=8.0, original_max_position_embeddings=8),
    )),
    "llama-linear-rope": ("llama", dict(rope_scaling=RopeScaling(type="linear", factor=2.0), head_dim=32)),
    "mistral-window": ("mistral", dict(sliding_window=WINDOW)),
    "qwen2-bias": ("qwen2", dict(tie_embeddings=True)),
    "qwen2-bias-window": ("qwen2", dict(sliding_window=WINDOW)),
}


@pytest.mark.parametrize("case", list(OUR_CASES))
def test_ours_to_hf_matches_logits(case: str, tmp_path: Path) -> None:
    arch, overrides = OUR_CASES[case]
    ours = _our_model(arch, **overrides)
    tokens = _tokens()
    expected = _our_logits(ours, tokens)
    to_hf(ours, tmp_path, arch=arch)
    assert not (tmp_path / "model.safetensors.index.json").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert hf.config.model_type == arch
    torch.testing.assert_close(_hf_logits(hf, tokens), expected, atol=ATOL, rtol=0)
    back = from_hf(tmp_path)
    assert back.state_dict().keys() == ours.state_dict().keys()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


@pytest.mark.parametrize("delta", [-1, 1])
def test_sliding_window_is_exactly_transformers(delta: int) -> None:
    """A window off by one key gives different logits, so the parity above pins the exact convention."""
    hf = _hf_model("mistral-window")
    tokens = _tokens()
    ours = from_hf(hf, sliding_window=WINDOW + delta)
    diff = (_our_logits(ours, tokens) - _hf_logits(hf, tokens)).abs().max()
    assert diff > 100 * ATOL


def test_sharded_export_loads_in_transformers_and_back(tmp_path: Path) -> None:
    ours = _our_model("llama", tie_embeddings=False)
    tokens = _tokens()
    to_hf(ours, tmp_path, max_shard_size="20KB")
    shards = sorted(p.name for p in tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert not (tmp_path / "model.safetensors").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    torch.testing.assert_close(_hf_logits(hf, tokens), _our_logits(ours, tokens), atol=ATOL, rtol=0)
    back = from_hf(tmp_path)
    for name, tensor in ours.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    assert not back.rope.is_meta
    torch.testing.assert_close(back.rope, ours.rope, atol=0, rtol=0)


def test_transformers_sharded_save_loads(tmp_path: Path) -> None:
    hf = _hf_model("llama-gqa")
    hf.save_pretrained(tmp_path, max_shard_size="30KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    tokens = _tokens()
    torch.testing.assert_close(_our_logits(from_hf(tmp_path), tokens), _hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_pytorch_bin_and_dtype(tmp_path: Path) -> None:
    hf = _hf_model("llama-gqa")
    (tmp_path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    tokens = _tokens()
    torch.testing.assert_close(_our_logits(from_hf(tmp_path), tokens), _hf_logits(hf, tokens), atol=ATOL, rtol=0)
    half = from_hf(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert half.rope.dtype == torch.float32
    out = tmp_path / "bf16"
    to_hf(half, out)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    reloaded = from_hf(out)
    assert reloaded.tok_embeddings.weight.dtype == torch.bfloat16
    assert torch.equal(reloaded.tok_embeddings.weight, half.tok_embeddings.weight)


def test_state_dict_round_trip_and_prefix() -> None:
    ours = _our_model("qwen2", tie_embeddings=True)
    hf_sd = state_dict_to_hf(ours.state_dict(), ours.config)
    assert "lm_head.weight" not in hf_sd and "model.layers.1.self_attn.k_proj.bias" in hf_sd
    back = state_dict_from_hf(hf_sd, ours.config)
    assert back.keys() == ours.state_dict().keys()
    assert back["output.weight"] is back["tok_embeddings.weight"]
    # A bare *Model state dict (no "model." prefix) with a rotary buffer loads too.
    bare = {k.removeprefix("model."): v for k, v in hf_sd.items()}
    bare["rotary_emb.inv_freq"] = torch.ones(8)
    assert state_dict_from_hf(bare, ours.config).keys() == back.keys()


def test_config_reads_4x_and_5x_rope_spellings() -> None:
    common = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64)
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8)
    v4, _ = config_from_hf({**common, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **scaling}})
    v5, _ = config_from_hf({**common, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}})
    assert v4 == v5 and v4.rope_theta == 5e5 and v4.rope_scaling == RopeScaling(type="llama3", **scaling)
    written = config_to_hf(v4, "llama")
    assert written["rope_parameters"]["rope_theta"] == 5e5 and written["rope_scaling"]["rope_type"] == "llama3"
    assert config_from_hf(written)[0] == v4
    mistral_dict = {**common, "model_type": "mistral", "num_key_value_heads": 2, "sliding_window": None}
    mistral, arch = config_from_hf(mistral_dict)
    assert arch == "mistral" and mistral.sliding_window is None


def _dict_config(**extra: Any) -> dict[str, Any]:
    base = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4)
    return {**base, **extra}


@pytest.mark.parametrize(("extra", "error", "match"), [
    (dict(model_type="gpt2"), ValueError, "'gpt2'"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), NotImplementedError, "'yarn'"),
    (dict(mlp_bias=True), NotImplementedError, "mlp_bias"),
    (dict(attention_bias=True), NotImplementedError, "attention_bias"),
    (dict(hidden_act="gelu"), NotImplementedError, "'gelu'"),
    # a Qwen2 window on only some layers is now supported (a layer pattern): tests/models/test_hf_patterns.py
])
def test_config_errors(extra: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        config_from_hf(_dict_config(**extra))


def test_export_and_load_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no config.json"):
        from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_dict_config(model_type="gpt2")))
    with pytest.raises(ValueError, match="'gpt2'"):
        from_hf(tmp_path)
    llama = _our_model("llama")
    with pytest.raises(ValueError, match="requires qkv_bias"):
        to_hf(llama, tmp_path / "x", arch="qwen2")
    with pytest.raises(ValueError, match="qkv_bias is True"):
        config_to_hf(_our_model("qwen2").config, "llama")
    with pytest.raises(ValueError, match="sliding_window is 5"):
        config_to_hf(_our_model("llama", sliding_window=WINDOW).config, "llama")
    hf_sd = state_dict_to_hf(llama.state_dict(), llama.config)
    with pytest.raises(ValueError, match=r"q_proj.weight: \(64, 64\) \(expected \(32, 64\)\)"):
        state_dict_from_hf(hf_sd, LlamaConfig(**{**llama.config.to_dict(), "n_heads": 2, "head_dim": 16}))
    del hf_sd["model.norm.weight"]
    hf_sd["model.extra.weight"] = torch.ones(1)
    with pytest.raises(KeyError, match=r"unknown keys \['model.extra.weight'\], missing keys \['model.norm.weight'\]"):
        state_dict_from_hf(hf_sd, llama.config)
