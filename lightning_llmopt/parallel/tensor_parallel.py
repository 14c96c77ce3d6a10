"""Tensor and sequence parallelism applied to a finished decoder (Megatron-LM layout, expressed with DTensor).

Megatron-LM (Shoeybi et al., arXiv 1909.08053) splits each block across ``tp`` ranks so that one all-reduce per
sub-block suffices; sequence parallelism (Korthikanti et al., arXiv 2205.05198) shards the sequence of the remaining
per-token work (norms, residual adds, dropout) and turns each all-reduce into a reduce-scatter + all-gather pair of
the same volume. :func:`apply_tp` does, with ``torch.distributed.tensor.parallel`` styles and the plan table of the
model's family (:mod:`~lightning_llmopt.parallel.tp_plans`):

- attention: ``q/k/v`` column-parallel (each rank computes ``n_heads/tp`` query heads and their kv heads), ``o``
  row-parallel; MLP: ``gate/up`` column-parallel, ``down`` row-parallel;
- embedding: vocab-parallel (rows of the table sharded; out-of-range ids give zeros; all-reduce or reduce-scatter);
- head: column-parallel with the logits left sharded on the vocabulary (``loss_parallel=True``) for
  :func:`~lightning_llmopt.parallel.vocab_parallel.vocab_parallel_cross_entropy`;
- norms: with ``sequence_parallel``, ``SequenceParallel`` (sequence-sharded activations, replicated weights; the
  attention and MLP inputs are all-gathered, their outputs reduce-scattered); otherwise replicated DTensor weights;
- the attention and MLP inputs become one replicated DTensor each, so q/k/v (gate/up) share one all-gather and one
  reduction of their input gradient; under ``torch.autocast`` they are cast to the autocast dtype first
  (``_cast_input_for_autocast``), so activations and their gradients cross ranks in bf16;
- GQA with ``n_kv_heads < tp`` (and ``tp % n_kv_heads == 0``): the k/v projections stay replicated and each rank
  computes only the kv head its query heads read (``rank * n_kv_heads // tp``); the gradients of the projection and
  of its input are all-reduced over the tensor-parallel group in backward.

Every parameter becomes a DTensor on the tensor-parallel mesh (sharded or replicated), so optimizers see one tensor
type, FSDP2 composes (2-D), and DCP checkpoints reshard to other layouts. Replicated weights of norms under
sequence parallelism receive ``Partial`` gradients: :func:`reduce_partial_grads` (run by the strategy after
backward; FSDP2 does it itself) all-reduces them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_llmopt.parallel.tp_grads import reduce_partial_grads, sum_moe_grads
from lightning_llmopt.parallel.tp_plans import ModelFamily, ModelShape, find_family

__all__ = ["apply_tp", "check_plan_paths", "reduce_partial_grads", "replicate_experts", "sum_moe_grads", "validate_tp"]


def validate_tp(shape: ModelShape, tp: int) -> None:
    """Raise ``ValueError`` naming the sizes that ``tp`` does not divide (no collectives)."""
    if shape.n_heads % tp != 0:
        raise ValueError(f"n_heads ({shape.n_heads}) must be divisible by tensor_parallel ({tp})")
    if shape.n_kv_heads % tp != 0 and tp % shape.n_kv_heads != 0:
        raise ValueError(
            f"n_kv_heads ({shape.n_kv_heads}) must be divisible by tensor_parallel ({tp}), or divide it (kv heads "
            "are then replicated on tensor_parallel/n_kv_heads ranks each)"
        )
    if shape.vocab_size % tp != 0:
        raise ValueError(
            f"vocab_size ({shape.vocab_size}) must be divisible by tensor_parallel ({tp}) for the "
            "vocab-parallel embedding and loss"
        )
    if shape.ffn_hidden_dim % tp != 0:
        raise ValueError(f"ffn_hidden_dim ({shape.ffn_hidden_dim}) must be divisible by tensor_parallel ({tp})")


def _get(root: nn.Module, path: str) -> nn.Module:
    return root.get_submodule(path)


# --------------------------------------------------------------------------- replicated parts


def _replicate_params(name: str, module: nn.Module, mesh: Any) -> None:
    from torch.distributed.tensor import Replicate, distribute_tensor

    for pname, p in list(module.named_parameters(recurse=False)):
        dt = distribute_tensor(p.data, mesh, [Replicate()])
        module.register_parameter(pname, nn.Parameter(dt, requires_grad=p.requires_grad))


def _to_replicated_inputs(module: nn.Module, inputs: Any, mesh: Any) -> Any:
    from torch.distributed.tensor import DTensor, Replicate

    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if isinstance(x, Tensor) and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def _to_local_output(module: nn.Module, output: Any, mesh: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return output.to_local() if isinstance(output, DTensor) else output


def replicate_module(module: nn.Module, mesh: Any) -> None:
    """Replicated DTensor weights; replicated inputs in, local tensors out (a norm outside sequence parallelism)."""
    from torch.distributed.tensor import distribute_module

    distribute_module(module, mesh, _replicate_params, _to_replicated_inputs, _to_local_output)


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group`` (Megatron's "f" operator)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReplicatedKVProjection(nn.Linear):
    """A k or v projection of a model with fewer kv heads than tensor-parallel ranks (set by :func:`apply_tp`).

    The weight is a replicated DTensor; rank ``t`` computes only rows ``kv_rows`` (kv head ``t * n_kv // tp``).
    Each rank's gradient covers its own query heads only, so the weight's and the input's gradients are summed over
    the tensor-parallel group: the weight's here, the input's (a replicated DTensor from the attention's input
    plan) as a ``Partial`` gradient that joins the query projection's and is reduced with it, once.
    """

    tp_group: Any
    kv_rows: tuple[int, int]

    def forward(self, x: Tensor) -> Tensor:
        from torch.distributed.tensor import DTensor, Partial

        if isinstance(x, DTensor):
            x = x.to_local(grad_placements=[Partial()])
        else:
            x = _AllReduceGrad.apply(x, self.tp_group)
        lo, hi = self.kv_rows
        weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        weight = _AllReduceGrad.apply(weight, self.tp_group)[lo:hi]
        bias = None
        if self.bias is not None:
            b = self.bias.to_local() if isinstance(self.bias, DTensor) else self.bias
            bias = _AllReduceGrad.apply(b, self.tp_group)[lo:hi]
        return F.linear(x, weight, bias)


def _replicate_kv(linear: nn.Module, mesh: Any, shape: ModelShape) -> None:
    if type(linear) is not nn.Linear:
        raise TypeError(f"kv head replication needs nn.Linear k/v projections, got {type(linear).__name__}")
    tp, rank = mesh.size(), mesh.get_local_rank()
    kv = rank * shape.n_kv_heads // tp
    _replicate_params("", linear, mesh)
    linear.__class__ = ReplicatedKVProjection  # same parameters and names, so checkpoints keep their keys
    linear.tp_group = mesh.get_group()  # type: ignore[assignment]
    linear.kv_rows = (kv * shape.head_dim, (kv + 1) * shape.head_dim)  # type: ignore[assignment]


def _to_autocast_dtype(x: Any) -> Any:
    if isinstance(x, Tensor) and x.dtype == torch.float32 and torch.is_autocast_enabled(x.device.type):
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x


def _cast_input_for_autocast(module: nn.Module, kwarg: str | None = None) -> None:
    """Under ``torch.autocast``, cast ``module``'s hidden-states input (the first positional argument, or the
    keyword ``kwarg``) from fp32 to the autocast dtype before the tensor-parallel input plan gathers (sequence
    parallelism) or wraps it.

    Every consumer of that input is a linear projection that autocast would cast anyway (once per projection), so the
    forward is unchanged; the all-gather and the reduction of its gradient in backward move half the bytes, and one
    cast of the local shard replaces one per projection. Outside autocast (fp32 training) nothing changes.
    """

    def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if kwarg is not None and kwarg in kwargs:
            return args, {**kwargs, kwarg: _to_autocast_dtype(kwargs[kwarg])}
        if args:
            return (_to_autocast_dtype(args[0]), *args[1:]), kwargs
        return args, kwargs

    module.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)  # before the plan's own input hook


# --------------------------------------------------------------------------- plans


def _reads_shared_kv(attention: nn.Module) -> bool:
    """Whether an attention module reads another layer's keys/values (cross-layer KV sharing: no k/v projections)."""
    return getattr(attention, "kv_source", None) not in (None, getattr(attention, "layer_id", None))


