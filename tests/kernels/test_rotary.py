"""In-place rotary embedding kernel (Triton interpreter on CPU) against an fp64 reference and the model's apply_rope.

Tolerance rule as in test_rmsnorm.py: kernel error <= 2 x plain-PyTorch error in the same dtype + 4 ulp floor.
"""

from __future__ import annotations

import pytest
import torch

from lightning_llmopt.kernels.fused_ref import rotary_ref
from lightning_llmopt.kernels.rotary import apply_rotary_
from lightning_llmopt.models.rope import apply_rope, rope_table
from lightning_llmopt.testing.triton import triton_available, triton_interpreter_enabled

pytestmark = pytest.mark.skipif(
    not triton_available() or not (torch.cuda.is_available() or triton_interpreter_enabled()),
    reason="needs triton (and TRITON_INTERPRET=1 without CUDA)",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _within_rule(ours, same, ref, name):  # type: ignore[no-untyped-def]
    err = (ours.double() - ref).abs().max().item()
    pt_err = (same.double() - ref).abs().max().item()
    floor = 4 * torch.finfo(ours.dtype).eps * max(ref.abs().max().item(), 1.0)
    assert err <= 2 * pt_err + floor, f"{name}: kernel error {err:.3g} > 2 x PyTorch {pt_err:.3g} + {floor:.3g}"


@pytest.mark.parametrize(
    "B, T, H, D, dtype",
    [
        (1, 1, 1, 64, torch.float32),  # one token
        (2, 17, 4, 80, torch.float16),  # D/2 = 40 padded to 64 lanes
        (1, 113, 3, 128, torch.float32),
        (2, 9, 8, 64, torch.float16),
    ],
)
def test_in_place_matches_float64_reference(B, T, H, D, dtype):
    g = torch.Generator().manual_seed(T * D)
    table = rope_table(256, D, 10000.0, device=DEVICE)
    pos = torch.randint(0, 256, (B, T), generator=g).to(DEVICE)  # arbitrary positions (packed documents, caches)
    x = torch.randn(B, T, H, D, generator=g).to(DEVICE, dtype)
    cos, sin = table[pos][..., 0], table[pos][..., 1]  # (B, T, D/2)
    y = x.clone()
    out = apply_rotary_(y, table[..., 0], table[..., 1], pos, backend="triton")
    assert out is y and out.data_ptr() == y.data_ptr()  # in place
    ref = rotary_ref(x.double(), cos.double(), sin.double())
    _within_rule(out, rotary_ref(x, cos, sin, upcast=False), ref, "out")
    if dtype == torch.float32:  # the reference model's apply_rope on (B, H, T, D) does the same fp32 arithmetic
        torch.testing.assert_close(out, apply_rope(x.transpose(1, 2), table, pos).transpose(1, 2), atol=0, rtol=0)


def test_per_token_cos_sin_broadcast_over_batch():
    """Hugging Face's layout: cos/sin (1, T, D/2) shared by the batch, no positions."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 17, 2, 32, generator=g, device=DEVICE)
    ang = torch.rand(1, 17, 16, generator=g, device=DEVICE) * 6
    out = apply_rotary_(x.clone(), ang.cos(), ang.sin(), backend="triton")
    torch.testing.assert_close(out, rotary_ref(x, ang.cos(), ang.sin()), atol=1e-6, rtol=1e-5)


def test_gradient_through_model_layout_views():
    """q from a Linear, viewed (B, T, H, D) and transposed as the model does; gradients match apply_rope's."""
    torch.manual_seed(0)
    B, T, H, D = 2, 13, 4, 32
    lin = torch.nn.Linear(24, H * D).to(DEVICE)
    inp = torch.randn(B, T, 24, device=DEVICE)
    table = rope_table(64, D, 10000.0, device=DEVICE)
    pos = torch.arange(T, device=DEVICE).expand(B, T)
    dout = torch.randn(B, H, T, D, device=DEVICE)

    def grads(rotate):  # type: ignore[no-untyped-def]
        q = lin(inp).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D) view
        out = rotate(q)
        return [out.detach(), *torch.autograd.grad(out, (lin.weight, lin.bias), dout)]

    fused = grads(
        lambda q: apply_rotary_(q.transpose(1, 2), table[..., 0], table[..., 1], pos, backend="triton").transpose(1, 2)
    )
    ref = grads(lambda q: apply_rope(q, table, pos))
    for a, b in zip(fused, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # fp32: the same rotation, other summation order


def test_module_rotates_q_and_k_of_different_head_counts():
    from lightning_llmopt.layers.rotary import FusedRotary

    table = rope_table(32, 16, 10000.0, device=DEVICE)
    pos = torch.arange(9, device=DEVICE).expand(2, 9)
    q = torch.randn(2, 4, 9, 16, device=DEVICE)  # (B, H, T, D)
    k = torch.randn(2, 1, 9, 16, device=DEVICE)
    rq, rk = FusedRotary(backend="triton")(q.clone(), k.clone(), table, pos)
    torch.testing.assert_close(rq, apply_rope(q, table, pos), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(rk, apply_rope(k, table, pos), atol=1e-6, rtol=1e-5)


def _graph_nodes(fn):  # type: ignore[no-untyped-def]
    """Names of every autograd node reachable from ``fn``."""
    seen, stack, names = set(), [fn], []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        names.append(type(node).__name__)
        stack.extend(nxt for nxt, _ in node.next_functions)
    return names


def test_module_out_of_place_under_autograd_in_place_without():
    """Training: q and k are views of their projections, and an in-place op on a view puts a ``CopySlices`` node
    (allocate, zero and copy the whole projection around the op's gradient) into backward; the module rotates them
    out of place instead, with the same values and gradients. Inference (no autograd): in place, no allocation."""
    from lightning_llmopt.layers.rotary import FusedRotary

    torch.manual_seed(0)
    B, T, H, D = 2, 11, 4, 16
    table = rope_table(32, D, 10000.0, device=DEVICE)
    pos = torch.arange(T, device=DEVICE).expand(B, T)
    lin = torch.nn.Linear(8, 2 * H * D).to(DEVICE)
    inp = torch.randn(B, T, 8, device=DEVICE)
    module = FusedRotary(backend="triton")
    q, k = (t.view(B, T, H, D).transpose(1, 2) for t in lin(inp).chunk(2, dim=-1))
    rq, rk = module(q, k, table, pos)
    names = _graph_nodes(rq.grad_fn) + _graph_nodes(rk.grad_fn)
    assert "CopySlices" not in names and "RotaryOutFunctionBackward" in names
    ref_q, ref_k = apply_rope(q, table, pos), apply_rope(k, table, pos)
    torch.testing.assert_close(rq, ref_q, atol=1e-6, rtol=1e-5)
    dq, dk = torch.randn_like(rq), torch.randn_like(rk)
    ours = torch.autograd.grad((rq, rk), (lin.weight, lin.bias), (dq, dk), retain_graph=True)
    ref = torch.autograd.grad((ref_q, ref_k), (lin.weight, lin.bias), (dq, dk))
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        q, k = (t.view(B, T, H, D).transpose(1, 2) for t in lin(inp).chunk(2, dim=-1))
        before = q.clone()
        rq, _ = module(q, k, table, pos)
    assert rq.data_ptr() == q.data_ptr()
    torch.testing.assert_close(rq, apply_rope(before, table, pos), atol=1e-6, rtol=1e-5)


def test_reference_backend_and_bad_shapes():
    table = rope_table(32, 16, 10000.0)
    pos = torch.arange(5).expand(1, 5)
    x = torch.randn(1, 5, 2, 16)
    ours = apply_rotary_(x.clone(), table[..., 0], table[..., 1], pos, backend="reference")
    torch.testing.assert_close(ours, apply_rope(x.transpose(1, 2), table, pos).transpose(1, 2))
    with pytest.raises(ValueError, match=r"positions \(1, 4\) must be \(B, T\) = \(1, 5\)"):
        apply_rotary_(x, table[..., 0], table[..., 1], pos[:, :4])
    with pytest.raises(ValueError, match=r"x must be \(B, T, H, D\) with an even D"):
        apply_rotary_(torch.randn(5, 2, 16), table[..., 0], table[..., 1], pos)


def test_custom_ops_fake_and_compile():
    table = rope_table(32, 16, 10000.0, device=DEVICE)
    cos, sin = table[..., 0], table[..., 1]
    pos = torch.arange(7, device=DEVICE).expand(2, 7)
    x = torch.randn(2, 7, 3, 16, device=DEVICE)
    torch.library.opcheck(
        torch.ops.lightning_llmopt.rotary.default,
        (x, cos, sin, pos, True),
        test_utils=("test_schema", "test_faketensor"),
    )
    torch.library.opcheck(
        torch.ops.lightning_llmopt.rotary_.default,
        (x.clone(), cos, sin, pos, False),
        test_utils=("test_schema", "test_faketensor"),
    )
    lin = torch.nn.Linear(8, 48).to(DEVICE)
    inp = torch.randn(2, 7, 8, device=DEVICE)

    def fn(a):  # type: ignore[no-untyped-def]
        q = lin(a).view(2, 7, 3, 16)
        return apply_rotary_(q, cos, sin, pos, backend="triton") * 2

    def run(f):  # type: ignore[no-untyped-def]
        out = f(inp)
        return [out.detach(), *torch.autograd.grad(out.square().sum(), (lin.weight,))]

    for a, b in zip(run(torch.compile(fn, backend="aot_eager", fullgraph=True)), run(fn), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_module_under_compile_rotates_out_of_place_without_copies():
    """``FusedRotary`` under ``torch.compile`` takes the out-of-place op: its traced forward and backward graphs hold
    no functionalized in-place op and no copy of q/k, and fewer clones and copies in all than with the in-place op;
    results match eager."""
    import collections

    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    from lightning_llmopt.layers.rotary import FusedRotary

    table = rope_table(32, 16, 10000.0, device=DEVICE)
    cos, sin = table[..., 0], table[..., 1]
    pos = torch.arange(7, device=DEVICE).expand(2, 7)
    wq, wk = torch.nn.Linear(8, 4 * 16).to(DEVICE), torch.nn.Linear(8, 2 * 16).to(DEVICE)  # as the model's
    inp = torch.randn(2, 7, 8, device=DEVICE)
    module = FusedRotary(backend="triton")

    def in_place(q, k):  # type: ignore[no-untyped-def]
        q = apply_rotary_(q.transpose(1, 2), cos, sin, pos, backend="triton").transpose(1, 2)
        return q, apply_rotary_(k.transpose(1, 2), cos, sin, pos, backend="triton").transpose(1, 2)

    def traced_ops(rot):  # type: ignore[no-untyped-def]
        ops: list[collections.Counter] = []

        def count(gm, example_inputs):  # type: ignore[no-untyped-def]
            ops.append(collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
            return make_boxed_func(gm.forward)

        def backend(gm, example_inputs):  # type: ignore[no-untyped-def]
            return aot_module_simplified(gm, example_inputs, fw_compiler=count, bw_compiler=count)

        def fn(a):  # type: ignore[no-untyped-def]
            q, k = wq(a).view(2, 7, 4, 16).transpose(1, 2), wk(a).view(2, 7, 2, 16).transpose(1, 2)
            q, k = rot(q, k) if rot is in_place else rot(q, k, table, pos)
            return q.sum(1) * k.sum(1)

        def run(f):  # type: ignore[no-untyped-def]
            out = f(inp)
            return [out.detach(), *torch.autograd.grad(out.square().sum(), (wq.weight, wk.weight))]

        for a, b in zip(run(torch.compile(fn, backend=backend, fullgraph=True)), run(fn), strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        assert len(ops) == 2, ops  # one forward and one backward graph
        return sum(ops, collections.Counter())

    def copies(c):  # type: ignore[no-untyped-def]
        return sum(v for k, v in c.items() if k.startswith(("aten.copy", "aten.clone")))

    ours, old = traced_ops(module), traced_ops(in_place)
    assert ours["lightning_llmopt.rotary.default"] == 4, ours  # q and k, forward and backward
    assert not {k: v for k, v in ours.items() if "functionalized" in k or k.startswith("aten.copy")}, ours
    assert copies(ours) < copies(old), (ours, old)
