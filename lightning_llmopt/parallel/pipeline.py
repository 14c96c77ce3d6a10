"""Pipeline parallelism over an unmodified ``Llama``: stage split, ``torch.distributed.pipelining`` stages and
schedules, and one training step over micro-batches.

Framework-free (no Lightning). Steps:

1. :class:`PipelineConfig` names the schedule, the micro-batch count ``M`` and the virtual stages ``V`` per rank and
   is checked in ``__post_init__``; :func:`validate_pipeline` checks it against the model (blocks >= stages, no tied
   embedding), :func:`validate_microbatches` against a batch (``B % M == 0``, ``M >= P`` ...), before any collective.
2. :func:`prune_to_stages`: this rank keeps only the blocks of its stages (the ``ModuleDict`` keys, hence parameter
   names, stay those of the full model, so checkpoints reshard between pipeline layouts), the embedding on the rank
   of stage 0 and the final norm and head on the rank of the last stage (``None`` elsewhere: the forward passes
   hidden states through). Apply it before TP/CP/AC/compile/ZeRO.
3. :class:`PipelineRunner` (after the weights exist): one module per local stage (the pruned model itself, or for
   ``V > 1`` views sharing its blocks), ``PipelineStage`` objects over the ``"pp"`` group and the schedule;
   :meth:`PipelineRunner.train_step` splits a batch into ``M`` micro-batches, runs forward and backward with the loss
   on the last stage (each micro-batch loss divided by ``M``, so gradients are those of the batch mean) and returns
   the mean loss on every pipeline rank; :meth:`PipelineRunner.forward` runs a forward-only pass and returns the
   last stage's output on every pipeline rank (validation; :mod:`~lightning_llmopt.parallel.pipeline_forward`). With
   tensor parallelism a :class:`~lightning_llmopt.parallel.pipeline_tp.TPStageBoundary` keeps what crosses between
   stages plain tensors (sequence-sharded under sequence parallelism) and rebuilds the vocabulary-sharded logits for
   the loss.

Schedules (``torch.distributed.pipelining``; bubbles in docs/pipeline.md): ``gpipe`` (all forwards, then all
backwards; Huang et al., arXiv 1811.06965), ``1f1b`` (PipeDream-flush: after ``P - s - 1`` warm-up forwards stage
``s`` alternates one forward and one backward; Narayanan et al., arXiv 2104.04473), ``interleaved_1f1b`` (``V``
stages per rank in a loop), ``zero_bubble`` (interleaved, backward split into input-gradient B and weight-gradient
W passes that fill the bubble; Qi et al., arXiv 2401.10241), ``zbv`` and ``dualpipev`` (two stages per rank in a V
shape; DeepSeek-V3, arXiv 2412.19437; DualPipeV needs a torch that ships ``ScheduleDualPipeV``). For the last three
the B/W split is ours by default (:mod:`~lightning_llmopt.parallel.pipeline_wgrad`: B runs the full backward with the
linear layers' weight gradients queued, W computes them; no recomputation); ``split_backward="torch"`` uses torch's.
``pipedream_2bw`` (PipeDream-2BW, arXiv 2006.09503: no flush, two weight versions, gradients applied one step late)
is our own executor, :mod:`~lightning_llmopt.parallel.pipeline_2bw`.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_llmopt.parallel.pipeline_forward import PipelineForwardMixin
from lightning_llmopt.parallel.pipeline_split import StageSplit, split_stages
from lightning_llmopt.parallel.pipeline_tp import TPStageBoundary

__all__ = [
    "SCHEDULES",
    "HiddenStage",
    "PipelineConfig",
    "PipelineRunner",
    "pipeline_grad_norm",
    "prune_to_stages",
    "schedule_class",
    "stage_modules",
    "validate_microbatches",
    "validate_pipeline",
]

# name -> (torch class, several stages per rank, placement style, default virtual stages)
SCHEDULES: dict[str, tuple[str, bool, str, int]] = {
    "gpipe": ("ScheduleGPipe", False, "loop", 1),
    "1f1b": ("Schedule1F1B", False, "loop", 1),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", True, "loop", 2),
    "zero_bubble": ("ScheduleInterleavedZeroBubble", True, "loop", 2),
    "zbv": ("ScheduleZBVZeroBubble", True, "v", 2),
    "dualpipev": ("ScheduleDualPipeV", True, "v", 2),
    "pipedream_2bw": ("", False, "loop", 1),  # our own executor, no torch class: parallel/pipeline_2bw.py
}


def schedule_class(name: str) -> type:
    """The ``torch.distributed.pipelining`` class of schedule ``name``; a clear error where this torch lacks it."""
    import torch.distributed.pipelining as pipelining

    cls = getattr(pipelining, SCHEDULES[name][0], None)
    if cls is None:
        raise NotImplementedError(
            f"schedule {name!r} needs torch.distributed.pipelining.{SCHEDULES[name][0]}, which torch "
            f"{torch.__version__} does not have; use 'zbv' or 'interleaved_1f1b'"
        )
    return cls


@dataclass
class PipelineConfig:
    """How the model is cut and scheduled.

    Arguments:
        pp: pipeline-parallel degree ``P``.
        schedule: one of :data:`SCHEDULES`.
        microbatches: ``M``, micro-batches per optimizer step (``None``: ``P``, or ``2P`` for V-shaped schedules).
        virtual_stages: ``V``, stages per rank (``None``: 1 for GPipe/1F1B, 2 otherwise; exactly 2 for zbv and
            dualpipev; 1 for gpipe and 1f1b).
        split: ``"layers"`` or ``"cost"`` (see :mod:`~lightning_llmopt.parallel.pipeline_split`).
        balance_ends: Llama-3 balancing: the embedding and the head count toward the first and last stages.
        split_backward: B/W split of the zero-bubble schedules (zero_bubble, zbv, dualpipev): ``"deferred"``
            (deferred linear weight gradients, :mod:`~lightning_llmopt.parallel.pipeline_wgrad`) or ``"torch"``
            (``stage_backward_input`` + ``stage_backward_weight``, which walk the autograd graph again); other
            schedules ignore it.
    """

    pp: int = 1
    schedule: str = "1f1b"
    microbatches: int | None = None
    virtual_stages: int | None = None
    split: str = "layers"
    balance_ends: bool = False
    split_backward: str = "deferred"

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule ({self.schedule!r}) must be one of {sorted(SCHEDULES)}")
        if self.split_backward not in ("deferred", "torch"):
            raise ValueError(f"split_backward ({self.split_backward!r}) must be 'deferred' or 'torch'")
        if self.split not in ("layers", "cost"):
            raise ValueError(f"pipeline split ({self.split!r}) must be 'layers' or 'cost'")
        _, multi, style, default_v = SCHEDULES[self.schedule]
        if self.virtual_stages is None:
            self.virtual_stages = default_v
        v = self.virtual_stages
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"virtual_stages ({v!r}) must be a positive integer")
        if not multi and v != 1:
            raise ValueError(f"schedule {self.schedule!r} runs one stage per rank: virtual_stages ({v}) must be 1")
        if style == "v" and v != 2:
            raise ValueError(f"schedule {self.schedule!r} runs two stages per rank: virtual_stages ({v}) must be 2")
        if self.microbatches is None:
            self.microbatches = self.pp * (2 if style == "v" else 1)
        m = self.microbatches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"microbatches ({m!r}) must be a positive integer")
        if self.pp > 1:
            self._check_counts(m)
        if self.pp > 1 and SCHEDULES[self.schedule][1]:
            schedule_class(self.schedule)  # dualpipev on a torch without it: fail at construction

    def _check_counts(self, m: int) -> None:
        p, name = self.pp, self.schedule
        if name == "1f1b" and m < p:
            raise ValueError(f"microbatches ({m}) must be >= pipeline_parallel ({p}) for 1F1B")
        if name == "pipedream_2bw" and m < p:  # two weight versions suffice only when M >= P (the paper's bound)
            raise ValueError(f"microbatches ({m}) must be >= pipeline_parallel ({p}) for pipedream_2bw")
        if name in ("interleaved_1f1b", "zero_bubble") and m % p != 0:
            raise ValueError(f"microbatches ({m}) must be a multiple of pipeline_parallel ({p}) for {name}")
        if self.style == "v" and m < 2 * p:
            raise ValueError(f"microbatches ({m}) must be >= 2*pipeline_parallel ({2 * p}) for {name}")

    @property
    def style(self) -> str:
        return SCHEDULES[self.schedule][2]

    @property
    def num_stages(self) -> int:
        assert self.virtual_stages is not None
        return self.pp * self.virtual_stages


def validate_pipeline(model: nn.Module, config: PipelineConfig, seq_len: int | None = None) -> StageSplit:
    """Model checks (no collective) and the stage split every rank will use."""
    cfg = getattr(model, "config", None)
    if cfg is None or not isinstance(getattr(model, "layers", None), nn.ModuleDict):
        raise ValueError(
            f"pipeline_parallel ({config.pp}) supports lightning_llmopt Llama models (blocks in a ModuleDict); got "
            f"{type(model).__name__} (convert transformers models with lightning_llmopt.models.hf.from_hf)"
        )
    if cfg.tie_embeddings:
        raise ValueError(
            f"pipeline_parallel ({config.pp}) with tie_embeddings=True: the embedding and the head live on "
            "different stages; untie them"
        )
    if getattr(cfg, "moe", None) is not None:
        raise ValueError(f"pipeline_parallel ({config.pp}) with Mixture-of-Experts layers is not supported yet")
    assert config.virtual_stages is not None
    split = split_stages(
        cfg,
        config.pp,
        config.virtual_stages,
        split=config.split,
        balance_ends=config.balance_ends,
        style=config.style,
        seq_len=seq_len,
    )
    for i, src in enumerate(getattr(cfg, "kv_sources", None) or []):  # cross-layer KV sharing stays within a stage
        stage = next(s for s, (lo, hi) in enumerate(split.ranges) if lo <= i < hi)
        if not split.ranges[stage][0] <= src:
            raise ValueError(
                f"pipeline_parallel ({config.pp}): layer {i} reads the K/V of layer {src}, which the split "
                f"{list(split.ranges)} puts on another stage; choose kv_sources within stages"
            )
    return split


def validate_microbatches(batch_size: int, config: PipelineConfig) -> None:
    """``batch_size`` (rows on this data-parallel rank) against ``M``; raises naming both."""
    m = config.microbatches
    assert m is not None
    if batch_size % m != 0:
        raise ValueError(
            f"batch size ({batch_size} rows per data-parallel rank) must be divisible by microbatches ({m})"
        )


# ------------------------------------------------------------------ stage modules
def prune_to_stages(model: nn.Module, split: StageSplit, pp_rank: int) -> list[int]:
    """Keep only this rank's blocks, embedding (stage 0) and final norm + head (last stage); returns its stages."""
    local = split.local_stages(pp_rank)
    keep = {str(i) for i in split.layers_of(local)}
    layers: Any = model.layers
    for key in [k for k in layers.keys() if k not in keep]:
        del layers[key]
    if 0 not in local:
        model.tok_embeddings = None
    if split.num_stages - 1 not in local:
        model.norm = None
        model.output = None
    return local


