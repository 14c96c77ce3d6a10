"""``optimize_model``: swap a finished model's submodules for the fused Triton kernels, in place.

Like the parallelism functions, it is applied to a finished model (before TP/FSDP wrapping and ``torch.compile``)
and leaves parameter names, parameter objects and the state dict unchanged, so checkpoints and optimizers carry
over. Supported models and what is replaced:

**Reference** :class:`~lightning_llmopt.models.llama.Llama`:

- every ``RMSNorm`` -> :class:`~lightning_llmopt.layers.norms.FusedRMSNorm` (same ``weight`` Parameter);
- every ``Attention.rotary`` hook -> :class:`~lightning_llmopt.layers.rotary.FusedRotary` (in-place q/k rotation;
  a layer reading another layer's K/V rotates its queries only; MLA blocks rotate their RoPE channels with it);
- ``pack_qkv`` on every attention block that has ``wk``/``wv`` (MLA: ``wq`` or ``wq_a`` with ``wkv_a``);
- every ``FeedForward`` -> :class:`~lightning_llmopt.layers.mlp.FusedSwiGLUMLP` (same ``w1``/``w2``/``w3``);
- ``model.fused_loss`` -> :class:`~lightning_llmopt.layers.loss.FusedLinearCrossEntropy`, used by
  :meth:`Llama.loss <lightning_llmopt.models.llama.Llama.loss>` (and so by ``CausalLMModule.training_step``);
- ``attention="triton"`` (or any registered backend): every ``Attention.backend`` and ``config.attn_backend``.

The same swaps happen at construction when ``LlamaConfig.fused_kernels`` names them.

**transformers** ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` (and
their base models), patched per instance, nothing process-wide:

- every ``*RMSNorm`` module of the family -> :class:`FusedRMSNorm` sharing its weight;
- every ``*MLP`` whose ``config.hidden_act`` is SiLU -> :class:`~lightning_llmopt.layers.mlp.FusedHFSwiGLUMLP`
  holding the original ``gate_proj``/``up_proj``/``down_proj``;
- every attention module's ``forward`` is replaced, on that instance, by the class's own ``forward`` code bound to
  a copy of its module globals in which ``apply_rotary_pos_emb`` is the in-place fused rotation (the module-level
  function of transformers is left alone);
- the causal-LM ``forward``, on that instance: in training mode with ``labels``, the loss comes from the fused
  linear + cross-entropy (labels shifted as transformers does, ``num_items_in_batch`` honoured) and ``logits`` is
  ``None``; otherwise the original forward runs.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_llmopt.models.config import FUSED_KERNELS
from lightning_llmopt.models.llama import set_kernel_step

__all__ = ["FUSED_KERNELS", "apply_config_kernels", "optimize_model"]

HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_COUNTS = (*FUSED_KERNELS, "attention", "packed_qkv")  # the keys of ``model.llmopt_fused``


def optimize_model(
    model: nn.Module,
    *,
    rmsnorm: bool = True,
    rope: bool = True,
    swiglu: bool = True,
    fused_ce: bool = True,
    pack_qkv: bool = True,
    attention: str | None = None,
    backend: str | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> nn.Module:
    """Swap ``model``'s norms, rotary embedding, SwiGLU MLPs and loss for the fused kernels, in place.

    Arguments:
        model: a :class:`~lightning_llmopt.models.llama.Llama`, or a transformers Llama/Mistral/Qwen2/Qwen3 model
            (causal LM or base model).
        rmsnorm, rope, swiglu, fused_ce: which kernels to use.
        pack_qkv: reference model only: compute q, k and v with one GEMM over the concatenated ``wq``/``wk``/``wv``
            weights (the parameters and state dict stay three ``nn.Linear``; modules that are not plain
            ``nn.Linear``, such as tensor-parallel, LoRA or quantized ones, fall back to three GEMMs at run time).
            In backward the input's gradient is one GEMM instead of three plus two passes to sum them.
        attention: reference model only: an attention backend name (e.g. ``"triton"``, our flash attention);
            ``None`` keeps the configured one.
        backend: ``"auto"`` / ``"triton"`` / ``"reference"`` for every fused module (see
            :mod:`lightning_llmopt.kernels.fused_common`); default ``$LLMOPT_FUSED_BACKEND`` or ``"auto"``.
        process_group: vocab-parallel TP group of the output head, passed to the fused loss.

    Returns ``model``; ``model.llmopt_fused`` counts what was replaced per kernel. Applying twice replaces nothing
    more.
    """
    from lightning_llmopt.models.llama import Llama

    wanted = dict(rmsnorm=rmsnorm, rope=rope, swiglu=swiglu, fused_ce=fused_ce, pack_qkv=pack_qkv)
    if isinstance(model, Llama):
        counts = _optimize_llama(model, wanted, attention, backend, process_group)
    elif getattr(getattr(model, "config", None), "model_type", None) in HF_MODEL_TYPES:
        if attention is not None:
            raise ValueError(
                f"attention ({attention!r}) can only be set on the reference Llama; transformers models "
                "choose attention with attn_implementation"
            )
        counts = _optimize_hf(model, wanted, backend, process_group)
    else:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise TypeError(
            f"optimize_model supports lightning_llmopt Llama and transformers models of type "
            f"{HF_MODEL_TYPES}, got {type(model).__name__} (model_type {model_type!r})"
        )
    previous = getattr(model, "llmopt_fused", {})
    model.llmopt_fused = {  # type: ignore[assignment]
        k: previous.get(k, 0) + counts.get(k, 0) for k in _COUNTS
    }
    return model


def apply_config_kernels(model: nn.Module, process_group: dist.ProcessGroup | None = None) -> nn.Module:
    """The kernels ``model.config.fused_kernels`` names (a reference :class:`~lightning_llmopt.models.llama.Llama`),
    swapped in by :func:`optimize_model`; a model without that field is returned unchanged. Registered as the
    Llama's construction-time kernel step (:func:`~lightning_llmopt.models.llama.set_kernel_step`)."""
    wanted = list(getattr(getattr(model, "config", None), "fused_kernels", None) or [])
    if not wanted:
        return model
    on = [name in wanted for name in FUSED_KERNELS]
    return optimize_model(model, rmsnorm=on[0], rope=on[1], swiglu=on[2], fused_ce=on[3], process_group=process_group)


