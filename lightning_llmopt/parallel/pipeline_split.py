"""Where a decoder is cut into pipeline stages: by layer count or by a cost model, optionally balanced as Llama 3.

Pure functions (no ``torch.distributed``): the split is decided from the config alone, so every rank computes the
same one and a bad layout raises before any collective.

- ``split="layers"``: every stage gets ``n_layers // S`` blocks, the first ``n_layers % S`` stages one more.
- ``split="layers"`` with ``balance_ends=True`` (Llama 3, arXiv 2407.21783 section 3.3.2): the embedding and the
  head + loss count as one block each, so the first and last stages hold fewer blocks.
- ``split="cost"``: each block costs its training FLOPs per token (``6 x params + 6 x H x D x T``, causal attention;
  PaLM appendix B; each block with its own parameters, MLA widths and window:
  :mod:`~lightning_llmopt.parallel.layer_costs`) plus ``param_weight`` times its share of the parameters (memory),
  both normalised to the model total; with ``balance_ends`` the embedding (parameters only: a lookup does no
  matmul) and the head (``6 x dim x vocab`` FLOPs) are charged to the first and last stages. Stages are the
  contiguous partition that minimises the most expensive stage (dynamic programming, ``O(S L^2)``).

Stage ``s`` of ``S = P x V`` is placed on pipeline rank ``s % P`` ("loop": GPipe, 1F1B, interleaved, zero bubble) or
in a V shape ("v": ZBV, DualPipeV; rank ``r`` holds stages ``r`` and ``2P - 1 - r``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_llmopt.parallel.layer_costs import attention_flops, layer_counts

__all__ = ["StageSplit", "block_costs", "partition", "split_stages", "stage_ranks"]


@dataclass(frozen=True)
class StageSplit:
    """Blocks ``[start, end)`` of every stage, and which pipeline rank runs it.

    Arguments:
        ranges: ``(start, end)`` block indices per stage, in stage order (stage 0 holds the embedding, the last stage
            the final norm, head and loss).
        ranks: pipeline rank of every stage.
        costs: estimated cost of every stage (same units as the cost model; block counts for ``split="layers"``).
    """

    ranges: tuple[tuple[int, int], ...]
    ranks: tuple[int, ...]
    costs: tuple[float, ...]

    @property
    def num_stages(self) -> int:
        return len(self.ranges)

    def local_stages(self, pp_rank: int) -> list[int]:
        """Stage indices held by ``pp_rank``, ascending."""
        return [s for s, r in enumerate(self.ranks) if r == pp_rank]

    def layers_of(self, stages: list[int]) -> list[int]:
        return [i for s in stages for i in range(*self.ranges[s])]


def stage_ranks(num_stages: int, pp: int, style: str) -> tuple[int, ...]:
    """Pipeline rank of each stage: ``"loop"`` (``s % pp``) or ``"v"`` (down then up, two stages per rank)."""
    if style == "loop":
        return tuple(s % pp for s in range(num_stages))
    if style == "v":
        if num_stages != 2 * pp:
            raise ValueError(f"V-shaped schedules need 2 stages per rank: num_stages ({num_stages}) != 2*pp ({pp})")
        return tuple(s if s < pp else 2 * pp - 1 - s for s in range(num_stages))
    raise ValueError(f"stage placement style ({style!r}) must be 'loop' or 'v'")


def block_costs(config: Any, seq_len: int, param_weight: float = 0.25) -> tuple[list[float], float, float]:
    """Cost of each block, of the embedding and of the head (+ final norm and loss) for a ``LlamaConfig``.

    Returns ``(blocks, embedding, head)``, normalised so the whole model's FLOPs sum to 1 and its parameters to
    ``param_weight``.
    """
    dim, vocab = config.dim, config.vocab_size
    counts = layer_counts(config)  # MLA projections, K/V readers without wk/wv, MoE experts: each block its own
    flops = [6 * c.active + a for c, a in zip(counts, attention_flops(config, seq_len), strict=True)]
    params = [c.params for c in counts]
    head_flops = 6 * dim * vocab
    total_flops = sum(flops) + head_flops
    total_params = sum(params) + 2 * dim * vocab + dim

    def cost(f: float, p: float) -> float:
        return f / total_flops + param_weight * p / total_params

    return (
        [cost(f, p) for f, p in zip(flops, params, strict=True)],
        cost(0, dim * vocab),
        cost(head_flops, dim * vocab + dim),
    )


def partition(costs: list[float], num_stages: int, first: float = 0.0, last: float = 0.0) -> list[tuple[int, int]]:
    """Contiguous split of ``costs`` into ``num_stages`` non-empty runs minimising the largest run cost, where the
    first run also pays ``first`` and the last ``last``. Ties go to the split with the earliest cut points."""
    n = len(costs)
    if n < num_stages:
        raise ValueError(f"n_layers ({n}) must be >= the number of pipeline stages ({num_stages})")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][j]: the smallest max cost splitting blocks [0, j) into s stages; cut[s][j]: start of the last stage
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, n - (num_stages - s) + 1):
            for i in range(s - 1, j):
                stage = prefix[j] - prefix[i] + (first if s == 1 else 0.0) + (last if s == num_stages else 0.0)
                value = max(best[s - 1][i], stage)
                if value < best[s][j] - 1e-12:
                    best[s][j], cut[s][j] = value, i
    ranges: list[tuple[int, int]] = []
    j = n
    for s in range(num_stages, 0, -1):
        i = cut[s][j]
        ranges.append((i, j))
        j = i
    return ranges[::-1]


def split_stages(
    config: Any,
    pp: int,
    virtual_stages: int = 1,
    *,
    split: str = "layers",
    balance_ends: bool = False,
    style: str = "loop",
    seq_len: int | None = None,
    param_weight: float = 0.25,
) -> StageSplit:
    """Split ``config.n_layers`` blocks into ``pp * virtual_stages`` stages (see the module docstring)."""
    num_stages = pp * virtual_stages
    n = config.n_layers
    if n < num_stages:
        raise ValueError(
            f"n_layers ({n}) must be >= pipeline_parallel*virtual_stages ({pp}*{virtual_stages} = {num_stages}): "
            "every stage holds at least one block"
        )
    if split == "layers":
        if balance_ends:
            ranges = partition([1.0] * n, num_stages, first=1.0, last=1.0)
        else:
            counts = [n // num_stages + (1 if s < n % num_stages else 0) for s in range(num_stages)]
            starts = [sum(counts[:s]) for s in range(num_stages)]
            ranges = [(a, a + c) for a, c in zip(starts, counts, strict=True)]
        costs = [
            float(b - a) + (1.0 if balance_ends and s in (0, num_stages - 1) else 0.0)
            for s, (a, b) in enumerate(ranges)
        ]
        if balance_ends and num_stages == 1:
            costs = [float(n) + 2.0]
    elif split == "cost":
        blocks, emb, head = block_costs(config, seq_len or config.max_seq_len, param_weight)
        first, last = (emb, head) if balance_ends else (0.0, 0.0)
        ranges = partition(blocks, num_stages, first=first, last=last)
        costs = [
            sum(blocks[a:b]) + (first if s == 0 else 0.0) + (last if s == num_stages - 1 else 0.0)
            for s, (a, b) in enumerate(ranges)
        ]
    else:
        raise ValueError(f"pipeline split ({split!r}) must be 'layers' or 'cost'")
    return StageSplit(tuple(ranges), stage_ranks(num_stages, pp, style), tuple(costs))
