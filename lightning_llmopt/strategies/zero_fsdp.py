"""Stage 3 of :class:`~lightning_llmopt.strategies.ZeroStrategy`: FSDP2 ``fully_shard`` from a meta-device model.

Framework-free, so it is defined in :mod:`lightning_llmopt.parallel.zero_fsdp` (``parallel/`` never imports
``strategies/``) and re-exported here.
"""

from __future__ import annotations

from lightning_llmopt.parallel.zero_fsdp import (
    edge_modules,
    fsdp_units,
    local,
    materialize,
    memory_bytes,
    no_gradient_sync,
    register_forward_methods,
    shard_module,
    transformer_blocks,
)

__all__ = [
    "edge_modules",
    "fsdp_units",
    "local",
    "materialize",
    "memory_bytes",
    "no_gradient_sync",
    "register_forward_methods",
    "shard_module",
    "transformer_blocks",
]
