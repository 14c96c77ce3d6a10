"""FP8 training of the linear layers (Hopper/Ada tensor cores): a plan step over a finished model, on torchao.

:func:`apply_float8` swaps each eligible ``nn.Linear`` for torchao's ``Float8Linear`` (``convert_to_float8_training``,
the ``lightning_llmopt[fp8]`` extra). The master weights stay as they are (fp32 under ``bf16-mixed``), under the same
parameter names, so optimizers, checkpoints, resumes and the Hugging Face export see an unchanged model. Each forward
casts the input and the weight to ``float8_e4m3fn`` with scales computed from their current absolute maximum
(dynamic scaling), multiplies them on the FP8 tensor cores (``torch._scaled_mm``) and returns the input's precision;
backward casts the output gradient the same way. Recipes (torchao's names):

- ``"tensorwise"``: one scale per tensor; the cheapest cast, the widest error on outliers;
- ``"rowwise"``: one scale per row of each operand along the reduced dimension, power-of-two scales; more accurate;
- ``"rowwise_with_gw_hp"``: rowwise, with the weight gradient's GEMM kept in high precision.

Which layers convert (:func:`float8_filter`): every ``nn.Linear`` whose input and output widths are multiples of 16
(the FP8 GEMM's alignment), except the LM head (``output``: its GEMM feeds the fused linear + cross-entropy, and the
logits' precision matters most for the loss) and MoE routers (``router``: a few outputs, their softmax decides the
experts). The rest stays in the training precision; :class:`Float8Report` names both sets for the log.

FP8 tensor cores exist from compute capability 8.9 (Ada, Hopper, Blackwell): elsewhere :func:`check_float8_device`
raises, unless ``emulate=True`` (torchao's emulation: the same rounding to FP8 with the same scales, the GEMM in high
precision), which runs on any device (CPU tests, parity references).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [
    "FLOAT8_RECIPES",
    "Float8Report",
    "apply_float8",
    "check_float8_device",
    "float8_filter",
    "float8_flop_share",
    "is_float8_linear",
    "precompute_scales",
]

FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
ALIGNMENT = 16  # FP8 GEMMs (torch._scaled_mm) take widths that are multiples of 16
KEEP_HIGH_PRECISION = ("output", "router")  # module names (last part) never converted; see the module docstring
MIN_CAPABILITY = (8, 9)


@dataclasses.dataclass
class Float8Report:
    """What :func:`apply_float8` did.

    Arguments:
        recipe: the recipe name.
        converted: qualified names of the linear layers now in FP8.
        kept: qualified name -> why that linear layer stays in high precision.
        emulate: whether the FP8 GEMMs are emulated.
    """

    recipe: str
    converted: list[str]
    kept: dict[str, str]
    emulate: bool = False

    def describe(self) -> str:
        """One line for the log, e.g. ``float8 (rowwise): 112 linear layers in FP8 (w1, w2, w3, wk, wo, wq, wv); kept in
        high precision: output (LM head)``; kept layers are grouped by name and reason (``w1 x2 (64x200 not
        multiples of 16)``)."""
        kinds = sorted({name.rsplit(".", 1)[-1] for name in self.converted})
        groups: dict[tuple[str, str], int] = {}  # (last name part, reason) -> layers, e.g. ("w1", "64x200 ...")
        for name, why in self.kept.items():
            key = (name.rsplit(".", 1)[-1], why)
            groups[key] = groups.get(key, 0) + 1
        kept = ", ".join(f"{leaf}{f' x{n}' if n > 1 else ''} ({why})" for (leaf, why), n in sorted(groups.items()))
        mode = ", emulated" if self.emulate else ""
        return (
            f"float8 ({self.recipe}{mode}): {len(self.converted)} linear layers in FP8 ({', '.join(kinds) or 'none'}); "
            f"kept in high precision: {kept or 'none'}"
        )


def check_float8_device(device: torch.device | str, emulate: bool = False) -> None:
    """Raise ``ValueError`` unless ``device`` has FP8 tensor cores (CUDA compute capability 8.9 or later) or
    ``emulate`` is set."""
    device = torch.device(device)
    if emulate:
        return
    if device.type != "cuda":
        raise ValueError(
            f"float8 training needs a GPU with FP8 tensor cores (compute capability >= 8.9: Ada, Hopper, Blackwell); "
            f"the device is {device.type!r}. Use bf16-mixed there, or float8_emulate=True to emulate FP8 (slow; tests)"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"float8 training needs FP8 tensor cores (compute capability >= 8.9); {name} has "
            f"{capability[0]}.{capability[1]}. Use bf16-mixed on this GPU"
        )


def _why_kept(name: str, module: nn.Linear) -> str | None:
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "output":
        return "LM head"
    if leaf in KEEP_HIGH_PRECISION:
        return "MoE router" if leaf == "router" else "kept by name"
    if module.in_features % ALIGNMENT or module.out_features % ALIGNMENT:
        return f"{module.in_features}x{module.out_features} not multiples of {ALIGNMENT}"
    return None


def float8_filter(kept: dict[str, str] | None = None) -> Callable[[nn.Module, str], bool]:
    """torchao's ``module_filter_fn``: ``True`` for the linear layers to convert (see the module docstring); the
    others' reasons go into ``kept`` when given."""

    def keep_or_convert(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear):
            return True  # torchao asks about containers too: descend into them
        why = _why_kept(name, module)
        if why is not None and kept is not None:
            kept[name] = why
        return why is None

    return keep_or_convert


