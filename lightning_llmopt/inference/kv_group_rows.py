"""The decode-row layout (:func:`~lightning_llmopt.inference.runner.decode_rows`) for KV groups.

With KV groups (producers with different windows, :mod:`~lightning_llmopt.inference.kv_groups`) every row
also needs, for each local group, the block its key is written to and the group's block table; slots, positions and
context lengths are the group-0 ones (the tables are aligned). :class:`~lightning_llmopt.inference.cuda_graphs.
DecodeGraphs` keeps these as extra static inputs of its graphs: one block row per local group appended to its
``(5, b)`` row buffer, and one table buffer per group, padded like group 0's (padding rows: block 0, context 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["group_rows", "local_tables"]


def local_tables(seq: Any, n_local: int) -> list[list[int]]:
    """The local groups' block tables of ``seq`` (``seq.group_tables``; empty tables before its first schedule)."""
    tables = getattr(seq, "group_tables", None)
    if tables is None or len(tables) != n_local:
        raise ValueError(f"sequence has {0 if tables is None else len(tables)} local block tables, need {n_local}")
    return tables  # type: ignore[no-any-return]


def group_rows(work: Sequence[Any], block_size: int, n_local: int) -> tuple[np.ndarray, list[list[list[int]]]]:
    """For the rows of ``work`` in :func:`~lightning_llmopt.inference.runner.decode_rows` order: ``(n_local, R)``
    int64, the block of each row's key in each local group, and per local group each row's block table."""
    n = sum(w.num_tokens for w in work)
    blocks = np.zeros((n_local, n), dtype=np.int64)
    tables: list[list[list[int]]] = [[] for _ in range(n_local)]
    r = 0
    for w in work:
        seq_tables = local_tables(w.seq, n_local)
        for p in range(w.start, w.start + w.num_tokens):
            for g, table in enumerate(seq_tables):
                blocks[g, r] = table[p // block_size]
                tables[g].append(table)
            r += 1
    return blocks, tables
