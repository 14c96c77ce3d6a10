"""Fine-tuning a pretrained Hugging Face folder: ``CausalLMModule(pretrained=...)`` on a transformers tiny Llama
and a tiny Qwen2 (random configs, ``save_pretrained``), under ZeRO-3 on 2 gloo ranks, under TP=2 and under PP=2
(each rank reading only its shards or its stages), against the same fine-tuning in one process; a tied checkpoint
under PP is refused by name; and ``from_hf`` inside a meta-device context."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_llmopt import CausalLMModule
from lightning_llmopt.models import from_hf

_spec = importlib.util.spec_from_file_location(
    "_hf_pretrained_jobs", Path(__file__).with_name("_hf_pretrained_jobs.py")
)
assert _spec is not None and _spec.loader is not None
J = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("_hf_pretrained_jobs", J)
_spec.loader.exec_module(J)

# fp32 parity of a sharded run with one process, as tests/strategies/test_nd_parallel.py: loss and parameters to
# 1e-6 relative after several AdamW steps (reduction order is the only difference).
TOL = 1e-6


def _save_transformers(kind: str, folder: Path, n_layers: int = 2) -> Path:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=True))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("pretrained")
    return {kind: str(_save_transformers(kind, root / kind)) for kind in ("llama", "qwen2")}


@pytest.fixture(scope="module")
def llama4(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 4-block transformers Llama (untied): two blocks per stage under PP=2."""
    return str(_save_transformers("llama", tmp_path_factory.mktemp("pretrained_pp") / "llama4", n_layers=4))


