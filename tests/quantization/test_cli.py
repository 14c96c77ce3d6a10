"""``llmopt quantize`` and ``llmopt export``: a float checkpoint (HF folder or Lightning .ckpt) to GPTQ and
compressed-tensors folders that load back into our model with the codes unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_llmopt.cli import export as export_cli
from lightning_llmopt.cli import quantize as quantize_cli
from lightning_llmopt.layers.quantized_linear import QuantizedLinear
from lightning_llmopt.models import Llama, LlamaConfig, to_hf
from lightning_llmopt.quantization import QuantConfig, load_quantized, quantize_model


def _model() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.from_preset("tiny", ffn_hidden_dim=128, init_std=0.05)).eval()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_quantize_gptq_then_export(tmp_path: Path) -> None:
    model = _model()
    src = to_hf(model, tmp_path / "hf")
    text = tmp_path / "calib.txt"
    text.write_text("def f(x):\n    return x * 2\n" * 400)
    out = quantize_cli.main(
        [
            str(src),
            str(tmp_path / "gptq"),
            "--method",
            "gptq",
            "--bits",
            "4",
            "--group-size",
            "32",
            "--format",
            "gptq",
            "--data",
            str(text),
            "--tokenizer",
            "byte",
            "--calib-samples",
            "8",
            "--seq-len",
            "32",
            "--device",
            "cpu",
        ]
    )
    q = load_quantized(out, dtype=torch.float32)
    assert isinstance(q.layers["1"].feed_forward.w1, QuantizedLinear) and q.layers["1"].feed_forward.w1.bits == 4
    rtn = _model()
    quantize_model(rtn, QuantConfig(bits=4, group_size=32))
    tokens = torch.tensor([list(b"def g(y):\n    return y * 3\n")])  # text like the calibration data
    with torch.no_grad():
        ref, got, baseline = model(tokens), q(tokens), rtn(tokens)
    assert _rel_err(got, ref) < _rel_err(baseline, ref)  # GPTQ calibrated on such text beats round to nearest
    ct = export_cli.main([str(out), str(tmp_path / "ct"), "--format", "compressed-tensors"])
    again = load_quantized(ct)
    assert torch.equal(again.layers["0"].attention.wv.qweight, q.layers["0"].attention.wv.qweight)


def test_quantize_lightning_checkpoint_with_rtn(tmp_path: Path) -> None:
    model = _model()
    ckpt = tmp_path / "last.ckpt"  # the keys of a CausalLMModule checkpoint
    torch.save(
        {
            "hyper_parameters": {"model": model.config.to_dict()},
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        },
        ckpt,
    )
    out = quantize_cli.main(
        [str(ckpt), str(tmp_path / "ct"), "--method", "rtn", "--bits", "8", "--group-size", "0", "--device", "cpu"]
    )
    q = load_quantized(out)
    assert q.layers["0"].attention.wq.group_size == 64  # per channel: one group spanning the 64 inputs
    tokens = torch.randint(0, 320, (2, 16))
    with torch.no_grad():
        assert _rel_err(q(tokens), model(tokens)) < 0.01


def test_export_keeps_architecture_and_tokenizer(tmp_path: Path) -> None:
    """A Qwen2-shaped quantized folder re-exported without --arch stays qwen2, with its tokenizer files and
    generation config; both load back to the same codes."""
    from lightning_llmopt.data import ByteTokenizer

    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_preset("tiny", qkv_bias=True, init_std=0.05)).eval()
    src = to_hf(model, tmp_path / "hf", tokenizer=ByteTokenizer())
    ct = quantize_cli.main([str(src), str(tmp_path / "ct"), "--method", "rtn", "--group-size", "32", "--device", "cpu"])
    out = export_cli.main([str(ct), str(tmp_path / "gptq"), "--format", "gptq"])
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["quantization_config"]["quant_method"] == "gptq"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_text() == (ct / name).read_text(), name
    a, b = load_quantized(ct), load_quantized(out)
    assert torch.equal(a.layers["0"].attention.wq.qweight, b.layers["0"].attention.wq.qweight)


def _fail(*args: object, **kwargs: object) -> None:
    raise AssertionError("calibration or quantization started before the group sizes were checked")


def test_quantize_names_layers_the_group_size_does_not_divide_before_calibration(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """A 172-wide layer (the FFN down projection) with the default --group-size 128: one line naming the layers and
    --group-size 0, before any calibration text is read or any layer is quantized; --group-size 0 then works."""
    from lightning_llmopt.cli.main import main as llmopt

    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_preset("tiny", dim=256, ffn_hidden_dim=172, init_std=0.05)).eval()
    src = to_hf(model, tmp_path / "hf")
    monkeypatch.setattr(quantize_cli, "calibration_batches", _fail)
    monkeypatch.setattr(quantize_cli, "quantize_model", _fail)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        llmopt(["quantize", str(src), str(tmp_path / "q"), "--method", "gptq", "--device", "cpu"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "[quantize] calibration text" not in err, err
    line = lines[0]
    assert line.startswith("llmopt quantize: error: --group-size 128 does not divide"), line
    assert "layers.*.feed_forward.w2 (172 inputs, 2 layers)" in line and "attention" not in line, line
    assert "2 of 14 layers" in line and "pass --group-size 0 (one scale per output channel)" in line, line
    assert "or --group-size" not in line, line  # 172 = 4 * 43: no power of two >= 32 divides it
    assert not (tmp_path / "q").exists()

    monkeypatch.undo()  # the way out the message names works
    out = quantize_cli.main([str(src), str(tmp_path / "q"), "--method", "rtn", "--group-size", "0", "--device", "cpu"])
    assert load_quantized(out).layers["0"].feed_forward.w2.group_size == 172


def test_group_size_check_names_a_group_size_dividing_every_width() -> None:
    """Widths 256 and 320 (gcd 64): the message offers --group-size 64, which then quantizes every layer."""
    model = Llama(LlamaConfig.from_preset("tiny", dim=256, ffn_hidden_dim=320)).eval()
    with pytest.raises(ValueError) as error:
        quantize_cli.check_group_sizes(model, QuantConfig(group_size=128))
    message = str(error.value)
    assert "layers.*.feed_forward.w2 (320 inputs, 2 layers)" in message, message
    assert "--group-size 0 (one scale per output channel) or --group-size 64 (divides every layer's width)" in message
    quantize_cli.check_group_sizes(model, QuantConfig(group_size=64))  # passes, and the layers quantize with it
    report = quantize_model(model, QuantConfig(group_size=64))
    assert len(report.layers) == 14 and set(report.layers.values()) == {"int4-g64-sym"}


def test_calibration_length_follows_the_model_context() -> None:
    from lightning_llmopt.cli.quantize import _calibration_length

    assert _calibration_length(None, 4096) == 512  # the default
    assert _calibration_length(None, 128) == 128  # a shorter model: its whole context, not an error
    assert _calibration_length(64, 128) == 64
    with pytest.raises(ValueError, match=r"--seq-len \(512\) must be between 1 and the model's max_seq_len \(128\)"):
        _calibration_length(512, 128)
