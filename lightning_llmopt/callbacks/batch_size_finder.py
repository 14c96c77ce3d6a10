"""``MicroBatchSizeFinder``: the largest micro-batch that fits, with gradient accumulation keeping the global batch.

Search (:func:`search_largest_fit`): double from ``init`` until a trial fails or ``max_val`` is reached, then bisect
between the last size that fitted and the first that did not: about ``2 log2(found)`` trials. A trial runs
``steps_per_trial`` real training steps (forward through the strategy, backward, optimizer step) on batches of the
trial size from the train dataloader; ``torch.OutOfMemoryError`` and CUDA/cuDNN out-of-memory ``RuntimeError``\\s mark
a failure, any other error propagates. Weights, optimizer state, the precision plugin's state (grad scaler) and the
module's checkpoint extras are snapshotted before the search and restored after it, so the search leaves no trace.

The micro-batch is then the largest divisor of ``global_batch_size / world_size`` not above the size found, and
``trainer.accumulate_grad_batches = global_batch_size / (world_size * micro_batch)``.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override


def is_oom_error(err: BaseException) -> bool:
    """Whether ``err`` means an allocation failed (CUDA, cuDNN, or the CPU allocator)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    if not isinstance(err, RuntimeError):
        return False
    msg = str(err)
    return (("CUDA" in msg and "out of memory" in msg) or "CUDNN_STATUS_NOT_SUPPORTED" in msg
            or "CUDNN_STATUS_ALLOC_FAILED" in msg or "DefaultCPUAllocator: can't allocate memory" in msg)


def search_largest_fit(fits: Callable[[int], bool], init: int, max_val: int) -> tuple[int, list[int]]:
    """Largest ``n`` in ``[1, max_val]`` with ``fits(n)``, assuming fitting is monotone; 0 if even 1 does not fit.

    Returns the size and the sizes tried, in order (about ``2 log2(n)`` of them).
    """
    if not 1 <= init <= max_val:
        raise ValueError(f"init ({init}) must be in [1, max_val ({max_val})]")
    trials: list[int] = []

    def trial(n: int) -> bool:
        trials.append(n)
        return fits(n)

    lo, hi = 0, None  # lo fits (0: nothing known to fit), hi does not
    n = init
    while hi is None:
        if trial(n):
            lo = n
            if n >= max_val:
                break
            n = min(2 * n, max_val)
        else:
            hi = n
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        if trial(mid):
            lo = mid
        else:
            hi = mid
    return lo, trials


def largest_divisor_at_most(total: int, limit: int) -> int:
    """The largest divisor of ``total`` that is ``<= limit`` (at least 1)."""
    return max(d for d in range(1, min(total, max(limit, 1)) + 1) if total % d == 0)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return copy.deepcopy(obj)


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None


