"""Every strategy with the fused kernels on, bf16, on 2 and 4 GPUs: 20 steps against one GPU from the same seed.

Skipped without 2 CUDA GPUs (``multigpu``; the 4-GPU layouts need 4). Each world size is one torchrun launch of
``_multigpu_job.py`` that trains its layouts in turn; the one-GPU references (bf16 and fp32) run in their own launch,
beside the 2-GPU one on a free GPU where there is one. Nothing is loaded: every layout builds its weights from
``seed_everything(0)``, and the data are the same global batches split over the data-parallel ranks.

The tolerance, derived rather than chosen: a layout changes only where bf16 rounds (partial sums of sharded matmuls,
reduction order of all-reduce and reduce-scatter, which rank computes which rows). Its distance from the one-GPU
bf16 run is therefore of the order of bf16 rounding's own effect on the trajectory, which the test measures in the
same run as the distance between the one-GPU bf16 and fp32 runs, ``d_k = |L_bf16(k) - L_fp32(k)|``. A layout passes
where at every step ``|L_layout(k) - L_bf16(k)| <= max(2 * max_{j<=k} d_j, 2**-8 * L_bf16(k))``: twice the largest
rounding effect seen so far (two independent roundings of that size), and never below one bf16 epsilon of the loss
itself (at step 0, ``d_0`` can vanish by chance). The data are learnable (the loss falls by more than 2 nats in 20
steps on one GPU), so a gradient that is lost, doubled or averaged over the wrong group moves a layout's curve by
far more than that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.multigpu

JOB = Path(__file__).with_name("_multigpu_job.py")
REPO = Path(__file__).resolve().parents[2]
STEPS = 20

LLAMA, MOE = "llama", "moe"
TWO_GPUS: list[tuple[str, dict[str, Any], str]] = [
    ("ddp", {"ddp": True}, LLAMA),
    ("zero1", {"zero": 1}, LLAMA),
    ("zero2", {"zero": 2}, LLAMA),
    ("zero3", {"zero": 3}, LLAMA),
    ("async-bsp", {"async": "bsp"}, LLAMA),
    ("nd-dp2", {"data_parallel": 2}, LLAMA),
    ("nd-tp2", {"tensor_parallel": 2}, LLAMA),
    ("nd-cp2", {"context_parallel": 2}, LLAMA),
    ("nd-pp2", {"pipeline_parallel": 2}, LLAMA),
    ("nd-ep2-moe", {"expert_parallel": 2}, MOE),
]
FOUR_GPUS: list[tuple[str, dict[str, Any], str]] = [
    ("ddp", {"ddp": True}, LLAMA),
    ("zero2", {"zero": 2}, LLAMA),
    ("zero3", {"zero": 3}, LLAMA),
    ("nd-tp2-dp2", {"tensor_parallel": 2, "data_parallel": 2}, LLAMA),
    ("nd-tp4", {"tensor_parallel": 4}, LLAMA),
    ("nd-cp2-dp2", {"context_parallel": 2, "data_parallel": 2}, LLAMA),
    ("nd-pp2-dp2", {"pipeline_parallel": 2, "data_parallel": 2}, LLAMA),
    ("nd-pp2-tp2", {"pipeline_parallel": 2, "tensor_parallel": 2}, LLAMA),
    ("nd-pp4", {"pipeline_parallel": 4}, LLAMA),
    ("nd-ep4-moe", {"expert_parallel": 4}, MOE),
]
REFERENCES: list[tuple[str, dict[str, Any], str]] = [("single", {"single": True}, m) for m in (LLAMA, MOE)]


def _env(gpus: list[int]) -> dict[str, str]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(map(str, gpus)), PYTHONUNBUFFERED="1",
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for name in ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK"):
        env.pop(name, None)
    return env


def _start(runs: list[tuple[str, dict[str, Any], str]], gpus: list[int], out: Path, log: Path,
           precision: str = "bf16-mixed", tag: str = "") -> subprocess.Popen:
    layouts = [[name + tag, layout, model] for name, layout, model in runs]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={len(gpus)}", str(JOB),
           "--layouts", json.dumps(layouts), "--out", str(out), "--steps", str(STEPS), "--precision", precision]
    return subprocess.Popen(cmd, env=_env(gpus), stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO)


def _finish(proc: subprocess.Popen, out: Path, log: Path, timeout: float) -> dict[str, Any]:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    results = json.loads(out.read_text()) if out.exists() else {}
    if not results:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        pytest.fail(f"{out.name}: the launch wrote nothing (exit {proc.returncode}); log tail:\n{tail}")
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    n = torch.cuda.device_count()
    tmp = tmp_path_factory.mktemp("multigpu")
    # The one-GPU references on the last GPU, beside the 2-GPU launch on the first two where there is room.
    ref_gpu = [n - 1] if n >= 3 else [0]
    refs: list[tuple[str, dict[str, Any], str]] = [(f"{m}-bf16", layout, m) for _, layout, m in REFERENCES]
    fp32 = [(f"{m}-fp32", layout, m) for _, layout, m in REFERENCES]
    procs = []
    if n >= 3:
        procs.append(("two", _start(TWO_GPUS, [0, 1], tmp / "two.json", tmp / "two.log"), tmp / "two"))
    ref = _start(refs, ref_gpu, tmp / "ref.json", tmp / "ref.log")
    ref_results = _finish(ref, tmp / "ref.json", tmp / "ref.log", 300)
    ref32 = _start(fp32, ref_gpu, tmp / "ref32.json", tmp / "ref32.log", precision="32-true")
    ref_results |= _finish(ref32, tmp / "ref32.json", tmp / "ref32.log", 240)
    if n < 3:
        procs.append(("two", _start(TWO_GPUS, [0, 1], tmp / "two.json", tmp / "two.log"), tmp / "two"))
    out: dict[str, Any] = {"ref": ref_results}
    for key, proc, stem in procs:
        out[key] = _finish(proc, stem.with_suffix(".json"), stem.with_suffix(".log"), 300)
    if n >= 4:
        out["four"] = _finish(_start(FOUR_GPUS, [0, 1, 2, 3], tmp / "four.json", tmp / "four.log"),
                              tmp / "four.json", tmp / "four.log", 300)
    summary = os.environ.get("LLMOPT_MULTIGPU_SUMMARY")  # the GPU run keeps the curves beside its record
    if summary:
        Path(summary).write_text(json.dumps(out, indent=1))
    return out


def tolerances(bf16: list[float], fp32: list[float]) -> list[float]:
    """Per-step tolerance (module docstring): ``max(2 * max_{j<=k} |bf16_j - fp32_j|, 2**-8 * bf16_k)``."""
    worst, out = 0.0, []
    for b, f in zip(bf16, fp32, strict=True):
        worst = max(worst, abs(b - f))
        out.append(max(2 * worst, 2**-8 * abs(b)))
    return out


def _check(name: str, model: str, got: dict[str, Any], ref: dict[str, Any]) -> None:
    assert "error" not in got, f"{name}: {got.get('error')}"
    base, full = ref[f"{model}-bf16"], ref[f"{model}-fp32"]
    assert "error" not in base and "error" not in full, (base.get("error"), full.get("error"))
    assert got["kernels"] == base["kernels"] and got["kernels"], (name, got["kernels"], base["kernels"])
    tol = tolerances(base["losses"], full["losses"])
    assert len(got["losses"]) == len(base["losses"]) == STEPS, name
    for k, (a, b, t) in enumerate(zip(got["losses"], base["losses"], tol, strict=True)):
        assert abs(a - b) <= t, f"{name} step {k}: loss {a:.5f} vs one GPU {b:.5f} (|diff| {abs(a - b):.2e} > {t:.2e})"


def test_references_learn(runs: dict[str, Any]) -> None:
    for model in (LLAMA, MOE):
        losses = runs["ref"][f"{model}-bf16"]["losses"]
        assert losses[-1] < losses[0] - 2.0, (model, losses)  # the data are learnable: the check has teeth


@pytest.mark.parametrize("name,layout,model", TWO_GPUS, ids=[r[0] for r in TWO_GPUS])
def test_two_gpus_match_one(runs: dict[str, Any], name: str, layout: dict[str, Any], model: str) -> None:
    _check(name, model, runs["two"][name], runs["ref"])


@pytest.mark.parametrize("name,layout,model", FOUR_GPUS, ids=[r[0] for r in FOUR_GPUS])
def test_four_gpus_match_one(runs: dict[str, Any], name: str, layout: dict[str, Any], model: str) -> None:
    if "four" not in runs:
        pytest.skip(f"needs 4 CUDA GPUs, found {torch.cuda.device_count()}")
    _check(name, model, runs["four"][name], runs["ref"])
