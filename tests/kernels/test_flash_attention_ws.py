"""The warp-specialized Gluon forward of flash attention (the default on Hopper where it measured faster).

On CPU: each launch plan compiles for sm_90 (Triton's own ptxas) into one warpgroup a consumer plus the loader's,
with register reallocation and without spilling, the ping-pong's named barriers where it is on; the TMA row mapping
of both supported layouts addresses the same elements as the tensor; the plan follows the measured rule and only
applies where the kernel does. On a Hopper GPU: outputs, log-sum-exps and the gradients computed from them match the
float64 reference by the attention tolerance rule, for both layouts, GQA, causal and not, ragged and unequal
lengths, rows that see no key, by the default rule and forced; likewise for packed documents (down to one token, a
long document beside short ones, query/key/value sliced from one fused projection output).
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
from lightning_llmopt.kernels import flash_attention_fwd_ws_persistent as wp
from lightning_llmopt.kernels import flash_attention_ws_plan as rules
from lightning_llmopt.kernels.flash_attention_common import geometry
from lightning_llmopt.kernels.flash_attention_ref import flash_attention_ref

_COMPILE = r"""
import json, os, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
import triton.experimental.gluon.language as gl
from lightning_llmopt.kernels import flash_attention_fwd_ws as ws
from lightning_llmopt.kernels import flash_attention_fwd_ws_persistent as wp

tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
stats = {}
for head_dim, causal, plan, varlen, persistent in json.loads(sys.argv[1]):
    plan = ws.WsPlan(*plan)
    block_n = plan.block_n
    def desc(rows):
        layout = gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl.bfloat16)
        return f"tensordesc<bf16[{rows}, {head_dim}],{layout!r}>"
    sig = {"q_desc": desc(64), "k_desc": desc(block_n), "v_desc": desc(block_n), "Out": "*bf16", "LSE": "*fp32",
           "CU_SEQLENS": "*i32"}
    for name in ("q_rb", "q_rh", "q_ch", "k_rb", "k_rh", "k_ch", "v_rb", "v_rh", "v_ch", "stride_ob", "stride_os",
                 "stride_oh", "stride_lb", "stride_lh", "seq_q", "seq_k", "num_heads", "group"):
        sig[name] = "i32"
    if persistent:
        sig.update(n_mblk="i32", BH="i32", CH="i32")
    sig["qk_scale"] = "fp32"
    consts = dict(HEAD_D=head_dim, BLOCK_N=block_n, STAGES=plan.stages, IS_CAUSAL=causal, NCONS=plan.consumers,
                  PP=plan.pingpong, CONSUMER_REGS=plan.consumer_regs, IS_VARLEN=varlen)
    if persistent:
        del consts["PP"]
    sig.update({name: "constexpr" for name in consts})
    kernel = wp._ws_fwd_persistent_kernel if persistent else ws._ws_fwd_kernel
    compiled = triton.compile(GluonASTSource(kernel, sig, consts, {}), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "maxnreg": plan.maxnreg})
    path = os.path.join(sys.argv[2], "k.cubin")
    open(path, "wb").write(compiled.asm["cubin"])
    sass = subprocess.run([tool, "--dump-sass", path], capture_output=True, text=True, check=True).stdout
    stats[str((head_dim, causal, plan.consumers, plan.pingpong, varlen, persistent))] = {
        "hgmma": len(re.findall(r"HGMMA", sass)), "spills": len(re.findall(r"\bSTL\b", sass)),
        "setmaxnreg": len(re.findall(r"USETMAXREG", sass)), "tma": len(re.findall(r"UTMALDG", sass)),
        "warps": compiled.metadata.num_warps, "named_bars": len(re.findall(r"BAR\.(?:SYNC|ARV)[^;]*0x100", sass))}
