"""The ``llmopt`` command: fit on the example config (shortened), W&B offline run, checkpoint, validate, bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "configs" / "tiny_cpu.yaml"
SHORT = [
    "--trainer.max_steps=6",
    "--trainer.val_check_interval=3",
    "--trainer.limit_val_batches=2",
    "--data.max_bytes=200000",
    "--data.batch_size=4",
    "--data.seq_len=64",
    "--model.warmup_steps=2",
]


def _llmopt(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["WANDB_SILENT"] = "true"
    return subprocess.run(
        [sys.executable, "-m", "lightning_llmopt.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_fit_writes_wandb_offline_run_and_checkpoint_then_validates(tmp_path):
    pytest.importorskip("wandb")
    fit = _llmopt(["fit", "--config", str(CONFIG), *SHORT], tmp_path)
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert "final validation loss:" in fit.stdout
    # not a terminal: periodic progress lines (the last step always), not tqdm redraws
    assert "[fit] step 6/6 (100.0%)" in fit.stderr and "[fit] validation at step 3: val/loss=" in fit.stderr
    assert "unigram baseline:" in fit.stdout
    runs = list((tmp_path / "runs" / "tiny_cpu" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, "exactly one offline W&B run per job"
    ckpt = tmp_path / "runs" / "tiny_cpu" / "checkpoints" / "last.ckpt"
    assert ckpt.is_file()
    assert list((tmp_path / "runs" / "tiny_cpu" / "csv").glob("version_*/metrics.csv"))

    val = _llmopt(["validate", "--config", str(CONFIG), *SHORT, "--wandb=false", f"--ckpt_path={ckpt}"], tmp_path)
    assert val.returncode == 0, val.stderr[-3000:]
    assert "final validation loss:" in val.stdout

    # the checkpoint remembers its (byte) tokenizer: text prompts work without --tokenizer
    from lightning_llmopt.cli.generate import main as generate

    out = generate([str(ckpt), "--prompt", "hi", "--prompt", "def", "--max-tokens", "4", "--device", "cpu"])
    assert [len(c.outputs[0].token_ids) for c in out] == [4, 4]


def _in_process(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from lightning_llmopt.cli.main import main

    capsys.readouterr()
    code, message = 0, ""
    try:
        main(args)
    except SystemExit as exc:  # SystemExit("text") prints the text to stderr when the interpreter exits
        code, message = (exc.code, "") if isinstance(exc.code, int) else (1, f"{exc.code}\n")
    captured = capsys.readouterr()
    return code, captured.out, captured.err + message


@pytest.mark.parametrize(
    "override, message",
    [
        ("--model.model=gpt9", "unknown preset 'gpt9'"),
        ("--data.data_path=/no/such/corpus", "data_path '/no/such/corpus' does not exist"),
        ("--model.learning_rate=-0.001", "learning_rate (-0.001) must be positive"),
        ("--model.model_overrides={n_heads: 4, n_kv_heads: 3}", "n_heads (4) must be divisible by n_kv_heads (3)"),
        ("--model.model_overrides={vocab_size: 100}", "vocabulary (258) is larger than the model's vocab_size (100)"),
        (
            "--trainer.strategy=zero9",
            "unknown strategy 'zero9'; lightning_llmopt's: diloco, local_sgd, nd_parallel, ssp, zero1, zero2",
        ),
    ],
)
def test_bad_input_is_one_line_without_traceback(tmp_path, monkeypatch, capsys, override, message):
    monkeypatch.chdir(tmp_path)
    args = ["fit", "--config", str(CONFIG), *SHORT, "--wandb=false", override]
    code, _, err = _in_process(args, capsys)
    lines = [ln for ln in err.splitlines() if ln.startswith("llmopt")]
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err
    assert not (tmp_path / "runs" / "tiny_cpu" / "checkpoints").exists()  # failed before training
    with pytest.raises((ValueError, FileNotFoundError)):  # --debug: the exception itself, with its traceback
        _in_process([*args, "--debug"], capsys)


def test_subcommand_bad_input_is_one_line(tmp_path, capsys):
    code, _, err = _in_process(
        ["quantize", str(tmp_path / "missing"), str(tmp_path / "out"), "--method", "rtn"], capsys
    )
    assert code == 2 and err.strip().splitlines()[-1].startswith("llmopt quantize: error: source '")
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 2  # the loading line, then the error


def test_help_lists_every_subcommand(capsys):
    import importlib.util

    code, out, _ = _in_process(["--help"], capsys)
    assert code == 0
    names = ["fit", "validate", "test", "predict", "generate", "quantize", "export", "consolidate", "pipeline-plan"]
    if importlib.util.find_spec("lightning_llmopt.cli.serve") is not None:
        names.append("serve")
    listed = [ln.split()[0] for ln in out.splitlines() if ln.startswith("  ") and not ln.strip().startswith("-")]
    assert listed == [n for n in listed if n in names] and sorted(listed) == sorted(names)


def test_generate_without_tokenizer_names_the_flag(tmp_path, capsys):
    import torch

    from lightning_llmopt.models import Llama, LlamaConfig

    model = Llama(LlamaConfig.from_preset("tiny"))
    path = tmp_path / "m.ckpt"  # no datamodule hyper-parameters, no remembered tokenizer
    torch.save(
        {
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
            "hyper_parameters": {"model": model.config.to_dict()},
        },
        path,
    )
    code, _, err = _in_process(["generate", str(path), "--prompt", "hi", "--device", "cpu"], capsys)
    assert code != 0 and "--tokenizer byte|PATH" in err
    code, out, _ = _in_process(
        [
            "generate",
            str(path),
            "--prompt",
            "hi",
            "--prompt",
            "yo",
            "--tokenizer",
            "byte",
            "--max-tokens",
            "3",
            "--n",
            "2",
            "--temperature",
            "0.5",
            "--seed",
            "1",
            "--device",
            "cpu",
            "--num-blocks",
            "16",
        ],
        capsys,
    )
    assert code == 0
    lines = out.splitlines()
    assert lines[:2] == ["=== prompt 0 ===", "hi"] and "=== prompt 1 ===" in lines and "yo" in lines
    heads = [ln for ln in lines if ln.startswith("--- completion")]
    assert [h.split()[2] for h in heads] == ["0.0", "0.1", "1.0", "1.1"]
    assert all("3 tokens" in h for h in heads)


def test_fit_pretrained_folder_then_generate_from_its_checkpoint(tmp_path, monkeypatch, capsys):
    """``llmopt fit --model.pretrained HF_FOLDER`` builds the model from the folder (a transformers tiny Llama) and
    its checkpoint remembers the folder's tokenizer, so ``llmopt generate CKPT --prompt`` needs no flag."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    import torch

    from lightning_llmopt.data import ByteTokenizer
    from lightning_llmopt.models import from_hf

    monkeypatch.chdir(tmp_path)
    src = tmp_path / "hub"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=258,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(src)
    ByteTokenizer().save_pretrained(src)
    args = [
        "fit",
        "--config",
        str(CONFIG),
        *SHORT,
        "--wandb=false",
        "--trainer.max_steps=2",
        f"--model.pretrained={src}",
        f"--data.tokenizer={src}",
    ]
    code, out, err = _in_process(args, capsys)
    assert code == 0, err[-3000:]
    ckpt = torch.load(tmp_path / "runs" / "tiny_cpu" / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["hyper_parameters"]["pretrained"] == str(src) and ckpt["llmopt_tokenizer"] == str(src)
    assert ckpt["hyper_parameters"]["model"]["dim"] == 48  # the folder's config, not the YAML's preset
    start = from_hf(src).state_dict()
    moved = {k: float((ckpt["state_dict"][f"model.{k}"] - v).abs().max()) for k, v in start.items()}
    assert 0 < max(moved.values()) < 0.05  # two small AdamW steps away from the pretrained weights
    code, out, err = _in_process(
        [
            "generate",
            str(tmp_path / "runs" / "tiny_cpu" / "checkpoints" / "last.ckpt"),
            "--prompt",
            "def",
            "--max-tokens",
            "3",
            "--device",
            "cpu",
            "--num-blocks",
            "16",
        ],
        capsys,
    )
    assert code == 0 and out.startswith("=== prompt 0 ===\ndef\n--- completion 0.0"), err[-2000:]


@pytest.mark.parametrize("config", sorted(p.name for p in (CONFIG.parent).glob("*.yaml")))
def test_every_example_config_parses(config, capsys):
    """Each shipped config resolves through the CLI (classes, strategy arguments, model fields) without running."""
    code, out, err = _in_process(["fit", "--config", str(CONFIG.parent / config), "--print_config"], capsys)
    assert code == 0, err
    assert "fused_kernels: auto" in out  # fast by default on CUDA, unchanged on CPU
