"""FP8 training (``lightning_llmopt.parallel.float8``, ``CausalLMModule(float8=...)``) on CPU, in torchao's emulation.

Two oracles we did not write the FP8 path for:

- a float64 reference that rounds to ``float8_e4m3fn`` / ``float8_e5m2`` with the same scales (``_fp8_round``):
  the emulated forward must equal it up to fp32 GEMM rounding (``2 K 2^-24`` of ``|a| |b|``);
- the exact float64 product: forward and both gradients within the bound FP8's epsilon gives. A value ``x`` cast
  with scale ``s`` (``fmax / amax``, at most halved by power-of-two rounding) comes back within ``u |x|`` (unit
  roundoff ``u``: 2^-4 for e4m3's 3 mantissa bits, 2^-3 for e5m2's 2) or, in the subnormal range, within half the
  smallest subnormal step over ``s``: ``h * 2 amax / fmax`` (``h`` = 2^-10 for e4m3, 2^-17 for e5m2). So each
  operand carries ``E = u |x| + 2 h amax / fmax`` per element and a GEMM ``A B`` is off by at most
  ``|A| E_B + E_A |B| + E_A E_B`` plus the fp32 accumulation, elementwise.

Odd row counts (37) and widths that are multiples of 16 (the FP8 GEMM's alignment) are used throughout.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("torchao.float8", reason="needs torchao (the fp8 extra)")

from lightning_llmopt import CausalLMModule  # noqa: E402
from lightning_llmopt.callbacks.monitor import FP8_PEAK_RATIO, fp8_flop_share, mixed_peak_flops  # noqa: E402
from lightning_llmopt.parallel.float8 import (  # noqa: E402
    FLOAT8_RECIPES,
    apply_float8,
    check_float8_device,
    float8_flop_share,
    is_float8_linear,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
UNIT = {E4M3: 2.0**-4, E5M2: 2.0**-3}
HALF_SUBNORMAL = {E4M3: 2.0**-10, E5M2: 2.0**-17}
# recipe -> (grad_output dtype, power-of-two scales, axiswise)
RECIPE = {"tensorwise": (E5M2, False, False), "rowwise": (E4M3, True, True), "rowwise_with_gw_hp": (E4M3, True, True)}


def _fp8_round(x: torch.Tensor, dtype: torch.dtype, dim: int | None, pow2: bool) -> torch.Tensor:
    """``x`` (fp32) cast to ``dtype`` with torchao's dynamic scale over ``dim`` (``None``: the whole tensor) and back,
    in float64."""
    amax = x.abs().amax(dim=dim, keepdim=True) if dim is not None else x.abs().max()
    fmax = torch.finfo(dtype).max
    scale = (fmax / amax.double().clamp(min=1e-12)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype).double() / scale.double()


def _err(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-element bound on ``|x - fp8(x)|`` for any of the recipes' scales (module docstring)."""
    x = x.double()
    return UNIT[dtype] * x.abs() + 2 * HALF_SUBNORMAL[dtype] * x.abs().max() / torch.finfo(dtype).max


def _gemm_bound(a: torch.Tensor, ea: torch.Tensor, b: torch.Tensor, eb: torch.Tensor) -> torch.Tensor:
    a, b = a.double().abs(), b.double().abs()
    k = a.shape[-1]
    return a @ eb + ea @ b + ea @ eb + 2 * k * 2.0**-24 * (a + ea) @ (b + eb)


def _linear(recipe: str, k: int = 48, n: int = 80, bias: bool = False) -> tuple[nn.Module, nn.Linear]:
    torch.manual_seed(0)
    plain = nn.Linear(k, n, bias=bias)
    model = nn.Sequential(nn.Linear(k, n, bias=bias))
    model[0].load_state_dict(plain.state_dict())
    report = apply_float8(model, recipe, emulate=True)
    assert report.converted == ["0"] and is_float8_linear(model[0])
    return model, plain


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_forward_equals_the_fp8_rounding_reference(recipe: str) -> None:
    model, plain = _linear(recipe)
    x = torch.randn(37, 48) * torch.logspace(-3, 1, 48)  # columns over four decades: subnormals included
    x[5, 7] = 40.0  # an outlier: tensorwise scales everything by it
    _, pow2, axiswise = RECIPE[recipe]
    dim = -1 if axiswise else None
    xq, wq = _fp8_round(x, E4M3, dim, pow2), _fp8_round(plain.weight.detach(), E4M3, dim, pow2)
    ref = xq @ wq.T
    out = model(x).double()
    bound = 2 * 48 * 2.0**-24 * (xq.abs() @ wq.abs().T) + 1e-30
    assert ((out - ref).abs() <= bound).all(), float(((out - ref).abs() / bound).max())
    assert not torch.equal(out, plain(x).double())  # it did round