def _torchao_float8() -> Any:
    try:
        import torchao.float8 as float8
    except ImportError as exc:  # pragma: no cover - exercised where torchao is absent
        raise ImportError(
            "float8 training needs torchao: pip install 'lightning_llmopt[fp8]' (torchao's float8 training)"
        ) from exc
    return float8


def apply_float8(
    model: nn.Module, recipe: str = "rowwise", emulate: bool = False, fsdp_all_gather: bool = False
) -> Float8Report:
    """Convert ``model``'s eligible linear layers to FP8 training in place (see the module docstring).

    Arguments:
        model: a finished decoder (before tensor parallelism, compile and ZeRO-3; on any device, meta included).
        recipe: one of :data:`FLOAT8_RECIPES`.
        emulate: emulate the FP8 GEMMs (any device; the same rounding and scales).
        fsdp_all_gather: ``"tensorwise"`` only: FSDP2 all-gathers the weights in FP8 (half bf16's traffic); call
            :func:`precompute_scales` after each optimizer step.

    Returns a :class:`Float8Report`. Raises ``ValueError`` naming a bad recipe or combination.
    """
    if recipe not in FLOAT8_RECIPES:
        raise ValueError(f"float8 recipe {recipe!r} is not one of {', '.join(FLOAT8_RECIPES)}")
    if fsdp_all_gather and recipe != "tensorwise":
        raise ValueError(f"FP8 all-gather under ZeRO-3 needs the 'tensorwise' recipe, not {recipe!r}")
    float8 = _torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=fsdp_all_gather)
    kept: dict[str, str] = {}
    already = [name for name, m in model.named_modules() if is_float8_linear(m)]
    float8.convert_to_float8_training(model, module_filter_fn=float8_filter(kept), config=config)
    converted = [name for name, m in model.named_modules() if is_float8_linear(m)]
    if already:
        converted = [name for name in converted if name not in already]
    return Float8Report(recipe, converted, kept, emulate)


def precompute_scales(model: nn.Module) -> None:
    """After an optimizer step under FSDP2 with FP8 all-gather: every weight's scale in one all-reduce (torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``) rather than one per layer during the next forward."""
    _torchao_float8().precompute_float8_dynamic_scale_for_fsdp(model)


def is_float8_linear(module: nn.Module) -> bool:
    """Whether ``module`` is torchao's ``Float8Linear`` (without importing torchao where nothing converted)."""
    return type(module).__name__ == "Float8Linear" and type(module).__module__.startswith("torchao.")


def float8_flop_share(model: nn.Module, flops_per_token: float) -> float:
    """The share of a training step's FLOPs that runs in FP8: ``6 * in * out`` per token for each FP8 linear
    (forward and both backward GEMMs) over ``flops_per_token`` (the model's training FLOPs per token); 0 without
    any, at most 1."""
    if flops_per_token <= 0:
        return 0.0
    fp8 = 0
    for module in model.modules():
        if is_float8_linear(module):
            in_features, out_features = int(module.in_features), int(module.out_features)  # type: ignore[arg-type]
            fp8 += 6 * in_features * out_features
    return min(1.0, fp8 / flops_per_token)
