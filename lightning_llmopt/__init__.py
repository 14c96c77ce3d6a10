"""lightning_llmopt: strategies, callbacks, kernels and inference for fast, memory-efficient LLMs in Lightning.

Importing the package needs only torch, lightning and torchmetrics: Triton, transformers and wandb load lazily.
"""

import lightning_llmopt.strategies  # noqa: F401, E402  (registers zero1/zero2/zero3/zero2_offload/zero3_offload)
from lightning_llmopt.callbacks import TrainingMonitor
from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.module import CausalLMModule

__version__ = "0.1.0"

__all__ = ["CausalLMModule", "Llama", "LlamaConfig", "TrainingMonitor", "__version__"]


def __getattr__(name: str):  # lazy: the data module pulls in nothing heavy, but keep import time low
    if name == "TextDataModule":
        from lightning_llmopt.data import TextDataModule

        return TextDataModule
    if name == "optimize_model":
        from lightning_llmopt.optimize import optimize_model

        return optimize_model
    raise AttributeError(f"module 'lightning_llmopt' has no attribute {name!r}")
