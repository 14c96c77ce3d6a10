"""Multi-GPU ZeRO throughput and per-rank peak memory against Lightning's own ``ddp`` and ``fsdp`` (issue 3).

On one host with N GPUs (``torch.cuda.device_count()``, or ``--nproc``), for one preset (default ``1b``),
``bf16-mixed``, random tokens (fixed seed), seq 4096 and micro-batch 4 per GPU, each strategy is trained in its OWN
``torchrun --standalone --nproc-per-node=N`` launch (a fresh process group per variant):

- peers: Lightning ``ddp``; Lightning ``fsdp`` (``FSDPStrategy``, FSDP1, ``auto_wrap_policy={TransformerBlock}``,
  ``FULL_SHARD``); ``fsdp2``: Lightning ``ModelParallelStrategy`` (data parallel only) with ``fully_shard`` of every
  block then the root, built on the meta device (bf16 parameters in compute, as Lightning's FSDP1 ``bf16-mixed``);
- ours: ``ZeroStrategy(stage=1|2|3)`` (``zero1``, ``zero2``, ``zero3``).

Per variant: median step time over the timed steps (warm-up excluded; wall time between consecutive batch ends,
``torch.cuda.synchronize`` at each, max over ranks), tokens/s over all GPUs, and per-rank peak
``torch.cuda.max_memory_allocated``/``reserved`` (all-gathered; the max over ranks is reported), beside
``estimate_memory`` (DDP as stage 0, ``fsdp``/``fsdp2``/``zero3`` as stage 3). One record per world size,
``benchmarks/results/zero-<preset>-<N>gpu-<device>.json``: ``zero1``/``zero2`` against ``ddp``, ``zero3`` against
``fsdp`` (and ``fsdp2``), with the issue's goals evaluated in the notes. A variant that fails (OOM, error, timeout)
is recorded with its error; the others still run.

    python benchmarks/bench_zero.py                           # all visible GPUs, 1b, seq 4096, micro-batch 4
    python benchmarks/bench_zero.py --nproc 2 --variants ddp zero2 --micro-batch 2
    python benchmarks/bench_zero.py --smoke                   # CPU, gloo, 2 ranks, tiny, seq 64, 3 steps

Internally each variant runs ``python -m torch.distributed.run --standalone --nproc-per-node=N bench_zero.py
--worker --strategy X ...``; the worker can also be started that way by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package
import launch  # noqa: E402
import records  # noqa: E402

from lightning_llmopt.testing.data import RandomTokens  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("ddp", "fsdp", "fsdp2", "zero1", "zero2", "zero3")
OURS = ("zero1", "zero2", "zero3")
STAGE_OF = {"ddp": 0, "fsdp": 3, "fsdp2": 3, "zero1": 1, "zero2": 2, "zero3": 3}
DATASHEET_BF16_TFLOPS = 989.0  # H100/H200 SXM dense bf16
# NVLink multicast must stay off on the shared multi-GPU hosts (device KINDS.md); also set for every child process.
GOAL_ZERO12_VS_DDP = 0.95
GOAL_ZERO3_VS_FSDP = 1.0
GOAL_ESTIMATE_TOL = 0.10
_GIB = 2**30


# --------------------------------------------------------------------------- worker (one rank of one variant)


def _fsdp2_module_class() -> type:
    """``CausalLMModule`` whose ``configure_model`` applies FSDP2 ``fully_shard`` (what ``ModelParallelStrategy``
    asks of the user): every block, then the root, on the meta device; then only the local shards are allocated."""
    import torch

    from lightning_llmopt import CausalLMModule
    from lightning_llmopt.models.llama import Llama

    class FSDP2CausalLM(CausalLMModule):
        param_dtype: Any = None

        def configure_model(self) -> None:
            if self.model is not None:
                return
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            with torch.device("meta"):
                model = Llama(self.config)
            assert self.device_mesh is not None, "needs ModelParallelStrategy"
            mesh = self.device_mesh["data_parallel"]
            mp = MixedPrecisionPolicy(param_dtype=self.param_dtype)
            for block in model.layers.values():
                fully_shard(block, mesh=mesh, mp_policy=mp)
            fully_shard(model, mesh=mesh, mp_policy=mp)
            device = self.trainer.strategy.root_device
            model.to_empty(device=device)
            model.init_weights(buffer_device=device)
            self.model = model

    return FSDP2CausalLM


ZERO_KWARGS: dict[str, Any] = {}  # --zero-kwargs: extra ZeroStrategy arguments for our variants


def _build_strategy(name: str, world: int, cuda: bool, precision: str) -> tuple[Any, Any]:
    """``(strategy, module class)`` for one variant."""
    from lightning_llmopt import CausalLMModule

    if name == "ddp":
        return "ddp", CausalLMModule
    if name == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        from lightning_llmopt.models.llama import TransformerBlock

        return FSDPStrategy(auto_wrap_policy={TransformerBlock}, sharding_strategy="FULL_SHARD"), CausalLMModule
    if name == "fsdp2":
        import torch
        from lightning.pytorch.strategies import ModelParallelStrategy

        cls: Any = _fsdp2_module_class()
        cls.param_dtype = torch.bfloat16 if precision == "bf16-mixed" else None
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1), cls
    if name in OURS:
        from lightning_llmopt.strategies import ZeroStrategy

        return ZeroStrategy(stage=STAGE_OF[name], **ZERO_KWARGS), CausalLMModule
    raise SystemExit(f"unknown strategy {name!r}; choose from {VARIANTS}")


def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch

    smoke = args.smoke
    cuda = not smoke
    if cuda and not torch.cuda.is_available():
        raise SystemExit("bench_zero needs CUDA GPUs (use --smoke for a CPU check of the code path)")
    world = int(os.environ["WORLD_SIZE"])
    torch.set_float32_matmul_precision("high")
    L.seed_everything(0, verbose=False)
    for pattern in (
        ".*does not have many workers.*",
        ".*GPU available but not used.*",
        ".*predict_dataloader.*",
        ".*sync_dist=True.*",
        ".*FSDP.*",
        ".*barebones.*",
    ):
        warnings.filterwarnings("ignore", message=pattern)

    strategy, module_cls = _build_strategy(args.strategy, world, cuda, args.precision)
    total_steps = args.warmup_steps + args.steps
    module = module_cls(
        args.preset, model_overrides=_overrides(args.preset, args.seq_len), warmup_steps=2, max_steps=total_steps
    )
    batch = args.micro_batch
    dataset = RandomTokens(module.config.vocab_size, args.seq_len, total_steps * batch * world, seed=1234)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=batch, shuffle=False, num_workers=2 if cuda else 0, pin_memory=cuda, persistent_workers=cuda
    )
    measure = launch.measure_callback(args.warmup_steps, cuda)
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=world,
        num_nodes=1,
        strategy=strategy,
        precision=args.precision,
        max_steps=total_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[measure] + ([launch.profile_callback(args.warmup_steps, 2, cuda)] if args.profile else []),
    )
    trainer.fit(module, train_dataloaders=loader)
    s = measure.summary
    if not s.get("step_s"):
        raise RuntimeError("no timed steps (increase --steps)")
    step_s = statistics.median(s["step_s"])
    tokens_per_s = world * batch * args.seq_len / step_s
    row: dict[str, Any] = {
        "variant": args.strategy,
        "median_step_ms": step_s * 1e3,
        "median_compute_ms": statistics.median(s["compute_s"]) * 1e3 if s["compute_s"] else None,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_gpu": tokens_per_s / world,
        "timed_steps": len(s["step_s"]),
        "final_loss": s["losses"][-1] if s["losses"] else None,
    }
    if cuda:
        row["peak_allocated_gib"] = max(s["allocated"]) / _GIB
        row["peak_reserved_gib"] = max(s["reserved"]) / _GIB
        row["peak_allocated_gib_per_rank"] = [round(v / _GIB, 3) for v in s["allocated"]]
    return row


def _overrides(preset: str, seq_len: int) -> dict[str, Any]:
    from lightning_llmopt.models import LlamaConfig

    return {"max_seq_len": seq_len} if LlamaConfig.from_preset(preset).max_seq_len < seq_len else {}


# --------------------------------------------------------------------------- driver (one launch per variant)


def run_variant(args: argparse.Namespace, variant: str, nproc: int, log_dir: Path) -> dict[str, Any]:
    """Launch one variant with torchrun; return its row (or ``{"variant", "error"}``)."""

    def worker_args(out: Path) -> list[str]:
        return (
            [
                "--worker",
                "--strategy",
                variant,
                "--preset",
                args.preset,
                "--seq-len",
                str(args.seq_len),
                "--micro-batch",
                str(args.micro_batch),
                "--precision",
                args.precision,
                "--warmup-steps",
                str(args.warmup_steps),
                "--steps",
                str(args.steps),
                "--json-out",
                str(out),
                "--zero-kwargs",
                args.zero_kwargs,
            ]
            + (["--smoke"] if args.smoke else [])
            + (["--profile"] if args.profile else [])
        )

    return launch.launch(__file__, worker_args, variant, nproc, log_dir / f"zero-{variant}-{nproc}.log", args.timeout)


def _estimates(args: argparse.Namespace, nproc: int) -> dict[int, Any]:
    from lightning_llmopt.models import LlamaConfig
    from lightning_llmopt.parallel.memory import estimate_memory

    config = LlamaConfig.from_preset(args.preset, **_overrides(args.preset, args.seq_len))
    out: dict[int, Any] = {}
    for stage in (0, 1, 2, 3):
        try:
            out[stage] = estimate_memory(
                config,
                stage=stage,
                world_size=nproc,
                precision=args.precision,
                micro_batch=args.micro_batch,
                seq_len=args.seq_len,
                activation_checkpointing="none",
            )
        except ValueError as err:  # e.g. a precision the estimate does not model: measure anyway
            print(f"estimate_memory(stage={stage}) failed: {err}", flush=True)
    return out


def _model_facts(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from lightning_llmopt.models import LlamaConfig
    from lightning_llmopt.models.llama import Llama

    config = LlamaConfig.from_preset(args.preset, **_overrides(args.preset, args.seq_len))
    with torch.device("meta"):
        model = Llama(config)
    return {
        "params": model.num_params(),
        "flops_per_token": float(model.flops_per_token(args.seq_len)),
        "model": {k: getattr(config, k) for k in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads")},
        "attn_backend": getattr(config, "attn_backend", None),
    }


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None, metric: str) -> float | None:
    if not a or not b or not isinstance(a.get(metric), (int, float)) or not isinstance(b.get(metric), (int, float)):
        return None
    return a[metric] / b[metric] if b[metric] else None


def _merge_previous(rows: dict[str, dict[str, Any]], path: Path) -> list[str]:
    """Add the rows of ``path``'s record for variants not run now; return notes saying which and from when."""
    if not path.exists():
        return [f"--merge: no earlier record at {path.name}"]
    old = json.loads(path.read_text())
    kept = []
    for row in [*old.get("results", []), *old.get("peers", [])]:
        if row.get("variant") in rows or "error" in row:
            continue
        row = dict(row)
        row.setdefault("run_date", old.get("date"))
        rows[row["variant"]] = row
        kept.append(f"{row['variant']} ({row['run_date']})")
    if not kept:
        return []
    return [f"merged from the earlier record (not rerun): {', '.join(kept)}; ratios only pair rows of one run"]


