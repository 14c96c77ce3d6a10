"""optimize_model and LlamaConfig.fused_kernels: the fused modules against the unmodified model (ours and a
transformers model built from a tiny random config), on CPU through the Triton interpreter.

fp32 on both sides with the same math in another order: observed differences are ~1e-6 on losses and logits of
size 1-10; the 1e-5 tolerances below leave margin while staying far below the effect of a wrong rotation, norm or
label shift (O(0.1) and more).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.optimize import optimize_model
from lightning_llmopt.testing.triton import triton_available, triton_interpreter_enabled

pytestmark = pytest.mark.skipif(
    not triton_available() or not (torch.cuda.is_available() or triton_interpreter_enabled()),
    reason="needs triton (and TRITON_INTERPRET=1 without CUDA)",
)
ATOL = RTOL = 1e-5


def _batch(vocab: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (2, 11), generator=g)
    labels = torch.randint(0, vocab, (2, 11), generator=g)
    labels[0, :4] = -100
    return tokens, labels


def _loss_and_grads(model: Any, fn: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = fn(model)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(a: tuple, b: tuple) -> None:
    torch.testing.assert_close(a[0], b[0], atol=ATOL, rtol=RTOL)
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], atol=ATOL, rtol=RTOL, msg=name)


def test_config_flag_builds_the_same_model_with_fused_modules(monkeypatch):
    monkeypatch.setenv("LLMOPT_FUSED_BACKEND", "triton")
    torch.manual_seed(0)
    ref = Llama(LlamaConfig.from_preset("tiny"))
    fused = Llama(LlamaConfig.from_preset("tiny", fused_kernels=["all"]))
    assert fused.config.fused_kernels == ["rmsnorm", "rope", "swiglu", "fused_ce"]
    assert fused.llmopt_fused == {"rmsnorm": 5, "rope": 2, "swiglu": 2, "fused_ce": 1, "attention": 0, "packed_qkv": 2}
    assert fused.state_dict().keys() == ref.state_dict().keys()
    fused.load_state_dict(ref.state_dict())
    tokens, labels = _batch(320)
    torch.testing.assert_close(fused(tokens), ref(tokens), atol=ATOL, rtol=RTOL)
    _assert_same(
        _loss_and_grads(fused, lambda m: m.loss(tokens, labels)), _loss_and_grads(ref, lambda m: m.loss(tokens, labels))
    )


def test_packed_qkv_matches_three_projections_and_falls_back_for_hooked_modules():
    """``pack_qkv`` (one GEMM over cat(wq, wk, wv), biases too) gives the unpacked model's loss and gradients; a
    projection with a forward hook (tensor-parallel layouts, adapters) makes that layer take three GEMMs again."""
    torch.manual_seed(0)
    ref = Llama(LlamaConfig.from_preset("tiny", qkv_bias=True))
    model = copy.deepcopy(ref)
    optimize_model(model, rmsnorm=False, rope=False, swiglu=False, fused_ce=False)
    assert model.llmopt_fused["packed_qkv"] == 2 and all(b.attention._packable() for b in model.layers.values())
    tokens, labels = _batch(320, seed=3)
    _assert_same(
        _loss_and_grads(model, lambda m: m.loss(tokens, labels)), _loss_and_grads(ref, lambda m: m.loss(tokens, labels))
    )
    calls = []
    model.layers["0"].attention.wk.register_forward_hook(lambda *a: calls.append(1))
    assert not model.layers["0"].attention._packable() and model.layers["1"].attention._packable()
    _assert_same(
        _loss_and_grads(model, lambda m: m.loss(tokens, labels)), _loss_and_grads(ref, lambda m: m.loss(tokens, labels))
    )
    assert calls == [1]


def test_optimize_model_in_place_keeps_parameters_and_is_idempotent(monkeypatch):
    monkeypatch.setenv("LLMOPT_FUSED_BACKEND", "triton")
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_preset("tiny", tie_embeddings=True))
    ref = copy.deepcopy(model)
    params = dict(model.named_parameters())
    assert optimize_model(model, attention="triton") is model
    assert {n: id(p) for n, p in model.named_parameters()} == {n: id(p) for n, p in params.items()}
    assert model.llmopt_fused["attention"] == 2 and model.config.attn_backend == "triton"
    optimize_model(model)  # nothing left to replace
    assert model.llmopt_fused == {"rmsnorm": 5, "rope": 2, "swiglu": 2, "fused_ce": 1, "attention": 2, "packed_qkv": 2}
    tokens, labels = _batch(320, seed=2)
    packed = torch.tensor([[0] * 4 + [1] * 7, [0] * 11])  # two documents in the first row
    _assert_same(
        _loss_and_grads(model, lambda m: m.loss(tokens, labels, doc_ids=packed)),
        _loss_and_grads(ref, lambda m: m.loss(tokens, labels, doc_ids=packed)),
    )


def test_causal_lm_module_trains_through_the_fused_loss(monkeypatch):
    from lightning_llmopt import CausalLMModule

    monkeypatch.setenv("LLMOPT_FUSED_BACKEND", "triton")
    fused = CausalLMModule("tiny", model_overrides={"fused_kernels": "rmsnorm,fused_ce"})
    plain = CausalLMModule("tiny")
    for m in (fused, plain):
        m.configure_model()
    plain.model.load_state_dict(fused.model.state_dict())
    assert fused.model.fused_loss is not None and fused.model.llmopt_fused["swiglu"] == 0
    tokens, labels = _batch(320, seed=3)
    batch = {"input_ids": tokens, "labels": labels}
    torch.testing.assert_close(fused.train_loss(batch), plain.train_loss(batch), atol=ATOL, rtol=RTOL)


def test_bad_names_and_models():
    with pytest.raises(ValueError, match=r"fused_kernels \(\['layernorm'\]\) must name kernels of"):
        LlamaConfig.from_preset("tiny", fused_kernels=["layernorm"])
    with pytest.raises(TypeError, match="optimize_model supports"):
        optimize_model(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"attention \('nope'\) must be one of"):
        optimize_model(Llama(LlamaConfig.from_preset("tiny")), attention="nope")


# ---------------------------------------------------------------- transformers models

transformers = pytest.importorskip("transformers")
_HF = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    initializer_range=0.15,
)


@pytest.mark.parametrize("cls_name, extra", [("LlamaConfig", {}), ("Qwen2Config", {"tie_word_embeddings": True})])
def test_transformers_model_matches_unpatched_copy(cls_name: str, extra: dict, monkeypatch) -> None:
    monkeypatch.setenv("LLMOPT_FUSED_BACKEND", "triton")
    cfg = getattr(transformers, cls_name)(**_HF, **extra)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
    ref = copy.deepcopy(hf)
    optimize_model(hf)
    assert hf.llmopt_fused == {"rmsnorm": 5, "rope": 2, "swiglu": 2, "fused_ce": 1, "attention": 0, "packed_qkv": 0}
    assert type(ref.model.norm).__name__.endswith("RMSNorm")  # the copy made before is untouched
    tokens, labels = _batch(128, seed=4)
    hf.train(), ref.train()
    ours = _loss_and_grads(hf, lambda m: m(input_ids=tokens, labels=labels).loss)
    theirs = _loss_and_grads(ref, lambda m: m(input_ids=tokens, labels=labels).loss)
    _assert_same(ours, theirs)
    assert hf(input_ids=tokens, labels=labels).logits is None  # training with labels: no logits
    hf.eval(), ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=tokens).logits, ref(input_ids=tokens).logits, atol=ATOL, rtol=RTOL)
        if cls_name != "LlamaConfig":
            return
        # num_items_in_batch (gradient accumulation in transformers' Trainer): sum / count, as transformers does
        hf.train(), ref.train()
        n = torch.tensor(50)
        torch.testing.assert_close(
            hf(input_ids=tokens, labels=labels, num_items_in_batch=n).loss,
            ref(input_ids=tokens, labels=labels, num_items_in_batch=n).loss,
            atol=ATOL,
            rtol=RTOL,
        )


# ---------------------------------------------------------------- the kernel step and the import direction


def test_models_import_nothing_above_them():
    """``models/`` (except the transformers interop, ``hf*.py``, which converts) imports neither ``optimize.py``,
    ``layers/`` nor ``parallel/``: ``LlamaConfig.fused_kernels`` reaches the kernels through the step that
    ``optimize.py`` registers (``models.llama.set_kernel_step``), not through an import."""
    import ast
    from pathlib import Path

    import lightning_llmopt.models as models

    above = ("lightning_llmopt.optimize", "lightning_llmopt.layers", "lightning_llmopt.parallel")
    found = []
    for path in sorted(Path(models.__file__).parent.glob("*.py")):
        if path.name.startswith("hf"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found += [f"{path.name}: {n}" for n in names if n.startswith(above)]
    assert found == []


def test_config_kernels_in_a_fresh_process():
    """``import lightning_llmopt.models`` alone (the package registers the kernel step on import) builds a Llama with
    its ``fused_kernels`` swapped in."""
    import subprocess
    import sys

    code = (
        "from lightning_llmopt.models import Llama, LlamaConfig\n"
        "m = Llama(LlamaConfig.from_preset('tiny', fused_kernels='all'))\n"
        "print(type(m.norm).__name__, type(m.layers['0'].feed_forward).__name__, type(m.fused_loss).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["FusedRMSNorm", "FusedSwiGLUMLP", "FusedLinearCrossEntropy"]
