"""Pipeline schedules on one multi-GPU host (issue 5): tokens/s per schedule and the measured bubble against theory.

Launched once per world size with torchrun (one process per GPU); every schedule runs in that process group in turn
(framework-free :class:`~lightning_llmopt.parallel.pipeline.PipelineRunner`, bf16 autocast, random tokens):

- step time: median over ``--steps`` after ``--warmup`` (``torch.cuda.synchronize`` + barrier around each step);
- busy time: on GPU, one more step under ``torch.profiler``: the union of the rank's kernel intervals, NCCL kernels
  excluded (a waiting send/recv is bubble); on CPU (and as ``busy_alone_s_per_rank``), the rank's own stage
  modules' forward + backward for the ``M`` micro-batches with no pipeline; measured bubble = ``1 - busy / step``
  (mean over ranks);
- theory: :func:`~lightning_llmopt.parallel.pipeline_plan.plan` (closed form for GPipe/1F1B/interleaved, the unit-cost
  simulation for zero-bubble schedules).

    torchrun --standalone --nproc-per-node=4 benchmarks/bench_pipeline.py --preset 1b --microbatches 8 16
    torchrun --standalone --nproc-per-node=4 benchmarks/bench_pipeline.py --preset llama3-8b --layers 16
    python benchmarks/bench_pipeline.py --smoke        # CPU, gloo, 2 processes, tiny model, no record written

Record: ``benchmarks/results/pipeline-<preset>[-<layers>l]-<N>gpu-<device>.json`` (``records`` format).
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
import launch  # noqa: E402
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
    overrides: dict[str, Any] = {
        "max_seq_len": max(args.seq_len, 256),
        **({"n_layers": args.layers} if args.layers else {}),
    }
    if args.fused_kernels:
        overrides["fused_kernels"] = args.fused_kernels
    if args.attn_backend:
        overrides["attn_backend"] = args.attn_backend
    cfg = LlamaConfig.from_preset(args.preset, **overrides)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(cfg)
    config = PipelineConfig(pp=pp, schedule=name, microbatches=m, virtual_stages=v, split_backward=args.split_backward)
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
    alone = _busy_time(args, modules, split, cfg, m, device, autocast)
    kernels = _kernel_busy_time(runner, batch, loss_fn, model, device, autocast)
    busy = kernels if kernels is not None else alone
    busy_all = [torch.zeros(2, device=device) for _ in range(pp)]
    dist.all_gather(busy_all, torch.tensor([busy, alone], device=device))
    busies = [float(b[0]) for b in busy_all]
    theory = plan(name, pp, m, v)
    return {
        "variant": f"{name}-m{m}",
        "schedule": name,
        "virtual_stages": v,
        "microbatches": m,
        "step_s": step,
        "tokens_per_s": rows * args.seq_len / step,
        "busy_s_per_rank": busies,
        "busy_method": "kernels" if kernels is not None else "alone",
        "busy_alone_s_per_rank": [float(b[1]) for b in busy_all],
        # mean over ranks of 1 - busy/step (the idle share of the step), and against the busiest rank (stage
        # imbalance excluded: the part of the step that even the critical rank spends waiting)
        "measured_bubble": statistics.fmean(1.0 - b / step for b in busies),
        "measured_bubble_busiest": 1.0 - max(busies) / step,
        # against the stage run alone (the work time the theory's unit cost stands for when the host, not the GPU,
        # bounds a stage): mean over ranks, and the slowest rank
        "measured_bubble_alone": statistics.fmean(1.0 - float(b[1]) / step for b in busy_all),
        "measured_bubble_alone_busiest": 1.0 - max(float(b[1]) for b in busy_all) / step,
        "theory_bubble": theory.theory if theory.theory is not None else theory.bubble,
    }


def _kernel_busy_time(
    runner: Any,
    batch: dict[str, torch.Tensor],
    loss_fn: Any,
    model: torch.nn.Module,
    device: torch.device,
    autocast: Any,
) -> float | None:
    """Seconds this rank's GPU spent computing during one pipeline step: one more step under ``torch.profiler``,
    the union of its kernel and copy intervals on all streams, NCCL kernels left out (a send/recv kernel spins
    while it waits for the peer stage: that is bubble, not work). ``None`` on the CPU."""
    if device.type != "cuda":
        return None
    _sync(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        with autocast:
            runner.train_step(batch, loss_fn)
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    return launch.device_intervals(prof, exclude=("nccl",))[1] / 1e6


def _busy_time(
    args: argparse.Namespace,
    modules: dict[int, torch.nn.Module],
    split: Any,
    cfg: Any,
    m: int,
    device: torch.device,
    autocast: Any,
) -> float:
    """This rank's compute for one step without the pipeline: forward + backward of each local stage, M times, under
    ONE autocast context like ``train_step`` (autocast caches the bf16 weight casts for the whole context; entering
    it per micro-batch recasts them each time and inflated the busy time past the step time), with the pipeline's
    cross-entropy on the last stage's logits."""
    mb = args.rows_per_microbatch
    last = split.num_stages - 1
    reps = []
    for _ in range(max(args.steps, 3) + 1):  # the first is a warm-up (dropped); the best of the rest is kept
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with autocast:
            for _ in range(m):
                for s, mod in modules.items():
                    if s == 0:
                        x: torch.Tensor = torch.randint(0, cfg.vocab_size, (mb, args.seq_len), device=device)
                    else:
                        x = torch.randn(mb, args.seq_len, cfg.dim, device=device, requires_grad=True)
                    out = mod(x)
                    if s == last:
                        labels = torch.randint(0, cfg.vocab_size, (mb * args.seq_len,), device=device)
                        F.cross_entropy(out.float().flatten(0, 1), labels).backward()
                    else:
                        out.backward(torch.ones_like(out))
        if device.type == "cuda":
            torch.cuda.synchronize()
        reps.append(time.perf_counter() - t0)
        for mod in modules.values():
            mod.zero_grad(set_to_none=True)
    return min(reps[1:])


