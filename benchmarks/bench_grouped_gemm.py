"""Grouped-GEMM expert FFN (SwiGLU) on one GPU: our Triton grouped GEMM against a per-expert loop of cuBLAS matmuls,
``torch._grouped_mm`` where this torch has it, and a dense SwiGLU of equal active FLOPs (issue 6).

Tokens arrive sorted by expert with given counts (``balanced``: equal; ``skewed``: Zipf-like). One expert is a
SwiGLU ``w2(silu(w1 x) * w3 x)``. The dense peer runs every token through one SwiGLU ``top_k`` times as wide, which
does the same FLOPs with no routing. Forward and forward+backward, bf16, median of ``triton.testing.do_bench``.
Record: ``benchmarks/results/grouped-gemm-<device>.json``.

    python benchmarks/bench_grouped_gemm.py
    python benchmarks/bench_grouped_gemm.py --smoke     # CPU interpreter, tiny shapes: code path only
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package
import records  # noqa: E402

SHAPES = {  # name: (tokens, dim, expert hidden, experts, top_k)
    "mixtral-8x7b-layer": (8192, 4096, 14336, 8, 2),
    "deepseek-moe-16b-layer": (16384, 2048, 1408, 64, 6),
}


def _counts(total: int, experts: int, skew: bool) -> Any:
    import torch

    if not skew:
        base = torch.full((experts,), total // experts, dtype=torch.int64)
    else:
        w = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64)
        base = (w / w.sum() * total).floor().to(torch.int64)
    base[0] += total - int(base.sum())
    return base


def _bench(fn: Any, smoke: bool) -> float:
    import time

    if smoke:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton

    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def run_shape(name: str, shape: tuple[int, int, int, int, int], skew: bool, smoke: bool) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    from lightning_llmopt.kernels.grouped_gemm import grouped_mm

    tokens, dim, hidden, experts, k = shape
    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    m = tokens * k
    counts = _counts(m, experts, skew).to(device)
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*s: int, scale: float = 1.0) -> Any:
        return (torch.randn(*s, generator=g, device=device, dtype=torch.float32) * scale).to(dtype).requires_grad_()

    x = rnd(m, dim)
    w1, w3 = rnd(experts, hidden, dim, scale=dim**-0.5), rnd(experts, hidden, dim, scale=dim**-0.5)
    w2 = rnd(experts, dim, hidden, scale=hidden**-0.5)
    xd = rnd(tokens, dim)
    d1, d3 = rnd(hidden * k, dim, scale=dim**-0.5), rnd(hidden * k, dim, scale=dim**-0.5)
    d2 = rnd(dim, hidden * k, scale=hidden**-0.5)
    offs = torch.cumsum(counts, 0).to(torch.int32)

    def ours() -> Any:
        b = "triton"
        return grouped_mm(F.silu(grouped_mm(x, w1, counts, b)) * grouped_mm(x, w3, counts, b), w2, counts, b)

    def loop() -> Any:
        b = "reference"
        return grouped_mm(F.silu(grouped_mm(x, w1, counts, b)) * grouped_mm(x, w3, counts, b), w2, counts, b)

    def dense() -> Any:
        return F.linear(F.silu(F.linear(xd, d1)) * F.linear(xd, d3), d2)

    def torch_grouped() -> Any:
        def gm(a: Any, w: Any) -> Any:
            return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)

        return gm(F.silu(gm(x, w1)) * gm(x, w3), w2)

    variants = {"ours": ours, "per-expert-loop": loop, "dense-equal-flops": dense}
    if not smoke and hasattr(torch, "_grouped_mm"):
        variants["torch-grouped-mm"] = torch_grouped
    flops_fwd = 2 * m * dim * hidden * 3
    rows = []
    for variant, fn in variants.items():
        row: dict[str, Any] = {"variant": variant, "shape": name, "counts": "skewed" if skew else "balanced"}
        try:
            fwd = _bench(lambda fn=fn: fn(), smoke)

            def fwd_bwd(fn: Any = fn) -> None:
                out = fn()
                out.backward(torch.ones_like(out))

            both = _bench(fwd_bwd, smoke)
            row.update(
                fwd_ms=fwd, fwd_bwd_ms=both, fwd_tflops=flops_fwd / fwd / 1e9, fwd_bwd_tflops=3 * flops_fwd / both / 1e9
            )
        except Exception as err:  # noqa: BLE001 - recorded (e.g. torch._grouped_mm unsupported here)
            row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
        for t in (x, w1, w2, w3, xd, d1, d2, d3):
            t.grad = None
        rows.append(row)
        print(row, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--results-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    shapes = {"smoke": (24, 16, 32, 4, 2)} if args.smoke else SHAPES
    rows: list[dict[str, Any]] = []
    for name, shape in shapes.items():
        for skew in (False, True):
            rows += run_shape(name, shape, skew, args.smoke)
    ours = [r for r in rows if r["variant"] == "ours"]
    peers = [r for r in rows if r["variant"] != "ours"]
    ratios = []
    for o in ours:
        for p in peers:
            if (p["shape"], p["counts"]) == (o["shape"], o["counts"]) and "error" not in p and "error" not in o:
                for metric in ("fwd_ms", "fwd_bwd_ms"):
                    ratios.append(
                        {
                            "variant": f"ours/{o['shape']}/{o['counts']}",
                            "peer": p["variant"],
                            "metric": metric,
                            "ratio": p[metric] / o[metric],
                        }
                    )
    record = records.make_record(
        "grouped-gemm" if not args.smoke else "grouped-gemm-smoke",
        config={
            "shapes": {
                k: dict(zip(("tokens", "dim", "hidden", "experts", "top_k"), v, strict=True)) for k, v in shapes.items()
            },
            "dtype": "float32" if args.smoke else "bfloat16",
            "op": "expert SwiGLU: 3 grouped GEMMs + silu*mul",
        },
        results=ours,
        peers=peers,
        benchmark="moe",
        ratio_metric=None,
        notes=[
            "ratio = peer time / our time (above 1: ours faster)",
            "dense-equal-flops: one SwiGLU top_k times as wide over the unrouted tokens (same FLOPs)",
        ],
    )
    record["ratios"] = ratios
    for r in ratios:
        print(f"{r['variant']:>40} vs {r['peer']:>20} {r['metric']:>10}: {r['ratio']:.2f}x")
    path = records.write_record(record, args.results_dir or (Path("/tmp") if args.smoke else records.RESULTS_DIR))
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
