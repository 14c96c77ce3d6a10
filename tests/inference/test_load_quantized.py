"""Our engine loads our own quantized exports: ``llmopt quantize`` (compressed-tensors) and ``save_gptq`` folders
through ``LLMEngine.from_pretrained`` and ``llmopt generate`` give the greedy tokens of the in-memory quantized
model; the quantize CLI writes the source's architecture (Qwen2 here, no ``--arch``) and a drop-in folder."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from lightning_llmopt.cli import quantize as quantize_cli
from lightning_llmopt.cli.generate import main as generate_main
from lightning_llmopt.data import ByteTokenizer
from lightning_llmopt.inference import LLMEngine, SamplingParams
from lightning_llmopt.models import to_hf
from lightning_llmopt.quantization import QuantConfig, quantize_model, save_gptq

pytest.importorskip("safetensors")

PROMPTS = [[5, 6, 7], list(range(20, 43))]
PARAMS = SamplingParams(max_tokens=6)
ENGINE = dict(num_blocks=32, block_size=8)


def _greedy(engine: LLMEngine) -> list[list[int]]:
    return [c.outputs[0].token_ids for c in engine.generate(PROMPTS, PARAMS)]


def _cli_tokens(folder: Path, capsys: pytest.CaptureFixture[str]) -> list[list[int]]:
    capsys.readouterr()  # drop what came before
    args = [str(folder), "--tokens", "5,6,7", "--tokens", ",".join(map(str, PROMPTS[1])), "--max-tokens", "6"]
    generate_main([*args, "--json", "--device", "cpu", "--dtype", "fp32", "--num-blocks", "32", "--block-size", "8"])
    return [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]


def test_quantize_cli_qwen2_loads_in_engine_and_generate(tmp_path: Path, model_factory, capsys) -> None:
    model = model_factory(seed=7, qkv_bias=True)  # a Qwen2-shaped model: q/k/v biases
    src = to_hf(model, tmp_path / "hf", tokenizer=ByteTokenizer())
    assert json.loads((src / "config.json").read_text())["model_type"] == "qwen2"
    out = quantize_cli.main(
        [str(src), str(tmp_path / "q"), "--method", "rtn", "--bits", "4", "--group-size", "32", "--device", "cpu"]
    )
    err = capsys.readouterr().err  # progress over the 14 quantized layers (the head is skipped), off a terminal
    assert "[quantize] started: 14 layers" in err and "[quantize] 14/14 layers (100.0%)" in err
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {p.name for p in out.iterdir()}
    in_memory = copy.deepcopy(model)
    quantize_model(in_memory, QuantConfig(bits=4, group_size=32))  # what the CLI ran, in this process
    want = _greedy(LLMEngine(in_memory, **ENGINE))
    engine = LLMEngine.from_pretrained(out, device="cpu", **ENGINE)
    assert engine.tokenizer is not None and engine.tokenizer.encode("hé") == ByteTokenizer().encode("hé")
    assert _greedy(engine) == want
    assert _cli_tokens(out, capsys) == want
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tokens = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        # transformers decompresses the same codes and scales: the two fp32 forwards differ by rounding only
        torch.testing.assert_close(theirs(tokens).logits, in_memory(tokens), rtol=1e-4, atol=1e-5)
    assert transformers.AutoTokenizer.from_pretrained(str(out)).encode("hé") == ByteTokenizer().encode("hé")


def test_gptq_folder_loads_in_engine_and_generate(tmp_path: Path, model_factory, capsys) -> None:
    model = model_factory(seed=8)
    with torch.no_grad():  # fp16-representable floats: the GPTQ format stores every float tensor in fp16
        for p in model.parameters():
            p.copy_(p.half().float())
    quantize_model(model, QuantConfig(bits=4, group_size=32, scale_dtype=torch.float16))
    out = save_gptq(model, tmp_path / "gptq")
    want = _greedy(LLMEngine(model, **ENGINE))
    assert _greedy(LLMEngine.from_pretrained(out, device="cpu", dtype=torch.float32, **ENGINE)) == want
    assert _cli_tokens(out, capsys) == want
