"""AsyncEngine's hand-off to the event loop: events held back while the next step launches keep their order."""

from __future__ import annotations

import asyncio

import pytest
import torch

from lightning_llmopt.data.tokenizers import ByteTokenizer
from lightning_llmopt.inference import LLMEngine, SamplingParams
from lightning_llmopt.inference.serving.async_engine import AsyncEngine
from lightning_llmopt.models import Llama, LlamaConfig


def _engine() -> LLMEngine:
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_preset("tiny", init_std=0.1)).eval()
    return LLMEngine(model, ByteTokenizer(), num_blocks=256, block_size=8, max_num_seqs=8)


async def _read(handle) -> list:
    items = []
    while (item := await handle.queue.get()) is not None:
        items.append(item)
    return items


@pytest.mark.parametrize("delay", [None, 0.0, 0.03])
def test_delivery_keeps_tokens_and_order(delay):
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    expected = [c.outputs[0].token_ids for c in _engine().generate(prompts, params)]

    async def main() -> tuple[list, list]:
        core = AsyncEngine(_engine(), delivery_delay=delay)
        core.start(asyncio.get_running_loop())
        handles = [core.submit(p, params) for p in prompts]
        long = core.submit([1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
        got = await asyncio.gather(*(_read(h) for h in handles))
        long.cancel()  # while its events may still be held back: the abort must come after them
        tail = await _read(long)
        await core.shutdown(1.0)
        assert all(h.ended and h.completion is not None for h in [*handles, long])
        return got, tail

    got, tail = asyncio.run(main())
    for events, want in zip(got, expected, strict=True):
        assert [t for evs in events for ev in evs for t in ev.token_ids] == want
        assert [ev.finished for evs in events for ev in evs] == [False] * (len(want) - 1) + [True]
    flat = [ev for evs in tail for ev in evs]
    assert flat[-1].finish_reason == "abort" and not any(ev.finished for ev in flat[:-1])


def test_delivery_delay_must_not_be_negative():
    with pytest.raises(ValueError, match=r"delivery_delay \(-1\.0\)"):
        AsyncEngine(_engine(), delivery_delay=-1.0)
