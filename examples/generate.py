"""Serve a model with the inference engine: batch generation, streaming, parallel sampling, prefix caching, int8 KV.

    python examples/generate.py                       # a randomly initialised "tiny" model on CPU (no download)
    python examples/generate.py --model runs/ckpts    # our checkpoint folder, a Lightning .ckpt or an HF folder

Public API only (``lightning_llmopt.inference``); see docs/inference.md.
"""

from __future__ import annotations

import argparse

import torch

from lightning_llmopt.data.tokenizers import ByteTokenizer
from lightning_llmopt.inference import LLMEngine, SamplingParams
from lightning_llmopt.models import Llama, LlamaConfig


def build_engine(model_path: str | None, **engine_kwargs: object) -> LLMEngine:
    if model_path is not None:
        return LLMEngine.from_pretrained(model_path, **engine_kwargs)
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_preset("tiny", vocab_size=ByteTokenizer().vocab_size))
    return LLMEngine(model, ByteTokenizer(), **engine_kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint path (default: a random tiny model)")
    args = parser.parse_args()
    engine = build_engine(args.model, num_blocks=256, block_size=16)

    # 1. Batch generation: every prompt is validated first, results come back in prompt order.
    system = "You are a terse assistant. "
    prompts = [system + "Name a colour.", system + "Name a fruit.", system + "Name a planet."]
    for out in engine.generate(prompts, SamplingParams(max_tokens=16)):
        print(
            f"{out.request_id}: {out.text!r} ({out.outputs[0].finish_reason}, {out.metrics.cached_tokens} prompt "
            "tokens from the prefix cache)"
        )

    # 2. Streaming with sampling: tokens arrive step by step; a seed makes the request reproducible.
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=1)
    for event in engine.stream([system + "Tell a story."], params):
        print(event.text, end="" if not event.finished else f"\n[{event.finish_reason}]\n", flush=True)

    # 3. Parallel sampling: four continuations share the prompt's KV blocks (copied only when written).
    four = engine.generate([system + "Say hi."], SamplingParams(max_tokens=8, temperature=1.0, seed=2, n=4))[0]
    print([o.text for o in four.outputs])

    # 4. A pinned system prompt is never evicted from the prefix cache.
    engine.pin_prefix(system)

    # 5. Bad input is rejected with a clear error and nothing is queued.
    try:
        engine.generate([""], SamplingParams(max_tokens=4))
    except ValueError as err:
        print(f"rejected: {err}")

    # 6. An int8 KV cache needs calibrated per-head scales (it refuses to run without them).
    int8 = LLMEngine(engine.model, engine.tokenizer, kv_dtype="int8", num_blocks=256, block_size=16)
    int8.calibrate_kv(prompts)
    print("int8:", int8.generate(prompts[:1], SamplingParams(max_tokens=16))[0].text)

    # 7. Greedy decoding runs up to 8 steps per host round trip on a GPU with CUDA graphs (same tokens);
    #    decode_steps=1 returns to one step a round trip, e.g. to stream every token as soon as it exists.
    single = LLMEngine(engine.model, engine.tokenizer, num_blocks=256, block_size=16, decode_steps=1)
    print("1 step a round trip:", single.generate(prompts[:1], SamplingParams(max_tokens=16))[0].text)

    print(engine.stats.summary())  # hit tokens, time to first token and throughput, together


if __name__ == "__main__":
    main()