print(json.dumps(stats))
"""


def test_compiles_for_sm90_into_warpgroups_without_spills(tmp_path) -> None:
    """Each launch plan compiled in a fresh process (the suite's interpreted kernels leave Triton patched in this
    one): tensor-core products, TMA, register reallocation, no spills, one warpgroup a consumer plus the loader's,
    and the ping-pong's named barriers (256 threads) exactly where it is on."""
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("no cuobjdump in this Triton wheel")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    cases = [(128, False, rules._HD128, False, True), (64, False, rules._HD64, False, False),
             (64, True, rules._HD64_CAUSAL, False, False), (128, True, rules._HD128, True, False),
             (128, True, rules._HD128, True, True)]  # dense persistent first; packed, packed persistent last
    run = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(cases), str(tmp_path)], capture_output=True,
                         text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    stats = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(stats) == len(cases)
    for case, got in stats.items():
        assert got["hgmma"] > 0 and got["tma"] > 0, case
        assert got["spills"] == 0, f"register spills at {case}"
        assert got["setmaxnreg"] > 0, f"no register reallocation between partitions at {case}"
    for (_, _, plan, _, _), got in zip(cases, stats.values(), strict=True):
        assert got["warps"] == 4 * (plan.consumers + 1), plan  # the loader's warpgroup: one warp, padded
        assert (got["named_bars"] > 0) == plan.pingpong, plan


def _address_of(t: torch.Tensor, b: int, s: int, h: int) -> int:
    return (t[b, s, h].data_ptr() - t.data_ptr()) // t.element_size()


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_tma_rows_address_the_tensors_elements(layout: str) -> None:
    B, S, H, D = 3, 37, 5, 64
    t = torch.zeros(B, S, H, D) if layout == "bshd" else torch.zeros(B, H, S, D).transpose(1, 2)
    rows, row_stride, per_b, per_h, col_h = rules.tma_rows(t)  # type: ignore[misc]
    assert rows * row_stride == t.numel()
    for b, s, h in [(0, 0, 0), (2, 36, 4), (1, 17, 3), (2, 0, 1)]:
        assert (b * per_b + h * per_h + s) * row_stride + h * col_h == _address_of(t, b, s, h)


def test_tma_rows_refuse_other_strides() -> None:
    t = torch.zeros(2, 16, 4, 64)
    assert rules.tma_rows(t[:, :, :2]) is None  # heads sliced: rows are not whole
    assert rules.tma_rows(t.transpose(0, 1)) is None
    assert rules.tma_rows(torch.zeros(2, 16, 4, 130)[..., :128]) is None  # padded rows: not a (B, S, H, D) stride
    packed = torch.zeros(50, 4, 64)
    assert rules.tma_rows(packed.transpose(0, 1).contiguous().transpose(0, 1)) is None  # (H, total, D) storage
    assert rules.tma_rows(torch.zeros(50, 4, 72)[..., :64]) is None  # heads not side by side
    assert rules.tma_rows(torch.zeros(50 * 4 * 64 + 1)[1:].view(50, 4, 64)) is None  # not 16-byte aligned
    assert rules.tma_rows(torch.zeros(50, 4 * 64 + 2)[:, : 4 * 64].view(50, 4, 64)) is None  # token stride: 8 bytes off


def test_tma_rows_of_packed_tensors_and_fused_qkv_slices() -> None:
    """A packed ``(total, H, D)`` tensor is rows = tokens, its heads side by side; the query, key and value slices
    of a fused projection's output keep the whole fused row as their token stride."""
    total, H, Hkv, D = 37, 4, 2, 64
    fused = torch.zeros(total, H + 2 * Hkv, D)
    for t in (torch.zeros(total, H, D), fused[:, :H], fused[:, H : H + Hkv], fused[:, H + Hkv :]):
        rows, row_stride, per_b, per_h, col_h = rules.tma_rows(t)  # type: ignore[misc]
        assert (rows, per_b, per_h, col_h) == (total, 0, 0, D) and row_stride == t.stride(0)
        for tok, h in [(0, 0), (36, t.shape[1] - 1), (17, 1)]:
            assert tok * row_stride + h * col_h == (t[tok, h].data_ptr() - t.data_ptr()) // t.element_size()


def test_not_taken_off_the_gpu_and_bad_modes_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.zeros(1, 64, 2, 64, dtype=torch.bfloat16)
    geo = geometry(q, q, None, None)
    for mode in ("auto", "ws"):
        monkeypatch.setenv("LLMOPT_FLASH_FWD", mode)
        assert rules.ws_plan(q, q, q, geo, False, None) is None  # a CPU tensor
    monkeypatch.setenv("LLMOPT_FLASH_FWD", "fast")
    with pytest.raises(ValueError, match="LLMOPT_FLASH_FWD"):
        rules.ws_plan(q, q, q, geo, False, None)


