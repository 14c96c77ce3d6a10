"""On a GPU: every autotuning configuration's shared-memory estimate is an upper bound of what Triton compiles.

Each test lifts the device limit (so that every configuration of every table is compiled, also those the prune
would drop), records what Triton reports for each compile (``metadata.shared``, through its compilation listener)
and checks ``shared <= estimate`` for every configuration whose estimate fits the real device, i.e. every
configuration the prune can keep. The flash-attention configurations are compiled at head dims 64, 128 and 192
(MLA prefill, padded to 256); the table printed with ``-s`` shows each estimate against Triton's figure.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import pytest
import torch

from lightning_llmopt.kernels import shared_memory as smem

pytestmark = pytest.mark.gpu
triton = pytest.importorskip("triton")

_SIZES = {"fp64": 8, "i64": 8, "u64": 8, "fp32": 4, "i32": 4, "u32": 4, "bf16": 2, "fp16": 2, "i16": 2, "u16": 2,
          "i8": 1, "u8": 1, "i1": 1, "fp8e4nv": 1, "fp8e5": 1}


def _record(src: Any, metadata: Any) -> dict[str, Any]:
    """``{name, params, shared}`` of one compile: the kernel's constexprs by name, its options and the element size
    of each pointer argument (what the estimates in :data:`~.shared_memory.ESTIMATES` read)."""
    fn = src.fn
    names = list(fn.arg_names)
    params: dict[str, Any] = {}
    for key, value in src.constants.items():
        key = key[0] if isinstance(key, tuple) and len(key) == 1 else key
        if isinstance(key, int):
            params[names[key]] = value
        elif isinstance(key, str):
            params[key] = value
    elem = {}
    for name, ty in src.signature.items():
        if isinstance(ty, str) and ty.startswith("*") and ty[1:] in _SIZES:
            elem[name] = _SIZES[ty[1:]]
    md = metadata if isinstance(metadata, dict) else vars(metadata)
    params.update(num_warps=md["num_warps"], num_stages=md["num_stages"], elem=elem)
    return {"name": getattr(fn, "__name__", src.name), "params": params, "shared": int(md["shared"])}


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Records of every compile in the test (cache hits too), with the shared-memory limit lifted."""
    from triton import knobs

    if not hasattr(knobs, "compilation") or not hasattr(knobs.compilation, "listener"):
        pytest.skip("this Triton has no compilation listener")
    records: list[dict[str, Any]] = []
    previous = knobs.compilation.listener

    def listen(*, src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool) -> None:
        with contextlib.suppress(AttributeError):  # a source that is not a Triton/Gluon AST (none here)
            records.append(_record(src, metadata))
        if previous is not None:
            previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

    limit = smem.device_limit(torch.cuda.current_device())
    assert limit is not None and limit > 48 * 1024, limit
    monkeypatch.setattr(smem, "device_limit", lambda device: 1 << 30)
    knobs.compilation.listener = listen
    try:
        yield records, limit
    finally:
        knobs.compilation.listener = previous


def _check_bounds(records: list[dict[str, Any]], limit: int, names: set[str]) -> None:
    seen: set[str] = set()
    bad = []
    for r in records:
        estimate = smem.ESTIMATES.get(r["name"])
        if estimate is None:
            continue
        seen.add(r["name"])
        need = estimate(r["params"])
        p = r["params"]
        short = {k: v for k, v in p.items() if k.startswith("BLOCK") or k in ("STAGES", "ROWS", "CHUNK", "num_warps",
                                                                                "num_stages", "BITS", "TWO_PASS")}
        print(f"smem {r['name']:<22} {short} elem={p['elem'].get('Q', p['elem'].get('X'))} "
              f"shared={r['shared']} estimate={need} fits={need <= limit}")
        if need <= limit and r["shared"] > need:
            bad.append((r["name"], short, r["shared"], need))
    assert not bad, f"Triton's shared memory above the estimate: {bad}"
    assert names <= seen, f"kernels never compiled: {names - seen}"


def _try(fn: Any, *args: Any, **kwargs: Any) -> bool:
    """Call ``fn(*args, **kwargs)``; ``False`` where the device refused the launch (OutOfResources)."""
    from triton.runtime.errors import OutOfResources

    try:
        fn(*args, **kwargs)
    except OutOfResources:
        return False
    torch.cuda.synchronize()
    return True


