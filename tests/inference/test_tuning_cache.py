"""The on-disk tuning cache and the start-up log: round trip, a warm build that times nothing, keys that follow the
environment, corrupt and foreign files, atomic writes, and the engine's phases."""

from __future__ import annotations

import json
import os
import time
import warnings

import pytest
import torch

from lightning_llmopt.inference import LLMEngine, SamplingParams
from lightning_llmopt.inference import tuning_cache as tc
from lightning_llmopt.inference.linear_chooser import LinearChooser
from lightning_llmopt.inference.startup import StartupLog
from lightning_llmopt.inference.tuning_cache import TuningCache, default_cache_dir, encode_key
from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.testing.triton import triton_available, triton_interpreter_enabled

CPU = torch.device("cpu")
KEY = ("norm+qkv", (64, 64), (32, 64), (32, 64), torch.float32, True, False, 4)


def test_round_trip_and_location(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOPT_CACHE_DIR", str(tmp_path / "root"))
    assert default_cache_dir() == tmp_path / "root" / "tuning"
    cache = TuningCache(CPU)
    assert cache.path.parent == tmp_path / "root" / "tuning" and cache.get("linear", KEY) is None
    cache.put("linear", KEY, True)
    cache.put("quant_matmul", (1, 4096, 4096, 4, 128, False, torch.bfloat16), {"kind": "words", "block_n": 8})
    again = TuningCache(CPU)
    assert again.get("linear", KEY) is True and again.hits == 1
    assert again.get("quant_matmul", (1, 4096, 4096, 4, 128, False, torch.bfloat16)) == {"kind": "words", "block_n": 8}
    assert again.get("linear", (*KEY[:-1], 8)) is None  # another row bucket: another key
    assert [p.name for p in cache.directory.iterdir()] == [cache.path.name]  # no temporary file left
    data = json.loads(cache.path.read_text())
    assert data["fingerprint"] == tc.environment(CPU) and encode_key(KEY) in data["entries"]["linear"]


def test_keys_follow_versions_and_shapes(tmp_path, monkeypatch):
    base = TuningCache(CPU, tmp_path)
    assert encode_key(KEY) != encode_key((*KEY[:1], (128, 64), *KEY[2:]))
    assert encode_key(KEY) != encode_key((*KEY[:4], torch.bfloat16, *KEY[5:]))
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert TuningCache(CPU, tmp_path).path != base.path
    monkeypatch.undo()
    monkeypatch.setattr(tc, "_version", lambda name: "0.0.1" if name == "triton" else None)
    assert TuningCache(CPU, tmp_path).path != base.path
    monkeypatch.undo()
    monkeypatch.setattr(tc, "_TUNED_SOURCES", (*tc._TUNED_SOURCES[:-1], "inference/engine.py"))  # edited kernels
    assert TuningCache(CPU, tmp_path).path != base.path
    monkeypatch.undo()
    monkeypatch.setenv("LLMOPT_PDL", "0")  # changes what the chooser would decide
    assert TuningCache(CPU, tmp_path).path != base.path
    monkeypatch.delenv("LLMOPT_PDL")
    assert TuningCache(CPU, tmp_path).path == base.path
    with pytest.raises(TypeError, match="tuning key holds object"):
        encode_key((object(),))


def test_corrupt_and_foreign_files_are_ignored_with_a_warning(tmp_path):
    cache = TuningCache(CPU, tmp_path)
    cache.put("linear", KEY, False)
    cache.path.write_text('{"fingerprint": {"device": "cpu"}, "entr')  # a torn write by something else
    with pytest.warns(UserWarning, match="corrupt"):
        fresh = TuningCache(CPU, tmp_path)
    assert fresh.get("linear", KEY) is None
    fresh.put("linear", KEY, True)  # rewritten whole
    assert TuningCache(CPU, tmp_path).get("linear", KEY) is True
    data = json.loads(cache.path.read_text())
    data["fingerprint"]["device"] = "NVIDIA H100 80GB HBM3"  # copied from another machine
    cache.path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="another environment"):
        assert TuningCache(CPU, tmp_path).get("linear", KEY) is None


