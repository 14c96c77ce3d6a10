"""Lightning callbacks, one per file; their logic lives in data/, parallel/ and quantization/."""

from lightning_llmopt.callbacks.curriculum import Curriculum
from lightning_llmopt.callbacks.monitor import TrainingMonitor, peak_flops
from lightning_llmopt.callbacks.sequence_packing import SequencePacking

__all__ = ["Curriculum", "SequencePacking", "TrainingMonitor", "peak_flops"]
