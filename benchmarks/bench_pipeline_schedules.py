"""Where a pipeline step's time goes (issue 44): every schedule in one run, with action-level timelines.

One process per pipeline rank (``torchrun``; pure pipeline, world size = ``P``). For each sequence length and each
schedule (gpipe, 1f1b, interleaved_1f1b, zero_bubble, zbv, dualpipev; the zero-bubble ones once per
``--split-backward``) with ``M`` micro-batches, on the framework-free
:class:`~lightning_llmopt.parallel.pipeline.PipelineRunner` (bf16 autocast on GPU, random tokens, no optimizer step):

- tokens/s: median step time over ``--steps`` after ``--warmup``, recorder off (``cuda.synchronize`` + barrier
  around each step); peak memory per rank (``max_memory_allocated``; on CPU the process's peak RSS);
- one more step per ``--record-steps`` with the :class:`~lightning_llmopt.parallel.pipeline_trace.ActionRecorder` on
  (CUDA events on GPU): per rank and per action kind (F, B, I, W, L, send/recv posting, transfer waits) seconds and
  counts, host bookkeeping between actions, busy/idle fractions, stage imbalance and the measured bubble against the
  plan's theoretical bubble (:mod:`~lightning_llmopt.parallel.pipeline_timeline`); the step with the median window
  is kept; with ``--profile-dir`` one more step under ``torch.profiler`` per schedule (Chrome trace per rank);
- a PNG per schedule: the measured timeline above the theoretical one of the same P, M and V;
- speedup over 1F1B at the same sequence length and M, and the issue's acceptance checks (interleaved >= 1.10x,
  zero_bubble/zbv/dualpipev >= 1.15x, 1F1B's measured bubble within 5 points of (P-1)/(M+P-1)).

    torchrun --standalone --nproc-per-node=4 benchmarks/bench_pipeline_schedules.py --preset 1b --seq-len 2048 4096
    python benchmarks/bench_pipeline_schedules.py --device cpu     # smoke: 2 gloo ranks, tiny model, not a result

Record: ``benchmarks/results/pipeline-schedules-<preset>-s<seq>[-mb<rows>]-<P>gpu-<device>.json`` (``records``
format), PNGs in ``--png-dir`` (default ``docs/pipeline_timelines/measured-<device>``). ``--device cpu`` writes
its record (named ``...-<P>rank-smoke``, marked ``"smoke": true``) and PNGs under ``/tmp/pipeline-schedules-smoke``
unless told otherwise: CPU figures time the code paths, not the schedules.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
ZERO_BUBBLE = ("zero_bubble", "zbv", "dualpipev")
TARGETS = {"interleaved_1f1b": 1.10, "zero_bubble": 1.15, "zbv": 1.15, "dualpipev": 1.15}
SMOKE_DIR = Path("/tmp/pipeline-schedules-smoke")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def build_runner(args: argparse.Namespace, name: str, v: int, m: int, split_backward: str, device: torch.device):
    """This rank's stages of a freshly initialised model and a runner for ``name``."""
    from lightning_llmopt.models import Llama, LlamaConfig
    from lightning_llmopt.parallel.pipeline import (
        PipelineConfig,
        PipelineRunner,
        prune_to_stages,
        stage_modules,
        validate_pipeline,
    )

    overrides: dict[str, Any] = {"max_seq_len": max(max(args.seq_len), 256)}
    if args.layers:
        overrides["n_layers"] = args.layers
    if args.fused_kernels:
        overrides["fused_kernels"] = args.fused_kernels
    if args.attn_backend:
        overrides["attn_backend"] = args.attn_backend
    cfg = LlamaConfig.from_preset(args.preset, **overrides)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(cfg)
    config = PipelineConfig(
        pp=dist.get_world_size(),
        schedule=name,
        microbatches=m,
        virtual_stages=v,
        split_backward=split_backward,
        balance_ends=args.balance_ends,
    )
    split = validate_pipeline(model, config, seq_len=max(args.seq_len))
    prune_to_stages(model, split, dist.get_rank())
    model.to_empty(device=device)
    model.init_weights()
    runner = PipelineRunner(stage_modules(model, split, dist.get_rank()), split, config, dist.group.WORLD, device)
    return model, runner, cfg


