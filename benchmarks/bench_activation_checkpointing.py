"""Activation checkpointing policies on one GPU: peak memory and step time against no checkpointing.

For each policy (``none full every_n sqrt selective``), in its own process: build the preset (default ``1b``) on the
GPU, apply :func:`lightning_llmopt.parallel.activation_checkpointing.apply_activation_checkpointing`, measure the
bytes kept for backward by one forward (``activation_memory``), then time training steps (forward under
``torch.autocast(bfloat16)`` with fp32 weights, i.e. bf16-mixed, fp32 cross-entropy, backward, fused AdamW step):
median step time over the steps after warm-up, ``torch.cuda.max_memory_allocated`` over the training steps (peak
reset after the measurement). The no-checkpointing run is the peer; ratios above 1 mean the policy is better (less
memory, or, for time, faster: checkpointing always costs time, so those ratios are below 1).

    python benchmarks/bench_activation_checkpointing.py                 # 1b, seq 4096, micro-batch 4
    python benchmarks/bench_activation_checkpointing.py --micro-batch 2 --policies none full
    python benchmarks/bench_activation_checkpointing.py --smoke         # CPU, tiny preset, seconds

One record: ``benchmarks/results/ac-<preset>-<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package
import records  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
POLICIES = ("none", "full", "every_n", "sqrt", "selective")
OOM_EXIT_CODE = 3




# --------------------------------------------------------------------------- worker: one policy in this process


def run_policy(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from lightning_llmopt.models import Llama, LlamaConfig
    from lightning_llmopt.parallel.activation_checkpointing import (
        activation_memory,
        apply_activation_checkpointing,
        recompute_overhead,
    )

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        raise SystemExit("bench_activation_checkpointing needs a CUDA GPU (use --smoke for the CPU code path)")
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    torch.set_float32_matmul_precision("high")
    config = LlamaConfig.from_preset(args.preset, max_seq_len=max(args.seq_len, 1))
    with torch.device("meta"):
        model = Llama(config)
    model.to_empty(device=device)
    model.init_weights()
    blocks = apply_activation_checkpointing(model, args.worker, every_n=args.every_n)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    ids = torch.randint(0, config.vocab_size, (args.micro_batch, args.seq_len + 1), device=device)
    inputs, labels = ids[:, :-1], ids[:, 1:]  # (B, T), (B, T)
    dtype = torch.bfloat16 if cuda else torch.float32

    def forward() -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype, enabled=cuda):
            return model(inputs)

    saved_bytes = activation_memory(model, forward)
    if cuda:
        torch.cuda.reset_peak_memory_stats()  # the peak below is the training steps'

    def step() -> None:
        logits = forward()  # (B, T, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = []
    for i in range(args.warmup_steps + args.steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup_steps:
            times.append(time.perf_counter() - start)
    tokens = args.micro_batch * args.seq_len
    step_s = statistics.median(times)
    row: dict[str, Any] = {
        "variant": args.worker,
        "checkpointed_blocks": len(blocks),
        "median_step_ms": step_s * 1e3,
        "tokens_per_s": tokens / step_s,
        "model_tflops": model.flops_per_token(args.seq_len) * tokens / step_s / 1e12,
        "recompute_overhead_flops": recompute_overhead(model, args.seq_len),
        "saved_activation_gib": saved_bytes / 2**30,
        "timed_steps": len(times),
    }
    if cuda:
        row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return row


def _worker_main(args: argparse.Namespace) -> int:
    import torch

    try:
        row = run_policy(args)
    except torch.OutOfMemoryError as err:
        print(f"[{args.worker}] out of memory: {err}", file=sys.stderr)
        return OOM_EXIT_CODE
    Path(args.json_out).write_text(json.dumps(row))
    return 0


# --------------------------------------------------------------------------- driver: one process per policy


def _run_one(args: argparse.Namespace, policy: str) -> dict[str, Any] | None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", policy, "--json-out", str(out),
               "--preset", args.preset, "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
               "--every-n", str(args.every_n), "--warmup-steps", str(args.warmup_steps), "--steps", str(args.steps)]
        cmd += ["--smoke"] if args.smoke else []
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        try:
            proc = subprocess.run(cmd, env=env, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"[{policy}] timed out after {args.timeout} s", file=sys.stderr)
            return None
        if proc.returncode == OOM_EXIT_CODE:
            return {"variant": policy, "oom": True}
        return json.loads(out.read_text()) if proc.returncode == 0 and out.exists() else None


def _print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'policy':>10} {'blocks':>6} {'step ms':>9} {'vs none':>8} {'peak GiB':>9} {'saved GiB':>9} "
            f"{'recompute':>9} {'TFLOP/s':>8}")
    print(head)
    print("-" * len(head))
    base = next((r for r in rows if r["variant"] == "none" and "median_step_ms" in r), None)
    for r in rows:
        if "median_step_ms" not in r:
            print(f"{r['variant']:>10} {'out of memory' if r.get('oom') else 'failed':>20}")
            continue
        slow = r["median_step_ms"] / base["median_step_ms"] if base else float("nan")
        print(f"{r['variant']:>10} {r['checkpointed_blocks']:>6} {r['median_step_ms']:>9.1f} {slow:>7.2f}x "
              f"{r.get('peak_allocated_gib', float('nan')):>9.2f} {r['saved_activation_gib']:>9.3f} "
              f"{r['recompute_overhead_flops']:>9.1%} {r['model_tflops']:>8.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Activation checkpointing policies: peak memory and step time.")
    parser.add_argument("--policies", nargs="*", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--preset", default=None, help="model preset (default 1b; tiny with --smoke)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 4096; 64 with --smoke)")
    parser.add_argument("--micro-batch", type=int, default=None, help="rows per step (default 4; 2 with --smoke)")
    parser.add_argument("--every-n", type=int, default=2, help="stride of the every_n policy")
    parser.add_argument("--warmup-steps", type=int, default=None, help="untimed steps (default 3; 1 with --smoke)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10; 2 with --smoke)")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per policy process")
    parser.add_argument("--results-dir", type=Path, default=None, help="default benchmarks/results (temp w/ smoke)")
    parser.add_argument("--smoke", action="store_true", help="CPU, fp32, tiny preset: checks the code path only")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.preset = args.preset or ("tiny" if args.smoke else "1b")
    args.seq_len = args.seq_len or (64 if args.smoke else 4096)
    args.micro_batch = args.micro_batch or (2 if args.smoke else 4)
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (1 if args.smoke else 3)
    args.steps = args.steps if args.steps is not None else (2 if args.smoke else 10)
    if args.worker is not None:
        return _worker_main(args)

    rows = []
    for policy in args.policies:
        print(f"[{policy}] {args.preset}, micro-batch {args.micro_batch}, seq {args.seq_len}", flush=True)
        row = _run_one(args, policy)
        rows.append(row or {"variant": policy, "failed": True})
    _print_table(rows)
    measured = [r for r in rows if "median_step_ms" in r]
    peers = [r for r in measured if r["variant"] == "none"]
    results = [r for r in measured if r["variant"] != "none"]
    config = {"preset": args.preset, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
              "every_n": args.every_n, "warmup_steps": args.warmup_steps, "timed_steps": args.steps,
              "precision": "fp32" if args.smoke else "bf16 autocast, fp32 weights", "optimizer": "AdamW"}
    notes = ["one process per policy; peak memory over the training steps, including weights and AdamW state",
             "saved_activation_gib: bytes kept for backward by one forward (activation_memory)"]
    notes += [f"{r['variant']}: {'out of memory' if r.get('oom') else 'failed'}" for r in rows if r not in measured]
    record = records.make_record(f"ac-{args.preset}", config, results, peers, benchmark="ac",
                                 ratio_metric="median_step_ms", notes=notes)
    for metric in ("peak_allocated_gib", "saved_activation_gib"):
        record["ratios"] += records.compute_ratios(results, peers, metric)
    directory = args.results_dir or (Path(tempfile.mkdtemp(prefix="llmopt-bench-")) if args.smoke else None)
    print(f"record: {records.write_record(record, directory)}")
    return 0 if len(measured) == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
