"""Paged-attention decode: the Triton kernel (interpreter on CPU) against an fp64 reference over contiguous keys.

The oracle is not our paged reference but plain attention over the *contiguous* keys each row should see, built
directly from the unpaged tensors (so the page gather is checked too). Tolerance rule (as the flash-attention
tests): ``max|kernel - ref64| <= 2 * max|torch_same_dtype - ref64| + floor`` with ``floor = 4 * eps * max|ref64|``.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_llmopt.kernels.paged_attention import choose_splits, paged_attention
from lightning_llmopt.kernels.paged_attention_ref import paged_attention_ref
from lightning_llmopt.testing.triton import triton_available, triton_interpreter_enabled

needs_kernel = pytest.mark.skipif(
    not triton_available() or not (torch.cuda.is_available() or triton_interpreter_enabled()),
    reason="needs triton (and TRITON_INTERPRET=1 without CUDA)",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _paged(lens, H, H_kv, D, page, dtype, seed, extra_blocks=3):
    """Random contiguous keys/values per row, scattered into shuffled pages of a pool."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    per_row = [math.ceil(n / page) for n in lens]
    num_blocks = sum(per_row) + extra_blocks + 1
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # block 0 stays unused
    k_cache = torch.randn(num_blocks, H_kv, page, D, generator=g)  # garbage everywhere, including unused slots
    v_cache = torch.randn(num_blocks, H_kv, page, D, generator=g)
    tables = torch.zeros(B, max(per_row) + 1, dtype=torch.int32)
    ks, vs = [], []
    for b, n in enumerate(lens):
        k = torch.randn(n, H_kv, D, generator=g)
        v = torch.randn(n, H_kv, D, generator=g)
        ks.append(k)
        vs.append(v)
        for j in range(per_row[b]):
            blk = perm.pop()
            tables[b, j] = blk
            piece = slice(j * page, min(n, (j + 1) * page))
            width = piece.stop - piece.start
            k_cache[blk, :, :width] = k[piece].transpose(0, 1)
            v_cache[blk, :, :width] = v[piece].transpose(0, 1)
    q = torch.randn(B, H, D, generator=g)
    cast = [t.to(DEVICE, dtype) for t in (q, k_cache, v_cache)]
    return (
        *cast,
        tables.to(DEVICE),
        torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        [k.to(DEVICE, dtype) for k in ks],
        [v.to(DEVICE, dtype) for v in vs],
    )


def _contiguous_ref(q, ks, vs, window, compute):
    """Attention of each row over its own contiguous keys (the oracle), in ``compute`` dtype."""
    outs = []
    for b, (k, v) in enumerate(zip(ks, vs, strict=True)):
        n = k.shape[0]
        lo = max(0, n - window) if window is not None else 0
        rep = q.shape[1] // k.shape[1]
        kk = k[lo:].to(compute).repeat_interleave(rep, dim=1)  # (S, H, D)
        vv = v[lo:].to(compute).repeat_interleave(rep, dim=1)
        if n == 0:
            outs.append(torch.zeros_like(q[b]))
            continue
        s = torch.einsum("hd,shd->hs", q[b].to(compute), kk) / math.sqrt(q.shape[-1])
        outs.append(torch.einsum("hs,shd->hd", torch.softmax(s, -1), vv).to(q.dtype))
    return torch.stack(outs)


def _check(out, q, ks, vs, window):
    ref = _contiguous_ref(q, ks, vs, window, torch.float64).double()
    same = _contiguous_ref(q, ks, vs, window, q.dtype).double()
    eps = torch.finfo(q.dtype).eps
    floor = 4 * eps * max(ref.abs().max().item(), 1.0)
    err = (out.double() - ref).abs().max().item()
    bound = 2 * (same - ref).abs().max().item() + floor
    assert not torch.isnan(out).any()
    assert err <= bound, f"max error {err:.3g} > {bound:.3g}"


@needs_kernel
@pytest.mark.parametrize(
    ("lens", "H", "H_kv", "D", "page", "window", "splits"),
    [
        ([1, 17, 113], 4, 2, 64, 16, None, 1),  # odd lengths, GQA 2, one split
        ([113, 40], 8, 1, 80, 16, None, 3),  # MQA, head dim 80 (padded lanes), split-KV
        ([33, 5, 70], 3, 3, 32, 8, 19, 2),  # MHA (group 1 padded to 16 rows), window, small pages
        ([0, 29], 6, 2, 16, 16, None, 2),  # a padding row (ctx 0) next to a real one
        ([3, 200, 64], 4, 2, 32, 16, 150, 8),  # each row cut into its own pieces: 16 keys for the short row
    ],
)
def test_kernel_matches_reference(lens, H, H_kv, D, page, window, splits):
    q, kc, vc, tables, ctx, ks, vs = _paged(lens, H, H_kv, D, page, torch.float32, seed=len(lens) * 7 + D)
    out = paged_attention(q, kc, vc, tables, ctx, window=window, num_splits=splits, backend="triton")
    assert out.shape == q.shape and out.dtype == q.dtype
    _check(out, q, ks, vs, window)
    ref = paged_attention_ref(q, kc, vc, tables, ctx, window=window)  # our paged reference agrees with the oracle
    _check(ref, q, ks, vs, window)


