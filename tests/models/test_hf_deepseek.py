"""DeepSeek-V2/V3 (MLA) interop: logits parity with transformers models built from tiny random dense configs, in
both directions (from_hf of an instance, to_hf then transformers' from_pretrained), and clear refusals."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_llmopt.models import Llama, LlamaConfig  # noqa: E402
from lightning_llmopt.models.hf import config_from_hf, from_hf, to_hf  # noqa: E402

# Peaky attention (large init) so a wrong RoPE permutation or head split moves logits by O(1), not O(1e-3).
INIT = 0.15
SEQ = 17
# fp32 on both sides, same math in another op order: differences ~1e-6 on logits of size ~1-10; 1e-4 leaves margin
# far below the effect of any mapping error (checked: without the RoPE row permutation logits differ by > 0.1).
ATOL = 1e-4

_BASE: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    initializer_range=INIT,
    kv_lora_rank=32,
    qk_nope_head_dim=24,
    qk_rope_head_dim=8,
    v_head_dim=16,
    first_k_dense_replace=2,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    tie_word_embeddings=False,
)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "v2-lite (q direct)": ("DeepseekV2Config", dict(q_lora_rank=None)),
    "v2-tied": ("DeepseekV2Config", dict(q_lora_rank=None, tie_word_embeddings=True)),
    "v2 (q lora)": ("DeepseekV2Config", dict(q_lora_rank=24)),
    "v3 (q lora, interleave)": (
        "DeepseekV3Config",
        dict(q_lora_rank=24, n_group=1, topk_group=1, num_key_value_heads=4),
    ),
}


def _hf_model(case: str) -> Any:
    cls_name, extra = CASES[case]
    cfg = getattr(transformers, cls_name)(**{**_BASE, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():  # norms initialise to one: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", list(CASES))
def test_from_transformers_logits_match(case):
    hf = _hf_model(case)
    ours = from_hf(hf, attn_backend="eager")
    assert ours.config.mla is not None
    tokens = _tokens()
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_export_loads_in_transformers(tmp_path, q_lora_rank):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        dim=64,
        n_layers=2,
        n_heads=4,
        ffn_hidden_dim=96,
        max_seq_len=64,
        init_std=INIT,
        attn_backend="eager",
        mla=dict(kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=q_lora_rank),
    )
    ours = Llama(cfg).eval()
    path = to_hf(ours, tmp_path / "ckpt")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").float().eval()
    assert type(hf).__name__ == "DeepseekV2ForCausalLM"
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), atol=ATOL, rtol=0)
    again = from_hf(path, attn_backend="eager")  # and back from the folder, without transformers
    for (name, a), b in zip(ours.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def _cfg(**extra: Any) -> dict[str, Any]:
    return {**_BASE, "model_type": "deepseek_v2", "q_lora_rank": None, **extra}


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (dict(first_k_dense_replace=1), "n_routed_experts \\(4\\) with first_k_dense_replace \\(1\\)"),
        (dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e4)), "rope type 'yarn'"),
        (dict(attention_bias=True), "attention_bias \\(True\\)"),
        (dict(num_key_value_heads=2), "num_key_value_heads \\(2\\)"),
        (dict(model_type="deepseek_v3", rope_interleave=False), "rope_interleave \\(False\\)"),
    ],
)
def test_refusals_name_the_field(extra, match):
    with pytest.raises(NotImplementedError, match=match):
        config_from_hf(_cfg(**extra))


def test_wrong_shapes_are_listed():
    from lightning_llmopt.models.hf import state_dict_from_hf

    hf = _hf_model("v2 (q lora)")
    config, _ = config_from_hf(hf.config)
    sd = dict(hf.state_dict())
    sd["model.layers.1.self_attn.kv_b_proj.weight"] = torch.zeros(3, 32)
    with pytest.raises(ValueError, match="model.layers.1.self_attn.kv_b_proj.weight: \\(3, 32\\) \\(expected"):
        state_dict_from_hf(sd, config)
