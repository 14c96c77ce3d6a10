"""End-to-end single-GPU training with our fused kernels against plain Lightning and ``torch.compile``, one run.

The ``1b`` preset, ``Trainer(precision="bf16-mixed")``, sequence length 4096, random tokens, the same loop and timer
as ``bench_train.py``. Variants, each in its own process (compile caches and autotuning otherwise leak between them):

- ``lightning-sdpa`` (peer a): plain ``CausalLMModule``, SDPA attention, eager;
- ``lightning-sdpa-compile`` (peer b): the same model with every transformer block compiled (``block.compile()``,
  as torchtitan does) and the loss (``cross_entropy(logits.float())``) compiled;
- ``ours-kernels``: ``LlamaConfig(fused_kernels=["all"], attn_backend="triton")``: fused RMSNorm, in-place RoPE,
  SwiGLU, chunked fused linear + cross-entropy, our flash attention; eager;
- ``ours-kernels-sdpa``: our fused kernels with SDPA attention (separates the attention kernel's share);
- ``ours-kernels-compile``: ``ours-kernels`` with every block compiled (our kernels are custom ops inside the graph);
- ``ours-kernels-sdpa-compile``: ``ours-kernels-sdpa`` with every block compiled: peer b plus our fused linear +
  cross-entropy (under compile ``auto`` leaves norms, rotary and SwiGLU to the compiler);
- ``ours-kernels-sdpa-compile-triton``: the same with ``LLMOPT_FUSED_BACKEND=triton``: every fused kernel of ours
  (RMSNorm, rotary, SwiGLU, linear + cross-entropy) runs as a custom op inside the compiled blocks, and the compiler
  fuses only what lies between them.

Reports the median step time, tokens/s, model TFLOP/s (``Llama.flops_per_token``: 6N + causal attention), MFU
against the bf16 GEMM ceiling measured in the same process and against 989 TFLOP/s, and peak memory. One record,
``benchmarks/results/e2e-kernels-1b-<device>.json``, with ratios against both peers.

    python benchmarks/bench_e2e_kernels.py                         # every variant
    python benchmarks/bench_e2e_kernels.py --variants lightning-sdpa,ours-kernels
    python benchmarks/bench_e2e_kernels.py --smoke                 # CPU, tiny preset, Triton interpreter
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package
import records  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DATASHEET_BF16_TFLOPS = 989.0
OOM_EXIT_CODE = 3
VARIANTS: dict[str, dict[str, Any]] = {
    "lightning-sdpa": {"kernels": False, "attention": "sdpa", "compile": False},
    "lightning-sdpa-compile": {"kernels": False, "attention": "sdpa", "compile": True},
    "ours-kernels": {"kernels": True, "attention": "triton", "compile": False},
    "ours-kernels-sdpa": {"kernels": True, "attention": "sdpa", "compile": False},
    "ours-kernels-compile": {"kernels": True, "attention": "triton", "compile": True},
    "ours-kernels-sdpa-compile": {"kernels": True, "attention": "sdpa", "compile": True},
    "ours-kernels-sdpa-compile-triton": {"kernels": True, "attention": "sdpa", "compile": True, "backend": "triton"},
}
PEERS = ("lightning-sdpa", "lightning-sdpa-compile")


def _bench_train() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_llmopt_bench_train", Path(__file__).parent / "bench_train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _module(preset: str, variant: dict[str, Any], seq_len: int, total_steps: int) -> Any:
    import torch

    from lightning_llmopt import CausalLMModule
    from lightning_llmopt.models import LlamaConfig

    overrides: dict[str, Any] = {"attn_backend": variant["attention"]}
    if variant["kernels"]:
        overrides["fused_kernels"] = ["all"]
    if LlamaConfig.from_preset(preset).max_seq_len < seq_len:
        overrides["max_seq_len"] = seq_len
    compile_blocks = variant["compile"]

    class Module(CausalLMModule):
        def configure_model(self) -> None:
            super().configure_model()
            if compile_blocks and self.model is not None and not getattr(self, "_blocks_compiled", False):
                for block in self.model.layers.values():
                    block.compile()  # the same code for every block: one compilation, reused
                self._blocks_compiled = True

    module = Module(model=preset, model_overrides=overrides, warmup_steps=2, max_steps=total_steps)
    if compile_blocks and not variant["kernels"]:
        module.loss_fn = torch.compile(CausalLMModule.loss_fn)  # type: ignore[method-assign]
    return module


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch

    from lightning_llmopt.testing.data import RandomTokens

    bt = _bench_train()
    smoke = args.smoke
    cuda = torch.cuda.is_available() and not smoke
    if not smoke and not cuda:
        raise SystemExit("needs a CUDA GPU (use --smoke for a CPU check of the code path)")
    torch.set_float32_matmul_precision("high")
    torch._dynamo.config.cache_size_limit = 64  # 22 blocks share one compiled graph; never fall back to eager
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 64
    L.seed_everything(0, verbose=False)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*GPU available but not used.*")
    gemm_n = 256 if smoke else 8192
    gemm = bt._load_bench_ceilings().gemm_tflops(
        gemm_n, torch.float32 if smoke else torch.bfloat16, "cuda" if cuda else "cpu"
    )
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    variant = VARIANTS[args.worker]
    batch, seq_len = args.micro_batch_size, args.seq_len
    total = args.warmup_steps + args.steps
    module = _module(args.preset, variant, seq_len, total)
    data = RandomTokens(module.config.vocab_size, seq_len, total * batch, seed=1234)
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=False, num_workers=0, pin_memory=cuda)
    timer = bt._step_timer(skip=args.warmup_steps)
    callbacks: list[Any] = [timer]
    if args.profile and args.warmup_steps > 1:  # the last warm-up step, ahead of the timer: no timed step is touched
        import launch

        callbacks.insert(0, launch.profile_callback(args.warmup_steps - 1, 1, cuda, rows=45))
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        precision="bf16-mixed" if cuda else "32-true",
        max_steps=total,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    trainer.fit(module, train_dataloaders=loader)
    step_s = statistics.median(timer.interval_s or timer.compute_s)
    flops_per_token = float(module.model.flops_per_token(seq_len))
    tokens_per_s = batch * seq_len / step_s
    tflops = flops_per_token * tokens_per_s / 1e12
    row: dict[str, Any] = {
        "variant": args.worker,
        "micro_batch": batch,
        "median_step_ms": step_s * 1e3,
        "tokens_per_s": tokens_per_s,
        "model_tflops": tflops,
        "mfu_vs_measured_gemm": tflops / gemm["tflops"],
        "mfu_vs_datasheet": tflops / DATASHEET_BF16_TFLOPS,
        "timed_steps": len(timer.interval_s or timer.compute_s),
        "gemm_tflops": gemm["tflops"],
        "params": module.model.num_params(),
        "flops_per_token": flops_per_token,
        "fused": dict(getattr(module.model, "llmopt_fused", {})),
        # the same data and seed in every variant: a sanity check that the kernels train the same model
        "final_loss": float(trainer.callback_metrics.get("train/loss", float("nan"))),
    }
    if cuda:
        row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return row


def _worker_main(args: argparse.Namespace) -> int:
    import torch

    try:
        row = run_variant(args)
    except torch.cuda.OutOfMemoryError as err:
        print(f"out of memory at micro-batch {args.micro_batch_size}: {err}", file=sys.stderr)
        return OOM_EXIT_CODE
    Path(args.json_out).write_text(json.dumps(row, default=str))
    return 0


def _run(args: argparse.Namespace, name: str, batch: int) -> tuple[int, dict | None]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            name,
            "--preset",
            args.preset,
            "--micro-batch-size",
            str(batch),
            "--seq-len",
            str(args.seq_len),
            "--warmup-steps",
            str(args.warmup_steps),
            "--steps",
            str(args.steps),
            "--json-out",
            str(out),
        ]
        cmd += ["--smoke"] if args.smoke else []
        cmd += ["--profile"] if args.profile else []
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if args.smoke:
            env.setdefault("TRITON_INTERPRET", "1")
        if VARIANTS[name].get("backend"):
            env["LLMOPT_FUSED_BACKEND"] = VARIANTS[name]["backend"]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        try:
            proc = subprocess.run(cmd, env=env, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"[{name}] timed out after {args.timeout} s", file=sys.stderr)
            return 124, None
        return proc.returncode, (json.loads(out.read_text()) if proc.returncode == 0 and out.exists() else None)


def _write(
    args: argparse.Namespace, names: list[str], rows: list[dict[str, Any]], notes: list[str], out_dir: Path | None
) -> Path:
    """The record of the variants measured so far, with ratios of ours against both peers (tokens/s)."""
    results = [r for r in rows if r["variant"] not in PEERS]
    peers = [r for r in rows if r["variant"] in PEERS]
    first = rows[0] if rows else {}
    record = records.make_record(
        f"e2e-kernels-{args.preset}",
        benchmark="e2e",
        ratio_metric=None,
        results=results,
        peers=peers,
        config={
            "preset": args.preset,
            "seq_len": args.seq_len,
            "micro_batch": args.micro_batch or 4,
            "precision": "bf16-mixed",
            "warmup_steps": args.warmup_steps,
            "timed_steps": args.steps,
            "params": first.get("params"),
            "flops_per_token": first.get("flops_per_token"),
            "variants": {n: VARIANTS[n] for n in names},
        },
        ceilings={f"gemm_{256 if args.smoke else 8192}_tflops": max((r["gemm_tflops"] for r in rows), default=0.0)},
        reference={"datasheet_bf16_dense_tflops": DATASHEET_BF16_TFLOPS},
        notes=notes
        + [
            "each variant in its own process; step = wall time between consecutive batch ends, median "
            "after warm-up; GEMM ceiling measured in each variant's process (the record shows the max)"
        ],
    )
    record["ratios"] = records.compute_ratios(results, peers, "tokens_per_s") + records.compute_ratios(
        results, peers, "peak_allocated_gib"
    )
    for r in record["ratios"]:
        print(f"{r['variant']} vs {r['peer']}: {r['ratio']:.3f}x {r['metric']}", flush=True)
    return records.write_record(record, out_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="1b training: our fused kernels vs plain Lightning and torch.compile.")
    p.add_argument("--variants", default=None, help=f"comma-separated subset of {list(VARIANTS)}")
    p.add_argument("--preset", default=None, help="model preset (default 1b; tiny with --smoke)")
    p.add_argument("--micro-batch", type=int, default=None, help="rows per step (default 4; 2 with --smoke)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 4096; 64 with --smoke)")
    p.add_argument("--warmup-steps", type=int, default=None, help="untimed steps (default 4; 1 with --smoke)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 12; 2 with --smoke)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per variant process")
    p.add_argument("--results-dir", type=Path, default=None, help="default benchmarks/results (temp with --smoke)")
    p.add_argument("--smoke", action="store_true", help="CPU, fp32, tiny preset, Triton interpreter")
    p.add_argument(
        "--profile",
        action="store_true",
        help="print each variant's top kernels over its last warm-up step (torch.profiler)",
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--micro-batch-size", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.preset = args.preset or ("tiny" if args.smoke else "1b")
    args.seq_len = args.seq_len or (64 if args.smoke else 4096)
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (1 if args.smoke else 4)
    args.steps = args.steps if args.steps is not None else (2 if args.smoke else 12)
    if args.worker:
        return _worker_main(args)
    names = args.variants.split(",") if args.variants else list(VARIANTS)
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    out_dir = args.results_dir or (Path(tempfile.mkdtemp(prefix="llmopt-bench-")) if args.smoke else None)
    path = None
    for name in names:
        batch = args.micro_batch or (2 if args.smoke else 4)
        while True:
            print(f"[{name}] micro-batch {batch}, seq {args.seq_len}", flush=True)
            code, row = _run(args, name, batch)
            if code == OOM_EXIT_CODE and batch > 1:
                notes.append(f"{name}: out of memory at micro-batch {batch}, retried with {batch // 2}")
                batch = max(1, math.floor(batch / 2))
                continue
            break
        if row is None:
            notes.append(f"{name}: failed (exit {code})")
        else:
            rows.append(row)
            print(json.dumps(row), flush=True)
        path = _write(args, names, rows, notes, out_dir)  # after every variant: a later kill keeps the rest
    print(f"{'variant':>24} {'B':>2} {'step ms':>9} {'tok/s':>9} {'TFLOP/s':>8} {'MFU/gemm':>8} {'peak GiB':>8}")
    for r in rows:
        print(
            f"{r['variant']:>24} {r['micro_batch']:>2} {r['median_step_ms']:>9.1f} {r['tokens_per_s']:>9,.0f} "
            f"{r['model_tflops']:>8.1f} {r['mfu_vs_measured_gemm']:>8.1%} {r.get('peak_allocated_gib', 0):>8.1f}"
        )
    print(f"wrote {path}")
    return 0 if len(rows) == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
