"""CPU threads sized to the machine (``lightning_llmopt.cli.threads``): cores from affinity and the cgroup quota, the
per-process rule, data-loader workers, the overrides, and the plan applied and logged by ``llmopt fit``."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lightning_llmopt.cli import threads
from lightning_llmopt.cli.threads import (
    available_cores,
    cgroup_cpu_limit,
    detect_cores,
    parse_cpu_max,
    plan_threads,
    prefer_passive_wait,
)

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "configs" / "tiny_cpu.yaml"
SHORT = ["--trainer.max_steps=3", "--data.max_bytes=100000", "--data.batch_size=2", "--data.seq_len=32",
         "--model.warmup_steps=1", "--wandb=false"]  # fmt: skip


@pytest.fixture(autouse=True)
def _keep_torch_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Other tests run in this process: leave torch's thread count and the thread variables as they were."""
    for name in ("LLMOPT_NUM_THREADS", "OMP_NUM_THREADS", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    "text, cores",
    [("max 100000\n", None), ("200000 100000\n", 2.0), ("150000 100000", 1.5), ("50000", 0.5), ("", None)],
)
def test_parse_cpu_max(text: str, cores: float | None) -> None:
    assert parse_cpu_max(text) == cores


def test_cgroup_quota_v2_then_v1_then_none(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(tmp_path) is None  # neither file
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # v1 without a quota
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(tmp_path) is None
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    assert cgroup_cpu_limit(tmp_path) == 3.0
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # v2 wins where both exist
    assert cgroup_cpu_limit(tmp_path) == 1.5


@pytest.mark.parametrize(
    "affinity, cpu_count, quota, cores",
    [
        (2, 64, None, 2),  # the affinity mask, not the machine's CPU count
        (None, 8, None, 8),  # no affinity (macOS): the CPU count
        (None, None, None, 1),
        (8, 8, 2.0, 2),  # a container's quota below its mask
        (8, 8, 1.5, 1),  # rounded down: a second thread would be throttled
        (8, 8, 0.5, 1),  # at least one
        (2, 8, 4.0, 2),  # a quota above the mask changes nothing
    ],
)
def test_available_cores(affinity: int | None, cpu_count: int | None, quota: float | None, cores: int) -> None:
    assert available_cores(affinity, cpu_count, quota) == cores


def test_detect_cores_reads_affinity_and_quota(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 64)
    assert detect_cores(tmp_path) == 4
    (tmp_path / "cpu.max").write_text("300000 100000\n")
    assert detect_cores(tmp_path) == 3


@pytest.mark.parametrize(
    "cores, processes, threads_each",
    [(2, 1, 2), (2, 2, 1), (2, 4, 1), (8, 3, 2), (16, 4, 4), (1, 1, 1)],
)
def test_threads_per_process(cores: int, processes: int, threads_each: int) -> None:
    plan = plan_threads(cores, processes, environ={})
    assert (plan.threads, plan.source) == (threads_each, "sized")


@pytest.mark.parametrize(
    "cores, processes, workers, capped",
    [(2, 1, 0, 0), (2, 1, 1, 1), (2, 1, 8, 2), (2, 2, 3, 1), (16, 2, 4, 4)],
)
def test_workers_capped_at_the_cores_per_process(cores: int, processes: int, workers: int, capped: int) -> None:
    plan = plan_threads(cores, processes, workers, environ={})
    assert plan.workers == capped and plan.asked_workers == workers
    assert plan.threads == max(1, cores // processes)  # workers take no cores from the intra-op threads
    assert ("capped at the cores per process" in plan.describe()) == (capped != workers)


@pytest.mark.parametrize(
    "num_threads, environ, threads_chosen, source",
    [
        (3, {"LLMOPT_NUM_THREADS": "5", "OMP_NUM_THREADS": "7"}, 3, "--num_threads"),
        (None, {"LLMOPT_NUM_THREADS": "5", "OMP_NUM_THREADS": "7"}, 5, "LLMOPT_NUM_THREADS"),
        (None, {"OMP_NUM_THREADS": "7"}, 7, "OMP_NUM_THREADS"),
        (None, {"OMP_NUM_THREADS": "4,2"}, 4, "OMP_NUM_THREADS"),  # nested list: the outer level
        (None, {"OMP_NUM_THREADS": "many"}, 2, "sized"),  # not a count: ignored, as OpenMP and torch ignore it
        (None, {"LLMOPT_NUM_THREADS": " "}, 2, "sized"),
    ],
)
def test_overrides(num_threads: int | None, environ: dict[str, str], threads_chosen: int, source: str) -> None:
    plan = plan_threads(4, 2, workers=8, num_threads=num_threads, environ=environ)
    assert (plan.threads, plan.source, plan.sized, plan.workers) == (threads_chosen, source, 2, 2)
    line = plan.describe()
    assert f"CPU threads: {threads_chosen} per process" in line and "4 cores available, 2 processes" in line
    assert "--num_threads N or LLMOPT_NUM_THREADS=N" in line
    assert (f"set by {source}" in line) == (source != "sized")


def test_zero_turns_sizing_off() -> None:
    plan = plan_threads(2, 2, workers=5, environ={"LLMOPT_NUM_THREADS": "0", "OMP_NUM_THREADS": "7"})
    assert plan.threads is None and plan.workers == 5  # torch's default and the workers configured, as before
    assert plan.describe().startswith("CPU threads: torch's default (LLMOPT_NUM_THREADS=0; sized: 1,")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_threads": 0}, "--num_threads ('0') must be a whole number >= 1"),
        ({"environ": {"LLMOPT_NUM_THREADS": "two"}}, "LLMOPT_NUM_THREADS ('two') must be a whole number >= 0"),
        ({"environ": {"LLMOPT_NUM_THREADS": "-1"}}, "LLMOPT_NUM_THREADS ('-1') must be a whole number >= 0"),
    ],
)
def test_bad_overrides_name_the_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan_threads(2, 1, **kwargs)


