"""SwiGLU kernel (Triton interpreter on CPU) against an fp64 reference, with derived tolerances (see test_rmsnorm)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_llmopt.kernels.fused_ref import swiglu_ref
from lightning_llmopt.kernels.swiglu import swiglu
from lightning_llmopt.testing.triton import triton_available, triton_interpreter_enabled

pytestmark = pytest.mark.skipif(
    not triton_available() or not (torch.cuda.is_available() or triton_interpreter_enabled()),
    reason="needs triton (and TRITON_INTERPRET=1 without CUDA)",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _run(fn, inputs, grad_out, cast=None):  # type: ignore[no-untyped-def]
    leaves = [(t if cast is None else t.to(cast)).detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_out if cast is None else grad_out.to(cast))]


@pytest.mark.parametrize(
    "shape, dtype, strided",
    [
        ((1,), torch.float32, False),
        ((17, 113), torch.float16, False),
        ((2, 3, 1023), torch.float32, False),
        ((5, 7, 96), torch.float16, True),  # gate/up as halves of one (.., 2F) projection: row-strided views
    ],
)
def test_matches_float64_reference(shape, dtype, strided):
    g = torch.Generator().manual_seed(sum(shape))
    if strided:
        both = (torch.randn(*shape[:-1], 2 * shape[-1], generator=g) * 3).to(DEVICE, dtype)
        a, b = both[..., : shape[-1]], both[..., shape[-1] :]
        assert not a.is_contiguous()
    else:
        a, b = ((torch.randn(shape, generator=g) * 3).to(DEVICE, dtype) for _ in range(2))
    dh = torch.randn(shape, generator=g).to(DEVICE, dtype)
    ours = _run(lambda x, y: swiglu(x, y, backend="triton"), [a, b], dh)
    same = _run(lambda x, y: swiglu_ref(x, y, upcast=False), [a, b], dh)
    ref = _run(swiglu_ref, [a, b], dh, cast=torch.float64)
    for name, o, p, r in zip(("out", "dgate", "dup"), ours, same, ref, strict=True):
        assert o.dtype == dtype and o.shape == r.shape
        err, pt_err = (o.double() - r).abs().max().item(), (p.double() - r).abs().max().item()
        floor = 4 * torch.finfo(dtype).eps * max(r.abs().max().item(), 1.0)
        assert err <= 2 * pt_err + floor, f"{name}: kernel error {err:.3g} > 2 x PyTorch {pt_err:.3g} + {floor:.3g}"


def test_mlp_module_matches_feed_forward():
    from lightning_llmopt.layers.mlp import FusedSwiGLUMLP
    from lightning_llmopt.models.llama import FeedForward

    torch.manual_seed(0)
    ref = FeedForward(32, 80).to(DEVICE)
    fused = FusedSwiGLUMLP.from_module(ref, backend="triton")
    assert fused.w1 is ref.w1 and set(fused.state_dict()) == set(ref.state_dict())
    x = torch.randn(3, 5, 32, device=DEVICE, requires_grad=True)
    torch.testing.assert_close(fused(x), ref(x), atol=1e-6, rtol=1e-5)
    g_f = torch.autograd.grad(fused(x).square().sum(), (x, ref.w1.weight, ref.w3.weight))
    g_r = torch.autograd.grad(ref(x).square().sum(), (x, ref.w1.weight, ref.w3.weight))
    for a, b in zip(g_f, g_r, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # fp32, one rounding instead of two


def test_errors_and_reference_backend():
    a = torch.randn(4, 8)
    torch.testing.assert_close(swiglu(a, a, backend="reference"), F.silu(a) * a)
    with pytest.raises(ValueError, match=r"gate \(4, 8\) and up \(4, 7\) must have the same shape"):
        swiglu(a, a[:, :7])
    with pytest.raises(ValueError, match="must have the same dtype"):
        swiglu(a, a.half())


def test_custom_ops_fake_and_compile():
    a, b, dh = (torch.randn(6, 40, device=DEVICE) for _ in range(3))
    torch.library.opcheck(
        torch.ops.lightning_llmopt.swiglu_fwd.default, (a, b), test_utils=("test_schema", "test_faketensor")
    )
    torch.library.opcheck(
        torch.ops.lightning_llmopt.swiglu_bwd.default, (dh, a, b), test_utils=("test_schema", "test_faketensor")
    )

    def fn(x, y):  # type: ignore[no-untyped-def]
        return swiglu(x, y, backend="triton") + 1

    for p, q in zip(
        _run(torch.compile(fn, backend="aot_eager", fullgraph=True), [a, b], dh), _run(fn, [a, b], dh), strict=True
    ):
        torch.testing.assert_close(p, q, atol=0, rtol=0)
