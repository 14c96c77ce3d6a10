import json
import math
import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_llmopt.data import (
    ByteTokenizer,
    ResumableDataLoader,
    ResumableShardedSampler,
    TextDataModule,
    default_corpus_files,
    read_documents,
)

SEQ_LEN = 16
BATCH = 8


def _write_corpus(root: Path, num_docs: int = 6, words_per_doc: int = 80) -> Path:
    rng = random.Random(0)
    vocab = ["alpha", "beta", "gamma", "delta", "épsilon", "zeta", "ηta", "theta", "\n"]
    root.mkdir(parents=True, exist_ok=True)
    for i in range(num_docs):
        (root / f"doc{i}.txt").write_text(" ".join(rng.choice(vocab) for _ in range(words_per_doc)), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_corpus(tmp_path_factory.mktemp("corpus"))


def _dm(corpus: Path, **kwargs: object) -> TextDataModule:
    args: dict = {"seq_len": SEQ_LEN, "batch_size": BATCH, "val_fraction": 0.1, "seed": 7, **kwargs}
    return TextDataModule(str(corpus), **args)


# ---------------------------------------------------------------- chunks, split, baseline


def test_chunks_are_the_tokenized_corpus(corpus: Path) -> None:
    dm = _dm(corpus)
    dm.setup("fit")
    tok = ByteTokenizer()
    expected: list[int] = []
    for path in sorted(corpus.glob("*.txt")):
        expected += [*tok.encode(path.read_text(encoding="utf-8")), tok.eos_id]
    assert dm.num_tokens == len(expected) and dm.num_documents == 6
    num_chunks = len(expected) // (SEQ_LEN + 1)
    all_chunks = {tuple(expected[i * (SEQ_LEN + 1) : (i + 1) * (SEQ_LEN + 1)]) for i in range(num_chunks)}
    train = {tuple(c.tolist()) for c in dm.train_dataset.chunks}
    val = {tuple(c.tolist()) for c in dm.val_dataset.chunks}
    assert len(dm.train_dataset) + len(dm.val_dataset) == num_chunks
    assert len(dm.val_dataset) == round(0.1 * num_chunks)
    assert train | val == all_chunks
    item = dm.train_dataset[0]
    assert torch.equal(item["input_ids"][1:], item["labels"][:-1])
    assert item["input_ids"].dtype == torch.int64 and item["input_ids"].shape == (SEQ_LEN,)


def test_split_is_deterministic_and_disjoint(corpus: Path) -> None:
    a, b = _dm(corpus), _dm(corpus)
    a.setup("fit")
    b.setup("fit")
    assert torch.equal(a.train_dataset.chunks, b.train_dataset.chunks)
    assert torch.equal(a.val_dataset.chunks, b.val_dataset.chunks)
    c = _dm(corpus, seed=8)
    c.setup("fit")
    assert not torch.equal(a.val_dataset.chunks, c.val_dataset.chunks)


def test_train_and_val_chunk_positions_do_not_overlap() -> None:
    from lightning_llmopt.data.chunks import split_chunk_indices

    train, val = split_chunk_indices(101, 0.2, seed=3)
    assert set(train.tolist()).isdisjoint(val.tolist())
    assert sorted(train.tolist() + val.tolist()) == list(range(101))
    assert len(val) == 20


def test_batches_have_documented_shapes(corpus: Path) -> None:
    dm = _dm(corpus)
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape == batch["labels"].shape == (BATCH, SEQ_LEN)
    assert batch["labels"].dtype == torch.int64
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])


def test_unigram_entropy_matches_direct_computation(corpus: Path) -> None:
    dm = _dm(corpus)
    dm.setup("fit")
    counts = Counter(dm.train_dataset.chunks[:, 1:].reshape(-1).tolist())
    n = sum(counts.values())
    val = dm.val_dataset.chunks[:, 1:].reshape(-1).tolist()
    direct = -sum(math.log((counts[t] + 1) / (n + dm.vocab_size)) for t in val) / len(val)
    assert dm.unigram_entropy() == pytest.approx(direct, rel=1e-9)
    assert 0 < dm.unigram_entropy() < math.log(dm.vocab_size)


