"""``TextDataModule(format="chat")``: rows are transformers' ``apply_chat_template`` ids with the loss on exactly the
assistant spans of transformers' rendering; packing keeps every supervised (input, label) pair of the unpacked rows
and no label crosses a conversation; ``llmopt fit --data.format chat`` trains and writes a checkpoint."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from lightning_llmopt.data import ByteTokenizer, TextDataModule
from lightning_llmopt.data.instruct import encode_example

_spec = importlib.util.spec_from_file_location("_tok_fixtures", Path(__file__).with_name("test_tokenizers.py"))
assert _spec is not None and _spec.loader is not None
T = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("_tok_fixtures", T)
_spec.loader.exec_module(T)

REPO = Path(__file__).resolve().parents[2]
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
    {"messages": [{"role": "user", "content": "sum 17 and 4"}, {"role": "assistant", "content": "21"}]},
    {"prompt": "Once upon a time", "completion": "there was a tiny model"},
]
ROWS = [CHATS[i % len(CHATS)] for i in range(17)]  # 17: an odd number of conversations, some rows ragged


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _as_messages(example: dict) -> list[dict]:
    return example.get("messages") or [
        {"role": "user", "content": example["prompt"]},
        {"role": "assistant", "content": example["completion"]},
    ]


def _dm(path: Path, tokenizer: object, **kwargs: object) -> TextDataModule:
    args: dict = {"seq_len": 128, "batch_size": 2, "val_fraction": 0.2, "seed": 3, **kwargs}
    dm = TextDataModule(str(path), tokenizer=str(tokenizer), format="chat", **args)
    dm.setup("fit")
    return dm


def _rows(dm: TextDataModule) -> list[dict[str, torch.Tensor]]:
    return [ds[i] for ds in (dm.train_dataset, dm.val_dataset) for i in range(len(ds))]


@pytest.mark.parametrize("style", ["llama3", "qwen2"])
def test_chat_rows_supervise_exactly_the_assistant_spans_of_transformers(style: str, tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    folder = T.FOLDERS[style](tmp_path / style)
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    expected = {}  # rendered text -> (transformers' ids, text of the assistant spans)
    for example in CHATS:
        messages = _as_messages(example)
        full = ref.apply_chat_template(messages, tokenize=False)
        ids = ref.apply_chat_template(messages, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        spans = []
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                start = ref.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
                spans.append((len(start), len(ref.apply_chat_template(messages[: i + 1], tokenize=False))))
        expected[full] = (list(ids), "".join(full[a:b] for a, b in spans))

    dm = _dm(_jsonl(tmp_path / "chat.jsonl", ROWS), folder, packing=None)  # one conversation per row
    rows = _rows(dm)
    assert dm.num_documents == len(ROWS) == len(rows)
    seen = Counter()
    for row in rows:
        real = row["doc_ids"] == 0
        ids = row["input_ids"][real].tolist()
        text = ref.decode(ids)
        assert text in expected, text
        want_ids, want_trained = expected[text]
        assert ids == want_ids
        labels = row["labels"]
        trained = labels[labels != -100]
        # every supervised label is the next input token, and together they spell the assistant spans
        assert torch.equal(trained, row["input_ids"][1:][labels[:-1] != -100]) and labels[-1] == -100
        assert ref.decode(trained.tolist()) == want_trained
        assert "be brief" not in want_trained and "Once upon" not in want_trained and want_trained
        seen[text] += 1
    assert seen == Counter(ref.apply_chat_template(_as_messages(e), tokenize=False) for e in ROWS)


def test_packing_puts_several_conversations_per_row_without_loss_across_them(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    folder = T.FOLDERS["qwen2"](tmp_path / "q")
    path = _jsonl(tmp_path / "chat.jsonl", ROWS)
    single = _dm(path, folder, packing=None)
    packed = _dm(path, folder, packing="ffd")
    assert (
        packed.padding_stats is not None and packed.padding_stats["waste_after"] < packed.padding_stats["waste_before"]
    )

    def pairs(dm: TextDataModule) -> tuple[Counter, Counter]:
        out = []
        for ds in (dm.train_dataset, dm.val_dataset):
            rows = [ds[i] for i in range(len(ds))]
            ids = torch.stack([r["input_ids"] for r in rows])
            labels = torch.stack([r["labels"] for r in rows])
            keep = labels != -100
            out.append(Counter(zip(ids[keep].tolist(), labels[keep].tolist(), strict=True)))
        return out[0], out[1]

    assert pairs(packed) == pairs(single)  # same split (by conversation), same supervised pairs
    assert sum(pairs(packed)[0].values()) == packed.train_dataset.num_target_tokens  # type: ignore[union-attr]
    assert len(packed.train_dataset) < len(single.train_dataset)
    several = 0
    for row in _rows(packed):
        ids, labels, pos, doc = row["input_ids"], row["labels"], row["positions"], row["doc_ids"]
        n_docs = int(doc.max())  # the padding has id n_docs
        several += n_docs >= 2
        for k in range(n_docs):
            at = (doc == k).nonzero().flatten()
            assert torch.equal(pos[at], torch.arange(at.numel()))  # positions restart per conversation
            assert labels[at[-1]] == -100  # the last token of a conversation predicts nothing
        crossing = (labels[:-1] != -100) & (doc[:-1] != doc[1:])
        assert not crossing.any() and torch.equal(labels[:-1][labels[:-1] != -100], ids[1:][labels[:-1] != -100])
    assert several > 0

    batch = next(iter(packed.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "positions", "doc_ids"} and batch["input_ids"].shape == (2, 128)


def test_prompt_completion_rows_with_the_byte_tokenizer_match_encode_example(tmp_path: Path) -> None:
    rows = [{"prompt": f"{a}+{a}=", "completion": str(2 * a)} for a in range(10, 30)]
    dm = _dm(_jsonl(tmp_path / "sums.jsonl", rows), "byte", packing=None, seq_len=16)
    byte = ByteTokenizer()
    want = {}
    for r in rows:
        ids, target = encode_example(r, byte)
        want[tuple(ids)] = [ids[t + 1] if target[t + 1] else -100 for t in range(len(ids) - 1)] + [-100]
    for row in _rows(dm):
        real = row["doc_ids"] == 0
        assert row["labels"][real].tolist() == want[tuple(row["input_ids"][real].tolist())]
        assert (row["labels"][~real] == -100).all()


def test_chat_format_errors(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "chat.jsonl", CHATS)
    with pytest.raises(ValueError, match=r"format \('chats'\) must be one of \('text', 'chat'\)"):
        TextDataModule(str(path), format="chats")
    with pytest.raises(ValueError, match="format='chat' needs data_path"):
        TextDataModule(format="chat")
    with pytest.raises(ValueError, match="ByteTokenizer has no chat template, needed for 'messages' examples"):
        TextDataModule(str(path), format="chat").setup("fit")
    one = _jsonl(tmp_path / "one.jsonl", CHATS[3:])
    with pytest.raises(ValueError, match="gives 1 document.*format=chat splits train and validation"):
        TextDataModule(str(one), format="chat").setup("fit")
    assert TextDataModule(str(tmp_path)).format == "text"  # the default is unchanged


@pytest.mark.slow
def test_llmopt_fit_chat_config_trains_and_writes_a_checkpoint(tmp_path: Path, monkeypatch, capsys) -> None:
    from lightning_llmopt.cli.main import main

    monkeypatch.chdir(tmp_path)  # the config's run folders are relative to the working directory
    data = REPO / "examples" / "data"
    args = [
        "fit",
        "--config",
        str(REPO / "examples" / "configs" / "chat_cpu.yaml"),
        "--wandb=false",
        f"--data.data_path={data / 'chat_sample.jsonl'}",
        f"--data.tokenizer={data / 'chat_tokenizer'}",
        "--data.format=chat",
        "--trainer.max_steps=4",
        "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=1",
        "--model.warmup_steps=1",
    ]
    try:
        main(args)
    except SystemExit as exc:
        assert exc.code in (0, None), capsys.readouterr().err[-3000:]
    out = capsys.readouterr().out
    assert "final validation loss:" in out
    ckpt = tmp_path / "runs" / "chat_cpu" / "checkpoints" / "last.ckpt"
    assert ckpt.is_file()
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert state["global_step"] == 4 and state["datamodule_hyper_parameters"]["format"] == "chat"
