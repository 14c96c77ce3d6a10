"""Where an engine's start-up time goes: :class:`StartupLog`, the phases of a build with their seconds and tuning.

A build is a sequence of phases, each started by :meth:`StartupLog.mark` (which ends the one before):

- ``load weights`` (:meth:`LLMEngine.from_pretrained`, ``llmopt serve``) or ``random init`` (``--preset``);
- ``kv pool``: the pool's size from free GPU memory, and its allocation;
- ``runner``: the model runner, the tuning cache (:mod:`.tuning_cache`) opened;
- ``cuda graph <b> rows``, one per captured batch size: two warm-up passes and the capture; the warm-up is where
  each new row bucket's kernel choices are made (cuBLAS or a Triton GEMV, timed; ``triton.autotune`` searches) and
  where Triton compiles;
- ``speculative`` and ``speculative round graphs`` when decoding speculatively.

Each phase records, beside its seconds, what happened inside it: ``linear_tunings``/``linear_tuning_s`` (the
:class:`~.linear_chooser.LinearChooser` decisions timed), ``quant_tunings``/``quant_tuning_s`` (quantized matmul
searches), ``triton_compiles``/``triton_compile_s``/``triton_compile_cache_hits`` and
``triton_autotunes``/``triton_autotune_s``/``triton_autotune_cache_hits`` (Triton's listeners, on CUDA),
``parallel_compiles``/``parallel_compile_s`` (search candidates compiled on threads before being timed,
:mod:`~lightning_llmopt.kernels.precompile`) and ``tuning_cache_hits``. A Triton without one of those listeners (3.6
has no autotuning listener) gets a note instead, e.g. ``triton_autotune_listener: unavailable (triton 3.6.0) ...``
(:attr:`StartupLog.notes`, in the summary and printed as a line), and the searches are counted from the package
kernels' own prunes. The engine keeps its log as ``engine.startup``; ``llmopt serve`` prints a line per phase while
loading and ``/health`` shows the phases done so far.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Phase", "StartupLog"]

log = logging.getLogger("lightning_llmopt.inference.startup")


@dataclass
class Phase:
    """One finished phase: its ``name``, ``seconds`` and the counters that moved in it (``counts``)."""

    name: str
    seconds: float
    counts: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "seconds": round(self.seconds, 4), **self.counts}


class StartupLog:
    """The phases of one engine build (see the module docstring).

    Arguments:
        on_line: called with a line of text when a phase ends (``llmopt serve`` prints it as progress).
    """

    def __init__(self, on_line: Callable[[str], None] | None = None) -> None:
        self.on_line = on_line
        self.phases: list[Phase] = []
        self.current: str | None = None
        self.start = time.perf_counter()
        self.total_s: float | None = None  # set by :meth:`done`: seconds from the first phase's start
        self.counters: dict[str, float] = {}  # accumulated by listeners (Triton)
        self._sources: list[Callable[[], dict[str, float]]] = []
        self._phase_start = self.start
        self._snapshot: dict[str, float] = {}
        self._lock = threading.Lock()
        self._cleanups: list[Callable[[], None]] = []
        self.notes: dict[str, str] = {}  # what could not be counted, and why (e.g. a Triton without a listener)

    # ------------------------------------------------------------------ recording
    def note(self, name: str, text: str) -> None:
        """Record ``name: text`` (shown in :meth:`summary` and passed to ``on_line`` once)."""
        if self.notes.get(name) == text:
            return
        self.notes[name] = text
        line = f"{name}: {text}"
        log.info("engine start-up: %s", line)
        if self.on_line is not None:
            self.on_line(line)

    def add_source(self, source: Callable[[], dict[str, float]]) -> None:
        """Counters read at each phase boundary (e.g. a chooser's ``tunings``); a phase records their change."""
        self._sources.append(source)

    def on_done(self, cleanup: Callable[[], None]) -> None:
        """Call ``cleanup`` when the build is done (e.g. remove a listener)."""
        self._cleanups.append(cleanup)

    def count(self, name: str, value: float = 1.0) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0.0) + value

    def _totals(self) -> dict[str, float]:
        with self._lock:
            totals = dict(self.counters)
        for source in self._sources:
            for k, v in source().items():
                totals[k] = totals.get(k, 0.0) + v
        return totals

    def mark(self, name: str | None) -> None:
        """End the current phase (if any) and start ``name`` (``None``: start none)."""
        now = time.perf_counter()
        if self.current is None and not self.phases:  # the build starts with its first phase
            self.start = now
        totals = self._totals()
        if self.current is not None:
            moved = {k: _round(v - self._snapshot.get(k, 0.0)) for k, v in totals.items()}
            phase = Phase(self.current, now - self._phase_start, {k: v for k, v in moved.items() if v})
            self.phases.append(phase)
            line = f"{phase.name}: {phase.seconds:.2f} s" + "".join(f", {k}={v:g}" for k, v in phase.counts.items())
            line += f" (total {now - self.start:.1f} s)"
            log.info("engine start-up: %s", line)
            if self.on_line is not None:
                self.on_line(line)
        self.current, self._phase_start, self._snapshot = name, now, totals

    def done(self) -> None:
        """End the last phase; the build took :attr:`total_s` seconds."""
        self.mark(None)
        self.total_s = time.perf_counter() - self.start
        for cleanup in self._cleanups:
            cleanup()
        self._cleanups.clear()

    # ------------------------------------------------------------------ reading
    def seconds(self) -> dict[str, float]:
        """Seconds per phase name (phases of one name summed)."""
        out: dict[str, float] = {}
        for p in list(self.phases):
            out[p.name] = out.get(p.name, 0.0) + p.seconds
        return out

    def summary(self) -> dict[str, Any]:
        """What ``/health`` shows: the phases done, the one running, the seconds so far, and the tuning totals."""
        totals = {k: _round(v) for k, v in self._totals().items() if v}
        return {
            "phases": [p.as_dict() for p in list(self.phases)],
            "current": self.current,
            "elapsed_s": round(self.total_s if self.total_s is not None else time.perf_counter() - self.start, 3),
            "totals": totals,
            **({"notes": dict(self.notes)} if self.notes else {}),
        }


