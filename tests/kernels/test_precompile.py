"""Searches compile their candidates on threads before timing them (kernels/precompile.py).

On CPU: the pool's size and its errors, the hooks on a Triton autotuner (this Triton's: the main job runs 3.9, the
toolchain job 3.6), and that a search answered from a disk cache compiles nothing ahead. On a GPU: a real search
(the quantized matmul's and an autotuned kernel's) compiles every candidate ahead, on several threads, and then
launches each without compiling again.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from lightning_llmopt.kernels import precompile


@pytest.fixture
def as_if_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """compile_all runs its calls as on a GPU (no device to set here)."""
    monkeypatch.setattr(precompile, "_enabled", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)


def test_thread_count_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMOPT_COMPILE_THREADS", raising=False)
    monkeypatch.setattr(precompile.os, "cpu_count", lambda: 16)
    assert precompile.compile_threads() == 8
    monkeypatch.setattr(precompile.os, "cpu_count", lambda: 2)
    assert precompile.compile_threads() == 2
    monkeypatch.setenv("LLMOPT_COMPILE_THREADS", "12")
    assert precompile.compile_threads() == 12
    for bad in ("0", "-2", "four"):
        monkeypatch.setenv("LLMOPT_COMPILE_THREADS", bad)
        with pytest.raises(ValueError, match=f"LLMOPT_COMPILE_THREADS \\('{bad}'\\)"):
            precompile.compile_threads()


def test_compile_all_runs_every_call_on_several_threads_and_ignores_errors(
    as_if_cuda: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMOPT_COMPILE_THREADS", "4")
    seen: list[int] = []
    names: set[str] = set()
    lock = threading.Lock()

    def call(i: int) -> Any:
        def run() -> None:
            time.sleep(0.05)  # long enough that the pool spreads the calls over its threads
            with lock:
                seen.append(i)
                names.add(threading.current_thread().name)
            if i == 3:
                raise RuntimeError("a configuration the compiler rejects")

        return run

    before = dict(precompile.STATS)
    assert precompile.compile_all(call(i) for i in range(9)) == 9
    assert sorted(seen) == list(range(9))
    assert len(names) >= 3, names  # the calling thread and at least two of the pool's
    assert precompile.STATS["calls"] == before["calls"] + 9 and precompile.STATS["batches"] == before["batches"] + 1


def test_compile_all_does_nothing_with_one_thread_or_without_cuda(
    as_if_cuda: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[int] = []
    monkeypatch.setenv("LLMOPT_COMPILE_THREADS", "1")
    assert precompile.compile_all([lambda: ran.append(1), lambda: ran.append(2)]) == 0
    monkeypatch.setenv("LLMOPT_COMPILE_THREADS", "4")
    monkeypatch.setattr(precompile, "_enabled", lambda: False)
    assert precompile.compile_all([lambda: ran.append(1), lambda: ran.append(2)]) == 0
    assert ran == []


class _Config:
    def __init__(self, block: int) -> None:
        self.kwargs = {"BLOCK": block}

    def all_kwargs(self) -> dict[str, int]:
        return {**self.kwargs, "num_warps": 4}


class _Fn:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def run(self, *args: Any, **kwargs: Any) -> None:
        with self.lock:
            self.calls.append({"args": args, **kwargs})


class _Tuner:
    """What parallel_search uses of Triton's Autotuner: ``fn``, ``prune_configs(kwargs)``, ``_bench``."""

    def __init__(self, configs: list[_Config]) -> None:
        self.fn, self.configs = _Fn(), configs

    def prune_configs(self, kwargs: dict[str, Any]) -> list[_Config]:
        return self.configs[1:]  # the first one pruned

    def _bench(self, *args: Any, config: _Config, **meta: Any) -> list[float]:
        self.fn.run(*args, **meta, **config.all_kwargs())
        return [float(config.kwargs["BLOCK"])] * 3

    def search(self, *args: Any, **kwargs: Any) -> dict[_Config, list[float]]:  # Autotuner.run's order
        configs = self.prune_configs(kwargs)
        return {c: self._bench(*args, config=c, **kwargs) for c in configs}