def test_flash_attention_estimates_bound_triton_at_head_dims_64_128_192(compiled) -> None:  # type: ignore[no-untyped-def]
    from lightning_llmopt.kernels.flash_attention_bwd import flash_bwd
    from lightning_llmopt.kernels.flash_attention_bwd_wgmma import _CONFIGS as WGMMA
    from lightning_llmopt.kernels.flash_attention_bwd_wgmma import wgmma_smem_bytes, wgmma_supported
    from lightning_llmopt.kernels.flash_attention_common import geometry, launch_configs, smem_bytes
    from lightning_llmopt.kernels.flash_attention_fwd import flash_fwd

    records, limit = compiled
    refused = []
    for head_dim in (64, 128, 192):
        g = torch.Generator(device="cuda").manual_seed(head_dim)
        q, k, v, do = (torch.randn(1, 256, 2, head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
                       for _ in range(4))
        geo = geometry(q, k, None, None)
        scale = 1 / math.sqrt(head_dim)
        for cfg in launch_configs("fwd"):
            ok = _try(flash_fwd, q, k, v, geo, True, scale, None, config=cfg)
            need = smem_bytes("fwd", cfg[0]["BLOCK_M"], cfg[0]["BLOCK_N"], cfg[2], geo.block_d, 2)
            if need <= limit and not ok:
                refused.append(("fwd", head_dim, cfg))
        out, lse = flash_fwd(q, k, v, geo, True, scale, None, config=({"BLOCK_M": 64, "BLOCK_N": 32}, 4, 2))
        dkdv, dq = launch_configs("dkdv"), launch_configs("dq")
        for i in range(max(len(dkdv), len(dq))):
            a, b = dkdv[i % len(dkdv)], dq[i % len(dq)]
            ok = _try(flash_bwd, do, q, k, v, out, lse, geo, True, scale, None, configs={"dkdv": a, "dq": b},
                      dkdv_impl="triton")
            fits = all(smem_bytes(n, c[0]["BLOCK_M"], c[0]["BLOCK_N"], c[2], geo.block_d, 2) <= limit
                       for n, c in (("dkdv", a), ("dq", b)))
            if fits and not ok:
                refused.append(("bwd", head_dim, a, b))
        if wgmma_supported((q, k, v, do), head_dim, geo.block_d):
            small_dq = ({"BLOCK_M": 64, "BLOCK_N": 32}, 4, 2)
            for m, n, w, s in {t for rows in WGMMA.values() for t in rows}:
                cfg = ({"BLOCK_M": m, "BLOCK_N": n}, w, s)
                ok = _try(flash_bwd, do, q, k, v, out, lse, geo, True, scale, None,
                          configs={"dkdv": cfg, "dq": small_dq}, dkdv_impl="wgmma")
                if wgmma_smem_bytes(m, n, s, head_dim) <= limit and not ok:
                    refused.append(("wgmma", head_dim, cfg))
    names = {"_flash_fwd_kernel", "_flash_bwd_dkdv_kernel", "_flash_bwd_dq_kernel"}
    if torch.cuda.get_device_capability() == (9, 0):
        names.add("_dkdv_wgmma_kernel")
    _check_bounds(records, limit, names)
    assert not refused, f"launches refused although their estimate fits: {refused}"


def test_flash_attention_head_dim_192_matches_reference() -> None:
    """MLA prefill's shape (head dim 192, padded to 256; packed documents, causal) through the autotuned kernels,
    forward and backward, against the fp64 reference: the kernel's error is at most twice plain PyTorch's in bf16
    plus a few ulps (the rule of tests/kernels/test_flash_attention.py)."""
    from lightning_llmopt.kernels import flash_attention, flash_attention_ref

    g = torch.Generator().manual_seed(192)
    lens = [300, 77, 512]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total, heads = sum(lens), 4
    q, k, v, do = (torch.randn(total, heads, 192, generator=g).to("cuda", torch.bfloat16) for _ in range(4))

    def grads(fn: Any, cast: torch.dtype | None = None) -> list[torch.Tensor]:
        leaves = [(t if cast is None else t.to(cast)).detach().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        return [out.detach(), *torch.autograd.grad(out, leaves, do if cast is None else do.to(cast))]

    kw = dict(causal=True, cu_seqlens=cu, max_seqlen=max(lens))
    ours = grads(lambda a, b, c: flash_attention(a, b, c, backend="triton", **kw))
    ref = grads(lambda a, b, c: flash_attention_ref(a, b, c, **kw), torch.float64)
    same = grads(lambda a, b, c: flash_attention_ref(a, b, c, upcast=False, **kw))
    eps = torch.finfo(torch.bfloat16).eps
    for name, o, r, s in zip(("out", "dq", "dk", "dv"), ours, ref, same, strict=True):
        assert not torch.isnan(o).any(), name
        err = (o.double() - r).abs().max().item()
        pt_err = (s.double() - r).abs().max().item()
        floor = 4 * eps * max(r.abs().max().item(), 1.0)
        assert err <= 2 * pt_err + floor, f"{name}: kernel error {err:.3g} > 2 x PyTorch {pt_err:.3g} + {floor:.3g}"


def test_other_kernels_estimates_bound_triton(compiled, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Paged decode (head dims 128 and MLA's absorbed 576, an int8 cache), SwiGLU, RMSNorm, the GEMVs and the
    quantized matmul's search, every configuration of their lists compiled (fresh autotuners)."""
    from lightning_llmopt.inference import gemv
    from lightning_llmopt.kernels import paged_attention_kernel as paged
    from lightning_llmopt.kernels import quant_matmul_tune, rmsnorm_triton, swiglu_triton
    from lightning_llmopt.kernels.paged_attention import paged_attention

    records, limit = compiled
    paged._tuned_kernel.cache_clear()
    monkeypatch.setattr(swiglu_triton, "_tuned", {})
    monkeypatch.setattr(rmsnorm_triton, "_tuned", {})
    monkeypatch.setattr(gemv, "_tuned_gemv", None)
    monkeypatch.setattr(gemv, "_tuned_rows", None)
    monkeypatch.setattr(quant_matmul_tune, "TUNED", {})
    monkeypatch.setattr(quant_matmul_tune, "STORE", None)
    g = torch.Generator(device="cuda").manual_seed(0)
    dev = dict(device="cuda", generator=g)
    for heads, kv_heads, d, cache_dtype in ((32, 8, 128, torch.bfloat16), (16, 1, 576, torch.bfloat16),
                                            (8, 2, 128, torch.int8)):
        q = torch.randn(2, heads, d, dtype=torch.bfloat16, **dev)
        blocks = 9
        if cache_dtype == torch.int8:
            kc = torch.randint(-127, 128, (blocks, kv_heads, 16, d), dtype=torch.int8, **dev)
            scales = dict(k_scale=torch.full((kv_heads,), 0.01, device="cuda"),
                          v_scale=torch.full((kv_heads,), 0.01, device="cuda"))
        else:
            kc = torch.randn(blocks, kv_heads, 16, d, dtype=cache_dtype, **dev)
            scales = {}
        tables = torch.arange(8, dtype=torch.int32, device="cuda").reshape(2, 4)
        ctx = torch.tensor([60, 33], dtype=torch.int32, device="cuda")
        _try(paged_attention, q, kc, kc, tables, ctx, backend="triton", num_splits=1, **scales)
    a, b = (torch.randn(64, 1536, dtype=torch.bfloat16, **dev) for _ in range(2))
    _try(lambda: swiglu_triton.swiglu_bwd_launch(a, a, swiglu_triton.swiglu_fwd_launch(a, b)))
    x = torch.randn(64, 4096, dtype=torch.bfloat16, **dev)
    w = torch.ones(4096, dtype=torch.bfloat16, device="cuda")
    y, rstd = rmsnorm_triton.rms_norm_fwd_launch(x, w, 1e-6, torch.bfloat16)
    _try(lambda: rmsnorm_triton.rms_norm_fwd_launch(x, w, 1e-6, torch.bfloat16, residual=x))
    _try(lambda: rmsnorm_triton.rms_norm_bwd_launch(y, x, w, rstd))
    wq, wk = (torch.randn(1024, 2048, dtype=torch.bfloat16, **dev) for _ in range(2))
    nw = torch.ones(2048, dtype=torch.bfloat16, device="cuda")
    for m in (1, 4):
        xr = torch.randn(m, 2048, dtype=torch.bfloat16, **dev)
        _try(gemv.gemv_cat, xr, [wq, wk])
        _try(gemv.norm_gemv_swiglu, xr, nw, 1e-6, xr, wq, wk)
    for m, bits, group in ((1, 4, 128), (16, 4, 128), (128, 8, 0)):
        n, k = 512, 1024
        codes = torch.randint(0, 256, (n, k * bits // 8), dtype=torch.uint8, device="cuda")
        sc = torch.rand(n, k // group if group else 1, dtype=torch.bfloat16, device="cuda") * 0.01
        xq = torch.randn(m, k, dtype=torch.bfloat16, **dev)
        quant_matmul_tune.choose_config(xq, codes, sc, None, bits, group, None)
    names = {"_paged_decode_kernel", "_swiglu_fwd_kernel", "_swiglu_bwd_kernel", "_rms_fwd_kernel",
             "_rms_bwd_kernel", "_gemv_kernel", "_gemv_rows_kernel", "_qmm_kernel", "_qmv_kernel",
             "_qmv_words_kernel"}
    _check_bounds(records, limit, names)