def _round(v: float) -> float:
    return round(v, 4) if isinstance(v, float) and not v.is_integer() else v


def _has_hook(namespace: Any, name: str) -> bool:
    """Whether a Triton knobs namespace declares the hook ``name`` (a class attribute: reading a missing one raised
    ``AttributeError`` on Triton 3.6, which has no ``autotuning.listener``)."""
    return namespace is not None and (hasattr(type(namespace), name) or name in getattr(namespace, "__dict__", {}))


def watch_triton(startup: StartupLog, knobs: Any = None) -> None:
    """Count Triton's compilations and autotuning searches (with their seconds and disk-cache hits) into
    ``startup`` until its build is done. Listeners installed before are still called.

    Each hook is feature-detected (``knobs.compilation.listener`` and ``knobs.autotuning.listener``; Triton 3.6 has
    no autotuning listener). Where one is missing, what can still be counted is, and a note says so in the log
    (:attr:`StartupLog.notes`, printed by ``llmopt serve``): without the autotuning listener, ``triton_autotunes``
    counts the searches of the package's own kernels (their shared-memory prune runs once per search,
    :func:`~lightning_llmopt.kernels.shared_memory.searches`), without seconds or cache hits. ``knobs``: Triton's
    (default) or a stand-in (tests)."""
    version = "unknown"
    if knobs is None:
        try:
            import triton
            from triton import knobs as triton_knobs
        except ImportError:
            return
        knobs = triton_knobs
        version = getattr(triton, "__version__", version)
    else:
        version = getattr(knobs, "version", version)
    compilation, autotuning = getattr(knobs, "compilation", None), getattr(knobs, "autotuning", None)
    restores: list[Callable[[], None]] = []
    if _has_hook(compilation, "listener"):
        restores.append(_watch_compiles(startup, compilation))
    else:
        startup.note("triton_compile_listener", f"unavailable (triton {version}): compilations not counted")
    if _has_hook(autotuning, "listener"):
        restores.append(_watch_autotunes(startup, autotuning))
    else:
        startup.note("triton_autotune_listener", f"unavailable (triton {version}): triton_autotunes counts the "
                                                 "package kernels' searches, without seconds or cache hits")
        from lightning_llmopt.kernels import shared_memory

        start = shared_memory.searches()
        startup.add_source(lambda: {"triton_autotunes": float(shared_memory.searches() - start)})

    def restore() -> None:
        for undo in restores:
            undo()

    startup.on_done(restore)


def _watch_compiles(startup: StartupLog, compilation: Any) -> Callable[[], None]:
    prev = compilation.listener

    def on_compile(*, src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool) -> None:
        startup.count("triton_compiles")
        startup.count("triton_compile_cache_hits", float(cache_hit))
        startup.count("triton_compile_s", getattr(times, "total", 0) / 1e6)
        if prev is not None:
            prev(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

    compilation.listener = on_compile

    def restore() -> None:
        if compilation.listener is on_compile:
            compilation.listener = prev

    return restore


def _watch_autotunes(startup: StartupLog, autotuning: Any) -> Callable[[], None]:
    prev = autotuning.listener

    def on_tune(**kw: Any) -> None:
        startup.count("triton_autotunes")
        startup.count("triton_autotune_cache_hits", float(bool(kw.get("cache_hit"))))
        startup.count("triton_autotune_s", float(kw.get("duration") or 0.0))
        if prev is not None:
            prev(**kw)

    autotuning.listener = on_tune

    def restore() -> None:
        if autotuning.listener is on_tune:
            autotuning.listener = prev

    return restore