set_kernel_step(apply_config_kernels)


_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def _replace(model: nn.Module, match: Callable[[nn.Module], bool], build: Callable[[nn.Module], nn.Module]) -> int:
    """Replace every submodule for which ``match`` holds by ``build(module)``; returns how many.

    The replacement takes over the original's forward hooks (those of a tensor-parallel plan applied before the
    kernels: ``SequenceParallel`` on a norm, ``PrepareModuleInput`` on an MLP), so the swap keeps the layout."""
    targets = [name for name, module in model.named_modules() if name and match(module)]
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        old = model.get_submodule(name)
        new = build(old)
        for attr in _HOOK_DICTS:
            hooks = getattr(old, attr, None)
            if hooks:
                getattr(new, attr).update(hooks)
        setattr(model.get_submodule(parent_name), child, new)
    return len(targets)


# --------------------------------------------------------------------------- reference model


def _optimize_llama(
    model: nn.Module,
    wanted: dict[str, bool],
    attention: str | None,
    backend: str | None,
    process_group: dist.ProcessGroup | None,
) -> dict[str, int]:
    from lightning_llmopt.layers.loss import FusedLinearCrossEntropy
    from lightning_llmopt.layers.mlp import FusedSwiGLUMLP
    from lightning_llmopt.layers.norms import FusedRMSNorm
    from lightning_llmopt.layers.rotary import FusedRotary
    from lightning_llmopt.models.attention import registered_backends
    from lightning_llmopt.models.llama import Attention, FeedForward, RMSNorm

    counts = dict.fromkeys(_COUNTS, 0)
    if wanted["rmsnorm"]:
        counts["rmsnorm"] = _replace(
            model, lambda m: type(m) is RMSNorm, lambda m: FusedRMSNorm.from_module(m, backend=backend)
        )
    if wanted["swiglu"]:
        counts["swiglu"] = _replace(
            model,
            lambda m: type(m) is FeedForward,
            lambda m: FusedSwiGLUMLP.from_module(m, backend=backend),  # type: ignore[arg-type]
        )
    from lightning_llmopt.models.mla import MLAttention

    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    mla = [m for m in model.modules() if isinstance(m, MLAttention)]
    blocks: list[Attention | MLAttention] = [*attentions, *mla]
    if wanted["pack_qkv"]:  # a layer reading another's K/V (no wk/wv) has only wq: nothing to pack
        for m in blocks:
            if not m.pack_qkv and getattr(m, "wk", True) is not None:
                m.pack_qkv = True
                counts["packed_qkv"] += 1
    if wanted["rope"]:  # MLA and K/V readers call ``rotary.rotate`` on their RoPE channels / queries alone
        for m in blocks:
            if getattr(m, "rotary", None) is None:
                m.rotary = FusedRotary(backend)
                counts["rope"] += 1
    if wanted["fused_ce"] and getattr(model, "fused_loss", None) is None:
        model.fused_loss = FusedLinearCrossEntropy(process_group=process_group, backend=backend)
        counts["fused_ce"] = 1
    if attention is not None:
        if attention not in registered_backends():
            raise ValueError(f"attention ({attention!r}) must be one of {sorted(registered_backends())}")
        model.config.attn_backend = attention  # type: ignore[union-attr]
        for m in blocks:
            m.backend = attention
        counts["attention"] = len(attentions) + len(mla)
    return counts


