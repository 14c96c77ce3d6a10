"""One ``torchrun`` launch per benchmark variant: environment, log streaming, time limit, and the row it wrote.

Used by ``bench_zero.py`` and ``bench_nd_parallel.py`` (loaded by path like ``records.py``; ``benchmarks`` is not a
package). A worker writes its JSON row on rank 0, or ``<row>.err<rank>`` with ``{"error", "oom"}`` when it fails
(:func:`worker_main`); :func:`launch` turns either into the variant's row.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
# NVLink multicast stays off on the shared multi-GPU hosts (device KINDS.md).
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def child_env(nproc: int) -> dict[str, str]:
    """The launch's environment: unbuffered output, NVLS off, a few CPU threads per rank, the repo importable.

    torchrun would set one thread per rank, which makes the CPU-side model construction slow."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **NVLS_OFF)
    env.setdefault("OMP_NUM_THREADS", str(max(1, min(8, (os.cpu_count() or 2) // (2 * nproc)))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def _stream(proc: subprocess.Popen, log: Any, prefix: str) -> None:
    assert proc.stdout is not None
    for line in iter(proc.stdout.readline, ""):
        log.write(line)
        sys.stdout.write(f"{prefix}{line}")
    sys.stdout.flush()


def worker_main(run: Callable[[Any], dict[str, Any]], args: Any) -> int:
    """Run one rank's ``run(args)``; rank 0 writes the row to ``args.json_out``. On failure every failing rank writes
    ``<json_out>.err<rank>`` and exits at once (no teardown: other ranks may be blocked in a collective)."""
    import torch

    rank = int(os.environ.get("RANK", "0"))
    try:
        row = run(args)
    except BaseException as err:  # noqa: BLE001 - recorded, then this rank exits so torchrun ends the others
        oom = isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()
        message = f"{'OOM' if oom else type(err).__name__} on rank {rank}: {str(err).strip()[:600]}"
        traceback.print_exc()
        if args.json_out:
            Path(f"{args.json_out}.err{rank}").write_text(json.dumps({"error": message, "oom": oom}))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3 if oom else 1)
    if rank == 0 and args.json_out:
        Path(args.json_out).write_text(json.dumps(row, default=str))
    return 0


def launch(
    script: str,
    worker_args: Callable[[Path], list[str]],
    variant: str,
    nproc: int,
    log_path: Path,
    timeout: float,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``torchrun --standalone --nproc-per-node=nproc script *worker_args(json_out)``; returns the row it wrote, or
    ``{"variant", "error", "oom", **extra}``. Output goes to ``log_path`` and to stdout with a ``[variant]`` prefix;
    after ``timeout`` seconds the whole process group is terminated."""
    tmp = Path(tempfile.mkdtemp(prefix=f"llmopt-{variant}-"))
    out = tmp / "row.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(Path(script).resolve()),
        *worker_args(out),
    ]
    print(f"[{variant}] torchrun x{nproc} (log {log_path})", flush=True)
    start = time.perf_counter()
    timed_out = False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            env=child_env(nproc),
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        reader = threading.Thread(target=_stream, args=(proc, log, f"[{variant}] "), daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGTERM)  # torchrun and its workers: the session we started
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        reader.join(timeout=10)
    if proc.returncode == 0 and out.exists():
        row = json.loads(out.read_text())
    else:
        errors = [json.loads(p.read_text()) for p in sorted(tmp.glob("row.json.err*"))]
        oom = any(e.get("oom") for e in errors)
        if timed_out:
            error = f"timed out after {timeout:.0f} s"
        elif errors:
            error = next((e["error"] for e in errors if e.get("oom")), errors[0]["error"])
        else:
            tail = [ln.strip() for ln in log_path.read_text().splitlines() if ln.strip()]
            hint = next((ln for ln in reversed(tail) if "rror" in ln), tail[-1] if tail else "")
            error = f"exit code {proc.returncode}: {hint[:400]}"
        row = {"variant": variant, "error": error, "oom": oom, **(extra or {})}
        print(f"[{variant}] FAILED: {error}", flush=True)
    row["launch_wall_s"] = round(time.perf_counter() - start, 1)
    return row


def profile_callback(start_step: int, steps: int, cuda: bool, rows: int = 30) -> Any:
    """A callback that runs ``torch.profiler`` over ``steps`` training steps from ``start_step`` and prints, on rank
    0, the top ``rows`` operators by device (or CPU) self time: where a slow variant spends its step."""
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback

    class Profile(Callback):
        def __init__(self) -> None:
            self.prof: Any = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == start_step:
                acts = [torch.profiler.ProfilerActivity.CPU]
                if cuda:
                    acts.append(torch.profiler.ProfilerActivity.CUDA)
                self.prof = torch.profiler.profile(activities=acts)
                self.prof.__enter__()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.prof is not None and batch_idx == start_step + steps - 1:
                if cuda:
                    torch.cuda.synchronize()
                self.prof.__exit__(None, None, None)
                if not dist.is_initialized() or dist.get_rank() == 0:
                    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
                    print(self.prof.key_averages().table(sort_by=key, row_limit=rows), flush=True)
                self.prof = None

    return Profile()


def measure_callback(warmup: int, cuda: bool) -> Any:
    """A callback timing steps (batch end to batch end after ``warmup`` steps; CUDA-synchronised) and recording
    per-rank peak memory; ``summary`` is gathered over ranks at the end of training."""
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    class Measure(Callback):
        """Step wall times (batch end -> batch end, after ``warmup`` steps) and per-rank peak memory, gathered at the
        end of training while the process group is still up: ``summary`` (same on every rank)."""

        def __init__(self) -> None:
            self.ends: list[float] = []
            self.start_compute: float = 0.0
            self.compute: list[float] = []
            self.losses: list[float] = []
            self.summary: dict[str, Any] = {}

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            sync()
            self.start_compute = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            sync()
            now = time.perf_counter()
            self.ends.append(now)
            if len(self.ends) > warmup:
                self.compute.append(now - self.start_compute)
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            if isinstance(loss, torch.Tensor):
                self.losses.append(float(loss.detach().float()))

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
            world, rank = dist.get_world_size(), dist.get_rank()
            ends = self.ends[warmup:]
            intervals = [b - a for a, b in zip(ends[:-1], ends[1:], strict=True)] or self.compute
            # Per step: the slowest rank's time (all ranks run the same number of steps).
            steps = torch.tensor(intervals, dtype=torch.float64, device=device)
            dist.all_reduce(steps, op=dist.ReduceOp.MAX)
            comp = torch.tensor(self.compute, dtype=torch.float64, device=device)
            dist.all_reduce(comp, op=dist.ReduceOp.MAX)
            mem = torch.zeros(world, 2, dtype=torch.float64, device=device)
            if cuda:
                mem[rank, 0] = torch.cuda.max_memory_allocated()
                mem[rank, 1] = torch.cuda.max_memory_reserved()
            dist.all_reduce(mem)  # each rank fills its own row
            self.summary = {
                "step_s": steps.tolist(),
                "compute_s": comp.tolist(),
                "allocated": mem[:, 0].tolist(),
                "reserved": mem[:, 1].tolist(),
                "losses": self.losses,
            }

    return Measure()
