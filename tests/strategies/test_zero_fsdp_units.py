"""Which modules stage 3 shards as separate FSDP2 units (embedding, blocks, norm + head)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.strategies.zero_fsdp import edge_modules, transformer_blocks


class Holder(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def test_edges_of_our_llama() -> None:
    model = Llama(LlamaConfig.from_preset("tiny"))
    embedding, head = edge_modules(Holder(model))
    assert embedding is model.tok_embeddings
    assert head == [model.norm, model.output]
    assert transformer_blocks(Holder(model)) == list(model.layers.values())


def test_tied_embeddings_stay_in_the_root() -> None:
    model = Llama(LlamaConfig.from_preset("tiny", tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    assert edge_modules(Holder(model)) == (None, [])


def test_pipeline_stage_without_embedding() -> None:
    model = Llama(LlamaConfig.from_preset("tiny"))
    model.tok_embeddings = None
    embedding, head = edge_modules(Holder(model))
    assert embedding is None and head == [model.norm, model.output]


def test_edges_of_transformers_llama() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config)
    embedding, head = edge_modules(Holder(model))
    assert embedding is model.model.embed_tokens
    assert head == [model.model.norm, model.lm_head]


def test_materialize_keeps_real_tensors_of_other_children() -> None:
    """Only meta children are allocated: a metric-like child with real state keeps it (``to_empty`` on the whole
    LightningModule used to overwrite torchmetrics states with uninitialised memory)."""
    import torch

    from lightning_llmopt.strategies.zero_fsdp import materialize

    holder = Holder(Llama(LlamaConfig.from_preset("tiny")))
    with torch.device("meta"):
        holder.model = Llama(LlamaConfig.from_preset("tiny"))
    holder.metric = nn.Module()
    holder.metric.register_buffer("total", torch.tensor([3.0, 4.0]))
    materialize(holder, torch.device("cpu"))
    assert torch.equal(holder.metric.total, torch.tensor([3.0, 4.0]))
    assert not any(p.is_meta for p in holder.parameters())
    assert all(torch.isfinite(p).all() for p in holder.parameters())
    assert float(holder.model.layers["0"].attention_norm.weight.detach().mean()) == 1.0  # init_weights ran


def test_stage3_validation_metrics_are_sane(tmp_path: object) -> None:
    """Through the Trainer: stage 3 validation loss/perplexity agree with the model's own loss on the batch."""
    import math

    import lightning as L
    import torch

    from lightning_llmopt import CausalLMModule
    from lightning_llmopt.testing.data import RandomTokens

    L.seed_everything(0, verbose=False)
    data = torch.utils.data.DataLoader(RandomTokens(320, 32, 8, seed=0), batch_size=4)
    module = CausalLMModule("tiny", warmup_steps=1, max_steps=2)
    trainer = _stage3_trainer(tmp_path, max_steps=2)
    trainer.fit(module, train_dataloaders=data, val_dataloaders=data)
    val = float(trainer.callback_metrics["val/loss"])
    ppl = float(trainer.callback_metrics["val/ppl"])
    assert 0 < val < 2 * math.log(320)  # near ln(vocab) for a barely trained model, never uninitialised memory
    assert math.isclose(ppl, math.exp(val), rel_tol=1e-3)


def test_embedding_unit_is_not_gathered_for_backward(tmp_path: object) -> None:
    """Stage 3 tells FSDP2 the embedding unit's backward needs no gather (it scatters the output gradient by token
    id) and leaves it out of the backward prefetch chain; its gradient still equals the unsharded model's."""
    import lightning as L
    import torch

    from lightning_llmopt import CausalLMModule
    from lightning_llmopt.testing.data import RandomTokens

    L.seed_everything(0, verbose=False)
    reference = Llama(LlamaConfig.from_preset("tiny"))
    tokens = RandomTokens(320, 32, 4, seed=0)
    batch = torch.utils.data.default_collate([tokens[i] for i in range(4)])
    loss = _reference_loss(reference, batch)
    loss.backward()

    class Check(L.Callback):
        def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: object) -> None:
            emb = pl_module.model.tok_embeddings
            state = emb._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.13: a list of groups per state
            if groups is None:  # torch 2.11: one group (or None) per state
                groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
            assert groups and all(g.unshard_in_backward is False for g in groups)
            block0 = next(iter(pl_module.model.layers.values()))
            prefetched = getattr(block0._get_fsdp_state(), "_states_to_backward_prefetch", None) or []
            assert emb._get_fsdp_state() not in prefetched
            grad = emb.weight.grad.full_tensor()
            torch.testing.assert_close(grad, reference.tok_embeddings.weight.grad, rtol=1e-5, atol=1e-6)
            self.checked = True

    module = CausalLMModule("tiny", warmup_steps=1, max_steps=1)
    check = Check()
    trainer = _stage3_trainer(tmp_path, max_steps=1, callbacks=[check])

    def load_reference(pl_module: L.LightningModule) -> None:
        from torch.distributed.tensor import distribute_tensor

        for name, p in pl_module.model.named_parameters():
            full = dict(reference.named_parameters())[name].detach()
            with torch.no_grad():
                p.copy_(distribute_tensor(full, p.device_mesh, p.placements))

    original = module.on_fit_start
    module.on_fit_start = lambda: (load_reference(module), original())[1]  # type: ignore[method-assign]
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([batch], batch_size=None))
    assert check.checked


def _reference_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    import torch.nn.functional as F

    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())


def _stage3_trainer(tmp_path: object, max_steps: int, callbacks: list | None = None) -> object:
    import lightning as L

    from lightning_llmopt.strategies import ZeroStrategy

    return L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ZeroStrategy(stage=3),
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=callbacks or [],
    )
