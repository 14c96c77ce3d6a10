"""Engine-wide figures: prefix-cache hits, time to first token and throughput, reported together."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from lightning_llmopt.inference.request import RequestMetrics, StreamEvent

__all__ = ["EngineStats"]


@dataclass
class EngineStats:
    """Counters since the engine was built (or :meth:`reset`).

    ``hit_rate`` is cached prompt tokens over prompt tokens of finished requests (first admission only: a
    preempted sequence's recomputation is not counted as a hit). ``throughput_tok_s`` is generated tokens over the
    wall time spent inside ``step()``. With speculative decoding: ``acceptance_rate``,
    ``tokens_per_step`` and ``measured_speedup`` (below).
    """

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    busy_s: float = 0.0
    preemptions: int = 0
    cancelled: int = 0
    ttfts: list[float] = field(default_factory=list)
    # speculative decoding (zero without it)
    spec_draft_tokens: int = 0  # draft tokens verified
    spec_accepted: int = 0  # of which accepted
    spec_verifications: int = 0  # sequence-steps that verified at least one draft
    decode_seq_steps: int = 0  # sequence-steps of decoding (one target pass for one sequence)
    decode_tokens: int = 0  # tokens those emitted
    spec_decode_s: float = 0.0  # time of decode-only steps where some sequence speculated ...
    spec_decode_tokens: int = 0  # ... and the tokens they emitted
    plain_decode_s: float = 0.0  # time of decode-only steps without speculation ...
    plain_decode_tokens: int = 0  # ... and their tokens

    def record_decode(self, num_seqs: int, events: list[StreamEvent], seconds: float, speculative: bool) -> None:
        """One decode-only step of ``num_seqs`` sequences that emitted ``events`` in ``seconds``."""
        tokens = sum(len(e.token_ids) + (e.finish_reason == "stop") for e in events)
        self.decode_seq_steps += num_seqs
        self.decode_tokens += tokens
        if speculative:
            self.spec_decode_s += seconds
            self.spec_decode_tokens += tokens
        else:
            self.plain_decode_s += seconds
            self.plain_decode_tokens += tokens

    def record(self, metrics: RequestMetrics, generated: int) -> None:
        self.requests += 1
        self.prompt_tokens += metrics.prompt_tokens
        self.cached_tokens += metrics.cached_tokens
        self.generated_tokens += generated
        if metrics.ttft is not None:
            self.ttfts.append(metrics.ttft)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def throughput_tok_s(self) -> float:
        return self.generated_tokens / self.busy_s if self.busy_s else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over verified draft tokens."""
        return self.spec_accepted / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a decoding sequence gains per target pass (1 without speculation)."""
        return self.decode_tokens / self.decode_seq_steps if self.decode_seq_steps else 0.0

    @property
    def measured_speedup(self) -> float:
        """Decode throughput of steps with speculation over that of steps without, in this run (0 until both kinds
        ran; an A/B run of the same workload with and without speculation is the cleaner measure)."""
        if not (self.spec_decode_s and self.plain_decode_s and self.plain_decode_tokens):
            return 0.0
        return (self.spec_decode_tokens / self.spec_decode_s) / (self.plain_decode_tokens / self.plain_decode_s)

    def summary(self) -> dict[str, float]:
        """Hit tokens, time to first token and throughput in one flat dict."""
        ttft = sorted(self.ttfts)
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": self.hit_rate,
            "generated_tokens": self.generated_tokens,
            "ttft_mean_s": statistics.fmean(ttft) if ttft else 0.0,
            "ttft_p50_s": ttft[len(ttft) // 2] if ttft else 0.0,
            "ttft_p90_s": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))] if ttft else 0.0,
            "throughput_tok_s": self.throughput_tok_s,
            "steps": self.steps,
            "preemptions": self.preemptions,
            "cancelled": self.cancelled,
            "spec_acceptance_rate": self.acceptance_rate,
            "spec_tokens_per_step": self.tokens_per_step,
            "spec_draft_tokens": self.spec_draft_tokens,
            "spec_measured_speedup": self.measured_speedup,
        }

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]