def _peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux: the process peak so far


def run_one(
    args: argparse.Namespace, name: str, v: int, split_backward: str, seq: int, device: torch.device
) -> dict[str, Any]:
    """Timed steps (recorder off), then recorded steps; every rank returns the row (traces gathered)."""
    from lightning_llmopt.parallel.pipeline_trace import ActionRecorder

    m = args.microbatches
    model, runner, cfg = build_runner(args, name, v, m, split_backward, device)
    rows = args.rows_per_microbatch * m
    tokens = torch.randint(0, cfg.vocab_size, (rows, seq + 1), device=device)
    batch, labels = {"input_ids": tokens[:, :-1]}, tokens[:, 1:]

    def loss_fn(out: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.float().flatten(0, 1), labels[idx].flatten())

    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step() -> float:
        _sync(device)
        t0 = time.perf_counter()
        with autocast:
            runner.train_step(batch, loss_fn)
        _sync(device)
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = [step() for _ in range(args.warmup + args.steps)][args.warmup :]
    peak = _peak_memory_gib(device)
    runner.recorder = recorder = ActionRecorder(cuda_events=device.type == "cuda", keep=args.record_steps)
    recorded = [step() for _ in range(args.record_steps)]
    variant = f"{name}-s{seq}-m{m}" + ("-torchsplit" if name in ZERO_BUBBLE and split_backward == "torch" else "")
    runner.recorder, profiled = None, None
    if args.profile_dir:  # one more step under torch.profiler (kernels, host operators), recorder off
        profiled = profile_step(step, device, Path(args.profile_dir) / f"{variant}-rank{dist.get_rank()}.json.gz")
    step_s = statistics.median(times)
    return {
        "variant": variant,
        "schedule": name,
        "split_backward": split_backward if name in ZERO_BUBBLE else None,
        "virtual_stages": v,
        "microbatches": m,
        "seq_len": seq,
        "step_s": step_s,
        "tokens_per_s": rows * seq / step_s,
        "recorded_step_s": statistics.median(recorded),
        **summarise(args, variant, name, v, recorder.traces, peak, f", seq {seq}, split {split_backward}"),
        **({"profiled_step_s": profiled} if profiled is not None else {}),
    }


