"""Weight-only quantized matmul on one GPU: our Triton int8 (per channel) and int4 (g128) kernels vs cuBLAS bf16.

Families (one process runs them in order; ``--family`` picks one):

- ``check``: bf16 correctness at real sizes against the fp64 dequantized reference (the 2x-PyTorch rule of the
  tests), several formats and batch sizes;
- ``ceilings``: device-to-device copy bandwidth (bytes read + written) and read-only bandwidth (``sum`` of a large
  tensor), the physical bounds of a weight-streaming kernel;
- ``gemm``: ``y = x W^T`` for N x K from 4096 x 4096 to 28672 x 8192 at batch 1 and 16: cuBLAS bf16
  (``F.linear``) vs ours int8 and int4-g128, each timed (a) by replaying a CUDA graph that runs the op over enough
  distinct weight copies to defeat the 50 MB L2 (per-call GPU time, what a decode engine with CUDA graphs pays) and
  (b) eagerly with ``triton.testing.do_bench`` (L2 flushed; includes our Python dispatch). Speedup = bf16 time /
  ours, same method; achieved bandwidth = weight bytes / time;
- ``decode``: one decode step of the linear layers of a ``llama2-7b``-shaped model (32 blocks of q/k/v/o
  4096 x 4096, gate/up 11008 x 4096, down 4096 x 11008, plus the bf16 head 32000 x 4096), random weights, as a CUDA
  graph: tokens/s = batch / step time. The linear stack only (attention, norms and the KV cache are not included:
  the inference engine is built separately), for bf16, int8 and int4-g128.

    python benchmarks/bench_quant_matmul.py                   # GPU, all families; record quant-matmul-<gpu>.json
    python benchmarks/bench_quant_matmul.py --smoke           # CPU interpreter: tiny shapes, checks the code path
"""

# ruff: noqa: B023 - closures built in loops are used within their own iteration
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package
import records  # noqa: E402

from lightning_llmopt.kernels.quant_matmul import quant_matmul  # noqa: E402
from lightning_llmopt.kernels.quant_matmul_ref import quant_matmul_ref  # noqa: E402
from lightning_llmopt.quantization.packing import pack_bits  # noqa: E402

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (8192, 8192), (28672, 8192)]
BATCHES = (1, 16)
LLAMA2_7B = {"dim": 4096, "ffn": 11008, "layers": 32, "vocab": 32000}
# goals of issue 10 (speedup over cuBLAS bf16)
GOALS = {("int8", 1): 1.8, ("int4-g128", 1): 3.0, ("int8", 16): 1.5, ("int4-g128", 16): 1.5}


# --------------------------------------------------------------------------- weights and timing


