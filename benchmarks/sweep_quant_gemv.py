"""Diagnostic, no record: small-batch quantized matmul launch choices against cuBLAS bf16 on one GPU.

For each ``N x K`` of the quant-matmul record (4096 x 4096 to 28672 x 8192) and each format (int4 symmetric g128,
int8 per channel), at batch ``--m`` in bf16: cuBLAS ``F.linear``, the autotuner's pick among the library's
candidates, and a grid of one kernel kind (``--kind``): ``words`` (batch 1: int32 word loads, codes placed in fp32
mantissas, optional inline-PTX ``prmt`` unpacking) or ``mma_t`` (tensor cores, weights as the left operand) over
block sizes, split-K, warps and stages. Every time is the autotuner's measure
(``quant_matmul_tune._gpu_ms``: a CUDA graph of calls each after a 64 MiB L2 flush, the flushes' own time
subtracted), so the ranking is the one ``choose_config`` would make. Prints the best configurations per shape and
writes them as JSON (``--out``) for the candidate list in ``quant_matmul_tune``.

    python benchmarks/sweep_quant_gemv.py [--m 1] [--kind words|mma_t] [--quick] [--out sweep.json]
"""

# ruff: noqa: B023 - closures built in loops are used within their own iteration
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from lightning_llmopt.kernels import quant_matmul_tune as tune
from lightning_llmopt.kernels.quant_matmul_fwd import KernelConfig, launch
from lightning_llmopt.quantization.packing import as_kernel_bytes

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (8192, 8192), (28672, 8192)]
FORMATS = {"int4-g128": (4, 128), "int8": (8, 0)}


