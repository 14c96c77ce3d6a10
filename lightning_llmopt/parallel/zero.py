"""ZeRO stages 1 and 2 over an unmodified model and any elementwise ``torch.optim`` optimizer.

ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", arXiv 1910.02054)
partitions the optimizer state (stage 1) and the gradients (stage 2) across the N data-parallel ranks, keeping the
DDP communication volume (reduce-scatter + all-gather = one all-reduce). One training step here:

1. At construction the trainable parameters are packed into flat per-bucket buffers (never mixing param groups,
   dtypes or devices), padded to a multiple of N; ``param.data`` becomes a view into its bucket. Rank r owns the
   contiguous shard ``[r*S, (r+1)*S)`` of every bucket and builds the inner optimizer over those shards only (fp32
   master copies when the parameters are bf16/fp16, or on the CPU with ``offload_optimizer``).
2. During backward a post-accumulate-grad hook per parameter copies/accumulates its gradient into the bucket's
   flat gradient buffer; when all gradients of a bucket are in, the bucket's reduction is launched asynchronously
   (buckets launch in a fixed order so every rank issues the same collectives), overlapping the rest of backward.
   Stage 1 all-reduces the bucket (every rank keeps the full averaged gradient in ``param.grad``); stage 2
   reduce-scatters it, keeps only its shard and frees the full buffer and ``param.grad``.
3. :meth:`ZeroOptimizer.synchronize` (run by ``clip_grad_norm_``, ``grads_finite`` and ``step``) waits on the
   handles and sets each master shard's ``.grad``.
4. :meth:`ZeroOptimizer.step` runs the inner optimizer on the shards, casts the updated shards to the parameter
   dtype and all-gathers them into the flat buffers, which updates the model parameters in place.

Under :meth:`ZeroOptimizer.no_sync` hooks only accumulate locally (gradient accumulation without communication).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_llmopt.parallel import zero_state
from lightning_llmopt.parallel.zero_buckets import (
    Bucket,
    attach_master,
    build_bucket,
    check_arguments,
    check_elementwise,
    named_groups,
    plan_buckets,
)
from lightning_llmopt.parallel.zero_comm import (
    ProcessGroup,
    all_gather_flat,
    backend_name,
    gloo_supports_reduce_scatter,
    reduce_scatter_flat,
)

__all__ = ["ZeroOptimizer", "apply_zero"]

OptimizerOrFactory = torch.optim.Optimizer | Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


class ZeroOptimizer:
    """Shard an optimizer's state (stage 1) and the gradients (stage 2) of ``model`` across data-parallel ranks.

    Arguments:
        model: the finished model (already on its device); its trainable parameters become views into flat buckets.
        optimizer: a ``torch.optim`` optimizer over ``model``'s parameters with no state yet (its class, param
            groups and options are reused on the shards), or a factory called as ``factory(param_groups)`` where
            ``param_groups`` defaults to one group of all trainable parameters.
        stage: 1 (shard optimizer state) or 2 (also shard gradients).
        process_group: data-parallel group; ``None`` means the default group, or a single process when
            ``torch.distributed`` is not initialised.
        bucket_size_mb: cap of a bucket in MiB of parameter dtype.
        master_dtype: dtype of the master shards the optimizer updates (``None``: the parameter dtype).
        reduce_dtype: dtype gradients are communicated in (``None``: the gradient dtype).
        param_groups: for a factory, the param groups to pass it (dicts with ``"params"`` and options).
        offload_optimizer: keep master shards, optimizer state and the step on the CPU (ZeRO-Offload).
        assume_elementwise: accept an optimizer class not known to be elementwise.
        reduce_scatter: ``"auto"`` (NCCL: ``reduce_scatter_tensor``; gloo: probe once, else all-reduce + slice),
            ``"reduce_scatter"`` or ``"all_reduce"``; only used by stage 2.
    """

    def __init__(self, model: nn.Module, optimizer: OptimizerOrFactory, stage: int = 1,
                 process_group: ProcessGroup | None = None, bucket_size_mb: float = 25,
                 master_dtype: torch.dtype | None = torch.float32, reduce_dtype: torch.dtype | None = None,
                 param_groups: Sequence[dict[str, Any]] | None = None, offload_optimizer: bool = False,
                 assume_elementwise: bool = False, reduce_scatter: str = "auto") -> None:
        check_arguments(stage, bucket_size_mb, reduce_dtype, master_dtype)
        if reduce_scatter not in ("auto", "reduce_scatter", "all_reduce"):
            raise ValueError(f"reduce_scatter ({reduce_scatter!r}) must be 'auto', 'reduce_scatter' or 'all_reduce'")
        if not isinstance(optimizer, torch.optim.Optimizer):
            trainable = [p for p in model.parameters() if p.requires_grad]
            optimizer = optimizer(list(param_groups) if param_groups is not None else [{"params": trainable}])
        check_elementwise(optimizer, assume_elementwise)
        groups = named_groups(model, optimizer)  # all validation is done before the first collective below
        self.model, self.stage, self.offload = model, stage, offload_optimizer
        self.master_dtype, self.reduce_dtype = master_dtype, reduce_dtype
        distributed = dist.is_available() and dist.is_initialized()
        self.process_group = (process_group or dist.group.WORLD) if distributed else None
        self.world_size = dist.get_world_size(self.process_group) if distributed else 1
        self.rank = dist.get_rank(self.process_group) if distributed else 0
        self.buckets = [build_bucket(i, gi, names, ps, self.world_size, self.rank)
                        for i, (gi, names, ps) in enumerate(plan_buckets(groups, bucket_size_mb))]
        for b in self.buckets:
            attach_master(b, master_dtype, offload_optimizer)
            if stage == 1:
                b.flat_grad = torch.zeros_like(b.flat_param)
        self.group_options = [opts for _, _, opts in groups]
        self.group_names = [names for names, _, _ in groups]
        inner_groups = [{**opts, "params": [b.master for b in self.buckets if b.group == gi]}
                        for gi, opts in enumerate(self.group_options)]
        optimizer_cls: Any = type(optimizer)  # options travel in the groups; torch optimizers default the rest
        self.optimizer: torch.optim.Optimizer = optimizer_cls([g for g in inner_groups if g["params"]])
        self.require_backward_grad_sync = True
        self._next_launch = 0
        self._sync_started = False  # a synced backward has produced gradients since the last synchronize()
        self._use_reduce_scatter = self._choose_reduce_scatter(reduce_scatter)
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(b, i))
                       for b in self.buckets for i, p in enumerate(b.params)]

    # ------------------------------------------------------------------ setup helpers
    @property
    def device(self) -> torch.device:
        return self.buckets[0].flat_param.device if self.buckets else torch.device("cpu")

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's param groups (shard tensors + options); LR schedulers act on ``self.optimizer``."""
        return self.optimizer.param_groups

    def _choose_reduce_scatter(self, mode: str) -> bool:
        if self.stage == 1 or self.world_size == 1 or mode == "all_reduce":
            return False
        if mode == "reduce_scatter" or backend_name(self.process_group) != "gloo":
            return True
        dtype = self.reduce_dtype or (self.buckets[0].flat_param.dtype if self.buckets else torch.float32)
        return gloo_supports_reduce_scatter(self.process_group, dtype, self.device)

    def _make_hook(self, bucket: Bucket, i: int) -> Callable[[Tensor], None]:
        def hook(param: Tensor) -> None:
            self._on_grad(bucket, i, param)

        return hook

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (e.g. when a strategy tears down)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------ backward: hooks and bucket launches
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within this context backward only accumulates gradients locally; the next synced backward reduces."""
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    @torch.no_grad()
    def _on_grad(self, bucket: Bucket, i: int, param: Tensor) -> None:
        if bucket.pending is not None:
            raise RuntimeError(
                f"a gradient of {bucket.names[i]!r} arrived while bucket {bucket.index} is being reduced: run all "
                "micro-batches but the last under no_sync() and call step() or synchronize() before the next "
                "synced backward"
            )
        if bucket.flat_grad is None:
            bucket.flat_grad = torch.zeros_like(bucket.flat_param)
        view, grad = bucket.grad_view(i), param.grad
        if grad is not None and grad.data_ptr() != view.data_ptr():
            view.add_(grad)  # autograd made a fresh tensor (param.grad was None): accumulate into the bucket
            param.grad = view
        if not self.require_backward_grad_sync:
            return
        bucket.ready.add(i)
        self._sync_started = True
        while self._next_launch < len(self.buckets):  # launch in bucket order so all ranks match collectives
            nxt = self.buckets[self._next_launch]
            if len(nxt.ready) < len(nxt.params):
                break
            self._launch(nxt)

    def _launch(self, bucket: Bucket) -> None:
        """Start the asynchronous reduction of one bucket (gradients pre-divided by the world size)."""
        if bucket.flat_grad is None:  # no gradient reached this bucket (unused parameters): reduce zeros
            bucket.flat_grad = torch.zeros_like(bucket.flat_param)
        dtype = self.reduce_dtype or bucket.flat_grad.dtype
        comm = bucket.flat_grad if dtype == bucket.flat_grad.dtype else bucket.flat_grad.to(dtype)
        work: Any = None
        if self.world_size > 1:
            comm.div_(self.world_size)
        if self.world_size > 1 and self._use_reduce_scatter:
            out = torch.empty(bucket.shard_size, dtype=dtype, device=comm.device)
            work = reduce_scatter_flat(out, comm, self.process_group, async_op=True)
        else:
            out = comm
            if self.world_size > 1:
                work = dist.all_reduce(comm, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True)
        bucket.pending = (work, comm, out)
        bucket.ready.clear()
        self._next_launch += 1

    # ------------------------------------------------------------------ after backward
    @torch.no_grad()
    def synchronize(self) -> None:
        """Wait for every reduction and set the master shards' ``.grad``.

        If a synced backward ran, buckets it did not complete (parameters without gradient) are reduced now, in
        bucket order. Without a synced backward since the last call nothing is communicated.
        """
        while self._sync_started and self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
        for b in self.buckets:
            if b.pending is not None:
                self._finish(b)
        self._next_launch, self._sync_started = 0, False

    def _finish(self, b: Bucket) -> None:
        assert b.pending is not None and b.flat_grad is not None
        work, comm, out = b.pending
        if work is not None:
            work.wait()
        b.pending = None
        shard = out if out.numel() == b.shard_size else out[b.shard_start: b.shard_end]
        if self.stage == 1:
            if comm is not b.flat_grad:
                b.flat_grad.copy_(comm)
            local = b.flat_grad[b.shard_start: b.shard_end]
            if b.master_aliased:
                b.master.grad = local
            else:
                b.master.grad = shard.to(device=b.master.device, dtype=b.master.dtype, copy=True)
            return
        if b.grad_shard is None:
            b.grad_shard = shard.to(device=b.master.device, dtype=b.master.dtype, copy=True)
        else:
            b.grad_shard.add_(shard.to(device=b.master.device, dtype=b.master.dtype))
        b.master.grad = b.grad_shard
        b.flat_grad = None  # stage 2: free the full buffer and the parameters' full gradients
        for p in b.params:
            p.grad = None

    def _shard_grads(self) -> list[Tensor]:
        return [b.master.grad for b in self.buckets if b.master.grad is not None]

    def _all_reduce_scalar(self, value: Tensor, op: Any, group: ProcessGroup | None = None) -> Tensor:
        value = value.to(self.device, torch.float32)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(value, op=op, group=group)
        elif group is None and self.world_size > 1:
            dist.all_reduce(value, op=op, group=self.process_group)
        return value

    @torch.no_grad()
    def grads_finite(self) -> bool:
        """Whether every reduced gradient shard on every rank is finite (one all-reduce)."""
        self.synchronize()
        bad = torch.zeros((), dtype=torch.float32)
        for g in self._shard_grads():
            bad += (~torch.isfinite(g)).any().float().cpu()
        return bool(self._all_reduce_scalar(bad, dist.ReduceOp.SUM).item() == 0)

    @torch.no_grad()
    def scale_grads_(self, factor: float) -> None:
        """Multiply every gradient this rank holds (shards, and stage 1's full ``param.grad``) by ``factor``."""
        self.synchronize()
        for b in self.buckets:
            if self.stage == 1 and b.flat_grad is not None:
                b.flat_grad.mul_(factor)
            if b.master.grad is not None and not (self.stage == 1 and b.master_aliased):
                b.master.grad.mul_(factor)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, norm_group: ProcessGroup | None = None
                        ) -> Tensor:
        """Clip by the global norm over all shards (one all-reduce); returns the norm before clipping.

        Matches ``torch.nn.utils.clip_grad_norm_`` on the unsharded gradients: ``coef = max_norm / (norm + 1e-6)``
        clamped to 1. ``norm_type`` is 2 or ``inf``. ``norm_group``: the group the norm is reduced over (default:
        this optimizer's data-parallel group); a larger group whose other ranks hold the rest of the model's
        gradients, each element on one rank only (e.g. the whole world under pipeline parallelism, each stage
        with its own ``ZeroOptimizer``), gives the norm of the whole model's gradient. Every rank of that group
        must call this.
        """
        if norm_type not in (2.0, float("inf")):
            raise ValueError(f"norm_type ({norm_type}) must be 2.0 or inf")
        self.synchronize()
        grads = self._shard_grads()
        if norm_type == 2.0:
            local = sum((g.float().pow(2).sum().cpu() for g in grads), torch.zeros(()))
            total = self._all_reduce_scalar(local, dist.ReduceOp.SUM, norm_group).sqrt()
        else:
            local = max((g.float().abs().max().cpu() for g in grads), default=torch.zeros(()))
            total = self._all_reduce_scalar(local, dist.ReduceOp.MAX, norm_group)
        coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        self.scale_grads_(coef)
        return total

    @torch.no_grad()
    def step(self) -> None:
        """Update the shards with the inner optimizer, then all-gather them into the model parameters."""
        self.synchronize()
        self.optimizer.step()
        self._push_params()

    @torch.no_grad()
    def _push_params(self) -> None:
        works = []
        for b in self.buckets:
            local = b.flat_param[b.shard_start: b.shard_end]
            if not b.master_aliased:
                local.copy_(b.master)
            if self.world_size > 1:
                works.append(all_gather_flat(b.flat_param, local, self.process_group, async_op=True))
        for w in works:
            w.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients. Stage 1 zeroes its persistent buckets in place (``param.grad`` stays a bucket view
        whatever ``set_to_none`` says); stage 2 drops the gradient shards and ``param.grad``."""
        self.synchronize()  # consume reductions still in flight so no collective is left pending
        for b in self.buckets:
            b.master.grad = None
            b.grad_shard = None
            if self.stage == 1:
                assert b.flat_grad is not None
                b.flat_grad.zero_()
            else:
                b.flat_grad = None
                for p in b.params:
                    p.grad = None

    # ------------------------------------------------------------------ accounting and state
    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds, from tensor sizes: ``parameters`` (flat buffers), ``gradients`` (full buffers,
        gradient shards and separate master gradients), ``optimizer_state`` and ``master_weights`` (0 when the
        master shard is a view of the parameters)."""
        def nbytes(t: Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        grads = 0
        for b in self.buckets:
            grads += nbytes(b.flat_grad) + nbytes(b.grad_shard)
            if b.master.grad is not None and not b.master_aliased and b.master.grad is not b.grad_shard:
                grads += nbytes(b.master.grad)
        state = sum(nbytes(v) for s in self.optimizer.state.values() for v in s.values() if isinstance(v, Tensor))
        return {
            "parameters": sum(nbytes(b.flat_param) for b in self.buckets),
            "gradients": grads,
            "optimizer_state": state,
            "master_weights": sum(0 if b.master_aliased else nbytes(b.master) for b in self.buckets),
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's reshardable state: per parameter name, its slice of master weights and optimizer state with
        the slice's offset in the flattened parameter (see :mod:`lightning_llmopt.parallel.zero_state`)."""
        return zero_state.sharded_state_dict(self)

    def full_state_dict(self) -> dict[str, Any]:
        """The whole state gathered to rank 0 bucket by bucket (a collective; other ranks get ``{}``)."""
        return zero_state.full_state_dict(self)

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Load a full state dict or the list of every rank's sharded state dicts, saved with any world size."""
        zero_state.load_state_dict(self, state)

    load_full_state_dict = load_state_dict


def apply_zero(model: nn.Module, optimizer: OptimizerOrFactory, stage: int = 1, **kwargs: Any) -> ZeroOptimizer:
    """Shard ``optimizer`` (or ``optimizer(param_groups)``) over data-parallel ranks; see :class:`ZeroOptimizer`."""
    return ZeroOptimizer(model, optimizer, stage=stage, **kwargs)