def summarise(
    args: argparse.Namespace, variant: str, name: str, v: int, traces: list[Any], peak: float, label: str
) -> dict[str, Any]:
    """Gather every rank's recorded steps, keep the one whose window is the median, draw it (rank 0)."""
    from lightning_llmopt.parallel.pipeline_timeline import bubble_summary, draw_timelines
    from lightning_llmopt.parallel.pipeline_trace import StepTrace

    m = args.microbatches
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"traces": [t.to_dict() for t in traces], "peak": peak})
    steps = [[StepTrace.from_dict(g["traces"][i]) for g in gathered] for i in range(len(traces))]
    summaries = [bubble_summary(s, name, m, v) for s in steps]
    pick = sorted(range(len(steps)), key=lambda i: summaries[i]["window_s"])[len(steps) // 2]
    summary = summaries[pick]
    png = None
    if dist.get_rank() == 0 and args.png_dir:
        Path(args.png_dir).mkdir(parents=True, exist_ok=True)
        png = str(Path(args.png_dir) / f"{variant}.png")
        draw_timelines(steps[pick], png, name, m, v, title=f"{label}, {args.rows_per_microbatch} row(s)/micro-batch")
    return {
        "peak_memory_gib_per_rank": [g["peak"] for g in gathered],
        "measured_bubble": summary["measured_bubble"],
        "theory_bubble": summary["theory_bubble"],
        "bubble_gap_points": summary["bubble_gap_points"],
        "busy_fraction_per_rank": summary["busy_fraction_per_rank"],
        "imbalance": summary["imbalance"],
        "bookkeeping_host_s_per_rank": summary["bookkeeping_host_s_per_rank"],
        "wait_s_per_rank": summary["wait_s_per_rank"],
        "actions_per_rank": [r["actions"] for r in summary["ranks"]],
        "window_s": summary["window_s"],
        "timeline_png": png,
    }


def profile_step(step: Any, device: torch.device, path: Path) -> float:
    """Run ``step`` under ``torch.profiler`` (CPU + CUDA activities; torch's schedules open a range per action) and
    write its Chrome trace to ``path``; returns the step's seconds."""
    from torch.profiler import ProfilerActivity, profile

    path.parent.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        seconds = step()
    prof.export_chrome_trace(str(path))
    return seconds


def add_comparisons(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Speedup over 1F1B (same sequence length and M) and the issue's acceptance checks."""
    base = {(r["seq_len"], r["microbatches"]): r for r in rows if r.get("schedule") == "1f1b" and "step_s" in r}
    checks: dict[str, Any] = {}
    for r in rows:
        b = base.get((r.get("seq_len"), r.get("microbatches")))
        if b is None or "step_s" not in r:
            continue
        r["speedup_vs_1f1b"] = b["step_s"] / r["step_s"]
        r["predicted_speedup_vs_1f1b"] = (1.0 - r["theory_bubble"]) / (1.0 - b["theory_bubble"])
        target = TARGETS.get(r["schedule"])
        if target is not None:
            checks[f"{r['variant']}_speedup_ge_{target:.2f}"] = r["speedup_vs_1f1b"] >= target
        if r["schedule"] == "1f1b":
            checks[f"{r['variant']}_bubble_within_5_points"] = abs(r["bubble_gap_points"]) <= 5.0
    return checks


def worker(args: argparse.Namespace) -> None:
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    args.png_dir = default_png_dir(args, device)
    rows: list[dict[str, Any]] = []
    for seq in args.seq_len:
        for name, v in SCHEDULES:
            if name not in args.schedules:
                continue
            for split in args.split_backward if name in ZERO_BUBBLE else ["deferred"]:
                try:
                    rows.append(run_one(args, name, v, split, seq, device))
                except (ValueError, NotImplementedError) as exc:  # config errors, raised alike before any collective
                    # (an out-of-memory error is not caught: one rank failing mid-step would leave the others
                    # waiting on its transfers; torchrun ends them all instead)
                    rows.append({"variant": f"{name}-s{seq}-{split}", "schedule": name, "skipped": str(exc)[:400]})
                if dist.get_rank() == 0:
                    print(json.dumps({k: v for k, v in rows[-1].items() if k != "actions_per_rank"}), flush=True)
                    write(args, [dict(r) for r in rows], dist.get_world_size(), quiet=True)  # partial: kept if a
                    # later schedule fails (e.g. out of memory)
    if dist.get_rank() == 0:
        write(args, [dict(r) for r in rows], dist.get_world_size())
    dist.destroy_process_group()


def write(args: argparse.Namespace, rows: list[dict[str, Any]], pp: int, quiet: bool = False) -> None:
    """The record of ``rows`` (modified: comparisons added, breakdowns moved to the top level)."""
    checks = add_comparisons(rows)
    smoke = args.device == "cpu"
    config = {
        "preset": args.preset,
        "layers": args.layers,
        "pipeline_parallel": pp,
        "seq_len": args.seq_len,
        "microbatches": args.microbatches,
        "rows_per_microbatch": args.rows_per_microbatch,
        "split_backward": args.split_backward,
        "balance_ends": args.balance_ends,
        "fused_kernels": args.fused_kernels,
        "attn_backend": args.attn_backend or "preset default",
        "warmup": args.warmup,
        "steps": args.steps,
        "record_steps": args.record_steps,
        "smoke": smoke,
    }
    notes = [
        "one launch, every schedule in turn on torch.distributed.pipelining stages; bf16 autocast on GPU; no "
        "optimizer step; tokens/s from steps with the recorder off",
        "measured_bubble = 1 - sum(busy) / (P * window): busy = union of the rank's compute actions (F, B, I, W, "
        "L) timed with CUDA events on the current stream (host perf_counter on CPU), window = earliest rank start "
        "to latest rank end; it counts waits, host bookkeeping and stage imbalance as bubble",
        "theory_bubble: (P-1)/(M+P-1) for gpipe/1f1b, (P-1)/(VM+P-1) for interleaved, the unit-cost simulation "
        "(F = I = W = 1) for zero_bubble/zbv/dualpipev",
        "bookkeeping_host_s_per_rank: host time of the recorded step outside every recorded action; breakdown "
        "(top level): per variant and rank, seconds and counts of each action kind (F forward, B full backward, "
        "I input-gradient, W weight-gradient, L loss, send/recv/sendrecv posting, wait) in the recorded step",
    ]
    if smoke:
        notes.insert(0, "CPU/gloo SMOKE RUN of the code paths: not a performance result")
    name = f"pipeline-schedules-{args.preset}" + (f"-{args.layers}l" if args.layers else "")
    name += (
        "-s"
        + "-".join(map(str, args.seq_len))
        + (f"-mb{args.rows_per_microbatch}" if args.rows_per_microbatch > 1 else "")
    )
    name += f"-{pp}rank-smoke" if smoke else f"-{pp}gpu"
    breakdown = {r["variant"]: r.pop("actions_per_rank") for r in rows if "actions_per_rank" in r}
    record = records.make_record(name, config, rows, [], benchmark="pipeline", ratio_metric=None, notes=notes)
    record["checks"] = checks  # the acceptance criteria, evaluated on this run
    record["breakdown"] = breakdown  # per variant, per rank: {kind: {"count", "seconds"}} of the recorded step
    directory = args.results_dir or (SMOKE_DIR if smoke else records.RESULTS_DIR)
    path = records.write_record(record, directory)
    if quiet:
        return
    print(f"wrote {path}")
    for key, ok in checks.items():
        print(f"check {key}: {'PASS' if ok else 'FAIL'}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--nproc", type=int, default=2, help="ranks when --device cpu launches itself (P)")
    parser.add_argument("--preset", default=None, help="model preset (default: 1b on cuda, tiny on cpu)")
    parser.add_argument("--layers", type=int, default=0, help="override the preset's block count (0: keep)")
    parser.add_argument("--seq-len", type=int, nargs="+", default=None, help="default: 2048 4096 (cuda), 32 (cpu)")
    parser.add_argument("--microbatches", "-m", type=int, default=None, help="M (default 16 on cuda, 4 on cpu)")
    parser.add_argument("--rows-per-microbatch", type=int, default=1)
    parser.add_argument("--schedules", nargs="+", default=[s for s, _ in SCHEDULES])
    parser.add_argument("--split-backward", nargs="+", default=["deferred"], choices=["deferred", "torch"])
    parser.add_argument("--balance-ends", action="store_true", help="Llama-3 stage balancing (embedding, head)")
    parser.add_argument("--fused-kernels", nargs="*", default=[])
    parser.add_argument("--attn-backend", default=None)
    parser.add_argument("--warmup", type=int, default=None, help="default 3 (cuda), 1 (cpu)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10 on cuda, 2 on cpu)")
    parser.add_argument("--record-steps", type=int, default=3, help="recorded steps (the median window is kept)")
    parser.add_argument("--png-dir", default=None)
    parser.add_argument("--profile-dir", default=None, help="also write a torch.profiler Chrome trace per variant/rank")
    parser.add_argument("--results-dir", default=None)
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    args.preset = args.preset or ("tiny" if cpu else "1b")
    args.layers = args.layers or (8 if cpu and args.preset == "tiny" else 0)
    args.seq_len = args.seq_len or ([32] if cpu else [2048, 4096])
    args.microbatches = args.microbatches or (4 if cpu else 16)
    args.warmup = args.warmup if args.warmup is not None else (1 if cpu else 3)
    args.steps = args.steps if args.steps is not None else (2 if cpu else 10)
    return args


def default_png_dir(args: argparse.Namespace, device: torch.device) -> str:
    """``--png-dir`` or ``docs/pipeline_timelines/measured-<gpu>`` (CPU: under the smoke directory)."""
    if args.png_dir:
        return args.png_dir
    if device.type == "cpu":
        return str(SMOKE_DIR / "measured-cpu-smoke")
    slug = records.slugify(torch.cuda.get_device_name(device))
    return str(records.REPO_ROOT / "docs" / "pipeline_timelines" / f"measured-{slug}")


def main() -> None:
    args = parse()
    if args.device == "cpu" and "RANK" not in os.environ:  # launch P gloo processes of this script
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        raise SystemExit(subprocess.call([*cmd, __file__, *sys.argv[1:]], env=env))
    worker(args)


if __name__ == "__main__":
    main()