def test_a_crash_while_writing_leaves_the_old_file(tmp_path, monkeypatch):
    cache = TuningCache(CPU, tmp_path)
    cache.put("linear", KEY, True)
    before = cache.path.read_bytes()

    def crash(src, dst):
        raise KeyboardInterrupt  # the process dies between writing the temporary file and renaming it

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        cache.put("linear", (*KEY[:-1], 8), False)
    monkeypatch.undo()
    assert cache.path.read_bytes() == before and sorted(tmp_path.iterdir()) == [cache.path]


def test_disabled(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOPT_TUNING_CACHE", "0")
    cache = TuningCache(CPU, tmp_path)
    cache.put("linear", KEY, True)
    assert not cache.enabled and cache.get("linear", KEY) is None and not any(tmp_path.iterdir())
    model = Llama(LlamaConfig.from_preset("tiny"))
    assert LLMEngine(model, num_blocks=16, block_size=8, tuning_cache=str(tmp_path)).tuning_cache is None
    monkeypatch.delenv("LLMOPT_TUNING_CACHE")
    assert LLMEngine(model, num_blocks=16, block_size=8, tuning_cache=False).tuning_cache is None
    assert LLMEngine(model, num_blocks=16, block_size=8, tuning_cache=str(tmp_path)).tuning_cache is not None
    with pytest.raises(TypeError, match="tuning_cache"):
        LLMEngine(model, num_blocks=16, block_size=8, tuning_cache=3)


def test_engine_records_its_phases():
    lines = []
    startup = StartupLog(on_line=lines.append)
    startup.mark("random init")
    model = Llama(LlamaConfig.from_preset("tiny"))
    engine = LLMEngine(model, num_blocks=16, block_size=8, tuning_cache=False, startup=startup)
    assert engine.startup is startup and startup.current is None and startup.total_s is not None
    assert [p.name for p in startup.phases] == ["random init", "kv pool", "runner"]
    assert set(startup.seconds()) == {"random init", "kv pool", "runner"} and len(lines) == 3
    assert lines[0].startswith("random init: ") and startup.summary()["current"] is None
    assert LLMEngine(model, num_blocks=16, block_size=8, tuning_cache=False).startup.phases  # a log of its own


def _cpu_timer(chooser_calls):
    """A real measurement on the CPU (one wall time each: the interpreter is slow), counting its calls."""

    def measure(self, triton_fn, torch_fn):
        chooser_calls.append(1)
        times = []
        for fn in (triton_fn, torch_fn):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return times[0] < times[1]

    return measure


@pytest.mark.skipif(not triton_available() or not triton_interpreter_enabled(), reason="needs TRITON_INTERPRET=1")
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
def test_a_warm_build_times_nothing(tmp_path, monkeypatch):
    """The chooser's decisions of a first engine are stored; a second engine over the same cache times none of them
    (counted) and decides alike; its greedy tokens equal the reference path's (plain PyTorch, no chooser)."""
    calls: list[int] = []
    monkeypatch.setattr(LinearChooser, "_on_device", lambda self, x: True)  # the GPU's choice path, interpreted
    monkeypatch.setattr(LinearChooser, "_measure", _cpu_timer(calls))
    torch.manual_seed(0)
    cfg = dict(n_layers=1, dim=32, n_heads=2, n_kv_heads=1, vocab_size=64, multiple_of=16, init_std=0.1)
    model = Llama(LlamaConfig.from_preset("tiny", **cfg)).eval()
    prompts, params = [[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True)  # row buckets 4 and 1

    def run(**kw):
        engine = LLMEngine(model, num_blocks=32, block_size=8, fused_kernels=True, attention_backend="reference", **kw)
        return engine, [c.token_ids for c in engine.generate(prompts, params)]

    first, out1 = run(tuning_cache=str(tmp_path))
    assert first.runner.linear.tunings == len(calls) > 0
    stored = json.loads(first.tuning_cache.path.read_text())["entries"]["linear"]
    assert len(stored) == len(first.runner.linear.use_gemv) == len(calls)
    second, out2 = run(tuning_cache=str(tmp_path))
    assert second.runner.linear.tunings == 0 and len(calls) == len(stored)  # nothing timed again
    # every decision the warm engine took came from the store, as the cold one took it (a decision found there also
    # skips the nested ones its timing made: fewer lookups than entries)
    decided = second.runner.linear.use_gemv
    assert 0 < second.tuning_cache.hits == len(decided) <= len(stored)
    assert all(first.runner.linear.use_gemv[k] == v for k, v in decided.items())
    phases = second.startup.summary()
    assert phases["totals"].get("linear_tunings", 0) == 0
    ref = [c.token_ids for c in LLMEngine(model, num_blocks=32, block_size=8).generate(prompts, params)]
    assert out1 == out2 == ref

    first.tuning_cache.path.write_text("not json")  # corrupt: a warning, then everything is timed again
    with pytest.warns(UserWarning, match="corrupt"):
        third, out3 = run(tuning_cache=str(tmp_path))
    assert third.runner.linear.tunings == len(stored) and out3 == ref
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TuningCache(CPU, tmp_path).get("linear", next(iter(first.runner.linear.use_gemv))) is not None


def _host_bytes(fn) -> int:
    """Bytes of the CPU tensors the ops run by ``fn()`` produce (a dispatch mode sees every op's outputs)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    Count.total += t.numel() * t.element_size()
            return out

    with Count():
        fn()
    return Count.total


def test_random_model_is_built_where_it_runs():
    """``random_model`` touches no host memory for the weights (the target here is the meta device, standing in for
    the GPU); ``Llama(config).to(device, dtype)`` fills every weight on the host first, in fp32."""
    from lightning_llmopt.inference.loading import random_model

    config = LlamaConfig.from_preset("tiny")
    n = sum(p.numel() for p in Llama(config).parameters())
    old = _host_bytes(lambda: Llama(config).to(device="meta", dtype=torch.bfloat16))
    new = _host_bytes(lambda: random_model(config, "meta", torch.bfloat16))
    # new: only the RoPE table (reset_buffers computes it on the host when the target is meta), 2.5% of the old
    assert old >= 4 * n and new < 0.05 * old
    torch.manual_seed(0)
    model = random_model(config, "cpu", torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and model.rope.dtype == torch.float32
    ref = Llama(config)  # the same initialisation: same spread per weight (init_std, and the scaled wo/w2)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert abs(p.float().std().item() - q.std().item()) <= 0.1 * q.std().item() + 1e-6, name


_NO_TRITON = r"""
import importlib.abc, importlib.util, sys

class _Absent(importlib.abc.MetaPathFinder):  # as if triton were not installed: find_spec None, import fails
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

_find = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] == "triton" else _find(name, *a)
sys.meta_path.insert(0, _Absent())

from lightning_llmopt.inference import EngineConfig, LLMEngine, SamplingParams
from lightning_llmopt.models import Llama, LlamaConfig
import torch

torch.manual_seed(0)
model = Llama(LlamaConfig.from_preset("tiny")).eval()
engine = LLMEngine(model, config=EngineConfig(num_blocks=32, block_size=8, max_num_seqs=2, max_model_len=64))
out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))
assert len(out[0].outputs[0].token_ids) == 4, out
assert "triton" not in sys.modules
print("ok")
"""


def test_engine_builds_and_generates_without_triton(tmp_path):
    """The README's main command installs no Triton: the engine (tuning cache included) must not import it."""
    import subprocess
    import sys

    env = {**os.environ, "LLMOPT_CACHE_DIR": str(tmp_path), "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-c", _NO_TRITON], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