def _view(model: nn.Module, blocks: range, first: bool, last: bool) -> nn.Module:
    """A module of the same class sharing ``model``'s blocks ``blocks`` (and its ends where ``first``/``last``)."""
    view = copy.copy(model)  # new __dict__; the dicts inside are still shared: copy them
    for key, value in list(view.__dict__.items()):
        if isinstance(value, dict):
            view.__dict__[key] = type(value)(value)
    for name in getattr(model, "forward_methods", ()):  # wrappers bound to the model (FSDP2's): the view's own code
        view.__dict__.pop(name, None)
    layers: Any = model.layers
    view._modules["layers"] = nn.ModuleDict({str(i): layers[str(i)] for i in blocks})
    view._modules["tok_embeddings"] = model.tok_embeddings if first else None
    view._modules["norm"] = model.norm if last else None
    view._modules["output"] = model.output if last else None
    return view


class HiddenStage(nn.Module):
    """The last stage of a model whose loss is fused (``model.fused_loss``): returns the final-norm hidden states
    ``(B, T, dim)`` (the model's ``hidden_states``, an entry point FSDP2 hooks like ``forward``); the head's weight
    and the fused linear + cross-entropy are applied by the loss on that stage
    (:meth:`PipelineRunner.fused_head`), so the ``(B, T, vocab)`` logits never exist.

    Arguments:
        model: the stage's model (the pruned model, or a view of it with ``V > 1``).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.stage_model = model

    def forward(self, tokens: Tensor, positions: Tensor | None = None, doc_ids: Tensor | None = None) -> Tensor:
        return self.stage_model.hidden_states(tokens, positions=positions, doc_ids=doc_ids)  # type: ignore[operator]


def stage_modules(model: nn.Module, split: StageSplit, pp_rank: int) -> dict[int, nn.Module]:
    """``{stage index: module}`` for this rank's stages of an already pruned (and materialised) model; with a fused
    loss the last stage is a :class:`HiddenStage`."""
    local = split.local_stages(pp_rank)
    last = split.num_stages - 1
    if len(local) == 1:
        modules = {local[0]: model}
    else:
        modules = {s: _view(model, range(*split.ranges[s]), s == 0, s == last) for s in local}
    if last in modules and getattr(model, "fused_loss", None) is not None:
        modules[last] = HiddenStage(modules[last])
    return modules


# ------------------------------------------------------------------ gradient norm
def pipeline_grad_norm(params: list[nn.Parameter], pp: int) -> Tensor:
    """Norm of the whole model's gradient when each rank holds one pipeline stage's (possibly sharded) parameters:
    local squares divided by the number of ranks holding the same elements (``world / pp`` over the mesh
    dimensions a DTensor is sharded on), one all-reduce over all ranks."""
    from torch.distributed.tensor import DTensor

    from lightning_llmopt.parallel.data_parallel import is_shard

    world = dist.get_world_size() if dist.is_initialized() else 1
    device = params[0].device if params else torch.device("cpu")
    if not params and world > 1 and dist.get_backend() == "nccl":  # no gradient yet (PipeDream-2BW's first step)
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        sharded = 1
        if isinstance(g, DTensor):
            sharded = int(
                torch.tensor([g.device_mesh.size(i) for i, pl in enumerate(g.placements) if is_shard(pl)] or [1]).prod()
            )
            g = g.to_local()
        total = total + g.float().pow(2).sum() / max(world // (pp * sharded), 1)
    if world > 1:
        dist.all_reduce(total)
    return total.sqrt()


# ------------------------------------------------------------------ running
LossFn = Callable[[Any, Tensor], Tensor]


class PipelineRunner(PipelineForwardMixin):
    """Stages and schedule of one pipeline rank.

    Arguments:
        modules: ``{stage index: module}`` (:func:`stage_modules`).
        split: the :class:`StageSplit`.
        config: the :class:`PipelineConfig`.
        group: the ``"pp"`` process group (``mesh["pp"].get_group()``).
        device: where activations live.
        boundary: with tensor parallelism, a :class:`~lightning_llmopt.parallel.pipeline_tp.TPStageBoundary` over
            this rank's ``"tp"`` mesh: its hooks keep what crosses between stages plain tensors.

    Set ``runner.recorder`` to a :class:`~lightning_llmopt.parallel.pipeline_trace.ActionRecorder` to time every
    action of the following training steps (``None``, the default, installs nothing).
    """

    def __init__(
        self,
        modules: dict[int, nn.Module],
        split: StageSplit,
        config: PipelineConfig,
        group: Any,
        device: torch.device,
        boundary: TPStageBoundary | None = None,
    ) -> None:
        self.modules, self.split, self.config, self.group, self.device = modules, split, config, group, device
        self.boundary = boundary
        last = modules.get(split.num_stages - 1)
        # the last stage returns hidden states: the head runs in the loss (training) or after the stage (forward)
        self.fused_head: nn.Module | None = last.stage_model if isinstance(last, HiddenStage) else None
        if boundary is not None:
            boundary.install(modules, split)
        self.pp_rank = dist.get_rank(group)
        self._schedules: dict[tuple[Any, ...], Any] = {}
        self._stages: list[Any] = []
        self._loss_fn: LossFn | None = None
        self._real_loss = False  # inside the schedule's own loss call (not its metadata inference)
        # opt-in action timing (parallel.pipeline_trace.ActionRecorder); None: nothing is installed
        self.recorder: Any = None

    def _scaled_loss(self, output: Any, rows: Tensor) -> Tensor:
        assert self._loss_fn is not None and self.config.microbatches is not None
        if not self._real_loss:
            # torch >= 2.12 infers gradient shapes by calling the loss once on example tensors before the
            # micro-batches run: answer with a stand-in so the user's loss (logging, counters) runs only for data
            local = output.to_local() if hasattr(output, "to_local") else output
            return local.float().sum() * 0.0
        if self.boundary is not None:
            output = self.boundary.wrap(output)  # e.g. the vocabulary-sharded logits, as the model returned them
        return self._loss_fn(output, rows) / self.config.microbatches  # the batch mean (scale_grads=False)

    def _mark_real_losses(self, schedule: Any) -> None:
        """Route the schedule's own loss calls (``_compute_loss``, present from torch 2.4 to 2.13) through a flag
        that tells them apart from metadata inference."""
        compute = getattr(schedule, "_compute_loss", None)
        if compute is None:
            self._real_loss = True
            return

        def real(*args: Any, **kwargs: Any) -> Tensor:
            self._real_loss = True
            try:
                return compute(*args, **kwargs)
            finally:
                self._real_loss = False

        schedule._compute_loss = real

    def _schedule(self, key: tuple[Any, ...]) -> Any:
        """A schedule for batches of shape ``key`` (stages infer their buffers on the first step)."""
        if key not in self._schedules:
            from lightning_llmopt.parallel.pipeline_wgrad import build_stages

            cfg = self.config
            stages = build_stages(
                self.modules, self.split.num_stages, self.device, self.group, cfg.schedule, cfg.split_backward
            )
            cls = schedule_class(self.config.schedule)
            multi = SCHEDULES[self.config.schedule][1]
            schedule = cls(
                stages if multi else stages[0],
                n_microbatches=self.config.microbatches,
                loss_fn=self._scaled_loss,
                scale_grads=False,
            )
            self._mark_real_losses(schedule)
            self._schedules, self._stages = {key: schedule}, stages
        return self._schedules[key]

    def train_step(self, batch: dict[str, Tensor], loss_fn: LossFn) -> Tensor:
        """Forward and backward of ``batch`` in ``M`` micro-batches (gradients accumulate into ``.grad``).

        Arguments:
            batch: ``input_ids`` ``(B, T)`` int64, optional ``positions`` / ``doc_ids`` ``(B, T)`` (given to every
                stage); other entries are for ``loss_fn``.
            loss_fn: ``loss_fn(output, rows)`` on the last stage: ``output`` is the last stage's output for the
                batch rows ``rows`` (``(B / M,)`` int64 indices into ``batch``); returns a scalar mean loss.

        Returns the mean of the micro-batch losses, fp32 scalar, on every pipeline rank.
        """
        from lightning_llmopt.parallel.pipeline_wgrad import settle_deferred

        # contiguous: torch's stages check each micro-batch's strides against the first step's (a row slice such as
        # ``ids[:, :-1]`` of several rows has row stride T + 1)
        tokens = batch["input_ids"].contiguous()
        validate_microbatches(tokens.shape[0], self.config)
        kwargs = {k: batch[k].contiguous() for k in ("positions", "doc_ids") if isinstance(batch.get(k), Tensor)}
        schedule = self._schedule((tuple(tokens.shape), tuple(sorted(kwargs))))
        self._loss_fn = loss_fn
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        losses: list[Tensor] = []
        done = False
        recording: Any = contextlib.nullcontext()
        if self.recorder is not None:
            recording = self.recorder.step(self.pp_rank, schedule, self._stages)
        try:
            with recording:
                schedule.step(*((tokens,) if self.has_first else ()), target=rows, losses=losses, **kwargs)
            done = True
        finally:
            self._loss_fn = None
            settle_deferred(self._stages, run=done)  # weight gradients no W action ran (none in torch's schedules)
        if self.has_last:  # each micro-batch loss was divided by M
            mean = torch.stack([loss.detach().float() for loss in losses]).sum()
        else:
            mean = torch.zeros((), dtype=torch.float32, device=tokens.device)
        dist.broadcast(mean, src=self._global(self.split.ranks[-1]), group=self.group)
        return mean
