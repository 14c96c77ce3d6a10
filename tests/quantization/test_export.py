"""Exports: the GPTQ checkpoint against a written spec of what vLLM's GPTQ loader reads (decoded here with the
loader's formula, independently of our unpacking); compressed-tensors checkpoints of a transformers Llama load with
transformers + compressed-tensors and match our engine's logits; both formats load back into our model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from lightning_llmopt.layers.quantized_linear import QuantizedLinear
from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.quantization import (
    QuantConfig,
    QuantSpec,
    load_quantized,
    quantize_model,
    rtn_quantize,
    save_compressed_tensors,
    save_gptq,
)
from lightning_llmopt.quantization.export_ct import ct_tensors

# ---------------------------------------------------------------------------------------------------------------
# The spec: what vLLM's GPTQ linear method (GPTQConfig / GPTQMarlinConfig and GPTQLinearMethod.create_weights)
# allocates and reads, for a layer with K inputs, N outputs, b bits, group size G, pack factor 32 / b:
#   qweight int32 (K / pack, N)   input dim 0 packed           qzeros int32 (K / G, N / pack)   output dim packed
#   scales  fp16  (K / G, N)                                   g_idx  int32 (K,)
# config.json quantization_config: quant_method "gptq", bits, group_size, desc_act, sym (read by the Marlin
# path), checkpoint_format ("gptq" = v1: the kernel adds 1 to every stored zero point), lm_head (default false).
# Modules: model.layers.<i>.self_attn.{q,k,v,o}_proj and model.layers.<i>.mlp.{gate,up,down}_proj; everything else
# (embed_tokens, norms, lm_head) stays float (fp16).
# ---------------------------------------------------------------------------------------------------------------
GPTQ_TENSOR_SPEC = {  # name -> (dtype, shape as a function of K, N, G, bits)
    "qweight": ("I32", lambda K, N, G, b: (K * b // 32, N)),
    "qzeros": ("I32", lambda K, N, G, b: (K // G, N * b // 32)),
    "scales": ("F16", lambda K, N, G, b: (K // G, N)),
    "g_idx": ("I32", lambda K, N, G, b: (K,)),
}
GPTQ_CONFIG_SPEC = {
    "quant_method": "gptq",
    "bits": 4,
    "group_size": 128,
    "desc_act": False,
    "sym": True,
    "checkpoint_format": "gptq",
    "lm_head": False,
}
OURS = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
}
HF_LINEARS = tuple(OURS)


def _decode_gptq_v1(
    qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray, bits: int
) -> np.ndarray:
    """W (K, N) the way the loaders' kernels compute it: (q - (z + 1)) * s[g_idx] (v1), written from the spec."""
    pack, mask = 32 // bits, (1 << bits) - 1
    words = qweight.astype(np.uint32)
    k = words.shape[0] * pack
    q = np.stack([(words >> (bits * j)) & mask for j in range(pack)], axis=1).reshape(k, -1)  # row k = 8r + j
    zw = qzeros.astype(np.uint32)
    z = np.stack([(zw >> (bits * j)) & mask for j in range(pack)], axis=2).reshape(zw.shape[0], -1)
    g = g_idx.astype(np.int64)
    return (q.astype(np.float32) - (z[g] + 1).astype(np.float32)) * scales[g].astype(np.float32)


def _llama(dim: int = 128, ffn: int = 256) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.from_preset("tiny", dim=dim, ffn_hidden_dim=ffn, init_std=0.1)).eval()


