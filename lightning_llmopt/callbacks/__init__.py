"""Lightning callbacks, one per file; their logic lives in data/, parallel/ and quantization/."""

from lightning_llmopt.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_llmopt.callbacks.batch_size_finder import MicroBatchSizeFinder
from lightning_llmopt.callbacks.curriculum import Curriculum
from lightning_llmopt.callbacks.distillation import Distillation
from lightning_llmopt.callbacks.monitor import TrainingMonitor, peak_flops
from lightning_llmopt.callbacks.pipeline_timeline import PipelineTimeline
from lightning_llmopt.callbacks.pruning import Pruning
from lightning_llmopt.callbacks.qat import QuantizationAwareTraining
from lightning_llmopt.callbacks.sequence_packing import SequencePacking

__all__ = [
    "ActivationCheckpointing",
    "Curriculum",
    "Distillation",
    "MicroBatchSizeFinder",
    "PipelineTimeline",
    "Pruning",
    "QuantizationAwareTraining",
    "SequencePacking",
    "TrainingMonitor",
    "peak_flops",
]
