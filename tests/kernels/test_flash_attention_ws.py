"""The warp-specialized Gluon forward of flash attention (opt-in: ``LLMOPT_FLASH_FWD=ws``).

On CPU: it compiles for sm_90 (Triton's own ptxas) into three warpgroups with register reallocation, without
spilling; the TMA row mapping of both supported layouts addresses the same elements as the tensor; the launcher only
takes it where it applies. On a Hopper GPU: outputs, log-sum-exps and the gradients computed from them match the
float64 reference by the attention tolerance rule, for both layouts, GQA, causal and not, ragged lengths.
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

from lightning_llmopt.kernels import flash_attention_fwd_ws as ws
from lightning_llmopt.kernels.flash_attention_common import geometry
from lightning_llmopt.kernels.flash_attention_ref import flash_attention_ref

_COMPILE = r"""
import json, os, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
import triton.experimental.gluon.language as gl
from lightning_llmopt.kernels import flash_attention_fwd_ws as ws

tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
stats = {}
for head_dim, causal in json.loads(sys.argv[1]):
    block_n, stages = ws._LAUNCH[head_dim]
    def desc(rows):
        layout = gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl.bfloat16)
        return f"tensordesc<bf16[{rows}, {head_dim}],{layout!r}>"
    sig = {"q_desc": desc(64), "k_desc": desc(block_n), "v_desc": desc(block_n), "Out": "*bf16", "LSE": "*fp32"}
    for name in ("q_rb", "q_rh", "q_ch", "k_rb", "k_rh", "k_ch", "v_rb", "v_rh", "v_ch", "stride_ob", "stride_os",
                 "stride_oh", "stride_lb", "stride_lh", "seq_q", "seq_k", "num_heads", "group"):
        sig[name] = "i32"
    sig["qk_scale"] = "fp32"
    consts = dict(HEAD_D=head_dim, BLOCK_N=block_n, STAGES=stages, IS_CAUSAL=causal)
    sig.update({name: "constexpr" for name in consts})
    compiled = triton.compile(GluonASTSource(ws._ws_fwd_kernel, sig, consts, {}), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "maxnreg": ws._MAXNREG})
    path = os.path.join(sys.argv[2], "k.cubin")
    open(path, "wb").write(compiled.asm["cubin"])
    sass = subprocess.run([tool, "--dump-sass", path], capture_output=True, text=True, check=True).stdout
    stats[str((head_dim, causal))] = {
        "hgmma": len(re.findall(r"HGMMA", sass)), "spills": len(re.findall(r"\bSTL\b", sass)),
        "setmaxnreg": len(re.findall(r"USETMAXREG", sass)), "tma": len(re.findall(r"UTMALDG", sass)),
        "warps": compiled.metadata.num_warps}
print(json.dumps(stats))
"""


def test_compiles_for_sm90_into_three_warpgroups_without_spills(tmp_path) -> None:
    """Compiled in a fresh process (the suite's interpreted kernels leave Triton patched in this one)."""
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("no cuobjdump in this Triton wheel")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    cases = [(128, False), (64, True)]
    run = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(cases), str(tmp_path)], capture_output=True,
                         text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    stats = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(stats) == len(cases)
    for case, got in stats.items():
        assert got["hgmma"] > 0 and got["tma"] > 0, case
        assert got["spills"] == 0, f"register spills at {case}"
        assert got["setmaxnreg"] > 0, f"no register reallocation between partitions at {case}"
        assert got["warps"] == 12, case  # two consumer warpgroups and the loader's (one warp, padded)


def _address_of(t: torch.Tensor, b: int, s: int, h: int) -> int:
    return (t[b, s, h].data_ptr() - t.data_ptr()) // t.element_size()


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_tma_rows_address_the_tensors_elements(layout: str) -> None:
    B, S, H, D = 3, 37, 5, 64
    t = torch.zeros(B, S, H, D) if layout == "bshd" else torch.zeros(B, H, S, D).transpose(1, 2)
    rows, row_stride, per_b, per_h, col_h = ws.tma_rows(t)  # type: ignore[misc]
    assert rows * row_stride == t.numel()
    for b, s, h in [(0, 0, 0), (2, 36, 4), (1, 17, 3), (2, 0, 1)]:
        assert (b * per_b + h * per_h + s) * row_stride + h * col_h == _address_of(t, b, s, h)


def test_tma_rows_refuse_other_strides() -> None:
    t = torch.zeros(2, 16, 4, 64)
    assert ws.tma_rows(t[:, :, :2]) is None  # heads sliced: rows are not whole
    assert ws.tma_rows(t.transpose(0, 1)) is None
    assert ws.tma_rows(torch.zeros(2, 16, 4, 130)[..., :128]) is None  # padded rows: not a (B, S, H, D) stride


def test_applies_only_when_requested_on_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.zeros(1, 64, 2, 64, dtype=torch.bfloat16)
    geo = geometry(q, q, None, None)
    monkeypatch.setenv("LLMOPT_FLASH_FWD", "ws")
    assert not ws.ws_supported(q, q, q, geo, None)  # a CPU tensor
    monkeypatch.delenv("LLMOPT_FLASH_FWD")
    assert not ws.ws_supported(q, q, q, geo, None)


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the warp-specialized forward runs on sm_90 only")
@pytest.mark.parametrize("head_dim,heads,kv_heads,causal,seq,layout", [
    (128, 4, 4, False, 1024, "bshd"),
    (128, 8, 2, True, 1000, "bhsd"),
    (64, 8, 1, True, 333, "bshd"),
    (64, 4, 2, False, 129, "bhsd"),
    (128, 2, 2, True, 1, "bshd"),
    (64, 2, 2, True, 2048, "bhsd"),
])  # fmt: skip
def test_matches_reference_on_hopper(monkeypatch: pytest.MonkeyPatch, head_dim, heads, kv_heads, causal, seq,
                                     layout) -> None:
    from lightning_llmopt.kernels import flash_attention

    monkeypatch.setenv("LLMOPT_FLASH_FWD", "ws")
    taken = []
    monkeypatch.setattr(ws, "ws_fwd", lambda *a, _f=ws.ws_fwd: taken.append(1) or _f(*a))
    g = torch.Generator(device="cuda").manual_seed(seq)

    def make(h: int) -> torch.Tensor:
        shape = (2, seq, h, head_dim) if layout == "bshd" else (2, h, seq, head_dim)
        t = torch.randn(shape, generator=g, device="cuda").bfloat16()
        return (t if layout == "bshd" else t.transpose(1, 2)).requires_grad_()

    q, k, v = make(heads), make(kv_heads), make(kv_heads)
    do = torch.randn(q.shape, generator=g, device="cuda").bfloat16()
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert taken, "the warp-specialized forward was not used"
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    plain_in = [t.detach().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = flash_attention_ref(*ref_in, causal=causal, return_lse=True)
    plain = flash_attention_ref(*plain_in, causal=causal, upcast=False)
    assert (lse.double() - ref_lse).abs().max().item() < 1e-2 / math.sqrt(head_dim)
    ref_g = torch.autograd.grad(ref, ref_in, do.double())
    plain_g = torch.autograd.grad(plain, plain_in, do)
    for name, a, r, p in [("out", out, ref, plain), *zip(("dq", "dk", "dv"), grads, ref_g, plain_g, strict=True)]:
        err, err_plain = (a.double() - r).abs().max().item(), (p.double() - r).abs().max().item()
        assert err <= 2 * err_plain + 1e-6, f"{name}: {err} vs plain bf16 {err_plain}"