@pytest.mark.parametrize("recipe", FLOAT8_RECIPES)
@pytest.mark.parametrize("bias", [False, True])
def test_forward_and_gradients_within_the_fp8_bound(recipe: str, bias: bool) -> None:
    model, plain = _linear(recipe, bias=bias)
    x = (torch.randn(37, 48) * torch.logspace(-2, 0.5, 48)).requires_grad_()
    g = torch.randn(37, 80) * torch.logspace(-1, 1, 80)  # the output's gradient
    grad_dtype = RECIPE[recipe][0]
    out = model(x)
    (out * g).sum().backward()
    x64, w64 = x.detach().double(), plain.weight.detach().double()
    exact = x64 @ w64.T + (plain.bias.detach().double() if bias else 0)
    bound = _gemm_bound(x64, _err(x64, E4M3), w64.T, _err(w64, E4M3).T)
    assert ((out.detach().double() - exact).abs() <= bound).all()
    # grad input = g W, both cast (g to the recipe's gradient dtype)
    g64 = g.double()
    dx_bound = _gemm_bound(g64, _err(g64, grad_dtype), w64, _err(w64, E4M3))
    assert ((x.grad.double() - g64 @ w64).abs() <= dx_bound).all()
    # grad weight = g^T x: both cast, or high precision (rowwise_with_gw_hp: fp32 accumulation alone)
    gw = model[0].weight.grad.double()
    hp = recipe == "rowwise_with_gw_hp"
    eg, ex = (torch.zeros_like(g64.T), torch.zeros_like(x64)) if hp else (_err(g64, grad_dtype).T, _err(x64, E4M3))
    dw_bound = _gemm_bound(g64.T, eg, x64, ex)
    assert ((gw - g64.T @ x64).abs() <= dw_bound).all()
    if bias:
        torch.testing.assert_close(model[0].bias.grad, g.sum(0))


def _tiny(**overrides: Any) -> CausalLMModule:
    module = CausalLMModule("tiny", model_overrides=overrides or None, float8="rowwise", float8_emulate=True,
                            fused_kernels="none")  # fmt: skip
    module.configure_model()
    return module


def test_which_layers_convert_and_the_log_line() -> None:
    """Every attention and MLP projection converts; the LM head, MoE routers and widths that are not multiples of
    16 stay, each with its reason; the parameter names do not change."""
    plain = CausalLMModule("tiny", model_overrides={"ffn_hidden_dim": 200}, fused_kernels="none")
    plain.configure_model()
    model = plain.model
    names = [n for n, _ in model.named_parameters()]
    report = apply_float8(model, "tensorwise", emulate=True)
    assert [n for n, _ in model.named_parameters()] == names
    assert sorted({n.rsplit(".", 1)[1] for n in report.converted}) == ["wk", "wo", "wq", "wv"]
    assert report.kept["output"] == "LM head"
    assert report.kept["layers.0.feed_forward.w1"] == "64x200 not multiples of 16"
    assert "float8 (tensorwise, emulated): 8 linear layers in FP8 (wk, wo, wq, wv)" in report.describe()
    assert report.describe().endswith(
        "kept in high precision: output (LM head), w1 x2 (64x200 not multiples of 16), "
        "w2 x2 (200x64 not multiples of 16), w3 x2 (64x200 not multiples of 16)"
    )
    moe = _tiny(moe={"num_experts": 4, "top_k": 2})
    routers = [n for n, m in moe.model.named_modules() if n.endswith("router")]
    assert routers and not any(is_float8_linear(moe.model.get_submodule(n)) for n in routers)


