"""PipelineTimeline inside Trainer.fit under NDParallelStrategy(pipeline_parallel=2) on 2 gloo ranks: the recorded
step holds each scheduled action once, the losses equal those of the same run without the callback, rank 0 writes
the picture; without a pipeline the callback does nothing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_llmopt import CausalLMModule
from lightning_llmopt.callbacks.pipeline_timeline import PipelineTimeline

_spec = importlib.util.spec_from_file_location(
    "_nd_jobs", Path(__file__).resolve().parents[1] / "strategies" / "_nd_jobs.py"
)
assert _spec is not None and _spec.loader is not None
J = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("_nd_jobs", J)
_spec.loader.exec_module(J)

ND = {"pipeline_parallel": 2, "schedule": "1f1b", "microbatches": 2, "zero_stage": 0}
LAYERS = {"model_overrides": {"n_layers": 4}}


def _fit_job(init_path: str, png: str | None) -> dict[str, Any]:
    callback = PipelineTimeline(steps=[1], png=png) if png else None
    recorder, _ = J.fit(
        ND, steps=3, init_path=init_path, callbacks=[callback] if callback else None, module_kwargs=LAYERS
    )
    return {"losses": list(recorder.losses), "summaries": callback.summaries if callback else None}


def test_pipeline_timeline_in_fit(dist_pool: Any, tmp_path: Path) -> None:
    L.seed_everything(0, verbose=False)
    module = CausalLMModule("tiny", **LAYERS)
    module.configure_model()
    init = str(tmp_path / "init.pt")
    torch.save({k: v.clone() for k, v in module.state_dict().items()}, init)
    png = str(tmp_path / "pp-{step}.png")
    pool = dist_pool(2)
    plain = pool.run(_fit_job, init, None)
    timed = pool.run(_fit_job, init, png)
    for a, b in zip(plain, timed, strict=True):
        assert a["losses"] == b["losses"]
        assert list(b["summaries"]) == [1]
        summary = b["summaries"][1]
        assert summary["theory_bubble"] == pytest.approx(1 / 3)  # (P-1)/(M+P-1), P = M = 2
        assert 0.0 <= summary["measured_bubble"] < 1.0
        for rank in summary["ranks"]:  # one stage per rank: M forwards and M full backwards
            assert rank["actions"]["F"]["count"] == 2 and rank["actions"]["B"]["count"] == 2
    assert (tmp_path / "pp-1.png").stat().st_size > 0


def test_without_pipeline_does_nothing() -> None:
    callback = PipelineTimeline(steps=[0])
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    from lightning_llmopt.testing.data import RandomTokens

    data = torch.utils.data.DataLoader(RandomTokens(vocab_size=320, seq_len=16, length=4), batch_size=2)
    trainer.fit(CausalLMModule("tiny"), data)
    assert callback.summaries == {}
    with pytest.raises(ValueError, match=r"steps \(\[-1\]\) must be >= 0"):
        PipelineTimeline(steps=[-1])
