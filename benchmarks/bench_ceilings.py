"""The two single-GPU ceilings every other figure is reported against.

- bf16 GEMM, M=N=K=8192, ``torch.matmul`` (cuBLAS): TFLOP/s = 2·M·N·K / time.
- Device-to-device copy of a large buffer (4 GiB by default): bandwidth = (bytes read + bytes written) / time.

Inputs are random (never zeros: some hardware and libraries take shortcuts on zeros). Timing: median of
``triton.testing.do_bench`` (warm-up excluded). Writes ``benchmarks/results/ceilings-<device>.json``.

    python benchmarks/bench_ceilings.py            # GPU
    python benchmarks/bench_ceilings.py --smoke    # CPU: small sizes, checks the code path only
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package
import records  # noqa: E402

# Published H100/H200 SXM figures (benchmarks/../shared anchors); context only, never a measurement.
DATASHEET = {
    "h100": {"datasheet_bf16_dense_tflops": 989.0, "datasheet_hbm_tb_per_s": 3.35},
    "h200": {"datasheet_bf16_dense_tflops": 989.0, "datasheet_hbm_tb_per_s": 4.8},
}


def datasheet_for(device_name: str) -> dict[str, float]:
    name = device_name.lower()
    return next((figures for key, figures in DATASHEET.items() if key in name), {})


def gemm_tflops(n: int, dtype: torch.dtype, device: str, repeats: int = 50) -> dict[str, float]:
    """Median time and TFLOP/s of one (n, n) @ (n, n) matmul on random inputs."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    median_ms = records.timeit_median(lambda: torch.matmul(a, b), warmup=10, repeats=repeats)
    return {"median_ms": median_ms, "tflops": 2 * n**3 / (median_ms * 1e-3) / 1e12}


def copy_bandwidth(nbytes: int, device: str, repeats: int = 20) -> dict[str, float]:
    """Median time of ``dst.copy_(src)`` over ``nbytes`` of random fp32 data; bandwidth counts read + write."""
    numel = nbytes // 4
    g = torch.Generator(device=device).manual_seed(1)
    src = torch.rand(numel, device=device, dtype=torch.float32, generator=g).add_(0.5)  # in [0.5, 1.5): no zeros
    dst = torch.empty_like(src)
    median_ms = records.timeit_median(lambda: dst.copy_(src), warmup=5, repeats=repeats)
    if not torch.equal(dst[:1024], src[:1024]):
        raise RuntimeError("copy produced wrong data")
    moved = 2 * numel * 4
    return {"median_ms": median_ms, "bytes_moved": moved, "tb_per_s": moved / (median_ms * 1e-3) / 1e12}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Measure the bf16 GEMM and copy-bandwidth ceilings.")
    parser.add_argument("--gemm-size", type=int, default=8192)
    parser.add_argument("--copy-gib", type=float, default=4.0)
    parser.add_argument("--results-dir", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, record in a temp dir")
    args = parser.parse_args(argv)

    if args.smoke:
        device, dtype, n, nbytes = "cpu", torch.float32, 256, 16 * 2**20
        results_dir = args.results_dir or Path(tempfile.mkdtemp(prefix="llmopt-bench-"))
    else:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA GPU (use --smoke for a CPU check of the code path)")
        device, dtype, n, nbytes = "cuda", torch.bfloat16, args.gemm_size, int(args.copy_gib * 2**30)
        results_dir = args.results_dir

    gemm = gemm_tflops(n, dtype, device)
    copy = copy_bandwidth(nbytes, device)
    env = records.environment()
    results = [
        {"variant": f"gemm-{str(dtype).removeprefix('torch.')}-{n}", **gemm},
        {"variant": f"copy-{nbytes / 2**30:g}GiB", **copy},
    ]
    record = records.make_record(
        "ceilings",
        config={"gemm_mnk": [n, n, n], "gemm_dtype": str(dtype), "copy_bytes": nbytes, "device": device},
        results=results,
        ratio_metric=None,
        ceilings={"bf16_gemm_tflops": gemm["tflops"], "copy_tb_per_s": copy["tb_per_s"]},
        reference=datasheet_for(env["device"]),
        env=env,
        notes=["torch.matmul (cuBLAS) on random inputs; copy bandwidth counts bytes read + bytes written"],
    )
    path = records.write_record(record, results_dir)
    print(
        f"{env['device']}: GEMM {n}^3 {dtype}: {gemm['tflops']:.1f} TFLOP/s ({gemm['median_ms']:.3f} ms); "
        f"copy {nbytes / 2**30:g} GiB: {copy['tb_per_s']:.3f} TB/s ({copy['median_ms']:.3f} ms)"
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
