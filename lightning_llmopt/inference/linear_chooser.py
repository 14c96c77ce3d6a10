"""Per weight shape and row count, cuBLAS or the Triton GEMVs for inputs of a few rows (decode), timed once."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import Tensor

from lightning_llmopt.inference.decode_kernels import add_rms_norm, silu_mul
from lightning_llmopt.inference.gemv import (
    MAX_ROWS,
    gemv,
    gemv_cat,
    gemv_swiglu,
    norm_gemv_cat,
    norm_gemv_swiglu,
    pdl_enabled,
)

__all__ = ["LinearChooser", "bucket"]


def _split(y: Tensor, lins: tuple[Any, ...]) -> tuple[Tensor, ...]:
    return y.split([lin.weight.shape[0] for lin in lins], dim=-1)


def _rows(x: Tensor) -> int:
    """The row-count bucket a decision is taken for: 1, 2, 4, 8 or 16 (0: too many rows for the GEMVs)."""
    return bucket(x.shape[0])


def bucket(m: int) -> int:
    """The row-count bucket of ``m`` rows: the next power of two up to :data:`~.gemv.MAX_ROWS` (0: more rows)."""
    return 0 if not 1 <= m <= MAX_ROWS else 1 << (m - 1).bit_length()


def inherit_default() -> bool:
    """Whether a chooser infers bracketed buckets (:meth:`LinearChooser.tuning_order`): yes unless
    ``LLMOPT_TUNE_EVERY_BUCKET`` is set to something other than ``0``."""
    return os.environ.get("LLMOPT_TUNE_EVERY_BUCKET", "0").strip() in ("", "0")


def _plain(lin: Any) -> bool:
    return type(lin) is torch.nn.Linear and not lin._forward_hooks and not lin._forward_pre_hooks


class LinearChooser:
    """``F.linear`` or :func:`gemv` for inputs of up to :data:`~.gemv.MAX_ROWS` rows, whichever was faster for the
    weight's shape and the row count's bucket (1, 2, 4, 8, 16; timed once, outside CUDA-graph capture; more rows
    always take ``F.linear``). :meth:`qkv` and :meth:`swiglu` likewise choose between one fused launch
    (:func:`gemv_cat`, :func:`gemv_swiglu`) and the separate products. Measured on an H100 (2026-11-26): a 5-row
    verify pass of a 16-layer, 1024-wide model took 0.81 ms through cuBLAS and 0.58 ms through the few-row GEMVs
    (one row through the GEMVs: 0.45-0.47 ms).

    Bracketed buckets are inferred, not timed (``inherit``, on by default; ``LLMOPT_TUNE_EVERY_BUCKET=1`` times every
    bucket). From 2 to 16 rows the GEMV is one kernel (:func:`~.gemv._gemv_rows_kernel`, the rows padded to 16 on the
    tensor cores) with one configuration (its autotuning key has no row count): it streams the same weight with the
    same launch whatever the rows, so its time does not grow with them, and cuBLAS reads that weight too, more rows
    costing it no less. So when the decisions at two timed buckets agree, every bucket between them takes it: a
    weight shape that takes the GEMV at 2 and at 16 rows takes it at 4 and 8. :meth:`tuning_order` orders the graph
    sizes so that the endpoints are timed first (1, 2, 16, then 4 and 8, each between two decided buckets); a
    decision inferred so is counted in ``inherited`` and not stored (the store keeps what was measured)."""

    def __init__(self) -> None:
        self.use_gemv: dict[tuple, bool] = {}
        # True/False: always/never the Triton GEMVs (tests; True also runs them on CPU under the interpreter)
        self.force: bool | None = None
        self.fused_calls = 0  # launches of the fused norm + q/k/v and norm + gate/up GEMVs
        # decisions kept on disk (a :class:`~lightning_llmopt.inference.tuning_cache.TuningCache`: ``get``/``put``)
        self.store: Any = None
        self.tunings = 0  # decisions timed (not found in ``use_gemv`` or the store)
        self.tuning_s = 0.0  # seconds spent timing them
        self.inherit = inherit_default()  # infer a bucket between two agreeing decided buckets (see the docstring)
        self.inherited = 0  # decisions inferred so, not timed

    def tuning_order(self, sizes: tuple[int, ...]) -> tuple[int, ...]:
        """``sizes`` (row counts of the decode graphs) in the order their first runs should decide: one row, then the
        few-row buckets by bisection (the smallest and the largest, then each middle bucket between two decided
        ones), then the sizes past :data:`~.gemv.MAX_ROWS` (cuBLAS only). Ascending when ``inherit`` is off."""
        if not self.inherit:
            return tuple(sorted(sizes))
        groups: dict[int, list[int]] = {}
        for s in sorted(sizes):
            groups.setdefault(bucket(s), []).append(s)
        multi = sorted(b for b in groups if b >= 2)

        def bisect(lo: int, hi: int) -> list[int]:  # the buckets strictly between multi[lo] and multi[hi]
            if hi - lo < 2:
                return []
            mid = (lo + hi) // 2
            return [multi[mid], *bisect(lo, mid), *bisect(mid, hi)]

        order = [1] if 1 in groups else []
        if multi:
            order += [multi[0], *([multi[-1]] if len(multi) > 1 else []), *bisect(0, len(multi) - 1)]
        order += [0] if 0 in groups else []
        return tuple(s for b in order for s in groups[b])

    def _on_device(self, x: Tensor) -> bool:
        return x.device.type == "cuda" or (self.force is True and os.environ.get("TRITON_INTERPRET") == "1")

    def __call__(self, x: Tensor, lin: Any) -> Tensor:
        # only plain dense linears have a GEMV alternative; quantized layers run their own kernels
        if not _rows(x) or not self._on_device(x) or not isinstance(lin, torch.nn.Linear):
            # a plain linear skips the module call (host time: an eager prefill pass makes 7 products a layer)
            return torch.nn.functional.linear(x, lin.weight, lin.bias) if _plain(lin) else lin(x)
        key = (tuple(lin.weight.shape), lin.weight.dtype, _rows(x))
        return self._choose(key, lambda: gemv(x, lin.weight, lin.bias), lambda: lin(x))

    def qkv(self, x: Tensor, lins: tuple[Any, Any, Any]) -> tuple[Tensor, ...]:
        """``(wq x, wk x, wv x)``; fused, they are views of one output."""
        separate = lambda: tuple(self(x, lin) for lin in lins)  # noqa: E731
        if not self._fusable(x, lins) or len({lin.bias is None for lin in lins}) > 1:
            return separate()
        key = ("qkv", *(tuple(lin.weight.shape) for lin in lins), lins[0].weight.dtype, lins[0].bias is None, _rows(x))
        biases = None if lins[0].bias is None else [lin.bias for lin in lins]
        return self._choose(key, lambda: _split(gemv_cat(x, [lin.weight for lin in lins], biases), lins), separate)

    def swiglu(self, x: Tensor, gate: Any, up: Any) -> Tensor:
        """``silu(gate x) * (up x)``."""
        separate = lambda: silu_mul(self(x, gate), self(x, up))  # noqa: E731
        if not self._fusable(x, (gate, up)) or gate.bias is not None or up.bias is not None:
            return separate()
        key = ("swiglu", tuple(gate.weight.shape), tuple(up.weight.shape), gate.weight.dtype, _rows(x))
        return self._choose(key, lambda: gemv_swiglu(x, gate.weight, up.weight), separate)

    def norm_qkv(
        self, x: Tensor, delta: Tensor | None, norm: Any, lins: tuple[Any, Any, Any]
    ) -> tuple[tuple[Tensor, ...], Tensor]:
        """``((wq h, wk h, wv h), r)`` with ``r = x + delta`` and ``h = norm(r)`` (:func:`add_rms_norm`)."""
        separate = lambda: self._normed(x, delta, norm, lambda h: self.qkv(h, lins))  # noqa: E731
        if not self._fusable(x, lins) or len({lin.bias is None for lin in lins}) > 1:
            return separate()
        key = (
            "norm+qkv",
            *(tuple(lin.weight.shape) for lin in lins),
            lins[0].weight.dtype,
            lins[0].bias is None,
            delta is None,
            _rows(x),
        )
        biases = None if lins[0].bias is None else [lin.bias for lin in lins]

        def fused() -> tuple[tuple[Tensor, ...], Tensor]:
            self.fused_calls += 1
            y, res = norm_gemv_cat(x, norm.weight, norm.eps, delta, [lin.weight for lin in lins], biases)
            return _split(y, lins), res

        return self._choose(key, fused, separate)

    def norm_swiglu(self, x: Tensor, delta: Tensor | None, norm: Any, gate: Any, up: Any) -> tuple[Tensor, Tensor]:
        """``(silu(gate h) * (up h), r)`` with ``r = x + delta`` and ``h = norm(r)``."""
        separate = lambda: self._normed(x, delta, norm, lambda h: self.swiglu(h, gate, up))  # noqa: E731
        if not self._fusable(x, (gate, up)) or gate.bias is not None or up.bias is not None:
            return separate()
        key = (
            "norm+swiglu",
            tuple(gate.weight.shape),
            tuple(up.weight.shape),
            gate.weight.dtype,
            delta is None,
            _rows(x),
        )

        def fused() -> tuple[Tensor, Tensor]:
            self.fused_calls += 1
            return norm_gemv_swiglu(x, norm.weight, norm.eps, delta, gate.weight, up.weight)

        return self._choose(key, fused, separate)

    @staticmethod
    def _normed(x: Tensor, delta: Tensor | None, norm: Any, fn: Any) -> tuple[Tensor, Tensor]:
        h, res = add_rms_norm(x, norm.weight, norm.eps, delta)
        return fn(h), res

    def _fusable(self, x: Tensor, lins: tuple[Any, ...]) -> bool:
        if not _rows(x) or not self._on_device(x) or not all(_plain(lin) for lin in lins):
            return False
        w0 = lins[0].weight
        return all(lin.weight.dtype == w0.dtype and lin.weight.shape[1] == w0.shape[1] for lin in lins)

    def _choose(self, key: tuple, triton_fn: Any, torch_fn: Any) -> Tensor:
        use = self.use_gemv.get(key) if self.force is None else self.force
        if use is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return torch_fn()
            use = self._decide(key, triton_fn, torch_fn)
        return triton_fn() if use else torch_fn()

    def _decide(self, key: tuple, triton_fn: Any, torch_fn: Any) -> bool:
        """The stored decision for ``key`` if the store has one, else :meth:`_measure` it (and store it)."""
        stored = self.store.get("linear", key) if self.store is not None else None
        if isinstance(stored, bool):
            self.use_gemv[key] = stored
            return stored
        inferred = self._bracketed(key) if self.inherit else None
        if inferred is not None:
            self.use_gemv[key] = inferred
            self.inherited += 1
            return inferred
        start = time.perf_counter()
        self.use_gemv[key] = self._measure(triton_fn, torch_fn)
        self.tunings += 1
        self.tuning_s += time.perf_counter() - start
        if self.store is not None:
            self.store.put("linear", key, self.use_gemv[key])
        return self.use_gemv[key]

    def _bracketed(self, key: tuple) -> bool | None:
        """The decision of the nearest decided few-row buckets below and above ``key``'s (same weights), if both
        exist and agree (see the class docstring); ``None`` otherwise."""
        rows, stem = key[-1], key[:-1]
        if not 2 < rows < MAX_ROWS:
            return None
        decided = {k[-1]: v for k, v in self.use_gemv.items() if k[:-1] == stem and k[-1] >= 2}
        below = [b for b in decided if b < rows]
        above = [b for b in decided if b > rows]
        if not below or not above:
            return None
        lo, hi = decided[max(below)], decided[min(above)]
        return lo if lo == hi else None

    def _measure(self, triton_fn: Any, torch_fn: Any) -> bool:
        """Whether the Triton GEMV beats ``torch_fn`` (timed on the GPU, see below)."""
        from triton.testing import do_bench

        triton_fn()  # autotunes
        # Each candidate is timed as the replay of a CUDA graph holding one call, as the decode step runs it: timed
        # as plain launches, a product of 10-20 us measures the host's launch cost instead wherever that is slower
        # than the GPU (a Triton launch costs more host time than a cuBLAS one), and the choice then depended on the
        # host: the same H100 model chose cuBLAS for wo on slow hosts. Interleaved, best of three each: one timing of
        # a few microseconds moves by several percent.
        replays = [_captured(fn) for fn in (triton_fn, torch_fn)]
        t_triton, t_torch = float("inf"), float("inf")
        for _ in range(3):
            t_triton = min(t_triton, do_bench(replays[0].replay, warmup=5, rep=25, return_mode="median"))
            t_torch = min(t_torch, do_bench(replays[1].replay, warmup=5, rep=25, return_mode="median"))
        # Inside the decode graph a GEMV launched as a programmatic dependent also overlaps the drain of the kernel
        # before it, which a graph of one call cannot show: there, 32 wo products (4096x4096) took 0.446 ms through
        # the GEMV against 0.530 ms through cuBLAS (H100, 2026-11-25) while isolated timings called it a tie. With
        # PDL the GEMV stays unless cuBLAS is more than 5% faster.
        margin = 1.05 if pdl_enabled(torch.device("cuda")) else 1.0
        return t_triton < t_torch * margin


def _captured(fn: Any) -> torch.cuda.CUDAGraph:
    """A CUDA graph of one ``fn()`` call (warmed up on a side stream first, as capture requires)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph
