"""lightning_llmopt: strategies, callbacks, kernels and inference for fast, memory-efficient LLMs in Lightning.

Importing the package imports nothing heavy: torch, Lightning, Triton, transformers and wandb load when a name that
needs them is first used (``lightning_llmopt.CausalLMModule`` imports Lightning, ``lightning_llmopt.Llama`` torch).
Our strategies (``zero1``/``zero2``/``zero3``/``zero2_offload``/``zero3_offload``, ``nd_parallel``, ``local_sgd``,
``diloco``, ``ssp``) are registered in Lightning's ``StrategyRegistry`` as soon as ``lightning.pytorch`` is imported,
before or after this package, so ``Trainer(strategy="zero3")`` works; and the kernel step of ``Llama``'s
``fused_kernels`` as soon as ``models/llama.py`` loads (see :mod:`lightning_llmopt._registration`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_llmopt._lazy import lazy_exports
from lightning_llmopt._registration import register_when_lightning_loads, register_when_llama_loads

if TYPE_CHECKING:  # the names below, for type checkers and IDEs
    from lightning_llmopt.callbacks.monitor import TrainingMonitor
    from lightning_llmopt.data.datamodule import TextDataModule
    from lightning_llmopt.models.config import LlamaConfig
    from lightning_llmopt.models.llama import Llama
    from lightning_llmopt.module import CausalLMModule
    from lightning_llmopt.optimize import optimize_model

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "CausalLMModule": "module",
    "Llama": "models",
    "LlamaConfig": "models",
    "TextDataModule": "data.datamodule",
    "TrainingMonitor": "callbacks.monitor",
    "optimize_model": "optimize",
}

__all__ = [
    "CausalLMModule",
    "Llama",
    "LlamaConfig",
    "TextDataModule",
    "TrainingMonitor",
    "__version__",
    "optimize_model",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

register_when_lightning_loads()
register_when_llama_loads()  # Llama's fused_kernels step (lightning_llmopt.optimize)
