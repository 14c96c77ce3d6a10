"""``llmopt consolidate`` on the checkpoints each training layout writes, given the folder the docs name.

Each test trains ``CausalLMModule("tiny")`` for a few steps through Lightning's own loop with Lightning's own
``ModelCheckpoint(dirpath=RUN/checkpoints, save_last=True)`` (as ``examples/configs/tiny_cpu.yaml`` does), under one
layout: one process, DDP, ZeRO-2, ZeRO-3, TP=2, PP=2 (2 gloo ranks of the session's worker pool, through
``tests/strategies/_nd_jobs.py``). It then runs ``llmopt consolidate`` on the run folder or its ``checkpoints``
folder (never the deep path: under the sharded strategies that is ``last.ckpt/step-00000003``), loads the export with
transformers ``AutoModelForCausalLM`` and compares it with the model that was trained: the exported tensors equal the
trained parameters exactly, and the logits match our ``Llama`` on those parameters within fp32 rounding.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from lightning_llmopt.cli.main import main as llmopt
from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.strategies import NDParallelStrategy, ZeroStrategy

_spec = importlib.util.spec_from_file_location("_nd_jobs", Path(__file__).parents[1] / "strategies" / "_nd_jobs.py")
assert _spec is not None and _spec.loader is not None
J = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("_nd_jobs", J)
_spec.loader.exec_module(J)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # consolidate reads without a group

STEPS = 3


def _train(run: str, strategy: Any, nd: dict[str, Any] | None) -> dict[str, torch.Tensor]:
    """``STEPS`` training steps under ``strategy(**nd)`` (``nd=None``: one process) with a ``ModelCheckpoint`` in
    ``run/checkpoints``; returns the trained parameters, full tensors under the module's names (collective)."""
    saver = ModelCheckpoint(dirpath=os.path.join(run, "checkpoints"), save_last=True)
    recorder, trainer = J.fit(
        nd,
        steps=STEPS,
        strategy_cls=strategy,
        callbacks=[saver],
        root=run,
        trainer_kwargs={"enable_checkpointing": True},
    )
    assert trainer.global_step == STEPS
    return J.summary(recorder, trainer)["params"]


