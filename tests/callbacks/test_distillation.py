"""``Distillation`` inside a Trainer: the first step's loss is alpha * T^2 KL + (1 - alpha) * CE computed here with
torch's own ``kl_div``; the teacher stays frozen and out of the optimizer; feature (learned projection) and
attention losses train; under ZeRO-2 on two gloo ranks it matches the single-process run."""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_llmopt import CausalLMModule
from lightning_llmopt.callbacks.distillation import Distillation
from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.testing import RandomTokens


class Probe(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.owned: set[int] = set()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.losses.append(float(outputs["loss"]))
        self.owned = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}


def _trainer(callbacks: list, steps: int = 3) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


def test_distillation_loss_in_trainer() -> None:
    torch.manual_seed(0)
    teacher = Llama(LlamaConfig.from_preset("tiny", n_layers=3))
    t_before = copy.deepcopy(teacher.state_dict())
    module = CausalLMModule("tiny", model_overrides={"n_layers": 1}, learning_rate=1e-3, warmup_steps=0)
    module.configure_model()
    student0 = copy.deepcopy(module.model)
    data = RandomTokens(320, 16, 8)
    probe = Probe()
    cb = Distillation(teacher, temperature=2.0, alpha=0.7)
    _trainer([cb, probe]).fit(module, DataLoader(data, batch_size=4))
    batch = {k: torch.stack([data[i][k] for i in range(4)]) for k in ("input_ids", "labels")}
    with torch.no_grad():
        s, t = student0(batch["input_ids"]).double(), teacher(batch["input_ids"]).double()
    kl = (
        F.kl_div(
            F.log_softmax(s / 2, -1).flatten(0, 1),
            F.log_softmax(t / 2, -1).flatten(0, 1),
            log_target=True,
            reduction="batchmean",
        )
        * 4
    )
    ce = F.cross_entropy(s.flatten(0, 1), batch["labels"].flatten())
    assert abs(probe.losses[0] - float(0.7 * kl + 0.3 * ce)) < 1e-5
    assert all(torch.equal(v, teacher.state_dict()[k]) for k, v in t_before.items())  # frozen
    assert not any(id(p) in probe.owned for p in teacher.parameters())
    assert "train_loss" not in module.__dict__  # restored at teardown


def test_feature_projection_and_attention_losses_train() -> None:
    torch.manual_seed(0)
    teacher = Llama(LlamaConfig.from_preset("tiny", dim=96, n_heads=6, n_kv_heads=3, n_layers=2))
    module = CausalLMModule("tiny", model_overrides={"n_layers": 1}, learning_rate=1e-2, warmup_steps=0)
    probe = Probe()
    cb = Distillation(teacher, feature_weight=1.0, attention_weight=1.0, teacher_dtype=torch.bfloat16)
    cb_initial: list[torch.Tensor] = []

    class Keep(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
            cb_initial.append(pl_module.distill_projector.proj[0].weight.detach().clone())

    probe_keep = Keep()
    trainer = _trainer([cb, probe, probe_keep], steps=4)
    trainer.fit(module, DataLoader(RandomTokens(320, 16, 4), batch_size=4))  # the same batch every step
    proj = module.distill_projector.proj[0]
    assert not torch.equal(proj.weight, cb_initial[0])  # the projection was trained
    assert proj.weight.shape == (96, 64) and id(proj.weight) in probe.owned
    assert next(teacher.parameters()).dtype == torch.bfloat16
    assert {"distill/kl", "distill/ce", "distill/feature", "distill/attention"} <= set(trainer.callback_metrics)
    assert probe.losses[-1] < probe.losses[0]


def test_int8_teacher_and_validation() -> None:
    from lightning_llmopt.quantization import QuantConfig

    with pytest.raises(ValueError, match="alpha"):
        Distillation(torch.nn.Linear(2, 2), alpha=2.0)
    torch.manual_seed(0)
    teacher = Llama(LlamaConfig.from_preset("tiny"))
    cb = Distillation(teacher, teacher_quantization=QuantConfig(bits=8, group_size=None))
    module = CausalLMModule("tiny", model_overrides={"n_layers": 1}, warmup_steps=0)
    _trainer([cb], steps=1).fit(module, DataLoader(RandomTokens(320, 16, 4), batch_size=4))
    assert type(teacher.layers["0"].attention.wq).__name__ == "QuantizedLinear"
    assert cb.state_dict()["alpha"] == 0.5


def _zero_job(init: dict[str, torch.Tensor], teacher_state: dict[str, torch.Tensor], stage: int) -> Any:
    import torch.distributed as dist

    from lightning_llmopt.data.sampler import ResumableDataLoader, ResumableShardedSampler
    from lightning_llmopt.strategies import ZeroStrategy
    from lightning_llmopt.testing import PoolEnvironment

    teacher = Llama(LlamaConfig.from_preset("tiny"))
    teacher.load_state_dict(teacher_state)
    module = CausalLMModule("tiny", model_overrides={"n_layers": 1}, learning_rate=3e-3, warmup_steps=2)
    module.configure_model()
    module.model.load_state_dict(init)
    probe = Probe()
    data = RandomTokens(320, 16, 16)
    world = dist.get_world_size() if stage else 1
    rank = dist.get_rank() if stage else 0
    loader = ResumableDataLoader(
        data,
        batch_size=4 // world,
        drop_last=True,
        sampler=ResumableShardedSampler(data, num_replicas=world, rank=rank, seed=0),
    )
    kwargs: dict[str, Any] = (
        dict(
            strategy=ZeroStrategy(stage=stage, cluster_environment=PoolEnvironment(), process_group_backend="gloo"),
            devices=world,
        )
        if stage
        else {}
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=3,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[Distillation(teacher, alpha=0.5), probe],
        **kwargs,
    )
    trainer.fit(module, loader)
    teacher_owned = any(id(p) in {id(q) for q in module.parameters()} for p in teacher.parameters())
    state = module.model.state_dict()
    flat = torch.cat([state[k].detach().reshape(-1) for k in sorted(state)])
    return flat, probe.losses, teacher_owned


def test_distillation_under_zero2_matches_single_process(dist_pool: Any) -> None:
    torch.manual_seed(0)
    teacher = Llama(LlamaConfig.from_preset("tiny")).state_dict()
    init = Llama(LlamaConfig.from_preset("tiny", n_layers=1)).state_dict()
    ref, ref_losses, _ = _zero_job(init, teacher, 0)
    init_flat = torch.cat([init[k].reshape(-1) for k in sorted(init)])
    assert float((ref - init_flat).norm() / init_flat.norm()) > 1e-3  # the weights did move
    results = dist_pool(2).run(_zero_job, init, teacher, 2)
    for flat, _, teacher_owned in results:
        assert not teacher_owned
        # as tests/strategies: the ranks average two half-batch means, the reference one full-batch mean (fp32)
        assert float((flat - ref).norm() / ref.norm()) <= 1e-6
    # per-rank losses are half-batch means (equal token counts): their average is the global-batch loss
    mean_losses = torch.tensor([r[1] for r in results]).mean(0)
    assert len(ref_losses) == 3
    assert float(((mean_losses - torch.tensor(ref_losses)).abs() / torch.tensor(ref_losses)).max()) <= 1e-6
