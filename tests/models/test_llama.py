"""Reference decoder: config validation, attention backends, packing, KV cache, meta-device init, FLOP count."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_llmopt.models import (
    PRESETS,
    AttentionMask,
    Llama,
    LlamaConfig,
    StaticKVCache,
    attention,
    doc_ids_from_cu_seqlens,
    greedy_generate,
    positions_from_doc_ids,
)


def tiny(**overrides) -> LlamaConfig:
    return LlamaConfig.from_preset("tiny", **overrides)


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(n_heads=4, n_kv_heads=3), r"n_heads \(4\) must be divisible by n_kv_heads \(3\)"),
        (dict(dim=66, n_heads=4), r"dim \(66\) must be divisible by n_heads \(4\)"),
        (dict(vocab_size=0), r"vocab_size \(0\)"),
        (dict(sliding_window=0), r"sliding_window \(0\)"),
        (dict(attn_backend="magic"), r"attn_backend \('magic'\)"),
        (dict(rope_scaling={"type": "yarn"}), r"rope_scaling.type \('yarn'\)"),
    ],
)
def test_config_rejects_bad_values(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny(**overrides)


def test_unknown_preset_names_the_value():
    with pytest.raises(ValueError, match=r"unknown preset 'llama-9000'"):
        LlamaConfig.from_preset("llama-9000")
    with pytest.raises(ValueError, match=r"unknown LlamaConfig field\(s\) \['dims'\]"):
        LlamaConfig.from_preset("tiny", dims=3)


@pytest.mark.parametrize("name, billions", [("llama2-7b", 6.74), ("llama3-8b", 8.03), ("1b", 1.10), ("125m", 0.124)])
def test_preset_parameter_counts(name, billions):
    with torch.device("meta"):
        model = Llama(LlamaConfig.from_preset(name))
    assert model.num_params() / 1e9 == pytest.approx(billions, rel=0.01)


def test_all_presets_build_on_meta():
    for name in PRESETS:
        with torch.device("meta"):
            Llama(LlamaConfig.from_preset(name))


# ---------------------------------------------------------------- attention


def _attention_f64(q, k, v, allowed):
    """Independent per-row loop in float64: softmax over the visible keys only."""
    B, H, T, D = q.shape
    rep = H // k.shape[1]
    out = torch.zeros(B, H, T, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                keys = allowed[b, 0, i].nonzero().flatten()
                if keys.numel() == 0:
                    continue
                s = (k[b, h // rep, keys].double() @ q[b, h, i].double()) / math.sqrt(D)
                out[b, h, i] = torch.softmax(s, 0) @ v[b, h // rep, keys].double()
    return out


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("H, H_kv, window, docs", [(4, 4, None, False), (4, 2, None, True), (6, 1, 5, False),
                                                   (4, 2, 3, True)])
def test_attention_backends_match_float64(backend, H, H_kv, window, docs):
    torch.manual_seed(0)
    B, T, D = 2, 17, 16
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, H_kv, T, D), torch.randn(B, H_kv, T, D)
    if docs:
        doc_ids = doc_ids_from_cu_seqlens(torch.tensor([0, 5, 6, 13]), T).expand(B, T)
        pos = positions_from_doc_ids(doc_ids)
        mask = AttentionMask(pos, pos, doc_ids, doc_ids, window=window)
    else:
        mask = AttentionMask.causal(B, T, q.device, window=window)
    out = attention(q, k, v, mask, backend=backend)
    ref = _attention_f64(q, k, v, mask.dense())
    # fp32 arithmetic over 17 keys: errors are a few ulps of O(1) values.
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-5)


def test_sliding_window_counts_the_query_itself():
    pos = torch.arange(6)[None]
    allowed = AttentionMask(pos, pos, window=3).dense()[0, 0]
    assert allowed[5].nonzero().flatten().tolist() == [3, 4, 5]


def test_doc_ids_and_positions_from_cu_seqlens():
    doc_ids = doc_ids_from_cu_seqlens(torch.tensor([0, 3, 4, 8]), 10)
    assert doc_ids.tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 3, 3]
    assert positions_from_doc_ids(doc_ids[None]).tolist() == [[0, 1, 2, 0, 0, 1, 2, 3, 0, 1]]
    with pytest.raises(ValueError, match="exceeds the row length"):
        doc_ids_from_cu_seqlens(torch.tensor([0, 11]), 10)


# ---------------------------------------------------------------- model


@pytest.mark.parametrize("overrides", [{}, dict(sliding_window=4), dict(qkv_bias=True, tie_embeddings=True)])
def test_sdpa_and_eager_models_agree(overrides):
    torch.manual_seed(0)
    model = Llama(tiny(**overrides))
    tokens = torch.randint(0, 320, (2, 23))
    out_sdpa = model(tokens)
    model_eager = Llama(tiny(attn_backend="eager", **overrides))
    model_eager.load_state_dict(model.state_dict())
    torch.testing.assert_close(out_sdpa, model_eager(tokens), atol=1e-5, rtol=1e-4)


def test_packed_rows_equal_separate_documents():
    """A packed row must give each document exactly the logits it gets alone."""
    torch.manual_seed(0)
    model = Llama(tiny(sliding_window=6))
    lengths = [7, 1, 11, 4]
    docs = [torch.randint(0, 320, (1, n)) for n in lengths]
    packed = torch.cat(docs, dim=1)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    doc_ids = doc_ids_from_cu_seqlens(cu, packed.shape[1])[None]
    out = model(packed, doc_ids=doc_ids)
    for i, doc in enumerate(docs):
        torch.testing.assert_close(out[:, cu[i]:cu[i + 1]], model(doc), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 5])
def test_kv_cache_decode_matches_full_forward(window):
    torch.manual_seed(0)
    model = Llama(tiny(sliding_window=window, n_kv_heads=1))
    tokens = torch.randint(0, 320, (3, 19))
    full = model(tokens)
    cache = StaticKVCache.for_model(model, batch_size=3, max_seq_len=32)
    pieces = [model(tokens[:, :8], kv_cache=cache)]
    for t in range(8, 19):
        pieces.append(model(tokens[:, t:t + 1], positions=torch.full((3, 1), t), kv_cache=cache))
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-4)
    prompt = tokens[:, :6]
    assert torch.equal(greedy_generate(model, prompt, 10), greedy_generate(model, prompt, 10, use_cache=False))


def test_positions_beyond_max_seq_len_are_rejected():
    model = Llama(tiny(max_seq_len=16))
    with pytest.raises(ValueError, match=r"sequence length \(17\) exceeds max_seq_len \(16\)"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match=r"position 16 is beyond max_seq_len \(16\)"):
        model(torch.zeros(1, 1, dtype=torch.long), positions=torch.tensor([[16]]))


def test_meta_init_matches_eager_statistics():
    cfg = LlamaConfig.from_preset("tiny", dim=256, ffn_hidden_dim=512, vocab_size=2048)
    torch.manual_seed(0)
    eager = Llama(cfg)
    with torch.device("meta"):
        lazy = Llama(cfg)
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    torch.manual_seed(1)
    lazy.init_weights()
    eager_params, lazy_params = dict(eager.named_parameters()), dict(lazy.named_parameters())
    assert eager_params.keys() == lazy_params.keys()
    for name, p in eager_params.items():
        q = lazy_params[name]
        assert p.shape == q.shape
        # Independent draws of >= 16k samples: the std estimates agree to ~1%; 5% leaves a wide margin.
        assert q.std().item() == pytest.approx(p.std().item(), rel=0.05, abs=1e-7), name
        assert abs(q.mean().item() - p.mean().item()) < 0.05 * max(p.std().item(), 1e-3), name
    torch.testing.assert_close(lazy.rope, eager.rope)
    tokens = torch.randint(0, 2048, (1, 9))
    assert torch.isfinite(lazy(tokens)).all()


def test_tied_embeddings_share_storage_after_meta_init():
    with torch.device("meta"):
        model = Llama(tiny(tie_embeddings=True))
    model.to_empty(device="cpu")
    model.init_weights()
    assert model.output.weight is model.tok_embeddings.weight


def test_flops_per_token_agrees_with_lightning_counter():
    from lightning.fabric.utilities.throughput import measure_flops

    cfg = tiny(vocab_size=64)
    with torch.device("meta"):
        model = Llama(cfg)
        tokens = torch.randint(0, 64, (2, 32))
    counted = measure_flops(model, lambda: model(tokens), lambda y: y.float().sum())
    # The counter charges full (non-causal) attention: add back the masked half before comparing.
    L, H, D, T = cfg.n_layers, cfg.n_heads, cfg.head_dim, 32
    expected = (model.flops_per_token(T) + 6 * L * H * D * T) * tokens.numel()
    assert counted == pytest.approx(expected, rel=0.01)