def test_gptq_checkpoint_matches_the_written_spec(tmp_path: Path) -> None:
    model = _llama()
    quantize_model(model, QuantConfig(bits=4, group_size=128, scale_dtype=torch.float16))
    out = save_gptq(model, tmp_path / "gptq")
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert {k: qc[k] for k in GPTQ_CONFIG_SPEC} == GPTQ_CONFIG_SPEC
    assert json.loads((out / "quantize_config.json").read_text()) == qc
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float16"
    cfg = model.config
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        for i in range(cfg.n_layers):
            for linear in HF_LINEARS:
                prefix = f"model.layers.{i}.{linear}"
                assert f"{prefix}.weight" not in names
                ours = model.get_submodule(f"layers.{i}.{OURS[linear]}")
                assert isinstance(ours, QuantizedLinear)
                K, N = ours.in_features, ours.out_features
                for suffix, (dtype, shape) in GPTQ_TENSOR_SPEC.items():
                    sl = f.get_slice(f"{prefix}.{suffix}")
                    assert (sl.get_dtype(), tuple(sl.get_shape())) == (dtype, shape(K, N, 128, 4)), (prefix, suffix)
                t = {s: f.get_tensor(f"{prefix}.{s}").numpy() for s in GPTQ_TENSOR_SPEC}
                assert np.array_equal(t["g_idx"], np.arange(K) // 128)
                assert (t["qzeros"].view(np.uint32) == 0x77777777).all()  # sym 4-bit, v1: zero 8 stored as 7
                decoded = _decode_gptq_v1(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4)
                assert np.array_equal(decoded, ours.dequantize(torch.float32).t().numpy())
        floats = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
        assert floats <= names and all(f.get_slice(n).get_dtype() == "F16" for n in floats)
        assert not any(n.endswith("proj.weight") for n in names)
    back = load_quantized(out, dtype=torch.float32)
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            loaded = back.get_submodule(name)
            assert isinstance(loaded, QuantizedLinear)
            assert torch.equal(loaded.qweight, module.qweight) and torch.equal(loaded.scales, module.scales.float())


def _hf_llama():  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    return transformers, transformers.LlamaForCausalLM(cfg).eval()


# int4 g32 for all; int8 per channel; mixed precision (attention int8 per channel, MLP int4 g32) as two
# config groups targeted by module name.
CT_CASES = {
    "int4-g32": QuantConfig(bits=4, group_size=32),
    "int8-channel": QuantConfig(bits=8, group_size=None),
    "mixed": QuantConfig(bits=4, group_size=32, overrides={"*self_attn*": {"bits": 8, "group_size": None}}),
}


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")
@pytest.mark.parametrize("case", sorted(CT_CASES))
def test_compressed_tensors_export_loads_in_transformers(tmp_path: Path, case: str) -> None:
    pytest.importorskip("compressed_tensors")
    transformers, hf = _hf_llama()
    report = quantize_model(hf, CT_CASES[case])
    assert len(report.layers) == 14 and "lm_head" not in report.layers
    out = save_compressed_tensors(hf, tmp_path / case)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["format"], qc["ignore"]) == ("compressed-tensors", "pack-quantized", ["lm_head"])
    assert len(qc["config_groups"]) == (2 if case == "mixed" else 1)
    tokens = torch.randint(0, 320, (2, 17), generator=torch.Generator().manual_seed(1))
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ours_model = load_quantized(out)  # our engine's model, QuantizedLinear layers
    assert isinstance(ours_model.layers["1"].feed_forward.w2, QuantizedLinear)
    with torch.no_grad():
        theirs = theirs_model(tokens).logits
        ours = ours_model(tokens)
        in_memory = hf(tokens).logits
    scale = ours.abs().max()
    assert (theirs - ours).abs().max() <= 1e-2 * scale  # the acceptance bound; fp32 both sides gives ~1e-6
    assert (in_memory - ours).abs().max() <= 1e-4 * scale


@pytest.mark.parametrize("bits, group", [(4, 32), (8, None)])
def test_asymmetric_pack_quantized_decompresses_with_compressed_tensors(bits: int, group: int | None) -> None:
    # transformers 5.x builds asymmetric pack-quantized layers with unpacked zero-point shapes on the meta device and
    # so cannot load them; compressed-tensors' own decompressor (what vLLM's layout follows) reads ours exactly.
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(bits))
    qw = rtn_quantize(
        w, QuantSpec(bits, "group" if group else "channel", group or 64, symmetric=False), scale_dtype=torch.float32
    )
    args = ct.quantization.QuantizationArgs(
        num_bits=bits, symmetric=False, strategy="group" if group else "channel", group_size=group
    )
    scheme = ct.quantization.QuantizationScheme(targets=["Linear"], weights=args)
    out = PackedQuantizationCompressor.decompress(ct_tensors(qw, torch.float32), scheme)
    assert torch.equal(out["weight"], qw.dequantize())


def test_round_trip_between_formats_keeps_codes(tmp_path: Path) -> None:
    model = _llama(dim=64, ffn=128)
    quantize_model(model, QuantConfig(bits=4, group_size=32, scale_dtype=torch.float16))
    tokens = torch.randint(0, 320, (1, 9))
    ct_dir = save_compressed_tensors(model, tmp_path / "ct")
    gptq_dir = save_gptq(load_quantized(ct_dir), tmp_path / "gptq")
    back = load_quantized(gptq_dir, dtype=torch.float32)
    wq, wq_back = model.layers["0"].attention.wq, back.layers["0"].attention.wq
    assert torch.equal(wq.qweight, wq_back.qweight) and torch.equal(wq.scales.float(), wq_back.scales)
    with torch.no_grad():
        # the GPTQ file stores embeddings and norms in fp16: only that rounding separates the logits
        assert torch.allclose(back(tokens), model(tokens), atol=2e-3, rtol=1e-2)