def make_weight(
    n: int, k: int, variant: str, device: str, g: torch.Generator, dtype: torch.dtype = torch.bfloat16
) -> dict[str, Any]:
    """Random weights (never zeros) in the variant's storage: a ``dtype`` matrix, or packed codes + scales."""
    if variant == "bf16":
        return {"w": (torch.randn(n, k, device=device, generator=g) * 0.02).to(dtype)}
    bits, groups = (8, 1) if variant == "int8" else (4, k // 128)
    words = k * bits // 32
    packed = torch.randint(-(2**31), 2**31 - 1, (n, words), device=device, dtype=torch.int32, generator=g)
    scales = (torch.rand(n, groups, device=device, generator=g) * 1e-3 + 1e-4).to(dtype)
    return {"packed": packed, "scales": scales, "bits": bits}


def weight_bytes(w: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in w.values() if isinstance(t, torch.Tensor))


def op(w: dict[str, Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    if "w" in w:
        return lambda x: F.linear(x, w["w"])
    return lambda x: quant_matmul(x, w["packed"], w["scales"], None, bits=w["bits"])


# --------------------------------------------------------------------------- families


def _check_configs(m: int, bits: int, group: int | None) -> dict[str, Any]:
    """Kernel variants checked at batch ``m``: the batch-1 GEMV and int32-word kernels (the latter with and without
    inline PTX), the tensor-core kernel with exact centering, its transposed form (weights as the left operand,
    double-buffered) and (int4 / fp16) the folded zero point; each with split-K 2."""
    from lightning_llmopt.kernels.quant_matmul_fwd import KernelConfig

    bk = min(128, group) if group else 128
    out = {"mma": KernelConfig("mma", 16 if m <= 16 else 64, 64, bk if m <= 16 else min(64, bk), 2, 4, 3, True)}
    out["mma_t"] = KernelConfig("mma_t", 16, 128, bk, 2, 4, 3, True, prefetch=True)
    if m == 1:
        out["gemv"] = KernelConfig("gemv", 1, 32, bk, 2, 4, 3, True)
        out["words"] = KernelConfig("words", 1, 8, 1024, 2, 4, 3, True, prefetch=True)
        if device_has_asm():
            out["words-asm"] = KernelConfig("words", 1, 8, 1024, 2, 4, 3, True, asm=True)
    if bits == 4 and m <= 16:
        out["mma-fold"] = KernelConfig("mma", 16, 64, bk, 2, 4, 3, False)
    return out


def device_has_asm() -> bool:
    """The inline-PTX variants need a CUDA device (the interpreter has no PTX)."""
    return torch.cuda.is_available()


def family_check(device: str, smoke: bool) -> list[dict[str, Any]]:
    """bf16 (GPU) / fp16 (interpreter) kernel error vs fp64, against plain PyTorch's in the same dtype."""
    from lightning_llmopt.kernels.quant_matmul_fwd import launch
    from lightning_llmopt.quantization.packing import as_kernel_bytes

    dtype = torch.float16 if smoke else torch.bfloat16
    n, k = (64, 256) if smoke else (4096, 4096)
    rows = []
    for bits, group, sym in ((4, 128, True), (4, 32, False), (8, None, True), (8, None, False)):
        for m in (1, 16) if smoke else (1, 16, 128):
            g = torch.Generator(device=device).manual_seed(m * 7 + bits)
            groups = 1 if group is None else k // group
            codes = torch.randint(0, 1 << bits, (n, k), device=device, generator=g)
            qw = pack_bits(codes, bits)
            scales = (torch.rand(n, groups, device=device, generator=g) * 0.05 + 0.005).to(dtype)
            zeros = None
            if not sym:
                zeros = torch.randint(0, 1 << bits, (n, groups), device=device, generator=g, dtype=torch.uint8)
            x = torch.randn(m, k, device=device, generator=g).to(dtype)
            ref = quant_matmul_ref(x.double(), qw, scales, zeros, bits)
            same = quant_matmul_ref(x, qw, scales, zeros, bits, upcast=False)
            pt_err = (same.double() - ref).abs().max().item()
            floor = 4 * torch.finfo(dtype).eps * max(ref.abs().max().item(), 1.0)
            for kind, cfg in _check_configs(m, bits, group).items():
                out = launch(x, as_kernel_bytes(qw, bits, k), scales, zeros, bits, group or 0, cfg)
                err = (out.double() - ref).abs().max().item()
                rel = ((out.double() - ref).norm() / ref.norm()).item()
                name = f"check-{kind}-int{bits}-{'g' + str(group) if group else 'channel'}-{'sym' if sym else 'asym'}"
                rows.append(
                    {
                        "variant": f"{name}-M{m}",
                        "max_err": err,
                        "torch_same_dtype_err": pt_err,
                        "rel_err": rel,
                        "passed": err <= 2 * pt_err + floor,
                        "dtype": str(dtype),
                    }
                )
                print(
                    f"{rows[-1]['variant']}: err {err:.3g} torch {pt_err:.3g} rel {rel:.2e} "
                    f"{'ok' if rows[-1]['passed'] else 'FAIL'}",
                    flush=True,
                )
    return rows


def family_ceilings(device: str, smoke: bool) -> dict[str, float]:
    import bench_ceilings

    nbytes = 16 * 2**20 if smoke else 2 * 2**30
    copy = bench_ceilings.copy_bandwidth(nbytes, device, repeats=10)
    src = torch.rand(nbytes // 2, device=device).to(torch.bfloat16).add_(0.5)
    read_ms = records.timeit_median(lambda: src.sum(), warmup=3, repeats=10)
    out = {"copy_tb_per_s": copy["tb_per_s"], "read_tb_per_s": nbytes / (read_ms * 1e-3) / 1e12}
    print(f"ceilings: copy {out['copy_tb_per_s']:.3f} TB/s (read + write), read {out['read_tb_per_s']:.3f} TB/s")
    return out


def family_gemm(device: str, smoke: bool, copy_budget: int) -> tuple[list[dict], list[dict], list[dict]]:
    shapes = [(96, 256), (64, 512)] if smoke else SHAPES
    results, peers, ratios = [], [], []
    g = torch.Generator(device=device).manual_seed(0)
    for n, k in shapes:
        int4_bytes = weight_bytes(make_weight(n, k, "int4-g128", device, g))
        copies = 2 if smoke else max(2, min(64, math.ceil(copy_budget / int4_bytes)))
        dtype = torch.float16 if smoke else torch.bfloat16
        weights = {
            v: [make_weight(n, k, v, device, g, dtype) for _ in range(copies)] for v in ("bf16", "int8", "int4-g128")
        }
        for m in BATCHES:
            x = torch.randn(m, k, device=device, generator=g).to(dtype)
            row: dict[str, dict[str, Any]] = {}
            for variant, ws in weights.items():
                calls = [lambda w=w: op(w)(x) for w in ws]
                entry = {
                    "variant": f"{variant} N={n} K={k} M={m}",
                    "kind": variant,
                    "N": n,
                    "K": k,
                    "M": m,
                    "weight_bytes": weight_bytes(ws[0]),
                    "copies": copies,
                }
                if device == "cuda":
                    entry["graph_us"] = records.graph_ms(calls) * 1e3
                    entry["eager_us"] = records.timeit_median(calls[0], warmup=5, repeats=30) * 1e3
                    entry["graph_tb_per_s"] = entry["weight_bytes"] / (entry["graph_us"] * 1e-6) / 1e12
                else:
                    calls[0]()
                row[variant] = entry
                (peers if variant == "bf16" else results).append(entry)
            for variant in ("int8", "int4-g128"):
                if device != "cuda":
                    continue
                for metric in ("graph_us", "eager_us"):
                    ratio = row["bf16"][metric] / row[variant][metric]
                    row[variant][f"speedup_{metric.removesuffix('_us')}"] = ratio
                    ratios.append(
                        {
                            "variant": row[variant]["variant"],
                            "peer": row["bf16"]["variant"],
                            "metric": metric,
                            "ratio": ratio,
                        }
                    )
                goal = GOALS[(variant, m)]
                row[variant]["goal"] = goal
                row[variant]["goal_met_graph"] = row[variant]["speedup_graph"] >= goal
                print(
                    f"N={n:6d} K={k:6d} M={m:3d} {variant:10s} graph {row[variant]['graph_us']:8.1f} us "
                    f"({row[variant]['graph_tb_per_s']:.2f} TB/s) vs bf16 {row['bf16']['graph_us']:8.1f} us "
                    f"({row['bf16']['graph_tb_per_s']:.2f} TB/s): x{row[variant]['speedup_graph']:.2f} "
                    f"(goal {goal}); eager x{row[variant]['speedup_eager']:.2f}",
                    flush=True,
                )
        del weights
        torch.cuda.empty_cache() if device == "cuda" else None
    return results, peers, ratios


def family_decode(device: str, smoke: bool) -> list[dict[str, Any]]:
    """Per-token time of the llama2-7b linear stack (see the module docstring), batch 1 and 16."""
    cfg = {"dim": 128, "ffn": 256, "layers": 2, "vocab": 320} if smoke else LLAMA2_7B
    d, f = cfg["dim"], cfg["ffn"]
    shapes = [(d, d)] * 4 + [(f, d), (f, d), (d, f)]
    dtype = torch.float16 if smoke else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(1)
    head = make_weight(cfg["vocab"], d, "bf16", device, g, dtype)
    rows = []
    for variant in ("bf16", "int8", "int4-g128"):
        layers = [[make_weight(n, k, variant, device, g, dtype) for n, k in shapes] for _ in range(cfg["layers"])]
        nbytes = sum(weight_bytes(w) for layer in layers for w in layer) + weight_bytes(head)
        for batch in (1, 16):
            xd = torch.randn(batch, d, device=device, generator=g).to(dtype)
            xf = torch.randn(batch, f, device=device, generator=g).to(dtype)

            def step(layers: list = layers, xd: torch.Tensor = xd, xf: torch.Tensor = xf) -> None:
                for layer in layers:
                    for (_, k), w in zip(shapes, layer, strict=True):
                        op(w)(xd if k == d else xf)
                op(head)(xd)

            entry = {
                "variant": f"decode-llama2-7b-linears-{variant}-batch{batch}",
                "kind": variant,
                "batch": batch,
                "weight_bytes": nbytes,
            }
            if device == "cuda":
                ms = records.graph_ms([step], reps=10)
                entry.update(step_ms=ms, tokens_per_s=batch * 1e3 / ms, tb_per_s=nbytes / (ms * 1e-3) / 1e12)
                print(
                    f"decode {variant:10s} batch {batch:2d}: {ms:.3f} ms/step, {entry['tokens_per_s']:.0f} tok/s, "
                    f"{entry['tb_per_s']:.2f} TB/s",
                    flush=True,
                )
            else:
                step()
            rows.append(entry)
        del layers
        torch.cuda.empty_cache() if device == "cuda" else None
    base = {r["batch"]: r for r in rows if r["kind"] == "bf16"}
    for r in rows:
        if "step_ms" in r:
            r["speedup_vs_bf16"] = base[r["batch"]]["step_ms"] / r["step_ms"]
    return rows


# --------------------------------------------------------------------------- main


def write(
    args: argparse.Namespace,
    results: list[dict],
    peers: list[dict],
    ratios: list[dict],
    ceilings: dict[str, float],
    notes: list[str],
    results_dir: Path | None,
) -> Path:
    """Write the record so far (called after every family, so a run cut short keeps what it measured)."""
    from lightning_llmopt.kernels import quant_matmul_tune
    from lightning_llmopt.kernels.pdl import pdl_enabled

    # our kernels launch as programmatic dependents on Hopper (as in the engine's decode graphs): in a graph of
    # back-to-back calls each may be scheduled while the one before drains; LLMOPT_PDL=0 gives the record without
    pdl = torch.cuda.is_available() and pdl_enabled(torch.device("cuda"))
    notes = notes + [
        f"programmatic dependent launch of our kernels: {'on' if pdl else 'off'} (cuBLAS launches without it)",
        "speedups are cuBLAS bf16 time / our time measured the same way in the same process; graph_us: per-call GPU "
        "time from CUDA-graph replays over distinct weight copies (no L2 reuse, no Python dispatch); eager_us: "
        "triton.testing.do_bench median (L2 flushed), includes the Python dispatch of each call",
        "weights are random codes and scales (int4: random 32-bit words, group 128, bf16 scales; int8: per-channel)",
        "decode rows time the linear layers of a llama2-7b-shaped model only (no attention, norms or KV cache)",
        f"autotuned configs: {json.dumps({str(k): str(v) for k, v in quant_matmul_tune.TUNED.items()})}",
    ]
    goals = {f"{k[0]}@M{k[1]}": v for k, v in GOALS.items()}
    config = {
        "shapes": SHAPES,
        "batches": list(BATCHES),
        "dtype": "bfloat16",
        "copy_budget_mib": args.copy_budget_mib,
        "decode_model": LLAMA2_7B,
        "goals": goals,
        "pdl": pdl,
    }
    record = records.make_record(
        "quant-matmul" if pdl or not torch.cuda.is_available() else "quant-matmul-nopdl",
        config=config,
        results=results,
        peers=peers,
        benchmark="quant",
        ratio_metric=None,
        ceilings=ceilings,
        notes=notes,
    )
    record["ratios"] = ratios
    record["autotune_timings_ms"] = {
        str(k): {str(c): t for c, t in v.items()} for k, v in quant_matmul_tune.TIMINGS.items()
    }
    return records.write_record(record, results_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Quantized matmul vs cuBLAS bf16, and decode of the 7B linears.")
    parser.add_argument("--family", choices=("all", "check", "ceilings", "gemm", "decode"), default="all")
    parser.add_argument(
        "--copy-budget-mib",
        type=int,
        default=512,
        help="int4 weight bytes per timed graph (distinct copies defeat the L2 cache)",
    )
    parser.add_argument("--results-dir", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes, temp results dir")
    args = parser.parse_args(argv)
    if args.smoke:
        device = "cpu"
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel module is first imported (lazily)
        results_dir = args.results_dir or Path(tempfile.mkdtemp(prefix="llmopt-bench-"))
    else:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA GPU (use --smoke for a CPU check of the code path)")
        device, results_dir = "cuda", args.results_dir
    want = {"check", "ceilings", "gemm", "decode"} if args.family == "all" else {args.family}
    results: list[dict] = []
    peers: list[dict] = []
    ratios: list[dict] = []
    ceilings: dict[str, float] = {}
    notes: list[str] = []
    start = time.perf_counter()
    path = None
    for family in ("check", "ceilings", "gemm", "decode"):
        if family not in want or (family == "ceilings" and args.smoke):
            continue
        try:
            if family == "check":
                results += family_check(device, args.smoke)
            elif family == "ceilings":
                ceilings = family_ceilings(device, args.smoke)
            elif family == "gemm":
                r, p, q = family_gemm(device, args.smoke, args.copy_budget_mib * 2**20)
                results, peers, ratios = results + r, peers + p, ratios + q
            else:
                results += family_decode(device, args.smoke)
        except Exception:  # keep what the other families measured
            notes.append(f"{family} failed: {traceback.format_exc()[-2000:]}")
            print(notes[-1], flush=True)
        print(f"[{family} done at {time.perf_counter() - start:.0f} s]", flush=True)
        path = write(args, results, peers, ratios, ceilings, notes, results_dir)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
