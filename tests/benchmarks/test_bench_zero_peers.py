"""bench_zero.py's ``single`` and transformers peers: variant selection, the refusals, the HF module's loss against
transformers' own, and the notes and table on hand-made rows (the launches themselves are a benchmark, not a test)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_llmopt.testing.scripts import load_script

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
bench = load_script(BENCH / "bench_zero.py", "_test_bench_zero_peers")


def _args(**kw: object) -> argparse.Namespace:
    base = dict(variants=None, no_liger=False, activation_checkpointing="none", preset="tiny", seq_len=16)
    base.update(warmup_steps=1, steps=2, smoke=True, strategy="fsdp-hf-liger")
    return argparse.Namespace(**{**base, **kw})


def test_variant_selection_and_refusals() -> None:
    assert bench._select_variants(_args(), 2) == list(bench.VARIANTS)  # the default run is unchanged
    assert bench._select_variants(_args(variants=["single"]), 1) == ["single"]
    picked = bench._select_variants(_args(variants=["zero3", "fsdp-hf-liger"], no_liger=True), 4)
    assert picked == ["zero3", "fsdp-hf"]
    with pytest.raises(SystemExit, match=r"at least 2 processes for zero3, got 1"):
        bench._select_variants(_args(variants=["single", "zero3"]), 1)
    with pytest.raises(SystemExit, match=r"--no-liger replaces fsdp-hf-liger.*\(zero3\)"):
        bench._select_variants(_args(variants=["zero3"], no_liger=True), 2)
    with pytest.raises(SystemExit, match=r"--activation-checkpointing full applies to fsdp-hf-liger fsdp-hf only"):
        bench._select_variants(_args(variants=["zero3"], activation_checkpointing="full"), 2)
    assert bench._estimate_key(_args(activation_checkpointing="full"), "single", 4) == (0, 1, "none")
    assert bench._estimate_key(_args(activation_checkpointing="full"), "fsdp-hf", 4) == (3, 4, "full")


def test_worker_refuses_before_any_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"single runs on one process, got WORLD_SIZE=2"):
        bench.run_worker(_args(strategy="single"))
    with pytest.raises(ValueError, match=r"--activation-checkpointing full applies to .* not to 'zero3'"):
        bench.run_worker(_args(strategy="zero3", activation_checkpointing="full"))


def test_missing_liger_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import fails whether or not it is installed
    with pytest.raises(ModuleNotFoundError, match=r"fsdp-hf-liger needs the liger-kernel package"):
        bench._apply_liger()


def test_hf_peer_on_cpu_runs_without_liger_and_checkpoints_decoder_layers() -> None:
    """The smoke path never patches transformers (Liger needs CUDA) and says so; ``full`` checkpoints every decoder
    layer. The module's loss (labels already shifted) equals cross-entropy of transformers' own logits."""
    from lightning.pytorch.strategies.fsdp import _setup_activation_checkpointing
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    strategy, module, info = bench._hf_peer(_args(activation_checkpointing="full"), cuda=False)
    assert info["liger"] is False and "without Liger" in info["liger_note"]
    assert module.hf_config["hidden_size"] == 64 and module.hf_config["num_hidden_layers"] == 2  # the tiny preset
    module.configure_model()
    assert module.model.config._attn_implementation == "sdpa" and module.model.config.use_cache is False
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, module.hf_config["vocab_size"], (2, 17), generator=g)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}  # as RandomTokens yields them
    logits = module.model(input_ids=batch["input_ids"]).logits
    expected = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
    torch.testing.assert_close(module.training_step(batch, 0), expected, rtol=1e-6, atol=1e-6)  # same fp32 math
    _setup_activation_checkpointing(module.model, strategy._activation_checkpointing_kwargs)  # as Lightning does
    layers = list(module.model.model.layers)
    assert all(
        isinstance(m, CheckpointWrapper) and isinstance(m._checkpoint_wrapped_module, LlamaDecoderLayer) for m in layers
    )
    torch.testing.assert_close(module.training_step(batch, 0), expected, rtol=1e-6, atol=1e-6)
    opt = module.configure_optimizers()["optimizer"]
    no_decay = {id(p) for p in opt.param_groups[1]["params"]}
    names = {n for n, p in module.model.named_parameters() if id(p) in no_decay}
    assert names and all("norm" in n or "embed_tokens" in n for n in names)


def _row(variant: str, tok: float, mem: float, **kw: object) -> dict:
    per_gpu = tok if variant == "single" else tok / 2
    row = {"variant": variant, "tokens_per_s": tok, "tokens_per_s_per_gpu": per_gpu, "peak_allocated_gib": mem}
    return {**row, "run_date": "d", **kw}


def test_notes_and_table_with_the_new_variants(capsys: pytest.CaptureFixture[str]) -> None:
    rows = {
        "single": _row("single", 100.0, 10.0),
        "zero3": _row("zero3", 180.0, 5.0),
        "fsdp-hf-liger": _row("fsdp-hf-liger", 150.0, 4.0, liger=True, activation_checkpointing="full"),
        "fsdp-hf": {"variant": "fsdp-hf", "error": "OOM on rank 0", "run_date": "d"},
    }
    notes = bench._goal_notes(rows, cuda=True)
    peer = next(n for n in notes if n.startswith("peer: zero3 vs fsdp-hf-liger"))
    assert "with Liger, activation checkpointing full" in peer and "1.200x tokens/s, 1.250x peak" in peer
    assert "peer: zero3 vs fsdp-hf (transformers LlamaForCausalLM, Lightning FSDP1; Liger n/a" in "\n".join(notes)
    (scaling,) = [n for n in notes if n.startswith("scaling:")]
    assert "zero3 0.900x, fsdp-hf-liger 0.750x, fsdp-hf n/ax" in scaling
    bench._print_table(list(rows.values()))
    table = capsys.readouterr().out
    assert "fsdp-hf-liger" in table and "0.900" in table and "OOM on rank 0" in table
