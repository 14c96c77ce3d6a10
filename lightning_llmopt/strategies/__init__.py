"""Lightning strategies: thin adapters over :mod:`lightning_llmopt.parallel`.

Importing this package registers ``zero1``, ``zero2``, ``zero3``, ``zero2_offload`` and ``zero3_offload`` in
Lightning's ``StrategyRegistry`` (names already registered are left alone), so ``Trainer(strategy="zero2")`` works.
"""

from lightning_llmopt.strategies.zero import ZeroStrategy
from lightning_llmopt.strategies.zero_precision import ZeroPrecision

__all__ = ["ZeroPrecision", "ZeroStrategy"]