def _block_plan(f: ModelFamily, sp: bool, replicate_kv: bool, moe: bool = False, kv: bool = True) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    act = Shard(1) if sp else Replicate()  # activations between the sub-blocks: sequence-sharded under SP
    att = f.attention
    plan: dict[str, Any] = {
        f"{att}.{f.q}": ColwiseParallel(),
        f"{att}.{f.o}": RowwiseParallel(output_layouts=act),
    }
    if not moe:
        plan[f"{f.mlp}.{f.gate}"] = ColwiseParallel()
        plan[f"{f.mlp}.{f.up}"] = ColwiseParallel()
        plan[f"{f.mlp}.{f.down}"] = RowwiseParallel(output_layouts=act)
    elif not sp:  # the MoE layer routes this rank's slice of the sequence: slice in, gather out
        plan[f.mlp] = PrepareModuleInputOutput(
            input_layouts=(Replicate(),),
            desired_input_layouts=(Shard(1),),
            use_local_input=True,
            output_layouts=(Shard(1),),
            desired_output_layouts=(Replicate(),),
            use_local_output=True,
        )
    if not replicate_kv and kv:
        plan[f"{att}.{f.k}"] = ColwiseParallel()
        plan[f"{att}.{f.v}"] = ColwiseParallel()
    # The attention and dense MLP inputs enter as ONE replicated DTensor (use_local_output=False) shared by q/k/v
    # (gate/up): their Partial input gradients add up locally and are reduced once per sub-block (reduce-scatter
    # under SP, else all-reduce). A plain tensor there is wrapped by each projection, which then all-reduces its own
    # input gradient: 3 + 2 full-size all-reduces per block.
    n = f.attention_args
    if f.attention_kwarg is not None:
        layouts: dict[str, Any] = {
            "input_kwarg_layouts": {f.attention_kwarg: act},
            "desired_input_kwarg_layouts": {f.attention_kwarg: Replicate()},
        }
    else:
        layouts = {
            "input_layouts": (act, *[None] * (n - 1)),
            "desired_input_layouts": (Replicate(), *[None] * (n - 1)),
        }
    plan[att] = PrepareModuleInput(**layouts, use_local_output=False)
    if not moe or sp:  # dense: gather (SP) or wrap the input; MoE under SP: route the local slice of the sequence
        plan[f.mlp] = PrepareModuleInput(
            input_layouts=(act,), desired_input_layouts=(Shard(1) if moe else Replicate(),), use_local_output=moe
        )
    if sp:
        plan[f.attention_norm] = SequenceParallel()
        plan[f.mlp_norm] = SequenceParallel()
    return plan


