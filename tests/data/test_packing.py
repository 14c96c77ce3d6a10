import itertools
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_llmopt.models.attention_flex  # noqa: F401  (registers "flex")
from lightning_llmopt.data import ResumableShardedSampler, TextDataModule
from lightning_llmopt.data.packing import (
    ALGORITHMS,
    StreamingPacker,
    best_fit,
    first_fit_decreasing,
    pack,
    pack_rows,
    padding_waste,
    row_pieces,
)
from lightning_llmopt.models import AttentionMask, Llama, LlamaConfig, attention, positions_from_doc_ids

# ---------------------------------------------------------------- bin packing


def _assert_valid(rows: list[list[int]], lengths: list[int], capacity: int) -> None:
    """Every document's tokens exactly once, no row over capacity (checked independently of row_pieces)."""
    counts = [0] * len(lengths)
    for row in rows:
        assert row, "empty row"
        for doc in row:
            counts[doc] += 1
    for doc, n in enumerate(lengths):
        assert counts[doc] == math.ceil(n / capacity), f"document {doc} ({n} tokens) appears {counts[doc]} times"
    used = [0] * len(lengths)
    for row in rows:
        fill = 0
        for doc in row:
            piece = min(capacity, lengths[doc] - used[doc])
            used[doc] += piece
            fill += piece
        assert fill <= capacity
    assert used == lengths


def _optimum(lengths: list[int], capacity: int) -> int:
    """Fewest bins by exhaustive search (items <= capacity; tiny instances only)."""
    best = len(lengths)

    def place(i: int, bins: list[int]) -> None:
        nonlocal best
        if len(bins) >= best:
            return
        if i == len(lengths):
            best = len(bins)
            return
        for b in range(len(bins)):
            if bins[b] + lengths[i] <= capacity:
                bins[b] += lengths[i]
                place(i + 1, bins)
                bins[b] -= lengths[i]
        place(i + 1, [*bins, lengths[i]])

    place(0, [])
    return best


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_packings_are_valid_with_long_and_odd_documents(algorithm: str) -> None:
    rng = random.Random(1)
    for _ in range(30):
        capacity = rng.choice([1, 7, 17, 64, 113])
        lengths = [rng.randint(1, 3 * capacity) for _ in range(rng.randint(1, 60))]
        rows = pack(lengths, capacity, algorithm)
        _assert_valid(rows, lengths, capacity)
        assert rows == pack(lengths, capacity, algorithm)  # deterministic
        assert len(rows) >= math.ceil(sum(lengths) / capacity)
        row_pieces(rows, lengths, capacity)  # consistent with the package's own reading of the rows


def test_ffd_and_best_fit_against_brute_force_optimum() -> None:
    rng = random.Random(2)
    for _ in range(200):
        capacity = rng.randint(5, 20)
        lengths = [rng.randint(1, capacity) for _ in range(rng.randint(1, 8))]
        opt = _optimum(lengths, capacity)
        ffd, bf = first_fit_decreasing(lengths, capacity), best_fit(lengths, capacity)
        assert opt <= len(ffd) <= 11 / 9 * opt + 6 / 9, (lengths, capacity)  # Dósa's tight FFD bound
        assert opt <= len(bf) <= math.floor(1.7 * opt) + 1, (lengths, capacity)


def test_ffd_fills_a_known_instance_optimally_and_best_fit_follows_input_order() -> None:
    # FFD sorts 6,5,4,3,2 and pairs 6+4 / 5+3+2; best-fit in input order puts 2,3,4 together first.
    assert first_fit_decreasing([2, 3, 4, 5, 6], 10) == [[4, 2], [3, 1, 0]]
    assert best_fit([2, 3, 4, 5, 6], 10) == [[0, 1, 2], [3], [4]]


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match=r"capacity \(0\)"):
        first_fit_decreasing([1], 0)
    with pytest.raises(ValueError, match=r"document 1 has length 0"):
        best_fit([3, 0], 8)
    with pytest.raises(ValueError, match=r"algorithm \('nfd'\)"):
        pack([1], 4, "nfd")
    with pytest.raises(ValueError, match=r"row 0 holds 12 tokens, more than the capacity \(8\)"):
        row_pieces([[0, 1]], [6, 6], 8)
    with pytest.raises(ValueError, match=r"buffer_size \(0\)"):
        StreamingPacker(8, 0)


