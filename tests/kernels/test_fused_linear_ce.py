"""Fused linear + cross-entropy (Triton interpreter on CPU): fp64 reference with derived tolerances, chunking that
never holds the full logits, ignore_index, reductions, custom op + compile, and vocab-parallel TP on 2 gloo ranks.

Tolerance rule as in test_rmsnorm.py: kernel error <= 2 x plain-PyTorch error in the same dtype + 4 ulp floor.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_llmopt.kernels.fused_linear_ce import _fused_impl, default_chunk_rows, fused_linear_cross_entropy
from lightning_llmopt.kernels.fused_ref import fused_linear_cross_entropy_ref
from lightning_llmopt.testing.triton import triton_available, triton_interpreter_enabled

pytestmark = pytest.mark.skipif(
    not triton_available() or not (torch.cuda.is_available() or triton_interpreter_enabled()),
    reason="needs triton (and TRITON_INTERPRET=1 without CUDA)",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(n, h, v, dtype, seed, ignore_every=4):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(DEVICE, dtype)
    weight = (torch.randn(v, h, generator=g) * 0.5).to(DEVICE, dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[1::ignore_every] = -100  # row 0 always counts
    return hidden, weight, labels.to(DEVICE)


def _grads(fn, hidden, weight, cast=None):  # type: ignore[no-untyped-def]
    leaves = [(t if cast is None else t.to(cast)).detach().requires_grad_() for t in (hidden, weight)]
    loss = fn(*leaves)
    return [loss.detach(), *torch.autograd.grad(loss, leaves)]


@pytest.mark.parametrize(
    "n, h, v, chunk, dtype, reduction",
    [
        (1, 16, 37, None, torch.float32, "mean"),
        (17, 24, 113, 5, torch.float32, "mean"),  # 4 chunks, the last one short
        (113, 32, 300, 64, torch.float16, "mean"),
        (40, 16, 257, 7, torch.float16, "sum"),
    ],
)
def test_matches_float64_reference(n, h, v, chunk, dtype, reduction):
    hidden, weight, labels = _inputs(n, h, v, dtype, seed=n + v)
    kw = dict(reduction=reduction)
    ours = _grads(
        lambda a, b: fused_linear_cross_entropy(a, b, labels, chunk_size=chunk, backend="triton", **kw), hidden, weight
    )
    same = _grads(lambda a, b: fused_linear_cross_entropy_ref(a, b, labels, upcast=False, **kw), hidden, weight)
    ref = _grads(lambda a, b: fused_linear_cross_entropy_ref(a, b, labels, **kw), hidden, weight, torch.float64)
    assert ours[0].dtype == torch.float32 and ours[1].dtype == dtype and ours[2].dtype == dtype
    for name, o, p, r in zip(("loss", "dhidden", "dweight"), ours, same, ref, strict=True):
        err, pt_err = (o.double() - r).abs().max().item(), (p.double() - r).abs().max().item()
        floor = 4 * torch.finfo(o.dtype).eps * max(r.abs().max().item(), 1.0)
        assert err <= 2 * pt_err + floor, f"{name}: kernel error {err:.3g} > 2 x PyTorch {pt_err:.3g} + {floor:.3g}"


def test_ignored_rows_and_all_ignored():
    hidden, weight, labels = _inputs(9, 16, 50, torch.float32, seed=2, ignore_every=3)
    loss, dh, _ = _grads(
        lambda a, b: fused_linear_cross_entropy(a, b, labels, chunk_size=4, backend="triton"), hidden, weight
    )
    assert (dh[labels == -100] == 0).all() and (dh[labels != -100] != 0).any()
    torch.testing.assert_close(loss, F.cross_entropy(hidden @ weight.t(), labels), atol=1e-6, rtol=1e-6)
    nothing = torch.full_like(labels, -100)
    loss, dh, dw = _grads(lambda a, b: fused_linear_cross_entropy(a, b, nothing, backend="triton"), hidden, weight)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(hidden @ weight.t(), nothing))  # as PyTorch
    assert (dh == 0).all() and (dw == 0).all()


class _LargestStorage(TorchDispatchMode):
    """Records the largest storage (bytes) behind any tensor an aten op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def test_never_materializes_the_full_logits():
    n, h, v, chunk = 64, 8, 200, 16
    hidden, weight, labels = _inputs(n, h, v, torch.float32, seed=4)
    with _LargestStorage() as mode:
        loss, dh, dw = _fused_impl(hidden, weight, labels, -100, chunk, "mean", "", torch.float32, True, True)
    assert mode.largest == chunk * v * 4 < n * v * 4  # one fp32 chunk of logits; dW (v * h), dh (n * h) smaller
    torch.testing.assert_close(loss, F.cross_entropy(hidden @ weight.t(), labels), atol=1e-6, rtol=1e-6)
    assert default_chunk_rows(300, 100) == 150 and default_chunk_rows(32768, 128256) == 4096  # >= 2 chunks; 2^29


