"""Host cost of one pipeline stage's forward + backward (diagnostic, one GPU, no record).

The pipeline records (bench_pipeline.py) showed a stage taking 2.4x its kernel time when run alone, so the schedules
were bounded by the host, not by the bubble. This script runs the same work without any pipeline: a ``--preset``
model cut to ``--layers`` layers, ``--microbatches`` forward + backward passes of ``rows x seq`` tokens under one bf16
autocast context, and prints for each ``--rows``: wall time, kernel time (union of kernel intervals), and under
``torch.profiler`` the operators with the most host time and the number of host-blocking CUDA calls.

    python benchmarks/profile_stage.py --preset 1b --layers 11 --seq-len 2048 --rows 1 2 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import launch  # noqa: E402

BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def _step(model: torch.nn.Module, cfg: Any, rows: int, seq: int, m: int, device: torch.device) -> None:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        for _ in range(m):
            x = torch.randint(0, cfg.vocab_size, (rows, seq), device=device)
            labels = torch.randint(0, cfg.vocab_size, (rows * seq,), device=device)
            out = model(x)
            F.cross_entropy(out.float().flatten(0, 1), labels).backward()


def main() -> None:
    from lightning_llmopt.models import Llama, LlamaConfig

    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="1b")
    p.add_argument("--layers", type=int, default=11)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--attn-backend", default=None)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    device = torch.device("cuda")
    over = {"n_layers": args.layers, "max_seq_len": args.seq_len}
    if args.attn_backend:
        over["attn_backend"] = args.attn_backend
    cfg = LlamaConfig.from_preset(args.preset, **over)
    model = Llama(cfg).to(device)
    print(f"config: {cfg}")
    for rows in args.rows:
        for _ in range(2):
            _step(model, cfg, rows, args.seq_len, args.microbatches, device)
            model.zero_grad(set_to_none=True)
        walls = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            _step(model, cfg, rows, args.seq_len, args.microbatches, device)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            _step(model, cfg, rows, args.seq_len, args.microbatches, device)
            torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        busy = launch.device_intervals(prof, exclude=("nccl",))[1] / 1e6
        wall = statistics.median(walls)
        print(
            f"\n=== rows {rows} x seq {args.seq_len} x M {args.microbatches}: wall {wall * 1e3:.1f} ms, kernels "
            f"{busy * 1e3:.1f} ms, kernels/wall {busy / wall:.2f}"
        )
        events = prof.key_averages()
        blocking = {e.key: e.count for e in events if any(e.key.startswith(b) for b in BLOCKING)}
        print(f"host-blocking CUDA calls: {blocking}")
        kinds = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")
        launches = sum(e.count for e in events if e.key in kinds)
        print(f"kernel launches: {launches}")
        by_scope = sorted(launch.idle_by_host_scope(prof).items(), key=lambda kv: -kv[1][0])[:10]
        print("device idle by host scope: " + "; ".join(f"{n[:50]} {t / 1e3:.1f} ms ({c})" for n, (t, c) in by_scope))
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))


if __name__ == "__main__":
    main()
