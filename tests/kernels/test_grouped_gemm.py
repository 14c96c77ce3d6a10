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
    return float((a.detach().double() - b.detach().double()).abs().max())


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
