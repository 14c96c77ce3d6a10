"""``llmopt consolidate``: DCP checkpoints (2 ranks with DTensor shards, one process) to Hugging Face safetensors,
checked against the original model through transformers and through our ``from_hf``, one shard in memory at a time."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_llmopt.cli.consolidate as consolidate_mod
from lightning_llmopt.cli.consolidate import consolidate, main
from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.models.hf import from_hf
from lightning_llmopt.parallel.checkpoint import IncompleteCheckpointError, save_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # single-process DCP saves

TINY: dict[str, Any] = {}
QWEN_TIED: dict[str, Any] = dict(qkv_bias=True, tie_embeddings=True, n_layers=3)


def _model(overrides: dict[str, Any]) -> Llama:
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_preset("tiny", **overrides))
    with torch.no_grad():  # non-trivial norms and biases, so a swapped or missing tensor shows in the logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, 320, (2, 17), generator=torch.Generator().manual_seed(1))


def _save_sharded(root: str) -> str:
    """Worker: each rank saves its Shard(0) pieces of the LightningModule-prefixed state, with the config."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model = _model(TINY)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    sharded = {f"model.{k}": distribute_tensor(v.detach(), mesh, [Shard(0)]) for k, v in model.state_dict().items()}
    assert all(v.to_local().shape[0] < v.shape[0] for v in sharded.values())  # really split across the ranks
    state = {"model": sharded, "config": model.config.to_dict(), "step": 5}
    return str(save_checkpoint(state, root, 5))


