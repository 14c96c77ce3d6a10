"""Plain greedy decoding with a contiguous KV cache: the reference the inference engine is checked against."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_llmopt.models.kv_cache import StaticKVCache
from lightning_llmopt.models.llama import Llama


@torch.no_grad()
def greedy_generate(model: Llama, prompt: Tensor, max_new_tokens: int, eos_id: int | None = None,
                    use_cache: bool = True) -> Tensor:
    """Greedy continuation of equal-length prompts.

    Arguments:
        model: the decoder (eval mode is the caller's business).
        prompt: ``(B, T)`` int64 token ids.
        max_new_tokens: number of tokens to append.
        eos_id: once a row emits it, the row keeps emitting it.
        use_cache: decode with a :class:`StaticKVCache` (True) or by re-running the whole sequence (False).

    Returns: ``(B, T + max_new_tokens)`` int64.
    """
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt must be (B, T) with T >= 1, got shape {tuple(prompt.shape)}")
    total = prompt.shape[1] + max_new_tokens
    if total > model.config.max_seq_len:
        raise ValueError(f"prompt + max_new_tokens ({total}) exceeds max_seq_len ({model.config.max_seq_len})")
    B, T = prompt.shape
    seq = prompt
    done = torch.zeros(B, dtype=torch.bool, device=prompt.device)
    cache = StaticKVCache.for_model(model, B, total) if use_cache else None
    logits = model(prompt, kv_cache=cache) if cache is not None else model(prompt)
    for step in range(max_new_tokens):
        nxt = logits[:, -1].argmax(-1)
        if eos_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
            done |= nxt == eos_id
        seq = torch.cat([seq, nxt[:, None]], dim=1)
        if step == max_new_tokens - 1:
            break
        if cache is not None:
            pos = torch.full((B, 1), seq.shape[1] - 1, dtype=torch.long, device=seq.device)
            logits = model(nxt[:, None], positions=pos, kv_cache=cache)
        else:
            logits = model(seq)
    return seq
