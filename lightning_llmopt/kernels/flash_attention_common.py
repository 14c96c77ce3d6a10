"""Shapes, strides and tuning tables shared by the flash-attention launchers (imports no Triton)."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_llmopt.kernels import shared_memory as smem
from lightning_llmopt.kernels.launch_cache import LaunchCache

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class Geometry:
    """Sizes of one call. Dense: ``(B, S, H, D)`` tensors; packed: ``(total, H, D)`` with ``cu_seqlens``.

    Arguments:
        batch: number of sequences (``B`` dense, documents when packed).
        seq_q, seq_k: sequence lengths (dense); the longest document (packed, both equal).
        num_heads, group: query heads and query heads per key/value head.
        head_dim, block_d: head dim and its padding to a power of two (at least 16, the smallest ``tl.dot``).
        cu_seqlens: ``(batch + 1,)`` int32 document offsets when packed.
        total: packed token count (0 when dense).
    """

    batch: int
    seq_q: int
    seq_k: int
    num_heads: int
    group: int
    head_dim: int
    block_d: int
    cu_seqlens: Tensor | None = None
    total: int = 0

    @property
    def max_q(self) -> int:
        return self.seq_q

    @property
    def max_k(self) -> int:
        return self.seq_k

    @property
    def lse_shape(self) -> tuple[int, ...]:
        if self.cu_seqlens is not None:
            return (self.num_heads, self.total)
        return (self.batch, self.num_heads, self.seq_q)

    @property
    def tune_args(self) -> tuple[int, int]:
        """``(tune_q, tune_k)``: the lengths rounded up to powers of two (at least 16), the autotuning key.

        Keyed on the exact lengths, every new length re-ran the whole configuration search (tens of milliseconds);
        an inference engine's mixed and verification steps, and packed training batches, bring a new longest
        sequence nearly every call. One search per power of two serves them all.
        """
        return tune_bucket(self.seq_q), tune_bucket(self.seq_k)

    def tuning(self, window: int | None) -> tuple[int, int]:
        """:attr:`tune_args` of a call with a sliding ``window``: the key length capped at the window's bucket. A
        windowed call visits about ``window`` keys per query block whatever the sequence length, so it tunes as a
        call over that many keys (before, every window of a length bucket shared the first window's choice)."""
        tq, tk = self.tune_args
        return (tq, min(tk, tune_bucket(window))) if window is not None else (tq, tk)

    def strides(self, t: Tensor) -> tuple[int, int, int]:
        """(batch, token, head) strides in elements; the head dim must be contiguous."""
        if self.cu_seqlens is not None:
            return 0, t.stride(0), t.stride(1)
        return t.stride(0), t.stride(1), t.stride(2)

    def lse_strides(self, lse: Tensor) -> tuple[int, int]:
        """(batch, head) strides of an lse/delta tensor; the token stride is 1."""
        if self.cu_seqlens is not None:
            return 0, lse.stride(0)
        return lse.stride(0), lse.stride(1)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def geometry(q: Tensor, k: Tensor, cu_seqlens: Tensor | None, max_seqlen: int | None) -> Geometry:
    """The :class:`Geometry` of ``q``/``k`` (shapes already validated by the caller)."""
    head_dim = q.shape[-1]
    block_d = max(16, next_pow2(head_dim))
    if cu_seqlens is None:
        B, s_q, H, _ = q.shape
        return Geometry(B, s_q, k.shape[1], H, H // k.shape[2], head_dim, block_d)
    assert max_seqlen is not None
    H = q.shape[1]
    return Geometry(cu_seqlens.numel() - 1, max_seqlen, max_seqlen, H, H // k.shape[1], head_dim, block_d,
                    cu_seqlens, q.shape[0])


TUNE_KEY = ["tune_q", "tune_k", "HEAD_D", "IS_CAUSAL", "HAS_WINDOW", "IS_VARLEN"]
# The dK/dV pass also keys on the GQA group and the split: a program's work grows with the query heads it sums, so
# one process training models of different groups must not reuse the first model's launch.
DKDV_TUNE_KEY = [*TUNE_KEY, "group", "split"]


def tune_bucket(n: int) -> int:
    """``n`` rounded up to a power of two, at least 16 (one autotuning search per bucket)."""
    return 1 << max(4, (max(int(n), 1) - 1).bit_length())


def use_interpreter_config(t: Tensor) -> bool:
    """Fixed small blocks (no autotuning) when running in the Triton interpreter."""
    return t.device.type == "cpu" or os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreter_block(n: int) -> int:
    """Block size under the interpreter: 16 keeps tests of the masking paths cheap; 32 for longer sequences."""
    return 16 if n <= 64 else 32


LaunchConfig = tuple[dict[str, int], int, int]
"""``({"BLOCK_M": m, "BLOCK_N": n}, num_warps, num_stages)``: one launch configuration of a flash kernel."""


# Autotuning lists, ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``, by head-dim class (padded head dim ``BLOCK_D`` up
# to 64, up to 128, or larger). The wide-head lists come from benchmarks/sweep_attention.py on an H100 (hd128, S
# 1k..8k, causal and not, 2026-11-25): each member was best or within 5% of best on some shape, and every
# configuration that ran 1.3x or more behind the best everywhere was dropped (a noisy search must not be able to pick
# it: the dK/dV candidate (32, 128, 4, 3) ran 2.3x behind at hd128). The narrow-head lists are the earlier
# hand-picked ones, plus the forward's (64, 64, 4, 3), the best of 18 at the 1b preset's shape (hd64, GQA 8:1, B = 4,
# S = 4096, causal; 418 TF/s, 3.6% ahead of the next; H100 sweep with --narrow, 2026-11-26), where the dK/dV and dQ
# bests were already listed. The extra-wide lists (``BLOCK_D`` 256: MLA prefill's head dim 192, or 256) hold tiles
# whose estimate (:func:`smem_bytes`) fits the 227 KiB of an H100/H200 in 16-bit dtypes, with 8 warps where a
# program's fp32 accumulators hold 64 or more rows of 256 lanes, plus one small tile per pass that fits in fp32.
_FWD = {
    "narrow": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 4), (64, 64, 4, 3)],
    "wide": [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4)],
    "xwide": [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 32, 8, 3), (64, 32, 4, 2)],
}
_DKDV = {  # BLOCK_N is the key tile owned by the program, BLOCK_M the query tile it steps over
    "narrow": [(32, 128, 4, 3), (64, 128, 8, 3), (64, 64, 4, 3)],
    "wide": [(64, 128, 8, 3), (32, 64, 4, 3), (32, 64, 4, 5), (64, 128, 8, 2)],
    "xwide": [(32, 64, 8, 2), (64, 64, 8, 2), (32, 64, 8, 3), (32, 32, 4, 2)],
}
_DQ = {  # BLOCK_M queries per program, BLOCK_N keys per step
    "narrow": [(128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3)],
    "wide": [(128, 64, 8, 3), (128, 32, 4, 3), (64, 32, 4, 3)],
    "xwide": [(64, 32, 4, 3), (64, 64, 8, 2), (128, 32, 8, 2), (32, 32, 4, 2)],
}
_TABLES = {"fwd": _FWD, "dkdv": _DKDV, "dq": _DQ}
KERNEL_NAMES = {"fwd": "_flash_fwd_kernel", "dkdv": "_flash_bwd_dkdv_kernel", "dq": "_flash_bwd_dq_kernel"}


