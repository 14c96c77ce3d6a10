"""The shell commands of README.md and docs/hf_interop.md, run as written on a tiny model (issue 52).

Every line of their ``bash`` blocks is either run or named in ``NOT_RUN`` with the reason, so a documented command
can no longer break unseen, and a new one fails here until it runs or is listed. What differs from a user's run,
and only that:

- installs are not repeated (the suite runs in the environment they made), and the Hub download is replaced by a
  tiny random transformers Qwen2 folder with the byte tokenizer, saved where the docs download to
  (``hub/qwen2.5-0.5b``; also ``path/to/hf_folder``); ``my_corpus/`` is a small text folder;
- every ``llmopt fit`` gets ``SHORT`` appended (a few steps of a small batch; the last value of a flag wins), and the
  GPU flags of docs/hf_interop.md become 2 CPU processes (``GPU_TO_CPU``);
- ``llmopt`` and ``python`` are this interpreter (``python -m lightning_llmopt.cli`` for ``llmopt``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHORT = [
    "--trainer.max_steps=4",
    "--trainer.val_check_interval=2",
    "--trainer.limit_val_batches=1",
    "--data.max_bytes=60000",
    "--data.seq_len=32",
    "--data.batch_size=2",
    "--model.warmup_steps=1",
    "--wandb=false",
]
GPU_TO_CPU = {("--trainer.accelerator", "cuda"): "cpu", ("--trainer.devices", "8"): "2"}
NOT_RUN = {
    "python3 -m venv .venv && . .venv/bin/activate": "the suite runs in the environment the set-up made",
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu": "an install",
    'pip install torch==2.13.0 && pip install -e ".[dev]" && python -m pytest': "the suite itself",
    "huggingface-cli download Qwen/Qwen2.5-0.5B --local-dir hub/qwen2.5-0.5b": "a download: the tiny folder instead",
}


def _normalize(line: str) -> str:
    """One spelling of a shell line: comments dropped, words quoted only where needed, ``&&`` kept an operator."""
    return " ".join(t if t == "&&" else shlex.quote(t) for t in shlex.split(line, comments=True))


def shell_commands(doc: Path) -> list[str]:
    """The commands of a markdown file's ``bash`` blocks, continuation lines joined and comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if normalized := _normalize(line):
                commands.append(normalized)
    return commands


def _runnable(command: str) -> list[str] | None:
    """The argv to run for a documented command, or None if it is listed in NOT_RUN."""
    if command in {_normalize(c) for c in NOT_RUN}:
        return None
    if command.startswith("pip install ") and " && llmopt " in command:  # the README's main job: installed already
        command = command[command.rindex("&& ") + 3:]
    argv = shlex.split(command)
    assert argv[0] in ("llmopt", "python"), f"a documented command this test cannot run yet: {command}"
    argv = [GPU_TO_CPU.get((argv[i - 1], a), a) if i else a for i, a in enumerate(argv)]
    if argv[:2] == ["llmopt", "fit"]:
        argv += SHORT
    head = [sys.executable, "-m", "lightning_llmopt.cli"] if argv[0] == "llmopt" else [sys.executable]
    return head + argv[1:]


def _tiny_hub_folder(folder: Path) -> None:
    """A random transformers Qwen2 (dims divisible by the docs' GPTQ group size, 128) with the byte tokenizer."""
    transformers = pytest.importorskip("transformers")
    import torch

    from lightning_llmopt.data.tokenizers import ByteTokenizer

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=256,
        eos_token_id=257,
    )
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    ByteTokenizer().save_pretrained(folder)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "examples").symlink_to(REPO / "examples")
    corpus = tmp_path / "my_corpus"
    corpus.mkdir()
    for name in ("os.py", "json/__init__.py", "argparse.py"):
        source = Path(os.__file__).parent / name
        (corpus / f"{source.parent.name}_{source.name}.txt").write_text(source.read_text())
    _tiny_hub_folder(tmp_path / "hub" / "qwen2.5-0.5b")
    _tiny_hub_folder(tmp_path / "path" / "to" / "hf_folder")
    return tmp_path


def _run_all(doc: Path, cwd: Path) -> list[str]:
    launch = ("MASTER_", "NODE_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "WANDB_",
              "LLMOPT_RUN_DIR")  # a fit on 2 devices must launch its own rank 1, not wait for a stale launcher's
    env = {k: v for k, v in os.environ.items() if not k.startswith(launch)}
    env.update(WANDB_SILENT="true", WANDB_MODE="offline", PYTHONPATH=os.pathsep.join([str(REPO), *sys.path]))
    skipped = []
    for command in shell_commands(doc):
        argv = _runnable(command)
        if argv is None:
            skipped.append(command)
            continue
        result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{doc.name}: `{command}` exited {result.returncode}:\n{result.stderr[-3000:]}"
    return skipped


@pytest.mark.slow
def test_readme_commands_run_as_written(workdir: Path) -> None:
    skipped = _run_all(REPO / "README.md", workdir)
    assert sorted(skipped) == sorted(_normalize(c) for c in NOT_RUN if not c.startswith("huggingface-cli"))
    assert (workdir / "runs" / "tiny_cpu" / "checkpoints" / "last.ckpt").is_file()  # the main job's
    assert json.loads((workdir / "out" / "hf" / "config.json").read_text())["model_type"] == "llama"
    # the two later fits of the same config (a longer run, a fine-tune) each got a folder of their own
    assert (workdir / "runs" / "tiny_cpu-2" / "checkpoints" / "last.ckpt").is_file()
    assert (workdir / "runs" / "tiny_cpu-3" / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.slow
def test_hf_interop_commands_run_as_written(workdir: Path) -> None:
    skipped = _run_all(REPO / "docs" / "hf_interop.md", workdir)
    assert skipped == ["huggingface-cli download Qwen/Qwen2.5-0.5B --local-dir hub/qwen2.5-0.5b"]
    assert json.loads((workdir / "out" / "qwen-ft" / "config.json").read_text())["model_type"] == "qwen2"
    assert (workdir / "out" / "qwen-ft-int4" / "config.json").is_file()
