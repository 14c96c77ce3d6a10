"""Instruction data: the token ids of a rendered conversation equal transformers' ``apply_chat_template`` ids, the
loss covers exactly the assistant turns (the spans transformers' rendering gives them), packing keeps every
(input, label) pair of the unpacked rows, and a prompt/completion file without a template."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from lightning_llmopt.data import ByteTokenizer, load_tokenizer
from lightning_llmopt.data.instruct import InstructionDataset, encode_example, read_jsonl

_spec = importlib.util.spec_from_file_location("_tok_fixtures", Path(__file__).with_name("test_tokenizers.py"))
assert _spec is not None and _spec.loader is not None
T = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("_tok_fixtures", T)
_spec.loader.exec_module(T)

CHATS = [
    {"messages": [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "the cat sat"}]},
    {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "def f(x):"},
            {"role": "assistant", "content": "return x * 2"},
            {"role": "user", "content": "héllo"},
            {"role": "assistant", "content": "wörld!"},
        ]
    },
    {"prompt": "Once upon a time", "completion": "there was a tiny model"},
]


def _reference_spans(ref, messages):
    """Assistant spans from transformers' own rendering of each prefix."""
    full = ref.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start = ref.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
            spans.append((len(start), len(ref.apply_chat_template(messages[: i + 1], tokenize=False))))
    return full, spans


@pytest.mark.parametrize("style", ["llama3", "qwen2"])
def test_chat_ids_and_assistant_mask_match_transformers(style: str, tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    folder = T.FOLDERS[style](tmp_path / style)
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    tok = load_tokenizer(folder)
    for example in CHATS:
        messages = example.get("messages") or [
            {"role": "user", "content": example["prompt"]},
            {"role": "assistant", "content": example["completion"]},
        ]
        ids, target = encode_example(example, tok)
        want = ref.apply_chat_template(messages, tokenize=True)
        assert ids == (want["input_ids"] if hasattr(want, "keys") else want)
        full, spans = _reference_spans(ref, messages)
        trained = ref.decode([i for i, t in zip(ids, target, strict=True) if t])
        assert trained == "".join(full[a:b] for a, b in spans)
        assert "be brief" not in trained and "def f" not in trained and "Once upon" not in trained


def test_packing_keeps_every_supervised_pair(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    tok = load_tokenizer(T.FOLDERS["qwen2"](tmp_path / "q"))
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in CHATS * 3) + "\n\n")
    packed = InstructionDataset(path, tok, seq_len=64)
    single = InstructionDataset(read_jsonl(path), tok, seq_len=64, packed=False)
    lengths = [len(encode_example(e, tok)[0]) for e in CHATS * 3]
    assert len(single) == sum(-(-n // 64) for n in lengths) and len(packed) < len(single)  # longer ones split
    assert packed.num_target_tokens == single.num_target_tokens

    def pairs(ds: InstructionDataset) -> Counter:
        rows = ds.rows
        keep = rows["labels"] != -100
        return Counter(zip(rows["input_ids"][keep].tolist(), rows["labels"][keep].tolist(), strict=True))

    assert pairs(packed) == pairs(single) and sum(pairs(packed).values()) == packed.num_target_tokens
    row = packed[0]
    assert set(row) == {"input_ids", "labels", "positions", "doc_ids"} and row["input_ids"].shape == (64,)
    assert row["labels"].shape == row["positions"].shape == row["doc_ids"].shape == (64,)


def test_prompt_completion_without_template_and_errors(tmp_path: Path) -> None:
    byte = ByteTokenizer()
    ids, target = encode_example({"prompt": "ab", "completion": "cd"}, byte)
    assert ids == [97, 98, 99, 100, byte.eos_id] and target == [0, 0, 1, 1, 1]
    ds = InstructionDataset([{"prompt": "ab", "completion": "cd"}], byte, seq_len=8)
    # labels: c after b, d after c, eos after d; nothing for the prompt or the padding
    assert ds[0]["labels"].tolist() == [-100, 99, 100, byte.eos_id, -100, -100, -100, -100]
    with pytest.raises(ValueError, match=r"needs 'messages' or 'prompt' and 'completion'; got keys \['text'\]"):
        encode_example({"text": "x"}, byte)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2 is not valid JSON"):
        read_jsonl(bad)
    with pytest.raises(AttributeError):  # a chat example needs a tokenizer with a chat template
        encode_example(CHATS[0], byte)
