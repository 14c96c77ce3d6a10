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
``triton_autotunes``/``triton_autotune_s``/``triton_autotune_cache_hits`` (Triton's listeners, on CUDA), and
``tuning_cache_hits``. The engine keeps its log as ``engine.startup``; ``llmopt serve`` prints a line per phase
while loading and ``/health`` shows the phases done so far.
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

    # ------------------------------------------------------------------ recording
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
        }


def _round(v: float) -> float:
    return round(v, 4) if isinstance(v, float) and not v.is_integer() else v


def watch_triton(startup: StartupLog) -> None:
    """Count Triton's compilations and autotuning searches (with their seconds and disk-cache hits) into
    ``startup`` until its build is done. Listeners installed before are still called."""
    try:
        from triton import knobs
    except ImportError:
        return
    prev_compile, prev_tune = knobs.compilation.listener, knobs.autotuning.listener

    def on_compile(*, src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool) -> None:
        startup.count("triton_compiles")
        startup.count("triton_compile_cache_hits", float(cache_hit))
        startup.count("triton_compile_s", getattr(times, "total", 0) / 1e6)
        if prev_compile is not None:
            prev_compile(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

    def on_tune(**kw: Any) -> None:
        startup.count("triton_autotunes")
        startup.count("triton_autotune_cache_hits", float(bool(kw.get("cache_hit"))))
        startup.count("triton_autotune_s", float(kw.get("duration") or 0.0))
        if prev_tune is not None:
            prev_tune(**kw)

    knobs.compilation.listener, knobs.autotuning.listener = on_compile, on_tune

    def restore() -> None:
        if knobs.compilation.listener is on_compile:
            knobs.compilation.listener = prev_compile
        if knobs.autotuning.listener is on_tune:
            knobs.autotuning.listener = prev_tune

    startup.on_done(restore)