def _moe_of(block: nn.Module, family: ModelFamily) -> Any:
    from lightning_llmopt.models.moe import MoEFeedForward

    try:
        mlp = block.get_submodule(family.mlp)
    except AttributeError:
        return None
    return mlp if isinstance(mlp, MoEFeedForward) else None


def _shard_moe(moe: Any, tp_mesh: Any) -> None:
    """Tensor parallelism of a Mixture-of-Experts feed-forward: each rank routes its slice of the sequence through
    the same router and experts (expert parallelism shards the experts, not TP), so the router and shared-expert
    weights become replicated DTensors whose gradients :func:`sum_moe_grads` sums over the group after backward,
    and the balance and z-losses sum their per-sequence statistics over it."""
    _replicate_params("", moe.router, tp_mesh)
    if moe.shared is not None:
        for linear in (moe.shared.w1, moe.shared.w2, moe.shared.w3):
            _replicate_params("", linear, tp_mesh)
    moe.tp_group = tp_mesh.get_group()


def replicate_experts(model: nn.Module, tp_mesh: Any) -> None:
    """Expert weights not sharded by expert parallelism: replicated DTensors over ``tp_mesh`` like the router (so
    FSDP2 sees one mesh per block); :func:`sum_moe_grads` sums their gradients over the group."""
    from lightning_llmopt.models.moe import moe_layers

    for layer in moe_layers(model):
        _replicate_params("", layer.experts, tp_mesh)


def check_plan_paths(model: nn.Module, family: ModelFamily) -> None:
    """Raise ``ValueError`` naming the first projection the family's plan expects as an ``nn.Linear`` that a block
    lacks (Mixture-of-Experts feed-forwards have their own plan: :func:`_shard_moe`)."""
    paths = [f"{family.attention}.{p}" for p in (family.q, family.k, family.v, family.o)]
    mlp_paths = [f"{family.mlp}.{p}" for p in (family.gate, family.up, family.down)]
    for i, block in enumerate(_blocks(model, family)):
        shared = _present(block, family.attention) and _reads_shared_kv(block.get_submodule(family.attention))
        attn_paths = [p for p in paths if not (shared and p.endswith((f".{family.k}", f".{family.v}")))]
        for path in attn_paths + ([] if _moe_of(block, family) is not None else mlp_paths):
            try:
                module: nn.Module | None = block.get_submodule(path)
            except AttributeError:
                module = None
            if not isinstance(module, nn.Linear):
                owner, _, _ = path.rpartition(".")
                found = type(module).__name__ if module is not None else f"none in {_type_at(block, owner)}"
                raise ValueError(
                    f"tensor-parallel plan {family.name!r} expects an nn.Linear at {family.blocks}.{i}.{path}, "
                    f"found {found}"
                )