def _record_loads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Patch the loader used by consolidate to record the tensor bytes requested by each call."""
    sizes: list[int] = []
    real = consolidate_mod.dcp.load

    def recording_load(state: dict[str, Any], **kwargs: Any) -> None:
        def nbytes(x: Any) -> int:
            if isinstance(x, torch.Tensor):
                return x.numel() * x.element_size()
            return sum(nbytes(v) for v in x.values()) if isinstance(x, dict) else 0

        sizes.append(nbytes(state))
        real(state, **kwargs)

    monkeypatch.setattr(consolidate_mod.dcp, "load", recording_load)
    return sizes


def _check_outputs(out: Path, model: Llama, dtype: torch.dtype = torch.float32) -> None:
    tokens = _tokens()
    ours = from_hf(out)
    assert dataclasses.replace(ours.config, multiple_of=32) == model.config  # multiple_of is not exported
    for name, p in model.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name], p.to(dtype), rtol=0, atol=0, msg=name)
    model = model.to(dtype)
    model.reset_buffers()  # an fp32 RoPE table, as from_hf builds it (`.to` also cast the buffer)
    with torch.no_grad():
        expected = model(tokens).float()
        torch.testing.assert_close(ours(tokens).float(), expected, rtol=0, atol=0)
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(tokens).logits
    # A different implementation in fp32 on exactly the same weights: float rounding only (bf16 weights are
    # upcast to fp32 by from_pretrained, our bf16 reference is compared after the same upcast below).
    reference = Llama(model.config)
    reference.load_state_dict({k: v.float() for k, v in ours.state_dict().items()})
    with torch.no_grad():
        torch.testing.assert_close(theirs, reference(tokens), rtol=1e-4, atol=1e-5)


def test_two_rank_dtensor_checkpoint(dist_pool: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ckpt"
    folder = dist_pool(2).run(_save_sharded, str(root))[0]
    model = _model(TINY)
    sizes = _record_loads(monkeypatch)
    max_bytes = 48_000
    written = consolidate(root, tmp_path / "hf", max_shard_size=max_bytes)  # the root: newest complete step
    total = sum(p.numel() * 4 for p in model.parameters())
    largest = max(p.numel() * 4 for p in model.parameters())
    tensor_loads = [s for s in sizes if s > 0]  # the config entries are loaded first, as bytes
    assert len(written) == len(tensor_loads) > 2
    assert sum(tensor_loads) == total  # every tensor read exactly once
    assert max(tensor_loads) <= max(max_bytes, largest)  # never more than one shard's worth at once
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [p.name for p in written]
    assert Path(folder).name == "step-00000005"
    _check_outputs(tmp_path / "hf", model)


def test_single_process_config_in_marker_bf16(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(QWEN_TIED)
    state = {"model": {f"model.{k}": v for k, v in model.state_dict().items()}, "step": 3}
    folder = save_checkpoint(state, tmp_path / "ckpt", 3, extra={"config": model.config.to_dict()})
    sizes = _record_loads(monkeypatch)
    written = main([str(folder), str(tmp_path / "hf"), "--dtype", "bf16", "--max-shard-size", "20KB"])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["torch_dtype"] == "bfloat16"  # inferred from qkv_bias
    assert len(written) == len(sizes) > 2
    largest = max(p.numel() * 4 for p in model.parameters())
    assert max(sizes) <= max(20_000, largest)  # fp32 as loaded, planned in the larger dtype
    _check_outputs(tmp_path / "hf", model, torch.bfloat16)


def test_unprefixed_checkpoint_without_config_needs_preset(tmp_path: Path) -> None:
    model = _model(TINY)
    folder = save_checkpoint({"model": model.state_dict()}, tmp_path / "ckpt", 1)
    with pytest.raises(ValueError, match=r"stores no model config .* --preset NAME or --config-json PATH"):
        consolidate(folder, tmp_path / "hf")
    written = main([str(folder), str(tmp_path / "hf"), "--preset", "tiny", "--arch", "mistral"])
    assert [p.name for p in written] == ["model.safetensors"]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "mistral"
    _check_outputs(tmp_path / "hf", model)
    with pytest.raises(ValueError, match=r"tensor\(s\) do not match the config: tok_embeddings.weight: \(320, 64\)"):
        consolidate(folder, tmp_path / "bad", config=LlamaConfig.from_preset("tiny", dim=128, n_heads=8))


def test_incomplete_checkpoint_is_refused(tmp_path: Path) -> None:
    model = _model(TINY)
    root = tmp_path / "ckpt"
    state = {"model": model.state_dict(), "config": model.config.to_dict()}
    save_checkpoint(state, root, 1)
    folder = save_checkpoint(state, root, 2)
    (folder / "COMPLETE").unlink()
    with pytest.raises(
        IncompleteCheckpointError,
        match=r"no COMPLETE marker .* newest complete checkpoint is .*"
        r"step-00000001",
    ):
        consolidate(folder, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()  # refused before writing anything
    partial_only = tmp_path / "partial"
    (partial_only / "step-00000004.partial").mkdir(parents=True)
    with pytest.raises(IncompleteCheckpointError, match="no complete checkpoint under"):
        consolidate(partial_only, tmp_path / "hf")
    with pytest.raises(ValueError, match=r"arch 'llama' has no q/k/v biases|requires qkv_bias"):
        consolidate(root, tmp_path / "hf", arch="qwen2")


def test_pretrained_finetune_checkpoint_consolidates_to_a_drop_in_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A transformers Llama folder with its tokenizer -> ``CausalLMModule(pretrained=...)`` -> a sharded checkpoint
    as ZeroStrategy writes it (the Lightning entries beside the shards) -> ``llmopt consolidate`` -> transformers
    loads the model (same logits as ours) and the tokenizer (same ids), and the folder has a generation config."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from lightning_llmopt import CausalLMModule
    from lightning_llmopt.data import ByteTokenizer
    from lightning_llmopt.strategies.zero_checkpoint import to_bytes

    torch.manual_seed(0)
    src = tmp_path / "hub"
    cfg = transformers.LlamaConfig(
        vocab_size=258,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=256,  # the byte tokenizer's: save_pretrained writes them to generation_config.json
        eos_token_id=257,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(src)
    ByteTokenizer().save_pretrained(src)
    module = CausalLMModule(pretrained=str(src))
    module.configure_model()
    assert module.model is not None
    with torch.no_grad():  # stands in for fine-tuning: the export must carry these weights, not the Hub's
        module.model.norm.weight.mul_(1.5)
    state = {
        "model": {f"model.{k}": v for k, v in module.model.state_dict().items()},
        "lightning": {"llmopt_tokenizer": to_bytes(module.tokenizer_spec())},
    }
    folder = save_checkpoint(state, tmp_path / "ckpt", 4, extra={"config": module.config.to_dict()})
    main([str(folder), str(tmp_path / "hf")])
    assert re.search(r"\[consolidate\] (\d+)/\1 tensors \(100\.0%\)", capsys.readouterr().err)
    names = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= names
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (256, 257)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "def f(x): return 'héllo'"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == ByteTokenizer().encode(text)
    with torch.no_grad():
        # the same fp32 weights in two implementations: rounding only (as _check_outputs)
        torch.testing.assert_close(hf(ids).logits, module.model(ids), rtol=1e-4, atol=1e-5)