def _flat(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([params[k].reshape(-1).double() for k in sorted(params)])


def test_from_hf_under_meta_device_matches_transformers(folders: dict[str, str]) -> None:
    transformers = pytest.importorskip("transformers")
    tokens = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    for folder in folders.values():
        with torch.device("meta"):  # what a sharded strategy's init context does around configure_model
            ours = from_hf(folder)
        assert not any(p.is_meta for p in ours.parameters()) and not ours.rope.is_meta
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        with torch.no_grad():
            # fp32, same weights, tiny depth: the two implementations differ by rounding only
            torch.testing.assert_close(ours(tokens), ref(tokens).logits, rtol=1e-4, atol=1e-5)


def test_pretrained_module_builds_from_the_folder(folders: dict[str, str]) -> None:
    module = CausalLMModule(pretrained=folders["qwen2"])
    assert module.config.qkv_bias and module.config.tie_embeddings and module.config.vocab_size == 128
    module.configure_model()  # a plain strategy: the weights are read right away
    assert module.model is not None
    reference = from_hf(folders["qwen2"])
    torch.testing.assert_close(module.model.state_dict(), reference.state_dict(), rtol=0, atol=0)
    sharded = CausalLMModule(pretrained=folders["qwen2"])
    with torch.device("meta"):  # a sharded strategy's init context: built on meta, read after sharding
        sharded.configure_model()
    assert sharded.model is not None and sharded.model.norm.weight.is_meta
    sharded.model.to_empty(device="cpu")  # what the strategy's materialisation does (random values then)
    sharded.model.output.weight = sharded.model.tok_embeddings.weight  # to_empty unties; strategies tie again
    sharded.load_pretrained()
    assert sharded.pretrained_elements_read == sum(p.numel() for p in reference.parameters())  # tied: read once
    torch.testing.assert_close(sharded.model.state_dict(), reference.state_dict(), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"pass one of model \('tiny'\) and pretrained"):
        CausalLMModule("tiny", pretrained=folders["llama"])
    with pytest.raises(FileNotFoundError, match="pretrained \\('nowhere'\\) is not a folder"):
        CausalLMModule(pretrained="nowhere")


def test_pretrained_parity_zero3_and_tp2(dist_pool: Any, folders: dict[str, str]) -> None:
    order = [folders["llama"], folders["qwen2"]]
    layouts = ["zero3", "tp2"]
    results = dist_pool(2).run(J.parity_job, order, layouts)[0]
    for i, folder in enumerate(order):
        ref = J.fit(folder, None)
        start = from_hf(folder)
        # the first loss is the pretrained weights' own: a randomly initialised model would differ at step 0
        with torch.no_grad():
            batch = ref["first_batch"]
            first = CausalLMModule.loss_fn(start(batch["input_ids"]), batch["labels"])
        assert abs(ref["losses"][0] - float(first)) <= TOL * float(first)
        for j, layout in enumerate(layouts):
            got = results[i * len(layouts) + j]
            losses, want = torch.tensor(got["losses"]), torch.tensor(ref["losses"])
            assert len(losses) == J.STEPS
            assert float(((losses - want).abs() / want).max()) <= TOL, (folder, layout, got["losses"], ref["losses"])
            a, b = _flat(got["params"]), _flat(ref["params"])
            assert float((a - b).norm() / b.norm()) <= TOL, (folder, layout)
            # each rank read only its shards: about half of the weights (replicated norms are read whole)
            total = sum(p.numel() for p in start.parameters())
            assert got["read"] is not None and got["read"] < 0.6 * total, (layout, got["read"], total)
        assert ref["read"] is None  # one process: the folder is read whole in configure_model


def test_pretrained_parity_pipeline_parallel(dist_pool: Any, llama4: str) -> None:
    """PP=2 with the default schedule (1f1b, 2 micro-batches, ZeRO-3 default: built on meta): each rank reads only
    its stage's weights (blocks 0-1 + embedding, blocks 2-3 + final norm + head); and interleaved 1F1B (V=2, default
    ZeRO-2: built on the CPU, the folder read whole in configure_model, then pruned). Both fine-tune as one process."""
    layouts = ["pp2", "pp2_interleaved"]
    ranks = dist_pool(2).run(J.parity_job, [llama4], layouts)
    ref = J.fit(llama4, None)
    start = from_hf(llama4)
    with torch.no_grad():  # the first loss is the pretrained weights' own
        batch = ref["first_batch"]
        first = CausalLMModule.loss_fn(start(batch["input_ids"]), batch["labels"])
    assert abs(ref["losses"][0] - float(first)) <= TOL * float(first)
    params = {k: p.detach() for k, p in start.named_parameters()}
    b = _flat(ref["params"])
    assert float((b - _flat(params)).norm() / b.norm()) > 1e-4  # the weights moved
    for j, layout in enumerate(layouts):
        got = ranks[0][j]
        losses, want = torch.tensor(got["losses"]), torch.tensor(ref["losses"])
        assert len(losses) == J.STEPS
        loss_err = float(((losses - want).abs() / want).max())
        assert loss_err <= TOL, (layout, got["losses"], ref["losses"])
        assert sorted(got["params"]) == sorted(ref["params"]), layout  # every parameter, on some stage, full names
        param_err = float((_flat(got["params"]) - b).norm() / b.norm())
        assert param_err <= TOL, (layout, param_err)
        print(f"{layout} pretrained: loss err {loss_err:.2e}, param err {param_err:.2e}")  # shown with -s
    # streamed (meta build): each rank read exactly its stage's parameters, together the whole model once
    blocks = {0: ("tok_embeddings.", "layers.0.", "layers.1."), 1: ("layers.2.", "layers.3.", "norm.", "output.")}
    total = sum(p.numel() for p in params.values())
    for rank, prefixes in blocks.items():
        stage = sum(p.numel() for k, p in params.items() if k.startswith(prefixes))
        assert ranks[rank][0]["read"] == stage < total, (rank, ranks[rank][0]["read"], stage, total)
    assert sum(r[0]["read"] for r in ranks) == total
    assert all(r[1]["read"] is None for r in ranks)  # not built on meta: from_hf read the folder in configure_model
    print(f"pp2 read {[r[0]['read'] for r in ranks]} of {total}")


def test_pretrained_tied_checkpoint_under_pipeline_parallel_is_named(dist_pool: Any, folders: dict[str, str]) -> None:
    """A tied checkpoint (Qwen2 here) cannot be cut into stages (embedding and head share one tensor): every rank
    fails in the strategy's setup, before the schedule's first send, naming both values."""
    for text in dist_pool(2).run(J.error_of, folders["qwen2"], "pp2"):
        assert re.search(r"ValueError: pipeline_parallel \(2\) with tie_embeddings=True", text), text
