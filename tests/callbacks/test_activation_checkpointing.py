"""Activation checkpointing: same gradients as the model without it, fewer saved activations, unchanged names."""

from __future__ import annotations

import copy
import math

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_llmopt import CausalLMModule
from lightning_llmopt.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.parallel.activation_checkpointing import (
    activation_memory,
    apply_activation_checkpointing,
    checkpointed_blocks,
    find_blocks,
    recompute_overhead,
    remove_activation_checkpointing,
    select_blocks,
)

POLICIES = ["full", "every_n", "sqrt", "selective"]


class RandomTokens(Dataset):
    def __init__(self, n: int = 16, seq_len: int = 32, vocab: int = 320) -> None:
        g = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, vocab, (n, seq_len + 1), generator=g)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i, :-1], "labels": self.rows[i, 1:]}


@pytest.fixture(scope="module")
def llama() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.from_preset("tiny", n_layers=4))


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(1))  # (B, T)


def _grads(model: nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("policy", POLICIES)
def test_gradients_match_model_without_checkpointing(llama, tokens, policy):
    reference = _grads(llama, tokens)
    model = copy.deepcopy(llama)
    assert apply_activation_checkpointing(model, policy)
    grads = _grads(model, tokens)
    # Recomputation replays the same CPU kernels on the same inputs in the same order, so fp32 results are bitwise
    # identical (selective recomputes only elementwise ops, which are deterministic).
    assert grads.keys() == reference.keys()
    for name in reference:
        assert torch.equal(grads[name], reference[name]), name


def test_number_of_wrapped_blocks(llama):
    n = 4
    counts = {p: len(apply_activation_checkpointing(copy.deepcopy(llama), p, every_n=3)) for p in POLICIES}
    assert counts == {"full": n, "every_n": math.ceil(n / 3), "sqrt": round(math.sqrt(n)), "selective": n}
    assert apply_activation_checkpointing(copy.deepcopy(llama), "every_n", every_n=2) == ["0", "2"]
    assert apply_activation_checkpointing(copy.deepcopy(llama), "none") == []
    for layers in (1, 9, 22, 32):
        chosen = select_blocks(layers, "sqrt")
        assert len(chosen) == max(1, round(math.sqrt(layers)))
        assert len(set(chosen)) == len(chosen) and chosen == sorted(chosen) and chosen[-1] < layers
        gaps = [b - a for a, b in zip(chosen, chosen[1:], strict=False)]
        assert not gaps or max(gaps) - min(gaps) <= 1  # evenly spaced


def test_saved_activation_bytes_ordering(llama, tokens):
    measured = {}
    for policy in ["none", "every_n", *POLICIES]:
        model = copy.deepcopy(llama)
        apply_activation_checkpointing(model, policy)
        measured[policy] = activation_memory(model, lambda m=model: m(tokens))
    assert measured["full"] < measured["every_n"] < measured["none"]
    assert measured["full"] < measured["selective"] < measured["none"]
    # Full checkpointing keeps each block's input (B, T, dim) fp32 instead of its internals.
    block_input = tokens.numel() * llama.config.dim * 4
    assert measured["none"] - measured["full"] > 4 * block_input


def test_state_dict_keys_unchanged_and_loadable(llama):
    model = copy.deepcopy(llama)
    apply_activation_checkpointing(model, "selective")
    assert list(model.state_dict()) == list(llama.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in llama.named_parameters()]
    plain = Llama(llama.config)
    plain.load_state_dict(model.state_dict())  # strict
    model.load_state_dict(llama.state_dict())


def test_idempotency_removal_and_deepcopy(llama, tokens):
    model = copy.deepcopy(llama)
    apply_activation_checkpointing(model, "full")
    with pytest.raises(RuntimeError, match="already applied"):
        apply_activation_checkpointing(model, "sqrt")
    clone = copy.deepcopy(model)
    assert clone.layers["1"].forward.__self__ is clone.layers["1"]  # bound to the copy, not the original
    assert checkpointed_blocks(clone) == {f"layers.{i}": "full" for i in range(4)}
    assert remove_activation_checkpointing(model) == 4 and checkpointed_blocks(model) == {}
    assert "forward" not in model.layers["0"].__dict__
    assert apply_activation_checkpointing(model, "sqrt") == ["0", "2"]


def test_bad_arguments_name_the_value(llama):
    with pytest.raises(ValueError, match="'most'"):
        apply_activation_checkpointing(copy.deepcopy(llama), "most")
    with pytest.raises(ValueError, match=r"every_n \(0\)"):
        apply_activation_checkpointing(copy.deepcopy(llama), "every_n", every_n=0)
    with pytest.raises(ValueError, match="every_n"):
        ActivationCheckpointing("every_n", every_n=-2)
    with pytest.raises(ValueError, match="no block container"):
        apply_activation_checkpointing(nn.Sequential(nn.Linear(2, 2)), "full")


def test_blocks_found_in_nested_models(llama):
    class Wrapper(nn.Module):  # the layout of transformers' LlamaForCausalLM: model.model.layers
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Module()
            self.model.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    wrapper = Wrapper()
    assert [name for name, _ in find_blocks(wrapper)] == ["0", "1", "2"]
    assert apply_activation_checkpointing(wrapper, "full") == ["0", "1", "2"]
    assert checkpointed_blocks(wrapper) == {f"model.layers.{i}": "full" for i in range(3)}
    x = torch.randn(2, 4, requires_grad=True)
    wrapper.model.layers[0](x).sum().backward()
    assert x.grad is not None


def test_recompute_overhead(llama):
    full, half, selective = (copy.deepcopy(llama) for _ in range(3))
    apply_activation_checkpointing(full, "full")
    apply_activation_checkpointing(half, "every_n", every_n=2)
    apply_activation_checkpointing(selective, "selective")
    assert 0 < recompute_overhead(full, 48) < 1 / 3  # one extra forward of the blocks, not of the head
    assert recompute_overhead(full, 48) == pytest.approx(2 * recompute_overhead(half, 48))
    assert recompute_overhead(selective, 48) == 0.0
    assert recompute_overhead(llama, 48) == 0.0


# --------------------------------------------------------------------------- the callback in a Trainer


class RecordingStrategy(SingleDeviceStrategy):
    """Records which blocks were checkpointed when the strategy set the model up (where DDP/FSDP would wrap it)."""

    seen: dict[str, str] | None = None

    def setup(self, trainer: L.Trainer) -> None:
        self.seen = checkpointed_blocks(trainer.lightning_module)
        super().setup(trainer)


def _fit(tmp_path, callbacks, max_steps=3, ckpt_path=None, strategy=None, module=None):
    L.seed_everything(0, verbose=False)
    module = module or CausalLMModule("tiny", warmup_steps=1)
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, callbacks=callbacks,
                        default_root_dir=tmp_path, strategy=strategy or "auto")
    trainer.fit(module, DataLoader(RandomTokens(), batch_size=4), ckpt_path=ckpt_path)
    return trainer, module


