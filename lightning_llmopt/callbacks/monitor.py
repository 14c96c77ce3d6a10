"""``TrainingMonitor``: tokens/s, model TFLOP/s, MFU, peak memory and gradient norm, logged through Lightning."""

from __future__ import annotations

import resource
import time
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.throughput import get_available_flops
from torch import Tensor
from typing_extensions import override

# Dense (no sparsity) bf16/fp16 peaks of chips whose names Lightning's table misses or lists with sparsity.
_DENSE_PEAK_FLOPS = {"h100": 989.4e12, "h200": 989.4e12, "gh200": 989.4e12}


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Theoretical dense matmul FLOP/s of one device in ``dtype``; None on CPUs and unknown chips."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    if dtype in (torch.bfloat16, torch.float16):
        for chip, flops in _DENSE_PEAK_FLOPS.items():
            if chip in name.split() or f" {chip}" in name:
                return flops
    found = get_available_flops(device, dtype)
    return float(found) if found else None


FP8_PEAK_RATIO = 2.0  # FP8 tensor cores (Ada, Hopper, Blackwell): twice the dense bf16 peak (H100/H200: 1,979 vs 989)


def mixed_peak_flops(device: torch.device, dtype: torch.dtype, fp8_share: float = 0.0) -> float | None:
    """The peak a step reaches if its FP8 share of the FLOPs runs at the FP8 peak (``FP8_PEAK_RATIO`` x the
    ``dtype`` peak) and the rest at the ``dtype`` peak: ``P / (1 - s + s / 2)``, the time-weighted (harmonic) blend.
    ``fp8_share`` 0 gives :func:`peak_flops`."""
    peak = peak_flops(device, dtype)
    if peak is None or fp8_share <= 0:
        return peak
    return peak / (1.0 - fp8_share + fp8_share / FP8_PEAK_RATIO)


def fp8_flop_share(pl_module: L.LightningModule, seq_len: int) -> float:
    """The share of the module's training FLOPs in FP8 linear layers (``float8``); 0 without them."""
    model = getattr(pl_module, "model", None)
    share = 0.0
    if model is not None and getattr(pl_module, "hparams", {}).get("float8"):
        from lightning_llmopt.parallel.float8 import float8_flop_share

        share = float8_flop_share(model, flops_per_token(pl_module, seq_len))
    return share


def _step_peak(trainer: L.Trainer, pl_module: L.LightningModule, seq_len: int) -> float | None:
    """The MFU denominator of this module's steps: FP8 linears (``float8``) count against the FP8 peak."""
    return mixed_peak_flops(pl_module.device, _precision_dtype(trainer), fp8_flop_share(pl_module, seq_len))


def _precision_dtype(trainer: L.Trainer) -> torch.dtype:
    precision = str(trainer.precision)
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return torch.float32


def flops_per_token(pl_module: L.LightningModule, seq_len: int) -> float:
    """Training FLOPs per token of the module's model: its own count if it has one, else ``6 N``."""
    model = getattr(pl_module, "model", None)
    if model is not None and hasattr(model, "flops_per_token"):
        return float(model.flops_per_token(seq_len))
    return 6.0 * sum(p.numel() for p in pl_module.parameters())


