"""PipeDream-2BW: a pipeline that never flushes, with double-buffered weights (Narayanan et al., "Memory-Efficient
Pipeline-Parallel DNN Training", ICML 2021, arXiv 2006.09503).

Update rule (the paper's 2BW semantics, section 3.1): ``W(t+1) = W(t) - lr * grad f(W(t-1))``, ``W(k)`` the weights
after ``k`` updates (``W(-1) := W(0)``). Every micro-batch of batch ``t`` runs its forward *and* backward with one
weight version on every stage: ``W(t-1)``, so the gradient applied at an update is one update stale. With
``M >= P`` micro-batches per batch two versions per stage suffice: the live one (forwards of the current batch) and
the stashed previous one (backwards of the previous batch's last micro-batches, still in flight).

One call of :meth:`PipeDream2BWRunner.train_step` (batch ``t``) is one "window" of the endless 1F1B order, cut so
that it holds exactly the forwards of batch ``t``. Pipeline rank ``s`` of ``P`` lags ``w = P - 1 - s`` forwards
behind its backwards (:func:`window_actions`):

1. at the start of the window, the weight buffer of the live version loses its old gradient (it was applied);
2. for each micro-batch ``j`` of batch ``t`` (global index ``t M + i``): ``F(j)`` with the live version, then
   ``B(j - w)`` where ``j - w >= 0``: the backward of a micro-batch forwarded ``w`` micro-batches earlier, with the
   version that micro-batch was forwarded with. The first ``w`` backwards of window ``t`` belong to batch ``t - 1``
   and run while batch ``t``'s forwards are in flight: forward of batch ``t`` overlaps backward of batch ``t - 1``;
3. at the end of the window batch ``t - 1`` is complete on this stage: its buffer becomes the new live version (a
   copy of the current live weights) and carries its accumulated gradient ``g(t-1)``, which is set as the
   parameters' ``.grad``; the caller's optimizer step makes update ``t`` (``W(t)``). The previous live buffer is now
   the stash that batch ``t``'s last ``w`` backwards (next window) use. The first call has no finished batch: ``.grad``
   stays ``None`` and the optimizer step changes nothing.

Weights: each parameter has two buffers (leaf tensors); the ``nn.Parameter`` aliases the live one (``.data``), so a
stage holds exactly two copies of its weights, and an optimizer stepping the parameters in place writes the new
version without touching the stash. Forwards run through ``torch.func.functional_call`` on the version's buffers, so
autograd saves the buffers (not the parameters) and gradients accumulate into the buffers' ``.grad``: each version
has its own gradient accumulator. Micro-batches are contiguous row blocks and gradients accumulate in micro-batch
order, so the update equals a single-process run of the same rule bit for bit (tested).

Sends are non-blocking (``isend``, tagged so they never match the forward-only pass's messages) and receives block
in the order above, which cannot deadlock. The losses of a batch are summed on the last stage and broadcast over the
``"pp"`` group at the end of the window (the only point where the pipeline ranks synchronise per step).
:meth:`PipeDream2BWRunner.drain` runs the backwards left in flight after the last step (their gradient is dropped:
no update follows) and waits for every send.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_llmopt.parallel.pipeline_forward import _DTYPES, PipelineForwardMixin
from lightning_llmopt.parallel.pipeline_split import StageSplit
from lightning_llmopt.parallel.pipeline_tp import TPStageBoundary

__all__ = [
    "PIPEDREAM_2BW",
    "Action",
    "DoubleBufferedWeights",
    "PipeDream2BWRunner",
    "check_2bw_combination",
    "check_2bw_trainer",
    "simulate_windows",
    "window_actions",
]

PIPEDREAM_2BW = "pipedream_2bw"
_TAG_FORWARD, _TAG_BACKWARD = 2101, 2102  # never 0: the forward-only pass (validation) sends untagged
LossFn = Callable[[Any, Tensor], Tensor]


def check_2bw_combination(pp: int, tp: int, zero_stage: int, activation_checkpointing: str = "none") -> None:
    """Layouts PipeDream-2BW does not compose with (named errors before any collective): the weight versions are
    plain full tensors per stage, so no tensor parallelism (DTensor shards) and no ZeRO (sharded or hooked
    gradients); no activation checkpointing (its recomputation in the backward would run outside the version's
    ``functional_call``, i.e. with the live weights); data parallelism with gradients all-reduced (``zero_stage=0``)
    composes."""
    if activation_checkpointing != "none":
        raise NotImplementedError(
            f"schedule {PIPEDREAM_2BW!r} with activation_checkpointing ({activation_checkpointing!r}) is not "
            "supported: the backward's recomputation would use the live weights, not the micro-batch's version"
        )
    if tp > 1:
        raise NotImplementedError(
            f"schedule {PIPEDREAM_2BW!r} with pipeline_parallel ({pp}) composes with data parallelism only; got "
            f"tensor_parallel ({tp})"
        )
    if zero_stage != 0:
        raise NotImplementedError(
            f"schedule {PIPEDREAM_2BW!r} keeps two full weight versions per stage and applies gradients itself: "
            f"zero_stage ({zero_stage}) is not supported; use zero_stage=0 (gradients all-reduced over data-parallel "
            "ranks)"
        )


def check_2bw_trainer(trainer: Any) -> None:
    """Trainer settings PipeDream-2BW refuses: gradient accumulation over batches (each batch's micro-batches
    already accumulate, and the update is delayed by one batch) and fp16 loss scaling (a skipped step would break
    the one-step delay)."""
    accumulate = int(getattr(trainer, "accumulate_grad_batches", 1))
    if accumulate != 1:
        raise NotImplementedError(
            f"schedule {PIPEDREAM_2BW!r} with accumulate_grad_batches ({accumulate}) is not supported; raise the "
            "rows per batch (and microbatches) instead"
        )
    precision = str(getattr(getattr(trainer, "precision_plugin", None), "precision", ""))
    if precision.startswith("16"):
        raise NotImplementedError(
            f"schedule {PIPEDREAM_2BW!r} with precision ({precision!r}) is not supported (dynamic loss scaling skips "
            "steps); use '32-true' or 'bf16-mixed'"
        )


class Action(NamedTuple):
    kind: str  # "F" forward, "B" backward
    microbatch: int  # global index: batch * M + position in the batch


def window_actions(pp: int, pp_rank: int, microbatches: int, batch: int) -> list[Action]:
    """Rank ``pp_rank``'s actions while batch ``batch`` is given: the forwards of its ``M`` micro-batches, each
    followed by the backward of the micro-batch ``w = pp - 1 - pp_rank`` places earlier (see the module docstring).
    Concatenated over batches this is the 1F1B order without any flush."""
    lag, m = pp - 1 - pp_rank, microbatches
    out: list[Action] = []
    for j in range(batch * m, (batch + 1) * m):
        out.append(Action("F", j))
        if j - lag >= 0:
            out.append(Action("B", j - lag))
    return out


def simulate_windows(
    pp: int, microbatches: int, batches: int, sync: bool, f: float = 1.0, b: float = 2.0
) -> list[float]:
    """End time of every window (and of the final drain) when each rank runs :func:`window_actions` with forward
    cost ``f`` and backward cost ``b`` and free communication (``F(j)`` of rank ``s`` after ``F(j)`` of ``s - 1``,
    ``B(j)`` after ``B(j)`` of ``s + 1``, or after its own ``F(j)`` on the last rank, as in
    :mod:`~lightning_llmopt.parallel.pipeline_plan`); ``sync``: every rank waits for the slowest at each window's
    end (the per-step loss broadcast)."""
    done: dict[tuple[int, str, int], float] = {}
    free = [0.0] * pp
    ends = []
    for t in range(batches + 1):
        m = microbatches
        if t < batches:
            orders = [window_actions(pp, r, m, t) for r in range(pp)]
        else:  # the drain
            orders = [[Action("B", j) for j in range(batches * m - (pp - 1 - r), batches * m)] for r in range(pp)]
        pos = [0] * pp
        while any(pos[r] < len(orders[r]) for r in range(pp)):
            progressed = False
            for r in range(pp):
                while pos[r] < len(orders[r]):
                    a = orders[r][pos[r]]
                    if a.kind == "F":
                        deps = [(r - 1, "F", a.microbatch)] if r > 0 else []
                    else:
                        deps = [(r + 1, "B", a.microbatch)] if r < pp - 1 else [(r, "F", a.microbatch)]
                    if any(d not in done for d in deps):
                        break
                    free[r] = max([free[r], *(done[d] for d in deps)]) + (f if a.kind == "F" else b)
                    done[(r, a.kind, a.microbatch)] = free[r]
                    pos[r], progressed = pos[r] + 1, True
            if not progressed:
                raise ValueError("the window orders deadlock")
        if sync:
            free = [max(free)] * pp
        ends.append(max(free))
    return ends


class DoubleBufferedWeights:
    """Two weight buffers per parameter of a stage; the parameters alias the live one.

    Arguments:
        module: the stage module; its parameters' storage is replaced by buffer 0 (same values).
    """

    def __init__(self, module: nn.Module) -> None:
        self.names = [n for n, _ in module.named_parameters()]
        self.params = [p for _, p in module.named_parameters()]
        self.buffers: list[list[Tensor]] = [[], []]
        with torch.no_grad():
            for p in self.params:
                first = p.detach().clone().requires_grad_(p.requires_grad)
                second = torch.empty_like(first).requires_grad_(p.requires_grad)
                p.data = first  # the parameter now shares storage with the live buffer
                self.buffers[0].append(first)
                self.buffers[1].append(second)
        self.live = 0

    def version(self, index: int) -> dict[str, Tensor]:
        """``{parameter name: buffer}`` of buffer ``index`` (for ``functional_call``)."""
        return dict(zip(self.names, self.buffers[index], strict=True))

    def clear_grad(self, index: int) -> None:
        for t in self.buffers[index]:
            t.grad = None

    @torch.no_grad()
    def advance(self) -> None:
        """The other buffer (whose micro-batches are all done) becomes live: it gets a copy of the live weights, the
        parameters alias it and take its accumulated gradient as ``.grad``; the old live buffer is the stash."""
        new = 1 - self.live
        for p, old, fresh in zip(self.params, self.buffers[self.live], self.buffers[new], strict=True):
            fresh.copy_(old)
            p.data = fresh
            p.grad = fresh.grad
        self.live = new

    def storages(self) -> int:
        """Distinct weight storages held (parameters and buffers): 2 per parameter."""
        ptrs = {t.untyped_storage().data_ptr() for bufs in self.buffers for t in bufs}
        ptrs |= {p.untyped_storage().data_ptr() for p in self.params}
        return len(ptrs)


@dataclass
class _InFlight:
    """A micro-batch forwarded on this stage whose backward has not run yet."""

    version: int
    output: Tensor  # the stage output (last stage: the scaled loss)
    inputs: Tensor | None  # the received activations (leaf); None on the first stage


class PipeDream2BWRunner(PipelineForwardMixin):
    """PipeDream-2BW training of one pipeline rank (one stage per rank), and the forward-only pass.

    Arguments:
        modules: ``{stage index: module}``, exactly one stage (:func:`~lightning_llmopt.parallel.pipeline.
            stage_modules` with ``virtual_stages=1``).
        split: the :class:`StageSplit`.
        config: the :class:`~lightning_llmopt.parallel.pipeline.PipelineConfig` (``schedule="pipedream_2bw"``).
        group: the ``"pp"`` process group.
        device: where activations live.
        boundary: must be ``None`` (tensor parallelism is not supported with this schedule).
    """

    def __init__(
        self,
        modules: dict[int, nn.Module],
        split: StageSplit,
        config: Any,
        group: Any,
        device: torch.device,
        boundary: TPStageBoundary | None = None,
    ) -> None:
        if boundary is not None:
            raise NotImplementedError(f"schedule {PIPEDREAM_2BW!r} with tensor_parallel > 1 is not supported yet")
        if len(modules) != 1:
            raise ValueError(f"schedule {PIPEDREAM_2BW!r} runs one stage per rank; this rank holds {sorted(modules)}")
        ((self.stage, module),) = modules.items()
        if getattr(module, "fused_loss", None) is not None or hasattr(module, "stage_model"):
            raise NotImplementedError(
                f"schedule {PIPEDREAM_2BW!r} with a fused linear + cross-entropy loss is not supported yet "
                "(the head's weight would bypass the weight versions); build the model without fused_loss"
            )
        self.modules, self.split, self.config, self.group, self.device = modules, split, config, group, device
        self.boundary, self.fused_head = None, None
        self.pp_rank = dist.get_rank(group)
        self.pp = dist.get_world_size(group)
        self.module = module
        self.weights = DoubleBufferedWeights(module)
        self.lag = self.pp - 1 - self.pp_rank
        self.batches = 0  # windows run since the start or the last drain
        self.in_flight: dict[int, _InFlight] = {}
        self.pending: list[tuple[Any, Tensor]] = []  # (isend work, tensor kept alive until it is sent)
        self.max_versions = 0  # most weight versions ever in use at once (live + in flight)
        self.max_in_flight = 0  # most micro-batches ever forwarded and not yet backpropagated (activations held)
        self.log: list[tuple[int, Action, int]] | None = None  # (batch, action, version) when set to a list

    # ------------------------------------------------------------------ point to point
    def _isend(self, t: Tensor, dst: int, tag: int) -> None:
        t = t.contiguous()
        self.pending.append((dist.isend(t, self._global(dst), group=self.group, tag=tag), t))

    def _send_activation(self, t: Tensor) -> None:
        header = torch.tensor([t.ndim, *t.shape, *([0] * (6 - t.ndim)), _DTYPES.index(t.dtype)], dtype=torch.int64)
        self._isend(header.to(self.device), self.pp_rank + 1, _TAG_FORWARD)
        self._isend(t.detach(), self.pp_rank + 1, _TAG_FORWARD)

    def _recv_activation(self) -> Tensor:
        header = torch.empty(8, dtype=torch.int64, device=self.device)
        dist.recv(header, self._global(self.pp_rank - 1), group=self.group, tag=_TAG_FORWARD)
        values = header.tolist()
        t = torch.empty(values[1 : 1 + values[0]], dtype=_DTYPES[values[7]], device=self.device)
        dist.recv(t, self._global(self.pp_rank - 1), group=self.group, tag=_TAG_FORWARD)
        return t

    def _settle_sends(self, wait: bool = False) -> None:
        if wait:
            for work, _ in self.pending:
                work.wait()
            self.pending = []
        else:
            self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]

    # ------------------------------------------------------------------ actions
    def _forward(self, j: int, tokens: Tensor, rows: Tensor, kwargs: dict[str, Tensor], loss_fn: LossFn) -> Tensor:
        """``F(j)`` with the live version; returns the micro-batch's scaled loss on the last stage (else 0)."""
        m = self.config.microbatches
        mb_rows = rows.tensor_split(m)[j % m]
        mb_kwargs = {k: v[mb_rows] for k, v in kwargs.items()}
        inputs = None
        if self.has_first:
            x = tokens[mb_rows]
        else:
            inputs = self._recv_activation().requires_grad_()
            x = inputs
        version = self.weights.live
        out = torch.func.functional_call(self.module, self.weights.version(version), (x,), mb_kwargs)
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.has_last:
            out = loss_fn(out, mb_rows) / m  # the batch mean over micro-batches
            loss = out.detach().float()
        else:
            self._send_activation(out)
        self.in_flight[j] = _InFlight(version, out, inputs)
        return loss

    def _backward(self, j: int) -> None:
        """``B(j)`` through the graph ``F(j)`` built (hence with ``F(j)``'s weight version)."""
        item = self.in_flight.pop(j)
        if self.has_last:
            item.output.backward()
        else:
            grad = torch.empty_like(item.output)
            dist.recv(grad, self._global(self.pp_rank + 1), group=self.group, tag=_TAG_BACKWARD)
            item.output.backward(grad)
        if item.inputs is not None:
            assert item.inputs.grad is not None
            self._isend(item.inputs.grad, self.pp_rank - 1, _TAG_BACKWARD)

    def _versions_in_use(self) -> int:
        return len({self.weights.live, *(f.version for f in self.in_flight.values())})

    # ------------------------------------------------------------------ steps
    def train_step(self, batch: dict[str, Tensor], loss_fn: LossFn) -> Tensor:
        """One window (see the module docstring): the forwards of ``batch`` interleaved with the backwards the 1F1B
        order puts between them; then the finished previous batch's gradient is the parameters' ``.grad``.

        Arguments:
            batch: ``input_ids`` ``(B, T)`` int64, optional ``positions`` / ``doc_ids`` ``(B, T)`` (given to every
                stage); other entries are for ``loss_fn``.
            loss_fn: ``loss_fn(output, rows)`` on the last stage for the rows ``rows`` (``(B / M,)`` int64) of
                ``batch``; returns the micro-batch's mean loss (scalar).

        Returns the mean loss of ``batch``'s micro-batches (fp32 scalar) on every pipeline rank; the parameters'
        ``.grad`` is the previous batch's gradient (``None`` after the first window).
        """
        from lightning_llmopt.parallel.pipeline import validate_microbatches

        tokens = batch["input_ids"]
        validate_microbatches(tokens.shape[0], self.config)
        kwargs = {k: batch[k] for k in ("positions", "doc_ids") if isinstance(batch.get(k), Tensor)}
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        t = self.batches
        self.weights.clear_grad(self.weights.live)  # its gradient (two windows old) was applied
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for action in window_actions(self.pp, self.pp_rank, self.config.microbatches, t):
            if action.kind == "F":
                total = total + self._forward(action.microbatch, tokens, rows, kwargs, loss_fn)
            else:
                self._backward(action.microbatch)
            self.max_versions = max(self.max_versions, self._versions_in_use())
            self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
            if self.log is not None:
                self.log.append((t, action, self.weights.live))
            self._settle_sends()
        self.weights.advance()  # batch t - 1 is done here: its buffer becomes live and carries g(t - 1)
        self.batches += 1
        dist.broadcast(total, self._global(self.split.ranks[-1]), group=self.group)
        return total

    def drain(self) -> None:
        """Run the backwards still in flight (the last batch's last ``w`` micro-batches), wait for every send and
        drop their gradient (no update follows); the next :meth:`train_step` starts a new pipeline."""
        for j in sorted(self.in_flight):
            self._backward(j)
            if self.log is not None:
                self.log.append((self.batches, Action("B", j), self.weights.live))
        self._settle_sends(wait=True)
        self.weights.clear_grad(0)
        self.weights.clear_grad(1)
        for p in self.weights.params:
            p.grad = None
        self.batches = 0