def test_callback_in_trainer_matches_training_without_it(tmp_path):
    strategy = RecordingStrategy(device=torch.device("cpu"))
    callback = ActivationCheckpointing("full")
    trainer, module = _fit(tmp_path, [callback], strategy=strategy)
    _, plain = _fit(tmp_path, [])
    assert strategy.seen == {"model.layers.0": "full", "model.layers.1": "full"}  # applied before strategy.setup
    assert callback.applied == ["layers.0", "layers.1"]
    assert "configure_model" not in module.__dict__  # the temporary hook is gone
    for (name, p), q in zip(module.model.named_parameters(), plain.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    m = trainer.callback_metrics
    assert 0 < m["ac/saved_activation_bytes"] < m["ac/saved_activation_bytes_no_ac"]
    assert 0 < m["ac/recompute_overhead"] < 1 / 3


def test_callback_state_checkpoint_and_resume(tmp_path):
    trainer, module = _fit(tmp_path, [ActivationCheckpointing("every_n", every_n=1, report=False)], max_steps=2)
    path = tmp_path / "ac.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["callbacks"]
    assert {"policy": "every_n", "every_n": 1, "applied": ["layers.0", "layers.1"]} in saved.values()
    resumed = ActivationCheckpointing("selective", report=False)
    with pytest.warns(UserWarning, match="policy='every_n'"):
        trainer2, module2 = _fit(tmp_path, [resumed], max_steps=3, ckpt_path=path)
    assert trainer2.global_step == 3
    assert checkpointed_blocks(module2.model) == {"layers.0": "selective", "layers.1": "selective"}
    # A second fit of the same module finds its model already built and checkpointed: nothing is re-applied.
    again = ActivationCheckpointing("selective", report=False)
    _fit(tmp_path, [again], max_steps=1, module=module2)
    assert again.applied == ["layers.0", "layers.1"]