class MicroBatchSizeFinder(L.Callback):
    """Finds the largest micro-batch that trains without running out of memory, at the start of ``fit``.

    Sets ``batch_arg_name`` on the datamodule (or the module, or its ``hparams``) and
    ``trainer.accumulate_grad_batches`` so that ``micro_batch * accumulate * world_size == global_batch_size``.
    Runs in ``on_fit_start``: after the strategy has wrapped the model and built the optimizers, before the train
    dataloader is requested. The size found is saved in checkpoints, and a resumed run reuses it without searching.
    Supported strategies: single device and DDP (trial outcomes are AND-reduced over ranks).

    Arguments:
        global_batch_size: sequences per optimizer step over all ranks; default: the run's own (batch size x
            ``accumulate_grad_batches`` x world size), so only the split changes.
        init: first size tried.
        max_val: largest size tried (also capped at ``global_batch_size / world_size``).
        steps_per_trial: training steps per trial (the optimizer state is allocated at the first).
        batch_arg_name: the attribute holding the batch size.
    """

    def __init__(self, global_batch_size: int | None = None, init: int = 1, max_val: int = 1024,
                 steps_per_trial: int = 2, batch_arg_name: str = "batch_size") -> None:
        for name, value in (("init", init), ("max_val", max_val), ("steps_per_trial", steps_per_trial)):
            if value < 1:
                raise ValueError(f"{name} ({value}) must be positive")
        if init > max_val:
            raise ValueError(f"init ({init}) must not exceed max_val ({max_val})")
        if global_batch_size is not None and global_batch_size < 1:
            raise ValueError(f"global_batch_size ({global_batch_size}) must be positive")
        self.global_batch_size = global_batch_size
        self.init, self.max_val, self.steps_per_trial = init, max_val, steps_per_trial
        self.batch_arg_name = batch_arg_name
        self.found: int | None = None  # largest size that fitted
        self.micro_batch_size: int | None = None
        self.accumulate_grad_batches: int | None = None
        self.trials: list[int] = []

    # ------------------------------------------------------------------ where the batch size lives
    def _holder(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Any:
        for obj in (getattr(trainer, "datamodule", None), pl_module):
            if obj is not None and hasattr(obj, self.batch_arg_name):
                return obj
        if self.batch_arg_name in pl_module.hparams:
            return pl_module.hparams
        raise ValueError(f"batch_arg_name ({self.batch_arg_name!r}) is not an attribute of the datamodule or the "
                         "module; pass the data through a datamodule or module with that attribute")

    def _get(self, holder: Any) -> int:
        return int(holder[self.batch_arg_name] if isinstance(holder, dict) else getattr(holder, self.batch_arg_name))

    def _set(self, holder: Any, value: int) -> None:
        if isinstance(holder, dict):
            holder[self.batch_arg_name] = value
        else:
            setattr(holder, self.batch_arg_name, value)

    # ------------------------------------------------------------------ one trial
    def _trial(self, trainer: L.Trainer, pl_module: L.LightningModule, holder: Any, size: int) -> bool:
        self._set(holder, size)
        datamodule = getattr(trainer, "datamodule", None)
        source = datamodule if datamodule is not None else pl_module
        fits = True
        try:
            batches = iter(source.train_dataloader())
            for step in range(self.steps_per_trial):
                batch = trainer.strategy.batch_to_device(next(batches))
                out = trainer.strategy.training_step(batch, step)
                loss = out["loss"] if isinstance(out, dict) else out
                assert isinstance(loss, Tensor), "training_step must return the loss or a dict with 'loss'"
                loss.backward()
                del out, loss, batch
                for optimizer in trainer.optimizers:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
        except StopIteration:
            rank_zero_warn(f"the train dataloader has fewer than {self.steps_per_trial} batches of {size}")
        except (RuntimeError, torch.OutOfMemoryError) as err:
            if not is_oom_error(err):
                raise
            fits = False
        finally:
            for optimizer in trainer.optimizers:
                optimizer.zero_grad(set_to_none=True)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return bool(trainer.strategy.reduce_boolean_decision(fits, all=True))

    # ------------------------------------------------------------------ search with snapshot/restore
    def _search(self, trainer: L.Trainer, pl_module: L.LightningModule, holder: Any, cap: int) -> int:
        weights = _to_cpu(pl_module.state_dict())
        optimizers = [_to_cpu(opt.state_dict()) for opt in trainer.optimizers]
        precision = _to_cpu(trainer.precision_plugin.state_dict())
        extras: dict[str, Any] = {}
        pl_module.on_save_checkpoint(extras)
        original, was_training = self._get(holder), pl_module.training
        pl_module.__dict__["log"] = pl_module.__dict__["log_dict"] = _no_log  # no loop collects metrics here
        pl_module.train()
        try:
            found, self.trials = search_largest_fit(
                lambda n: self._trial(trainer, pl_module, holder, n), min(self.init, cap), cap)
        finally:
            pl_module.__dict__.pop("log", None)
            pl_module.__dict__.pop("log_dict", None)
            self._set(holder, original)
            pl_module.train(was_training)
            pl_module.load_state_dict(weights)
            for opt, state in zip(trainer.optimizers, optimizers, strict=True):
                opt.load_state_dict(state)
            trainer.precision_plugin.load_state_dict(precision)
            if extras:
                pl_module.on_load_checkpoint(extras)
        return found

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not pl_module.automatic_optimization:
            raise ValueError("MicroBatchSizeFinder needs automatic optimization (automatic_optimization=True)")
        holder = self._holder(trainer, pl_module)
        world = trainer.world_size
        if self.global_batch_size is None:
            self.global_batch_size = self._get(holder) * trainer.accumulate_grad_batches * world
        if self.global_batch_size % world:
            raise ValueError(f"global_batch_size ({self.global_batch_size}) must be divisible by "
                             f"world_size ({world})")
        per_rank = self.global_batch_size // world
        if self.found is None:  # not restored from a checkpoint
            cap = min(self.max_val, per_rank)
            found = self._search(trainer, pl_module, holder, cap)
            if found == 0:
                raise RuntimeError(f"micro-batch size 1 runs out of memory (tried {self.trials})")
            self.found = found
        self.micro_batch_size = largest_divisor_at_most(per_rank, self.found)
        self.accumulate_grad_batches = per_rank // self.micro_batch_size
        self._set(holder, self.micro_batch_size)
        trainer.accumulate_grad_batches = self.accumulate_grad_batches
        rank_zero_info(f"MicroBatchSizeFinder: largest fitting micro-batch {self.found} (trials {self.trials}); "
                       f"using micro-batch {self.micro_batch_size} x accumulate {self.accumulate_grad_batches} x "
                       f"world {world} = global batch {self.global_batch_size}")

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"found": self.found, "global_batch_size": self.global_batch_size, "trials": list(self.trials)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.found = state_dict.get("found")
        self.trials = list(state_dict.get("trials", []))
        if self.global_batch_size is None:
            self.global_batch_size = state_dict.get("global_batch_size")