# ---------------------------------------------------------------- packed tensors


def _random_docs(lengths: list[int], vocab: int = 320, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def test_packed_rows_recover_documents_and_labels_never_cross_documents() -> None:
    lengths = [1, 17, 5, 40, 113, 9, 30, 2, 64, 23]
    docs, T = _random_docs(lengths), 32
    batch = pack_rows(docs, pack(lengths, T), T, pad_id=0)
    assert all(v.shape == batch["input_ids"].shape and v.dtype == torch.int64 for v in batch.values())
    # Rebuild every document from the rows: its tokens, and its labels (next token, -100 only at its very end).
    rebuilt_ids: dict[int, list[int]] = {}
    rebuilt_labels: dict[int, list[int]] = {}
    for row, pieces in zip(range(batch["input_ids"].shape[0]), row_pieces(pack(lengths, T), lengths, T), strict=True):
        ids, labels = batch["input_ids"][row].tolist(), batch["labels"][row].tolist()
        doc_ids, pos = batch["doc_ids"][row].tolist(), batch["positions"][row].tolist()
        at = 0
        for k, piece in enumerate(pieces):
            span = range(at, at + piece.length)
            assert [pos[i] for i in span] == list(range(piece.length))
            assert {doc_ids[i] for i in span} == {k}
            rebuilt_ids.setdefault(piece.doc, []).extend(ids[i] for i in span)
            rebuilt_labels.setdefault(piece.doc, []).extend(labels[i] for i in span)
            at += piece.length
        assert set(doc_ids[at:]) <= {len(pieces)} and set(labels[at:]) <= {-100}  # padding: own id, no target
        assert pos[at:] == list(range(T - at))
    for d, doc in enumerate(docs):
        assert rebuilt_ids[d] == doc.tolist()
        assert rebuilt_labels[d] == doc[1:].tolist() + [-100]


def test_padding_waste_drops_on_a_long_tailed_distribution() -> None:
    g = torch.Generator().manual_seed(0)
    lengths = (math.log(60) + torch.randn(2000, generator=g, dtype=torch.float64)).exp().clamp(1, 1024).long().tolist()
    for algorithm in ALGORITHMS:
        rows = pack(lengths, 512, algorithm)
        waste = padding_waste(lengths, 512, rows)
        assert waste.rows_before == sum(math.ceil(n / 512) for n in lengths)
        assert waste.before == pytest.approx(1 - sum(lengths) / (512 * waste.rows_before))
        assert 0 <= waste.after < 0.05 < 0.5 < waste.before  # fixed thresholds: median doc ~1/8 of a row


def test_streaming_packer_is_deterministic_bounded_and_complete() -> None:
    rng = random.Random(3)
    lengths = [rng.choice([rng.randint(1, 20), rng.randint(20, 150)]) for _ in range(300)]
    docs = _random_docs(lengths, seed=1)
    for algorithm, buffer in itertools.product(ALGORITHMS, (1, 7, 64)):
        packer = StreamingPacker(64, buffer, algorithm)
        rows = list(packer.pack_lengths(iter(lengths)))
        assert packer.max_buffered <= buffer
        assert rows == list(StreamingPacker(64, buffer, algorithm).pack_lengths(lengths))
        as_indices = [[p.doc for p in row] for row in rows]
        _assert_valid(as_indices, lengths, 64)
        tensors = list(StreamingPacker(64, buffer, algorithm)(iter(docs)))
        expected = pack_rows(docs, as_indices, 64)
        for key in expected:
            assert torch.equal(torch.stack([t[key] for t in tensors]), expected[key])
    small = len(list(StreamingPacker(64, 1).pack_lengths(lengths)))
    large = len(list(StreamingPacker(64, 64).pack_lengths(lengths)))
    assert large < small  # a larger buffer packs tighter


# ---------------------------------------------------------------- acceptance: packed loss == documents one by one

BACKENDS = ["sdpa", "eager", "flex"]


def _per_document_losses(model: Llama, docs: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for doc in docs:
        logits = model(doc[None])[0]  # (L, V)
        out.append(F.cross_entropy(logits[:-1], doc[1:], reduction="none"))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_packed_loss_equals_documents_run_one_at_a_time(backend: str) -> None:
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_preset("tiny", attn_backend=backend)).eval()
    lengths = [1, 17, 5, 40, 3, 64, 23, 11, 2, 30]
    docs, T = _random_docs(lengths), 64
    rows = pack(lengths, T)
    batch = pack_rows(docs, rows, T)
    logits = model(batch["input_ids"], positions=batch["positions"], doc_ids=batch["doc_ids"])  # (R, T, V)
    packed = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none", ignore_index=-100)
    packed = packed.view(len(rows), T)
    # One document at a time through the same model; for "flex" through the "eager" backend with the same weights
    # (flex would build one block mask per document length: slow on CPU, and eager is the numerical reference).
    ref_model = model
    if backend == "flex":
        ref_model = Llama(LlamaConfig.from_preset("tiny", attn_backend="eager")).eval()
        ref_model.load_state_dict(model.state_dict())
    reference = _per_document_losses(ref_model, docs)
    for r, pieces in enumerate(row_pieces(rows, lengths, T)):
        at = 0
        for piece in pieces:
            got = packed[r, at : at + piece.length - 1]
            # fp32 on both sides; only the matmul shapes differ, so 1e-5 (the brief's bound) is ~10x the noise.
            torch.testing.assert_close(got, reference[piece.doc], rtol=0, atol=1e-5)
            at += piece.length
    valid = batch["labels"] != -100
    assert int(valid.sum()) == sum(n - 1 for n in lengths)
    mean_ref = torch.cat(reference).mean()
    torch.testing.assert_close(packed[valid].mean(), mean_ref, rtol=0, atol=1e-5)
    # The document mask matters: the same rows without doc_ids give different losses.
    plain = model(batch["input_ids"]).flatten(0, 1)
    assert not torch.allclose(F.cross_entropy(plain, batch["labels"].flatten(), ignore_index=-100), mean_ref)


def test_flex_backend_matches_eager_on_gqa_windows_and_cache_slots() -> None:
    torch.manual_seed(1)
    B, H, H_kv, T, D = 2, 4, 2, 37, 16
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, H_kv, T, D), torch.randn(B, H_kv, T, D)
    doc = torch.tensor([[0] * 5 + [1] * 12 + [2] * 20, [0] * 9 + [1] * 8 + [2] * 20])
    pos = positions_from_doc_ids(doc)
    for window in (None, 3):
        mask = AttentionMask(pos, pos, doc, doc, window=window)
        torch.testing.assert_close(attention(q, k, v, mask, "flex"), attention(q, k, v, mask, "eager"))
    k_pos = torch.arange(T).expand(B, T).clone()
    k_pos[:, 30:] = -1
    k_pos[0] = -1  # a row with no visible key returns zeros
    mask = AttentionMask(torch.arange(T).expand(B, T), k_pos)
    out = attention(q, k, v, mask, "flex")
    torch.testing.assert_close(out, attention(q, k, v, mask, "eager"))
    assert torch.count_nonzero(out[0]) == 0


