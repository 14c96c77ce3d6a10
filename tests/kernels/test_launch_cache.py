"""The compiled-kernel launch cache: which calls it takes, and that a changed specialization goes back to the JIT."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from lightning_llmopt.kernels import launch_cache  # noqa: E402
from lightning_llmopt.kernels.launch_cache import LaunchCache, arg_signature  # noqa: E402


def test_signature_changes_whenever_triton_would_specialize_differently() -> None:
    x = torch.zeros(64, dtype=torch.bfloat16)
    base = arg_signature((x, 32, 0.5, None, True))
    assert base == arg_signature((x.clone(), 48, 0.25, None, True))  # same alignment, multiple of 16, same types
    changed = [
        (x[1:], 32, 0.5, None, True),  # address no longer 16-byte aligned
        (x.float(), 32, 0.5, None, True),  # pointer dtype
        (x, 33, 0.5, None, True),  # not a multiple of 16
        (x, 1, 0.5, None, True),  # Triton turns an integer 1 into a constant
        (x, 2**32, 0.5, None, True),  # 64-bit integer
        (x, 32, 0.5, None, False),
    ]
    for args in changed:
        assert arg_signature(args) != base, args
    assert arg_signature(("not an argument kind the cache knows",)) is None


def test_signature_of_tma_descriptors_is_their_type() -> None:
    """A TMA descriptor specializes on its base's dtype, block shape and layout; its shape and strides are encoded
    at launch, so a descriptor of a longer tensor launches the same compiled kernel."""
    hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    gl = pytest.importorskip("triton.experimental.gluon.language")

    def desc(t: torch.Tensor, rows: int):  # type: ignore[no-untyped-def]
        dtype = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
        layout = gl.NVMMASharedLayout.get_default_for([rows, 64], dtype)
        return hopper.TensorDescriptor(t, list(t.shape), list(t.stride()), [rows, 64], layout)

    x = torch.zeros(256, 64, dtype=torch.bfloat16)
    base = arg_signature((desc(x, 64), 32))
    assert base is not None
    assert arg_signature((desc(torch.zeros(512, 64, dtype=torch.bfloat16), 64), 32)) == base
    assert arg_signature((desc(x, 128), 32)) != base  # block shape
    assert arg_signature((desc(x.half(), 64), 32)) != base  # dtype, layout


class _FakeCompiled:
    """A compiled kernel: ``run`` is its launcher, called as ``JITFunction.run`` calls it."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def run(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter_hook, exit_hook, *args):
        assert (stream, function, metadata) == ("stream", "function", "metadata")
        self.calls.append(("compiled", (gx, gy, gz), args))


class _FakeJit:
    """``fn[grid](*args, **kw)`` as a ``triton.jit`` function answers it: launch, return the compiled kernel."""

    arg_names = ["X", "n", "scale", "HEAD_D", "BLOCK"]

    def __init__(self) -> None:
        self.calls: list = []

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.calls.append(("jit", grid, args, kw))
            return _FakeCompiled(self.calls)

        return run


def test_cache_launches_the_compiled_kernel_until_the_signature_changes(monkeypatch) -> None:
    monkeypatch.setattr(launch_cache, "_current_device", lambda: 0)
    monkeypatch.setattr(launch_cache, "_current_stream", lambda device: "stream")
    monkeypatch.delenv("LLMOPT_TRITON_LAUNCH_CACHE", raising=False)
    monkeypatch.setattr(launch_cache, "_launcher_tested", lambda: True)
    fn, cache = _FakeJit(), LaunchCache()
    x = torch.zeros(64, dtype=torch.float16)
    consts = {"HEAD_D": 64, "BLOCK": 128}
    for n in (32, 48):
        cache.launch(fn, ("k",), (4, 2), (x, n, 0.5), consts, {"num_warps": 4})
    assert fn.calls[0] == ("jit", (4, 2), (x, 32, 0.5), {**consts, "num_warps": 4})
    # the second call: the compiled kernel, every parameter positionally (constexprs too), a 3-D grid
    assert fn.calls[1] == ("compiled", (4, 2, 1), (x, 48, 0.5, 64, 128))
    cache.launch(fn, ("k",), (4, 2), (x[1:], 48, 0.5), consts, {"num_warps": 4})  # misaligned: the JIT again
    cache.launch(fn, ("other",), (4, 2), (x, 48, 0.5), consts, {"num_warps": 4})  # another key: the JIT
    assert [c[0] for c in fn.calls] == ["jit", "compiled", "jit", "jit"]
    for _ in range(2):  # the misaligned call replaced the entry: the aligned one compiles back in, then hits
        cache.launch(fn, ("k",), (4, 2), (x, 48, 0.5), consts, {"num_warps": 4})
    assert [c[0] for c in fn.calls[-2:]] == ["jit", "compiled"]
    fn.pre_run_hooks = [lambda *a, **k: None]  # a hook on the kernel: launches go through the JIT, which runs it
    cache.launch(fn, ("k",), (4, 2), (x, 48, 0.5), consts, {"num_warps": 4})
    assert fn.calls[-1][0] == "jit"
    fn.pre_run_hooks = []
    monkeypatch.setenv("LLMOPT_TRITON_LAUNCH_CACHE", "0")
    cache.launch(fn, ("k",), (4, 2), (x, 48, 0.5), consts, {"num_warps": 4})
    assert fn.calls[-1][0] == "jit"  # turned off