def test_a_search_compiles_its_pruned_candidates_first(as_if_cuda: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMOPT_COMPILE_THREADS", "4")
    tuner = precompile.parallel_search(_Tuner([_Config(b) for b in (16, 32, 64, 128)]))
    timings = tuner.search("x", 7, grid=(1,), warmup=False, FLAG=True)
    assert [t[0] for t in timings.values()] == [32.0, 64.0, 128.0]  # the search's result is unchanged
    warm = [c for c in tuner.fn.calls if c["warmup"]]
    timed = [c for c in tuner.fn.calls if not c["warmup"]]
    assert sorted(c["BLOCK"] for c in warm) == [32, 64, 128]  # each pruned candidate compiled once, ahead
    assert all(c["args"] == ("x", 7) and c["FLAG"] and c["grid"] == (1,) and c["num_warps"] == 4 for c in warm)
    assert [c["BLOCK"] for c in timed] == [32, 64, 128]
    assert tuner.fn.calls.index(timed[0]) == 3  # every compilation before the first timing

    tuner.fn.calls.clear()  # a search answered by the disk cache prunes, but times (and compiles) nothing
    tuner.prune_configs({})
    assert tuner.fn.calls == []


def test_the_package_autotuners_are_hooked_on_this_triton() -> None:
    """Feature detection holds on the Triton this job runs: the hooks replace the autotuner's own methods."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def _kernel(X, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        tl.store(X + tl.arange(0, BLOCK), tl.zeros((BLOCK,), dtype=tl.float32))

    tuner = precompile.autotune(configs=[triton.Config({"BLOCK": b}) for b in (16, 32)], key=[])(_kernel)
    assert isinstance(tuner, triton.runtime.Autotuner)
    assert tuner._bench.__name__ == "timed" and tuner.prune_configs.__name__ == "prune_configs"


@pytest.mark.gpu
def test_quantized_matmul_search_compiles_ahead_and_chooses_a_correct_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_llmopt.kernels import quant_matmul_tune as qt
    from lightning_llmopt.kernels.quant_matmul_fwd import launch

    monkeypatch.setattr(qt, "TUNED", {})
    monkeypatch.setattr(qt, "STORE", None)
    monkeypatch.setenv("LLMOPT_COMPILE_THREADS", "8")
    g = torch.Generator(device="cuda").manual_seed(0)
    n, k, bits, group = 384, 1024, 4, 128
    w = torch.randint(0, 256, (n, k * bits // 8), dtype=torch.uint8, device="cuda", generator=g)
    scales = torch.rand(n, k // group, dtype=torch.bfloat16, device="cuda", generator=g) * 0.01
    for m in (1, 5):
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda", generator=g)
        before = precompile.STATS["calls"]
        cfg = qt.choose_config(x, w, scales, None, bits, group, None)
        assert precompile.STATS["calls"] > before + 10  # the candidates, compiled on threads
        assert launch(x, w, scales, None, bits, group, cfg, compile_only=True) is None
        out = launch(x, w, scales, None, bits, group, cfg).float()
        ref = qt._reference(x, w, scales, None, bits)
        assert (out - ref).norm() <= 2e-2 * ref.norm()


@pytest.mark.gpu
def test_autotuned_kernel_search_compiles_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_llmopt.kernels import rmsnorm_triton

    monkeypatch.setattr(rmsnorm_triton, "_tuned", {})
    monkeypatch.setenv("LLMOPT_COMPILE_THREADS", "8")
    x = torch.randn(77, 3000, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(3000, dtype=torch.bfloat16, device="cuda")
    before = precompile.STATS["calls"]
    y, _ = rmsnorm_triton.rms_norm_fwd_launch(x, w, 1e-6, torch.bfloat16)
    (tuner,) = rmsnorm_triton._tuned.values()
    searched = len(getattr(tuner, "configs_timings", None) or {})
    assert searched > 1, "expected a search over several configurations at D = 3000"
    assert precompile.STATS["calls"] - before == searched  # each timed configuration compiled ahead
    ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=2e-2)
