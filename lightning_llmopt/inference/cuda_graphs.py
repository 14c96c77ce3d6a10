"""Decode steps replayed from CUDA graphs, one graph per common batch size.

A decode step launches a few hundred small kernels; replaying them from a captured ``torch.cuda.CUDAGraph`` removes
the CPU launch cost between them (gpt-fast gets the same effect from ``torch.compile(mode="reduce-overhead")``).

- Inputs live in static buffers sized for the largest captured batch. A batch of ``n`` decodes runs the graph of the
  smallest captured size ``b >= n``; rows ``n..b-1`` are padding: context length 0 (the attention kernel reads no
  key and writes zeros) and key/value slot 0 of the null block (never read).
- The split-KV grid of the attention kernel is sized from ``max_model_len`` (fixed at capture); splits past the end
  of a shorter sequence return at once.
- Graphs are captured on first use of each size, after two warm-up runs on a side stream (Triton compilation and
  autotuning must happen outside the capture). All graphs share one memory pool.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_llmopt.inference.runner import ModelRunner, StepInputs
from lightning_llmopt.inference.scheduler import Work

__all__ = ["DecodeGraphs"]


class DecodeGraphs:
    """Captured decode steps (see the module docstring).

    Arguments:
        runner: the engine's model runner (CUDA).
        sizes: batch sizes to capture (sorted).
        max_blocks: block-table width (blocks of a ``max_model_len`` sequence).
        max_context: ``max_model_len``: the bound the attention grid is sized for.
    """

    def __init__(self, runner: ModelRunner, sizes: tuple[int, ...], max_blocks: int, max_context: int) -> None:
        self.runner = runner
        self.sizes = tuple(sorted(sizes))
        self.max_batch = self.sizes[-1]
        self.max_blocks = max_blocks
        self.max_context = max_context
        dev = runner.device
        b = self.max_batch
        # one device buffer for the per-row inputs, so a step needs one host-to-device copy (plus the tables)
        self.meta = torch.zeros(5, b, dtype=torch.long, device=dev)
        self.ids, self.pos, self.blocks, self.slots, self.ctx = self.meta.unbind(0)
        self.tables = torch.zeros(b, max_blocks, dtype=torch.int32, device=dev)
        self.rows = torch.arange(b, dtype=torch.long, device=dev)
        self._staging = torch.zeros(5, b, dtype=torch.long).pin_memory()
        self._table_staging = torch.zeros(b, max_blocks, dtype=torch.int32).pin_memory()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Tensor] = {}
        self._mempool: Any = None

    def fits(self, n: int) -> bool:
        return 0 < n <= self.max_batch

    def _inputs(self, b: int) -> StepInputs:
        return StepInputs(
            input_ids=self.ids[:b],
            positions=self.pos[:b],
            blocks=self.blocks[:b],
            slots=self.slots[:b],
            num_decode=b,
            dec_tables=self.tables[:b],
            dec_ctx=self.ctx[:b],
            dec_max_ctx=self.max_context,
            logits_idx=self.rows[:b],
        )

    def _capture(self, b: int) -> None:
        inp = self._inputs(b)
        stream = torch.cuda.Stream(self.runner.device)
        stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.runner.forward(inp, max_context=self.max_context)
        torch.cuda.current_stream(self.runner.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            out = self.runner.forward(inp, max_context=self.max_context)
        self._mempool = graph.pool()
        self.graphs[b] = graph
        self.outputs[b] = out

    def _fill(self, work: list[Work], b: int) -> None:
        """Stage the inputs in pinned memory and copy them (asynchronously) into the static buffers.

        The staging buffers are reused every step: safe because sampling reads the previous step's logits on the
        host, which waits for everything queued before, these copies included."""
        bs = self.runner.block_size
        stage = self._staging.numpy()
        stage[:, :b] = 0  # padding rows: token 0 at position 0, null block slot 0, context 0
        tables = self._table_staging.numpy()
        widest = 1
        for r, w in enumerate(work):
            seq, p = w.seq, w.start
            table = seq.block_table
            stage[0, r] = seq.tokens[p]
            stage[1, r] = p
            stage[2, r] = table[p // bs]
            stage[3, r] = p % bs
            stage[4, r] = p + 1
            tables[r, : len(table)] = table
            widest = max(widest, len(table))
        self.meta[:, :b].copy_(self._staging[:, :b], non_blocking=True)
        n = len(work)
        self.tables[:n, :widest].copy_(self._table_staging[:n, :widest], non_blocking=True)

    def run(self, work: list[Work]) -> Tensor:
        """Logits ``(n, vocab)`` of ``n`` decode works (each computing its sequence's last token)."""
        n = len(work)
        b = next(s for s in self.sizes if s >= n)
        self._fill(work, b)
        if b not in self.graphs:
            self._capture(b)
        self.graphs[b].replay()
        return self.outputs[b][:n]
