"""One ``torchrun`` launch per benchmark variant: environment, log streaming, time limit, and the row it wrote.

Used by ``bench_zero.py`` and ``bench_nd_parallel.py`` (loaded by path like ``records.py``; ``benchmarks`` is not a
package). A worker writes its JSON row on rank 0, or ``<row>.err<rank>`` with ``{"error", "oom"}`` when it fails
(:func:`worker_main`); :func:`launch` turns either into the variant's row.
"""

from __future__ import annotations

import heapq
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
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``torchrun --standalone --nproc-per-node=nproc script *worker_args(json_out)``; returns the row it wrote, or
    ``{"variant", "error", "oom", **extra}``. Output goes to ``log_path`` and to stdout with a ``[variant]`` prefix;
    after ``timeout`` seconds the whole process group is terminated. ``env`` adds variables to the launch's
    environment (e.g. ``CUDA_VISIBLE_DEVICES`` for launches that share a host side by side)."""
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
            env={**child_env(nproc), **(env or {})},
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        reader = threading.Thread(target=_stream, args=(proc, log, f"[{variant}] "), daemon=True)
        reader.start()

        def stop() -> None:
            os.killpg(proc.pid, signal.SIGTERM)  # torchrun and its workers: the session we started
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            stop()
        except BaseException:  # interrupted (a step's time limit): the workers must not outlive us holding GPUs
            stop()
            raise
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


def device_intervals(
    prof: Any, exclude: tuple[str, ...] = ()
) -> tuple[float, float, list[tuple[float, float, str, str]]]:
    """``(wall, busy, gaps)`` in microseconds over a ``torch.profiler`` run's device kernels and copies (any stream):
    ``wall`` from the first start to the last end, ``busy`` the union of their intervals, ``gaps`` the idle stretches
    as ``(length, offset from the first start, kernel before, kernel after)``. Kernels whose name starts with one of
    ``exclude`` (e.g. ``"nccl"``: a collective kernel spins while it waits for its peer) do not count as busy.
    Device-side ``record_function`` ranges (FSDP's ``FullyShardedDataParallel.forward``, ``FSDP::all_gather``) are
    not work: they span the gaps inside them, so counting them hid most of the idle time (fixed 2026-11-22)."""
    spans = []
    for evt in prof.events():
        if _device_work(evt) and evt.time_range.elapsed_us() > 0:
            if not evt.name.lower().startswith(exclude):
                spans.append((evt.time_range.start, evt.time_range.end, evt.name))
    if not spans:
        return 0.0, 0.0, []
    spans.sort()
    busy, cur_s, cur_e, last = 0.0, spans[0][0], spans[0][1], spans[0][2]
    gaps = []
    for s, e, name in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((s - cur_e, cur_e - spans[0][0], last, name))
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
        if e >= cur_e:
            last = name
    busy += cur_e - cur_s
    return max(e for _, e, _ in spans) - spans[0][0], busy, gaps


def _on_device(evt: Any) -> bool:
    return str(getattr(evt, "device_type", "")).endswith("CUDA")


def _device_work(evt: Any) -> bool:
    """A kernel, copy or memset on the device; not a ``record_function`` range mirrored onto the device timeline."""
    return _on_device(evt) and not getattr(evt, "is_user_annotation", False)


_RUNTIME = ("aten::", "cuda", "cu", "Memcpy", "Memset", "Activity Buffer", "PyTorch Profiler", "ProfilerStep")


def idle_by_host_scope(prof: Any, min_gap_us: float = 10.0) -> dict[str, tuple[float, int]]:
    """What the host was inside while no device kernel ran: ``{scope: (idle microseconds, gaps)}``.

    Device gaps of at least ``min_gap_us`` (all kernels and copies count as busy, NCCL included) are each charged
    to the most recently entered host scope that was open at the gap's midpoint, on any thread: ``record_function``
    labels such as FSDP2's ``FSDP::pre_forward (layers.3)``, ``Optimizer.step#AdamW.step``, Lightning's hooks, or
    Python-level ops; aten operators and CUDA runtime calls are skipped in favour of the scope around them (their
    names say little about who called them). Gaps with no open scope go to ``"(none)"``."""
    spans, scopes = [], []
    for evt in prof.events():
        start, end = evt.time_range.start, evt.time_range.end
        if _device_work(evt):
            if end > start:
                spans.append((start, end))
        elif not _on_device(evt) and not evt.name.startswith(_RUNTIME):
            scopes.append((start, end, evt.name))
    spans.sort()
    scopes.sort()
    gaps = []  # (midpoint, length), in time order
    cur_end = spans[0][1] if spans else 0.0
    for s, e in spans[1:]:
        if s - cur_end >= min_gap_us:
            gaps.append(((s + cur_end) / 2, s - cur_end))
        cur_end = max(cur_end, e)
    out: dict[str, tuple[float, int]] = {}
    heap: list[tuple[float, float, str]] = []  # (-start, end, name) of the scopes opened so far
    i = 0
    for mid, length in gaps:  # sweep: the open scope entered last is the heap's top once closed ones are dropped
        while i < len(scopes) and scopes[i][0] <= mid:
            heapq.heappush(heap, (-scopes[i][0], scopes[i][1], scopes[i][2]))
            i += 1
        while heap and heap[0][1] < mid:
            heapq.heappop(heap)  # closed before this gap, so before every later one
        label = heap[0][2] if heap else "(none)"
        total, count = out.get(label, (0.0, 0))
        out[label] = (total + length, count + 1)
    return out


def _gpu_idle_summary(prof: Any, steps: int) -> str:
    """Per step: wall time from the first to the last device kernel of the profiled window, the time some kernel
    (any stream) was running, the idle remainder (host-bound or waiting), and the longest idle stretches."""
    wall, busy, gaps = device_intervals(prof)
    if not wall:
        return "profile: no device kernels recorded"
    lines = [
        f"profile: per step {wall / steps / 1e3:.2f} ms from first to last kernel, {busy / steps / 1e3:.2f} ms "
        f"with a kernel running, {(wall - busy) / steps / 1e3:.2f} ms idle ({(wall - busy) / wall:.1%})"
    ]
    for length, at, before, after in sorted(gaps, reverse=True)[:12]:
        lines.append(
            f"  idle {length / 1e3:7.3f} ms at {at / 1e3:8.2f} ms: after {before[:60]!r} before {after[:60]!r}"
        )
    by_scope = sorted(idle_by_host_scope(prof).items(), key=lambda kv: -kv[1][0])
    if by_scope:
        lines.append("idle by host scope (gaps >= 10 us, charged to the innermost open scope at their midpoint):")
        for name, (total, count) in by_scope[:15]:
            lines.append(f"  {total / steps / 1e3:7.3f} ms/step in {count:5d} gaps: {name[:90]}")
    return "\n".join(lines)


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
                    averages = self.prof.key_averages()
                    print(averages.table(sort_by=key, row_limit=rows), flush=True)
                    if cuda:  # where the host, not the GPU, sets the pace (launch-bound phases)
                        print(averages.table(sort_by="cpu_time_total", row_limit=rows), flush=True)
                        print(_gpu_idle_summary(self.prof, steps), flush=True)
                    trace_dir = os.environ.get("LLMOPT_PROFILE_TRACE")
                    if trace_dir:  # the whole timeline, for chrome://tracing or Perfetto (gzip: a few MB)
                        import gzip
                        import shutil

                        Path(trace_dir).mkdir(parents=True, exist_ok=True)
                        raw = Path(trace_dir) / f"trace-{os.getpid()}.json"
                        self.prof.export_chrome_trace(str(raw))
                        with raw.open("rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
                            shutil.copyfileobj(src, dst)
                        raw.unlink()
                        print(f"profile: trace written to {raw}.gz", flush=True)
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
