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
  :mod:`~lightning_llmopt.kernels.quant_matmul_tune`, passes its candidates' ``launch(..., compile_only=True)``);
- :func:`collecting` and :func:`collect_call`: gather the compilations of many searches (of different keys and
  kernels) without launching or timing anything, so that one :func:`compile_all` batch compiles them all before
  the first search is timed (the engine does so for its GEMVs before the decode graphs are warmed up: a search of
  4 or 8 candidates leaves most of the pool idle). A call whose search is due hands over its pruned candidates; one
  whose key is already tuned (in memory or in Triton's disk cache) hands over its chosen configuration only.

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
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

__all__ = ["STATS", "autotune", "collect_call", "collecting", "compile_all", "compile_threads", "parallel_search"]

MAX_DEFAULT_THREADS = 8
# what was compiled ahead in this process: batches (searches), calls, their wall seconds (the start-up log reads it)
STATS = {"batches": 0, "calls": 0, "seconds": 0.0}
_LOCK = threading.Lock()
_COLLECT = threading.local()  # .calls: the list :func:`collecting` gathers into on this thread


class _Collected(Exception):
    """Raised by a search's first timing under :func:`collecting`, once its candidates are handed over."""


@contextlib.contextmanager
def collecting() -> Iterator[list[Callable[[], Any]]]:
    """Within the block, :func:`collect_call` gathers compile-only calls into the list yielded (this thread only)."""
    outer = getattr(_COLLECT, "calls", None)
    calls: list[Callable[[], Any]] = []
    _COLLECT.calls = calls
    try:
        yield calls
    finally:
        _COLLECT.calls = outer


def collect_call(tuner: Any, grid: Any, *args: Any, **kwargs: Any) -> bool:
    """Under :func:`collecting`, gather what launching the :func:`parallel_search` ``tuner`` on ``args`` would compile
    (its pruned candidates when a search is due, else its chosen configuration), launching and timing nothing, and
    return ``True``; outside it (or for a tuner without the hooks), do nothing and return ``False``. The search's
    state is left as before (no result is cached); the shared-memory prune it ran is not counted as a search."""
    calls = getattr(_COLLECT, "calls", None)
    real = getattr(tuner, "_llmopt_fn", None)
    if calls is None or real is None:
        return False
    from lightning_llmopt.kernels import shared_memory

    class Recorder:  # the tuner's launch of its chosen configuration, as a compile-only call
        def run(self, *a: Any, **kw: Any) -> None:
            calls.append(lambda: real.run(*a, **{**kw, "warmup": True}))

    searches = shared_memory.searches()
    tuner.fn = Recorder()
    try:
        tuner.run(*args, grid=grid, warmup=True, **kwargs)
    except _Collected:
        pass
    finally:
        tuner.fn = real
        shared_memory.discount(shared_memory.searches() - searches)
    return True


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

    fn = tuner.fn
    tuner._llmopt_fn = fn  # the kernel itself (:func:`collect_call` stands in for it while collecting)

    def timed(*args: Any, config: Any, **meta: Any) -> Any:
        if pending:  # the search's first timing: compile every candidate first
            configs = pending.pop()

            def compile_only(c: Any) -> Callable[[], Any]:
                return lambda: fn.run(*args, **{**meta, **c.all_kwargs(), "warmup": True})

            collected = getattr(_COLLECT, "calls", None)
            if collected is not None:  # collect_call: hand the candidates over, time nothing, keep no result
                collected.extend(compile_only(c) for c in configs)
                raise _Collected
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
