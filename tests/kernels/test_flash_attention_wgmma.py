"""The Gluon (explicit async WGMMA) dK/dV pass of the flash-attention backward.

On CPU: it compiles for sm_90 (Triton's own ptxas) at every autotuning configuration without spilling registers
and without ptxas serializing its WGMMAs (the loop keeps three waits: two per step, one after the loop), and the
launcher only picks it where it applies. On a Hopper GPU: its gradients match the Triton pass's and the fp32
reference by the attention tolerance rule, dense, packed, windowed and with GQA.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import triton

from lightning_llmopt.kernels import flash_attention_bwd_wgmma as wgmma
from lightning_llmopt.kernels.flash_attention_bwd import flash_bwd
from lightning_llmopt.kernels.flash_attention_common import geometry
from lightning_llmopt.kernels.flash_attention_ref import flash_attention_ref

_COMPILE = r"""
import inspect, json, os, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from lightning_llmopt.kernels import flash_attention_bwd_wgmma as wgmma

head_dim, causal, window, packed = json.loads(sys.argv[1])
kernel = wgmma._dkdv_wgmma_kernel
names = list(inspect.signature(kernel.fn).parameters)
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
stats = {}
for blocks, warps, stages in wgmma.wgmma_configs(head_dim):
    consts = dict(HEAD_D=head_dim, BLOCK_D=head_dim, IS_CAUSAL=causal, HAS_WINDOW=window, IS_VARLEN=packed,
                  IEEE=False, STAGES=stages, **blocks)
    sig = {}
    for name in names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ("LSE2", "DELTA"):
            sig[name] = "*fp32"
        elif name == "CU_SEQLENS":
            sig[name] = "*i32"
        elif name in ("Q", "K", "V", "DO", "DK", "DV"):
            sig[name] = "*bf16"
        else:
            sig[name] = "fp32" if name in ("qk_scale", "sm_scale") else "i32"
    aligned = [n for n in names if sig[n].startswith("*") or n.startswith("stride") or n in ("seq_q", "seq_k")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    compiled = triton.compile(GluonASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps})
    path = os.path.join(sys.argv[2], "k.cubin")
    open(path, "wb").write(compiled.asm["cubin"])
    sass = subprocess.run([tool, "--dump-sass", path], capture_output=True, text=True, check=True).stdout
    stats[str((blocks["BLOCK_M"], blocks["BLOCK_N"], warps, stages))] = {
        "hgmma": len(re.findall(r"HGMMA", sass)), "spills": len(re.findall(r"\bSTL\b", sass)),
        "waits": len(re.findall(r"WARPGROUP\.DEPBAR", sass))}
print(json.dumps(stats))
"""


CASES = [  # (head dim, causal, window, packed)
    (64, True, False, False),
    (128, False, False, True),
    (64, True, True, False),
]


@pytest.mark.parametrize("head_dim,causal,window,packed", CASES)
def test_compiles_for_sm90_without_spills_or_serialized_wgmma(head_dim, causal, window, packed, tmp_path) -> None:
    """Compiled in a fresh process: the suite runs interpreted kernels (``TRITON_INTERPRET=1``), which leave
    Triton's language patched for the interpreter in this one."""
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("no cuobjdump in this Triton wheel")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    run = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps([head_dim, causal, window, packed]),
                          str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    stats = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(stats) == len(wgmma.wgmma_configs(head_dim))
    for config, got in stats.items():
        assert got["hgmma"] > 0, config
        assert got["spills"] == 0, f"register spills at {config}"
        assert got["waits"] == 3, f"{got['waits']} WGMMA waits at {config}: ptxas serialized the products"


def test_applies_only_to_16_bit_head_dims_64_and_128_on_hopper() -> None:
    q = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)
    assert not wgmma.wgmma_supported((q, q, q, q), 64, 64)  # a CPU tensor
    q = q.float()  # the choice is checked before any launch: no forward needed, on any machine
    geo = geometry(q, q, None, None)
    lse = torch.zeros(geo.lse_shape)
    for impl in ("wgmma", "cuda"):
        with pytest.raises(ValueError, match="dkdv_impl"):
            flash_bwd(q, q, q, q, q, lse, geo, True, 0.125, None, dkdv_impl=impl)


def _grads(q: torch.Tensor, causal: bool, window: int | None = None, dkdv_impl: str | None = None,
           k: torch.Tensor | None = None, cu: torch.Tensor | None = None, max_len: int | None = None):
    k = q if k is None else k
    g = torch.Generator(device=q.device).manual_seed(1)
    v = torch.randn(k.shape, generator=g, device=q.device).to(q.dtype)
    do = torch.randn(q.shape, generator=g, device=q.device).to(q.dtype)
    geo = geometry(q, k, cu, max_len)
    from lightning_llmopt.kernels.flash_attention_fwd import flash_fwd

    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = flash_fwd(q, k, v, geo, causal, scale, window)
    return flash_bwd(do, q, k, v, out, lse, geo, causal, scale, window, dkdv_impl=dkdv_impl), (v, do)


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the Gluon dK/dV pass runs on sm_90 only")
@pytest.mark.parametrize("head_dim,heads,kv_heads,causal,window,lens", [
    (64, 8, 2, True, None, (1000, 1000)),
    (128, 4, 4, False, None, (777, 777)),
    (64, 8, 1, True, None, (1, 17, 300, 1000, 64, 129, 700)),
    (64, 4, 2, True, 256, (1500,)),
])
def test_matches_triton_pass_and_reference_on_hopper(head_dim, heads, kv_heads, causal, window, lens) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    packed = len(set(lens)) > 1
    if packed:
        shape_q, shape_k = (sum(lens), heads, head_dim), (sum(lens), kv_heads, head_dim)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    else:
        shape_q, shape_k = (len(lens), lens[0], heads, head_dim), (len(lens), lens[0], kv_heads, head_dim)
        cu = None
    q = torch.randn(shape_q, generator=g, device="cuda").bfloat16()
    k = torch.randn(shape_k, generator=g, device="cuda").bfloat16()
    max_len = max(lens) if packed else None
    ours, (v, do) = _grads(q, causal, window, "wgmma", k, cu, max_len)
    triton_pass, _ = _grads(q, causal, window, "triton", k, cu, max_len)
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    plain_in = [t.detach().requires_grad_() for t in (q, k, v)]
    kw = dict(causal=causal, window=window, cu_seqlens=cu, max_seqlen=max_len)
    ref = torch.autograd.grad(flash_attention_ref(*ref_in, **kw), ref_in, do.float())
    plain = torch.autograd.grad(flash_attention_ref(*plain_in, upcast=False, **kw), plain_in, do)
    for name, a, b, r, p in zip("qkv", ours, triton_pass, ref, plain, strict=True):
        err, err_plain = (a.float() - r).abs().max().item(), (p.float() - r).abs().max().item()
        assert err <= 2 * err_plain, f"d{name}: {err} vs plain bf16 {err_plain}"
        assert (a.float() - b.float()).abs().max().item() <= 2 * err_plain