def head_dim_class(block_d: int) -> str:
    """``"narrow"`` (padded head dim up to 64), ``"wide"`` (up to 128) or ``"xwide"`` (more: MLA's 192 -> 256)."""
    return "narrow" if block_d <= 64 else "wide" if block_d <= 128 else "xwide"


def as_launch_config(t: tuple[int, int, int, int]) -> LaunchConfig:
    return {"BLOCK_M": t[0], "BLOCK_N": t[1]}, t[2], t[3]


def launch_configs(kernel: str, block_d: int | None = None) -> list[LaunchConfig]:
    """Autotuning list of ``kernel`` (``"fwd"``, ``"dkdv"`` or ``"dq"``) for a padded head dim ``block_d``; with
    ``block_d=None`` the union over head-dim classes (what the autotuner holds; :func:`prune_for_head_dim` narrows
    it per call)."""
    table = _TABLES[kernel]
    if block_d is not None:
        return [as_launch_config(t) for t in table[head_dim_class(block_d)]]
    seen: list[tuple[int, int, int, int]] = []
    for rows in table.values():
        seen += [t for t in rows if t not in seen]
    return [as_launch_config(t) for t in seen]


def smem_bytes(kernel: str, block_m: int, block_n: int, stages: int, block_d: int, elem: int) -> int:
    """Upper estimate of the shared memory (bytes) of one flash program; ``elem``: the inputs' element size.

    Tiles that stay for the whole program are counted once, tiles loaded in the pipelined loop ``stages`` times
    (Triton's pipeliner keeps ``num_stages`` buffers of each loop load that feeds a ``tl.dot``):

    - ``fwd``: ``(BLOCK_M + stages * 2 * BLOCK_N) * BLOCK_D * elem`` (the query tile; key and value tiles);
    - ``dkdv``: ``(2 * BLOCK_N + stages * 2 * BLOCK_M) * BLOCK_D * elem + stages * 2 * BLOCK_M * 4 + 1024`` (the key
      and value tiles; query and dO tiles, and the rows' fp32 lse2 and delta; 1 KiB of alignment: Triton 3.6
      reported up to 1024 bytes beyond the tiles, e.g. 41984 for (32, 64, 4, 3) at ``BLOCK_D`` 64);
    - ``dq``: ``(2 * BLOCK_M + stages * 2 * BLOCK_N) * BLOCK_D * elem`` (the query and dO tiles; key and value
      tiles).

    The forward's formula gives Triton's own figure for MLA's failing launch: (128, 64, 8, 3) at ``BLOCK_D`` 256 in
    bf16 is 262144 bytes. On an H200 with Triton 3.6 (2026-11-29) the forward's and the dQ pass's estimates equalled
    ``metadata.shared`` for every configuration at ``BLOCK_D`` 64, 128 and 256 (bf16); tests/kernels/
    test_shared_memory_gpu.py checks the bound for every configuration of the tables."""
    if kernel == "fwd":
        return (block_m + stages * 2 * block_n) * block_d * elem
    if kernel == "dkdv":
        return (2 * block_n + stages * 2 * block_m) * block_d * elem + stages * 2 * block_m * 4 + 1024
    if kernel == "dq":
        return (2 * block_m + stages * 2 * block_n) * block_d * elem
    raise ValueError(f"kernel ({kernel!r}) must be 'fwd', 'dkdv' or 'dq'")