def test_bad_values_are_named() -> None:
    with pytest.raises(ValueError, match=r"float8 \('fp8'\) must be None or one of tensorwise, rowwise"):
        CausalLMModule("tiny", float8="fp8")
    with pytest.raises(ValueError, match="FP8 tensor cores.*the device is 'cpu'.*float8_emulate=True"):
        check_float8_device("cpu")
    if not torch.cuda.is_available():  # the module's device without a trainer: CUDA where there is one
        with pytest.raises(ValueError, match="FP8 tensor cores.*the device is 'cpu'.*float8_emulate=True"):
            CausalLMModule("tiny", float8="tensorwise").configure_model()
    with pytest.raises(ValueError, match="FP8 all-gather under ZeRO-3 needs the 'tensorwise' recipe, not 'rowwise'"):
        apply_float8(nn.Sequential(nn.Linear(16, 16)), "rowwise", emulate=True, fsdp_all_gather=True)
    with pytest.raises(ValueError, match="float8 recipe 'delayed' is not one of"):
        apply_float8(nn.Sequential(nn.Linear(16, 16)), "delayed", emulate=True)
    check_float8_device("cpu", emulate=True)  # emulation runs anywhere


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_without_fp8_tensor_cores_is_refused() -> None:  # pragma: no cover - GPU only
    if torch.cuda.get_device_capability() >= (8, 9):
        check_float8_device("cuda")
    else:
        with pytest.raises(ValueError, match="compute capability >= 8.9"):
            check_float8_device("cuda")


def test_flop_share_and_the_mfu_peak() -> None:
    """The FP8 share counts ``6 in out`` per FP8 linear against the model's training FLOPs; the MFU peak is the
    time-weighted blend of the FP8 and bf16 peaks."""
    module = _tiny()
    model = module.model
    linears = sum(6 * m.in_features * m.out_features for m in model.modules() if is_float8_linear(m))
    per_token = model.flops_per_token(64)
    assert math.isclose(float8_flop_share(model, per_token), linears / per_token)
    assert math.isclose(fp8_flop_share(module, 64), linears / per_token)
    assert 0.3 < fp8_flop_share(module, 64) < 1
    assert mixed_peak_flops(torch.device("cpu"), torch.bfloat16, 0.5) is None  # no peak on CPUs
    plain = CausalLMModule("tiny")
    plain.configure_model()
    assert fp8_flop_share(plain, 64) == 0.0
    assert FP8_PEAK_RATIO == 2.0


def test_mixed_peak_blend(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_llmopt.callbacks import monitor

    monkeypatch.setattr(monitor, "peak_flops", lambda device, dtype: 989.0)
    assert mixed_peak_flops(torch.device("cuda"), torch.bfloat16, 0.0) == 989.0
    assert math.isclose(mixed_peak_flops(torch.device("cuda"), torch.bfloat16, 1.0) or 0, 1978.0)
    # 3/4 of the FLOPs at twice the speed: time 1/4 + 3/8 of the bf16 time
    assert math.isclose(mixed_peak_flops(torch.device("cuda"), torch.bfloat16, 0.75) or 0, 989.0 / 0.625)


def test_activation_checkpointing_recomputes_the_same_fp8_step() -> None:
    """Full activation checkpointing over FP8 blocks: the same loss and gradients (the recomputed casts see the
    same tensors, so the same scales)."""
    from lightning_llmopt.parallel.activation_checkpointing import apply_activation_checkpointing

    torch.manual_seed(0)
    ids = torch.randint(0, 320, (3, 24))
    results = []
    for ac in (False, True):
        torch.manual_seed(1)
        module = _tiny()
        if ac:
            apply_activation_checkpointing(module.model, "full")
        loss = module.train_loss({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in module.model.named_parameters()}))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(grad, results[1][1][name], rtol=1e-6, atol=1e-9)


