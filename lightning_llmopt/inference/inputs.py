"""Request input handling for :class:`~lightning_llmopt.inference.LLMEngine`: prompt encoding and validation.

Text prompts are encoded with the tokenizer's special tokens (``add_special_tokens=True``, as transformers'
``tokenizer(text)`` and vLLM do: a Llama folder's BOS is added, a Qwen2 folder adds none), so the engine, ``llmopt
generate`` and ``/v1/completions`` see the same ids for the same text. Text that already holds them (a rendered chat
template) is encoded with ``add_special_tokens=False``. Token-id prompts are taken as they are.

Every check raises before anything is queued, naming the offending value, so bad input never disturbs other
requests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from lightning_llmopt.inference.sampling import SamplingParams

__all__ = ["ContextLengthError", "Prompt", "encode_prompt", "prepare_batch", "validate_prompt"]

Prompt = str | Sequence[int] | torch.Tensor


class ContextLengthError(ValueError):
    """A prompt that does not fit: ``prompt_tokens + max_tokens > max_model_len``. Its message names the Python
    API's remedy (``truncate=True``); another surface (the HTTP server) words its own from the numbers."""

    def __init__(self, message: str, prompt_tokens: int = 0, max_tokens: int = 0, max_model_len: int = 0) -> None:
        super().__init__(message)
        self.prompt_tokens, self.max_tokens, self.max_model_len = prompt_tokens, max_tokens, max_model_len

    @property
    def room(self) -> int:
        """How many prompt tokens fit beside ``max_tokens`` (what truncation would keep)."""
        return max(self.max_model_len - self.max_tokens, 0)


def encode_prompt(prompt: Prompt, tokenizer: Any, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a string (through ``tokenizer.encode(text, add_special_tokens=...)``: the tokenizer's BOS and
    the like, as transformers adds them, unless ``add_special_tokens=False``), a 1-D integer tensor or a sequence of
    ints (taken as they are)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a string prompt needs a tokenizer; pass token ids or LLMEngine(..., tokenizer=...)")
        return list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
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
                    max_model_len: int, add_special_tokens: bool = True) -> tuple[list[int], int]:
    """``(tokens, dropped)``: the prompt's ids (:func:`encode_prompt`), left-truncated by ``dropped`` tokens when
    ``truncate`` allows; a prompt too long without it raises :class:`ContextLengthError`."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    tokens = encode_prompt(prompt, tokenizer, add_special_tokens)
    if not tokens:
        raise ValueError("empty prompt: at least one token is needed")
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    params.check_vocab(vocab)
    dropped = 0
    if len(tokens) + params.max_tokens > max_model_len:
        keep = max_model_len - params.max_tokens
        sizes = (len(tokens), params.max_tokens, max_model_len)
        if keep < 1:
            raise ContextLengthError(
                f"max_tokens ({params.max_tokens}) leaves no room for a prompt in max_model_len ({max_model_len})",
                *sizes,
            )
        if not truncate:
            raise ContextLengthError(
                f"prompt ({len(tokens)} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len "
                f"({max_model_len}); shorten it or pass truncate=True (llmopt generate: --truncate) to keep its "
                f"last {keep} tokens",
                *sizes,
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
        except ContextLengthError as exc:
            sizes = (exc.prompt_tokens, exc.max_tokens, exc.max_model_len)
            raise ContextLengthError(f"prompt {i}: {exc}", *sizes) from None
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"prompt {i}: {exc}") from None
        batch.append((tokens, p, dropped))
    return batch