class TrainingMonitor(L.Callback):
    """Logs throughput and memory every ``log_every_n_steps`` optimizer steps.

    Metrics (per device unless named otherwise): ``perf/tokens_per_sec`` (all devices),
    ``perf/tokens_per_sec_per_device``,
    ``perf/step_time_s``, ``perf/tflops_per_device`` (model FLOPs, no recomputation counted), ``perf/mfu`` (GPUs only,
    against the dense peak of the chip), ``memory/max_allocated_gib`` and ``memory/max_reserved_gib`` (GPUs) or
    ``memory/max_rss_gib`` (CPU), and ``train/grad_norm`` (before clipping).

    Arguments:
        log_every_n_steps: how often to log; the throughput figures average over the steps since the last log.
        skip_first_steps: steps excluded from timing (compilation, allocator warm-up).
        grad_norm: whether to compute the gradient norm (one reduction over all gradients per logged step).
    """

    def __init__(self, log_every_n_steps: int = 10, skip_first_steps: int = 2, grad_norm: bool = True) -> None:
        if log_every_n_steps <= 0:
            raise ValueError(f"log_every_n_steps ({log_every_n_steps}) must be positive")
        self.log_every_n_steps = log_every_n_steps
        self.skip_first_steps = skip_first_steps
        self.grad_norm = grad_norm
        self._window_start: float | None = None
        self._window_tokens = 0
        self._window_steps = 0
        self._seq_len = 0
        self.last_metrics: dict[str, float] = {}
        self._run_tokens = 0  # every timed window so far (the whole run after skip_first_steps)
        self._run_seconds = 0.0
        self._run_steps = 0
        self._run_flops = 0.0
        self._run_peak: float | None = None
        self._run_fp8_share = 0.0

    def _sync(self, pl_module: L.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._window_start is None and trainer.global_step >= self.skip_first_steps:
            self._sync(pl_module)
            self._window_start = time.perf_counter()
            self._window_tokens = self._window_steps = 0

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if not self.grad_norm or (trainer.global_step + 1) % self.log_every_n_steps != 0:
            return
        params = [p for p in pl_module.parameters() if p.grad is not None]
        if not params:
            return
        from torch.distributed.tensor import DTensor

        if any(isinstance(p.grad, DTensor) for p in params):
            # sharded over one or several meshes (TP, FSDP2, expert shards): each shard counted once, one collective
            from lightning_llmopt.parallel.data_parallel import grad_norm

            norm = grad_norm(params)
        else:
            grads = [p.grad for p in params if p.grad is not None]  # all of them: params was filtered above
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        pl_module.log("train/grad_norm", norm)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._window_start is None:
            return
        ids = batch["input_ids"] if isinstance(batch, dict) else batch[0]
        assert isinstance(ids, Tensor)
        self._seq_len = ids.shape[-1]
        self._window_tokens += ids.numel()
        self._window_steps += 1
        if trainer.global_step % self.log_every_n_steps != 0:
            return
        self._sync(pl_module)
        elapsed = time.perf_counter() - self._window_start
        metrics = self.compute(trainer, pl_module, elapsed)
        self.last_metrics = metrics
        self._run_tokens += self._window_tokens
        self._run_seconds += elapsed
        self._run_steps += self._window_steps
        self._run_flops += metrics["perf/tflops_per_device"] * 1e12 * elapsed
        self._run_peak = _step_peak(trainer, pl_module, self._seq_len)
        self._run_fp8_share = fp8_flop_share(pl_module, self._seq_len)
        pl_module.log_dict(metrics, rank_zero_only=True)
        self._window_start = time.perf_counter()
        self._window_tokens = self._window_steps = 0

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Counts the steps since the last log into the run's totals (not logged), so that :meth:`summary` covers
        the whole run, a run shorter than ``log_every_n_steps`` too."""
        if self._window_start is None or not self._window_steps:
            return
        self._sync(pl_module)
        elapsed = time.perf_counter() - self._window_start
        self._run_tokens += self._window_tokens
        self._run_seconds += elapsed
        self._run_steps += self._window_steps
        self._run_flops += flops_per_token(pl_module, self._seq_len) * self._window_tokens
        self._run_peak = _step_peak(trainer, pl_module, self._seq_len)
        self._run_fp8_share = fp8_flop_share(pl_module, self._seq_len)
        self._window_start = None
        self._window_tokens = self._window_steps = 0

    def compute(self, trainer: L.Trainer, pl_module: L.LightningModule, elapsed: float) -> dict[str, float]:
        """Throughput and memory over the current window of ``elapsed`` seconds."""
        tokens_per_sec = self._window_tokens / max(elapsed, 1e-9)
        flops = flops_per_token(pl_module, self._seq_len) * tokens_per_sec
        metrics = {
            "perf/tokens_per_sec_per_device": tokens_per_sec,
            "perf/tokens_per_sec": tokens_per_sec * trainer.world_size,
            "perf/step_time_s": elapsed / max(self._window_steps, 1),
            "perf/tflops_per_device": flops / 1e12,
        }
        peak = _step_peak(trainer, pl_module, self._seq_len)
        if peak:
            metrics["perf/mfu"] = flops / peak
        if pl_module.device.type == "cuda":
            metrics["memory/max_allocated_gib"] = torch.cuda.max_memory_allocated(pl_module.device) / 2**30
            metrics["memory/max_reserved_gib"] = torch.cuda.max_memory_reserved(pl_module.device) / 2**30
        else:
            metrics["memory/max_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        metrics.update(moe_metrics(getattr(pl_module, "moe_stats", None) or {}))
        return metrics


    def summary(self) -> dict[str, float]:
        """Throughput over the timed steps of the run so far (those after ``skip_first_steps``, up to the last log
        during training, all of them once training ended): ``steps``, ``tokens_per_sec_per_device``,
        ``tflops_per_device`` and, on GPUs, ``mfu``. Empty before any timed step was counted."""
        if not self._run_steps or self._run_seconds <= 0:
            return {}
        out = {
            "steps": float(self._run_steps),
            "tokens_per_sec_per_device": self._run_tokens / self._run_seconds,
            "tflops_per_device": self._run_flops / self._run_seconds / 1e12,
        }
        if self._run_peak:
            out["mfu"] = self._run_flops / self._run_seconds / self._run_peak
            if self._run_fp8_share:
                out["fp8_flop_share"] = self._run_fp8_share
        return out

    def summary_line(self) -> str:
        """One line for logs: ``throughput: 65,512 tokens/s per device, 412.3 TFLOP/s, 48.5% MFU (98 steps timed)``;
        empty before the first log."""
        s = self.summary()
        if not s:
            return ""
        mfu = f", {100 * s['mfu']:.1f}% MFU" if "mfu" in s else ""
        if "fp8_flop_share" in s:  # how the MFU counted: the FP8 share against twice the peak
            mfu += (f" ({100 * s['fp8_flop_share']:.0f}% of the FLOPs in FP8 linears, counted against "
                    f"{FP8_PEAK_RATIO:g}x the dense bf16 peak)")
        tflops = s["tflops_per_device"]
        shown = f"{tflops:.1f}" if tflops >= 1 else f"{tflops:.2g}"  # a CPU run of a tiny model: 0.0031, not 0.0
        return (f"throughput: {s['tokens_per_sec_per_device']:,.0f} tokens/s per device, "
                f"{shown} TFLOP/s{mfu} ({int(s['steps'])} steps timed)")


def moe_metrics(stats: dict[str, Tensor]) -> dict[str, float]:
    """Mixture-of-Experts load metrics from ``CausalLMModule.moe_stats`` (all ranks, last optimizer step):
    ``moe/load_cv`` and ``moe/dropped_fraction`` averaged over MoE layers, ``moe/load_cv_max`` over layers, and
    ``moe/expert_tokens/<layer>/<expert>`` the tokens each expert processed."""
    if not stats:
        return {}
    load, cv, dropped = stats["load"], stats["load_cv"], stats["dropped_fraction"]
    metrics = {
        "moe/load_cv": float(cv.mean()),
        "moe/load_cv_max": float(cv.max()),
        "moe/dropped_fraction": float(dropped.mean()),
    }
    for layer, row in enumerate(load.tolist()):
        for expert, count in enumerate(row):
            metrics[f"moe/expert_tokens/{layer}/{expert}"] = float(count)
    return metrics
