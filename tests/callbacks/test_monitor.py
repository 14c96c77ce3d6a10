"""TrainingMonitor: the logged throughput is consistent with the model's FLOP count and the batch size."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_llmopt import CausalLMModule, TrainingMonitor
from lightning_llmopt.callbacks import peak_flops

_spec = importlib.util.spec_from_file_location("_tm", Path(__file__).parents[1] / "test_module.py")
_tm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tm)


def test_monitor_logs_consistent_throughput(tmp_path):
    monitor = TrainingMonitor(log_every_n_steps=2, skip_first_steps=1)
    module = CausalLMModule("tiny", model_overrides={"vocab_size": 64})
    trainer = L.Trainer(accelerator="cpu", max_steps=7, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, callbacks=[monitor], default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(_tm.RepeatingTokens(), batch_size=4))
    m = monitor.last_metrics
    assert m["perf/tokens_per_sec"] > 0
    assert m["perf/tokens_per_sec"] == pytest.approx(m["perf/tokens_per_sec_per_device"])  # one device
    expected_tflops = module.model.flops_per_token(32) * m["perf/tokens_per_sec_per_device"] / 1e12
    assert m["perf/tflops_per_device"] == pytest.approx(expected_tflops)
    # 2 steps of 4 x 32 tokens in the window.
    assert m["perf/step_time_s"] == pytest.approx(4 * 32 / m["perf/tokens_per_sec_per_device"], rel=1e-6)
    assert "perf/mfu" not in m  # no peak FLOP/s on a CPU
    assert m["memory/max_rss_gib"] > 0
    assert trainer.callback_metrics["train/grad_norm"].item() > 0
    # the run's summary (llmopt fit prints it): 6 steps timed, three logged windows (1 + 2 + 2: skip 1, logs at 2, 4,
    # 6) and the step after the last log, counted when training ended
    s = monitor.summary()
    assert s["steps"] == 6 and "mfu" not in s
    assert s["tflops_per_device"] == pytest.approx(module.model.flops_per_token(32) * s["tokens_per_sec_per_device"]
                                                   / 1e12)
    assert monitor.summary_line().startswith("throughput: ") and "(6 steps timed)" in monitor.summary_line()
    assert TrainingMonitor().summary() == {} and TrainingMonitor().summary_line() == ""


def test_peak_flops():
    assert peak_flops(torch.device("cpu"), torch.bfloat16) is None
    with pytest.raises(ValueError, match="log_every_n_steps"):
        TrainingMonitor(log_every_n_steps=0)
