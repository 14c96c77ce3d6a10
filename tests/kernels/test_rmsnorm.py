"""RMSNorm kernel (Triton interpreter on CPU) against an fp64 reference, with derived tolerances.

Rule (docs/fused_kernels.md): ``max|kernel - ref64| <= 2 * max|torch_same_dtype - ref64| + 4 * eps * max(|ref64|, 1)``
for the output and every gradient; ``torch_same_dtype`` is the reference computing in the inputs' dtype
(``upcast=False``). The floor covers outputs where PyTorch's own error is a handful of roundings or exactly 0.
"""

from __future__ import annotations

import pytest
import torch

from lightning_llmopt.kernels.fused_common import resolve_backend
from lightning_llmopt.kernels.fused_ref import rms_norm_ref
from lightning_llmopt.kernels.rmsnorm import rms_norm
from lightning_llmopt.testing.triton import triton_available, triton_interpreter_enabled

pytestmark = pytest.mark.skipif(
    not triton_available() or not (torch.cuda.is_available() or triton_interpreter_enabled()),
    reason="needs triton (and TRITON_INTERPRET=1 without CUDA)",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _derived_check(ours, same, ref, names):  # type: ignore[no-untyped-def]
    for name, o, p, r in zip(names, ours, same, ref, strict=True):
        assert o.shape == r.shape and not torch.isnan(o).any(), name
        err = (o.double() - r).abs().max().item()
        pt_err = (p.double() - r).abs().max().item()
        floor = 4 * torch.finfo(o.dtype).eps * max(r.abs().max().item(), 1.0)
        assert err <= 2 * pt_err + floor, f"{name}: kernel error {err:.3g} > 2 x PyTorch {pt_err:.3g} + {floor:.3g}"


def _run(fn, inputs, grad_out, cast=None):  # type: ignore[no-untyped-def]
    leaves = [(t if cast is None else t.to(cast)).detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_out if cast is None else grad_out.to(cast))]


@pytest.mark.parametrize(
    "shape, dtype, out_dtype",
    [
        ((1, 64), torch.float32, None),  # one row
        ((17, 80), torch.float16, None),  # D not a power of two (padded to 128 lanes)
        ((3, 7, 113), torch.float32, None),  # odd D, 3-D input
        ((2, 5, 256), torch.float16, None),
        ((9, 48), torch.float32, torch.float16),  # narrower output (the autocast path)
    ],
)
def test_matches_float64_reference(shape, dtype, out_dtype):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(DEVICE, dtype)
    w = (1 + 0.3 * torch.randn(shape[-1], generator=g)).to(DEVICE, dtype)
    dy = torch.randn(shape, generator=g).to(DEVICE, out_dtype or dtype)
    ours = _run(lambda a, b: rms_norm(a, b, 1e-5, out_dtype=out_dtype, backend="triton"), [x, w], dy)
    same = _run(lambda a, b: rms_norm_ref(a, b, 1e-5, out_dtype=out_dtype, upcast=False), [x, w], dy)
    ref = _run(lambda a, b: rms_norm_ref(a, b, 1e-5), [x, w], dy, cast=torch.float64)
    assert ours[0].dtype == (out_dtype or dtype) and ours[1].dtype == dtype and ours[2].dtype == dtype
    _derived_check(ours, same, ref, ("out", "dx", "dw"))