def pipeline_record(config: dict[str, Any], results: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    """The record: per schedule and M, tokens/s, the measured and theoretical bubble, and the speedup over 1F1B at
    the same M against the speedup the theoretical bubbles predict (``(1 - bubble_1f1b) / (1 - bubble)``)."""
    rows = [dict(r) for r in results]
    base = {r["microbatches"]: r for r in rows if r.get("schedule") == "1f1b" and "step_s" in r}
    for r in rows:
        r.setdefault("variant", f"{r['schedule']}-m{r['microbatches']}")
        b = base.get(r["microbatches"])
        if b is None or "step_s" not in r:
            continue
        r["speedup_vs_1f1b"] = b["step_s"] / r["step_s"]
        # step = busy / (1 - bubble) with the same busy time: speedup = (1 - bubble) / (1 - bubble_1f1b)
        r["predicted_speedup_vs_1f1b"] = (1.0 - r["theory_bubble"]) / (1.0 - b["theory_bubble"])
        r["bubble_gap_pp"] = 100.0 * (r["measured_bubble"] - r["theory_bubble"])
        if "measured_bubble_alone" in r:
            r["bubble_gap_alone_pp"] = 100.0 * (r["measured_bubble_alone"] - r["theory_bubble"])
    name = f"pipeline-{config['preset']}" + (f"-{config['layers']}l" if config.get("layers") else "")
    if config.get("rows_per_microbatch", 2) != 2:
        name += f"-mb{config['rows_per_microbatch']}"
    if config.get("fused_kernels"):
        name += "-fused"
    name += f"-{config['world_size']}gpu"
    notes = [
        "one torchrun launch, every schedule in turn on torch.distributed.pipelining stages; no optimizer step",
        "measured_bubble = mean over ranks of 1 - busy/step; busy (busy_method 'kernels') = the union of the rank's "
        "kernel intervals over one profiled step, NCCL kernels excluded; theory assumes equal stages (the last stage "
        "also holds the head and the loss); predicted_speedup_vs_1f1b = (1 - theory) / (1 - theory of 1F1B)",
        "measured_bubble_alone = mean over ranks of 1 - alone/step, alone = the best of several runs of the rank's "
        "stage modules' forward + backward for the M micro-batches without the pipeline (the reference when the host "
        "bounds a stage: its kernels then fill less than its time)",
        "zero_bubble/zbv/dualpipev split the backward with "
        f"split_backward={config.get('split_backward', 'deferred')!r} "
        "('deferred': our weight-gradient store; 'torch': stage_backward_input + stage_backward_weight)",
        *kw.pop("notes", []),
    ]
    return records.make_record(name, config, rows, [], benchmark="pipeline", ratio_metric=None, notes=notes, **kw)


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
            config = {
                "preset": args.preset,
                "layers": args.layers,
                "world_size": dist.get_world_size(),
                "seq_len": args.seq_len,
                "rows_per_microbatch": args.rows_per_microbatch,
                "fused_kernels": args.fused_kernels,
                "attn_backend": args.attn_backend or "preset default",
                "split_backward": args.split_backward,
                "warmup": args.warmup,
                "steps": args.steps,
            }
            record = pipeline_record(config, results)
            print(f"wrote {records.write_record(record)}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--layers", type=int, default=0, help="override the preset's block count (0: keep)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument(
        "--rows-per-microbatch",
        type=int,
        default=2,
        help="rows of --seq-len tokens per micro-batch (default 2: at 1 row a 1b stage is bound by the host)",
    )
    parser.add_argument("--fused-kernels", nargs="*", default=[], help="model kernels, e.g. rmsnorm rope swiglu")
    parser.add_argument("--attn-backend", default=None, help="model attention backend (default: the preset's)")
    parser.add_argument("--split-backward", default="deferred", choices=["deferred", "torch"])
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
