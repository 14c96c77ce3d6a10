"""CPU threads sized to the machine: intra-op threads and data-loader workers of ``llmopt`` on CPU.

The rule (:func:`plan_threads`, pure; ``benchmarks/bench_cpu_threads.py`` measured it):

- cores available: ``len(os.sched_getaffinity(0))`` (``os.cpu_count()`` where affinity is unknown), lowered to the
  cgroup CPU quota (``cpu.max``, v1's ``cpu.cfs_quota_us``) rounded down, at least 1 (:func:`detect_cores`);
- intra-op threads per process: ``max(1, cores // processes)``, ``processes`` being the training processes on this
  node (``LOCAL_WORLD_SIZE``, else the trainer's devices); ``llmopt serve`` and ``generate`` are one process;
- data-loader workers: as configured, at most the cores per process. A worker of ``TextDataModule`` slices tensors
  tokenized in ``setup``: it is idle nearly all the time, so workers do not take cores from the intra-op threads,
  but more worker processes than cores cannot fetch in parallel and each one is a process started and kept;
- overrides, first match wins: ``--num_threads N`` (``--num-threads`` in ``serve``/``generate``),
  ``LLMOPT_NUM_THREADS=N``, then the user's ``OMP_NUM_THREADS`` (torch's own variable, respected as it is);
  ``LLMOPT_NUM_THREADS=0`` turns all of this off: torch's defaults as before, the workers as configured, and no
  OpenMP wait policy;
- OpenMP wait policy of ``llmopt fit`` (``validate``, ``test``, ``predict``): ``OMP_WAIT_POLICY=PASSIVE`` unless the
  user set one (:func:`prefer_passive_wait`), on machines without a GPU driver. OpenMP threads spin at each barrier
  by default; beside another busy process one of them is descheduled while its partner spins, and two threads
  train slower than one. Passive threads sleep instead (a few percent slower alone). OpenMP reads the variable once,
  when torch loads it, so ``llmopt`` sets it before importing torch. ``generate`` and ``serve`` keep OpenMP's
  default: decoding a small model runs many short parallel regions, and passive waits measured slower there alone.

Inter-op threads are left alone: eager training and the inference engine do not use torch's inter-op pool.
Only the ``llmopt`` command applies the plan, and only on CPU (the ``cpu`` accelerator or device); GPU runs keep
torch's defaults and their configured workers.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path

__all__ = [
    "ENV",
    "ThreadPlan",
    "available_cores",
    "cgroup_cpu_limit",
    "configure",
    "detect_cores",
    "parse_cpu_max",
    "plan_threads",
    "prefer_passive_wait",
]

ENV = "LLMOPT_NUM_THREADS"
_GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd")  # NVIDIA's and AMD's (ROCm) driver nodes


def parse_cpu_max(text: str) -> float | None:
    """Cores a cgroup v2 ``cpu.max`` allows: ``"200000 100000"`` -> ``2.0``; ``"max 100000"`` -> ``None``."""
    fields = text.split()
    if not fields or fields[0] == "max":
        return None
    quota = int(fields[0])
    period = int(fields[1]) if len(fields) > 1 else 100_000
    return quota / period if quota > 0 and period > 0 else None


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in cores (v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us`` /
    ``cpu.cfs_period_us``); ``None`` without a quota or where neither file can be read."""
    try:
        return parse_cpu_max((root / "cpu.max").read_text())
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def available_cores(affinity: int | None, cpu_count: int | None, quota: float | None) -> int:
    """Cores this process may use: the affinity mask's size (else the CPU count), at most the cgroup ``quota``
    rounded down (1.5 cores: 1; a second thread would be throttled half of each period), at least 1."""
    cores = affinity or cpu_count or 1
    if quota is not None:
        cores = min(cores, math.floor(quota))
    return max(1, cores)


