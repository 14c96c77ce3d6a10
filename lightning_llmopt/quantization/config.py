"""``QuantConfig``: which linear layers of a model are quantized, how, and with which algorithm."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from lightning_llmopt.quantization.observers import OBSERVERS
from lightning_llmopt.quantization.spec import QuantSpec

METHODS = ("rtn", "gptq")
DEFAULT_SKIP = ("output", "lm_head", "*.output", "*.lm_head")
_SPEC_FIELDS = ("bits", "group_size", "symmetric", "observer")


@dataclass
class QuantConfig:
    """Weight-only quantization of the ``nn.Linear`` layers of a model (ours or a transformers one).

    Arguments:
        bits: code width, 2..8 (Triton kernels for 4 and 8).
        group_size: input columns per scale; ``None`` or ``0``: one scale per output channel (also used for layers
            with at most ``group_size`` inputs).
        symmetric: fixed zero point ``2**(bits-1)`` (GPTQ's ``sym=True``) instead of one per group.
        method: ``"rtn"`` (round to nearest) or ``"gptq"`` (needs calibration batches).
        observer: range selection, ``"minmax"``, ``"mse"`` or ``"percentile"`` (see
            :mod:`~lightning_llmopt.quantization.observers`).
        act_order: GPTQ only: quantize columns by decreasing Hessian diagonal (keeps a permutation).
        damp: GPTQ dampening, a fraction of the mean Hessian diagonal.
        block_size: GPTQ lazy-update block (columns).
        sequential: GPTQ only: quantize block by block, collecting each block's Hessians with the earlier blocks
            already quantized (the paper's setting); ``False`` collects every Hessian from the float model at once.
        skip: ``fnmatch`` patterns of module names left in full precision (default: the output head).
        overrides: ``{pattern: {field: value} or None}``: per-layer ``bits``/``group_size``/``symmetric``/
            ``observer``, or ``None`` to leave the layer unquantized; the first matching pattern wins (mixed
            precision writes one exact name per layer).
        scale_dtype: dtype of the stored scales (default: the layer's weight dtype).
    """

    bits: int = 4
    group_size: int | None = 128
    symmetric: bool = True
    method: str = "rtn"
    observer: str = "minmax"
    act_order: bool = False
    damp: float = 0.01
    block_size: int = 128
    sequential: bool = True
    skip: tuple[str, ...] = DEFAULT_SKIP
    overrides: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    scale_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        self.skip = tuple(self.skip)
        if self.method not in METHODS:
            raise ValueError(f"method ({self.method!r}) must be one of {METHODS}")
        if self.observer not in OBSERVERS or self.observer == "cross_entropy":
            raise ValueError(f"observer ({self.observer!r}) must be one of minmax, mse, percentile for weights")
        if not 0.0 <= self.damp < 1.0:
            raise ValueError(f"damp ({self.damp}) must be in [0, 1)")
        if self.block_size <= 0:
            raise ValueError(f"block_size ({self.block_size}) must be positive")
        for pattern, values in self.overrides.items():
            unknown = set(values or {}) - set(_SPEC_FIELDS)
            if unknown:
                raise ValueError(
                    f"overrides[{pattern!r}] has unknown field(s) {sorted(unknown)}; allowed: {_SPEC_FIELDS}"
                )
        self.spec_for("")  # validates bits / group_size

    @staticmethod
    def _spec(bits: int, group_size: int | None, symmetric: bool) -> QuantSpec:
        if group_size is None or group_size <= 0:
            return QuantSpec(bits, "channel", 128, symmetric)
        return QuantSpec(bits, "group", group_size, symmetric)

    def settings_for(self, name: str) -> dict[str, Any] | None:
        """``{bits, group_size, symmetric, observer}`` for module ``name``, or ``None`` if it is not quantized."""
        if any(fnmatch.fnmatchcase(name, p) for p in self.skip):
            return None
        values: dict[str, Any] = {k: getattr(self, k) for k in _SPEC_FIELDS}
        for pattern, override in self.overrides.items():
            if fnmatch.fnmatchcase(name, pattern):
                if override is None:
                    return None
                return {**values, **override}
        return values

    def spec_for(self, name: str, in_features: int | None = None) -> QuantSpec | None:
        """The :class:`QuantSpec` of module ``name`` (``None``: left in full precision). Given ``in_features``, a
        group at least as wide as the layer becomes one group per row (``"channel"``)."""
        values = self.settings_for(name)
        if values is None:
            return None
        group = values["group_size"]
        if in_features is not None and group is not None and group >= in_features:
            group = None
        return self._spec(values["bits"], group, values["symmetric"])

    def observer_for(self, name: str) -> str:
        values = self.settings_for(name)
        return self.observer if values is None else str(values["observer"])

    def with_overrides(self, plan: dict[str, QuantSpec | None]) -> QuantConfig:
        """A copy whose ``overrides`` pin each named layer to a spec (``None``: full precision), e.g. a
        :class:`~lightning_llmopt.quantization.mixed_precision.Allocation`'s plan."""
        overrides: dict[str, dict[str, Any] | None] = {}
        for name, spec in plan.items():
            if spec is None:
                overrides[name] = None
            else:
                group = spec.group_size if spec.granularity == "group" else None
                overrides[name] = {"bits": spec.bits, "group_size": group, "symmetric": spec.symmetric}
        return replace(self, overrides={**overrides, **self.overrides})


__all__ = ["DEFAULT_SKIP", "METHODS", "QuantConfig"]