def test_checkpoint_round_trip_resume_and_export(tmp_path: Any) -> None:
    """An FP8 fit saves a checkpoint with the plain parameter names; it loads into a new FP8 module (equal logits),
    resumes, and exports to a Hugging Face folder whose model matches ours without FP8 (the master weights)."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_llmopt.testing.data import RandomTokens

    def trainer(steps: int) -> L.Trainer:
        return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, num_sanity_val_steps=0)  # fmt: skip

    L.seed_everything(0, verbose=False)
    data = DataLoader(RandomTokens(320, 16, 16), batch_size=2)
    module = _tiny()
    first = trainer(3)
    first.fit(module, data)
    ckpt = tmp_path / "fp8.ckpt"
    first.save_checkpoint(ckpt)
    state = torch.load(ckpt, weights_only=False)["state_dict"]
    assert "model.layers.0.attention.wq.weight" in state and state["model.layers.0.attention.wq.weight"].dtype == (
        torch.float32
    )
    loaded = CausalLMModule.load_from_checkpoint(ckpt)
    assert loaded.hparams["float8"] == "rowwise" and any(is_float8_linear(m) for m in loaded.model.modules())
    ids = torch.randint(0, 320, (2, 16))
    module.eval()
    loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), module(ids), rtol=0, atol=0)
    resumed = trainer(5)
    resumed.fit(_tiny(), data, ckpt_path=ckpt)
    assert resumed.global_step == 5
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from lightning_llmopt.models import Llama
    from lightning_llmopt.models.hf import to_hf

    plain = Llama(module.config)
    plain.load_state_dict(module.model.state_dict())  # same names, so the master weights load as they are
    to_hf(module.model, tmp_path / "hf")  # straight from the FP8 model: the same names and master weights
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, plain(ids), rtol=1e-5, atol=1e-5)
        fp8_logits = module(ids)
    assert not torch.equal(fp8_logits, plain(ids))  # FP8 did round in training's forward


def test_qat_refuses_fp8_layers() -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_llmopt.callbacks import QuantizationAwareTraining
    from lightning_llmopt.testing.data import RandomTokens

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, callbacks=[QuantizationAwareTraining()])  # fmt: skip
    with pytest.raises(ValueError, match="FP8 linear layers.*float8='rowwise'"):
        trainer.fit(_tiny(), DataLoader(RandomTokens(320, 16, 4), batch_size=2))


@pytest.mark.parametrize(
    ("recipe", "strategy", "choice", "expected"),
    [
        ("tensorwise", {"stage": 3}, None, True),  # zero3: on by default
        ("tensorwise", {"stage": 3}, False, False),
        ("rowwise", {"stage": 3}, None, False),
        ("tensorwise", {"stage": 2}, None, False),
        ("tensorwise", {"stage": 3, "offload_parameters": True}, None, False),
        ("tensorwise", {"stage": 3, "dims": object()}, None, False),  # NDParallelStrategy
        ("tensorwise", None, None, False),  # no trainer
    ],
)
def test_float8_all_gather_applies_under_zero3_tensorwise(
    recipe: str, strategy: dict[str, Any] | None, choice: bool | None, expected: bool
) -> None:
    module = CausalLMModule("tiny", float8=recipe, float8_emulate=True, float8_all_gather=choice)
    if strategy is not None:
        module._trainer = SimpleNamespace(strategy=SimpleNamespace(**strategy))  # type: ignore[assignment]
    assert module._wants_float8_all_gather() is expected


@pytest.mark.parametrize(
    ("recipe", "strategy", "match"),
    [
        ("rowwise", {"stage": 3}, "float8='rowwise'"),
        ("tensorwise", {"stage": 1}, "ZeroStrategy\\(stage=3\\)"),
        ("tensorwise", {"stage": 3, "offload_parameters": True}, "zero3_offload"),
    ],
)
def test_float8_all_gather_true_where_it_cannot_apply_is_named(
    recipe: str, strategy: dict[str, Any], match: str
) -> None:
    module = CausalLMModule("tiny", float8=recipe, float8_emulate=True, float8_all_gather=True)
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(**strategy))  # type: ignore[assignment]
    with pytest.raises(ValueError, match=match):
        module._wants_float8_all_gather()
