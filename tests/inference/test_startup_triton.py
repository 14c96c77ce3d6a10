"""The start-up watcher on every declared Triton: each listener hook is feature-detected (3.6 has no autotuning
listener), counts survive a missing hook, and the log says what could not be counted."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from lightning_llmopt.inference.startup import StartupLog, watch_triton
from lightning_llmopt.kernels import shared_memory


class _Compilation:  # declares the hook as triton.knobs' compilation_knobs does
    listener = None


class _Autotuning:
    listener = None
    cache = False


class _Autotuning36:  # triton 3.6.0's autotuning_knobs: cache and print, no listener
    cache = False
    print = False


class _Empty:  # a namespace without the compilation listener
    pass


def _compile(knobs: Any, cache_hit: bool) -> None:
    knobs.compilation.listener(src=None, metadata={}, metadata_group={}, times=SimpleNamespace(total=1_500_000),
                               cache_hit=cache_hit)


def test_without_autotuning_listener_compiles_are_counted_and_searches_come_from_the_prunes() -> None:
    previous: list[bool] = []
    knobs = SimpleNamespace(compilation=_Compilation(), autotuning=_Autotuning36(), version="3.6.0")
    knobs.compilation.listener = lambda **kw: previous.append(kw["cache_hit"])  # installed before: still called
    before = knobs.compilation.listener
    lines: list[str] = []
    startup = StartupLog(on_line=lines.append)
    watch_triton(startup, knobs=knobs)  # reading knobs.autotuning.listener raised AttributeError here before
    assert not hasattr(knobs.autotuning, "listener")
    startup.mark("cuda graph 1 rows")
    _compile(knobs, False)
    _compile(knobs, True)
    shared_memory.fit("a kernel", [1, 2], lambda c: 0, None)  # one autotuning search's prune
    startup.done()
    counts = startup.phases[0].counts
    assert counts["triton_compiles"] == 2 and counts["triton_compile_cache_hits"] == 1
    assert counts["triton_compile_s"] == 3.0 and counts["triton_autotunes"] == 1
    assert previous == [False, True]
    note = startup.notes["triton_autotune_listener"]
    assert note.startswith("unavailable (triton 3.6.0)")
    assert any(line.startswith("triton_autotune_listener: unavailable (triton 3.6.0)") for line in lines)
    assert startup.summary()["notes"] == {"triton_autotune_listener": note}
    assert knobs.compilation.listener is before  # restored when the build is done
    assert "triton_compile_listener" not in startup.notes


def test_without_compilation_listener_autotunes_are_counted() -> None:
    knobs = SimpleNamespace(compilation=_Empty(), autotuning=_Autotuning(), version="9.9.9")
    lines: list[str] = []
    startup = StartupLog(on_line=lines.append)
    watch_triton(startup, knobs=knobs)
    startup.mark("warm-up")
    knobs.autotuning.listener(fn=None, key=(), best_config=None, configs_timings={}, duration=0.25, cache_hit=False)
    knobs.autotuning.listener(fn=None, key=(), best_config=None, configs_timings={}, duration=None, cache_hit=True)
    startup.done()
    counts = startup.phases[0].counts
    assert counts == {"triton_autotunes": 2, "triton_autotune_cache_hits": 1, "triton_autotune_s": 0.25}
    assert startup.notes["triton_compile_listener"].startswith("unavailable (triton 9.9.9)")
    assert "triton_autotune_listener" not in startup.notes
    assert knobs.autotuning.listener is None  # restored


def test_installed_triton_is_watched_and_restored() -> None:
    import pytest

    triton = pytest.importorskip("triton")
    from triton import knobs

    before = getattr(knobs.compilation, "listener", None)
    startup = StartupLog()
    watch_triton(startup)
    startup.mark("phase")
    startup.done()
    assert getattr(knobs.compilation, "listener", None) is before
    if hasattr(type(knobs.autotuning), "listener"):
        assert "triton_autotune_listener" not in startup.notes
    else:
        assert triton.__version__ in startup.notes["triton_autotune_listener"]