def test_passive_wait_unless_set_off_or_gpu(tmp_path: Path) -> None:
    environ: dict[str, str] = {}
    assert prefer_passive_wait(environ, gpu_nodes=()) and environ == {"OMP_WAIT_POLICY": "PASSIVE"}
    user = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert not prefer_passive_wait(user, gpu_nodes=()) and user == {"OMP_WAIT_POLICY": "ACTIVE"}
    off = {"LLMOPT_NUM_THREADS": "0"}
    assert not prefer_passive_wait(off, gpu_nodes=()) and "OMP_WAIT_POLICY" not in off
    node = tmp_path / "nvidiactl"
    node.touch()
    gpu: dict[str, str] = {}
    assert not prefer_passive_wait(gpu, gpu_nodes=(str(node),)) and gpu == {}
    assert plan_threads(2, environ=environ).describe().count("OMP_WAIT_POLICY=PASSIVE") == 1


_PROBE = '''
import os
import torch
from lightning.pytorch.callbacks import Callback


class Probe(Callback):
    """What the training loop runs with."""

    def on_train_start(self, trainer, pl_module):
        print(f"PROBE threads={torch.get_num_threads()} workers={trainer.datamodule.num_workers} "
              f"omp={os.environ.get('OMP_NUM_THREADS')}", flush=True)
'''


def test_fit_applies_and_logs_the_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """A real ``llmopt fit`` (3 steps, in this process) on a machine of one core: one thread and one of the two
    configured data-loader workers during training, the line on stderr, and this process as it was afterwards."""
    from lightning_llmopt.cli.main import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "threads_probe.py").write_text(textwrap.dedent(_PROBE))
    monkeypatch.setattr(threads, "detect_cores", lambda: 1)
    torch.set_num_threads(2)  # what torch picks on two cores; the plan must change it for the run
    capsys.readouterr()
    main(["fit", "--config", str(CONFIG), *SHORT, "--data.num_workers=2", "--trainer.callbacks+=threads_probe.Probe"])
    out, err = capsys.readouterr()
    assert ("CPU threads: 1 per process (1 core available, 1 process on this node); data-loader workers: 1 "
            "(2 configured, capped at the cores per process); override with --num_threads N") in err  # fmt: skip
    assert "PROBE threads=1 workers=1 omp=1" in out  # OMP_NUM_THREADS: for ranks a launcher spawns
    assert "steps: 3," in out
    assert torch.get_num_threads() == 2  # restored for the rest of this process
    assert "OMP_NUM_THREADS" not in os.environ


def test_generate_on_cpu_takes_the_flag(capsys) -> None:
    from lightning_llmopt.cli.generate import main as generate

    before = torch.get_num_threads()
    out = generate(["--preset", "tiny", "--tokens", "1,2,3", "--max-tokens", "2", "--device", "cpu",
                    "--num-blocks", "8", "--num-threads", "1"])  # fmt: skip
    assert len(out[0].outputs[0].token_ids) == 2
    err = capsys.readouterr().err
    assert "llmopt generate: CPU threads: 1 per process (set by --num-threads; sized: " in err
    assert torch.get_num_threads() == before
