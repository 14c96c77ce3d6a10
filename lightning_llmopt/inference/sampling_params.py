"""``SamplingParams``: how to continue one prompt (validated in ``__post_init__``, naming the offending value)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lightning_llmopt.inference.structured_output import StructuredOutput

__all__ = ["MAX_LOGPROBS", "SamplingParams", "StructuredOutput"]

MAX_LOGPROBS = 20  # the most top log-probabilities a token may report (OpenAI's limit)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to continue one prompt.

    The sampler applies, in order: the penalties, temperature, top-k, top-p, min-p, then draws (see
    :mod:`~lightning_llmopt.inference.sampling`).

    Arguments:
        max_tokens: number of tokens to generate at most (>= 1).
        temperature: 0 for greedy decoding; otherwise logits are divided by it before sampling (> 0).
        top_k: keep only the ``top_k`` most likely tokens (``None`` or 0: all).
        top_p: nucleus sampling: keep the most likely tokens whose cumulative probability reaches ``top_p``
            (in ``(0, 1]``; 1 keeps all).
        seed: seeds the request's own generator; ``None`` draws from the engine's generator.
        stop_token_ids: tokens that end the sequence (not included in the output).
        ignore_eos: do not stop at the tokenizer's end-of-sequence token.
        n: number of sequences sampled from the prompt (parallel sampling; they share the prompt's KV blocks,
            copied on write). ``n > 1`` needs ``temperature > 0``.
        min_p: keep only tokens whose probability is at least ``min_p`` times the most likely token's (in
            ``[0, 1]``; 0 keeps all).
        presence_penalty: subtracted from the logit of every token already generated (in ``[-2, 2]``).
        frequency_penalty: subtracted from a token's logit once per time it was generated (in ``[-2, 2]``).
        repetition_penalty: a token of the prompt or the output has its logit divided by it when positive and
            multiplied by it when negative (> 0; 1 is off; Keskar et al. 2019, CTRL).
        logprobs: report each sampled token's log-probability under the model and the ``logprobs`` most likely
            tokens' (``None``: off; 0 reports the sampled token's only; at most 20).
        stop: strings that end the sequence, matched on the detokenised text across token boundaries (the text
            is cut before the match).
        skip_special_tokens: leave the tokenizer's special tokens (other than the stop tokens, which are never in
            the output) out of the text (default, as in vLLM); ``False`` keeps them. Token ids are unaffected.
        structured_output: a :class:`StructuredOutput` the text must follow (a JSON schema, any JSON object, a
            regular expression, choices or a grammar): tokens that cannot continue it are masked before the draw,
            and the sequence ends once the text is complete (docs/structured_output.md). Needs the ``serve`` extra
            (llguidance).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens ({self.max_tokens!r}) must be an integer >= 1")
        if not _number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature ({self.temperature!r}) must be a finite number >= 0 (0 is greedy)")
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0
        ):
            raise ValueError(f"top_k ({self.top_k!r}) must be None or an integer >= 0 (0 keeps every token)")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p ({self.top_p!r}) must be in (0, 1]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed ({self.seed!r}) must be None or an integer >= 0")
        stops = tuple(self.stop_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stops):
            raise ValueError(f"stop_token_ids ({list(stops)!r}) must be non-negative integers")
        object.__setattr__(self, "stop_token_ids", stops)
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n ({self.n!r}) must be an integer >= 1")
        if self.n > 1 and self.temperature == 0:
            raise ValueError(f"n ({self.n}) > 1 needs temperature > 0: greedy samples would all be identical")
        self._check_processing()

    def _check_processing(self) -> None:
        if not _number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p ({self.min_p!r}) must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} ({value!r}) must be a number in [-2, 2]")
        if not _number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty ({self.repetition_penalty!r}) must be a number > 0 (1 is off)")
        lp = self.logprobs
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_LOGPROBS):
            raise ValueError(f"logprobs ({lp!r}) must be None or an integer in [0, {MAX_LOGPROBS}]")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop ({list(stop)!r}) must be non-empty strings")
        object.__setattr__(self, "stop", stop)
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens ({self.skip_special_tokens!r}) must be a bool")
        so = self.structured_output
        if so is not None and not isinstance(so, StructuredOutput):
            raise ValueError(f"structured_output ({so!r}) must be None or a StructuredOutput")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        """Any of the presence, frequency or repetition penalties is on."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def plain(self) -> bool:
        """No penalty, min-p, logprobs or structured output: the token depends on the logits through temperature,
        top-k and top-p only, which the multi-step, speculative and device-round paths implement (others take the
        full sampler)."""
        return not self.penalised and self.min_p == 0 and self.logprobs is None and self.structured_output is None

    def check_vocab(self, vocab_size: int) -> None:
        """Raise if a stop token lies outside the vocabulary."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary (size {vocab_size})")
