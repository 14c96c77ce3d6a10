"""JSON benchmark records: environment capture, timing, and writing ``benchmarks/results/<name>-<device>.json``.

A record (``"schema": 1``)::

    {
      "schema": 1,
      "name": "train-125m",              # file stem, unique per benchmark instance
      "benchmark": "train",              # family; docs/results.md groups tables by it
      "date": "2025-01-01T12:00:00Z",    # UTC, seconds
      "env": {"device": "NVIDIA H100 80GB HBM3", "device_slug": "nvidia-h100-80gb-hbm3", "gpu_count": 1,
              "torch": "...", "triton": "...", "lightning": "...", "transformers": "...", "cuda": "12.8",
              "python": "3.11.7", "git_commit": "abc123...", "git_dirty": false},
      "config": {...},                   # shapes, dtypes, steps: everything needed to rerun it
      "results": [{"variant": "ours", "median_ms": 1.23, ...}],   # our figures, one dict per variant
      "peers": [{"variant": "sdpa-cudnn", "median_ms": 1.50, ...}], # peers measured in the same run
      "ratios": [{"variant": "ours", "peer": "sdpa-cudnn", "metric": "median_ms", "ratio": 1.22}],
      "ceilings": {"bf16_gemm_tflops": 750.0, "copy_tb_per_s": 3.0},  # measured in the same run
      "reference": {"datasheet_bf16_tflops": 989.0},                   # published figures, not measured
      "notes": []
    }

A ratio above 1 always means ours is better: peer/ours for metrics where lower is better (``*_ms``, ``*_s``,
``*memory*``, ``*latency*``, ``loss``...), ours/peer for rates (``*_per_s``, ``*tflops*``, ``mfu``...) and the rest.
This file is loaded by path (``benchmarks`` is not a package).
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

SCHEMA = 1
BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
REPO_ROOT = BENCH_DIR.parent

_HIGHER_IS_BETTER = re.compile(r"per_s|tflop|mfu|bandwidth|throughput|speedup|tok_s|hit_rate|accept")
_LOWER_IS_BETTER = re.compile(r"(_ms|_us|_ns|_s|_gib|_gb|_bytes)$|time|latency|memory|perplexity|loss")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def slugify(text: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def environment() -> dict[str, Any]:
    """Device and software versions of this process."""
    import torch

    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else f"CPU ({platform.processor() or platform.machine()})"
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "device": device,
        "device_slug": slugify(device) if cuda else "cpu",
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "lightning": _version("lightning"),
        "transformers": _version("transformers"),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        # The GPU machine gets a copy of the tree without .git: run_gpu.sh callers pass LLMOPT_COMMIT.
        "git_commit": _git("rev-parse", "HEAD") or os.environ.get("LLMOPT_COMMIT"),
        "git_dirty": None if status is None else bool(status),
    }


def lower_is_better(metric: str) -> bool:
    """Whether smaller values of ``metric`` are better: times, latency, memory, loss; not rates (``*_per_s``)."""
    if _HIGHER_IS_BETTER.search(metric):
        return False
    return bool(_LOWER_IS_BETTER.search(metric))


def compute_ratios(results: Sequence[dict[str, Any]], peers: Sequence[dict[str, Any]], metric: str) -> list[dict]:
    """One ratio per (result, peer) pair that both report ``metric``; above 1 means ours is better."""
    ratios = []
    for ours in results:
        for peer in peers:
            a, b = ours.get(metric), peer.get(metric)
            if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or a == 0 or b == 0:
                continue
            ratio = b / a if lower_is_better(metric) else a / b
            ratios.append(
                {"variant": ours.get("variant"), "peer": peer.get("variant"), "metric": metric, "ratio": ratio}
            )
    return ratios


def make_record(
    name: str,
    config: dict[str, Any],
    results: list[dict[str, Any]],
    peers: list[dict[str, Any]] | None = None,
    *,
    benchmark: str | None = None,
    ratio_metric: str | None = "median_ms",
    ceilings: dict[str, float] | None = None,
    reference: dict[str, Any] | None = None,
    notes: list[str] | None = None,
    env: dict[str, Any] | None = None,
    date: str | None = None,
) -> dict[str, Any]:
    """Build a record (see the module docstring). Each result and peer is a dict with a ``"variant"`` key.

    Arguments:
        name: unique record name, also the file stem.
        config: shapes, dtypes, steps.
        results: our figures per variant.
        peers: figures of other systems measured in the same process on the same device.
        benchmark: family used for grouping in docs/results.md (default: ``name`` up to its first ``-``).
        ratio_metric: metric compared between results and peers (skipped when ``None``).
        ceilings: physical ceilings measured in the same run.
        reference: published figures (datasheet), for context only.
    """
    for row in [*results, *(peers or [])]:
        if "variant" not in row:
            raise ValueError(f"every result and peer needs a 'variant' key, got {sorted(row)}")
    peers = peers or []
    return {
        "schema": SCHEMA,
        "name": name,
        "benchmark": benchmark or name.split("-")[0],
        "date": date or _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "env": env if env is not None else environment(),
        "config": config,
        "results": results,
        "peers": peers,
        "ratios": compute_ratios(results, peers, ratio_metric) if ratio_metric else [],
        "ceilings": ceilings or {},
        "reference": reference or {},
        "notes": notes or [],
    }


def record_path(record: dict[str, Any], directory: str | Path | None = None) -> Path:
    directory = Path(directory) if directory is not None else RESULTS_DIR
    return directory / f"{slugify(record['name'])}-{record['env']['device_slug']}.json"


def write_record(record: dict[str, Any], directory: str | Path | None = None) -> Path:
    """Write ``record`` to ``<directory>/<name>-<device-slug>.json`` (default ``benchmarks/results``)."""
    path = record_path(record, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
    return path


def load_records(directory: str | Path | None = None) -> list[dict[str, Any]]:
    directory = Path(directory) if directory is not None else RESULTS_DIR
    return [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]


# --------------------------------------------------------------------------- timing


def timeit_median(fn: Callable[[], Any], warmup: int = 10, repeats: int = 50) -> float:
    """Median time of one ``fn()`` call in milliseconds, warm-up excluded.

    On CUDA with Triton installed this is ``triton.testing.do_bench(..., return_mode="median")`` (which also clears
    the L2 cache between calls), with ``warmup`` and ``repeats`` converted from calls to do_bench's milliseconds by a
    first estimate; on CUDA without Triton, CUDA events per call; on CPU, ``time.perf_counter`` per call.
    """
    import torch

    if warmup < 0 or repeats < 1:
        raise ValueError(f"warmup ({warmup}) must be >= 0 and repeats ({repeats}) >= 1")
    if torch.cuda.is_available():
        try:
            from triton.testing import do_bench
        except ImportError:
            do_bench = None
        if do_bench is not None:
            fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            estimate_ms = max((time.perf_counter() - start) * 1e3, 1e-3)
            return float(do_bench(fn, warmup=warmup * estimate_ms, rep=repeats * estimate_ms, return_mode="median"))
        for _ in range(warmup):
            fn()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for begin, end in events:
            begin.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(b.elapsed_time(e) for b, e in events)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def graph_ms(calls: list[Callable[[], Any]], reps: int = 20) -> float:
    """Median GPU time of one call in milliseconds: the calls captured in one CUDA graph and replayed, timed with CUDA
    events (per replay, divided by the number of calls). Host time (Python, launches) is left out, as inside an
    engine's captured decode step."""
    import torch

    for c in calls:  # warm-up outside capture: compilation and autotuning
        c()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    del graph
    return statistics.median(times)
