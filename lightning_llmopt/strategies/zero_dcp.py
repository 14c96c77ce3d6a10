"""DCP glue of the sharded checkpoints of :class:`~lightning_llmopt.strategies.ZeroStrategy` and its subclasses.

What the strategy passes to :mod:`lightning_llmopt.parallel.checkpoint` and takes back, in the layout of
:mod:`.zero_checkpoint`:

- :func:`model_state`: the model entry (``state_dict()`` for ZeRO-1/2, DCP's sharded state for FSDP2);
- :func:`optimizer_entry` / :func:`optimizer_template`: the optimizer entry to save, and the template to load into;
- :func:`resolve_checkpoint`: the ``step-N`` folder to resume from, chosen and verified on rank 0;
- :func:`load_dcp_state`: put a loaded FSDP2 (or plain, replicated) model and optimizer state in place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from lightning_llmopt.parallel.zero import ZeroOptimizer
from lightning_llmopt.strategies import zero_checkpoint as zc

__all__ = [
    "load_dcp_state",
    "merge_stage_param_groups",
    "model_state",
    "optimizer_entry",
    "optimizer_template",
    "resolve_checkpoint",
]


def model_state(module: nn.Module, dcp: bool) -> dict[str, Any]:
    """The model entry: DCP's ``get_model_state_dict`` (FSDP2/DTensor parameters) or a plain ``state_dict()``."""
    if dcp:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(module)
    return dict(module.state_dict())


def optimizer_entry(module: nn.Module | None, optimizers: list[Any]) -> dict[str, Any] | None:
    """The optimizer entry to save (``None`` without an optimizer); one optimizer at most."""
    if not optimizers:
        return None
    if len(optimizers) > 1:
        raise ValueError(f"ZeroStrategy checkpoints one optimizer, configure_optimizers returned {len(optimizers)}")
    opt = optimizers[0]
    if isinstance(opt, ZeroOptimizer):
        return zc.zero_optimizer_state(opt)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    assert module is not None
    sd = get_optimizer_state_dict(module, opt)
    return {"state": sd["state"], "param_groups": zc.to_bytes(sd["param_groups"])}


def merge_stage_param_groups(entry: dict[str, Any], group: Any) -> dict[str, Any]:
    """``entry`` with param groups naming every pipeline stage's parameters (collective over ``group``).

    Each stage's optimizer holds its own parameters only, while DCP writes a non-tensor entry such as
    ``param_groups`` once (one rank's copy): a resume would then find no saved group, hence no options (``betas``,
    ``lr``, ...), for the other stages' parameters. Group ``i`` keeps this rank's options (the stages' optimizers are
    built alike) and lists the names of group ``i`` of every stage, in stage-rank order.
    """
    import torch.distributed as dist

    mine = zc.from_bytes(entry["param_groups"])
    stages: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(stages, mine, group=group)
    if len({len(groups) for groups in stages}) != 1:
        raise ValueError(
            f"the pipeline stages' optimizers have different numbers of param groups: "
            f"{[len(groups) for groups in stages]}"
        )
    merged = [{**g, "params": [name for groups in stages for name in groups[i]["params"]]} for i, g in enumerate(mine)]
    return {**entry, "param_groups": zc.to_bytes(merged)}


def optimizer_template(module: nn.Module | None, optimizers: list[Any], metadata: Any) -> dict[str, Any] | None:
    """The optimizer entry to load into: the saved keys this optimizer holds (``None``: nothing to load)."""
    if not optimizers or not any(k.startswith("optimizer.") for k in metadata.state_dict_metadata):
        return None
    opt = optimizers[0]
    if isinstance(opt, ZeroOptimizer):
        return zc.zero_optimizer_template(opt, metadata)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    assert module is not None
    sd: Any = get_optimizer_state_dict(module, opt)  # creates the (zero) state to load into
    saved = {k for k in metadata.state_dict_metadata if k.startswith("optimizer.state.")}
    st = {fqn: {k: v for k, v in s.items() if f"optimizer.state.{fqn}.{k}" in saved} for fqn, s in sd["state"].items()}
    return {"state": st, "param_groups": b""}


def resolve_checkpoint(path: Path, is_global_zero: bool) -> Path:
    """Rank 0 picks and verifies the folder (a ``step-N`` folder, or the newest complete one under a root).

    Collective: every rank receives rank 0's choice, or raises ``IncompleteCheckpointError`` with its reason.
    """
    from lightning_llmopt.parallel.checkpoint import IncompleteCheckpointError, latest_checkpoint, verify_checkpoint

    folder, error = str(path), None
    if is_global_zero:
        try:
            if path.name.startswith("step-"):
                verify_checkpoint(path)
            else:
                newest = latest_checkpoint(path)
                if newest is None:
                    raise IncompleteCheckpointError(f"no complete checkpoint under {path}")
                folder = str(newest)
        except (IncompleteCheckpointError, FileNotFoundError) as exc:
            error = f"{type(exc).__name__}: {exc}"
    folder, error = zc.broadcast_object((folder, error))
    if error is not None:
        raise IncompleteCheckpointError(f"cannot resume from {path}: {error}")
    return Path(folder)


def load_dcp_state(module: nn.Module, optimizers: list[Any], state: dict[str, Any]) -> None:
    """Set the loaded model entry and, if present, the optimizer entry through DCP's ``set_*_state_dict``."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(module, state["model"])
    if "optimizer" in state:
        loaded = {
            "state": state["optimizer"]["state"],
            "param_groups": zc.from_bytes(state["optimizer"]["param_groups"]),
        }
        set_optimizer_state_dict(module, optimizers[0], loaded)