@triton.jit
def _load_probe(W, Y, N, K_WORDS, stride_wn, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """The word kernel's loads alone (xor-folded): the memory ceiling of its tiling."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_W)
    rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.int32)
    for k0 in range(0, K_WORDS, BLOCK_W):
        acc ^= tl.load(rows + (k0 + offs_w)[None, :], mask=(offs_n < N)[:, None], other=0)
    tl.store(Y + offs_n, tl.xor_sum(acc, axis=1), mask=offs_n < N)


def probe(packed: torch.Tensor, dev: torch.device, top: int) -> list[tuple[float, str]]:
    n, kw = packed.shape
    y = torch.empty(n, device=dev, dtype=torch.int32)
    rows = []
    for bn, bw, warps, stages in itertools.product((4, 8, 16), (64, 128, 256), (4, 8), (2, 3, 4)):

        def run(bn=bn, bw=bw, warps=warps, stages=stages):  # type: ignore[no-untyped-def]
            _load_probe[(triton.cdiv(n, bn),)](
                packed, y, n, kw, packed.stride(0), BLOCK_N=bn, BLOCK_W=bw, num_warps=warps, num_stages=stages
            )

        rows.append((tune._gpu_ms(run, dev), f"BN={bn} BW={bw} warps={warps} stages={stages}"))
    return sorted(rows)[:top]


def grid(kind: str, bits: int, group: int, quick: bool) -> list[KernelConfig]:
    if kind == "mma_t":
        shapes = [(64, 4), (128, 4)] if quick else [(64, 4), (128, 4), (128, 8)]
        block_k = [min(bk, group or bk) for bk in ((128,) if quick else (128, 256))]
        asm = (False, True) if bits == 4 else (False,)
        modes = [(False, False), (True, False)] + ([(False, True)] if bits == 4 else [])  # (prefetch, x_split)
        return [
            KernelConfig("mma_t", 16, bn, bk, sk, w, st, True, a, pf, xs)
            for (bn, w), bk, sk, st, a, (pf, xs) in itertools.product(shapes, block_k, (1, 2, 4), (3, 4), asm, modes)
        ]
    block_n = (4, 8, 16)
    block_k = (1024,) if quick else (1024, 2048) if bits == 4 else (512, 1024, 2048)
    splits = (1, 2) if quick else (1, 2, 4)
    warps = (2, 4, 8)
    stages = (3,) if quick else (2, 3, 4)
    asm = (False, True)
    return [
        KernelConfig("words", 1, bn, bk, sk, w, st, True, a, pf)
        for bn, bk, sk, w, st, a, pf in itertools.product(block_n, block_k, splits, warps, stages, asm, (False, True))
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller grid")
    parser.add_argument("--out", default=None, help="write the per-shape rankings here (JSON)")
    parser.add_argument("--top", type=int, default=6)
    parser.add_argument("--probe", action="store_true", help="also time the word kernel's loads alone (int4)")
    parser.add_argument("--m", type=int, default=1, help="batch rows (the words kernel takes 1)")
    parser.add_argument("--kind", choices=("words", "mma_t"), default="words")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a GPU")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    if args.kind == "words" and args.m != 1:
        sys.exit("the words kernel takes one row")
    report = {"gpu": torch.cuda.get_device_name(), "m": args.m, "kind": args.kind, "shapes": []}
    for (n, k), (name, (bits, group)) in itertools.product(SHAPES, FORMATS.items()):
        t0 = time.time()
        x = torch.randn(args.m, k, device=dev, generator=g).to(torch.bfloat16)
        w16 = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
        packed = torch.randint(-(2**31), 2**31 - 1, (n, k * bits // 32), device=dev, dtype=torch.int32, generator=g)
        groups = k // group if group else 1
        scales = (torch.rand(n, groups, device=dev, generator=g) * 1e-3 + 1e-4).to(torch.bfloat16)
        codes = as_kernel_bytes(packed, bits, k)
        bf16_ms = tune._gpu_ms(lambda: F.linear(x, w16), dev)
        tuned = tune.choose_config(x, codes, scales, None, bits, group, None)
        timings = tune.TIMINGS[next(key for key in tune.TIMINGS if key[2] == n and key[3] == k and key[4] == bits)]
        tuned_ms = timings[tuned]
        per_kind: dict[str, float] = {}
        for cfg, ms in timings.items():
            if ms == ms:
                label = cfg.kind + ("+asm" if cfg.asm else "")
                per_kind[label] = min(per_kind.get(label, float("inf")), ms)
        print("  tuner's best per kind: " + ", ".join(f"{k_} {bf16_ms / v:.2f}x" for k_, v in sorted(per_kind.items())))
        ref = tune._reference(x, codes, scales, None, bits)
        rows = []
        for cfg in grid(args.kind, bits, group, args.quick):
            try:
                out = launch(x, codes, scales, None, bits, group, cfg).float()
                if not bool(((out - ref).norm() <= 2e-2 * ref.norm()).item()):
                    rows.append((float("nan"), cfg))
                    continue
                rows.append((tune._gpu_ms(lambda cfg=cfg: launch(x, codes, scales, None, bits, group, cfg), dev), cfg))
            except Exception as exc:  # noqa: BLE001 - a configuration the compiler rejects is reported and skipped
                print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        ok = sorted((r for r in rows if r[0] == r[0]), key=lambda r: r[0])
        wrong = [r[1] for r in rows if r[0] != r[0]]
        weight_bytes = packed.numel() * 4 + scales.numel() * 2
        print(
            f"{name} N={n} K={k}: bf16 {bf16_ms * 1e3:.1f} us; tuned {tuned.kind} {tuned_ms * 1e3:.1f} us "
            f"({bf16_ms / tuned_ms:.2f}x); best {args.kind} {ok[0][0] * 1e3:.1f} us ({bf16_ms / ok[0][0]:.2f}x, "
            f"{weight_bytes / ok[0][0] / 1e9:.2f} TB/s); {len(wrong)} wrong; {time.time() - t0:.0f} s",
            flush=True,
        )
        for ms, cfg in ok[: args.top]:
            print(f"    {ms * 1e3:7.1f} us {bf16_ms / ms:5.2f}x  {cfg}", flush=True)
        loads = probe(packed, dev, 3) if args.probe and bits == 4 else []
        for ms, what in loads:
            print(f"    loads only {ms * 1e3:7.1f} us {bf16_ms / ms:5.2f}x {weight_bytes / ms / 1e9:.2f} TB/s  {what}")
        report["shapes"].append(
            {
                "format": name,
                "N": n,
                "K": k,
                "bf16_us": bf16_ms * 1e3,
                "tuned": repr(tuned),
                "tuned_us": tuned_ms * 1e3,
                "tuner_best_per_kind_us": {k_: v * 1e3 for k_, v in per_kind.items()},
                "grid": [{"us": ms * 1e3, "config": repr(cfg)} for ms, cfg in ok[: 4 * args.top]],
                "wrong": [repr(c) for c in wrong],
                "loads_only": [{"us": ms * 1e3, "config": what} for ms, what in loads],
            }
        )
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
