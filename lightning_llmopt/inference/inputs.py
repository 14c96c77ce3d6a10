"""Request input handling for :class:`~lightning_llmopt.inference.LLMEngine`: prompt encoding and validation.

Every check raises before anything is queued, naming the offending value, so bad input never disturbs other
requests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from lightning_llmopt.inference.sampling import SamplingParams

__all__ = ["Prompt", "encode_prompt", "prepare_batch", "validate_prompt"]

Prompt = str | Sequence[int] | torch.Tensor


def encode_prompt(prompt: Prompt, tokenizer: Any) -> list[int]:
    """Token ids of a string (through ``tokenizer``), a 1-D integer tensor or a sequence of ints."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a string prompt needs a tokenizer; pass token ids or LLMEngine(..., tokenizer=...)")
        return list(tokenizer.encode(prompt))
    if isinstance(prompt, torch.Tensor):
        if prompt.ndim != 1 or prompt.is_floating_point():
            raise ValueError(
                f"a tensor prompt must be 1-D integer token ids, got {prompt.dtype} {tuple(prompt.shape)}"
            )
        return [int(t) for t in prompt.tolist()]
    tokens = list(prompt)
    if any(isinstance(t, bool) or not isinstance(t, int) for t in tokens):
        raise ValueError("a prompt must be a string or a sequence of integer token ids")
    return tokens


def validate_prompt(prompt: Prompt, params: SamplingParams, truncate: bool, tokenizer: Any, vocab: int,
                    max_model_len: int) -> tuple[list[int], int]:
    """``(tokens, dropped)``: the prompt's ids, left-truncated by ``dropped`` tokens when ``truncate`` allows."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    tokens = encode_prompt(prompt, tokenizer)
    if not tokens:
        raise ValueError("empty prompt: at least one token is needed")
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    params.check_vocab(vocab)
    dropped = 0
    if len(tokens) + params.max_tokens > max_model_len:
        keep = max_model_len - params.max_tokens
        if not truncate:
            raise ValueError(
                f"prompt ({len(tokens)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({max_model_len}); shorten it or pass truncate=True to keep its last "
                f"{max(keep, 0)} tokens"
            )
        if keep < 1:
            raise ValueError(
                f"max_tokens ({params.max_tokens}) leaves no room for a prompt in max_model_len ({max_model_len})"
            )
        dropped = len(tokens) - keep
        tokens = tokens[-keep:]
    return tokens, dropped


def prepare_batch(
    prompts: Prompt | Iterable[Prompt],
    params: SamplingParams | Sequence[SamplingParams] | None,
    validate: Callable[[Prompt, SamplingParams], tuple[list[int], int]],
) -> list[tuple[list[int], SamplingParams, int]]:
    """``(tokens, params, dropped)`` per prompt; one prompt or a list, one ``SamplingParams`` or one per prompt.
    An error names the prompt's index."""
    if isinstance(prompts, (str, torch.Tensor)) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
    ):
        prompts = [prompts]  # type: ignore[list-item]
    prompts = list(prompts)  # type: ignore[arg-type]
    if params is None or isinstance(params, SamplingParams):
        plist = [params or SamplingParams()] * len(prompts)
    else:
        plist = list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
    batch = []
    for i, (prompt, p) in enumerate(zip(prompts, plist, strict=True)):
        try:
            tokens, dropped = validate(prompt, p)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"prompt {i}: {exc}") from None
        batch.append((tokens, p, dropped))
    return batch