def _estimate_from(kernel: str) -> Callable[[dict[str, Any]], int]:
    def estimate(p: dict[str, Any]) -> int:
        return smem_bytes(kernel, p["BLOCK_M"], p["BLOCK_N"], p["num_stages"], p["BLOCK_D"], p["elem"]["Q"])

    return estimate


for _name, _fn_name in KERNEL_NAMES.items():
    smem.register(_fn_name)(_estimate_from(_name))


def prune_for_head_dim(kernel: str):  # type: ignore[no-untyped-def]
    """``early_config_prune`` for ``triton.autotune``: keep the configurations of the call's head-dim class whose
    shared memory (:func:`smem_bytes`) fits the device (:func:`~.shared_memory.fit`, which raises a clear error where
    none does)."""

    def prune(configs, named_args, **kwargs):  # type: ignore[no-untyped-def]
        block_d = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
        wanted = [(c[0]["BLOCK_M"], c[0]["BLOCK_N"], c[1], c[2]) for c in launch_configs(kernel, block_d)]
        kept = [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in wanted]
        kept = kept or list(configs)
        q = named_args.get("Q")  # absent only where a caller prunes a bare list (no device: no limit)
        elem = q.element_size() if q is not None else 2
        head_dim = kwargs.get("HEAD_D", named_args.get("HEAD_D"))
        dtype = str(q.dtype).split(".")[-1] if q is not None else None
        call = smem.describe([("head dim", head_dim), ("BLOCK_D", block_d), ("dtype", dtype)])
        return smem.fit(f"flash attention {kernel} ({KERNEL_NAMES[kernel]})", kept,
                        lambda c: smem_bytes(kernel, c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages,
                                             block_d, elem),
                        smem.device_limit(q.device) if q is not None else None, call)

    return prune


