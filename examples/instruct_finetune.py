"""Instruction tuning: JSONL examples, loss on the assistant turns only, packed rows, a plain Lightning Trainer.

Without arguments it writes a small prompt/completion file (two-digit additions) and trains the ``debug-1m`` preset
with the byte tokenizer for a few hundred steps on the CPU (about a minute on 2 cores), then prints the loss on the
completion tokens before and after, and greedy answers to held-out prompts through ``LLMEngine``::

    python examples/instruct_finetune.py
    python examples/instruct_finetune.py --data chat.jsonl --pretrained hub/qwen2.5-0.5b-instruct --steps 1000

With ``--pretrained`` the model starts from that Hugging Face folder and its tokenizer renders each example with the
folder's chat template (``{"messages": [...]}`` lines, or ``{"prompt", "completion"}`` turned into a user and an
assistant turn). See docs/hf_interop.md, "Instruction tuning data".
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_llmopt import CausalLMModule
from lightning_llmopt.data import ByteTokenizer, InstructionDataset, load_tokenizer
from lightning_llmopt.inference import LLMEngine, SamplingParams


def addition_examples(n: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    pairs = [(rng.randrange(10, 50), rng.randrange(10, 50)) for _ in range(n)]
    return [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a, b in pairs]


def completion_loss(module: CausalLMModule, rows: dict[str, torch.Tensor]) -> float:
    """Mean cross-entropy over the supervised (completion) tokens of every row."""
    assert module.model is not None
    module.model.eval()
    with torch.no_grad():
        logits = module.model(rows["input_ids"], positions=rows["positions"], doc_ids=rows["doc_ids"])
    module.model.train()
    return float(module.loss_fn(logits, rows["labels"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=None, help="JSONL of messages or prompt/completion (default: generated sums)")
    p.add_argument("--pretrained", default=None, help="Hugging Face folder: weights, config and tokenizer")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args()
    torch.manual_seed(0)

    workdir = Path(tempfile.mkdtemp(prefix="instruct-"))
    if args.data is None:
        args.data = workdir / "sums.jsonl"
        args.data.write_text("".join(json.dumps(e) + "\n" for e in addition_examples(2000, seed=0)))
    tokenizer = load_tokenizer(args.pretrained) if args.pretrained else ByteTokenizer()
    train = InstructionDataset(args.data, tokenizer, seq_len=args.seq_len)  # packed rows, loss on completions only
    held_out = addition_examples(8, seed=1)
    print(f"{train.num_examples} examples in {len(train)} packed rows of {args.seq_len} tokens, "
          f"{train.num_target_tokens} supervised tokens")

    module = (CausalLMModule(pretrained=args.pretrained, learning_rate=1e-4, warmup_steps=20) if args.pretrained
              else CausalLMModule("debug-1m", learning_rate=3e-3, warmup_steps=30, max_steps=args.steps))
    module.configure_model()
    probe = InstructionDataset(held_out, tokenizer, seq_len=args.seq_len).rows
    print(f"completion loss before: {completion_loss(module, probe):.3f}")
    trainer = L.Trainer(max_steps=args.steps, accelerator="auto", devices=1, logger=False, enable_checkpointing=False,
                        default_root_dir=workdir)
    trainer.fit(module, DataLoader(train, batch_size=args.batch_size, shuffle=True))
    print(f"completion loss after:  {completion_loss(module, probe):.3f}")

    engine = LLMEngine(module.model.eval(), tokenizer=tokenizer, max_model_len=args.seq_len)
    chat = getattr(tokenizer, "chat_template", None) is not None  # the rows were rendered with it: so is the prompt
    for example in held_out[:4]:
        prompt = example["prompt"]
        if chat:  # the template writes the special tokens itself: none added on top
            text = str(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True))
            answer = engine.generate([text], SamplingParams(max_tokens=4), add_special_tokens=False)[0].text
        else:  # encoded as the training rows' prompts were: with the tokenizer's special tokens (its BOS)
            answer = engine.generate([prompt], SamplingParams(max_tokens=4))[0].text
        print(f"{prompt!r} -> {answer!r} (expected {example['completion']!r})")


if __name__ == "__main__":
    main()