def test_flex_backend_trains_on_cpu_through_the_dense_fallback() -> None:
    torch.manual_seed(2)
    doc = torch.tensor([[0] * 7 + [1] * 10])
    pos = positions_from_doc_ids(doc)
    mask = AttentionMask(pos, pos, doc, doc)
    grads = []
    for backend in ("flex", "eager"):
        torch.manual_seed(3)
        q = torch.randn(1, 4, 17, 16, requires_grad=True)
        k, v = torch.randn(1, 2, 17, 16), torch.randn(1, 2, 17, 16)
        attention(q, k, v, mask, backend).square().sum().backward()
        grads.append(q.grad)
    torch.testing.assert_close(grads[0], grads[1])


# ---------------------------------------------------------------- TextDataModule packing mode

SEQ_LEN = 64
BATCH = 4


def _write_corpus(root: Path, num_docs: int = 60) -> Path:
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "zeta", "theta", "\n"]
    root.mkdir(parents=True, exist_ok=True)
    for i in range(num_docs):
        n = rng.choice([rng.randint(1, 8), rng.randint(8, 40)])
        (root / f"doc{i:03d}.txt").write_text(" ".join(rng.choice(words) for _ in range(n)), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_corpus(tmp_path_factory.mktemp("packing_corpus"))


def _dm(corpus: Path, **kwargs: object) -> TextDataModule:
    args: dict = {"seq_len": SEQ_LEN, "batch_size": BATCH, "val_fraction": 0.1, "seed": 7, "packing": "ffd", **kwargs}
    return TextDataModule(str(corpus), **args)


def test_datamodule_packed_batches_hold_whole_documents(corpus: Path) -> None:
    dm = _dm(corpus, packing_buffer=16, seq_len=256)  # every document fits a row whole
    dm.setup("fit")
    texts = [p.read_text(encoding="utf-8").encode() for p in sorted(corpus.glob("*.txt"))]
    docs = [tuple([*t, 257]) for t in texts]
    seen: list[tuple[int, ...]] = []
    for dataset in (dm.train_dataset, dm.val_dataset):
        for i in range(len(dataset)):
            item = dataset[i]
            for d in item["doc_ids"].unique().tolist():
                span = item["doc_ids"] == d
                tokens = item["input_ids"][span].tolist()
                if tokens[0] == 257:
                    continue  # padding (eos ids); every document starts with text
                assert item["labels"][span].tolist() == tokens[1:] + [-100]
                assert item["positions"][span].tolist() == list(range(len(tokens)))
                seen.append(tuple(tokens))
    assert sorted(seen) == sorted(docs) and len(seen) == len(docs)  # train and val split by document, disjoint
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "positions", "doc_ids"}
    assert all(v.shape == (BATCH, 256) for v in batch.values())
    stats = dm.padding_stats
    assert stats is not None and stats["waste_after"] < stats["waste_before"]
    assert dm.unigram_entropy() < math.log(dm.vocab_size)


