"""Shared helpers of the inference tests: tiny random models and the naive full-recompute oracle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from lightning_llmopt.models import Llama, LlamaConfig, greedy_generate

# A larger init than the usual 0.02 makes attention peaky, so a wrong key/value (wrong block, slot or position)
# moves the logits by O(1) and changes the greedy tokens instead of hiding in near-uniform attention.
INIT_STD = 0.1


def make_model(seed: int = 0, **overrides: Any) -> Llama:
    torch.manual_seed(seed)
    values = dict(init_std=INIT_STD)
    values.update(overrides)
    return Llama(LlamaConfig.from_preset("tiny", **values)).eval()


def full_recompute(model: Llama, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by re-running the whole sequence every step (no cache at all)."""
    out = greedy_generate(model, torch.tensor([prompt], device=next(model.parameters()).device), n, use_cache=False)
    return out[0, len(prompt) :].tolist()


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture
def model_factory() -> Callable[..., Llama]:
    return make_model


@pytest.fixture
def reference() -> Callable[[Llama, list[int], int], list[int]]:
    return full_recompute


@pytest.fixture
def prompts_factory() -> Callable[[list[int], int, int], list[list[int]]]:
    return random_prompts


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: intra-op threads only add synchronisation (100x slower per op on a loaded 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
