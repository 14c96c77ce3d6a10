"""Magnitude (per layer, global) and N:M masks, the cubic schedule, and 2:4 semi-structured kernels on GPU."""

from __future__ import annotations

import pytest
import torch

from lightning_llmopt.compression import (
    apply_masks,
    cubic_sparsity,
    global_magnitude_masks,
    is_nm_sparse,
    magnitude_mask,
    magnitude_masks,
    nm_mask,
    prune_model,
    semi_structured_available,
    sparsity_of,
    to_semi_structured,
)
from lightning_llmopt.models import Llama, LlamaConfig


def test_magnitude_mask_drops_smallest() -> None:
    w = torch.randn(13, 17, generator=torch.Generator().manual_seed(0))
    mask = magnitude_mask(w, 0.5)
    assert int((~mask).sum()) == round(0.5 * w.numel())
    assert w[~mask].abs().max() <= w[mask].abs().min()


def test_global_masks_share_one_threshold() -> None:
    g = torch.Generator().manual_seed(1)
    ws = {"a": torch.randn(8, 8, generator=g) * 0.1, "b": torch.randn(8, 16, generator=g)}
    masks = global_magnitude_masks(ws, 0.5)
    assert sum(int((~m).sum()) for m in masks.values()) == 96
    kept = torch.cat([ws[k][masks[k]].abs() for k in ws])
    dropped = torch.cat([ws[k][~masks[k]].abs() for k in ws])
    assert dropped.max() <= kept.min()
    assert (~masks["a"]).float().mean() > (~masks["b"]).float().mean()  # the small layer is pruned harder


@pytest.mark.parametrize("shape", [(1, 4), (7, 12), (64, 384)])
def test_two_four_masks_valid(shape: tuple[int, int]) -> None:
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    mask = nm_mask(w.abs())
    groups = mask.view(shape[0], -1, 4)
    assert (groups.sum(-1) == 2).all() and is_nm_sparse(mask)
    kept_min = torch.where(groups, w.abs().view_as(groups), torch.inf).min(-1).values
    dropped_max = torch.where(~groups, w.abs().view_as(groups), -torch.inf).max(-1).values
    assert (dropped_max <= kept_min).all()  # in every group, the two largest survive
    assert not is_nm_sparse(torch.ones(shape, dtype=torch.bool))
    with pytest.raises(ValueError, match="multiple of m"):
        nm_mask(torch.randn(3, 6))


def test_model_masks_and_schedule() -> None:
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_preset("tiny"))
    masks = magnitude_masks(model, 0.3)
    assert "output" not in masks and len(masks) == 14
    apply_masks(model, masks)
    assert abs(sparsity_of(model, masks) - 0.3) < 1e-3
    report = prune_model(model, pattern="2:4")
    assert all(is_nm_sparse(model.get_submodule(n).weight != 0) for n in report.masks)
    assert report.sparsity == 0.5
    assert cubic_sparsity(0, 0.8, 10, 20) == 0.0 and cubic_sparsity(25, 0.8, 10, 20) == 0.8
    assert cubic_sparsity(15, 0.8, 10, 20) == pytest.approx(0.8 * (1 - 0.5**3))
    assert cubic_sparsity(10, 0.8, 10, 20, initial=0.1) == pytest.approx(0.1)


@pytest.mark.gpu
def test_semi_structured_matches_masked_dense() -> None:
    if not semi_structured_available():
        pytest.skip("needs a GPU of compute capability >= 8.0")
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 128, bias=False, device="cuda", dtype=torch.float16)
    model = torch.nn.Sequential(lin)
    apply_masks(model, {"0": nm_mask(lin.weight.abs())})
    x = torch.randn(64, 256, device="cuda", dtype=torch.float16)
    dense = lin(x)
    ref = x.double() @ lin.weight.double().t()
    to_semi_structured(model, ["0"])
    sparse = model(x)
    # derived tolerance: the sparse kernel's error vs fp64 at most ~2x the dense fp16 GEMM's
    assert (sparse.double() - ref).abs().max() <= 2 * (dense.double() - ref).abs().max() + 1e-3
