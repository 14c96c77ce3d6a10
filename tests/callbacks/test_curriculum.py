import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_llmopt import CausalLMModule
from lightning_llmopt.callbacks.curriculum import Curriculum, truncate_batch
from lightning_llmopt.data import ResumableShardedSampler, TextDataModule
from lightning_llmopt.data.curriculum import CurriculumSamplerFactory, root

SEQ_LEN, BATCH, MAX_STEPS, CURRICULUM_STEPS = 32, 4, 30, 24


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The tiny model gains nothing from intra-op threads, and on a loaded 2-core machine they spin against other
    processes (a 30-step run went from under 1 s to 20 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Documents from repetitive ("aaaa ...") to varied, so lexical diversity spreads over the chunks."""
    rng = random.Random(0)
    root_dir = tmp_path_factory.mktemp("curriculum_corpus")
    letters = "abcdefghijklmnopqrstuvwxyz"
    for i in range(8):
        alphabet = letters[: 2 + 3 * i]
        text = " ".join("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 7))) for _ in range(60))
        (root_dir / f"doc{i}.txt").write_text(text, encoding="utf-8")
    return root_dir


class _Recorder(Callback):
    """Before the curriculum's hook: the full batch and the step; after the training step: the length trained on."""

    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []
        self.steps: list[int] = []
        self.trained_lengths: list[int] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.batches.append(batch["input_ids"].clone())
        self.steps.append(trainer.global_step)


class _Module(CausalLMModule):
    recorder: _Recorder  # set after construction: an __init__ argument would land in the checkpoint's hparams

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert batch["labels"].shape == batch["input_ids"].shape
        self.recorder.trained_lengths.append(batch["input_ids"].shape[1])
        return super().training_step(batch, batch_idx)


def _curriculum(**kwargs: Any) -> Curriculum:
    args: dict[str, Any] = {"scorer": "lexical_diversity", "pacing": "root", "c0": 0.2,
                            "total_steps": CURRICULUM_STEPS, "seq_len_warmup": (8, 12), **kwargs}
    return Curriculum(**args)


def _fit(corpus: Path, root_dir: Path, max_steps: int, ckpt_path: str | None = None, ckpt_every: int | None = None,
         curriculum: Curriculum | None = None) -> tuple[_Recorder, Curriculum, TextDataModule, L.Trainer]:
    L.seed_everything(0, verbose=False)
    dm = TextDataModule(data_path=str(corpus), seq_len=SEQ_LEN, batch_size=BATCH, max_bytes=None, val_fraction=0.1)
    recorder = _Recorder()
    curriculum = curriculum or _curriculum()
    callbacks: list[Callback] = [recorder, curriculum]
    if ckpt_every is not None:
        callbacks.append(ModelCheckpoint(dirpath=root_dir, every_n_train_steps=ckpt_every, save_top_k=-1))
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, enable_progress_bar=False, enable_model_summary=False,
                        logger=False, enable_checkpointing=ckpt_every is not None, callbacks=callbacks,
                        default_root_dir=root_dir, num_sanity_val_steps=0, limit_val_batches=0)
    module = _Module("tiny", warmup_steps=2)
    module.recorder = recorder
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    return recorder, curriculum, dm, trainer


@pytest.fixture(scope="module")
def uninterrupted(corpus: Path, tmp_path_factory: pytest.TempPathFactory):
    return _fit(corpus, tmp_path_factory.mktemp("run_a"), MAX_STEPS)


def test_acceptance_batches_follow_the_schedule(uninterrupted) -> None:
    recorder, curriculum, dm, trainer = uninterrupted
    per_epoch = trainer.num_training_batches
    assert MAX_STEPS > per_epoch > 4 and CURRICULUM_STEPS > per_epoch  # the schedule crosses an epoch boundary
    assert isinstance(dm.sampler_factory, type) and dm.sampler_factory is ResumableShardedSampler  # restored
    # Ranks computed here, independently of the callback: the type-token ratio of each train chunk's inputs.
    chunks = dm.train_dataset.chunks
    ttr = torch.tensor([len(set(c[:-1].tolist())) / SEQ_LEN for c in chunks], dtype=torch.float64)
    assert curriculum.difficulty is not None
    by_rank = ttr[curriculum.difficulty.argsort()]
    assert bool((by_rank[1:] >= by_rank[:-1]).all())  # the callback's ranks sort the chunks by type-token ratio
    index = {tuple(c[:-1].tolist()): i for i, c in enumerate(chunks)}
    pacing = root(0.2, CURRICULUM_STEPS)
    assert recorder.steps == list(range(MAX_STEPS))
    for step, batch in zip(recorder.steps, recorder.batches, strict=True):
        for row in batch:
            rank = curriculum.difficulty[index[tuple(row.tolist())]]
            assert rank <= pacing(step) + 1e-12, f"step {step}: sample of rank {rank:.3f} > c = {pacing(step):.3f}"
    first = torch.stack([ttr[index[tuple(r.tolist())]] for b in recorder.batches[:4] for r in b])
    assert first.mean() < ttr.mean()  # the first steps really train on the repetitive chunks