def test_strided_input_and_fp32_weight():
    """A transposed (non-contiguous) input and an fp32 weight on fp16 activations (promotes to fp32, as PyTorch)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 5, 40, generator=g).to(DEVICE, torch.float16).transpose(0, 1)  # (5, 7, 40) view
    w = (1 + 0.3 * torch.randn(40, generator=g)).to(DEVICE)
    out = rms_norm(x, w, backend="triton")
    assert out.dtype == torch.float32 and out.shape == (5, 7, 40)
    torch.testing.assert_close(out, rms_norm_ref(x, w), atol=1e-6, rtol=1e-5)  # same fp32 math, other order


def test_module_matches_model_rmsnorm_and_shares_weight():
    from lightning_llmopt.layers.norms import FusedRMSNorm
    from lightning_llmopt.models.llama import RMSNorm

    torch.manual_seed(0)
    ref = RMSNorm(48, eps=1e-6).to(DEVICE)
    with torch.no_grad():
        ref.weight.normal_(1.0, 0.2)
    fused = FusedRMSNorm.from_module(ref, backend="triton")
    assert fused.weight is ref.weight and fused.eps == 1e-6 and fused.variance_epsilon == 1e-6
    x = torch.randn(2, 9, 48, device=DEVICE, requires_grad=True)
    torch.testing.assert_close(fused(x), ref(x), atol=1e-6, rtol=1e-5)
    (gx, gw), (rx, rw) = (torch.autograd.grad(m(x).square().sum(), (x, ref.weight)) for m in (fused, ref))
    torch.testing.assert_close(gx, rx, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gw, rw, atol=1e-5, rtol=1e-5)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):  # the output goes straight to the autocast dtype
        assert FusedRMSNorm.from_module(ref, backend="reference")(x).dtype == torch.bfloat16
        assert FusedRMSNorm.from_module(ref, cast_to_autocast=False, backend="reference")(x).dtype == torch.float32


def test_backend_switch_and_errors(monkeypatch):
    x, w = torch.randn(4, 16), torch.ones(16)
    monkeypatch.setenv("LLMOPT_FUSED_BACKEND", "reference")
    assert resolve_backend(None, x.device) == "reference"
    assert torch.equal(rms_norm(x, w), rms_norm_ref(x, w))
    monkeypatch.setenv("LLMOPT_FUSED_BACKEND", "cuda-graphs")
    with pytest.raises(ValueError, match="'cuda-graphs'"):
        rms_norm(x, w)
    monkeypatch.delenv("LLMOPT_FUSED_BACKEND")
    assert resolve_backend("auto", torch.device("cpu")) == "reference"
    with pytest.raises(ValueError, match=r"weight shape \(8,\) must be \(16,\)"):
        rms_norm(x, torch.ones(8))


def test_custom_ops_fake_and_compile():
    x = torch.randn(6, 32, device=DEVICE)
    w = torch.rand(32, device=DEVICE) + 0.5
    torch.library.opcheck(
        torch.ops.lightning_llmopt.rms_norm_fwd.default,
        (x, w, 1e-5, torch.float32),
        test_utils=("test_schema", "test_faketensor"),
    )
    y, rstd = torch.ops.lightning_llmopt.rms_norm_fwd(x, w, 1e-5, torch.float32)
    torch.library.opcheck(
        torch.ops.lightning_llmopt.rms_norm_bwd.default,
        (torch.randn_like(y), x, w, rstd),
        test_utils=("test_schema", "test_faketensor"),
    )

    def fn(a, b):  # type: ignore[no-untyped-def]
        return rms_norm(a, b, backend="triton") * 2

    dy = torch.randn(6, 32, device=DEVICE)
    eager = _run(fn, [x, w], dy)
    traced = _run(torch.compile(fn, backend="aot_eager", fullgraph=True), [x, w], dy)
    for a, b in zip(traced, eager, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def _add_norm_ref(x, r, w, out_dtype, upcast):  # type: ignore[no-untyped-def]
    h = x + r  # PyTorch's add (the promoted dtype)
    return h, rms_norm_ref(h, w, 1e-5, out_dtype=out_dtype, upcast=upcast)


@pytest.mark.parametrize(
    "shape, x_dtype, r_dtype, out_dtype",
    [
        ((1, 64), torch.float32, torch.float32, None),
        ((17, 80), torch.float32, torch.float16, torch.float16),  # fp32 residual + half branch, half out (autocast)
        ((3, 7, 113), torch.float16, torch.float16, None),  # odd D, 3-D
        ((2, 5, 256), torch.float32, torch.float32, torch.float16),
    ],
)
def test_add_rms_norm_matches_float64_reference(shape, x_dtype, r_dtype, out_dtype):
    """``add_rms_norm``: ``h`` equals PyTorch's ``x + r`` bit for bit; ``y`` and the gradients of ``x``, ``r`` and
    the weight (from a gradient on both ``h`` and ``y``) follow the derived rule against fp64."""
    from lightning_llmopt.kernels.rmsnorm import add_rms_norm

    g = torch.Generator().manual_seed(sum(shape) + 7)
    x = (torch.randn(shape, generator=g) * 3).to(DEVICE, x_dtype)
    r = torch.randn(shape, generator=g).to(DEVICE, r_dtype)
    w = (1 + 0.3 * torch.randn(shape[-1], generator=g)).to(DEVICE, x_dtype)
    h_dtype = torch.promote_types(x_dtype, r_dtype)
    dh = torch.randn(shape, generator=g).to(DEVICE, h_dtype)
    dy = torch.randn(shape, generator=g).to(DEVICE, out_dtype or h_dtype)

    def run(fn, cast=None):  # type: ignore[no-untyped-def]
        leaves = [(t if cast is None else t.to(cast)).detach().requires_grad_() for t in (x, r, w)]
        h, y = fn(*leaves)
        grads = torch.autograd.grad((h, y), leaves, [t if cast is None else t.to(cast) for t in (dh, dy)])
        return [h.detach(), y.detach(), *grads]

    ours = run(lambda a, b, c: add_rms_norm(a, b, c, 1e-5, out_dtype=out_dtype, backend="triton"))
    same = run(lambda a, b, c: _add_norm_ref(a, b, c, out_dtype, upcast=False))
    ref = run(lambda a, b, c: _add_norm_ref(a, b, c, out_dtype, upcast=True), cast=torch.float64)
    assert torch.equal(ours[0], x + r) and ours[0].dtype == h_dtype
    assert ours[1].dtype == (out_dtype or h_dtype) and (ours[2].dtype, ours[3].dtype) == (x_dtype, r_dtype)
    _derived_check(ours[1:], same[1:], ref[1:], ("y", "dx", "dr", "dw"))


@pytest.mark.parametrize(
    "shape, dtype, out_dtype",
    [((1, 64), torch.float32, None), ((3, 7, 113), torch.float32, torch.float16), ((17, 80), torch.float16, None)],
)
def test_rms_norm_residual_passes_x_through_and_fuses_its_gradient(shape, dtype, out_dtype):
    """``rms_norm_residual``: the returned ``x`` is the input's storage; the gradient of ``x`` (from the stream and
    from the norm) follows the derived rule against fp64 ``rms_norm`` with ``x`` used twice, and reaches ``x``
    through the function's one backward node (no separate accumulation)."""
    from lightning_llmopt.kernels.rmsnorm import rms_norm_residual

    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 2).to(DEVICE, dtype)
    w = (1 + 0.3 * torch.randn(shape[-1], generator=g)).to(DEVICE, dtype)
    d_stream = torch.randn(shape, generator=g).to(DEVICE, dtype)
    dy = torch.randn(shape, generator=g).to(DEVICE, out_dtype or dtype)

    def run(fn, cast=None):  # type: ignore[no-untyped-def]
        leaves = [(t if cast is None else t.to(cast)).detach().requires_grad_() for t in (x, w)]
        stream, y = fn(*leaves)
        grads = torch.autograd.grad((stream, y), leaves, [t if cast is None else t.to(cast) for t in (d_stream, dy)])
        return [stream, y.detach(), *grads]

    ours = run(lambda a, c: rms_norm_residual(a, c, 1e-5, out_dtype=out_dtype, backend="triton"))
    same = run(lambda a, c: (a, rms_norm_ref(a, c, 1e-5, out_dtype=out_dtype, upcast=False)))
    ref = run(lambda a, c: (a, rms_norm_ref(a, c, 1e-5, out_dtype=out_dtype, upcast=True)), cast=torch.float64)
    assert torch.equal(ours[0], x)
    node, names = ours[0].grad_fn, []  # x's stream output -> (views) -> the function's node -> x's leaf
    while node is not None and type(node).__name__ != "AccumulateGrad":
        names.append(type(node).__name__)
        node = node.next_functions[0][0]
    assert "RMSNormResidualFunctionBackward" in names and node is not None
    _derived_check(ours[1:], same[1:], ref[1:], ("y", "dx", "dw"))
    leaf = x.detach().requires_grad_()
    stream, _ = rms_norm_residual(leaf, w, backend="triton")
    assert stream.data_ptr() == leaf.data_ptr()  # an alias, no copy
    with torch.no_grad():  # no autograd: x itself
        assert rms_norm_residual(x, w, backend="triton")[0] is x


