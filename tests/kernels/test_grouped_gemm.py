"""Grouped GEMM: the Triton kernels (interpreter on CPU) against an fp64 per-expert loop, with derived tolerances.

Tolerance rule (CONVENTIONS.md): the kernel's error against fp64 is at most 2x that of PyTorch's own matmul in the
same dtype on the same inputs (+ a tiny floor for fp32, where both errors can be ~0).
"""

from __future__ import annotations

import pytest
import torch

from lightning_llmopt.kernels.grouped_gemm import grouped_mm, grouped_mm_ref
from lightning_llmopt.testing.triton import triton_available, triton_interpreter_enabled

pytestmark = pytest.mark.skipif(
    not triton_available() or not (torch.cuda.is_available() or triton_interpreter_enabled()),
    reason="needs Triton with a GPU or TRITON_INTERPRET=1",
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference, on the CPU in fp64 (the fp64 references live on the CPU)."""
    return float((a.detach().cpu().double() - b.detach().cpu().double()).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("counts", "n", "k"), [([5, 0, 17, 1], 24, 40), ([33], 17, 8), ([0, 0, 3], 16, 16), ([1, 2, 3, 4, 5, 6, 7], 9, 33)]
)
def test_forward_and_backward(counts: list[int], n: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(sum(counts) + n + k)
    m, e = sum(counts), len(counts)
    x64 = torch.randn(m, k, generator=g, dtype=torch.float64)
    w64 = torch.randn(e, n, k, generator=g, dtype=torch.float64) / k**0.5
    dy64 = torch.randn(m, n, generator=g, dtype=torch.float64)
    c = torch.tensor(counts, device=DEVICE)

    def run(x: torch.Tensor, w: torch.Tensor, backend: str) -> tuple[torch.Tensor, ...]:
        x = x.to(DEVICE).requires_grad_(True)
        w = w.to(DEVICE).requires_grad_(True)
        y = grouped_mm(x, w, c, backend=backend)
        dx, dw = torch.autograd.grad(y, [x, w], dy64.to(DEVICE, y.dtype))
        return y, dx, dw

    ref = run(x64, w64, "reference")  # fp64 loop: the oracle
    torch_same = run(x64.to(dtype), w64.to(dtype), "reference")  # PyTorch matmuls in the tested dtype
    ours = run(x64.to(dtype), w64.to(dtype), "triton")
    floor = 1e-5 if dtype == torch.float32 else 1e-3
    for name, o, t, r in zip(("y", "dx", "dw"), ours, torch_same, ref, strict=True):
        assert o.dtype == dtype and o.shape == r.shape, name
        assert _err(o, r) <= 2 * _err(t, r) + floor, (name, _err(o, r), _err(t, r))


def test_reference_matches_dense_per_expert() -> None:
    x = torch.randn(7, 5, dtype=torch.float64)
    w = torch.randn(2, 3, 5, dtype=torch.float64)
    y = grouped_mm_ref(x, w, torch.tensor([4, 3]))
    torch.testing.assert_close(y[:4], x[:4] @ w[0].T)
    torch.testing.assert_close(y[4:], x[4:] @ w[1].T)


def test_errors() -> None:
    with pytest.raises(ValueError, match="must be \\(E=2, N, K=5\\)"):
        grouped_mm(torch.zeros(3, 5), torch.zeros(2, 4, 6), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="same dtype"):
        grouped_mm(torch.zeros(3, 5), torch.zeros(2, 4, 5, dtype=torch.float64), torch.tensor([1, 2]))


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[5, 0, 17, 1, 0, 9], [33], [0, 0, 3], [1, 2, 3, 4, 5, 6, 7]])
def test_torch_backend_matches_fp64(counts: list[int], dtype: torch.dtype) -> None:
    """``backend="torch"`` (torch._grouped_mm): forward and both gradients within 2x PyTorch's own matmul error
    against fp64, with empty and odd expert groups, and a stride-0 output gradient (``y.sum()``)."""
    if DEVICE == "cuda" and torch.cuda.get_device_capability() < (9, 0) and dtype == torch.bfloat16:
        pytest.skip("torch._grouped_mm bf16 needs sm90 here")
    g = torch.Generator().manual_seed(len(counts) + sum(counts))
    m, e, n, k = sum(counts), len(counts), 24, 40
    x64 = torch.randn(m, k, generator=g, dtype=torch.float64)
    w64 = torch.randn(e, n, k, generator=g, dtype=torch.float64) / k**0.5
    c = torch.tensor(counts, device=DEVICE)
    ref = grouped_mm_ref(x64, w64, torch.tensor(counts))
    x = x64.to(DEVICE, dtype).requires_grad_()
    w = w64.to(DEVICE, dtype).requires_grad_()
    y = grouped_mm(x, w, c, backend="torch")
    y.sum().backward()
    xr, wr = x64.to(DEVICE, dtype).requires_grad_(), w64.to(DEVICE, dtype).requires_grad_()
    yr = grouped_mm_ref(xr, wr, c)  # PyTorch's matmul in the same dtype: the error budget
    yr.sum().backward()
    ones = torch.ones(m, n, dtype=torch.float64)  # dL/dy of y.sum()
    dx_ref = grouped_mm_ref(ones, w64.transpose(1, 2).contiguous(), torch.tensor(counts))
    ends = torch.tensor(counts).cumsum(0).tolist()
    dw_ref = torch.stack([ones[b - c_ : b].t() @ x64[b - c_ : b] for b, c_ in zip(ends, counts, strict=True)])
    floor = 1e-6 if dtype == torch.float32 else 0.0
    assert _err(y, ref) <= 2 * _err(yr, ref) + floor
    assert _err(x.grad, dx_ref) <= 2 * _err(xr.grad, dx_ref) + floor
    assert _err(w.grad, dw_ref) <= 2 * _err(wr.grad, dw_ref) + floor