def _consolidate(root: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """``llmopt consolidate ROOT OUT`` through the ``llmopt`` entry point; returns the line naming what it read."""
    capsys.readouterr()
    llmopt(["consolidate", str(root), str(out)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("wrote 1 safetensors file(s)"), lines
    return next(line for line in lines if line.startswith("reading "))


def _check_export(out: Path, params: dict[str, torch.Tensor]) -> None:
    """The export holds exactly the trained weights, and transformers computes our model's logits from them."""
    transformers = pytest.importorskip("transformers")
    safetensors = pytest.importorskip("safetensors.torch")
    trained = {k.removeprefix("model."): v for k, v in params.items()}
    reference = Llama(LlamaConfig.from_preset("tiny"))
    reference.load_state_dict(trained)  # strict: the training run's parameters are the whole model
    exported = safetensors.load_file(str(out / "model.safetensors"))
    assert exported["model.embed_tokens.weight"].dtype == torch.float32
    assert torch.equal(exported["model.embed_tokens.weight"], trained["tok_embeddings.weight"])
    assert torch.equal(exported["model.layers.1.mlp.down_proj.weight"], trained["layers.1.feed_forward.w2.weight"])
    assert torch.equal(exported["lm_head.weight"], trained["output.weight"])
    assert len(exported) == len(trained)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, 320, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # The same fp32 weights in two implementations: rounding only (as tests/cli/test_consolidate.py).
        torch.testing.assert_close(hf(tokens).logits, reference.eval()(tokens), rtol=1e-4, atol=1e-5)


def _last_step_folder(run: Path) -> Path:
    """The layout the sharded strategies write through ModelCheckpoint: ``last.ckpt`` is a folder of steps."""
    last = run / "checkpoints" / "last.ckpt"
    assert last.is_dir() and (last / f"step-{STEPS:08d}" / "COMPLETE").is_file(), sorted(last.rglob("*"))
    return last / f"step-{STEPS:08d}"


def test_single_device_ckpt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    params = _train(str(run), None, None)
    assert (run / "checkpoints" / "last.ckpt").is_file()  # Lightning's own .ckpt file
    read = _consolidate(run / "checkpoints", tmp_path / "hf", capsys)
    assert read.startswith(f"reading {run / 'checkpoints' / 'last.ckpt'} (Lightning checkpoint)"), read
    assert "'last.ckpt' of 2 checkpoints" in read  # beside epoch=0-step=3.ckpt
    _check_export(tmp_path / "hf", params)


def test_ddp_ckpt(dist_pool: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    params = dist_pool(2).run(_train, str(run), DDPStrategy, {})[0]
    assert (run / "checkpoints" / "last.ckpt").is_file()
    read = _consolidate(run, tmp_path / "hf", capsys)  # the run folder
    assert read.startswith(f"reading {run / 'checkpoints' / 'last.ckpt'} (Lightning checkpoint)"), read
    _check_export(tmp_path / "hf", params)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_folders(dist_pool: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], stage: int) -> None:
    run = tmp_path / "run"
    params = dist_pool(2).run(_train, str(run), ZeroStrategy, {"stage": stage})[0]
    deep = _last_step_folder(run)
    assert json.loads((deep / "COMPLETE").read_text())["stage"] == stage
    read = _consolidate(run / "checkpoints", tmp_path / "hf", capsys)
    assert read.startswith(f"reading {deep} (sharded DCP checkpoint, step {STEPS}): 'last.ckpt' of 2"), read
    _check_export(tmp_path / "hf", params)


@pytest.mark.parametrize(
    "nd",
    [
        pytest.param({"tensor_parallel": 2}, id="tp2"),
        pytest.param({"pipeline_parallel": 2, "schedule": "1f1b", "microbatches": 2}, id="pp2"),
    ],
)
def test_nd_folders(dist_pool: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], nd: dict[str, Any]) -> None:
    run = tmp_path / "run"
    params = dist_pool(2).run(_train, str(run), NDParallelStrategy, nd)[0]
    deep = _last_step_folder(run)
    read = _consolidate(run, tmp_path / "hf", capsys)  # the run folder
    assert read.startswith(f"reading {deep} (sharded DCP checkpoint"), read
    _check_export(tmp_path / "hf", params)


def _fake_ckpt(path: Path, seed: int, mtime: float) -> Llama:
    torch.manual_seed(seed)
    model = Llama(LlamaConfig.from_preset("tiny"))
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": state, "hyper_parameters": {"model": model.config.to_dict()}}, path)
    os.utime(path, (mtime, mtime))
    return model


def test_without_last_the_newest_is_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    run = tmp_path / "run"
    _fake_ckpt(run / "checkpoints" / "epoch=0-step=9.ckpt", 1, 2_000_000_000)
    newest = _fake_ckpt(run / "checkpoints" / "epoch=0-step=4.ckpt", 2, 2_000_000_100)  # written later
    read = _consolidate(run, tmp_path / "hf", capsys)
    assert read.endswith(f"the newest of 2 checkpoints under {run}"), read
    exported = safetensors.load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(exported["model.norm.weight"], newest.norm.weight)
    assert torch.equal(exported["lm_head.weight"], newest.output.weight)


@pytest.mark.parametrize(
    "layout, message",
    [
        ("missing", r"checkpoint .*/missing does not exist \(.* holds logs/, partial/\); expected a Lightning \.ckpt"),
        ("logs", r"no checkpoint under .*/logs \(searched 4 levels down; it holds metrics\.csv\); expected a"),
        ("partial", r"no complete checkpoint under .*/last\.ckpt: found step-00000002\.partial; expected a step-N"),
    ],
)
def test_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, layout: str, message: str
) -> None:
    import re

    monkeypatch.delenv("LLMOPT_DEBUG", raising=False)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.csv").write_text("step\n")
    (tmp_path / "partial" / "last.ckpt" / "step-00000002.partial").mkdir(parents=True)
    with pytest.raises(SystemExit) as exit_info:
        llmopt(["consolidate", str(tmp_path / layout), str(tmp_path / "hf")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("llmopt consolidate: error: ") and re.search(message, err), err
    assert not (tmp_path / "hf").exists()  # refused before writing anything