def test_int64_offsets_give_the_same_results(monkeypatch):
    """Rows whose element offsets pass 2**31 take 64-bit offsets (tensors too large to build here); forcing that
    path on a small input gives bit-identical outputs and gradients to the 32-bit one."""
    from lightning_llmopt.kernels import rmsnorm_triton
    from lightning_llmopt.kernels.rmsnorm import add_rms_norm

    g = torch.Generator().manual_seed(5)
    x, r = (torch.randn(9, 48, generator=g).to(DEVICE) for _ in range(2))
    w = torch.randn(48, generator=g).to(DEVICE)
    dh, dy = (torch.randn(9, 48, generator=g).to(DEVICE) for _ in range(2))

    def run():  # type: ignore[no-untyped-def]
        leaves = [t.detach().requires_grad_() for t in (x, r, w)]
        h, y = add_rms_norm(*leaves, backend="triton")
        return [h.detach(), y.detach(), *torch.autograd.grad((h, y), leaves, (dh, dy))]

    narrow = run()
    monkeypatch.setattr(rmsnorm_triton, "_needs_int64", lambda *a: True)
    for a, b in zip(run(), narrow, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("d, chunk", [(80, 16), (113, 32), (256, 256)])
def test_two_pass_forward_matches_one_pass(d, chunk):
    """The two-pass forward (an autotuned alternative: column chunks, rows re-read from L2) gives the one-pass
    kernel's statistics to fp32 rounding and its fp16 output to one rounding step, on odd sizes where the last chunk
    is partly masked; without the statistics store the output is unchanged and nothing is written."""
    from lightning_llmopt.kernels.fused_common import next_pow2
    from lightning_llmopt.kernels.rmsnorm_triton import _rms_fwd_kernel

    g = torch.Generator().manual_seed(d)
    n = 7
    x = (torch.randn(n, d, generator=g) * 3).to(DEVICE)
    w = torch.randn(d, generator=g).to(DEVICE)

    def run(two_pass, store=True):  # type: ignore[no-untyped-def]
        y = torch.empty(n, d, device=DEVICE, dtype=torch.float16)
        rstd = torch.full((n,), -1.0, device=DEVICE)
        args = (x, w, y, rstd, x, x, x.stride(0), y.stride(0), x.stride(0), x.stride(0), n, d, 1e-5)
        _rms_fwd_kernel[(4,)](*args, BLOCK_D=max(16, next_pow2(d)), ROWS=2, HAS_RES=False, IDX64=False,
                              STORE_RSTD=store, TWO_PASS=two_pass, CHUNK=chunk)
        return y, rstd

    one, two = run(False), run(True)
    ref = (1 / (x.double().square().mean(-1) + 1e-5).sqrt()).float()
    torch.testing.assert_close(two[1], ref, atol=0, rtol=4e-7)  # fp32 sums in another order: a few ulp at most
    torch.testing.assert_close(one[1], ref, atol=0, rtol=4e-7)
    torch.testing.assert_close(two[0], one[0], atol=0, rtol=1e-3)  # the fp16 output: at most one rounding step
    y, rstd = run(True, store=False)
    assert torch.equal(y, two[0]) and bool((rstd == -1).all())


def test_add_rms_norm_errors_and_reference_backend():
    from lightning_llmopt.kernels.rmsnorm import add_rms_norm

    x, r, w = torch.randn(4, 16), torch.randn(4, 16), torch.ones(16)
    h, y = add_rms_norm(x, r, w, backend="reference")
    assert torch.equal(h, x + r) and torch.equal(y, rms_norm_ref(x + r, w))
    with pytest.raises(ValueError, match=r"x \(4, 16\) and r \(4, 8\) must have the same shape"):
        add_rms_norm(x, torch.randn(4, 8), w)
    with pytest.raises(ValueError, match=r"weight shape \(8,\) must be \(16,\)"):
        add_rms_norm(x, r, torch.ones(8))


def test_auto_defers_elementwise_kernels_to_the_compiler(monkeypatch):
    """``"auto"`` while ``torch.compile`` traces: the reference for the elementwise/norm kernels (the compiler fuses
    them with their neighbours), the kernel where the caller does not defer (the fused CE) or names ``"triton"``."""
    cuda = torch.device("cuda")
    monkeypatch.delenv("LLMOPT_FUSED_BACKEND", raising=False)
    assert resolve_backend("auto", cuda, defer_to_compiler=True) == "triton"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert resolve_backend("auto", cuda, defer_to_compiler=True) == "reference"
    assert resolve_backend(None, cuda, defer_to_compiler=True) == "reference"
    assert resolve_backend("auto", cuda) == "triton"
    monkeypatch.setenv("LLMOPT_FUSED_BACKEND", "triton")
    assert resolve_backend(None, cuda, defer_to_compiler=True) == "triton"
