"""Writes the chat fine-tuning sample of ``examples/configs/chat_cpu.yaml``: synthetic conversations (no download).

    python examples/data/make_chat_sample.py          # rewrites chat_sample.jsonl and chat_tokenizer/ beside it

``chat_sample.jsonl``: 200 short conversations, one per line, ``{"messages": [{"role", "content"}, ...]}`` (a few
with a system turn, a third with two exchanges) and some ``{"prompt", "completion"}`` lines. The tasks (add two
numbers, reverse or upper-case a word, count letters) are learnable by a ~1M-parameter model in minutes on a CPU.

``chat_tokenizer/``: the byte tokenizer (:class:`~lightning_llmopt.data.ByteTokenizer`, ids 0..255 bytes, 256
``<bos>``, 257 ``<eos>``) saved as a Hugging Face folder, plus a ``chat_template.jinja`` that writes each turn as
``<|role|>\\ncontent<eos>``; transformers' ``AutoTokenizer`` loads the folder and renders the same text.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from lightning_llmopt.data import ByteTokenizer

HERE = Path(__file__).resolve().parent
TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
WORDS = ["cat", "lamp", "river", "stone", "cloud", "apple", "tiger", "bread", "piano", "moon", "garden", "ticket"]


def exchange(rng: random.Random) -> tuple[str, str]:
    """One (user, assistant) pair of a random task."""
    task = rng.randrange(4)
    word = rng.choice(WORDS)
    if task == 0:
        a, b = rng.randrange(10, 50), rng.randrange(10, 50)
        return f"What is {a}+{b}?", f"{a}+{b}={a + b}."
    if task == 1:
        return f"Reverse the word {word}.", f"{word[::-1]}"
    if task == 2:
        return f"Upper-case {word}.", word.upper()
    return f"How many letters are in {word}?", f"{word} has {len(word)} letters."


def conversation(rng: random.Random) -> dict[str, object]:
    if rng.random() < 0.15:  # the instruction form TextDataModule(format="chat") accepts too
        prompt, completion = exchange(rng)
        return {"prompt": prompt, "completion": completion}
    messages = [{"role": "system", "content": "Answer briefly."}] if rng.random() < 0.2 else []
    for _ in range(2 if rng.random() < 0.33 else 1):
        user, assistant = exchange(rng)
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return {"messages": messages}


def main(n: int = 200, seed: int = 0) -> None:
    rng = random.Random(seed)
    lines = [json.dumps(conversation(rng)) for _ in range(n)]
    (HERE / "chat_sample.jsonl").write_text("\n".join(lines) + "\n")
    folder = HERE / "chat_tokenizer"
    ByteTokenizer().save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)


if __name__ == "__main__":
    main()