# --------------------------------------------------------------------------- transformers


def _optimize_hf(
    model: nn.Module, wanted: dict[str, bool], backend: str | None, process_group: dist.ProcessGroup | None
) -> dict[str, int]:
    from lightning_llmopt.layers.mlp import FusedHFSwiGLUMLP
    from lightning_llmopt.layers.norms import FusedRMSNorm

    config: Any = model.config
    counts = dict.fromkeys(_COUNTS, 0)
    family = f"transformers.models.{config.model_type}."
    if wanted["rmsnorm"]:
        counts["rmsnorm"] = _replace(
            model,
            lambda m: type(m).__name__.endswith("RMSNorm") and type(m).__module__.startswith(family),
            lambda m: FusedRMSNorm.from_module(m, backend=backend),
        )
    if wanted["swiglu"] and getattr(config, "hidden_act", None) in ("silu", "swish"):
        counts["swiglu"] = _replace(
            model,
            lambda m: (
                type(m).__name__.endswith("MLP") and all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj"))
            ),
            lambda m: FusedHFSwiGLUMLP.from_module(m, backend=backend),
        )
    if wanted["rope"]:
        for m in model.modules():
            if type(m).__module__.startswith(family) and _patch_hf_rope(m, backend):
                counts["rope"] += 1
    if wanted["fused_ce"] and hasattr(model, "lm_head") and "forward" not in vars(model):
        model._llmopt_fused_ce = dict(process_group=process_group, backend=backend)  # type: ignore[assignment]
        model.forward = types.MethodType(_hf_causal_lm_forward, model)  # type: ignore[method-assign]
        counts["fused_ce"] = 1
    return counts


