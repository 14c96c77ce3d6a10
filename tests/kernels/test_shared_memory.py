"""Every autotuned kernel prunes, before anything is timed, the configurations whose shared-memory estimate exceeds
the device's limit; no configuration fitting raises a clear error; the flash re-timing skips failed candidates.

The limit is monkeypatched to an H100/H200's 232448 bytes and to a small value; each prune must keep exactly the
configurations (of the call's head-dim class, where the kernel has classes) whose estimate fits."""

from __future__ import annotations

import math
from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_llmopt.kernels import shared_memory as smem

triton = pytest.importorskip("triton")

LIMITS = (smem.H100_LIMIT, 40_000)


@pytest.fixture
def limit(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Sets the device limit every prune sees: ``limit(n)``."""

    def set_limit(n: int | None) -> None:
        monkeypatch.setattr(smem, "device_limit", lambda device: n)

    return set_limit


def _expect(prune: Any, configs: list, wanted: list, estimate: Any, lim: int) -> None:
    """``prune()`` keeps exactly the ``wanted`` configurations whose estimate fits, or raises when none does."""
    fitting = [c for c in wanted if estimate(c) <= lim]
    if not fitting:
        with pytest.raises(smem.SharedMemoryError, match=f"limit per block is {lim} bytes"):
            prune()
        return
    assert prune() == fitting


def _flash_key(c: Any) -> tuple:
    return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages


@pytest.mark.parametrize("kernel", ["fwd", "dkdv", "dq"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_flash_prune_keeps_the_class_configs_that_fit(limit, kernel: str, dtype: torch.dtype) -> None:
    from lightning_llmopt.kernels.flash_attention_common import launch_configs, prune_for_head_dim, smem_bytes

    configs = [triton.Config(kw, num_warps=w, num_stages=s) for kw, w, s in launch_configs(kernel)]
    q = torch.empty(1, dtype=dtype)
    for lim in LIMITS:
        limit(lim)
        for head_dim in (64, 80, 128, 192):
            block_d = max(16, 1 << (head_dim - 1).bit_length())
            wanted_keys = [(c[0]["BLOCK_M"], c[0]["BLOCK_N"], c[1], c[2]) for c in launch_configs(kernel, block_d)]
            wanted = [c for c in configs if _flash_key(c) in wanted_keys]
            est = lambda c, d=block_d: smem_bytes(kernel, *_flash_key(c)[:2], c.num_stages, d,  # noqa: E731
                                                  q.element_size())
            _expect(lambda d=block_d, h=head_dim: prune_for_head_dim(kernel)(configs, {"Q": q}, BLOCK_D=d, HEAD_D=h),
                    configs, wanted, est, lim)
            if lim == smem.H100_LIMIT and dtype == torch.bfloat16:
                kept = prune_for_head_dim(kernel)(configs, {"Q": q}, BLOCK_D=block_d, HEAD_D=head_dim)
                assert kept, (kernel, head_dim)  # MLA's 192 keeps configurations for fwd, dkdv and dq
                if block_d <= 128:  # the measured lists are whole on an H100/H200
                    assert kept == wanted


def test_flash_forward_estimate_reproduces_tritons_figure_for_mla() -> None:
    """The launch that failed in MLA prefill: (128, 64, 8, 3) at head dim 192 (BLOCK_D 256), bf16: Triton reported
    262144 bytes against a limit of 232448; it is pruned, and the head-dim class of 256 does not hold it."""
    from lightning_llmopt.kernels.flash_attention_common import launch_configs, smem_bytes

    assert smem_bytes("fwd", 128, 64, 3, 256, 2) == 262144 > smem.H100_LIMIT
    assert ({"BLOCK_M": 128, "BLOCK_N": 64}, 8, 3) not in launch_configs("fwd", 256)
    assert ({"BLOCK_M": 128, "BLOCK_N": 64}, 8, 3) in launch_configs("fwd", 128)  # measured list unchanged


def test_all_pruned_raises_a_named_error(limit) -> None:
    from lightning_llmopt.kernels.flash_attention_common import launch_configs, prune_for_head_dim

    configs = [triton.Config(kw, num_warps=w, num_stages=s) for kw, w, s in launch_configs("fwd")]
    limit(50_000)
    with pytest.raises(smem.SharedMemoryError) as err:
        prune_for_head_dim("fwd")(configs, {"Q": torch.empty(1, dtype=torch.float32)}, BLOCK_D=256, HEAD_D=192)
    text = str(err.value)
    assert "flash attention fwd" in text and "head dim 192" in text and "float32" in text
    assert "limit per block is 50000 bytes" in text and "smallest needs an estimated" in text


def test_no_limit_on_cpu_or_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    assert smem.device_limit(torch.device("cpu")) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert smem.device_limit("cuda:0") is None
    assert smem.fit("k", [1, 2], lambda c: 10**9, None) == [1, 2]


def test_wgmma_prune(limit) -> None:
    pytest.importorskip("triton.experimental.gluon")
    from lightning_llmopt.kernels import flash_attention_bwd_wgmma as wg

    configs = wg._make_tuner().configs
    q = torch.empty(1, dtype=torch.bfloat16)
    for lim in LIMITS:
        limit(lim)
        for d in (64, 128):
            keys = {(c[0]["BLOCK_M"], c[0]["BLOCK_N"], c[1], c[2]) for c in wg.wgmma_configs(d)}
            wanted = [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps,
                                             c.kwargs["STAGES"]) in keys]
            est = lambda c, d=d: wg.wgmma_smem_bytes(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"],  # noqa: E731
                                                     c.kwargs["STAGES"], d)
            _expect(lambda d=d: wg._prune(configs, {"Q": q}, BLOCK_D=d), configs, wanted, est, lim)


@pytest.mark.parametrize("head_dim, group, cache", [(128, 4, torch.bfloat16), (576, 16, torch.bfloat16),
                                                    (128, 8, torch.int8), (576, 128, torch.bfloat16)])
def test_paged_prune(limit, head_dim: int, group: int, cache: torch.dtype) -> None:
    from lightning_llmopt.kernels import paged_attention_kernel as pk

    configs = pk._configs()
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    block_g = max(16, 1 << (group - 1).bit_length())
    q, k = torch.empty(1, dtype=torch.bfloat16), torch.empty(1, dtype=cache)
    quant = cache == torch.int8
    wanted = [c for c in configs if (c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in pk._CONFIGS[pk._class(block_d)]]
    for lim in LIMITS:
        limit(lim)
        est = lambda c: pk.smem_bytes(c.kwargs["BLOCK_N"], c.num_stages, block_g, block_d, 2,  # noqa: E731
                                      k.element_size(), quant)
        _expect(lambda: pk._prune(configs, {"Q": q, "K": k}, BLOCK_D=block_d, BLOCK_G=block_g, QUANT=quant,
                                  HEAD_D=head_dim), configs, wanted, est, lim)
    limit(smem.H100_LIMIT)
    if group <= 16:  # MLA's absorbed decode (576 -> 1024 lanes, 16 heads) keeps configurations on an H100/H200
        assert pk._prune(configs, {"Q": q, "K": k}, BLOCK_D=block_d, BLOCK_G=block_g, QUANT=quant, HEAD_D=head_dim)


def test_swiglu_and_rmsnorm_prunes(limit) -> None:
    from lightning_llmopt.kernels import rmsnorm_triton as rms
    from lightning_llmopt.kernels import swiglu_triton as sw

    x = torch.empty(1, dtype=torch.bfloat16)
    for lim in (*LIMITS, 1_000):
        limit(lim)
        configs = sw._configs()
        _expect(partial(sw._prune, configs, {"A": x}), configs, configs, lambda c: 0, lim)
        for block_d in (1024, 4096, 16384):
            fwd = rms._configs(block_d, two_pass=True)
            for has_res in (False, True):
                est = lambda c, d=block_d, r=has_res: rms.smem_bytes(  # noqa: E731
                    "fwd", c.kwargs["ROWS"], d, c.kwargs["TWO_PASS"] and not r, c.kwargs["CHUNK"])
                _expect(partial(rms._prune("fwd"), fwd, {"X": x, "D": block_d}, BLOCK_D=block_d, HAS_RES=has_res),
                        fwd, fwd, est, lim)
            bwd = rms._configs(block_d)
            est = lambda c, d=block_d: rms.smem_bytes("bwd", c.kwargs["ROWS"], d)  # noqa: E731
            _expect(partial(rms._prune("bwd"), bwd, {"X": x, "D": block_d}, BLOCK_D=block_d), bwd, bwd, est, lim)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_prunes(limit, dtype: torch.dtype) -> None:
    from lightning_llmopt.inference import gemv

    x, w = torch.empty(1, dtype=dtype), torch.empty(1, dtype=dtype)
    for lim in LIMITS:
        limit(lim)
        for rows, configs in ((False, gemv._gemv_configs()), (True, gemv._rows_configs())):
            for num_w, swiglu, delta in ((3, False, False), (2, True, True)):
                est = lambda c, r=rows, n=num_w, s=swiglu, d=delta: gemv.smem_bytes(  # noqa: E731
                    r, c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_stages, n, x.element_size(), w.element_size(),
                    s, d)
                _expect(lambda r=rows, cs=configs, n=num_w, s=swiglu, d=delta: gemv._prune(r)(
                    cs, {"X": x, "W0": w, "K": 4096}, NUM_W=n, SWIGLU=s, HAS_DELTA=d, BLOCK_M=16),
                    configs, configs, est, lim)


def test_quant_matmul_search_prunes_before_timing(limit) -> None:
    from lightning_llmopt.kernels import quant_matmul_tune as qt

    for lim in LIMITS:
        limit(lim)
        for m, bits, group, dtype in ((1, 4, 128, torch.bfloat16), (16, 4, 128, torch.bfloat16),
                                      (128, 8, 0, torch.float32)):
            x = torch.empty(m, 4096, dtype=dtype)
            cands = qt.candidate_configs(m, 4096, group, x_split=bits == 4, wide_words=bits == 4 and m == 1)
            est = partial(lambda c, b, e: qt.config_smem_bytes(c, b, e), b=bits, e=x.element_size())
            _expect(partial(qt.fitting_configs, cands, x, bits, group), cands, cands, est, lim)


def test_every_autotuned_kernel_has_an_estimate() -> None:
    """The GPU test (test_shared_memory_gpu.py) checks each of these against Triton's ``metadata.shared``."""
    import lightning_llmopt.inference.gemv  # noqa: F401
    import lightning_llmopt.kernels.flash_attention_bwd  # noqa: F401
    import lightning_llmopt.kernels.paged_attention_kernel  # noqa: F401
    import lightning_llmopt.kernels.quant_matmul_tune  # noqa: F401
    import lightning_llmopt.kernels.rmsnorm_triton  # noqa: F401
    import lightning_llmopt.kernels.swiglu_triton  # noqa: F401

    assert {"_flash_fwd_kernel", "_flash_bwd_dkdv_kernel", "_flash_bwd_dq_kernel", "_paged_decode_kernel",
            "_swiglu_fwd_kernel", "_swiglu_bwd_kernel", "_rms_fwd_kernel", "_rms_bwd_kernel", "_gemv_kernel",
            "_gemv_rows_kernel", "_qmm_kernel", "_qmv_kernel", "_qmv_words_kernel"} <= set(smem.ESTIMATES)


def test_settle_skips_configurations_that_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's autotuner times a configuration that could not launch as inf: the re-timing of the top candidates
    must never launch it again (that is where MLA prefill's OutOfResources escaped)."""
    import triton.testing

    from lightning_llmopt.kernels.flash_attention_common import ChosenConfigs

    class Cfg:  # hashable, as triton.Config is
        def __init__(self, m: int) -> None:
            self.kwargs = {"BLOCK_M": m}

        def all_kwargs(self) -> dict[str, int]:
            return dict(self.kwargs)

    cfg = Cfg

    bad, slow, fast, worse = cfg(1), cfg(2), cfg(3), cfg(4)
    launched: list[int] = []

    class Fn:
        def __getitem__(self, grid: Any) -> Any:
            return lambda *a, **kw: launched.append(kw["BLOCK_M"])

    tuner = SimpleNamespace(fn=Fn(), best_config=bad, configs_timings={
        bad: [math.inf] * 3, slow: [2.0, 2.0, 2.0], fast: [1.0, 1.0, 1.0], worse: [float("nan")]})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    def fake_bench(fn: Any, return_mode: str = "median") -> float:
        fn()
        return {2: 3.0, 3: 1.0}[launched[-1]]

    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)
    chosen = ChosenConfigs._settle(tuner, lambda meta: (1,), (), {})
    assert chosen is fast
    assert set(launched) == {2, 3}  # neither the inf nor the NaN configuration was launched
