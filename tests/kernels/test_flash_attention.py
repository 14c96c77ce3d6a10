"""Flash attention: the Triton kernels (interpreter on CPU) against an fp64 reference, with derived tolerances.

Tolerance rule (flash-attn's ``tests/test_flash_attn.py``): for the output and each of dq/dk/dv,

    max|kernel - ref64| <= 2 * max|torch_same_dtype - ref64| + floor,   floor = 4 * eps(dtype) * max(max|ref64|, 1)

``ref64`` is the reference in float64; ``torch_same_dtype`` is plain PyTorch computing in the inputs' dtype
(``flash_attention_ref(..., upcast=False)``). The floor (4 ulps of the largest value, or of 1: inputs are
standard normal) exists because in fp32 PyTorch's own maximum error is itself a handful of rounding errors, or
exactly 0 where the true value is 0 (dq of a single key); twice a lucky small maximum is not a bound that a
different, equally correct summation order can be held to.

For the gradients, "plain PyTorch in the same dtype" is measured two ways and the larger error counts:
autograd through the reference (which keeps the softmax ``P`` of its forward), and a backward written the way the
kernel works (:func:`_recompute_grads`: only the output and the log-sum-exp are kept; ``P = exp(s - lse)``,
``dP = dO V^T`` and ``delta = rowsum(dO O)`` are recomputed from dot products). The kernel's error comes from that
recomputation, and under the interpreter its dots are numpy's sgemm, whose order and FMA use depend on the CPU's
OpenBLAS kernel: the GQA split test gave a dq error of 1.15e-6 with the Haswell/Zen kernels, 2.3e-6 with the no-FMA
Prescott/Nehalem ones and 2.87e-6 on another machine, against a bound of 2.3e-6 from autograd's error alone (7.2e-7).
PyTorch's own recomputing backward has 2.87e-6 on those inputs; a kernel whose softmax scale is off by 1e-5
relative still fails the rule by a factor of 4.5 there.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_llmopt.kernels import flash_attention, flash_attention_ref
from lightning_llmopt.kernels.flash_attention import resolve_backend
from lightning_llmopt.kernels.flash_attention_ref import visible_mask
from lightning_llmopt.testing.triton import triton_available, triton_interpreter_enabled

pytestmark = [
    pytest.mark.skipif(not triton_available() or not (torch.cuda.is_available() or triton_interpreter_enabled()),
                       reason="needs triton (and TRITON_INTERPRET=1 without CUDA)"),
    # the interpreter's numpy log2(0) for rows without keys (lse = -inf by design)
    pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning"),
]
pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(shape_q, shape_kv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(shape_q, generator=g)
    k = torch.randn(shape_kv, generator=g)
    v = torch.randn(shape_kv, generator=g)
    do = torch.randn(shape_q, generator=g)
    return [t.to(DEVICE, dtype) for t in (q, k, v, do)]


def _grads(fn, q, k, v, do, cast=None):
    leaves = [(t if cast is None else t.to(cast)).detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, do if cast is None else do.to(cast))
    return [out.detach(), *grads]


def _check(q, k, v, do, **kw):
    """Kernel vs fp64 reference vs plain PyTorch in the same dtype, for out, dq, dk, dv."""
    kernel = _grads(lambda a, b, c: flash_attention(a, b, c, backend="triton", **kw), q, k, v, do)
    ref = _grads(lambda a, b, c: flash_attention_ref(a, b, c, **kw), q, k, v, do, cast=torch.float64)
    same = _grads(lambda a, b, c: flash_attention_ref(a, b, c, upcast=False, **kw), q, k, v, do)
    eps = torch.finfo(q.dtype).eps
    recomputed = [same[0], *_recompute_grads(q, k, v, do, **kw)]
    for name, ours, r, pt, pt_re in zip(("out", "dq", "dk", "dv"), kernel, ref, same, recomputed, strict=True):
        assert ours.shape == r.shape and ours.dtype == q.dtype, name
        assert not torch.isnan(ours).any(), f"NaN in {name}"
        err = (ours.double() - r).abs().max().item()
        pt_err = max((pt.double() - r).abs().max().item(), (pt_re.double() - r).abs().max().item())
        floor = 4 * eps * max(r.abs().max().item(), 1.0)
        assert err <= 2 * pt_err + floor, f"{name}: kernel error {err:.3g} > 2 x PyTorch {pt_err:.3g} + {floor:.3g}"


def _recompute_grads(q, k, v, do, causal=False, window=None, cu_seqlens=None):
    """dq, dk, dv by plain PyTorch in the inputs' dtype, the way a flash-attention backward computes them: from the
    forward's output and log-sum-exp only, recomputing ``P = exp(s - lse)``, ``dP = dO V^T``, ``delta = rowsum(dO O)``
    (module docstring). Packed input is done document by document."""
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        parts = [_recompute_grads(*(t[None, a:b] for t in (q, k, v, do)), causal=causal, window=window)
                 for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        grads = [torch.cat([p[i][0] for p in parts]) for i in range(3)]
        pad = q.shape[0] - grads[0].shape[0]  # tokens past the last document get no gradient
        return [torch.cat([g, g.new_zeros(pad, *g.shape[1:])]) for g in grads]
    out, lse = flash_attention_ref(q, k, v, causal=causal, window=window, return_lse=True, upcast=False)
    scale, rep = 1.0 / math.sqrt(q.shape[-1]), q.shape[2] // k.shape[2]
    qh, doh, oh = (t.transpose(1, 2) for t in (q, do, out))  # (B, H, S_q, D)
    kh, vh = (t.transpose(1, 2).repeat_interleave(rep, dim=1) for t in (k, v))  # (B, H, S_k, D)
    allowed = visible_mask(q.shape[1], k.shape[1], causal, window, q.device)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale  # (B, H, S_q, S_k)
    lse = lse.to(q.dtype).unsqueeze(-1)
    p = torch.where(allowed & torch.isfinite(lse), torch.exp(s - lse.nan_to_num(0.0, neginf=0.0)), 0.0)
    ds = p * (torch.matmul(doh, vh.transpose(-1, -2)) - (doh * oh).sum(-1, keepdim=True))
    dq = torch.matmul(ds, kh) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qh) * scale
    dv = torch.matmul(p.transpose(-1, -2), doh)
    fold = lambda t: t.unflatten(1, (k.shape[2], rep)).sum(2)  # noqa: E731 - sum the GQA group onto its K/V head
    return [dq.transpose(1, 2), fold(dk).transpose(1, 2), fold(dv).transpose(1, 2)]


@pytest.mark.parametrize(
    "B, S_q, S_k, H, H_kv, D, causal, window, dtype",
    [
        (2, 1, 1, 2, 2, 16, True, None, torch.float32),  # one token
        (2, 17, 17, 4, 1, 32, True, None, torch.float32),  # GQA 4:1
        (1, 113, 113, 8, 1, 24, False, None, torch.float16),  # GQA 8:1, head dim padded 24 -> 32
        (1, 113, 113, 2, 2, 64, True, 7, torch.float16),  # sliding window
        (1, 17, 17, 2, 1, 96, True, None, torch.float16),  # head dim 96 padded to 128
        (1, 113, 113, 4, 1, 40, True, 33, torch.float32),  # window spanning several tiles, GQA, padded dim
        (2, 17, 40, 2, 1, 16, False, None, torch.float32),  # more keys than queries
        (1, 40, 17, 2, 2, 16, True, None, torch.float16),  # causal, bottom-right: first 23 queries see nothing
    ],
)
def test_dense_matches_float64_reference(B, S_q, S_k, H, H_kv, D, causal, window, dtype):
    q, k, v, do = _inputs((B, S_q, H, D), (B, S_k, H_kv, D), dtype, seed=S_q * 7 + D)
    _check(q, k, v, do, causal=causal, window=window)


@pytest.mark.parametrize("split, packed", [(2, False), (4, False), (2, True)])
def test_gqa_split_backward_matches_reference(monkeypatch, split, packed):
    """dK/dV programs that each sum part of a query group, reduced after the launch, give the same gradients."""
    from lightning_llmopt.kernels import flash_attention_bwd

    monkeypatch.setattr(flash_attention_bwd, "gqa_split", lambda *args: split)
    if packed:
        cu = torch.tensor([0, 17, 30, 143], device=DEVICE)
        q, k, v, do = _inputs((143, 4, 32), (143, 2, 32), torch.float16, seed=11)
        _check(q, k, v, do, causal=True, cu_seqlens=cu)
    else:
        q, k, v, do = _inputs((2, 40, 4, 32), (2, 40, 1, 32), torch.float32, seed=12)
        _check(q, k, v, do, causal=True)


@pytest.mark.parametrize(
    "H, H_kv, causal, window, split",
    [(32, 4, True, None, 4), (24, 4, True, None, 3), (16, 4, True, None, 4), (8, 4, True, None, 1),
     (32, 4, False, None, 1), (32, 4, True, 256, 1)],
)
def test_gqa_split_rule(H, H_kv, causal, window, split):
    """Causal attention with 4+ query heads per key/value head splits (largest divisor up to 4), the rest not."""
    from lightning_llmopt.kernels.flash_attention_bwd import gqa_split
    from lightning_llmopt.kernels.flash_attention_common import geometry

    q, k = torch.empty(1, 8, H, 64), torch.empty(1, 8, H_kv, 64)
    assert gqa_split(geometry(q, k, None, None), causal, window) == split


def test_gqa_split_must_divide_the_group(monkeypatch):
    from lightning_llmopt.kernels import flash_attention_bwd

    monkeypatch.setattr(flash_attention_bwd, "gqa_split", lambda *args: 3)
    q, k, v, do = _inputs((1, 17, 4, 16), (1, 17, 1, 16), torch.float32, seed=13)
    with pytest.raises(ValueError, match="split=3 must divide the GQA group of 4"):
        _grads(lambda a, b, c: flash_attention(a, b, c, causal=True, backend="triton"), q, k, v, do)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False])
def test_length_255(causal):
    q, k, v, do = _inputs((1, 255, 2, 32), (1, 255, 1, 32), torch.float16, seed=255)
    _check(q, k, v, do, causal=causal)


@pytest.mark.parametrize("window, dtype", [(None, torch.float16), (5, torch.float32)])
def test_ragged_pack_matches_reference(window, dtype):
    cu = torch.tensor([0, 1, 18, 31, 144], device=DEVICE)  # documents of 1, 17, 13 and 113 tokens
    q, k, v, do = _inputs((144, 4, 32), (144, 2, 32), dtype, seed=3)
    _check(q, k, v, do, causal=True, window=window, cu_seqlens=cu)


def test_pack_equals_documents_run_separately():
    """No attention crosses documents: each document of a pack gives what it gives alone."""
    cu = [0, 9, 26, 40]
    q, k, v, _ = _inputs((40, 2, 16), (40, 1, 16), torch.float32, seed=5)
    packed = flash_attention(q, k, v, causal=True, cu_seqlens=torch.tensor(cu), backend="triton")
    for s, e in zip(cu[:-1], cu[1:], strict=True):
        alone = flash_attention(q[None, s:e], k[None, s:e], v[None, s:e], causal=True, backend="triton")[0]
        torch.testing.assert_close(packed[s:e], alone, atol=1e-6, rtol=1e-5)  # same fp32 math, other tiling


def test_lse_and_fully_masked_rows():
    q, k, v, do = _inputs((1, 40, 2, 16), (1, 17, 2, 16), torch.float32, seed=11)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attention(*leaves, causal=True, return_lse=True, backend="triton")
    ref_out, ref_lse = flash_attention_ref(q.double(), k.double(), v.double(), causal=True, return_lse=True)
    assert lse.shape == (1, 2, 40) and lse.dtype == torch.float32
    assert torch.isneginf(lse[:, :, :23]).all() and (out[:, :23] == 0).all()  # queries 0..22 see no key
    torch.testing.assert_close(lse[:, :, 23:].double(), ref_lse[:, :, 23:], atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(out, leaves, do)
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[0][:, :23] == 0).all()


def test_lse_merges_two_halves_like_ring_attention():
    """Attention over all keys equals the lse-weighted merge of attention over two halves of the keys."""
    q, k, v, _ = _inputs((1, 17, 2, 16), (1, 34, 1, 16), torch.float32, seed=2)
    full = flash_attention(q, k, v, backend="triton")
    o1, l1 = flash_attention(q, k[:, :17], v[:, :17], return_lse=True, backend="triton")
    o2, l2 = flash_attention(q, k[:, 17:], v[:, 17:], return_lse=True, backend="triton")
    lse = torch.logaddexp(l1, l2)  # (B, H, S)
    w1 = torch.exp(l1 - lse).transpose(1, 2)[..., None]
    w2 = torch.exp(l2 - lse).transpose(1, 2)[..., None]
    torch.testing.assert_close(w1 * o1 + w2 * o2, full, atol=1e-5, rtol=1e-5)


def test_model_layout_views_need_no_copy():
    """(B, H, S, D) tensors passed as transposed views give the same result as contiguous (B, S, H, D) ones."""
    q, k, v, _ = _inputs((2, 3, 17, 16), (2, 1, 17, 16), torch.float32, seed=4)  # (B, H, S, D)
    views = flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, backend="triton")
    contiguous = flash_attention(*(t.transpose(1, 2).contiguous() for t in (q, k, v)), causal=True, backend="triton")
    torch.testing.assert_close(views, contiguous, atol=0, rtol=0)


def test_backend_switch(monkeypatch):
    q, k, v, _ = _inputs((1, 17, 2, 16), (1, 17, 2, 16), torch.float32, seed=6)
    monkeypatch.setenv("LLMOPT_FLASH_BACKEND", "reference")
    assert resolve_backend(None, q.device) == "reference"
    assert torch.equal(flash_attention(q, k, v, causal=True), flash_attention_ref(q, k, v, causal=True))
    monkeypatch.setenv("LLMOPT_FLASH_BACKEND", "triton")
    assert resolve_backend(None, q.device) == "triton"
    monkeypatch.setenv("LLMOPT_FLASH_BACKEND", "cudnn")
    with pytest.raises(ValueError, match="'cudnn'"):
        flash_attention(q, k, v)
    monkeypatch.delenv("LLMOPT_FLASH_BACKEND")
    assert resolve_backend("auto", torch.device("cpu")) == "reference"


@pytest.mark.parametrize(
    "shapes, kw, match",
    [
        (((1, 4, 3, 16), (1, 4, 2, 16)), {}, r"query heads \(3\) must be a multiple of key/value heads \(2\)"),
        (((1, 4, 2, 16), (1, 4, 2, 16)), dict(window=4), r"window \(4\) .* needs causal=True"),
        (((4, 2, 16), (4, 2, 16)), {}, r"q must be \(B, S, H, D\)"),
    ],
)
def test_bad_input_names_the_values(shapes, kw, match):
    q = torch.randn(shapes[0])
    k = v = torch.randn(shapes[1])
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, v, **kw)


def test_custom_op_fake_and_compile():
    q, k, v, do = _inputs((1, 17, 4, 16), (1, 17, 2, 16), torch.float32, seed=8)
    args = (q, k, v, None, 0, True, 0.25, 0)
    torch.library.opcheck(torch.ops.lightning_llmopt.flash_attn_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    out, lse = torch.ops.lightning_llmopt.flash_attn_fwd(*args)
    torch.library.opcheck(torch.ops.lightning_llmopt.flash_attn_bwd.default,
                          (do, q, k, v, out, lse, None, 0, True, 0.25, 0),
                          test_utils=("test_schema", "test_faketensor"))

    def fn(a, b, c):
        return flash_attention(a, b, c, causal=True, softmax_scale=0.25, backend="triton") * 2

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    eager = _grads(fn, q, k, v, do)
    traced = _grads(compiled, q, k, v, do)
    for a, b in zip(traced, eager, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_softmax_scale_default_is_inverse_sqrt_head_dim():
    q, k, v, _ = _inputs((1, 17, 2, 24), (1, 17, 2, 24), torch.float32, seed=9)
    torch.testing.assert_close(flash_attention(q, k, v, backend="triton"),
                               flash_attention(q, k, v, softmax_scale=1 / math.sqrt(24), backend="triton"))


# ---------------------------------------------------------------- the "triton" backend of the model


def _tiny(**overrides):
    import lightning_llmopt.models.attention_triton  # noqa: F401 - registers "triton" (until models/attention.py does)
    from lightning_llmopt.models import LlamaConfig

    return LlamaConfig.from_preset("tiny", **overrides)


@pytest.mark.parametrize("overrides", [{}, dict(sliding_window=5)])
def test_llama_triton_backend_matches_eager(overrides):
    from lightning_llmopt.models import Llama

    torch.manual_seed(0)
    model = Llama(_tiny(attn_backend="triton", **overrides))
    eager = Llama(_tiny(attn_backend="eager", **overrides))
    eager.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 320, (2, 23))
    out = model(tokens)
    torch.testing.assert_close(out, eager(tokens), atol=1e-5, rtol=1e-4)  # fp32 model: rounding-level agreement
    # gradients flow through the kernels' backward
    out.float().square().mean().backward()
    eager(tokens).float().square().mean().backward()
    for (name, p), p_ref in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_llama_triton_backend_packed_rows_and_cache_fallback():
    from lightning_llmopt.models import Llama, StaticKVCache, doc_ids_from_cu_seqlens
    from lightning_llmopt.models.attention import AttentionMask
    from lightning_llmopt.models.attention_triton import _plan

    torch.manual_seed(0)
    model = Llama(_tiny(attn_backend="triton", sliding_window=6))
    eager = Llama(_tiny(attn_backend="eager", sliding_window=6))
    eager.load_state_dict(model.state_dict())
    doc_ids = torch.stack([doc_ids_from_cu_seqlens(torch.tensor([0, 7, 8, 19]), 23),
                           doc_ids_from_cu_seqlens(torch.tensor([0, 23]), 23)])
    tokens = torch.randint(0, 320, (2, 23))
    torch.testing.assert_close(model(tokens, doc_ids=doc_ids), eager(tokens, doc_ids=doc_ids), atol=1e-5, rtol=1e-4)
    from lightning_llmopt.models.attention import positions_from_doc_ids

    pos = positions_from_doc_ids(doc_ids)
    plan = _plan(AttentionMask(pos, pos, doc_ids, doc_ids, window=6), 23, 23, pos.device)
    assert plan.kind == "varlen" and plan.cu_seqlens.tolist() == [0, 7, 8, 19, 23, 46]
    # decoding with a KV cache (empty slots) is not expressible: the backend falls back and still agrees
    cache, cache_ref = (StaticKVCache.for_model(m, batch_size=2, max_seq_len=32) for m in (model, eager))
    torch.testing.assert_close(model(tokens[:, :9], kv_cache=cache), eager(tokens[:, :9], kv_cache=cache_ref),
                               atol=1e-5, rtol=1e-4)


def test_autotune_settles_close_candidates_by_timing_them_again(monkeypatch):
    """``ChosenConfigs._settle``: the search's top three are timed again in two interleaved passes and the fastest
    on average wins, whatever the search's single timings said; ties with fewer than two candidates keep its pick."""
    pytest.importorskip("triton")
    import triton.testing

    from lightning_llmopt.kernels.flash_attention_common import ChosenConfigs

    class Config:
        def __init__(self, name: str) -> None:
            self.name, self.kwargs = name, {"BLOCK_M": 64}

        def all_kwargs(self) -> dict:
            return {"tag": self.name}

    a, b, c, d = (Config(n) for n in "abcd")
    launched: list[str] = []

    class Kernel:
        def __getitem__(self, grid):  # noqa: ANN001, ANN204
            return lambda *args, tag, **kw: launched.append(tag)

    class Tuner:
        fn = Kernel()
        best_config = a  # the search's pick
        configs_timings = {a: [1.00, 0.9, 1.1], b: [1.02, 1.0, 1.1], c: [1.03, 1.0, 1.1], d: [2.0, 1.9, 2.1]}

    true_ms = {"a": 1.04, "b": 0.97, "c": 1.01, "d": 2.0}

    def fake_bench(fn, return_mode="median"):  # noqa: ANN001, ANN202
        fn()
        return true_ms[launched[-1]]

    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    chosen = ChosenConfigs._settle(Tuner(), lambda meta: (1,), (), {})
    assert chosen is b
    assert sorted(set(launched)) == ["a", "b", "c"] and len(launched) == 6  # the top three, twice; never d
    Tuner.configs_timings = {a: [1.0, 0.9, 1.1]}
    assert ChosenConfigs._settle(Tuner(), lambda meta: (1,), (), {}) is a
