"""Decode steps replayed from CUDA graphs, one graph per common batch size (in rows: one row per token).

A decode step launches a few hundred small kernels; replaying them from a captured ``torch.cuda.CUDAGraph`` removes
the CPU launch cost between them (gpt-fast gets the same effect from ``torch.compile(mode="reduce-overhead")``).

- Inputs live in static buffers sized for the largest captured batch. A batch of ``n`` decodes runs the graph of the
  smallest captured size ``b >= n``; rows ``n..b-1`` are padding: context length 0 (the attention kernel reads no
  key and writes zeros) and key/value slot 0 of the null block (never read).
- The split-KV grid of the attention kernel is sized from ``max_model_len`` (fixed at capture); splits past the end
  of a shorter sequence return at once.
- Graphs are captured on first use of each size, or all at once by :meth:`DecodeGraphs.capture_all` (the engine
  does so at start), after two warm-up runs on a side stream (Triton compilation and autotuning must happen outside
  the capture). All graphs share one memory pool.
- A work of several tokens (a speculative verify, or a draft model catching up on accepted tokens) takes one row
  per token (:func:`~lightning_llmopt.inference.runner.decode_rows`), so speculative steps replay graphs too.
  :meth:`DecodeGraphs.run` returns the rows :meth:`ModelRunner.forward` would.
- ``capture=False`` (and any non-CUDA device) runs the same static-buffer step eagerly: the row layout and the
  selection of logits are then checked on the CPU.
- KV groups (producers with different windows): each local group's key blocks are extra rows of the row buffer
  (``meta[5 + g]``) and its block tables a table buffer of their own (``all_tables[1 + g]``), padded like group
  0's (:mod:`~lightning_llmopt.inference.kv_group_rows`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_llmopt.inference.kv_group_rows import group_rows
from lightning_llmopt.inference.kv_groups import GroupedPool
from lightning_llmopt.inference.runner import ModelRunner, StepInputs, decode_rows, sampled_rows, to_device
from lightning_llmopt.inference.scheduler import Work

__all__ = ["DecodeGraphs", "graph_sizes", "step_logits"]


def graph_sizes(batch_sizes: tuple[int, ...], max_num_seqs: int, spec_tokens: int = 0) -> tuple[int, ...]:
    """Row counts to capture: ``batch_sizes`` up to the widest step, ``max_num_seqs * (1 + spec_tokens)`` rows (a
    speculative verify takes one row per token), doubling past the largest given size when speculating."""
    rows = max_num_seqs * (1 + spec_tokens)
    sizes = [s for s in batch_sizes if s <= rows]
    while spec_tokens and sizes and sizes[-1] < rows:
        sizes.append(min(2 * sizes[-1], rows))
    return tuple(sizes)


def step_logits(graphs: DecodeGraphs | None, runner: ModelRunner, work: list[Work],
                split: bool = False) -> tuple[list[Work], Tensor]:
    """``(work, logits)``: a step's logits, one row per sampled token, in the order of the returned work.

    Without graphs (or when none serves any of the work) the runner runs the step eagerly. A step that mixes decodes
    with prefill chunks (continuous batching admits new requests while others decode) runs in one eager pass, its
    decodes beside the chunks (one read of the weights); with ``split`` it runs its decodes and verifies from a
    graph and only the prefill chunks eagerly (two reads of the weights, the decodes' without launch cost; the
    returned order is then graph work first)."""
    if graphs is not None and graphs.accepts(work):
        return work, graphs.run(work)
    if not split:
        work = ModelRunner.order(work)
        return work, runner.forward(runner.prepare(work))
    fast: list[Work] = []
    slow: list[Work] = []
    rows = 0
    for w in work:
        if graphs is not None and graphs.serves(w) and rows + w.num_tokens <= graphs.max_batch:
            fast.append(w)
            rows += w.num_tokens
        else:
            slow.append(w)
    slow = ModelRunner.order(slow)
    if not fast:
        return slow, runner.forward(runner.prepare(slow))
    assert graphs is not None
    return [*fast, *slow], torch.cat([graphs.run(fast), runner.forward(runner.prepare(slow))])


class DecodeGraphs:
    """Captured decode steps (see the module docstring).

    Arguments:
        runner: the engine's model runner (CUDA).
        sizes: batch sizes to capture (sorted).
        max_blocks: block-table width (blocks of a ``max_model_len`` sequence).
        max_context: ``max_model_len``: the bound the attention grid is sized for.
        capture: capture CUDA graphs (CUDA only); ``False`` runs the static-buffer steps eagerly.
        max_tokens_per_work: works of more tokens (prefill chunks) are left to the runner's prefill path.
    """

    def __init__(
        self,
        runner: ModelRunner,
        sizes: tuple[int, ...],
        max_blocks: int,
        max_context: int,
        capture: bool = True,
        max_tokens_per_work: int = 16,
    ) -> None:
        self.runner = runner
        self.capture = capture and runner.device.type == "cuda"
        self.max_tokens_per_work = max_tokens_per_work
        self.sizes = tuple(sorted(sizes))
        self.max_batch = self.sizes[-1]
        self.max_blocks = max_blocks
        self.max_context = max_context
        dev = runner.device
        b = self.max_batch
        pool = runner.pool
        self.n_local = len(pool.pools) - 1 if isinstance(pool, GroupedPool) else 0  # KV groups past group 0
        m = 5 + self.n_local
        # one device buffer for the per-row inputs, so a step needs one host-to-device copy (plus the tables)
        self.meta = torch.zeros(m, b, dtype=torch.long, device=dev)
        self.ids, self.pos, self.blocks, self.slots, self.ctx = self.meta[:5].unbind(0)
        self.all_tables = torch.zeros(1 + self.n_local, b, max_blocks, dtype=torch.int32, device=dev)
        self.tables = self.all_tables[0]
        self.rows = torch.arange(b, dtype=torch.long, device=dev)
        pin = runner.device.type == "cuda"
        self._staging = torch.zeros(m, b, dtype=torch.long, pin_memory=pin)
        self._table_staging = torch.zeros(1 + self.n_local, b, max_blocks, dtype=torch.int32, pin_memory=pin)
        self._chain_staging: Tensor | None = None  # stage_chain's pinned rows (P, 5, max_batch) and tables
        self._chain_tables: Tensor | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Tensor] = {}
        self._mempool: Any = None

    def fits(self, n: int) -> bool:
        return 0 < n <= self.max_batch

    def serves(self, w: Work) -> bool:
        """Whether one work can take the row layout: a decode, a speculative verify (every token sampled) or a short
        catch-up."""
        if w.num_tokens > self.max_tokens_per_work:
            return False
        return not (w.num_tokens > 1 and w.samples and w.num_logits not in (1, w.num_tokens))

    def accepts(self, work: list[Work]) -> bool:
        """Whether :meth:`run` serves ``work``: every work :meth:`serves`, within the largest captured size."""
        return bool(work) and all(self.serves(w) for w in work) and self.fits(sum(w.num_tokens for w in work))

    def _inputs(self, b: int) -> StepInputs:
        inp = StepInputs(
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
        if self.n_local:  # each local group: its key blocks and tables, the same positions, slots and contexts
            local = [
                dataclasses.replace(inp, blocks=self.meta[5 + g, :b], dec_tables=self.all_tables[1 + g, :b])
                for g in range(self.n_local)
            ]
            inp.groups = [inp, *local]
        return inp

    def row_layout(self, work: list[Work]) -> tuple[np.ndarray, list[list[list[int]]]]:
        """:func:`decode_rows` of ``work`` with each local group's block row appended (``(5 + n_local, R)``), and
        each row's block table per group (group 0 first)."""
        rows, tables = decode_rows(work, self.runner.block_size)
        if not self.n_local:
            return rows, [tables]
        blocks, local = group_rows(work, self.runner.block_size, self.n_local)
        return np.concatenate([rows, blocks]), [tables, *local]

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

    def capture_all(self, progress: Callable[[str], None] | None = None) -> None:
        """Capture every size now instead of on first use. A size first needed mid-serving stalls that step by its
        capture (with its Triton compilation, over a second on an H100: speculative verify steps reach sizes a
        warm-up may not have); the engine calls this at start. The buffers hold padding rows meanwhile (context 0,
        the null block's slot), which the warm-up and replay may compute. ``progress`` is called with a phase name
        before each size (:meth:`~lightning_llmopt.inference.startup.StartupLog.mark`)."""
        for b in self.sizes:
            if not self.capture:
                return
            if b not in self.graphs:
                if progress is not None:
                    progress(f"cuda graph {b} rows")
                self._step(b)

    def _fill(self, work: list[Work], b: int) -> int:
        """Stage the rows in pinned memory and copy them (asynchronously) into the static buffers; returns the row
        count.

        The staging buffers are reused every step: safe because sampling reads the previous step's logits on the
        host, which waits for everything queued before, these copies included."""
        rows, tables = self.row_layout(work)
        n = rows.shape[1]
        stage = self._staging.numpy()
        stage[:, :b] = 0  # padding rows: token 0 at position 0, null block slot 0, context 0
        stage[:, :n] = rows
        self.meta[:, :b].copy_(self._staging[:, :b], non_blocking=True)
        self._copy_tables(tables, self._table_staging)
        return n

    def _copy_tables(self, tables: list[list[list[int]]], staging: Tensor) -> None:
        """Each group's row tables (group 0 first) into the static table buffers through ``staging``."""
        tab = staging.numpy()
        widest = max([1, *(len(t) for t in tables[0])])  # the groups' tables are aligned with group 0's
        for g, group in enumerate(tables):
            for r, table in enumerate(group):
                tab[g, r, : len(table)] = table
        n = len(tables[0])
        self.all_tables[:, :n, :widest].copy_(staging[:, :n, :widest], non_blocking=True)

    def _step(self, b: int) -> Tensor:
        """Logits of the step the static buffers hold for ``b`` rows: the graph's replay (captured on first use), or
        the same step eagerly without capture."""
        if self.capture and b not in self.graphs:
            try:
                self._capture(b)
            except RuntimeError as exc:  # e.g. a layer that syncs with the host: keep serving, eagerly
                warnings.warn(f"CUDA graph capture of {b} rows failed ({exc}); steps run eagerly", stacklevel=2)
                torch.cuda.synchronize(self.runner.device)
                self.capture = False
        if not self.capture:
            return self.runner.forward(self._inputs(b), max_context=self.max_context)
        self.graphs[b].replay()
        return self.outputs[b]

    def run(self, work: list[Work]) -> Tensor:
        """The logits :meth:`ModelRunner.forward` returns for ``work`` (see :meth:`accepts`): one row per sampled
        token, in order."""
        n = sum(w.num_tokens for w in work)
        b = self.size_for(n)
        self._fill(work, b)
        out = self._step(b)
        pick = sampled_rows(work)
        if pick is None:
            return out[:n]
        return out.index_select(0, to_device(torch.tensor(pick, dtype=torch.long), out.device))

    def size_for(self, n: int) -> int:
        """The captured row count a step of ``n`` rows runs at (``n <= max_batch``)."""
        return next(s for s in self.sizes if s >= n)

    def load_tables(self, tables: list[list[int]], local: list[list[list[int]]] | None = None) -> None:
        """Put one block table per row (rows ``0 .. len(tables) - 1``) into the static table buffer (and, with KV
        groups, ``local[g]``: the rows' tables of local group ``g``), through the chain's own pinned buffer (reused
        by the next chain or :meth:`load_tables`: the caller synchronises with the host in between, reading the
        chain's tokens)."""
        if len(local or []) != self.n_local:
            raise ValueError(f"{len(local or [])} local groups' tables given, the graphs have {self.n_local}")
        if self._chain_tables is None:
            pin = self.runner.device.type == "cuda"
            shape = (1 + self.n_local, self.max_batch, self.max_blocks)
            self._chain_tables = torch.zeros(*shape, dtype=torch.int32, pin_memory=pin)
        self._copy_tables([tables, *(local or [])], self._chain_tables)

    def stage_chain(
        self, passes: list[np.ndarray], tables: list[list[int]], local: list[list[list[int]]] | None = None
    ) -> Tensor:
        """Upload the inputs of a chain of steps over the same ``n`` single-token rows: ``passes`` (each ``(5, n)``,
        the :func:`decode_rows` layout; with KV groups ``(5 + n_local, n)``, :meth:`rows`) in one copy, and the
        rows' block tables (one per row, shared by every pass; ``local``: those of each local group) into the
        static table buffers (:meth:`load_tables`). Returns ``(P, 5 + n_local, b)`` device rows for
        :meth:`replay_rows` (``b`` the captured size for ``n``; padding rows zero)."""
        n, P = len(tables), len(passes)
        b = self.size_for(n)
        m = 5 + self.n_local
        if any(rows.shape[0] != m for rows in passes):
            raise ValueError(f"passes have {[r.shape[0] for r in passes]} rows each, the graphs take {m}")
        pin = self.runner.device.type == "cuda"
        if self._chain_staging is None or self._chain_staging.shape[0] < P:
            self._chain_staging = torch.zeros(P, m, self.max_batch, dtype=torch.long, pin_memory=pin)
        stage = self._chain_staging.numpy()
        stage[:P, :, :b] = 0
        for j, rows in enumerate(passes):
            stage[j, :, :n] = rows
        self.load_tables(tables, local)
        return self._chain_staging[:P, :, :b].to(self.runner.device, non_blocking=True)

    def replay_rows(self, meta: Tensor, n: int, ids: Tensor | None = None) -> Tensor:
        """Logits ``(n, V)`` of one step of a chain (:meth:`stage_chain`): ``meta`` ``(5, b)`` on the device becomes
        the step's rows, ``ids`` ``(n,)`` (tokens computed by the previous step, still on the device) replaces their
        token row. Nothing is copied from the host and nothing waits for the device."""
        b = meta.shape[1]
        self.meta[:, :b].copy_(meta)
        if ids is not None:
            self.ids[:n].copy_(ids)
        return self._step(b)[:n]
