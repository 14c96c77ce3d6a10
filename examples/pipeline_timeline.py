"""Record where a pipeline step's time goes: per rank, per action (forward, backward, input/weight-gradient
backward, loss, send/recv, waits), the measured bubble against theory, and a timeline PNG.

    python examples/pipeline_timeline.py --schedule zbv --pp 2 --microbatches 4 --png zbv.png   # CPU, gloo

Launches ``--pp`` gloo processes of itself (or run it under ``torchrun``). On a CPU the timings show the code paths,
not the schedule's merit; use ``benchmarks/bench_pipeline_schedules.py`` on GPUs for figures.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.parallel.pipeline import (
    PipelineConfig,
    PipelineRunner,
    prune_to_stages,
    stage_modules,
    validate_pipeline,
)
from lightning_llmopt.parallel.pipeline_timeline import bubble_summary, draw_timelines
from lightning_llmopt.parallel.pipeline_trace import ActionRecorder, StepTrace


def run(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_preset("tiny", n_layers=args.layers))
    config = PipelineConfig(pp=dist.get_world_size(), schedule=args.schedule, microbatches=args.microbatches)
    split = validate_pipeline(model, config)
    prune_to_stages(model, split, rank)
    runner = PipelineRunner(stage_modules(model, split, rank), split, config, dist.group.WORLD, torch.device("cpu"))
    data = torch.randint(0, model.config.vocab_size, (args.microbatches, args.seq_len + 1))

    def loss_fn(out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), data[rows, 1:].flatten())

    runner.train_step({"input_ids": data[:, :-1]}, loss_fn)  # first step: stages infer their buffers
    runner.recorder = ActionRecorder()  # opt in; None (the default) records nothing
    loss = runner.train_step({"input_ids": data[:, :-1]}, loss_fn)
    traces: list = [None] * dist.get_world_size()
    dist.all_gather_object(traces, runner.recorder.last.to_dict())
    if rank == 0:
        steps = [StepTrace.from_dict(t) for t in traces]
        assert config.virtual_stages is not None
        s = bubble_summary(steps, args.schedule, args.microbatches, config.virtual_stages)
        print(f"loss {float(loss):.4f}; measured bubble {s['measured_bubble']:.3f} (theory {s['theory_bubble']:.3f})")
        for r in s["ranks"]:
            kinds = ", ".join(f"{k} {v['count']}x {1e3 * v['seconds']:.1f} ms" for k, v in sorted(r["actions"].items()))
            print(f"rank {r['rank']}: busy {1e3 * r['busy_s']:.1f} ms of {1e3 * r['step_s']:.1f} ms; {kinds}")
        if args.png:
            draw_timelines(steps, args.png, args.schedule, args.microbatches, config.virtual_stages)
            print(f"wrote {args.png}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--png", default=None, help="timeline PNG, measured above theoretical (plot extra)")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.pp}"]
        raise SystemExit(subprocess.call([*cmd, __file__, *sys.argv[1:]]))
    run(args)


if __name__ == "__main__":
    main()
