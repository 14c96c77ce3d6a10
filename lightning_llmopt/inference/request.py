"""Requests, their sequences, and what the engine hands back."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from lightning_llmopt.inference.detokenize import TextState
from lightning_llmopt.inference.sampling import SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    from lightning_llmopt.inference.grammar import Matcher

__all__ = ["Completion", "CompletionOutput", "Request", "RequestMetrics", "SeqStatus", "Sequence", "StreamEvent"]


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One token sequence being generated: the prompt, then the sampled tokens.

    ``num_computed`` tokens have their keys/values in the blocks of ``block_table``; the next step computes
    ``tokens[num_computed:]`` (the whole prompt, a chunk of it, or the last sampled token).
    """

    def __init__(
        self, seq_id: int, request: Request, tokens: list[int], index: int, generator: torch.Generator | None
    ) -> None:
        self.seq_id = seq_id
        self.request = request
        self.index = index  # 0..n-1 within the request
        self.tokens = tokens
        self.prompt_len = len(request.prompt_token_ids)
        self.block_table: list[int] = []
        self.num_computed = 0
        self.status = SeqStatus.WAITING
        self.generator = generator
        self.finish_reason: str | None = None
        self.num_streamed = 0  # output tokens already handed to a stream
        self.cached_tokens = 0  # prompt tokens reused from the prefix cache at admission
        self.matched = False  # prefix cache consulted for the current admission
        self.deferred = False  # admission already postponed once (cache-aware admission)
        self.text: TextState | None = None  # detokenised output (with a tokenizer), stop strings
        self.logprobs: list[TokenLogprobs] = []  # one per output token when the request asks for logprobs
        self.grammar: Matcher | None = None  # structured output: where the text stands in its grammar

    @property
    def output_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def priority(self) -> tuple[int, int]:
        """Smaller is more important: arrival order, then index in the request."""
        return (self.request.arrival, self.index)

    @property
    def finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, len={len(self.tokens)}, computed={self.num_computed}, "
            f"blocks={len(self.block_table)}, {self.status.value})"
        )


@dataclass
class RequestMetrics:
    """Per-request figures: prompt tokens, those served from the prefix cache, and times (seconds, monotonic)."""

    prompt_tokens: int
    cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    truncated: int = 0  # prompt tokens dropped from the left by truncate=True
    cancelled: bool = False

    @property
    def finished(self) -> bool:
        if self.cancelled:
            return True
        return bool(self.seqs) and all(s.finished for s in self.seqs) and len(self.seqs) == self.params.n


@dataclass
class CompletionOutput:
    """One generated sequence: ``token_ids`` (stop token excluded), ``text`` (with a tokenizer; cut before a stop
    string), why it ended, and each token's log-probabilities when the request asked for them."""

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class Completion:
    """The result of one prompt: its ``n`` outputs and metrics."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics

    @property
    def token_ids(self) -> list[int]:
        """Tokens of the first output (the only one unless ``n > 1``)."""
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text


@dataclass
class StreamEvent:
    """New tokens of one sequence since the previous event (``finished`` with ``finish_reason`` at the end).

    ``text`` is the new text (incremental detokenisation: never half a character; text that could begin a stop
    string is held back until it is known not to), ``logprobs`` the new tokens' log-probabilities when asked for.
    """

    request_id: str
    index: int
    token_ids: list[int]
    text: str | None
    finished: bool
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None


def now() -> float:
    return time.perf_counter()
