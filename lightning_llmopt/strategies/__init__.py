"""Lightning strategies: thin adapters over :mod:`lightning_llmopt.parallel`.

Importing this package registers ``zero1``, ``zero2``, ``zero3``, ``zero2_offload``, ``zero3_offload`` and
``nd_parallel`` in Lightning's ``StrategyRegistry`` (names already registered are left alone), so
``Trainer(strategy="zero2")`` works.
"""

from lightning_llmopt.strategies.nd_parallel import NDParallelStrategy, NDPrecision
from lightning_llmopt.strategies.zero import ZeroStrategy
from lightning_llmopt.strategies.zero_precision import ZeroPrecision

__all__ = ["NDParallelStrategy", "NDPrecision", "ZeroPrecision", "ZeroStrategy"]
