"""Single-GPU training throughput of plain Lightning + ``CausalLMModule``: the baseline later work is measured against.

For each preset (default ``125m 1b``), in its own process: measure the bf16 GEMM ceiling (one 8192^3 matmul), then
train on random tokens with ``Trainer(accelerator="gpu", devices=1, precision="bf16-mixed")`` and time the steady
state. Reports the median step time, tokens/s, model TFLOP/s (``Llama.flops_per_token``: 6N + causal attention),
MFU against the measured GEMM ceiling and against the 989 TFLOP/s datasheet, and peak memory. One record per preset
in ``benchmarks/results/train-<preset>-<device>.json``.

    python benchmarks/bench_train.py                      # 125m and 1b, seq 4096, on one GPU
    python benchmarks/bench_train.py 1b --micro-batch 1b=2 --steps 30
    python benchmarks/bench_train.py --smoke              # CPU, preset "tiny", seq 64, 3 steps: code path only

A preset that runs out of memory is retried with half the micro-batch (noted in its record).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package
import records  # noqa: E402

from lightning_llmopt.testing.data import RandomTokens  # noqa: E402

DATASHEET_BF16_TFLOPS = 989.0  # H100/H200 SXM dense bf16
DEFAULT_MICRO_BATCH = {"125m": 8, "1b": 4, "tiny": 2, "debug-1m": 2}
OOM_EXIT_CODE = 3
REPO_ROOT = Path(__file__).resolve().parent.parent




# --------------------------------------------------------------------------- worker: one preset in this process




def _step_timer(skip: int) -> Any:
    import torch
    from lightning.pytorch.callbacks import Callback

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    class StepTimer(Callback):
        """Per step: compute time (batch start -> end) and wall interval (end -> end, includes data loading)."""

        def __init__(self) -> None:
            self.compute_s: list[float] = []
            self.interval_s: list[float] = []
            self._start = 0.0
            self._last_end: float | None = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            sync()
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            sync()
            now = time.perf_counter()
            if batch_idx >= skip:
                self.compute_s.append(now - self._start)
                if self._last_end is not None:
                    self.interval_s.append(now - self._last_end)
            self._last_end = now

    return StepTimer()


def _build_module(preset: str, seq_len: int, total_steps: int) -> Any:
    from lightning_llmopt import CausalLMModule
    from lightning_llmopt.models import LlamaConfig

    config = LlamaConfig.from_preset(preset)
    overrides = {"max_seq_len": seq_len} if config.max_seq_len < seq_len else {}
    kwargs: dict[str, Any] = {"warmup_steps": 2, "max_steps": total_steps}
    if overrides and "model_overrides" in inspect.signature(CausalLMModule).parameters:
        kwargs["model_overrides"] = overrides
        model: Any = preset
    else:
        model = LlamaConfig.from_preset(preset, **overrides)
    return CausalLMModule(model=model, **kwargs), config.vocab_size


def run_preset(args: argparse.Namespace) -> dict[str, Any]:
    """Train one preset in this process, write its record, return its summary row."""
    import lightning as L
    import torch
    ceilings_mod = _load_bench_ceilings()
    smoke = args.smoke
    cuda = torch.cuda.is_available() and not smoke
    if not smoke and not cuda:
        raise SystemExit("bench_train needs a CUDA GPU (use --smoke for a CPU check of the code path)")
    torch.set_float32_matmul_precision("high")
    L.seed_everything(0, verbose=False)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*GPU available but not used.*")

    gemm_n = 256 if smoke else 8192
    gemm = ceilings_mod.gemm_tflops(gemm_n, torch.float32 if smoke else torch.bfloat16, "cuda" if cuda else "cpu")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    preset, seq_len, batch = args.worker, args.seq_len, args.micro_batch_size
    total_steps = args.warmup_steps + args.steps
    module, vocab_size = _build_module(preset, seq_len, total_steps)
    dataset = RandomTokens(vocab_size, seq_len, total_steps * batch, seed=1234)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=False, num_workers=0, pin_memory=cuda)
    timer = _step_timer(skip=args.warmup_steps)
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        precision="bf16-mixed" if cuda else "32-true",
        max_steps=total_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[timer],
    )
    trainer.fit(module, train_dataloaders=loader)

    step_s = statistics.median(timer.interval_s or timer.compute_s)
    tokens_per_step = batch * seq_len
    flops_per_token = float(module.model.flops_per_token(seq_len))
    tokens_per_s = tokens_per_step / step_s
    model_tflops = flops_per_token * tokens_per_s / 1e12
    result: dict[str, Any] = {
        "variant": "lightning-bf16-mixed" if cuda else "lightning-cpu-32",
        "median_step_ms": step_s * 1e3,
        "median_compute_ms": statistics.median(timer.compute_s) * 1e3,
        "tokens_per_s": tokens_per_s,
        "model_tflops": model_tflops,
        "mfu_vs_measured_gemm": model_tflops / gemm["tflops"],
        "mfu_vs_datasheet": model_tflops / DATASHEET_BF16_TFLOPS,
        "timed_steps": len(timer.interval_s or timer.compute_s),
    }
    if cuda:
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    notes = ["steady-state median over steps after warm-up; step = wall time between consecutive batch ends"]
    if args.requested_micro_batch and args.requested_micro_batch != batch:
        notes.append(f"micro-batch reduced from {args.requested_micro_batch} to {batch} after running out of memory")
    config = {
        "preset": preset,
        "params": module.model.num_params(),
        "flops_per_token": flops_per_token,
        "seq_len": seq_len,
        "micro_batch": batch,
        "tokens_per_step": tokens_per_step,
        "warmup_steps": args.warmup_steps,
        "timed_steps": args.steps,
        "precision": trainer.precision,
        "attn_backend": getattr(module.config, "attn_backend", None),
        "model": {k: getattr(module.config, k) for k in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads")},
    }
    record = records.make_record(
        f"train-{preset}",
        config=config,
        results=[result],
        benchmark="train",
        ratio_metric=None,
        ceilings={f"gemm_{gemm_n}_tflops": gemm["tflops"]},
        reference={"datasheet_bf16_dense_tflops": DATASHEET_BF16_TFLOPS},
        notes=notes,
    )
    path = records.write_record(record, args.results_dir)
    return {"preset": preset, "record": str(path), "gemm_tflops": gemm["tflops"], **config, **result}


def _load_bench_ceilings() -> ModuleType:
    path = Path(__file__).resolve().parent / "bench_ceilings.py"
    spec = importlib.util.spec_from_file_location("_llmopt_bench_ceilings", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _worker_main(args: argparse.Namespace) -> int:
    import torch

    try:
        row = run_preset(args)
    except torch.cuda.OutOfMemoryError as err:
        print(f"out of memory at micro-batch {args.micro_batch_size}: {err}", file=sys.stderr)
        return OOM_EXIT_CODE
    Path(args.json_out).write_text(json.dumps(row, default=str))
    return 0


# --------------------------------------------------------------------------- driver: one process per preset


def _parse_micro_batch(spec: str | None) -> dict[str, int]:
    sizes = dict(DEFAULT_MICRO_BATCH)
    for item in filter(None, (spec or "").split(",")):
        name, _, value = item.partition("=")
        if not value.isdigit() or int(value) < 1:
            raise SystemExit(f"--micro-batch entries look like 125m=8, got {item!r}")
        sizes[name.strip()] = int(value)
    return sizes


def _run_one(args: argparse.Namespace, preset: str, batch: int, results_dir: Path) -> tuple[int, dict | None]:
    requested = _parse_micro_batch(args.micro_batch).get(preset, 4)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            preset,
            "--micro-batch-size",
            str(batch),
            "--requested-micro-batch",
            str(requested),
            "--seq-len",
            str(args.seq_len),
            "--warmup-steps",
            str(args.warmup_steps),
            "--steps",
            str(args.steps),
            "--results-dir",
            str(results_dir),
            "--json-out",
            str(out),
        ] + (["--smoke"] if args.smoke else [])
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        try:
            proc = subprocess.run(cmd, env=env, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"[{preset}] timed out after {args.timeout} s", file=sys.stderr)
            return 124, None
        row = json.loads(out.read_text()) if proc.returncode == 0 and out.exists() else None
        return proc.returncode, row


def _print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'preset':>8} {'B':>3} {'T':>5} {'step ms':>9} {'tok/s':>10} {'TFLOP/s':>8} {'GEMM':>7} "
        f"{'MFU/gemm':>8} {'MFU/989':>8} {'peak GiB':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        peak = r.get("peak_allocated_gib", float("nan"))
        print(
            f"{r['preset']:>8} {r['micro_batch']:>3} {r['seq_len']:>5} {r['median_step_ms']:>9.1f} "
            f"{r['tokens_per_s']:>10,.0f} {r['model_tflops']:>8.1f} {r['gemm_tflops']:>7.1f} "
            f"{r['mfu_vs_measured_gemm']:>8.1%} {r['mfu_vs_datasheet']:>8.1%} {peak:>8.1f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Single-GPU Lightning training throughput per model preset.")
    parser.add_argument("presets", nargs="*", help="model presets (default: 125m 1b; tiny with --smoke)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 4096; 64 with --smoke)")
    parser.add_argument("--micro-batch", default=None, help="per-preset micro-batch, e.g. '125m=8,1b=4'")
    parser.add_argument("--warmup-steps", type=int, default=None, help="untimed steps (default 5; 1 with --smoke)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 20; 2 with --smoke)")
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds per preset process")
    parser.add_argument("--results-dir", type=Path, default=None, help="default benchmarks/results (temp w/ smoke)")
    parser.add_argument("--smoke", action="store_true", help="CPU, fp32, tiny preset: checks the code path only")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--micro-batch-size", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--requested-micro-batch", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.seq_len = args.seq_len or (64 if args.smoke else 4096)
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (1 if args.smoke else 5)
    args.steps = args.steps if args.steps is not None else (2 if args.smoke else 20)
    if args.worker is not None:
        return _worker_main(args)

    presets = args.presets or (["tiny"] if args.smoke else ["125m", "1b"])
    results_dir = args.results_dir or (
        Path(tempfile.mkdtemp(prefix="llmopt-bench-")) if args.smoke else REPO_ROOT / "benchmarks" / "results"
    )
    sizes = _parse_micro_batch(args.micro_batch)
    rows, failed = [], []
    for preset in presets:
        batch = sizes.get(preset, 4)
        while True:
            print(f"[{preset}] micro-batch {batch}, seq {args.seq_len}", flush=True)
            code, row = _run_one(args, preset, batch, results_dir)
            if code == OOM_EXIT_CODE and batch > 1:
                batch = max(1, math.floor(batch / 2))
                continue
            break
        if row is None:
            failed.append(f"{preset} (exit {code})")
        else:
            rows.append(row)
    if rows:
        _print_table(rows)
        print(f"records in {results_dir}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
