"""``EngineCore``: what the engine's step helpers (:mod:`.multi_step`, :mod:`.spec_chain`) read and call on the
engine, as a protocol, so that they take the engine as an argument and never import the module above them
(CONVENTIONS rule 13: block allocator -> prefix cache -> scheduler -> runner -> engine -> server)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from lightning_llmopt.inference.block_manager import BlockManager
    from lightning_llmopt.inference.config import EngineConfig
    from lightning_llmopt.inference.cuda_graphs import DecodeGraphs
    from lightning_llmopt.inference.kv_pool import KVPool
    from lightning_llmopt.inference.request import Sequence, StreamEvent
    from lightning_llmopt.inference.runner import ModelRunner
    from lightning_llmopt.inference.sampling import TokenLogprobs
    from lightning_llmopt.inference.scheduler import Scheduler
    from lightning_llmopt.inference.spec_decode import SpeculativeDecoder
    from lightning_llmopt.inference.stats import EngineStats

__all__ = ["EngineCore"]


class EngineCore(Protocol):
    """The state of :class:`~lightning_llmopt.inference.engine.LLMEngine` its step helpers use."""

    config: EngineConfig
    device: torch.device
    tokenizer: Any
    max_model_len: int
    blocks: BlockManager
    pool: KVPool
    scheduler: Scheduler
    runner: ModelRunner
    graphs: DecodeGraphs | None
    spec: SpeculativeDecoder | None
    stats: EngineStats

    def _append(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None = None) -> StreamEvent: ...

    def _append_tokens(
        self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprobs | None] | None = None
    ) -> StreamEvent: ...