def _goal_notes(rows: dict[str, dict[str, Any]], cuda: bool) -> list[str]:
    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    def verdict(ok: bool | None) -> str:
        return "not measured" if ok is None else ("MET" if ok else "NOT MET")

    notes = []
    ddp = rows.get("ddp")
    for v in ("zero1", "zero2"):
        same = ddp is not None and v in rows and rows[v].get("run_date") == ddp.get("run_date")
        r = _ratio(rows.get(v), ddp, "tokens_per_s") if same else None
        notes.append(
            f"goal: {v} tokens/s >= {GOAL_ZERO12_VS_DDP}x ddp: {fmt(r)}x -> "
            f"{verdict(None if r is None else r >= GOAL_ZERO12_VS_DDP)}"
        )
    for peer in ("fsdp", "fsdp2"):
        if peer in rows and "zero3" in rows and rows[peer].get("run_date") != rows["zero3"].get("run_date"):
            continue  # measured in different runs: no same-run ratio
        r = _ratio(rows.get("zero3"), rows.get(peer), "tokens_per_s")
        m = _ratio(rows.get("zero3"), rows.get(peer), "peak_allocated_gib") if cuda else None
        ok = None if r is None or (cuda and m is None) else (r >= GOAL_ZERO3_VS_FSDP and (m is None or m <= 1.0))
        notes.append(
            f"goal: zero3 tokens/s >= {GOAL_ZERO3_VS_FSDP}x {peer} at <= its peak allocated memory: "
            f"{fmt(r)}x throughput, {fmt(m)}x memory -> {verdict(ok)}"
        )
    for v in OURS:
        e = rows.get(v, {}).get("peak_vs_estimate")
        notes.append(
            f"goal: {v} measured peak allocated within {GOAL_ESTIMATE_TOL:.0%} of estimate_memory peak: "
            f"{fmt(e)} -> {verdict(None if e is None else abs(e - 1) <= GOAL_ESTIMATE_TOL)}"
        )
    return notes