def test_plan_follows_the_measured_rule() -> None:
    """Head dim 128: two plain consumers, persistent when dense, at every length; head dim 64: three, ping-pong
    without a mask from 2k keys, plain with it from 8k; any length when forced (the Triton forward was as fast or
    faster below). Packed: head dim 128 without a mask, and with it from a mean document length of 1024; head dim
    64 only when forced."""
    hd128, hd64 = rules.WsPlan(2, False, 128, 2, 168, 240, persistent=True), rules.WsPlan(3, True, 128, 3, 128, 160)
    hd64_causal = rules.WsPlan(3, False, 128, 3, 128, 160)
    expect = {  # (head_dim, causal) -> plans at 1, 1024, 2048, 4096, 8192, 16384 keys
        (128, False): [hd128] * 6,
        (128, True): [hd128] * 6,
        (64, False): [None, None] + [hd64] * 4,
        (64, True): [None] * 4 + [hd64_causal] * 2,
    }
    for (head_dim, causal), plans in expect.items():
        for seq_k, plan in zip((1, 1024, 2048, 4096, 8192, 16384), plans, strict=True):
            assert rules.choose_plan(head_dim, causal, seq_k) == plan, (head_dim, causal, seq_k)
            assert rules.choose_plan(head_dim, causal, seq_k, "ws") == plans[-1]
    for length in (1, 512, 1023):  # packed, by the mean document length
        assert rules.choose_plan(128, False, length, packed=True) == hd128
        assert rules.choose_plan(128, True, length, packed=True) is None
        assert rules.choose_plan(128, True, length, "ws", packed=True) == hd128
    assert rules.choose_plan(128, True, 1024, packed=True) == hd128
    for causal in (False, True):  # head dim 64 packed: only when forced
        assert rules.choose_plan(64, causal, 16384, packed=True) is None
        assert rules.choose_plan(64, causal, 1, "ws", packed=True) == (hd64_causal if causal else hd64)
    for plan in (rules._HD128, rules._HD64, rules._HD64_CAUSAL):  # every warp's registers fit the 64k register file
        warpgroups = plan.consumers + 1
        assert warpgroups * 128 * plan.maxnreg <= 65536
        assert plan.consumers * 128 * plan.consumer_regs + 128 * 24 <= 65536


