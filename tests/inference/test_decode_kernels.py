"""The engine's fused Triton kernels (interpreter on CPU) against the reference model's own PyTorch operations.

Each kernel promises the reference's rounding (fp32 math, rounding to the activation dtype at the same points), so
fp16 results must agree with PyTorch to within one unit in the last place (different summation order in the norm's
mean, fused multiply-adds in RoPE) and fp32 results to a few ulps.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from lightning_llmopt.models.llama import RMSNorm
from lightning_llmopt.models.rope import apply_rope, rope_table
from lightning_llmopt.testing.triton import triton_available, triton_interpreter_enabled

pytestmark = pytest.mark.skipif(
    not triton_available() or not (torch.cuda.is_available() or triton_interpreter_enabled()),
    reason="needs triton (and TRITON_INTERPRET=1 without CUDA)",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _ulp_close(a, b, ulps):
    eps = torch.finfo(a.dtype).eps
    tol = ulps * eps * b.float().abs().clamp(min=1.0)
    assert ((a.float() - b.float()).abs() <= tol).all(), (a.float() - b.float()).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_rms_norm(dtype):
    from lightning_llmopt.inference.decode_kernels import add_rms_norm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 80, generator=g).to(DEVICE, dtype)
    d = torch.randn(5, 80, generator=g).to(DEVICE, dtype)
    norm = RMSNorm(80).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(80, generator=g) + 0.5)
        out, res = add_rms_norm(x, norm.weight, norm.eps, d)
        _ulp_close(res, x + d, 0)
        _ulp_close(out, norm(x + d), 2 if dtype == torch.float16 else 8)
        out2, res2 = add_rms_norm(x, norm.weight, norm.eps)
        assert res2 is x
        _ulp_close(out2, norm(x), 2 if dtype == torch.float16 else 8)


@pytest.mark.parametrize("quant", [False, True])
def test_rope_store(quant):
    from lightning_llmopt.inference.decode_kernels import rope_store

    g = torch.Generator().manual_seed(1)
    N, H, H_kv, D, nb, bs = 6, 4, 2, 32, 5, 4
    q = torch.randn(N, H, D, generator=g).to(DEVICE)
    k = torch.randn(N, H_kv, D, generator=g).to(DEVICE)
    v = torch.randn(N, H_kv, D, generator=g).to(DEVICE)
    pos = torch.tensor([0, 3, 7, 1, 15, 9], device=DEVICE)
    blocks = torch.tensor([1, 1, 2, 4, 3, 2], device=DEVICE)
    slots = torch.tensor([0, 3, 1, 2, 0, 2], device=DEVICE)
    table = rope_table(32, D, 10000.0).to(DEVICE)
    dtype = torch.int8 if quant else torch.float32
    kc = torch.zeros(nb, H_kv, bs, D, dtype=dtype, device=DEVICE)
    vc = torch.zeros_like(kc)
    ks = (torch.rand(H_kv, generator=g) * 0.02 + 0.01).to(DEVICE) if quant else None
    vs = (torch.rand(H_kv, generator=g) * 0.02 + 0.01).to(DEVICE) if quant else None
    q_ref = apply_rope(q.transpose(0, 1)[None], table, pos[None])[0].transpose(0, 1)
    k_ref = apply_rope(k.transpose(0, 1)[None], table, pos[None])[0].transpose(0, 1)
    qq, kk = q.clone(), k.clone()
    rope_store(qq, kk, v, pos, table, blocks, slots, kc, vc, ks, vs)
    _ulp_close(qq, q_ref, 4)
    _ulp_close(kk, k_ref, 4)
    stored_k, stored_v = kc[blocks, :, slots], vc[blocks, :, slots]
    if quant:
        expect_k = torch.round(k_ref / ks.view(1, -1, 1)).clamp(-127, 127)
        expect_v = torch.round(v / vs.view(1, -1, 1)).clamp(-127, 127)
        # round-half-up vs PyTorch's half-to-even, and the 4-ulp RoPE difference, move a value by at most one step
        assert (stored_k.float() - expect_k).abs().max() <= 1 and (stored_v.float() - expect_v).abs().max() <= 1
        assert (stored_k.float() == expect_k).float().mean() > 0.99
    else:
        _ulp_close(stored_k, k_ref, 4)
        assert torch.equal(stored_v, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul(dtype):
    from lightning_llmopt.inference.decode_kernels import silu_mul

    g = torch.Generator().manual_seed(2)
    a = (torch.randn(3, 700, generator=g) * 3).to(DEVICE, dtype)
    b = torch.randn(3, 700, generator=g).to(DEVICE, dtype)
    _ulp_close(silu_mul(a, b), F.silu(a) * b, 1 if dtype == torch.float16 else 4)


@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize(("N", "K", "bias"), [(40, 72, False), (17, 130, True)])
def test_gemv(N, K, bias, M):
    """One row (the one-row kernel) and several (the tensor-core rows kernel, padded to 16 rows)."""
    from lightning_llmopt.inference.gemv import gemv

    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(K, N, bias=bias).to(DEVICE)
    x = torch.randn(M, K, generator=g).to(DEVICE)
    with torch.no_grad():
        ref = lin(x)
        out = gemv(x, lin.weight, lin.bias)
    # fp32 both ways, different summation order: a few ulps of the sum of |terms|
    scale = (x.abs() @ lin.weight.abs().T).max().item()
    assert (out - ref).abs().max().item() <= 8 * torch.finfo(torch.float32).eps * scale


@pytest.mark.parametrize(
    ("sizes", "K", "bias"), [((40, 24, 24), 72, False), ((17, 9, 9), 130, True), ((33,), 64, True)]
)
@pytest.mark.parametrize("M", [1, 5])
def test_gemv_cat(sizes, K, bias, M):
    """q, k and v in one launch: rows of the concatenated weights (segments need not align with the row tiles)."""
    from lightning_llmopt.inference.gemv import gemv_cat

    g = torch.Generator().manual_seed(5)
    lins = [torch.nn.Linear(K, n, bias=bias).to(DEVICE) for n in sizes]
    x = torch.randn(M, K, generator=g).to(DEVICE)
    with torch.no_grad():
        ref = torch.cat([lin(x) for lin in lins], dim=-1)
        out = gemv_cat(x, [lin.weight for lin in lins], [lin.bias for lin in lins] if bias else None)
    assert out.shape == ref.shape
    w = torch.cat([lin.weight for lin in lins])
    scale = (x.abs() @ w.abs().T).max().item()
    assert (out - ref).abs().max().item() <= 8 * torch.finfo(torch.float32).eps * scale


@pytest.mark.parametrize("M", [1, 4])
@pytest.mark.parametrize(("N", "K", "dtype"), [(40, 72, torch.float16), (19, 130, torch.float32)])
def test_gemv_swiglu_rounds_like_the_separate_kernels(N, K, dtype, M, monkeypatch):
    """The fused gate/up GEMV with the SiLU epilogue equals ``silu_mul(gemv(gate), gemv(up))`` bit for bit (same
    summation order, same rounding points) and the PyTorch expression within the products' rounding. On CUDA the
    autotuner picks a tile per kernel variant, and another ``BLOCK_K`` sums in another order, so both run one tile."""
    from lightning_llmopt.inference import gemv as gemv_module
    from lightning_llmopt.inference.decode_kernels import silu_mul
    from lightning_llmopt.inference.gemv import gemv, gemv_swiglu

    for name in ("_gemv_configs", "_rows_configs"):
        first = getattr(gemv_module, name)()[:1]
        monkeypatch.setattr(gemv_module, name, functools.partial(list, first))
    monkeypatch.setattr(gemv_module, "_tuned_gemv", None)
    monkeypatch.setattr(gemv_module, "_tuned_rows", None)

    g = torch.Generator().manual_seed(6)
    gate, up = (torch.randn(N, K, generator=g).to(DEVICE, dtype) / K**0.5 for _ in range(2))
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    out = gemv_swiglu(x, gate, up)
    assert torch.equal(out, silu_mul(gemv(x, gate), gemv(x, up)))
    ref = F.silu(x.double() @ gate.double().T) * (x.double() @ up.double().T)
    assert (out.double() - ref).abs().max().item() <= 4 * torch.finfo(dtype).eps * max(ref.abs().max().item(), 1.0)


def test_gemv_rejects_mismatched_weights():
    from lightning_llmopt.inference.gemv import gemv_cat, gemv_swiglu

    x = torch.randn(1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="share K"):
        gemv_cat(x, [torch.randn(4, 8, device=DEVICE), torch.randn(4, 6, device=DEVICE)])
    with pytest.raises(ValueError, match="one to three"):
        gemv_cat(x, [torch.randn(4, 8, device=DEVICE)] * 4)
    with pytest.raises(ValueError, match="SwiGLU"):
        gemv_swiglu(x, torch.randn(4, 8, device=DEVICE), torch.randn(5, 8, device=DEVICE))


@pytest.mark.parametrize("M", [1, 6])
@pytest.mark.parametrize("has_delta", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_norm_gemvs_match_add_rms_norm_then_gemv(has_delta, dtype, M):
    """RMSNorm (with the residual add) fused into the q/k/v (with biases, Qwen-style) and gate/up GEMVs: the residual
    equals add_rms_norm's bit for bit, and the products agree with add_rms_norm + GEMV within the rounding of the
    normalised input, which the fused kernel skips (two roundings of each input element, a few ulps of the sum of
    |terms|)."""
    from lightning_llmopt.inference.decode_kernels import add_rms_norm
    from lightning_llmopt.inference.gemv import gemv_cat, gemv_swiglu, norm_gemv_cat, norm_gemv_swiglu

    g = torch.Generator().manual_seed(7)
    K = 136
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    delta = torch.randn(M, K, generator=g).to(DEVICE, dtype) if has_delta else None
    nw = (1 + 0.1 * torch.randn(K, generator=g)).to(DEVICE, dtype)
    ws = [(torch.randn(n, K, generator=g) / K**0.5).to(DEVICE, dtype) for n in (48, 16, 16)]
    biases = [torch.randn(w.shape[0], generator=g).to(DEVICE, dtype) for w in ws] if has_delta else None
    h, res_ref = add_rms_norm(x, nw, 1e-5, delta)
    y, res = norm_gemv_cat(x, nw, 1e-5, delta, ws, biases)
    assert torch.equal(res, res_ref)
    ref = gemv_cat(h, ws, biases)
    eps = torch.finfo(dtype).eps
    scale = (h.float().abs() @ torch.cat(ws).float().abs().T).max().item()
    assert (y.float() - ref.float()).abs().max().item() <= 6 * eps * max(scale, 1.0)
    s, res2 = norm_gemv_swiglu(x, nw, 1e-5, delta, ws[1], ws[2])
    assert torch.equal(res2, res_ref)
    s_ref = gemv_swiglu(h, ws[1], ws[2])
    assert (s.float() - s_ref.float()).abs().max().item() <= 8 * eps * max(s_ref.float().abs().max().item(), 1.0)