def test_autocast_compute_dtype_and_module():
    from lightning_llmopt.layers.loss import FusedLinearCrossEntropy

    hidden, weight, labels = _inputs(12, 16, 40, torch.float32, seed=6)
    module = FusedLinearCrossEntropy(chunk_size=5, backend="triton")
    torch.testing.assert_close(
        module(hidden, weight, labels), F.cross_entropy(hidden @ weight.t(), labels), atol=1e-6, rtol=1e-6
    )
    half = fused_linear_cross_entropy(hidden, weight, labels, compute_dtype=torch.float16, backend="triton")
    ref = F.cross_entropy((hidden.half() @ weight.half().t()).float(), labels)
    torch.testing.assert_close(half, ref, atol=1e-4, rtol=1e-4)  # fp16 logits, fp32 softmax on both sides
    with pytest.raises(ValueError, match=r"labels \(11,\) must have hidden's leading shape \(12,\)"):
        fused_linear_cross_entropy(hidden, weight, labels[:11])
    with pytest.raises(ValueError, match="reduction \\('max'\\)"):
        fused_linear_cross_entropy(hidden, weight, labels, reduction="max")


def test_custom_op_fake_and_compile():
    hidden, weight, labels = _inputs(10, 8, 30, torch.float32, seed=7)
    torch.library.opcheck(
        torch.ops.lightning_llmopt.fused_linear_ce.default,
        (hidden, weight, labels, -100, 4, "mean", "", torch.float32, True, True),
        test_utils=("test_schema", "test_faketensor"),
    )

    def fn(a, b):  # type: ignore[no-untyped-def]
        return fused_linear_cross_entropy(a, b, labels, chunk_size=4, backend="triton") * 3

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    for a, b in zip(_grads(compiled, hidden, weight), _grads(fn, hidden, weight), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# ---------------------------------------------------------------- vocab-parallel TP on 2 gloo ranks


def _tp_job(chunk: int) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    hidden, weight, labels = _inputs(23, 16, 64, torch.float32, seed=9)  # the same full inputs on every rank
    shard = weight.chunk(world)[rank]  # rank r holds vocabulary ids [32 r, 32 r + 32)
    h = hidden.clone().requires_grad_()
    w = shard.clone().requires_grad_()
    loss = fused_linear_cross_entropy(h, w, labels, chunk_size=chunk, process_group=dist.group.WORLD, backend="triton")
    loss.backward()
    h_ref = hidden.clone().requires_grad_()
    w_ref = shard.clone().requires_grad_()
    ref = fused_linear_cross_entropy_ref(h_ref, w_ref, labels, process_group=dist.group.WORLD)
    ref.backward()
    return {
        "loss": loss.detach(),
        "dh": h.grad,
        "dw": w.grad,
        "ref_loss": ref.detach(),
        "ref_dh": h_ref.grad,
        "ref_dw": w_ref.grad,
    }


def test_vocab_parallel_two_ranks_match_single_process(dist_pool):
    hidden, weight, labels = _inputs(23, 16, 64, torch.float32, seed=9)
    single = _grads(lambda a, b: F.cross_entropy(a @ b.t(), labels), hidden, weight, torch.float64)
    out = dist_pool(2).run(_tp_job, 7)
    for rank, r in enumerate(out):
        # fp32 against fp64, sharded softmax: rounding-level agreement (1e-6 relative, CONVENTIONS parallelism parity)
        torch.testing.assert_close(r["loss"].double(), single[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(r["dh"].double(), single[1], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(r["dw"].double(), single[2].chunk(2)[rank], atol=1e-6, rtol=1e-5)
        # the differentiable-all-reduce reference (Megatron-LM's math) agrees too
        torch.testing.assert_close(r["ref_loss"].double(), single[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(r["ref_dh"].double(), single[1], atol=1e-6, rtol=1e-5)
