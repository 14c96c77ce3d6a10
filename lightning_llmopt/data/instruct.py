"""Instruction-tuning data: chat or prompt/completion examples, rendered with the tokenizer's chat template, the loss
masked to the assistant turns, packed into fixed-length rows with :mod:`~lightning_llmopt.data.packing`.

Input: JSONL, one example per line, either ``{"messages": [{"role": "system"|"user"|"assistant", "content": ...},
...]}`` or ``{"prompt": ..., "completion": ...}`` (a user turn and an assistant turn when the tokenizer has a chat
template; else the prompt with the tokenizer's special tokens, then the completion and the end-of-sequence token).

Masking: the example is rendered once (``full``); for the ``i``-th message, when it is an assistant turn, its span is
``[len(render(messages[:i], add_generation_prompt=True)), len(render(messages[:i + 1])))`` of ``full``: the answer
and the template's end of turn (``<|eot_id|>``, ``<|im_end|>``, ``</s>``), so the model learns to stop. The text is
encoded span by span and concatenated, so the token boundaries fall on the span boundaries (templates put special
tokens there, where the tokenization of the whole text splits too). Labels are the next token where that token is
in an assistant span, ``-100`` elsewhere.

Torch and the tokenizer only (no Lightning); :class:`InstructionDataset` is a map-style dataset of packed rows
(``input_ids``, ``labels``, ``positions``, ``doc_ids``: ``(T,)`` int64 each) for any ``DataLoader``.
:func:`encode_documents` and :class:`MaskedPackedDataset` are the same data as a document stream, for the ``chat``
format of :class:`~lightning_llmopt.data.datamodule.TextDataModule` (split by document, streaming packer).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_llmopt.data.packed import PackedDataset, TokenizedDocuments
from lightning_llmopt.data.packing import IGNORE_INDEX, Piece, StreamingPacker, build_row, pack, pack_rows, row_pieces

__all__ = [
    "InstructionDataset",
    "MaskedPackedDataset",
    "encode_documents",
    "encode_example",
    "pack_masked",
    "read_examples",
    "read_jsonl",
]


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The examples of a JSONL file (blank lines skipped); a bad line is named by its number."""
    examples = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if line.strip():
            try:
                examples.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number} is not valid JSON ({exc.msg})") from None
    return examples


def read_examples(path: str | Path) -> list[dict[str, Any]]:
    """The examples of a ``.jsonl`` file, or of every ``*.jsonl`` file of a directory (sorted by path)."""
    path = Path(path).expanduser()
    files = sorted(path.rglob("*.jsonl")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"directory {str(path)!r} holds no .jsonl file")
    return [example for file in files for example in read_jsonl(file)]


