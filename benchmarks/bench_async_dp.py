"""Asynchronous data parallelism over a throttled interconnect: tokens/s and loss after N steps against BSP.

On one host with N GPUs (default 4), for one preset (default ``125m``), ``bf16-mixed``, random tokens (fixed seed),
each variant is trained in its OWN ``torchrun --standalone --nproc-per-node=N`` launch:

- peer: ``bsp`` (``AsyncDataParallelStrategy("bsp", zero_stage=0)``: gradients averaged every step, the
  communication pattern of DDP through our flat-bucket all-reduce);
- ours: ``local_sgd`` (parameters averaged every ``--sync-every`` steps), ``diloco`` (the same with the outer
  Nesterov step, lr 0.7, momentum 0.9), ``ssp`` (bounded staleness ``--staleness``).

The interconnect is throttled by an injected delay on every ``torch.distributed.all_reduce`` made from Python (ours
and BSP's gradient all-reduce): ``--allreduce-latency-ms + bytes / --link-gbps``. A blocking all-reduce sleeps that
long on the host after it was issued; a non-blocking one (SSP) completes no earlier than that long after it was
issued (its ``wait`` sleeps for the rest), so SSP can hide it behind ``s`` steps of compute. This models a slow link
seen from the host; it is not a network emulator (GPU kernels already queued keep running during the sleep).

Per variant: median step time over the timed steps (max over ranks), tokens/s, the mean training loss of the last
5 steps over ranks, and the evaluation loss of the final model (the replicas are equal after ``fit``) on 8 held-out
rows. One record ``benchmarks/results/async-dp-<preset>-<N>gpu-<device>.json``; ratios against ``bsp`` for
``tokens_per_s`` and ``eval_loss`` (ratio > 1: ours better).

    python benchmarks/bench_async_dp.py                         # 4 GPUs, 125m, seq 1024, 1 ms + 10 Gbit/s
    python benchmarks/bench_async_dp.py --link-gbps 1 --sync-every 16 --steps 200
    python benchmarks/bench_async_dp.py --smoke                 # CPU, gloo, 2 ranks, tiny, seq 64, 4 steps

No GPU figures exist yet for this benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package
import launch  # noqa: E402
import records  # noqa: E402

from lightning_llmopt.testing.data import RandomTokens  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("bsp", "local_sgd", "diloco", "ssp")
OURS = ("local_sgd", "diloco", "ssp")
EVAL_ROWS = 8


# --------------------------------------------------------------------------- the throttle


class _DelayedWork:
    """A non-blocking collective that completes no earlier than ``ready_at`` (``time.monotonic()``)."""

    def __init__(self, work: Any, ready_at: float) -> None:
        self.work, self.ready_at = work, ready_at

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(max(0.0, self.ready_at - time.monotonic()))
        return self.work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return time.monotonic() >= self.ready_at and self.work.is_completed()


def throttle_all_reduce(latency_s: float, bytes_per_s: float) -> Any:
    """Replace ``torch.distributed.all_reduce`` with a delayed one; returns the original (to restore it)."""
    import torch.distributed as dist

    original = dist.all_reduce

    def all_reduce(tensor: Any, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
        delay = latency_s + tensor.numel() * tensor.element_size() / bytes_per_s
        start = time.monotonic()
        work = original(tensor, op=op, group=group, async_op=async_op)
        if async_op:
            return _DelayedWork(work, start + delay)
        time.sleep(delay)
        return work

    dist.all_reduce = all_reduce  # type: ignore[assignment]
    return original


# --------------------------------------------------------------------------- worker (one rank of one variant)


def _strategy(args: argparse.Namespace) -> Any:
    from lightning_llmopt.strategies import AsyncDataParallelStrategy

    kwargs: dict[str, Any] = {
        "bsp": {"data_parallel_sync": "bsp", "zero_stage": 0},
        "local_sgd": {"data_parallel_sync": "local_sgd", "sync_every": args.sync_every},
        "diloco": {"data_parallel_sync": "local_sgd", "sync_every": args.sync_every, "outer_optimizer": "nesterov"},
        "ssp": {"data_parallel_sync": "ssp", "staleness": args.staleness},
    }[args.strategy]
    return AsyncDataParallelStrategy(**kwargs)


def _eval_loss(module: Any, vocab: int, seq_len: int) -> float:
    import torch

    rows = RandomTokens(vocab, seq_len, EVAL_ROWS, seed=987_654)
    batch = {k: torch.stack([rows[i][k] for i in range(EVAL_ROWS)]).to(module.device) for k in ("input_ids", "labels")}
    module.eval()
    with (
        torch.no_grad(),
        torch.autocast(module.device.type, dtype=torch.bfloat16, enabled=module.device.type == "cuda"),
    ):
        return float(module.train_loss(batch).float())


def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch
    import torch.distributed as dist

    from lightning_llmopt import CausalLMModule

    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        raise SystemExit("bench_async_dp needs CUDA GPUs (use --smoke for a CPU check of the code path)")
    world = int(os.environ["WORLD_SIZE"])
    L.seed_everything(0, verbose=False)
    throttle_all_reduce(args.allreduce_latency_ms / 1e3, args.link_gbps * 1e9 / 8)
    total = args.warmup_steps + args.steps
    module = CausalLMModule(args.preset, warmup_steps=2, max_steps=total, learning_rate=args.lr)
    rows = RandomTokens(module.config.vocab_size, args.seq_len, total * args.micro_batch * world, seed=1234)
    loader = torch.utils.data.DataLoader(rows, batch_size=args.micro_batch, shuffle=False)
    measure = launch.measure_callback(args.warmup_steps, cuda)
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=world,
        strategy=_strategy(args),
        precision=args.precision,
        max_steps=total,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[measure],
    )
    trainer.fit(module, train_dataloaders=loader)
    s = measure.summary
    step_s = statistics.median(s["step_s"])
    last = torch.tensor(s["losses"][-5:], dtype=torch.float64).mean().reshape(1)
    dist.all_reduce(last)
    return {
        "variant": args.strategy,
        "median_step_ms": step_s * 1e3,
        "tokens_per_s": world * args.micro_batch * args.seq_len / step_s,
        "train_loss_last5": float(last) / world,
        "eval_loss": _eval_loss(module, module.config.vocab_size, args.seq_len),
        "timed_steps": len(s["step_s"]),
        **({"peak_allocated_gib": max(s["allocated"]) / 2**30} if cuda else {}),
    }


# --------------------------------------------------------------------------- driver (one launch per variant)


def _worker_args(args: argparse.Namespace, variant: str) -> Any:
    def build(out: Path) -> list[str]:
        flags = ["--worker", "--strategy", variant, "--json-out", str(out)]
        for name in (
            "preset",
            "seq_len",
            "micro_batch",
            "precision",
            "warmup_steps",
            "steps",
            "lr",
            "sync_every",
            "staleness",
            "allreduce_latency_ms",
            "link_gbps",
        ):
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        return flags + (["--smoke"] if args.smoke else [])

    return build


def _config(args: argparse.Namespace, nproc: int) -> dict[str, Any]:
    keys = (
        "preset",
        "seq_len",
        "micro_batch",
        "precision",
        "warmup_steps",
        "steps",
        "lr",
        "sync_every",
        "staleness",
        "allreduce_latency_ms",
        "link_gbps",
    )
    return {"nproc": nproc, "eval_rows": EVAL_ROWS, **{k: getattr(args, k) for k in keys}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="BSP vs local SGD / DiLoCo / SSP over a throttled all-reduce.")
    parser.add_argument("--nproc", type=int, default=None, help="processes/GPUs (default 4; 2 with --smoke)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--preset", default=None, help="model preset (default 125m; tiny with --smoke)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 1024; 64 with --smoke)")
    parser.add_argument("--micro-batch", type=int, default=None, help="rows per rank per step (default 8; 2 smoke)")
    parser.add_argument("--precision", default=None, help="default bf16-mixed (32-true with --smoke)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="untimed steps (default 5; 1 with --smoke)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps N (default 100; 4 with --smoke)")
    parser.add_argument("--lr", type=float, default=3e-4, help="inner AdamW peak rate")
    parser.add_argument("--sync-every", type=int, default=None, help="local_sgd/diloco: H (default 8; 2 with --smoke)")
    parser.add_argument("--staleness", type=int, default=1, help="ssp: s")
    parser.add_argument("--allreduce-latency-ms", type=float, default=1.0, help="injected delay per all-reduce")
    parser.add_argument("--link-gbps", type=float, default=10.0, help="injected bandwidth (Gbit/s) per all-reduce")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per variant launch")
    parser.add_argument("--results-dir", type=Path, default=None, help="default benchmarks/results (temp w/ smoke)")
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, 2 ranks, tiny preset: code path only")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    smoke = args.smoke
    args.preset = args.preset or ("tiny" if smoke else "125m")
    args.seq_len = args.seq_len or (64 if smoke else 1024)
    args.micro_batch = args.micro_batch or (2 if smoke else 8)
    args.precision = args.precision or ("32-true" if smoke else "bf16-mixed")
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (1 if smoke else 5)
    args.steps = args.steps if args.steps is not None else (4 if smoke else 100)
    args.sync_every = args.sync_every or (2 if smoke else 8)
    if args.worker:
        return launch.worker_main(run_worker, args)

    import torch

    cuda = torch.cuda.is_available() and not smoke
    if not smoke and not cuda:
        raise SystemExit("bench_async_dp needs CUDA GPUs (use --smoke for a CPU check of the code path)")
    nproc = args.nproc or (2 if smoke else 4)
    results_dir = args.results_dir or (
        Path(tempfile.mkdtemp(prefix="llmopt-bench-")) if smoke else REPO_ROOT / "benchmarks" / "results"
    )
    log_dir = Path(tempfile.mkdtemp(prefix="llmopt-async-dp-logs-"))
    rows = {}
    for variant in args.variants:
        log = log_dir / f"async-dp-{variant}-{nproc}.log"
        rows[variant] = launch.launch(__file__, _worker_args(args, variant), variant, nproc, log, args.timeout)
    ours = [rows[v] for v in args.variants if v in OURS]
    peers = [rows[v] for v in args.variants if v not in OURS]
    name = f"async-dp-{args.preset}-{nproc}{'gpu' if cuda else 'cpu'}"
    notes = [f"throttle: {args.allreduce_latency_ms} ms + bytes / {args.link_gbps} Gbit/s per Python all_reduce"]
    record = records.make_record(
        name, _config(args, nproc), ours, peers, benchmark="async_dp", ratio_metric="tokens_per_s", notes=notes
    )
    record["ratios"] += records.compute_ratios(ours, peers, "eval_loss")
    path = records.write_record(record, results_dir)
    for row in [*peers, *ours]:
        print(
            json.dumps(
                {
                    k: row.get(k)
                    for k in ("variant", "tokens_per_s", "train_loss_last5", "eval_loss", "median_step_ms", "error")
                }
            )
        )
    print(f"record: {path}")
    return 0 if all("error" not in r for r in rows.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
