"""Profile summaries of benchmarks/launch.py on synthetic profiler events (benchmarks/ is not a package)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from lightning_llmopt.testing.scripts import load_script

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


launch = load_script(BENCH / "launch.py", "_test_bench_launch")


def _evt(name: str, start: float, end: float, device: str = "DeviceType.CPU") -> SimpleNamespace:
    span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
    return SimpleNamespace(name=name, device_type=device, time_range=span)


class _Prof:
    def __init__(self, events: list[SimpleNamespace]) -> None:
        self._events = events

    def events(self) -> list[SimpleNamespace]:
        return self._events


def test_idle_is_charged_to_the_innermost_open_host_scope() -> None:
    """Three device gaps: one inside an optimizer step (charged to it, not to the aten op or the CUDA call within),
    one inside an FSDP pre-forward nested in the training step, one where no scope is open; short gaps ignored."""
    cuda = "DeviceType.CUDA"
    prof = _Prof(
        [
            _evt("gemm", 0, 100, cuda),
            _evt("gemm", 150, 200, cuda),  # gap 100-150 (50 us): inside Optimizer.step
            _evt("gemm", 205, 300, cuda),  # gap 200-205 (5 us): below the threshold
            _evt("gemm", 400, 500, cuda),  # gap 300-400 (100 us): FSDP::pre_forward inside training_step
            _evt("gemm", 600, 650, cuda),  # gap 500-600 (100 us): no scope
            _evt("Optimizer.step#AdamW.step", 90, 160),
            _evt("aten::_fused_adamw_", 110, 140),
            _evt("cudaLaunchKernel", 120, 130),
            _evt("[LightningModule]training_step", 290, 480),
            _evt("FSDP::pre_forward (layers.0)", 320, 390),
            _evt("aten::empty", 340, 360),
        ]
    )
    got = launch.idle_by_host_scope(prof, min_gap_us=10.0)
    assert got == {
        "Optimizer.step#AdamW.step": (50, 1),
        "FSDP::pre_forward (layers.0)": (100, 1),
        "(none)": (100, 1),
    }
    summary = launch._gpu_idle_summary(prof, steps=1)
    assert "idle by host scope" in summary and "FSDP::pre_forward (layers.0)" in summary


def test_device_side_annotations_are_not_busy_time() -> None:
    """A ``record_function`` range mirrored onto the device timeline spans the idle gaps inside it: the busy time and
    the gaps come from kernels and copies alone (before 2026-11-22 the range hid FSDP1's idle time)."""
    cuda = "DeviceType.CUDA"
    annotation = _evt("FullyShardedDataParallel.forward", 0, 300, cuda)
    annotation.is_user_annotation = True
    prof = _Prof([_evt("gemm", 0, 100, cuda), _evt("gemm", 200, 300, cuda), annotation])
    wall, busy, gaps = launch.device_intervals(prof)
    assert (wall, busy) == (300, 200)
    assert [g[0] for g in gaps] == [100]
    assert launch.idle_by_host_scope(prof, min_gap_us=10.0) == {"(none)": (100, 1)}
