"""Pipeline schedules on one multi-GPU host (issue 5): tokens/s per schedule and the measured bubble against theory.

Launched once per world size with torchrun (one process per GPU); every schedule runs in that process group in turn
(framework-free :class:`~lightning_llmopt.parallel.pipeline.PipelineRunner`, bf16 autocast, random tokens):

- step time: median over ``--steps`` after ``--warmup`` (``torch.cuda.synchronize`` + barrier around each step);
- busy time: each rank runs its own stage modules' forward + backward for the ``M`` micro-batches with no pipeline
  (inputs made locally), median over repeats; measured bubble = ``1 - busy / step`` (mean over ranks);
- theory: :func:`~lightning_llmopt.parallel.pipeline_plan.plan` (closed form for GPipe/1F1B/interleaved, the unit-cost
  simulation for zero-bubble schedules).

    torchrun --standalone --nproc-per-node=4 benchmarks/bench_pipeline.py --preset 1b --microbatches 8 16
    torchrun --standalone --nproc-per-node=4 benchmarks/bench_pipeline.py --preset llama3-8b --layers 16
    python benchmarks/bench_pipeline.py --smoke        # CPU, gloo, 2 processes, tiny model, no record written

Record: ``benchmarks/results/pipeline-<preset>[-<layers>l]-<N>gpu-<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package
import records  # noqa: E402

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2), ("zbv", 2), ("dualpipev", 2)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def run_schedule(args: argparse.Namespace, name: str, v: int, m: int, device: torch.device) -> dict[str, Any]:
    from lightning_llmopt.models import Llama, LlamaConfig
    from lightning_llmopt.parallel.pipeline import (
        PipelineConfig,
        PipelineRunner,
        prune_to_stages,
        stage_modules,
        validate_pipeline,
    )
    from lightning_llmopt.parallel.pipeline_plan import plan

    pp, rank = dist.get_world_size(), dist.get_rank()
    overrides = {"max_seq_len": max(args.seq_len, 256), **({"n_layers": args.layers} if args.layers else {})}
    cfg = LlamaConfig.from_preset(args.preset, **overrides)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(cfg)
    config = PipelineConfig(pp=pp, schedule=name, microbatches=m, virtual_stages=v)
    split = validate_pipeline(model, config, seq_len=args.seq_len)
    prune_to_stages(model, split, rank)
    model.to_empty(device=device)
    model.init_weights()
    modules = stage_modules(model, split, rank)
    runner = PipelineRunner(modules, split, config, dist.group.WORLD, device)
    rows = args.rows_per_microbatch * m
    tokens = torch.randint(0, cfg.vocab_size, (rows, args.seq_len + 1), device=device)
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    def loss_fn(out: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.float().flatten(0, 1), batch["labels"][idx].flatten())

    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    times = []
    for i in range(args.warmup + args.steps):
        _sync(device)
        t0 = time.perf_counter()
        with autocast:
            runner.train_step(batch, loss_fn)
        _sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    step = statistics.median(times)
    busy = _busy_time(args, modules, split, cfg, m, device, autocast)
    measured = torch.tensor([1.0 - busy / step], device=device)
    dist.all_reduce(measured)
    theory = plan(name, pp, m, v)
    return {
        "schedule": name,
        "virtual_stages": v,
        "microbatches": m,
        "step_s": step,
        "tokens_per_s": rows * args.seq_len / step,
        "measured_bubble": float(measured) / pp,
        "theory_bubble": theory.theory if theory.theory is not None else theory.bubble,
    }


def _busy_time(
    args: argparse.Namespace,
    modules: dict[int, torch.nn.Module],
    split: Any,
    cfg: Any,
    m: int,
    device: torch.device,
    autocast: Any,
) -> float:
    """This rank's compute for one step without the pipeline: forward + backward of each local stage, M times."""
    mb = args.rows_per_microbatch
    reps = []
    for _ in range(max(args.steps // 2, 1)):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(m):
            for s, mod in modules.items():
                if s == 0:
                    x: torch.Tensor = torch.randint(0, cfg.vocab_size, (mb, args.seq_len), device=device)
                else:
                    x = torch.randn(mb, args.seq_len, cfg.dim, device=device, requires_grad=True)
                with autocast:
                    out = mod(x)
                out.float().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        reps.append(time.perf_counter() - t0)
        for mod in modules.values():
            mod.zero_grad(set_to_none=True)
    return statistics.median(reps)


def worker(args: argparse.Namespace) -> None:
    cuda = torch.cuda.is_available() and not args.smoke
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    results = []
    for m in args.microbatches:
        for name, v in SCHEDULES:
            try:
                results.append(run_schedule(args, name, v, m, device))
            except (ValueError, NotImplementedError) as exc:
                results.append({"schedule": name, "microbatches": m, "skipped": str(exc)})
    if dist.get_rank() == 0:
        for r in results:
            print(json.dumps(r))
        if not args.smoke:
            env = records.environment()
            preset_name = f"{args.preset}-{args.layers}l" if args.layers else args.preset  # one record per depth
            record = {
                "benchmark": "pipeline",
                "preset": args.preset,
                "layers": args.layers,
                "world_size": dist.get_world_size(),
                "seq_len": args.seq_len,
                "rows_per_microbatch": args.rows_per_microbatch,
                "date": time.strftime("%Y-%m-%d"),
                "environment": env,
                "results": results,
            }
            out = (
                Path(__file__).parent
                / "results"
                / (f"pipeline-{preset_name}-{dist.get_world_size()}gpu-{env['device_slug']}.json")
            )
            out.write_text(json.dumps(record, indent=2))
            print(f"wrote {out}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--layers", type=int, default=0, help="override the preset's block count (0: keep)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rows-per-microbatch", type=int, default=1)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="CPU, 2 gloo processes, tiny model, a few steps")
    args = parser.parse_args()
    if args.smoke and "RANK" not in os.environ:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            __file__,
            "--smoke",
            "--preset",
            "tiny",
            "--layers",
            "4",
            "--seq-len",
            "32",
            "--microbatches",
            "4",
            "--warmup",
            "1",
            "--steps",
            "2",
        ]
        raise SystemExit(subprocess.call(cmd))
    worker(args)


if __name__ == "__main__":
    main()
