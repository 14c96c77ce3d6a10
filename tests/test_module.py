"""CausalLMModule: training lowers the loss, checkpoints restore the model, bad configs fail before training."""

from __future__ import annotations

import importlib.util
import math

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_llmopt import CausalLMModule, LlamaConfig
from lightning_llmopt.data import ResumableDataLoader, ResumableShardedSampler


class RepeatingTokens(Dataset):
    """Rows of a short periodic sequence: a model that learns the period reaches near-zero loss."""

    def __init__(self, n: int = 64, seq_len: int = 32, vocab: int = 64, period: int = 7) -> None:
        g = torch.Generator().manual_seed(0)
        base = torch.randint(0, vocab, (period,), generator=g)
        self.rows = [base.roll(i).repeat(seq_len // period + 2)[: seq_len + 1] for i in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.rows[i]
        return {"input_ids": row[:-1], "labels": row[1:]}


def _trainer(tmp_path, **kwargs) -> L.Trainer:
    defaults = dict(accelerator="cpu", devices=1, max_steps=40, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, default_root_dir=tmp_path, num_sanity_val_steps=0)
    defaults.update(kwargs)
    return L.Trainer(**defaults)


def test_training_lowers_loss_and_checkpoint_restores_model(tmp_path):
    L.seed_everything(0)
    module = CausalLMModule("tiny", model_overrides={"vocab_size": 64}, learning_rate=3e-3, warmup_steps=5)
    loader = DataLoader(RepeatingTokens(), batch_size=8, shuffle=True)
    val = DataLoader(RepeatingTokens(n=8), batch_size=8)
    trainer = _trainer(tmp_path, enable_checkpointing=False)
    trainer.fit(module, loader, val)
    final = trainer.callback_metrics["val/loss"].item()
    assert final < 0.5 * math.log(64), final  # far below the uniform loss: the period was learned
    assert trainer.callback_metrics["val/ppl"].item() == pytest.approx(math.exp(final), rel=1e-4)
    assert module.tokens_seen == 40 * 8 * 32

    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    restored = CausalLMModule.load_from_checkpoint(path)
    assert restored.config == module.config
    assert restored.tokens_seen == module.tokens_seen
    batch = next(iter(val))
    module.eval(), restored.eval()
    torch.testing.assert_close(restored(batch["input_ids"]), module(batch["input_ids"]), rtol=0, atol=0)


def test_resume_continues_the_schedule(tmp_path):
    """A checkpoint written mid-epoch at step 23 and resumed to step 40 gives the weights of 40 uninterrupted steps:
    model, AdamW state, learning-rate schedule and data position are all restored."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    data = RepeatingTokens(n=40)

    def run(max_steps, ckpt=None, callbacks=()):
        L.seed_everything(0)
        module = CausalLMModule("tiny", model_overrides={"vocab_size": 64}, warmup_steps=5, max_steps=40)
        loader = ResumableDataLoader(data, batch_size=8, drop_last=True, sampler=ResumableShardedSampler(data, seed=3))
        trainer = _trainer(tmp_path, max_steps=max_steps, callbacks=list(callbacks))
        trainer.fit(module, loader, ckpt_path=ckpt)
        return module

    full = run(40, callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="s{step}", every_n_train_steps=23,
                                              save_top_k=-1)])
    resumed = run(40, ckpt=tmp_path / "sstep=23.ckpt")
    for (name, a), b in zip(full.named_parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_learning_rate_schedule():
    module = CausalLMModule("tiny", warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert module.lr_lambda(0) == pytest.approx(1 / 11)
    assert module.lr_lambda(10) == pytest.approx(1.0)
    assert module.lr_lambda(60) == pytest.approx(0.55)
    assert module.lr_lambda(110) == pytest.approx(0.1)
    assert module.lr_lambda(500) == pytest.approx(0.1)


def test_weight_decay_skips_norms_and_embeddings():
    module = CausalLMModule("tiny")
    module.configure_model()
    opt = module.configure_optimizers()["optimizer"]
    decay, no_decay = opt.param_groups
    names = {id(p): n for n, p in module.model.named_parameters()}
    assert all("norm" not in names[id(p)] and "tok_embeddings" not in names[id(p)] for p in decay["params"])
    assert any("tok_embeddings" in names[id(p)] for p in no_decay["params"])


def test_accepts_config_object_and_dict():
    cfg = LlamaConfig.from_preset("tiny", n_layers=1)
    assert CausalLMModule(cfg).config == cfg
    assert CausalLMModule(cfg.to_dict(), model_overrides={"n_layers": 3}).config.n_layers == 3


def test_tokenizer_larger_than_vocab_fails_before_training(tmp_path):
    class BigVocab(L.LightningDataModule):
        vocab_size = 1000

        def train_dataloader(self):
            raise AssertionError("training must not start")

    trainer = _trainer(tmp_path)
    with pytest.raises(ValueError, match=r"vocabulary \(1000\) is larger than the model's vocab_size \(320\)"):
        trainer.fit(CausalLMModule("tiny"), datamodule=BigVocab())


def test_bad_hyperparameters_name_the_value():
    with pytest.raises(ValueError, match=r"learning_rate \(-1"):
        CausalLMModule("tiny", learning_rate=-1)
    with pytest.raises(ValueError, match=r"unknown preset 'gpt5'"):
        CausalLMModule("gpt5")


def test_meta_device_construction_through_configure_model():
    module = CausalLMModule("tiny")
    with torch.device("meta"):
        module.configure_model()
    assert all(p.is_meta for p in module.parameters())
    module.model.to_empty(device="cpu")
    module.model.init_weights()
    out = module(torch.randint(0, 320, (1, 5)))
    assert torch.isfinite(out).all()


def test_fused_kernels_auto_resolution():
    from lightning_llmopt.models.config import FUSED_KERNELS
    from lightning_llmopt.module import resolve_fused_kernels

    triton = importlib.util.find_spec("triton") is not None
    assert resolve_fused_kernels("auto", [], "cpu") == []  # CPU: as before
    assert resolve_fused_kernels("auto", [], "cuda") == (list(FUSED_KERNELS) if triton else [])
    assert resolve_fused_kernels("auto", ["rmsnorm"], "cuda") == ["rmsnorm"]  # the config's own choice wins
    assert resolve_fused_kernels("none", ["rmsnorm"], "cuda") == []
    assert resolve_fused_kernels(None, [], "cuda") == []
    assert resolve_fused_kernels("swiglu,rope", [], "cpu") == ["rope", "swiglu"]
    assert resolve_fused_kernels("all", [], "cpu") == list(FUSED_KERNELS)
    with pytest.raises(ValueError, match="bogus"):
        CausalLMModule("tiny", fused_kernels="bogus")


def test_fused_kernels_default_on_cpu_builds_plain_model_and_names_opt_in():
    from lightning_llmopt.parallel.fused import fused_modules

    plain = CausalLMModule("tiny")
    plain.configure_model()
    assert fused_modules(plain.model) == []
    fused = CausalLMModule("tiny", fused_kernels="all")
    fused.configure_model()
    assert "FusedRMSNorm" in fused_modules(fused.model)
    # The saved config stays the one the user asked for, so a CPU reload of a GPU checkpoint stays plain.
    assert fused.hparams["model"]["fused_kernels"] == []


def test_fused_optimizer_choice():
    """``fused_optimizer=None`` (default) picks fused AdamW only where every parameter is on CUDA; True/False force it
    (torch has a fused AdamW on the CPU too). Clipping with it: tests/strategies/test_clipping.py."""
    for choice, expected in ((None, False), (True, True), (False, False)):
        module = CausalLMModule("tiny", fused_optimizer=choice)
        module.configure_model()
        optimizer = module.configure_optimizers()["optimizer"]
        assert bool(optimizer.defaults["fused"]) is expected
        assert bool(getattr(optimizer, "_step_supports_amp_scaling", False)) is expected


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_gpu_clipping_with_the_default_fused_optimizer(tmp_path, precision):
    """Issue 51: ``gradient_clip_val`` with the default optimizer (fused AdamW on CUDA) under Lightning's own
    ``MixedPrecision`` stopped at the first step (``does not allow for gradient clipping``)."""
    L.seed_everything(0)
    module = CausalLMModule("debug-1m", warmup_steps=1)
    loader = DataLoader(RepeatingTokens(n=8), batch_size=4)
    trainer = _trainer(tmp_path, accelerator="gpu", devices=1, precision=precision, gradient_clip_val=1.0,
                       max_steps=2, enable_checkpointing=False)
    trainer.fit(module, loader)
    optimizer = trainer.optimizers[0]
    assert optimizer.defaults["fused"] and optimizer._step_supports_amp_scaling  # the default, fused path
    assert trainer.global_step == 2
    assert all(torch.isfinite(p).all() for p in module.parameters())
    steps = [optimizer.state[p]["step"] for p in module.parameters()]
    assert all(int(s) >= 1 for s in steps), steps  # updates were applied (fp16: at most one skipped by the scaler)
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