def _print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'variant':>8} {'step ms':>9} {'tok/s':>11} {'tok/s/gpu':>10} {'vs peer':>8} {'peak alloc':>10} "
        f"{'reserved':>9} {'estimate':>9} {'meas/est':>8} {'wall s':>7}  error"
    )
    print(head)
    print("-" * len(head))

    def num(value: Any, spec: str, width: int) -> str:
        return f"{value:{width}{spec}}" if isinstance(value, (int, float)) else f"{'-':>{width}}"

    by = {r["variant"]: r for r in rows}
    for r in rows:
        peer = {"zero1": "ddp", "zero2": "ddp", "zero3": "fsdp"}.get(r["variant"])
        vs = _ratio(r, by.get(peer), "tokens_per_s") if peer else None
        print(
            f"{r['variant']:>8} {num(r.get('median_step_ms'), '.1f', 9)} {num(r.get('tokens_per_s'), ',.0f', 11)} "
            f"{num(r.get('tokens_per_s_per_gpu'), ',.0f', 10)} {num(vs, '.3f', 8)} "
            f"{num(r.get('peak_allocated_gib'), '.2f', 10)} {num(r.get('peak_reserved_gib'), '.2f', 9)} "
            f"{num(r.get('estimate_peak_gib'), '.2f', 9)} {num(r.get('peak_vs_estimate'), '.3f', 8)} "
            f"{num(r.get('launch_wall_s'), '.0f', 7)}  {r.get('error', '')[:100]}"
        )
    print("(vs peer: tokens/s ratio, zero1/zero2 vs ddp, zero3 vs fsdp; memory in GiB, max over ranks)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="ZeRO stages vs Lightning ddp/fsdp on one multi-GPU host.")
    parser.add_argument("--nproc", type=int, default=None, help="processes/GPUs (default: all visible; 2 w/ smoke)")
    parser.add_argument("--variants", nargs="+", default=None, choices=VARIANTS, help=f"default: {' '.join(VARIANTS)}")
    parser.add_argument("--preset", default=None, help="model preset (default 1b; tiny with --smoke)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 4096; 64 with --smoke)")
    parser.add_argument("--micro-batch", type=int, default=None, help="rows per GPU per step (default 4; 2 w/ smoke)")
    parser.add_argument("--precision", default=None, help="default bf16-mixed (also with --smoke)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="untimed steps (default 5; 1 with --smoke)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 15; 2 with --smoke)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per variant launch (default 150)")
    parser.add_argument("--results-dir", type=Path, default=None, help="default benchmarks/results (temp w/ smoke)")
    parser.add_argument("--log-dir", type=Path, default=None, help="per-variant logs (default: a temp folder)")
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, 2 ranks, tiny preset: code path only")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="print rank 0's top operators and device idle time over 2 steps after warm-up into each launch's log "
        "(the timed figures then include the profiler's overhead: write them elsewhere with --results-dir)",
    )
    parser.add_argument(
        "--zero-kwargs",
        default="{}",
        help="JSON of extra ZeroStrategy arguments, e.g. '{\"split_edges\": false}' (recorded in the config)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep rows of variants not run now from the existing "
        "record (each row keeps its own date; a ratio is only formed within one run)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    ZERO_KWARGS.update(json.loads(args.zero_kwargs))
    smoke = args.smoke
    args.preset = args.preset or ("tiny" if smoke else "1b")
    args.seq_len = args.seq_len or (64 if smoke else 4096)
    args.micro_batch = args.micro_batch or (2 if smoke else 4)
    args.precision = args.precision or "bf16-mixed"
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (1 if smoke else 5)
    args.steps = args.steps if args.steps is not None else (2 if smoke else 15)
    args.timeout = args.timeout or 150.0
    if args.worker:
        return launch.worker_main(run_worker, args)

    os.environ.update(launch.NVLS_OFF)
    import torch

    cuda = torch.cuda.is_available() and not smoke
    if not smoke and not cuda:
        raise SystemExit("bench_zero needs CUDA GPUs (use --smoke for a CPU check of the code path)")
    nproc = args.nproc or (2 if smoke else torch.cuda.device_count())
    if nproc < 2:
        raise SystemExit(f"bench_zero needs at least 2 processes, got {nproc}")
    variants = args.variants or list(VARIANTS)
    results_dir = args.results_dir or (
        Path(tempfile.mkdtemp(prefix="llmopt-bench-")) if smoke else REPO_ROOT / "benchmarks" / "results"
    )
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="llmopt-zero-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    facts = _model_facts(args)
    estimates = _estimates(args, nproc)
    print(
        f"{args.preset}: {facts['params'] / 1e6:.1f}M params, {nproc} ranks, seq {args.seq_len}, micro-batch "
        f"{args.micro_batch}/rank, {args.precision}, {args.warmup_steps} warm-up + {args.steps} timed steps",
        flush=True,
    )

    rows: dict[str, dict[str, Any]] = {}
    run_date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    skipped: list[str] = []
    for variant in variants:
        if smoke and variant == "fsdp":
            # Lightning's FSDPStrategy refuses accelerator="cpu" ("requires a GPU accelerator"); fsdp2 runs instead.
            skipped.append("fsdp skipped in --smoke: Lightning's FSDPStrategy requires a GPU accelerator")
            print(f"[fsdp] {skipped[-1]}", flush=True)
            continue
        row = run_variant(args, variant, nproc, log_dir)
        est = estimates.get(STAGE_OF[variant])
        row["estimate_stage"] = STAGE_OF[variant]
        row["estimate_peak_gib"] = est.peak / _GIB if est is not None else None
        if isinstance(row.get("peak_allocated_gib"), (int, float)) and est is not None:
            row["peak_vs_estimate"] = row["peak_allocated_gib"] / row["estimate_peak_gib"]
            row["reserved_vs_estimate"] = row["peak_reserved_gib"] / row["estimate_peak_gib"]
        if isinstance(row.get("tokens_per_s_per_gpu"), (int, float)):
            row["model_tflops_per_gpu"] = facts["flops_per_token"] * row["tokens_per_s_per_gpu"] / 1e12
            if cuda:
                row["mfu_vs_datasheet"] = row["model_tflops_per_gpu"] / DATASHEET_BF16_TFLOPS
        row["run_date"] = run_date
        if ZERO_KWARGS and variant in OURS:
            row["zero_kwargs"] = dict(ZERO_KWARGS)
        rows[variant] = row

    name = f"zero-{args.preset}-{nproc}{'gpu' if cuda else 'cpu'}"
    previous = records.record_path({"name": name, "env": records.environment()}, results_dir)
    merged = _merge_previous(rows, previous) if args.merge else []
    variants = [v for v in VARIANTS if v in rows]
    ours = [rows[v] for v in variants if v in OURS]
    peers = [rows[v] for v in variants if v not in OURS]
    ratios: list[dict[str, Any]] = []
    pairs = [("zero1", "ddp"), ("zero2", "ddp"), ("zero3", "fsdp"), ("zero3", "fsdp2")]
    for metric in ("tokens_per_s", "peak_allocated_gib"):
        for a, b in pairs:
            if a in rows and b in rows and rows[a].get("run_date") == rows[b].get("run_date"):  # same run only
                ratios += records.compute_ratios([rows[a]], [rows[b]], metric)
    notes = [
        f"each variant in its own `torchrun --standalone --nproc-per-node={nproc}` launch (fresh process group)",
        "step time: wall time between consecutive batch ends after warm-up, torch.cuda.synchronize at each, "
        "slowest rank per step, median over steps; tokens/s counts all GPUs",
        "peak memory: torch.cuda.max_memory_allocated/reserved over the whole run per rank, max over ranks",
        "estimate: lightning_llmopt.parallel.memory.estimate_memory(..., activation_checkpointing='none').peak; "
        "ddp as stage 0, fsdp/fsdp2/zero3 as stage 3; peak_vs_estimate = measured allocated / estimate",
        "ratios above 1 mean ours is better (memory ratio = peer peak / our peak)",
        "fsdp = Lightning FSDPStrategy (FSDP1, FULL_SHARD, auto_wrap_policy={TransformerBlock}; bf16-mixed gathers "
        "and reduces in bf16); fsdp2 = Lightning ModelParallelStrategy(data_parallel_size=N) + fully_shard per "
        "block and root from the meta device (bf16 param_dtype, reduce in bf16, implicit prefetch)",
        *_goal_notes(rows, cuda),
    ]
    notes += skipped + merged
    failed = [v for v in variants if "error" in rows[v]]
    for v in failed:
        notes.append(f"{v} failed: {rows[v]['error']}")
    if smoke:
        notes.append("smoke run on CPU (gloo, fp32 master weights, autocast bf16): code path only, figures meaningless")
    config = {
        "preset": args.preset,
        **facts,
        "world_size": nproc,
        "seq_len": args.seq_len,
        "micro_batch_per_rank": args.micro_batch,
        "global_batch_tokens": nproc * args.micro_batch * args.seq_len,
        "precision": args.precision,
        "warmup_steps": args.warmup_steps,
        "timed_steps": args.steps,
        "optimizer": "AdamW (CausalLMModule.configure_optimizers, fused on CUDA)",
        "activation_checkpointing": "none",
        "data": "random tokens, seed 1234",
        "variants": variants,
        "estimate_peak_gib_by_stage": {str(s): round(e.peak / _GIB, 4) for s, e in estimates.items()},
    }
    record = records.make_record(
        name,
        config=config,
        results=ours,
        peers=peers,
        benchmark="zero",
        ratio_metric=None,
        reference={"datasheet_bf16_dense_tflops": DATASHEET_BF16_TFLOPS},
        notes=notes,
    )
    record["ratios"] = ratios
    path = records.write_record(record, results_dir)
    print()
    _print_table([rows[v] for v in variants])
    for note in notes:
        if note.startswith("goal:") or " failed: " in note:
            print(f"  {note}")
    for note in skipped:
        print(f"  {note}")
    print(f"record: {path}\nlogs: {log_dir}")
    if smoke:
        bad = [v for v in failed if v != "fsdp2"]  # the optional FSDP2 peer need not run on CPU
    else:
        bad = failed
    if bad:
        print(f"failed: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