def test_enable_packing_after_setup_and_sampler_factory(corpus: Path) -> None:
    dm = _dm(corpus, packing=None)
    dm.setup("fit")
    assert dm.padding_stats is None and set(dm.train_dataset[0]) == {"input_ids", "labels"}
    built: list[int] = []

    def factory(dataset, **kwargs) -> ResumableShardedSampler:  # type: ignore[no-untyped-def]
        built.append(len(dataset))
        return ResumableShardedSampler(dataset, **kwargs)

    dm.sampler_factory = factory
    dm.enable_packing("best_fit", 8)
    assert dm.packing == "best_fit" and dm.state_dict()["packing"] == "best_fit"
    next(iter(dm.train_dataloader()))
    assert built == [len(dm.train_dataset)] and "doc_ids" in dm.train_dataset[0]
    with pytest.raises(ValueError, match=r"packing \('nfd'\)"):
        dm.enable_packing("nfd")
    with pytest.raises(ValueError, match=r"packing_buffer \(0\)"):
        _dm(corpus, packing_buffer=0)


class _Recorder(LightningModule):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, 4)
        self.head = torch.nn.Linear(4, vocab_size)
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append(torch.stack([batch["input_ids"], batch["doc_ids"]]).clone())
        logits = self.head(self.embed(batch["input_ids"]))
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(corpus: Path, root: Path, max_steps: int, ckpt_path: str | None = None, ckpt_every: int | None = None):
    dm = _dm(corpus)
    model = _Recorder(dm.vocab_size)
    callbacks: list[Callback] = (
        [ModelCheckpoint(dirpath=root, every_n_train_steps=ckpt_every, save_top_k=-1)] if ckpt_every else []
    )
    trainer = Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=bool(ckpt_every),
        callbacks=callbacks,
        default_root_dir=root,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model.seen, trainer.num_training_batches


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_packed_mode_resumes_exactly_mid_epoch(corpus: Path, tmp_path: Path) -> None:
    seen_a, per_epoch = _fit(corpus, tmp_path / "a", max_steps=2 * 50)
    steps = len(seen_a)
    assert steps > per_epoch + 3, "the run must reach the second epoch"
    stop = per_epoch + 2
    seen_b, _ = _fit(corpus, tmp_path / "b", max_steps=stop, ckpt_every=stop)
    (ckpt,) = (tmp_path / "b").glob(f"*step={stop}.ckpt")
    seen_c, _ = _fit(corpus, tmp_path / "c", max_steps=steps, ckpt_path=str(ckpt))
    assert len(seen_b) + len(seen_c) == steps
    for step, (x, y) in enumerate(zip(seen_a, seen_b + seen_c, strict=True)):
        assert torch.equal(x, y), f"batch {step} differs after resuming at step {stop}"