def test_hf_tokenizer_stream_has_eos_after_each_document(corpus: Path, tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    hf = tokenizers.Tokenizer(models.WordLevel(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    docs = list(read_documents(corpus))
    hf.train_from_iterator(docs, trainer=trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"]))
    hf.save(str(tmp_path / "tokenizer.json"))
    dm = _dm(corpus, tokenizer=str(tmp_path), seq_len=4, batch_size=2)
    assert dm.vocab_size == hf.get_vocab_size() and dm.tokenizer.eos_id == hf.token_to_id("</s>")
    dm.setup("fit")
    expected = [t for doc in docs for t in [*hf.encode(doc).ids, hf.token_to_id("</s>")]]
    assert dm.num_tokens == len(expected)
    chunks = Counter(tuple(c) for c in torch.cat([dm.train_dataset.chunks, dm.val_dataset.chunks]).tolist())
    assert chunks == Counter(tuple(expected[i : i + 5]) for i in range(0, len(expected) - 4, 5))


def test_datamodule_state_warns_on_changed_order_settings(corpus: Path) -> None:
    dm = _dm(corpus)
    dm.load_state_dict(dm.state_dict())  # same settings: silent
    with pytest.warns(UserWarning, match=r"seed: 1 -> 7"):
        dm.load_state_dict({**dm.state_dict(), "seed": 1})


# ---------------------------------------------------------------- corpus and documents


def test_default_corpus_is_deterministic_and_skips_tests() -> None:
    files = default_corpus_files(200_000)
    assert files and files == default_corpus_files(200_000)
    assert all(f.suffix == ".py" for f in files)
    assert not any({"test", "tests", "site-packages", "idlelib"} & set(f.parts) for f in files)
    sizes = [f.stat().st_size for f in files]
    assert sum(sizes[:-1]) < 200_000 <= sum(sizes) or len(files) == len(default_corpus_files(None))
    assert default_corpus_files(None)[: len(files)] == files


def test_read_documents_formats(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("first", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("second", encoding="utf-8")
    rows = [{"body": "third"}, {"body": "  "}, {"body": "fourth"}]
    (tmp_path / "sub" / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    (tmp_path / "ignored.bin").write_bytes(b"\x00\x01")
    assert list(read_documents(tmp_path, jsonl_key="body")) == ["first", "second", "third", "fourth"]
    with pytest.raises(ValueError, match=r"c\.jsonl.*line 1.*'text'"):
        list(read_documents(tmp_path / "sub" / "c.jsonl"))


def test_read_documents_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing_dir"):
        read_documents(tmp_path / "missing_dir")
    (tmp_path / "empty.txt").write_text("   \n", encoding="utf-8")
    with pytest.raises(ValueError, match="empty.txt.*no non-empty documents"):
        list(read_documents(tmp_path / "empty.txt"))
    (tmp_path / "x.csv").write_text("a,b", encoding="utf-8")
    with pytest.raises(ValueError, match=r"x\.csv.*'\.csv'"):
        read_documents(tmp_path / "x.csv")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seq_len": 0}, r"seq_len \(0\)"),
        ({"batch_size": -2}, r"batch_size \(-2\)"),
        ({"val_fraction": 1.0}, r"val_fraction \(1.0\)"),
        ({"val_fraction": 0}, r"val_fraction \(0\)"),
        ({"max_bytes": 0}, r"max_bytes \(0\)"),
    ],
)
def test_bad_arguments_are_named(corpus: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _dm(corpus, **kwargs)


def test_missing_paths_fail_at_construction(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no_such_data"):
        TextDataModule(str(tmp_path / "no_such_data"))
    with pytest.raises(FileNotFoundError, match="no_such_tok"):
        TextDataModule(tokenizer=str(tmp_path / "no_such_tok"))


def test_too_little_data_is_reported(tmp_path: Path) -> None:
    (tmp_path / "tiny.txt").write_text("abc", encoding="utf-8")
    dm = TextDataModule(str(tmp_path / "tiny.txt"), seq_len=16)
    assert dm.vocab_size == 258 and isinstance(dm.tokenizer, ByteTokenizer)  # available before setup
    with pytest.raises(ValueError, match=r"tiny\.txt.*4 tokens"):
        dm.setup("fit")


def test_default_corpus_datamodule_with_small_budget() -> None:
    dm = TextDataModule(seq_len=32, batch_size=4, max_bytes=50_000)
    dm.setup("fit")
    assert 50_000 <= dm.num_tokens - dm.num_documents < 50_000 + max(f.stat().st_size for f in default_corpus_files())
    assert dm.unigram_entropy() < math.log(256)  # Python source is far from uniform over bytes


# ---------------------------------------------------------------- sampler


def test_sampler_shards_are_disjoint_equal_and_seeded() -> None:
    data = list(range(103))
    shards = [list(ResumableShardedSampler(data, num_replicas=4, rank=r, seed=5)) for r in range(4)]
    assert all(len(s) == 25 for s in shards)
    union = [i for s in shards for i in s]
    assert len(set(union)) == 100  # disjoint, tail of 3 dropped
    single = ResumableShardedSampler(data, seed=5)
    assert sorted(union) == sorted(single.permutation(0)[:100].tolist())
    epoch1 = ResumableShardedSampler(data, seed=5)
    epoch1.set_epoch(1)
    assert list(epoch1) != list(single) and list(single) == list(ResumableShardedSampler(data, seed=5))


def test_loader_state_counts_consumed_batches_with_workers() -> None:
    data = torch.arange(40)

    def loader() -> ResumableDataLoader:
        sampler = ResumableShardedSampler(data, seed=1)
        return ResumableDataLoader(data, batch_size=4, sampler=sampler, drop_last=True, num_workers=2)

    full = [b.tolist() for b in loader()]
    first = loader()
    it = iter(first)
    seen = [next(it).tolist() for _ in range(3)]  # workers have prefetched further than this
    state = first.state_dict()
    assert state["consumed"] == 12 and state["epoch"] == 0
    del it
    second = loader()
    second.load_state_dict(state)
    assert seen + [b.tolist() for b in second] == full


# ---------------------------------------------------------------- exact resume through Lightning


class _Recorder(LightningModule):
    """Records every training batch it sees; a tiny embedding + linear model so the optimizer really steps."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, 4)
        self.head = torch.nn.Linear(4, vocab_size)
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append(batch["input_ids"].clone())
        logits = self.head(self.embed(batch["input_ids"]))  # (B, T, V)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.head(self.embed(batch["input_ids"])).mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(corpus: Path, root: Path, max_steps: int, ckpt_path: str | None = None, ckpt_every: int | None = None):
    dm = _dm(corpus)
    model = _Recorder(dm.vocab_size)
    callbacks = []
    if ckpt_every is not None:
        callbacks.append(ModelCheckpoint(dirpath=root, every_n_train_steps=ckpt_every, save_top_k=-1))
    trainer = Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=ckpt_every is not None,
        callbacks=callbacks,
        default_root_dir=root,
        num_sanity_val_steps=0,
        limit_val_batches=2,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model.seen, trainer


@pytest.fixture(scope="module")
def uninterrupted(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[torch.Tensor], int]:
    seen, trainer = _fit(corpus, tmp_path_factory.mktemp("run_a"), max_steps=40)
    return seen, trainer.num_training_batches


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
@pytest.mark.parametrize("stop_at", ["mid_epoch_0", "end_of_epoch_0", "mid_epoch_1"])
def test_exact_resume_matches_uninterrupted_run(corpus: Path, tmp_path: Path, uninterrupted, stop_at: str) -> None:
    seen_a, per_epoch = uninterrupted
    assert 40 > 2 * per_epoch + 1, "run A must span more than two epochs for this test to mean anything"
    stop = {"mid_epoch_0": per_epoch // 2, "end_of_epoch_0": per_epoch, "mid_epoch_1": per_epoch + 3}[stop_at]
    seen_b, _ = _fit(corpus, tmp_path, max_steps=stop, ckpt_every=stop)
    (ckpt,) = tmp_path.glob(f"*step={stop}.ckpt")
    state = torch.load(ckpt, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert state[0]["consumed"] == (stop - (stop // per_epoch) * per_epoch or per_epoch) * BATCH
    seen_c, _ = _fit(corpus, tmp_path / "c", max_steps=40, ckpt_path=str(ckpt))
    assert len(seen_b) == stop and len(seen_b) + len(seen_c) == len(seen_a)
    for step, (x, y) in enumerate(zip(seen_a, seen_b + seen_c, strict=True)):
        assert torch.equal(x, y), f"batch {step} differs after resuming at step {stop}"
    # Epochs really are reshuffled: the second epoch does not repeat the first.
    assert not torch.equal(torch.cat(seen_a[:per_epoch]), torch.cat(seen_a[per_epoch : 2 * per_epoch]))


def test_data_parallel_position_follows_the_strategy() -> None:
    """Tensor/context-parallel ranks of one group must read the same rows: the sampler's replicas and rank come from
    the strategy's ``distributed_sampler_kwargs``, not from the world size."""
    from types import SimpleNamespace

    from lightning_llmopt.data.datamodule import data_parallel_position

    tp_strategy = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": 1})
    assert data_parallel_position(SimpleNamespace(strategy=tp_strategy, world_size=8, global_rank=5)) == (2, 1)
    plain = SimpleNamespace(strategy=SimpleNamespace(), world_size=4, global_rank=3)
    assert data_parallel_position(plain) == (4, 3)
    assert data_parallel_position(None) == (1, 0)
