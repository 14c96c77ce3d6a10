"""The compile step of the plan: each decoder block through ``torch.compile``, without falling back to eager.

Blocks share one ``forward`` code object, and dynamo specialises on their integer attributes (the layer index, the
layer that holds its keys and values), so each block is one more entry in that code object's cache. Past dynamo's
recompile limit (8 by default) every further block runs eagerly, silently but for a log warning: a 22-block 1b model
compiled only 8 of its blocks (one H200: FP8 at 23.7k tokens/s against 55k for eager bf16). :func:`compile_blocks`

- treats integer attributes of modules as dynamic (``allow_unspec_int_on_nn_module``), so that blocks differing
  only in their index share one graph (on CPU, 2 graphs for 4 blocks instead of 4; dynamo still specialises the
  values 0 and 1). This is a process-wide dynamo setting; it changes only how module integers are traced;
- raises the recompile limit to cover every block besides, in case some attribute still specialises.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = ["compile_blocks"]


def _raise_recompile_limit(entries: int) -> None:
    import torch._dynamo

    config = torch._dynamo.config
    if hasattr(config, "allow_unspec_int_on_nn_module"):  # not part of torch's stable surface: feature-detected
        config.allow_unspec_int_on_nn_module = True
    for name in ("recompile_limit", "cache_size_limit"):  # torch >= 2.6 names it recompile_limit; older torch, both
        if hasattr(config, name) and getattr(config, name) < entries:
            setattr(config, name, entries)


def compile_blocks(blocks: Iterable[nn.Module]) -> int:
    """``block.compile()`` for each block, after making module integers dynamic and raising dynamo's recompile limit
    to the number of blocks plus 8 (headroom for the shapes a run sees). Returns the number of blocks compiled."""
    blocks = list(blocks)
    _raise_recompile_limit(len(blocks) + 8)
    for block in blocks:
        block.compile()
    return len(blocks)
