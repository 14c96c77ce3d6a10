"""Largest model that trains on one GPU with ``zero3_offload``, against the largest with ``zero3`` (issue 3).

Models: the ``llama2-7b`` shape (dim 4096, 32 heads, FFN 11008, vocab 32000) with its layer count varied, so the size
grows in steps of one block (~202M parameters). Each attempt runs in its own process: ``Trainer(devices=1,
strategy=ZeroStrategy(stage=3[, offload]), precision="bf16-mixed")``, full activation checkpointing, micro-batch 1,
sequence 2048, AdamW, two optimizer steps on random tokens. An attempt passes when both steps finish with a finite
loss; it fails on a CUDA out-of-memory error, a host out-of-memory kill, or its time limit.

For each mode the layer counts are tried from the largest candidate down; the first that passes is the answer
(the next larger candidate failed, so it bounds the largest from above). One record,
``benchmarks/results/offload-llama2-7b-shape-<device>.json``, with every attempt, peak GPU memory and host RSS.

    python benchmarks/bench_offload.py                       # on one GPU
    python benchmarks/bench_offload.py --plain 22 20 18 --offload 32 28 24
    python benchmarks/bench_offload.py --smoke               # CPU, tiny shapes: code path only
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package
import records  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
_GIB = 2**30


def _config(layers: int, smoke: bool) -> Any:
    from lightning_llmopt.models import LlamaConfig

    if smoke:
        return LlamaConfig.from_preset("tiny", n_layers=layers)
    return LlamaConfig.from_preset("llama2-7b", n_layers=layers, max_seq_len=4096)


def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback

    from lightning_llmopt import CausalLMModule
    from lightning_llmopt.callbacks import ActivationCheckpointing
    from lightning_llmopt.strategies import ZeroStrategy
    from lightning_llmopt.testing.data import RandomTokens

    cuda = not args.smoke
    config = _config(args.layers, args.smoke)
    module = CausalLMModule(config, warmup_steps=1, max_steps=args.steps)
    seq = 64 if args.smoke else args.seq_len
    data = RandomTokens(config.vocab_size, seq, args.steps, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=1)
    times: list[float] = []
    losses: list[float] = []

    class Timer(Callback):
        def on_train_batch_start(self, *a: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *a: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t)
            losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

    strategy = ZeroStrategy(stage=3, offload_optimizer=args.offload, offload_parameters=args.offload)
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[ActivationCheckpointing("full", report=False), Timer()],
    )
    trainer.fit(module, train_dataloaders=loader)
    if len(losses) < args.steps or not all(torch.isfinite(torch.tensor(losses))):
        raise RuntimeError(f"training did not finish {args.steps} finite steps: losses {losses}")
    return {
        "layers": args.layers,
        "step_s": times,
        "losses": losses,
        "peak_gpu_allocated_gib": torch.cuda.max_memory_allocated() / _GIB if cuda else None,
        "peak_gpu_reserved_gib": torch.cuda.max_memory_reserved() / _GIB if cuda else None,
        "peak_host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / _GIB,
    }


def _worker_main(args: argparse.Namespace) -> int:
    import torch

    try:
        row = run_worker(args)
    except BaseException as err:  # noqa: BLE001 - recorded by the driver
        oom = isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()
        Path(args.json_out).write_text(json.dumps({"error": f"{type(err).__name__}: {str(err)[:400]}", "oom": oom}))
        os._exit(3 if oom else 1)
    Path(args.json_out).write_text(json.dumps(row))
    return 0


def attempt(args: argparse.Namespace, layers: int, offload: bool) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="llmopt-offload-")) / "row.json"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--layers",
        str(layers),
        "--steps",
        str(args.steps),
        "--seq-len",
        str(args.seq_len),
        "--json-out",
        str(out),
    ]
    cmd += ["--offload-mode"] if offload else []
    cmd += ["--smoke"] if args.smoke else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, cwd=REPO_ROOT, timeout=args.timeout, capture_output=True, text=True)
        code: int | None = proc.returncode
        tail = (proc.stdout + proc.stderr)[-1500:]
    except subprocess.TimeoutExpired:
        code, tail = None, ""
    row: dict[str, Any] = {
        "mode": "zero3_offload" if offload else "zero3",
        "layers": layers,
        "wall_s": round(time.perf_counter() - start, 1),
    }
    if out.exists():
        row.update(json.loads(out.read_text()))
    if code is None:
        row["error"] = f"timed out after {args.timeout:.0f} s"
    elif code in (-9, 137) and "error" not in row:
        row.update(error="killed (host out of memory)", oom=True)
    elif code != 0 and "error" not in row:
        row["error"] = f"exit {code}: {tail[-400:]}"
    row["params"] = _params(_config(layers, args.smoke))
    print(json.dumps({k: v for k, v in row.items() if k not in ("losses",)}), flush=True)
    return row


def search(args: argparse.Namespace, candidates: list[int], offload: bool) -> tuple[int | None, list[dict[str, Any]]]:
    rows = []
    for layers in sorted(candidates, reverse=True):
        row = attempt(args, layers, offload)
        rows.append(row)
        if "error" not in row:
            return layers, rows
    return None, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Largest model trainable on one GPU with and without zero3_offload")
    parser.add_argument("--plain", type=int, nargs="+", default=None, help="layer counts to try with zero3")
    parser.add_argument("--offload", type=int, nargs="+", default=None, help="layer counts with zero3_offload")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per attempt")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--results-dir", type=Path, default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--offload-mode", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.offload = args.offload_mode
        return _worker_main(args)
    plain = args.plain or ([3, 2] if args.smoke else [22, 20, 18, 16])
    offload = args.offload or ([3, 2] if args.smoke else [32, 28, 24])
    best_plain, rows_plain = search(args, plain, offload=False)
    best_off, rows_off = search(args, offload, offload=True)

    def params(layers: int | None) -> int | None:
        return None if layers is None else _params(_config(layers, args.smoke))

    ours = {"variant": "zero3_offload", "max_layers": best_off, "max_params": params(best_off), "attempts": rows_off}
    peer = {"variant": "zero3", "max_layers": best_plain, "max_params": params(best_plain), "attempts": rows_plain}
    ratio = (ours["max_params"] / peer["max_params"]) if ours["max_params"] and peer["max_params"] else None
    notes = [
        "largest llama2-7b-shaped model (layer count varied) that finishes two AdamW steps on one GPU; "
        "bf16-mixed, full activation checkpointing, micro-batch 1, sequence "
        f"{64 if args.smoke else args.seq_len}",
        "candidates tried largest first; the first that passes is the answer",
        *[
            _bound_note(name, rows, cands)
            for name, rows, cands in (("zero3", rows_plain, plain), ("zero3_offload", rows_off, offload))
        ],
        f"max params zero3_offload / zero3: {ratio:.2f}x" if ratio else "ratio: n/a",
    ]
    record = records.make_record(
        "offload-llama2-7b-shape" if not args.smoke else "offload-smoke",
        config={
            "shape": "llama2-7b" if not args.smoke else "tiny",
            "seq_len": args.seq_len,
            "micro_batch": 1,
            "steps": args.steps,
            "precision": "bf16-mixed",
            "activation_checkpointing": "full",
            "candidates_plain": plain,
            "candidates_offload": offload,
            "timeout_s": args.timeout,
        },
        results=[ours],
        peers=[peer],
        benchmark="offload",
        ratio_metric=None,
        notes=notes,
    )
    if ratio:
        record["ratios"] = [{"variant": "zero3_offload", "peer": "zero3", "metric": "max_params", "ratio": ratio}]
    results_dir = args.results_dir or (Path(tempfile.mkdtemp()) if args.smoke else records.RESULTS_DIR)
    path = records.write_record(record, results_dir)
    print(
        f"zero3: {best_plain} layers ({params(best_plain)} params); zero3_offload: {best_off} layers "
        f"({params(best_off)} params); record {path}"
    )
    return 0 if best_off is not None and best_plain is not None else 1


def _bound_note(mode: str, rows: list[dict[str, Any]], candidates: list[int]) -> str:
    passed = [r["layers"] for r in rows if "error" not in r]
    failed = [r for r in rows if "error" in r]
    if not passed:
        return f"{mode}: no candidate trained ({', '.join(str(r['layers']) for r in failed)} layers failed)"
    if not failed:
        return (
            f"{mode}: the largest candidate ({passed[0]} layers) trained, so it is a lower bound: "
            "no larger size was tried"
        )
    top = min(failed, key=lambda r: r["layers"])
    return f"{mode}: {passed[0]} layers trained, {top['layers']} layers failed ({top['error'][:120]})"


def _params(config: Any) -> int:
    import torch

    from lightning_llmopt.models import Llama

    with torch.device("meta"):
        return sum(p.numel() for p in Llama(config).parameters())


if __name__ == "__main__":
    sys.exit(main())