@needs_kernel
def test_custom_op_and_direct_launch_agree():
    """Eager calls skip the custom op (the launcher directly); the op itself, used under ``torch.compile``, passes
    ``torch.library.opcheck`` (schema, fake implementation) and gives the same output."""
    q, kc, vc, tables, ctx, ks, vs = _paged([13, 40], 4, 2, 32, 16, torch.float32, seed=4)
    out = paged_attention(q, kc, vc, tables, ctx, num_splits=2, backend="triton")
    args = (q, kc, vc, tables, ctx, None, None, 1.0 / math.sqrt(32), 0, 2, 1)
    torch.testing.assert_close(torch.ops.lightning_llmopt.paged_attention_decode(*args), out, rtol=0, atol=0)
    torch.library.opcheck(torch.ops.lightning_llmopt.paged_attention_decode, args,
                          test_utils=("test_schema", "test_faketensor"))
    _check(out, q, ks, vs, None)


@needs_kernel
def test_kernel_fp16():
    q, kc, vc, tables, ctx, ks, vs = _paged([50, 9], 4, 2, 64, 16, torch.float16, seed=3)
    out = paged_attention(q, kc, vc, tables, ctx, num_splits=2, backend="triton")
    _check(out, q, ks, vs, None)


@needs_kernel
def test_int8_cache_matches_dequantized_reference():
    """int8 pages with per-head scales: the kernel equals attention over the dequantized keys/values."""
    q, kc, vc, tables, ctx, _, _ = _paged([37, 16], 4, 2, 32, 16, torch.float32, seed=5)
    k_scale = kc.abs().amax(dim=(0, 2, 3)) / 127
    v_scale = vc.abs().amax(dim=(0, 2, 3)) / 127
    kq = torch.round(kc / k_scale.view(1, -1, 1, 1)).clamp(-127, 127).to(torch.int8)
    vq = torch.round(vc / v_scale.view(1, -1, 1, 1)).clamp(-127, 127).to(torch.int8)
    out = paged_attention(q, kq, vq, tables, ctx, k_scale=k_scale, v_scale=v_scale, num_splits=2, backend="triton")
    deq = paged_attention_ref(
        q, kq.float() * k_scale.view(1, -1, 1, 1), vq.float() * v_scale.view(1, -1, 1, 1), tables, ctx
    )
    torch.testing.assert_close(out, deq, rtol=1e-5, atol=1e-5)  # same math up to fp32 summation order
    with pytest.raises(ValueError, match="calibrated k_scale"):
        paged_attention(q, kq, vq, tables, ctx, backend="triton")


def test_reference_on_odd_shapes():
    """The reference path (CPU fallback) against the contiguous oracle, fp32 and bf16."""
    for dtype in (torch.float32, torch.bfloat16):
        q, kc, vc, tables, ctx, ks, vs = _paged([1, 23, 64], 6, 3, 80, 16, dtype, seed=11)
        out = paged_attention(q, kc, vc, tables, ctx, window=30, backend="reference")
        _check(out, q, ks, vs, 30)


def test_validation_and_splits():
    q = torch.randn(2, 4, 16)
    kc = torch.randn(5, 2, 8, 16)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        paged_attention(q[:, :3], kc, kc, torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention(q, kc, kc, torch.zeros(3, 2, dtype=torch.int32), torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="window"):
        paged_attention(q, kc, kc, torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, dtype=torch.int32), window=0)
    assert choose_splits(4, 8, 1000, torch.device("cpu")) == 1
    assert choose_splits(1, 8, 1000, torch.device("cpu"), num_splits=3) == 3
    assert choose_splits(1, 8, 2, torch.device("cpu"), num_splits=3) == 2  # no more splits than keys
    with pytest.raises(ValueError, match="num_splits"):
        choose_splits(1, 8, 100, torch.device("cpu"), num_splits=0)


@pytest.mark.gpu
def test_kernel_bf16_gpu_long_context():
    """bf16 on the GPU at a long context with the automatic split count (several splits)."""
    q, kc, vc, tables, ctx, ks, vs = _paged([4000, 1, 2500, 777], 32, 8, 128, 16, torch.bfloat16, seed=9)
    out = paged_attention(q, kc, vc, tables, ctx)
    _check(out, q, ks, vs, None)
    out_w = paged_attention(q, kc, vc, tables, ctx, window=1000)
    _check(out_w, q, ks, vs, 1000)