def test_seq_len_warmup_truncates_what_training_step_sees(uninterrupted) -> None:
    recorder, _, _, _ = uninterrupted
    # 8 + 24 t / 12 rounded down to a multiple of 8, then the full 32 from step 12
    expected = [max(8, (8 + 24 * t // 12) // 8 * 8) if t < 12 else SEQ_LEN for t in range(MAX_STEPS)]
    assert recorder.trained_lengths == expected
    assert all(b.shape == (BATCH, SEQ_LEN) for b in recorder.batches)  # the loader still yields full rows


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
@pytest.mark.parametrize("stop", [5, 17])
def test_mid_epoch_resume_reproduces_the_order(corpus: Path, tmp_path: Path, uninterrupted, stop: int) -> None:
    full, curriculum_a, _, trainer_a = uninterrupted
    assert stop % trainer_a.num_training_batches != 0  # mid-epoch (epoch 0 and epoch 1)
    first, curriculum_b, _, _ = _fit(corpus, tmp_path, stop, ckpt_every=stop)
    (ckpt,) = tmp_path.glob(f"*step={stop}.ckpt")
    saved = torch.load(ckpt, weights_only=False)["callbacks"]["Curriculum"]
    assert saved == curriculum_b.state_dict() == curriculum_a.state_dict()
    assert saved["pacing"] == {"kind": "root", "c0": 0.2, "total_steps": CURRICULUM_STEPS, "p": 2.0}
    second, curriculum_c, _, _ = _fit(corpus, tmp_path / "c", MAX_STEPS, ckpt_path=str(ckpt))
    assert curriculum_c.state_dict() == saved
    assert first.steps + second.steps == full.steps
    assert first.trained_lengths + second.trained_lengths == full.trained_lengths
    for step, (x, y) in enumerate(zip(full.batches, first.batches + second.batches, strict=True)):
        assert torch.equal(x, y), f"batch {step} differs after resuming at step {stop}"


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_resuming_with_another_schedule_warns(corpus: Path, tmp_path: Path) -> None:
    _fit(corpus, tmp_path, 3, ckpt_every=3)
    (ckpt,) = tmp_path.glob("*step=3.ckpt")
    with pytest.warns(UserWarning, match=r"Curriculum differs from the checkpoint.*'c0': 0.2.*'c0': 0.5"):
        _fit(corpus, tmp_path / "b", 4, ckpt_path=str(ckpt), curriculum=_curriculum(c0=0.5))


def test_state_round_trip_without_trainer() -> None:
    cb = _curriculum()
    cb.difficulty = torch.tensor([0.0, 1.0])
    cb.scores_hash = "abc"
    cb.pacing_fn = root(0.2, CURRICULUM_STEPS)
    state = cb.state_dict()
    other = _curriculum()
    other.difficulty, other.scores_hash, other.pacing_fn = cb.difficulty, "abc", cb.pacing_fn
    other.load_state_dict(state)  # same: silent
    other.difficulty, other.scores_hash = torch.tensor([0.0, 1.0]), "def"
    with pytest.warns(UserWarning, match="scores_hash: 'abc' -> 'def'"):
        other.load_state_dict(state)


def test_truncate_batch_cuts_every_sequence_key_in_place() -> None:
    batch = {k: torch.arange(24).view(2, 12) for k in ("input_ids", "labels", "positions", "doc_ids")}
    batch["other"] = torch.arange(24).view(2, 12)
    same = batch
    truncate_batch(batch, 5)
    assert same is batch
    for key in ("input_ids", "labels", "positions", "doc_ids"):
        assert torch.equal(batch[key], torch.arange(24).view(2, 12)[:, :5]) and batch[key].is_contiguous()
    assert batch["other"].shape == (2, 12)
    truncate_batch(batch, 50)  # longer than the batch: unchanged
    assert batch["input_ids"].shape == (2, 5)
    with pytest.raises(ValueError, match=r"length \(0\)"):
        truncate_batch(batch, 0)


def test_datamodule_without_hook_is_a_clear_error() -> None:
    class Plain(L.LightningDataModule):
        pass

    trainer = SimpleNamespace(datamodule=Plain(), max_steps=10)
    with pytest.raises(TypeError, match="sampler_factory.*got Plain"):
        Curriculum().setup(trainer, None, "fit")  # type: ignore[arg-type]


def test_missing_total_steps_and_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"needs total_steps.*max_steps is -1"):
        Curriculum()._build_pacing(SimpleNamespace(max_steps=-1))  # type: ignore[arg-type]
    assert Curriculum(pacing="root")._build_pacing(SimpleNamespace(max_steps=50)) == root(0.1, 50)  # type: ignore[arg-type]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"scorer": "size"}, r"scorer \('size'\)"),
        ({"scorer": "reference_loss"}, "needs reference_model"),
        ({"pacing": "cosine"}, r"pacing \('cosine'\)"),
        ({"pacing": "staged"}, "needs stages"),
        ({"c0": 1.5}, r"c0 \(1.5\)"),
        ({"seq_len_warmup": (0, 10)}, r"seq_len_warmup \(\(0, 10\)\)"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            Curriculum(**kwargs)


def test_reference_loss_scorer_installs_a_sampler(corpus: Path) -> None:
    dm = TextDataModule(data_path=str(corpus), seq_len=SEQ_LEN, batch_size=BATCH, max_bytes=None)
    reference = torch.nn.Sequential(torch.nn.Embedding(258, 4), torch.nn.Linear(4, 258))
    cb = Curriculum(scorer="reference_loss", reference_model=reference, total_steps=10)
    strategy = SimpleNamespace(root_device=torch.device("cpu"), broadcast=lambda obj, src=0: obj)
    trainer = SimpleNamespace(datamodule=dm, max_steps=-1, strategy=strategy, accumulate_grad_batches=2)
    cb.setup(trainer, None, "fit")  # type: ignore[arg-type]
    factory = dm.sampler_factory
    assert isinstance(factory, CurriculumSamplerFactory) and factory.accumulate_grad_batches == 2
    assert cb.difficulty is not None and cb.difficulty.shape == (len(dm.train_dataset),)
    cb.teardown(trainer, None, "fit")  # type: ignore[arg-type]
    assert dm.sampler_factory is ResumableShardedSampler
