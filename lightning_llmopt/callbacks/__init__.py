"""Lightning callbacks, one per file; their logic lives in data/, parallel/ and quantization/."""

from lightning_llmopt.callbacks.monitor import TrainingMonitor, peak_flops

__all__ = ["TrainingMonitor", "peak_flops"]