def _persistent_order(n_mblk: int, pairs: int, sms: int) -> list[list[tuple[int, int]]]:
    """The (query block, pair) tiles each program of the persistent kernel takes, in the order of its docstring."""
    programs, chunk = wp.persistent_grid(n_mblk, pairs, sms)
    per_program: list[list[tuple[int, int]]] = [[] for _ in range(programs)]
    for t in range(n_mblk * pairs):
        c, r = divmod(t, chunk * n_mblk)
        width = min(chunk, pairs - c * chunk)
        if c % 2:
            r = width * n_mblk - 1 - r
        per_program[t % programs].append((n_mblk - 1 - r // width, c * chunk + r % width))
    return per_program


@pytest.mark.parametrize("n_mblk,pairs", [(8, 256), (16, 128), (128, 16), (8, 72), (1, 4), (200, 3)])
def test_persistent_order_covers_every_tile_once_and_balances_causal_work(n_mblk: int, pairs: int) -> None:
    """Every tile once; at most one program per SM; under the causal mask (block m: m + 1 key tiles) no program
    does more than its even share plus one tile's worth, when the pairs divide into chunks."""
    order = _persistent_order(n_mblk, pairs, sms=132)
    assert len(order) <= 132
    tiles = [tile for program in order for tile in program]
    assert sorted(tiles) == sorted((m, p) for m in range(n_mblk) for p in range(pairs))
    work = [sum(m + 1 for m, _ in program) for program in order]
    if pairs % wp.persistent_grid(n_mblk, pairs, 132)[1] == 0 and n_mblk <= 132:
        assert max(work) - min(work) <= n_mblk, work


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the warp-specialized forward runs on sm_90 only")
@pytest.mark.parametrize("head_dim,heads,kv_heads,causal,seq,seq_k,layout,mode", [
    (128, 4, 4, False, 1024, 1024, "bshd", "auto"),
    (128, 8, 2, True, 1000, 1000, "bhsd", "ws"),
    (64, 8, 1, True, 333, 333, "bshd", "ws"),  # three plain consumers (below 8k keys only when forced)
    (64, 4, 2, False, 129, 129, "bhsd", "ws"),  # three consumers, ping-pong
    (128, 2, 2, True, 1, 1, "bshd", "ws"),
    (64, 2, 2, True, 2048, 2048, "bhsd", "ws"),
    (64, 4, 4, False, 300, 700, "bshd", "ws"),  # ping-pong, more keys than queries
    (128, 4, 2, True, 700, 300, "bhsd", "ws"),  # the first 400 query rows see no key (bottom-right causal)
    (64, 2, 2, False, 2048, 2048, "bshd", "auto"),  # ping-pong by the default rule
    (128, 2, 1, True, 2048, 2048, "bshd", "auto"),
    (128, 36, 4, True, 1000, 1000, "bshd", "auto"),  # persistent: 72 pairs in chunks of 16, the last one of 8
])  # fmt: skip
def test_matches_reference_on_hopper(monkeypatch: pytest.MonkeyPatch, head_dim, heads, kv_heads, causal, seq, seq_k,
                                     layout, mode) -> None:
    from lightning_llmopt.kernels import flash_attention

    monkeypatch.setenv("LLMOPT_FLASH_FWD", mode)
    taken = []
    monkeypatch.setattr(ws, "ws_fwd", lambda *a, _f=ws.ws_fwd: taken.append(1) or _f(*a))
    g = torch.Generator(device="cuda").manual_seed(seq)

    def make(s: int, h: int) -> torch.Tensor:
        shape = (2, s, h, head_dim) if layout == "bshd" else (2, h, s, head_dim)
        t = torch.randn(shape, generator=g, device="cuda").bfloat16()
        return (t if layout == "bshd" else t.transpose(1, 2)).requires_grad_()

    q, k, v = make(seq, heads), make(seq_k, kv_heads), make(seq_k, kv_heads)
    do = torch.randn(q.shape, generator=g, device="cuda").bfloat16()
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    assert taken, "the warp-specialized forward was not used"
    _assert_matches_reference(q, k, v, do, out, lse, causal=causal)


def _assert_matches_reference(q, k, v, do, out, lse, **kwargs) -> None:  # type: ignore[no-untyped-def]
    """``out``/``lse`` and the gradients through them against float64 (the attention tolerance rule: at most twice
    the error of plain PyTorch in the inputs' dtype, lse to 1e-2 / sqrt(D)); ``kwargs``: causal, packing."""
    head_dim = q.shape[-1]
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    plain_in = [t.detach().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = flash_attention_ref(*ref_in, return_lse=True, **kwargs)
    plain = flash_attention_ref(*plain_in, upcast=False, **kwargs)
    blind = torch.isinf(ref_lse)  # rows that see no key: lse -inf, output 0
    assert torch.equal(torch.isinf(lse), blind) and not torch.isnan(lse).any()
    lse_err = (lse.double() - ref_lse)[~blind].abs().max().item()
    assert lse_err < 1e-2 / math.sqrt(head_dim)
    ref_g = torch.autograd.grad(ref, ref_in, do.double())
    plain_g = torch.autograd.grad(plain, plain_in, do)
    for name, a, r, p in [("out", out, ref, plain), *zip(("dq", "dk", "dv"), grads, ref_g, plain_g, strict=True)]:
        assert not torch.isnan(a).any(), name
        err, err_plain = (a.double() - r).abs().max().item(), (p.double() - r).abs().max().item()
        assert err <= 2 * err_plain + 1e-6, f"{name}: {err} vs plain bf16 {err_plain}"


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the warp-specialized forward runs on sm_90 only")
@pytest.mark.parametrize("head_dim,heads,kv_heads,causal,lens,mode,fused,taken_expected", [
    (128, 4, 4, True, [1024, 1024, 1100], "auto", False, True),  # documents average over 1024 tokens
    (128, 8, 2, False, [1, 17, 300, 5, 129], "auto", False, True),  # no mask: any pack
    (128, 2, 2, True, [300, 200], "auto", False, False),  # short causal documents: the Triton forward
    (128, 4, 2, True, [1024, 1024, 1024], "auto", False, True),  # equal documents: the persistent kernel
    (128, 4, 4, False, [300, 300], "auto", True, True),  # equal documents, fused rows: persistent
    (128, 4, 2, True, [2000, 1, 1, 64, 129, 3], "ws", True, True),  # blocks past short documents return early
    (64, 6, 3, True, [64, 65, 1000, 3], "ws", False, True),
    (64, 4, 1, False, [17, 511], "ws", True, True),  # ping-pong
])  # fmt: skip
def test_packed_matches_reference_on_hopper(monkeypatch: pytest.MonkeyPatch, head_dim, heads, kv_heads, causal, lens,
                                            mode, fused, taken_expected) -> None:
    """Packed documents of ragged lengths (down to one token), GQA, and query/key/value as slices of one fused
    projection output (token stride wider than the heads)."""
    from lightning_llmopt.kernels import flash_attention

    monkeypatch.setenv("LLMOPT_FLASH_FWD", mode)
    taken = []
    monkeypatch.setattr(ws, "ws_fwd", lambda *a, _f=ws.ws_fwd: taken.append(1) or _f(*a))
    g = torch.Generator(device="cuda").manual_seed(sum(lens))
    total = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    if fused:
        qkv = torch.randn(total, heads + 2 * kv_heads, head_dim, generator=g, device="cuda").bfloat16()
        q, k, v = (t.requires_grad_() for t in qkv.split([heads, kv_heads, kv_heads], dim=1))
        assert q.stride(0) == qkv.stride(0)
    else:
        q, k, v = (torch.randn(total, h, head_dim, generator=g, device="cuda").bfloat16().requires_grad_()
                   for h in (heads, kv_heads, kv_heads))
    do = torch.randn(q.shape, generator=g, device="cuda").bfloat16()
    out, lse = flash_attention(q, k, v, causal=causal, cu_seqlens=cu, return_lse=True)
    assert bool(taken) == taken_expected
    _assert_matches_reference(q, k, v, do, out, lse, causal=causal, cu_seqlens=cu, max_seqlen=max(lens))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the warp-specialized forward runs on sm_90 only")
@pytest.mark.parametrize("batch,seq,heads,kv_heads,causal", [(2, 1000, 36, 4, True), (1, 3000, 8, 8, False),
                                                             (3, 257, 16, 2, True)])
def test_persistent_is_bit_identical_to_one_program_per_tile(batch, seq, heads, kv_heads, causal) -> None:
    g = torch.Generator(device="cuda").manual_seed(seq)
    q = torch.randn(batch, seq, heads, 128, generator=g, device="cuda").bfloat16()
    k, v = (torch.randn(batch, seq, kv_heads, 128, generator=g, device="cuda").bfloat16() for _ in range(2))
    geo = geometry(q, k, None, None)
    assert rules._HD128.persistent
    got = ws.ws_fwd(q, k, v, geo, causal, 0.1, rules._HD128)
    want = ws.ws_fwd(q, k, v, geo, causal, 0.1, rules._HD128._replace(persistent=False))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the warp-specialized forward runs on sm_90 only")
@pytest.mark.parametrize("lens,causal", [([1000] * 3, True), ([256] * 5, False)])
def test_packed_persistent_is_bit_identical_to_one_program_per_tile(lens, causal) -> None:
    """Equal documents take the persistent kernel (which reads each document's bounds from ``cu_seqlens``); its
    outputs and log-sum-exps equal the one-program-per-tile kernel's bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(len(lens))
    total = sum(lens)
    q = torch.randn(total, 8, 128, generator=g, device="cuda").bfloat16()
    k, v = (torch.randn(total, 2, 128, generator=g, device="cuda").bfloat16() for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    geo = geometry(q, k, cu, max(lens))
    assert wp.ws_fwd_persistent(q, k, v, geo, causal, 0.1, rules._HD128) is not None
    got = ws.ws_fwd(q, k, v, geo, causal, 0.1, rules._HD128)
    want = ws.ws_fwd(q, k, v, geo, causal, 0.1, rules._HD128._replace(persistent=False))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    ragged = geometry(q, k, torch.tensor([0, 1, total], device="cuda", dtype=torch.int32), total - 1)
    assert wp.ws_fwd_persistent(q, k, v, ragged, causal, 0.1, rules._HD128) is None