@pytest.mark.parametrize("version, default_on", [("3.6.0", True), ("3.6.1", True), ("3.8.0", False), ("3.9.0", False)])
def test_cache_is_on_by_default_only_on_the_triton_line_it_ran_with(monkeypatch, version, default_on) -> None:
    """The cached launch calls Triton's private launcher, whose argument list changes between releases: by default
    it runs on the release lines it was run with on a GPU; the environment variable forces either way."""
    import triton

    monkeypatch.setattr(triton, "__version__", version)
    launch_cache._launcher_tested.cache_clear()
    monkeypatch.delenv("LLMOPT_TRITON_LAUNCH_CACHE", raising=False)
    try:
        assert LaunchCache.enabled() is default_on
        monkeypatch.setenv("LLMOPT_TRITON_LAUNCH_CACHE", "1")
        assert LaunchCache.enabled()
        monkeypatch.setenv("LLMOPT_TRITON_LAUNCH_CACHE", "0")
        assert not LaunchCache.enabled()
    finally:
        launch_cache._launcher_tested.cache_clear()


def test_cache_keeps_nothing_when_a_parameter_is_left_to_its_default(monkeypatch) -> None:
    monkeypatch.setattr(launch_cache, "_current_device", lambda: 0)
    monkeypatch.setattr(launch_cache, "_launcher_tested", lambda: True)
    fn, cache = _FakeJit(), LaunchCache()
    x = torch.zeros(64, dtype=torch.float16)
    for _ in range(2):
        cache.launch(fn, ("k",), (1,), (x, 32, 0.5), {"HEAD_D": 64}, {})  # BLOCK not given
    assert [c[0] for c in fn.calls] == ["jit", "jit"]


_GPU_CASES = {  # (head dim, query heads, key/value heads, causal, window, packed)
    "hd64-causal": (64, 4, 4, True, None, False),
    "hd64": (64, 4, 4, False, None, False),
    "hd128-gqa4-causal": (128, 8, 2, True, None, False),
    "hd128-packed-causal": (128, 4, 4, True, None, True),
    "hd64-window": (64, 4, 2, True, 37, False),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(_GPU_CASES))
def test_flash_attention_through_the_cache_matches_the_jit_launch_bit_for_bit(monkeypatch, case) -> None:
    """Forward + backward of flash attention, repeated: aligned storage, then views one element off alignment (a new
    specialization under the same autotuning key, and no Gluon dK/dV pass), then aligned again; every result equals
    the launch through ``JITFunction`` exactly, and a repeated call never reaches ``JITFunction.run``."""
    from lightning_llmopt.kernels import flash_attention

    D, H, H_kv, causal, window, packed = _GPU_CASES[case]
    cu = torch.tensor([0, 100, 350, 600], device="cuda", dtype=torch.int32) if packed else None
    lead = (600,) if packed else (2, 300)
    shapes = [(*lead, H, D), (*lead, H_kv, D), (*lead, H_kv, D), (*lead, H, D)]  # q, k, v, dO
    bufs = [torch.randn(math.prod(shape) + 8, device="cuda", dtype=torch.bfloat16) for shape in shapes]

    def run(offset: int, cached: bool):
        monkeypatch.setenv("LLMOPT_TRITON_LAUNCH_CACHE", "1" if cached else "0")
        q, k, v, do = (b[offset : offset + math.prod(s)].view(s) for b, s in zip(bufs, shapes, strict=True))
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = flash_attention(q, k, v, causal=causal, window=window, cu_seqlens=cu,
                              max_seqlen=250 if packed else None, backend="triton")
        return [out, *torch.autograd.grad(out, (q, k, v), do)]

    for offset in (0, 1):  # the autotuning searches: their first call may launch another configuration than the
        run(offset, cached=True)  # one kept (ChosenConfigs._settle times the search's best three again)
    for offset in (0, 0, 1, 1, 0):
        for a, b in zip(run(offset, cached=False), run(offset, cached=True), strict=True):
            assert torch.equal(a, b)
    import triton.runtime.jit as jit

    jit_runs: list[int] = []
    real = jit.JITFunction.run

    def counting(self, *args, **kwargs):
        jit_runs.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(jit.JITFunction, "run", counting)
    run(0, cached=True)
    assert not jit_runs, "a repeated call still went through JITFunction.run"