class ChosenConfigs:
    """Launch an autotuned kernel; after the search for a key, launch the configuration it chose directly.

    Triton's ``Autotuner.run`` rebuilds its cache key from every argument on each call (about 35 us a launch on an
    H100 host, torch 2.11 / triton 3.6, 2026-11-25), and one attention forward + backward makes three tuned launches.
    The caller passes the key: the values of :data:`TUNE_KEY` and the dtype. Launches after the search go through
    a :class:`~lightning_llmopt.kernels.launch_cache.LaunchCache`, which skips ``JITFunction.run`` too.

    Arguments:
        make_tuner: returns the ``triton.autotune``-wrapped kernel (built on first use).
    """

    def __init__(self, make_tuner: Callable[[], Any]) -> None:
        self._make = make_tuner
        self._chosen: dict[tuple, tuple[dict[str, Any], dict[str, Any]]] = {}  # key: (block sizes, options)
        self._compiled = LaunchCache()

    def launch(self, key: tuple, grid: Callable[[dict], tuple], args: tuple, consts: dict[str, Any]) -> None:
        tuner = self._make()
        chosen = self._chosen.get(key)
        if chosen is None:
            tuner[grid](*args, **consts)
            config = self._settle(tuner, grid, args, consts)
            options = {k: v for k, v in config.all_kwargs().items() if k not in config.kwargs}
            self._chosen[key] = (config.kwargs, options)
        else:  # the chosen launch, through the compiled kernel cached for it (key + constexprs fix the compile)
            blocks, options = chosen
            self._compiled.launch(tuner.fn, (*key, *consts.values()), grid(blocks), args, {**consts, **blocks},
                                  options)

    @staticmethod
    def _settle(tuner: Any, grid: Callable[[dict], tuple], args: tuple, consts: dict[str, Any], top: int = 3) -> Any:
        """The search's best configuration, or the fastest of its ``top`` when timed again in two interleaved
        passes: one timing per candidate does not separate candidates a few percent apart (on an H100 the search
        picked a forward configuration 4% slower than the best, at hd128 S = 1k, 2026-11-26)."""
        import statistics

        from triton.testing import do_bench

        best = tuner.best_config
        timings = getattr(tuner, "configs_timings", None) or {}

        def median(t: Any) -> float:
            return float(t[0] if isinstance(t, (list, tuple)) else t)

        # finite timings only: Triton's autotuner times a configuration that failed to launch (OutOfResources) as inf
        ranked = sorted((c for c, t in timings.items() if math.isfinite(median(t))), key=lambda c: median(timings[c]))
        if len(ranked) < 2 or not torch.cuda.is_available() or torch.cuda.is_current_stream_capturing():
            return best
        times: dict[Any, list[float]] = {c: [] for c in ranked[:top]}
        for _ in range(2):
            for c in times:
                times[c].append(do_bench(lambda c=c: tuner.fn[grid(c.kwargs)](*args, **consts, **c.all_kwargs()),
                                         return_mode="median"))
        return min(times, key=lambda c: statistics.fmean(times[c]))


def tune_key(geo: Geometry, consts: dict[str, Any], dtype: torch.dtype, window: int | None = None) -> tuple:
    """The autotuning key of a call: the length buckets (:meth:`Geometry.tuning`), the constexpr flags of
    :data:`TUNE_KEY` and the dtype."""
    return (*geo.tuning(window), *(consts[name] for name in TUNE_KEY[2:]), dtype)


@functools.cache
def cuda_capability(device_index: int) -> tuple[int, int]:
    """``torch.cuda.get_device_capability``, kept per device: several microseconds a call, asked on every launch."""
    return torch.cuda.get_device_capability(device_index)


def device_is_cuda(t: Tensor) -> bool:
    return t.device.type == "cuda" and torch.cuda.is_available()