def detect_cores(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """:func:`available_cores` of this process: its affinity mask, CPU count and cgroup quota."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return available_cores(affinity, os.cpu_count(), cgroup_cpu_limit(cgroup_root))


@dataclasses.dataclass(frozen=True)
class ThreadPlan:
    """What :func:`plan_threads` chose for one process.

    Arguments:
        threads: intra-op threads (``torch.set_num_threads``); ``None``: torch's default left alone (sizing off).
        workers: data-loader workers.
        cores: cores available to the node's processes (:func:`detect_cores`).
        processes: training processes on this node.
        asked_workers: the workers configured.
        source: where ``threads`` came from: ``"sized"``, the flag, ``"LLMOPT_NUM_THREADS"`` or ``"OMP_NUM_THREADS"``.
        flag: the command-line option that overrides the count (named in :meth:`describe`).
        wait_policy: ``OMP_WAIT_POLICY`` as the process started with it (``None``: unset, OpenMP's default).
    """

    threads: int | None
    workers: int
    cores: int
    processes: int
    asked_workers: int = 0
    source: str = "sized"
    flag: str = "--num_threads"
    wait_policy: str | None = None

    @property
    def sized(self) -> int:
        """The intra-op threads the rule gives, whatever overrode them."""
        return max(1, self.cores // self.processes)

    def describe(self) -> str:
        """One line for the log, e.g. ``CPU threads: 1 per process (2 cores available, 2 processes on this node);
        data-loader workers: 0; override with --num_threads N or LLMOPT_NUM_THREADS=N (0: torch's defaults)``."""
        cores = f"{self.cores} core{'s' if self.cores != 1 else ''} available"
        machine = f"{cores}, {self.processes} process{'es' if self.processes != 1 else ''} on this node"
        if self.wait_policy:
            machine += f"; OMP_WAIT_POLICY={self.wait_policy}"
        if self.threads is None:
            head = f"CPU threads: torch's default ({ENV}=0; sized: {self.sized}, {machine})"
        elif self.source == "sized":
            head = f"CPU threads: {self.threads} per process ({machine})"
        else:
            head = f"CPU threads: {self.threads} per process (set by {self.source}; sized: {self.sized}, {machine})"
        workers = f"data-loader workers: {self.workers}"
        if self.workers != self.asked_workers:
            workers += f" ({self.asked_workers} configured, capped at the cores per process)"
        return f"{head}; {workers}; override with {self.flag} N or {ENV}=N (0: torch's defaults)"


def _count(name: str, value: str, minimum: int) -> int:
    try:
        count = int(value.strip())
    except ValueError:
        count = -1
    if count < minimum:
        raise ValueError(f"{name} ({value!r}) must be a whole number >= {minimum}")
    return count


def _omp_threads(value: str) -> int | None:
    """``OMP_NUM_THREADS`` as OpenMP reads it: ``"4"``, or the nested list ``"4,2"`` whose first level counts here;
    ``None`` when unset or not a positive count (OpenMP and torch ignore such a value too)."""
    first = value.split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None


def plan_threads(
    cores: int,
    processes: int = 1,
    workers: int = 0,
    num_threads: int | None = None,
    environ: Mapping[str, str] | None = None,
    flag: str = "--num_threads",
) -> ThreadPlan:
    """Intra-op threads and data-loader workers for one of ``processes`` processes sharing ``cores`` (the rule in the
    module docstring). ``num_threads`` is the command-line override; ``environ`` (default ``os.environ``) holds
    ``LLMOPT_NUM_THREADS`` and ``OMP_NUM_THREADS``. Bad values raise ``ValueError`` naming them."""
    environ = os.environ if environ is None else environ
    if cores < 1 or processes < 1 or workers < 0:
        raise ValueError(f"cores ({cores}) and processes ({processes}) must be >= 1, workers ({workers}) >= 0")
    off = ThreadPlan(None, workers, cores, processes, workers, "sized", flag, environ.get("OMP_WAIT_POLICY") or None)
    env_value = environ.get(ENV, "").strip()
    if num_threads is not None:
        threads, source = _count(flag, str(num_threads), 1), flag
    elif env_value:
        threads, source = _count(ENV, env_value, 0), ENV
        if threads == 0:  # off: torch's defaults and the workers configured, as before this module
            return off
    elif (omp := _omp_threads(environ.get("OMP_NUM_THREADS", ""))) is not None:
        threads, source = omp, "OMP_NUM_THREADS"
    else:
        threads, source = off.sized, "sized"
    return dataclasses.replace(off, threads=threads, workers=min(workers, off.sized), source=source)


def prefer_passive_wait(
    environ: MutableMapping[str, str] | None = None, gpu_nodes: tuple[str, ...] = _GPU_DEVICE_NODES
) -> bool:
    """Sets ``OMP_WAIT_POLICY=PASSIVE`` in ``environ`` (default ``os.environ``) unless the user set a policy, sizing is
    off (``LLMOPT_NUM_THREADS=0``) or a GPU driver node exists (GPU runs keep OpenMP's defaults). Takes effect only
    if torch is imported afterwards (in this process or a child). Returns whether it set the variable."""
    environ = os.environ if environ is None else environ
    if environ.get("OMP_WAIT_POLICY") or environ.get(ENV, "").strip() == "0":
        return False
    if any(os.path.exists(node) for node in gpu_nodes):
        return False
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


def configure(
    processes: int = 1, workers: int = 0, num_threads: int | None = None, flag: str = "--num_threads"
) -> ThreadPlan:
    """Plans this process's threads (:func:`plan_threads` on :func:`detect_cores`) and applies them with
    ``torch.set_num_threads``; the caller logs :meth:`ThreadPlan.describe` and applies :attr:`ThreadPlan.workers` to
    its data loaders."""
    import torch

    plan = plan_threads(detect_cores(), processes, workers, num_threads, flag=flag)
    if plan.threads is not None and plan.threads != torch.get_num_threads():
        torch.set_num_threads(plan.threads)
    return plan
