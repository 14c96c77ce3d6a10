"""Compile a kernel search's candidates in parallel before timing them.

A search times every candidate configuration of a kernel for a new shape, and each candidate is a separate Triton
compilation (a fraction of a second to several seconds each). Triton's autotuner compiles them one after another,
on the thread that times them. Triton's compiler releases the GIL for most of its work (its MLIR passes and
``ptxas``): 16 compilations of one tensor-core kernel took 5.7 s one after another and 0.71 s on 8 threads on the
16-core host of an H200 (Triton 3.6.0, 2026-11-29), and 4.3 s against 2.3 s on 2 threads of a CPU machine (Triton
3.9). So every search of the package first compiles its candidates on a pool of threads (compile only: nothing is
launched), then times them as before, each launch now finding its kernel compiled:

- :func:`autotune`: ``triton.autotune`` whose searches do that (every autotuned kernel of the package uses it);
- :func:`compile_all`: runs compile-only calls on the pool (the quantized matmul's own search,
  :mod:`~lightning_llmopt.kernels.quant_matmul_tune`, passes its candidates' ``launch(..., compile_only=True)``).

A search answered from Triton's disk cache of autotuning results compiles nothing ahead. Errors in the ahead-of-time
compilation are ignored: the search meets the same configuration again and handles it as it always did (an
``OutOfResources`` candidate timed as ``inf``, a rejected one skipped). The result of a search is unchanged; only
its compilations move earlier. ``LLMOPT_COMPILE_THREADS`` sets the pool's size (default: the CPU count, at most 8);
``1`` compiles each candidate when it is first timed, as Triton does. Nothing is compiled ahead under the Triton
interpreter or without CUDA.

This module imports no Triton at import time.
"""

from __future__ import annotations

import concurrent.futures as futures
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["STATS", "autotune", "compile_all", "compile_threads", "parallel_search"]

MAX_DEFAULT_THREADS = 8
# what was compiled ahead in this process: batches (searches), calls, their wall seconds (the start-up log reads it)
STATS = {"batches": 0, "calls": 0, "seconds": 0.0}
_LOCK = threading.Lock()


def compile_threads() -> int:
    """Threads of the pool: ``LLMOPT_COMPILE_THREADS`` if set, else the CPU count, at most 8."""
    value = os.environ.get("LLMOPT_COMPILE_THREADS")
    if value is None or not value.strip():
        return max(1, min(MAX_DEFAULT_THREADS, os.cpu_count() or 1))
    try:
        threads = int(value)
    except ValueError:
        threads = 0
    if threads < 1:
        raise ValueError(f"LLMOPT_COMPILE_THREADS ({value!r}) must be a whole number >= 1 (1: no parallel compile)")
    return threads


def _enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and torch.cuda.is_available()


def compile_all(calls: Iterable[Callable[[], Any]]) -> int:
    """Run compile-only ``calls`` on :func:`compile_threads` threads (the first on this thread, so that Triton sets
    up its per-device state once); returns how many ran. An exception in a call is ignored (the search that follows
    meets it again). Nothing runs with one thread, one call, under the interpreter or without CUDA."""
    calls = list(calls)
    threads = compile_threads()
    if len(calls) < 2 or threads < 2 or not _enabled():
        return 0
    device = torch.cuda.current_device()
    start = time.perf_counter()

    def run(call: Callable[[], Any]) -> None:
        try:
            torch.cuda.set_device(device)  # a new thread starts on device 0; Triton compiles for the current one
            call()
        except Exception:  # noqa: BLE001 -- handled where the configuration is timed
            pass

    run(calls[0])
    with futures.ThreadPoolExecutor(min(threads, len(calls) - 1), thread_name_prefix="llmopt-compile") as pool:
        list(pool.map(run, calls[1:]))
    with _LOCK:
        STATS["batches"] += 1
        STATS["calls"] += len(calls)
        STATS["seconds"] += time.perf_counter() - start
    return len(calls)


def parallel_search(tuner: Any) -> Any:
    """Make a Triton ``Autotuner`` compile its pruned configurations with :func:`compile_all` when a search starts
    timing them (not when its disk cache answers). Returns ``tuner``; a Triton whose autotuner lacks the methods
    used (``prune_configs``, ``_bench``) keeps its own one-by-one compilation."""
    prune, bench = getattr(tuner, "prune_configs", None), getattr(tuner, "_bench", None)
    if prune is None or bench is None:
        return tuner
    pending: list[list[Any]] = []

    def prune_configs(*args: Any, **kwargs: Any) -> Any:
        configs = prune(*args, **kwargs)
        pending[:] = [list(configs)]
        return configs

    def timed(*args: Any, config: Any, **meta: Any) -> Any:
        if pending:  # the search's first timing: compile every candidate first
            configs = pending.pop()
            fn = tuner.fn

            def compile_only(c: Any) -> Callable[[], Any]:
                return lambda: fn.run(*args, **{**meta, **c.all_kwargs(), "warmup": True})

            compile_all(compile_only(c) for c in configs)
        return bench(*args, config=config, **meta)

    tuner.prune_configs = prune_configs
    tuner._bench = timed
    return tuner


def autotune(*args: Any, **kwargs: Any) -> Callable[[Any], Any]:
    """``triton.autotune(*args, **kwargs)`` with :func:`parallel_search`."""
    import triton

    decorate = triton.autotune(*args, **kwargs)
    return lambda fn: parallel_search(decorate(fn))
