"""``LLMEngine.from_pretrained`` from our DCP checkpoint, a Lightning ``.ckpt`` and a Hugging Face folder; the
``llmopt generate`` command; the models' KV-cache protocol over paged storage."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_llmopt.cli.generate import main as generate_main
from lightning_llmopt.inference import BlockManager, KVPool, LLMEngine, PagedKVCache, SamplingParams
from lightning_llmopt.models import StaticKVCache, greedy_generate

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # single-process DCP

PROMPTS = [[5, 6, 7], list(range(20, 43))]
PARAMS = SamplingParams(max_tokens=6)


def _expected(model):
    return [o.token_ids for o in LLMEngine(model, num_blocks=32, block_size=8).generate(PROMPTS, PARAMS)]


def _check(engine, expected):
    assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS)] == expected


def test_from_our_dcp_checkpoint(tmp_path, model_factory):
    from lightning_llmopt.parallel.checkpoint import save_checkpoint

    model = model_factory(seed=1)
    state = {"model": {f"model.{k}": v.clone() for k, v in model.state_dict().items()}}
    save_checkpoint(state, tmp_path / "ckpts", 7, extra={"config": model.config.to_dict()})
    engine = LLMEngine.from_pretrained(tmp_path / "ckpts", device="cpu", num_blocks=32, block_size=8)
    _check(engine, _expected(model))


def test_from_lightning_ckpt(tmp_path, model_factory):
    model = model_factory(seed=2, tie_embeddings=True)
    path = tmp_path / "last.ckpt"
    torch.save(
        {
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
            "hyper_parameters": {"model": model.config.to_dict(), "learning_rate": 3e-4},
            "global_step": 10,
        },
        path,
    )
    engine = LLMEngine.from_pretrained(path, device="cpu", num_blocks=32, block_size=8)
    _check(engine, _expected(model))


def test_from_hf_folder(tmp_path, model_factory):
    pytest.importorskip("safetensors")
    from lightning_llmopt.models.hf import to_hf

    model = model_factory(seed=3)
    to_hf(model, tmp_path / "hf")
    engine = LLMEngine.from_pretrained(tmp_path / "hf", device="cpu", num_blocks=32, block_size=8)
    _check(engine, _expected(model))


def test_cli_generate(tmp_path, model_factory, capsys):
    model = model_factory(seed=4)
    path = tmp_path / "m.ckpt"
    torch.save(
        {
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
            "hyper_parameters": {"model": model.config.to_dict()},
        },
        path,
    )
    args = [
        str(path),
        "--tokens",
        "5,6,7",
        "--tokens",
        ",".join(map(str, PROMPTS[1])),
        "--max-tokens",
        "6",
        "--json",
        "--device",
        "cpu",
        "--num-blocks",
        "32",
        "--block-size",
        "8",
    ]
    outs = generate_main(args)
    assert [o.token_ids for o in outs] == _expected(model)
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [ln["token_ids"] for ln in lines] == _expected(model)
    events = generate_main(args[:-1] + ["8", "--stream"])
    assert sum(len(e.token_ids) for e in events) == 12
    with pytest.raises(SystemExit, match="rejected: prompt 0"):
        generate_main([str(path), "--tokens", "1,2", "--max-tokens", "500", "--device", "cpu"])
    with pytest.raises(SystemExit, match="invalid sampling parameters"):
        generate_main([str(path), "--tokens", "1", "--top-p", "2", "--device", "cpu"])
    with pytest.raises(SystemExit, match="exactly one of MODEL"):
        generate_main(["--tokens", "1", "--device", "cpu"])


def test_paged_cache_implements_the_kv_cache_protocol(model_factory):
    """The unmodified model decoding through PagedKVCache (rows scattered over shuffled blocks) matches the
    contiguous StaticKVCache step by step."""
    model = model_factory(seed=5)
    cfg = model.config
    prompt = torch.randint(0, 320, (2, 11), generator=torch.Generator().manual_seed(0))
    pool = KVPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 40, 4, torch.float32, "cpu")
    blocks = BlockManager(40, 4)
    for _ in range(7):  # fragment the free list so rows get non-contiguous blocks
        blocks.allocator.allocate()
    for b in (3, 5, 1):
        blocks.allocator.decref(b + 1)
    paged = PagedKVCache(pool, blocks, 2)
    static = StaticKVCache.for_model(model, 2, 30)
    with torch.no_grad():
        a = model(prompt, positions=torch.arange(11).expand(2, 11), kv_cache=paged)
        b = model(prompt, positions=torch.arange(11).expand(2, 11), kv_cache=static)
        torch.testing.assert_close(a, b)
        seq = prompt
        for step in range(8):
            nxt = a[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
            pos = torch.full((2, 1), 11 + step)
            a = model(nxt, positions=pos, kv_cache=paged)
            b = model(nxt, positions=pos, kv_cache=static)
            torch.testing.assert_close(a, b)
    assert seq.tolist() == greedy_generate(model, prompt, 8).tolist()
    paged.free()
    assert blocks.allocator.num_free == blocks.allocator.capacity - 4  # the 4 blocks held by hand at the start