def _messages(example: dict[str, Any]) -> list[dict[str, Any]] | None:
    if "messages" in example:
        messages = example["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError(f"'messages' must be a list of {{'role', 'content'}} objects, got {messages!r:.200}")
        return messages
    if "prompt" in example and "completion" in example:
        return None
    raise ValueError(f"an example needs 'messages' or 'prompt' and 'completion'; got keys {sorted(example)}")


def _chat_spans(messages: list[dict[str, Any]], tokenizer: Any) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns."""
    full = str(tokenizer.apply_chat_template(messages))
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = str(tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True)) if i else ""
        end = str(tokenizer.apply_chat_template(messages[: i + 1]))
        if not (full.startswith(start) and full.startswith(end) and len(start) <= len(end)):
            raise ValueError(
                "the chat template does not render a conversation's prefix as a prefix of it; "
                "assistant turns cannot be located"
            )
        spans.append((len(start), len(end)))
    return full, spans


def encode_example(example: dict[str, Any], tokenizer: Any) -> tuple[list[int], list[int]]:
    """``(ids, target)`` of one example: token ids and, per token, 1 where the loss applies (assistant turns or the
    completion), 0 elsewhere. ``tokenizer`` needs ``encode`` and, for chat, ``apply_chat_template``."""
    messages = _messages(example)
    if messages is None and getattr(tokenizer, "chat_template", None) is None:
        prompt = tokenizer.encode(str(example["prompt"]), add_special_tokens=True)
        completion = tokenizer.encode(str(example["completion"]))
        eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
        return prompt + completion + eos, [0] * len(prompt) + [1] * (len(completion) + len(eos))
    if messages is None:
        messages = [
            {"role": "user", "content": str(example["prompt"])},
            {"role": "assistant", "content": str(example["completion"])},
        ]
    full, spans = _chat_spans(messages, tokenizer)
    ids: list[int] = []
    target: list[int] = []
    at = 0
    for start, end in [*spans, (len(full), len(full))]:
        for text, flag in ((full[at:start], 0), (full[start:end], 1)):
            if text:
                piece = tokenizer.encode(text)
                ids += piece
                target += [flag] * len(piece)
        at = end
    return ids, target


class InstructionDataset(Dataset):
    """Packed rows of instruction examples (module docstring).

    Arguments:
        examples: a JSONL path or the examples themselves.
        tokenizer: an :class:`~lightning_llmopt.data.HFTokenizer` (chat template) or any tokenizer with
            ``encode``/``eos_id`` (prompt/completion only).
        seq_len: row length ``T``; longer examples are split over rows as :mod:`~lightning_llmopt.data.packing`
            does.
        packed: several examples per row (``algorithm``: ``"ffd"`` or ``"best_fit"``); ``False``: one per row.
        pad_id: padding input id (default: the tokenizer's ``pad_id``, else its ``eos_id``, else 0).
    """

    def __init__(
        self,
        examples: str | Path | Sequence[dict[str, Any]],
        tokenizer: Any,
        seq_len: int,
        packed: bool = True,
        algorithm: str = "ffd",
        pad_id: int | None = None,
    ) -> None:
        if seq_len <= 1:
            raise ValueError(f"seq_len ({seq_len}) must be > 1")
        items = read_jsonl(examples) if isinstance(examples, (str, Path)) else list(examples)
        if not items:
            raise ValueError("no instruction examples")
        encoded = [encode_example(e, tokenizer) for e in items]
        ids = [torch.tensor(i, dtype=torch.int64) for i, _ in encoded]
        targets = [torch.tensor(t, dtype=torch.int64) for _, t in encoded]
        lengths = [len(i) for i in ids]
        if packed:
            rows = pack(lengths, seq_len, algorithm)
        else:  # one example per row (a longer one over ceil(n / T) rows)
            rows = [[doc] for doc, n in enumerate(lengths) for _ in range(-(-n // seq_len))]
        if pad_id is None:
            pad_id = next((i for i in (getattr(tokenizer, "pad_id", None), tokenizer.eos_id) if i is not None), 0)
        batch = pack_rows(ids, rows, seq_len, pad_id)
        flags = pack_rows(targets, rows, seq_len)  # its labels: whether each label is an assistant token
        batch["labels"] = torch.where(flags["labels"] == 1, batch["labels"], IGNORE_INDEX)
        self.rows: dict[str, Tensor] = batch
        self.num_examples = len(items)
        self.num_target_tokens = int(sum(int(t[1:].sum()) for t in targets))

    def __len__(self) -> int:
        return int(self.rows["input_ids"].shape[0])

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {k: v[i] for k, v in self.rows.items()}


def encode_documents(
    examples: Sequence[dict[str, Any]], tokenizer: Any
) -> tuple[TokenizedDocuments, TokenizedDocuments]:
    """Every example encoded by :func:`encode_example` as one document of a stream: ``(docs, targets)``, where
    ``targets.tokens`` is ``(N,)`` int64, 1 where ``docs.tokens`` is an assistant (completion) token, 0 elsewhere;
    both have the same ``lengths``. No eos is appended: the template's end of turn (or the completion's eos) ends a
    document."""
    if getattr(tokenizer, "chat_template", None) is None and any("messages" in e for e in examples):
        raise ValueError(
            f"{type(tokenizer).__name__} has no chat template, needed for 'messages' examples: use a tokenizer folder "
            "with one (tokenizer_config.json 'chat_template' or chat_template.jinja), or prompt/completion examples"
        )
    encoded = [encode_example(e, tokenizer) for e in examples]
    lengths = torch.tensor([len(ids) for ids, _ in encoded], dtype=torch.int64)
    empty = [i for i, n in enumerate(lengths.tolist()) if n == 0]
    if empty:
        raise ValueError(f"examples {empty[:10]} encode to no tokens")
    ids = torch.tensor([i for e, _ in encoded for i in e], dtype=torch.int64)
    flags = torch.tensor([t for _, e in encoded for t in e], dtype=torch.int64)
    return TokenizedDocuments(ids, lengths), TokenizedDocuments(flags, lengths.clone())


class MaskedPackedDataset(PackedDataset):
    """A :class:`~lightning_llmopt.data.packed.PackedDataset` whose labels are ``-100`` except where the label token
    is a target (an assistant token): rows are built as for text, then masked by the same row of ``targets``.

    Arguments:
        docs: the documents of this split (from :func:`encode_documents`).
        targets: their target flags, same ``lengths``.
        rows, seq_len, pad_id: as for :class:`~lightning_llmopt.data.packed.PackedDataset`.
    """

    def __init__(
        self,
        docs: TokenizedDocuments,
        targets: TokenizedDocuments,
        rows: list[list[Piece]],
        seq_len: int,
        pad_id: int = 0,
    ) -> None:
        if not torch.equal(docs.lengths, targets.lengths):
            raise ValueError("docs and targets must have the same document lengths")
        super().__init__(docs, rows, seq_len, pad_id)
        self.targets = targets

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        row = super().__getitem__(index)
        flags = build_row(self.targets.tokens, self._offsets, self.rows[index], self.seq_len)["labels"]  # (T,)
        row["labels"] = torch.where(flags == 1, row["labels"], IGNORE_INDEX)
        return row

    @property
    def num_target_tokens(self) -> int:
        """Labels that carry loss over the whole split (a document's first token is never a label)."""
        firsts = self.targets.tokens[self.targets.offsets]
        return int(self.targets.tokens.sum() - firsts.sum())


def pack_masked(
    docs: TokenizedDocuments,
    targets: TokenizedDocuments,
    seq_len: int,
    algorithm: str | None,
    buffer_size: int = 1024,
    pad_id: int = 0,
) -> MaskedPackedDataset:
    """Rows of ``seq_len`` tokens: packed in stream order by a
    :class:`~lightning_llmopt.data.packing.StreamingPacker` (``algorithm`` ``"ffd"`` or ``"best_fit"``), or one
    document per row (``None``; a longer one over ``ceil(n / seq_len)`` rows)."""
    lengths = docs.lengths.tolist()
    if algorithm is None:
        rows = row_pieces([[d] for d, n in enumerate(lengths) for _ in range(-(-n // seq_len))], lengths, seq_len)
    else:
        rows = list(StreamingPacker(seq_len, buffer_size, algorithm).pack_lengths(lengths))
    return MaskedPackedDataset(docs, targets, rows, seq_len, pad_id)
