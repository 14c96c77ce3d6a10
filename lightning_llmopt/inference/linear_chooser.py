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

__all__ = ["LinearChooser"]


def _split(y: Tensor, lins: tuple[Any, ...]) -> tuple[Tensor, ...]:
    return y.split([lin.weight.shape[0] for lin in lins], dim=-1)


def _rows(x: Tensor) -> int:
    """The row-count bucket a decision is taken for: 1, 2, 4, 8 or 16 (0: too many rows for the GEMVs)."""
    m = x.shape[0]
    return 0 if not 1 <= m <= MAX_ROWS else 1 << (m - 1).bit_length()


def _plain(lin: Any) -> bool:
    return type(lin) is torch.nn.Linear and not lin._forward_hooks and not lin._forward_pre_hooks


class LinearChooser:
    """``F.linear`` or :func:`gemv` for inputs of up to :data:`~.gemv.MAX_ROWS` rows, whichever was faster for the
    weight's shape and the row count's bucket (1, 2, 4, 8, 16; timed once, outside CUDA-graph capture; more rows
    always take ``F.linear``). :meth:`qkv` and :meth:`swiglu` likewise choose between one fused launch
    (:func:`gemv_cat`, :func:`gemv_swiglu`) and the separate products. Measured on an H100 (2026-11-26): a 5-row
    verify pass of a 16-layer, 1024-wide model took 0.81 ms through cuBLAS and 0.58 ms through the few-row GEMVs
    (one row through the GEMVs: 0.45-0.47 ms)."""

    def __init__(self) -> None:
        self.use_gemv: dict[tuple, bool] = {}
        # True/False: always/never the Triton GEMVs (tests; True also runs them on CPU under the interpreter)
        self.force: bool | None = None
        self.fused_calls = 0  # launches of the fused norm + q/k/v and norm + gate/up GEMVs
        # decisions kept on disk (a :class:`~lightning_llmopt.inference.tuning_cache.TuningCache`: ``get``/``put``)
        self.store: Any = None
        self.tunings = 0  # decisions timed (not found in ``use_gemv`` or the store)
        self.tuning_s = 0.0  # seconds spent timing them

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
        start = time.perf_counter()
        self.use_gemv[key] = self._measure(triton_fn, torch_fn)
        self.tunings += 1
        self.tuning_s += time.perf_counter() - start
        if self.store is not None:
            self.store.put("linear", key, self.use_gemv[key])
        return self.use_gemv[key]

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
