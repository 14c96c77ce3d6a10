"""SwiGLU MLPs on the fused activation kernel (:func:`lightning_llmopt.kernels.swiglu.swiglu`)."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from lightning_llmopt.kernels.swiglu import swiglu
from lightning_llmopt.models.llama import FeedForward

__all__ = ["FusedHFSwiGLUMLP", "FusedSwiGLUMLP"]


class FusedSwiGLUMLP(FeedForward):
    """:class:`~lightning_llmopt.models.llama.FeedForward` (``w2(silu(w1 x) * w3 x)``, same parameter names) with the
    activation and product in one kernel that saves only ``w1 x`` and ``w3 x`` for backward.

    Arguments:
        dim: model width.
        hidden_dim: SwiGLU inner width.
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.

    Shapes: ``(..., dim)`` -> ``(..., dim)``.
    """

    def __init__(self, dim: int, hidden_dim: int, backend: str | None = None) -> None:
        super().__init__(dim, hidden_dim)
        self.backend = backend

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x), backend=self.backend))

    @classmethod
    def from_module(cls, module: FeedForward, backend: str | None = None) -> FusedSwiGLUMLP:
        """A fused MLP holding ``module``'s own ``w1``/``w2``/``w3`` (shared, not copied)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.w1, new.w2, new.w3 = module.w1, module.w2, module.w3
        new.backend = backend
        return new


class FusedHFSwiGLUMLP(nn.Module):
    """A Hugging Face Llama/Mistral/Qwen2 MLP (``down_proj(silu(gate_proj x) * up_proj x)``) on the fused kernel.

    Holds the original ``gate_proj``/``up_proj``/``down_proj`` modules, so parameter names and the state dict do not
    change. Built with :meth:`from_module` from a module whose ``act_fn`` is SiLU.

    Shapes: ``(..., hidden_size)`` -> ``(..., hidden_size)``.
    """

    def __init__(
        self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module, backend: str | None = None
    ) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.backend = backend

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), backend=self.backend))

    @classmethod
    def from_module(cls, module: Any, backend: str | None = None) -> FusedHFSwiGLUMLP:
        new = cls(module.gate_proj, module.up_proj, module.down_proj, backend)
        if hasattr(module, "config"):
            new.config = module.config  # type: ignore[assignment]
        return new
