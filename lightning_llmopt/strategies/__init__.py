"""Lightning strategies: thin adapters over :mod:`lightning_llmopt.parallel`.

Importing this package registers ``zero1``, ``zero2``, ``zero3``, ``zero2_offload``, ``zero3_offload``,
``nd_parallel``, ``local_sgd``, ``diloco`` and ``ssp`` in Lightning's ``StrategyRegistry`` (names already registered
are left alone), so ``Trainer(strategy="zero2")`` works.
"""

from lightning_llmopt.strategies.async_dp import AsyncDataParallelStrategy
from lightning_llmopt.strategies.nd_parallel import NDParallelStrategy, NDPrecision
from lightning_llmopt.strategies.zero import ZeroStrategy
from lightning_llmopt.strategies.zero_precision import ZeroPrecision

__all__ = ["AsyncDataParallelStrategy", "NDParallelStrategy", "NDPrecision", "ZeroPrecision", "ZeroStrategy"]