def _present(root: nn.Module, path: str) -> bool:
    """False where a pipeline stage pruned the part at ``path`` (set to ``None``)."""
    try:
        root.get_submodule(path)
    except AttributeError:
        return False
    return True


def _type_at(block: nn.Module, path: str) -> str:
    try:
        return type(block.get_submodule(path)).__name__
    except AttributeError:
        return "nothing"


def _blocks(model: nn.Module, f: ModelFamily) -> list[nn.Module]:
    container: Any = _get(model, f.blocks)
    return list(container.values()) if isinstance(container, nn.ModuleDict) else list(container)


def apply_tp(
    model: nn.Module, tp_mesh: Any, *, sequence_parallel: bool = False, loss_parallel: bool = True
) -> ModelFamily:
    """Parallelise ``model`` in place over the 1-D ``tp_mesh``; returns the family plan used.

    Arguments:
        model: a finished model of a known family (our ``Llama``; transformers Llama/Mistral/Qwen2 for causal LM),
            on the meta device or materialised (identical on every rank: shards are taken from tp rank 0); or a
            pipeline stage of one (:func:`~lightning_llmopt.parallel.pipeline.prune_to_stages`: the parts it set
            to ``None`` are skipped).
        tp_mesh: the tensor-parallel ``DeviceMesh`` (e.g. ``mesh["tp"]``).
        sequence_parallel: shard norms and residuals on the sequence (inputs ``(B, T)`` need ``T % tp == 0``).
        loss_parallel: leave the logits sharded on the vocabulary (a DTensor); else gather them (a plain tensor).

    Raises ``ValueError`` (before any collective) when ``tp`` does not divide the heads, kv heads, vocabulary or MLP.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    family = find_family(model)
    shape = family.shape(model)
    tp = tp_mesh.size()
    validate_tp(shape, tp)
    if tp == 1:
        return family
    check_plan_paths(model, family)
    sp = sequence_parallel
    # transformers derives positions and the mask from the embedding output's length: keep it whole there and
    # enter sequence parallelism at the first block instead.
    seq_embedding = sp and family.attention_kwarg is None
    root_plan = {
        family.embedding: RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1) if seq_embedding else Replicate()
        ),
        family.head: ColwiseParallel(
            input_layouts=Shard(1) if sp else Replicate(),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    if sp:
        root_plan[family.final_norm] = SequenceParallel()
    replicate_kv = shape.n_kv_heads < tp
    blocks = _blocks(model, family)
    for i, block in enumerate(blocks):
        moe = _moe_of(block, family)
        kv = not _reads_shared_kv(_get(block, family.attention))  # a CLA reader has no k/v projections
        parallelize_module(block, tp_mesh, _block_plan(family, sp, replicate_kv, moe=moe is not None, kv=kv))
        if moe is not None:
            _shard_moe(moe, tp_mesh)
        attention = _get(block, family.attention)
        _cast_input_for_autocast(attention, family.attention_kwarg)
        if moe is None:
            _cast_input_for_autocast(_get(block, family.mlp))
        if not sp:
            replicate_module(_get(block, family.attention_norm), tp_mesh)
            replicate_module(_get(block, family.mlp_norm), tp_mesh)
        if replicate_kv and kv:
            _replicate_kv(_get(attention, family.k), tp_mesh, shape)
            _replicate_kv(_get(attention, family.v), tp_mesh, shape)
        if family.kv_groups_attr is not None:
            local_kv = max(shape.n_kv_heads // tp, 1)
            setattr(attention, family.kv_groups_attr, shape.n_heads // tp // local_kv)
        if sp and not seq_embedding and i == 0:
            parallelize_module(
                block,
                tp_mesh,
                PrepareModuleInput(
                    input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
                ),
            )
    # a pipeline stage holds the embedding, the final norm and the head only where it is the first or last stage
    root_plan = {path: style for path, style in root_plan.items() if _present(model, path)}
    parallelize_module(model, tp_mesh, root_plan)
    if family.head in root_plan:
        _cast_input_for_autocast(_get(model, family.head))
    if not sp and _present(model, family.final_norm):
        replicate_module(_get(model, family.final_norm), tp_mesh)
    if shape.tie_embeddings:  # both are Shard(0) over the vocabulary: tie the DTensor parameters again
        _get(model, family.head).weight = _get(model, family.embedding).weight  # type: ignore[union-attr]
    return family
