"""ZeroStrategy on CPU/gloo: parity with a single process, memory, resume, resharding, fp16 loss scaling.

Multi-rank trainings run inside the session's shared worker pool (see ``_zero_jobs.py``); several trainings share one
pool task. The single-process references use Lightning's default strategy, which we did not write.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_llmopt import CausalLMModule, LlamaConfig
from lightning_llmopt.parallel.checkpoint import IncompleteCheckpointError, save_checkpoint, verify_checkpoint
from lightning_llmopt.parallel.loss_scaler import DynamicLossScaler, LossScaleError
from lightning_llmopt.strategies import ZeroPrecision, ZeroStrategy
from lightning_llmopt.strategies.zero_checkpoint import flat_range_rects

_spec = importlib.util.spec_from_file_location("_zero_jobs", Path(__file__).with_name("_zero_jobs.py"))
assert _spec is not None and _spec.loader is not None
J = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("_zero_jobs", J)
_spec.loader.exec_module(J)

TOL = 1e-6  # fp32: the ranks average two half-batch means, the reference one full-batch mean (reordered sums)


@pytest.fixture(scope="module")
def init_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    L.seed_everything(0, verbose=False)
    module = CausalLMModule("tiny")
    module.configure_model()
    path = tmp_path_factory.mktemp("zero") / "init.pt"
    torch.save({k: v.clone() for k, v in module.state_dict().items()}, path)
    return str(path)


def _reference(init_path: str, **kwargs: Any) -> dict[str, Any]:
    return J.summary(*J.fit(zero=False, init_path=init_path, **kwargs))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _assert_parity(result: dict[str, Any], ref: dict[str, Any]) -> None:
    losses, ref_losses = torch.tensor(result["losses"]), torch.tensor(ref["losses"])
    assert len(losses) == len(ref_losses) >= 10  # one per micro-batch
    assert float(((losses - ref_losses).abs() / ref_losses.abs()).max()) <= TOL
    names = sorted(ref["params"])
    assert sorted(result["params"]) == names
    flat = torch.cat([result["params"][k].reshape(-1) for k in names])
    ref_flat = torch.cat([ref["params"][k].reshape(-1) for k in names])
    assert _rel(flat, ref_flat) <= TOL
    init = torch.cat([v.reshape(-1) for v in [torch.load(ref["init"])[k] for k in names]]) if "init" in ref else None
    if init is not None:
        assert _rel(ref_flat, init) > 1e-3  # the weights did move


def test_registered_names_resolve() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    for name, stage in (("zero1", 1), ("zero2", 2), ("zero3", 3), ("zero2_offload", 2), ("zero3_offload", 3)):
        assert name in StrategyRegistry
        trainer = L.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
        assert isinstance(trainer.strategy, ZeroStrategy) and trainer.strategy.stage == stage
        assert isinstance(trainer.precision_plugin, ZeroPrecision)
    assert StrategyRegistry["zero3_offload"]["init_params"]["offload_parameters"] is True


def test_package_import_registers() -> None:
    """`import lightning_llmopt` alone makes `Trainer(strategy="zero2")` resolve, in a fresh interpreter."""
    code = ("import lightning_llmopt, lightning as L; "
            "t = L.Trainer(strategy='zero2', accelerator='cpu', devices=1, logger=False); "
            "print(type(t.strategy).__name__, t.strategy.stage)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["ZeroStrategy", "2"]


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match=r"stage \(4\)"):
        ZeroStrategy(stage=4)
    with pytest.raises(ValueError, match="offload_parameters=True needs stage 3"):
        ZeroStrategy(stage=2, offload_parameters=True)
    with pytest.raises(ValueError, match="offload_parameters=True too"):
        ZeroStrategy(stage=3, offload_optimizer=True)
    with pytest.raises(ValueError, match="'bf16-true'"):
        ZeroPrecision("bf16-true")


def test_flat_range_rects_cover_exactly() -> None:
    for shape in ((7,), (5, 6), (3, 4, 5)):
        n = int(torch.tensor(shape).prod())
        for lo, hi in ((0, n), (1, n - 1), (3, 4), (7, 23 if n > 23 else n)):
            mask = torch.zeros(shape, dtype=torch.int64)
            pos = lo
            for offsets, sizes in flat_range_rects(lo, hi, shape):
                index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
                mask[index] += 1
                flat = torch.arange(n).view(shape)[index].reshape(-1)
                assert flat.tolist() == list(range(pos, pos + flat.numel()))  # contiguous, in flat order
                pos += flat.numel()
            expect = torch.zeros(n, dtype=torch.int64)
            expect[lo:hi] = 1
            assert torch.equal(mask.reshape(-1), expect)


def test_parity_and_memory_two_ranks(dist_pool: Any, init_path: str) -> None:
    """Each stage (stage 2 with accumulation and clipping) matches one process; per-rank memory is 1/N."""
    configs = [{"stage": 1}, {"stage": 2, "accumulate": 2, "clip": 0.05}, {"stage": 3}]
    results = dist_pool(2).run(J.parity_job, init_path, configs)[0]
    plain, accum = _reference(init_path), _reference(init_path, accumulate=2, clip=0.05)
    plain["init"] = accum["init"] = init_path
    _assert_parity(results[0], plain)
    _assert_parity(results[1], accum)
    _assert_parity(results[2], plain)
    n_params = sum(v.numel() for v in plain["params"].values())
    adam_bytes = 2 * 4 * n_params  # exp_avg + exp_avg_sq, fp32, single process
    for stage, result in zip((1, 2, 3), results, strict=True):
        mem = result["memory"]
        assert abs(mem["optimizer_state"] - adam_bytes / 2) <= 64 * 8  # + step scalars and bucket padding
        grads = result["grad_memory"]
        if stage == 1:
            assert grads == 4 * n_params
        else:
            assert abs(grads - 4 * n_params / 2) <= 64
        expected_params = 4 * n_params / 2 if stage == 3 else 4 * n_params
        assert abs(mem["parameters"] - expected_params) <= 64


def test_parity_and_memory_four_ranks(dist_pool: Any, init_path: str) -> None:
    result = dist_pool(4).run(J.parity_job, init_path, [{"stage": 2}])[0][0]
    ref = _reference(init_path)
    _assert_parity(result, ref)
    n_params = sum(v.numel() for v in ref["params"].values())
    assert abs(result["memory"]["optimizer_state"] - 2 * 4 * n_params / 4) <= 64 * 8
    assert abs(result["grad_memory"] - 4 * n_params / 4) <= 64


def test_resume_reshard_and_refusal(dist_pool: Any, init_path: str, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    out = dist_pool(2).run(J.resume_job, init_path, str(root), 4, 7)[0]
    assert out["saved"] == ["step-00000004"]
    marker = verify_checkpoint(root / "step-00000004")  # carries the model config for `llmopt consolidate`
    assert marker["stage"] == 2 and LlamaConfig.from_dict(marker["config"]) == LlamaConfig.from_preset("tiny")
    straight, resumed, stage3 = out["straight"], out["resumed"], out["stage3"]
    # N steps + stop + M steps == N + M steps straight, bitwise on CPU
    assert resumed["losses"] == straight["losses"][4:]
    for k, v in straight["params"].items():
        assert torch.equal(resumed["params"][k], v), k
    # zero2 -> zero3: the loaded weights and optimizer state are the saved ones; training continues alike
    saved = resumed["start_state"]
    for k, v in saved["params"].items():
        assert torch.equal(stage3["start_state"]["params"][k], v), k
    for k, state in saved["optimizer"].items():
        for key, value in state.items():
            assert torch.equal(stage3["start_state"]["optimizer"][k][key].reshape(value.shape), value), (k, key)
    assert max(abs(a - b) / b for a, b in zip(stage3["losses"], straight["losses"][4:], strict=True)) <= TOL
    # 2 ranks -> 1 process (ZeRO-1): same weights and optimizer state after loading
    single, _ = _fit_single(init_path, ckpt_path=str(root), stage=1)
    for k, v in saved["params"].items():
        assert torch.equal(single.start_state["params"][k], v), k
    for k, state in saved["optimizer"].items():
        for key, value in state.items():
            assert torch.equal(single.start_state["optimizer"][k][key].reshape(value.shape), value), (k, key)
    # a truncated checkpoint is refused, naming the damaged file and the fallback
    broken = tmp_path / "broken"
    shutil.copytree(root, broken)
    shards = [p for p in (broken / "step-00000004").iterdir() if p.suffix == ".distcp"]
    shard = max(shards, key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(IncompleteCheckpointError, match=r"damaged: .*\.distcp has \d+ bytes"):
        _fit_single(init_path, ckpt_path=str(broken / "step-00000004"), stage=2)


def _fit_single(init_path: str, **kwargs: Any) -> tuple[Any, L.Trainer]:
    """One process through ZeroStrategy (world size 1); the process group Lightning creates is destroyed after."""
    import torch.distributed as dist

    try:
        return J.fit(steps=7, init_path=init_path, **kwargs)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_fp16_skip_on_non_finite_gradients(dist_pool: Any, init_path: str) -> None:
    """16-mixed: a NaN/inf on one rank skips the step on both ranks, parameters stay, the scale halves."""
    config = {"stage": 2, "steps": 4, "precision": "16-mixed", "module_kwargs": {"inf_at_step": 3, "inf_rank": 1}}
    results = dist_pool(2).run(J.parity_job, init_path, [config])
    for result in (r[0] for r in results):
        assert result["skipped"] == [0.0, 0.0, 0.0, 1.0]
        assert result["scales"][-1] == result["scales"][-2] / 2 == 2.0**15
        for k, before in result["params_before"].items():  # captured just before the skipped step
            assert torch.equal(result["params_after"][k], before), k
        assert all(torch.isfinite(torch.tensor(result["losses"][:3])))


def test_consecutive_skips_raise() -> None:
    scaler = DynamicLossScaler(init_scale=4.0, max_consecutive_skips=2)
    plugin = ZeroPrecision("16-mixed", device="cpu", scaler=scaler)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)

    def closure() -> torch.Tensor:
        p.grad = torch.full((3,), float("inf"))
        return torch.ones(())

    plugin.optimizer_step(opt, model=torch.nn.Linear(1, 1), closure=closure)
    assert scaler.skipped_steps == 1 and scaler.scale_value == 2.0 and torch.equal(p.detach(), torch.ones(3))
    with pytest.raises(LossScaleError, match="2 consecutive steps"):
        plugin.optimizer_step(opt, model=torch.nn.Linear(1, 1), closure=closure)


def test_save_checkpoint_refuses_storage_options(tmp_path: Path) -> None:
    assert save_checkpoint  # the strategy writes through parallel.checkpoint.save_checkpoint
    with pytest.raises(TypeError, match="storage_options"):
        ZeroStrategy(stage=2).save_checkpoint({}, tmp_path, storage_options={"x": 1})