def _fused_apply_rotary_pos_emb(original: Callable, backend: str | None) -> Callable:
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` on the in-place kernel.

    q/k ``(B, H, T, D)``, cos/sin ``(B or 1, T, D)`` whose two halves are equal (transformers builds them as
    ``cat(freqs, freqs)``); anything else goes to the original function.
    """
    from lightning_llmopt.kernels.rotary import apply_rotary

    def apply_rotary_pos_emb(
        q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        unsqueeze_dim = args[0] if args else kwargs.get("unsqueeze_dim", 1)
        if unsqueeze_dim != 1 or q.ndim != 4 or cos.ndim != 3 or cos.shape[-1] != q.shape[-1]:
            return original(q, k, cos, sin, *args, **kwargs)
        half = q.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]  # (B, T, D/2)
        q = apply_rotary(q.transpose(1, 2), c, s, backend=backend).transpose(1, 2)
        k = apply_rotary(k.transpose(1, 2), c, s, backend=backend).transpose(1, 2)
        return q, k

    return apply_rotary_pos_emb


def _patch_hf_rope(module: nn.Module, backend: str | None) -> bool:
    """Rebind ``module.forward`` to its class's code with a fused ``apply_rotary_pos_emb``; False if not applicable."""
    if "forward" in vars(module):
        return False
    patched = _with_fused_rope(type(module).forward, backend)
    if patched is None:
        return False
    module.forward = types.MethodType(patched, module)  # type: ignore[method-assign]
    return True


def _with_fused_rope(fn: Callable, backend: str | None) -> Callable | None:
    """A copy of ``fn`` whose code sees the fused ``apply_rotary_pos_emb``; None if its code never calls it.

    A decorated forward (transformers >= 5.2x wraps attention forwards in ``deprecate_kwarg``) is copied with the
    copy of the function it wraps in place of the original, so the decorator's behaviour stays.
    """
    inner = getattr(fn, "__wrapped__", None)
    if inner is not None:
        patched_inner = _with_fused_rope(inner, backend)
        closure = getattr(fn, "__closure__", None) or ()
        cells = [types.CellType(patched_inner) if _cell_holds(c, inner) else c for c in closure]
        if patched_inner is None or not any(_cell_holds(c, inner) for c in closure):
            return None
        wrapper = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, tuple(cells))
        wrapper.__kwdefaults__ = fn.__kwdefaults__
        wrapper.__dict__.update({**fn.__dict__, "__wrapped__": patched_inner})
        return wrapper
    code = getattr(fn, "__code__", None)
    if code is None or "apply_rotary_pos_emb" not in code.co_names:
        return None
    scope = dict(fn.__globals__)
    scope["apply_rotary_pos_emb"] = _fused_apply_rotary_pos_emb(fn.__globals__["apply_rotary_pos_emb"], backend)
    patched = types.FunctionType(code, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    patched.__kwdefaults__ = fn.__kwdefaults__
    return patched


def _cell_holds(cell: Any, value: object) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def _hf_causal_lm_forward(
    self: Any,
    input_ids: Tensor | None = None,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    past_key_values: Any = None,
    inputs_embeds: Tensor | None = None,
    labels: Tensor | None = None,
    use_cache: bool | None = None,
    **kwargs: Any,
) -> Any:
    """transformers' causal-LM forward with the fused loss in training mode (``logits`` is then ``None``)."""
    if labels is None or not self.training:
        return type(self).forward(
            self,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            **kwargs,
        )
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from lightning_llmopt.kernels.fused_linear_ce import fused_linear_cross_entropy

    num_items = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)
    outputs = self.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        **kwargs,
    )
    hidden = outputs.last_hidden_state  # (B, T, H)
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:]  # transformers' ForCausalLMLoss shift
    from lightning_llmopt.layers.shards import vocab_operands

    opts = self._llmopt_fused_ce
    hidden, weight, group = vocab_operands(hidden, self.lm_head.weight)  # tensor parallelism: the local shards
    loss = fused_linear_cross_entropy(
        hidden,
        weight,
        shift_labels.to(hidden.device),
        reduction="sum" if num_items is not None else "mean",
        process_group=group if group is not None else opts["process_group"],
        backend=opts["backend"],
    )
    if num_items is not None:
        # a Python count divides as a scalar: a tensor made from it would be copied from host memory every step
        loss = loss / (num_items.to(loss.device) if isinstance(num_items, torch.Tensor) else float(num_items))
    return CausalLMOutputWithPast(
        loss=loss,
        logits=None,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )
