"""A pool of ``torch.distributed`` worker processes that is reused across tests.

Spawning a process group costs seconds per rank on a small CPU machine (each worker imports torch and
rendezvouses), so tests share long-lived workers instead of spawning per test::

    def _sum_ranks() -> float:
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    pool = DistributedPool(world_size=2)
    assert pool.run(_sum_ranks) == [1.0, 1.0]  # one result per rank, in rank order
    pool.close()

Inside the function a worker learns its place from ``torch.distributed`` (``dist.get_rank()``,
``dist.get_world_size()``); the default process group is already initialised and stays alive between tasks,
so functions must not destroy it. They may create sub-groups (``dist.new_group``) or a
``torch.distributed.device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))`` themselves.

How functions travel: functions and classes from importable modules are pickled by name as usual. Those whose
module cannot be imported by name in a fresh process (test files collected by pytest with
``--import-mode=importlib``, scripts run as ``__main__``) are sent as ``(absolute source path, qualified name)``;
the worker loads the file once with :func:`importlib.util.spec_from_file_location` and caches it. Lambdas and
functions defined inside other functions cannot be sent: define them at module level. Arguments and results
are pickled; return plain data or CPU tensors (``DTensor.full_tensor()`` or ``.to_local()`` rather than a
``DTensor``, ``.detach()`` on tensors that require grad).
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import os
import pickle
import time
from collections.abc import Callable
from typing import Any

from lightning_llmopt.testing._dist_worker import (  # noqa: F401
    _REMOTE_PREFIX,
    _STOP,
    DistributedTaskError,
    DistributedTimeoutError,
    _dumps,
    _find_spec_fresh,
    _fn_name,
    _load_by_path,
    _module_from_path,
    _module_importable,
    _Pickler,
    _run_task,
    _worker_main,
)

__all__ = [
    "DistributedPool",
    "DistributedTaskError",
    "DistributedTimeoutError",
    "close_all_pools",
    "get_pool",
    "run_distributed",
]


class DistributedPool:
    """``world_size`` long-lived worker processes joined in one ``torch.distributed`` process group.

    Workers start lazily on the first :meth:`run` (``multiprocessing`` "forkserver" or "spawn"), join the default
    process group once over a TCP store hosted by this process on a free localhost port, then run tasks until
    :meth:`close`. After each task every rank enters a barrier.

    Arguments:
        world_size: number of ranks.
        backend: ``torch.distributed`` backend; ``"gloo"`` for CPU.
        timeout: seconds a task may take; past it, or if a worker dies, all workers are killed, the pool restarts
            on the next :meth:`run` and :class:`DistributedTimeoutError` is raised. Also the process group's
            collective timeout.
        start_timeout: seconds to wait for the workers to join the group.
        num_threads: ``torch.set_num_threads`` in each worker (1 by default: ranks share a few cores);
            ``None`` leaves torch's default.
        error_grace: once a rank has raised, seconds the other ranks get to finish before the workers are killed
            and the error is raised (they may be stuck in a collective the failed rank skipped).
        start_method: ``"forkserver"`` (default) or ``"spawn"``. Both start workers from a fresh interpreter
            state, never from a fork of the caller; the forkserver imports torch once and forks each worker from
            it, so a start costs ~0.1 s instead of one torch import per rank (seconds each on 2 busy cores).
            Workers get the caller's ``os.environ`` as of pool start, but variables that torch reads at import
            take the forkserver's values: use ``"spawn"`` when a test needs those to differ.
        max_worker_threads: before a task, if any worker holds more threads than this, the workers are closed and
            the pool restarts (new pids). Every process group or device mesh a task makes keeps its gloo threads
            (three a group) for the worker's life, and meshes cached by torch may be reused by later tasks, so
            groups are never destroyed between tasks; restarting bounds the threads instead (a full run once left
            650-830 threads per worker). ``None``: never restart. Counted through ``/proc`` (Linux only).
    """

    def __init__(
        self,
        world_size: int,
        backend: str = "gloo",
        timeout: float = 300.0,
        start_timeout: float = 120.0,
        num_threads: int | None = 1,
        start_method: str = "forkserver",
        error_grace: float = 10.0,
        max_worker_threads: int | None = 128,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size ({world_size}) must be >= 1")
        if timeout <= 0 or start_timeout <= 0:
            raise ValueError(f"timeout ({timeout}) and start_timeout ({start_timeout}) must be > 0")
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.num_threads = num_threads
        self.error_grace = error_grace
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(
                f"start_method ({start_method!r}) must be 'forkserver' or 'spawn' (not fork: torch threads)"
            )
        self.start_method = start_method
        self.max_worker_threads = max_worker_threads
        self._processes: list[Any] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._pids: list[int] = []
        self._store: Any = None

    @property
    def started(self) -> bool:
        return bool(self._processes)

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers in rank order (starts them if needed)."""
        self._ensure_started()
        return list(self._pids)

    def _ensure_started(self) -> None:
        if self._processes:
            return
        import torch.distributed as dist

        # The store lives in this process: port 0 lets the OS pick a free port without a bind/close race.
        self._store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
        port = self._store.port
        environ = dict(os.environ)
        ctx: Any = multiprocessing.get_context(self.start_method)
        if self.start_method == "forkserver":
            ctx.set_forkserver_preload(["torch", "torch.distributed", __name__])
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            args = (rank, self.world_size, self.backend, port, child_conn, self.timeout, self.num_threads, environ)
            process = ctx.Process(target=_worker_main, args=args, name=f"llmopt-dist-rank{rank}", daemon=True)
            process.start()
            child_conn.close()
            self._processes.append(process)
            self._conns.append(parent_conn)
        try:
            replies = self._collect(self.start_timeout, what="starting the process group")
        except BaseException:
            self._kill()
            raise
        self._pids = [pid for _, pid in replies]

    def _collect(self, timeout: float, what: str, error_grace: float | None = None) -> list[Any]:
        """One reply per rank; kills the workers and raises DistributedTimeoutError on timeout or death.

        Workers send ``("early", "error", traceback)`` as soon as the function raised, and ``("final", status,
        value)`` after the barrier; only final messages count as replies. With ``error_grace``, once an early error
        arrives the other ranks get that many more seconds (they may be stuck in a collective the failed rank never
        joined, and the failed rank in the barrier); then the workers are killed and the errors raised as
        :class:`DistributedTaskError`.
        """
        deadline = time.monotonic() + timeout
        replies: dict[int, Any] = {}
        early_errors: dict[int, str] = {}
        while len(replies) < self.world_size:
            pending = {self._conns[r]: r for r in range(self.world_size) if r not in replies}
            sentinels = {self._processes[r].sentinel: r for r in pending.values()}
            remaining = deadline - time.monotonic()
            ready = multiprocessing.connection.wait([*pending, *sentinels], timeout=max(remaining, 0.0))
            if not ready:
                waiting = sorted(pending.values())
                self._kill()
                if early_errors:
                    raise DistributedTaskError(early_errors, what, stuck=[r for r in waiting if r not in early_errors])
                raise DistributedTimeoutError(
                    f"{what} took longer than {timeout:.0f} s on world_size={self.world_size} (ranks {waiting} did "
                    "not answer); the workers were killed and the pool restarts on the next run()"
                )
            for obj in ready:
                if obj in pending:
                    rank = pending[obj]
                    try:
                        kind, status, value = pickle.loads(obj.recv_bytes())  # type: ignore[union-attr]
                    except EOFError:
                        continue  # the sentinel reports the death
                    if kind == "final":
                        replies[rank] = (status, value)
                    elif error_grace is not None and rank not in early_errors:
                        early_errors[rank] = value
                        deadline = min(deadline, time.monotonic() + error_grace)
            for obj in ready:
                if obj in sentinels and sentinels[obj] not in replies:
                    rank = sentinels[obj]
                    code = self._processes[rank].exitcode
                    self._kill()
                    raise DistributedTimeoutError(
                        f"rank {rank} died (exit code {code}) while {what}; the workers were killed and the pool "
                        "restarts on the next run()"
                    )
        return [replies[r] for r in range(self.world_size)]

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank and return the results in rank order.

        Raises:
            DistributedTaskError: ``fn`` raised on some rank; carries each failing rank's remote traceback.
                The workers stay alive and usable.
            DistributedTimeoutError: the task exceeded ``timeout`` or a worker died; the workers were killed.
        """
        payload = _dumps((fn, args, kwargs))  # fail here, before any worker is involved, if fn cannot travel
        if self.max_worker_threads is not None and max(self.thread_counts(), default=0) > self.max_worker_threads:
            self.close()  # restarts below with fresh workers
        self._ensure_started()
        for conn in self._conns:
            conn.send_bytes(payload)
        outcomes = self._collect(self.timeout, what=_fn_name(fn), error_grace=self.error_grace)
        errors = {rank: value for rank, (status, value) in enumerate(outcomes) if status == "error"}
        if errors:
            raise DistributedTaskError(errors, _fn_name(fn))
        return [value for _, value in outcomes]

    def thread_counts(self) -> list[int]:
        """Threads of each running worker, in rank order (empty if the pool is not started or not on Linux)."""
        counts = []
        for pid in self._pids:
            try:
                counts.append(len(os.listdir(f"/proc/{pid}/task")))
            except OSError:
                return []
        return counts

    def close(self, timeout: float = 30.0) -> None:
        """Ask the workers to destroy their process group and exit; kill those that do not within ``timeout``."""
        if not self._processes:
            return
        for conn in self._conns:
            try:
                conn.send_bytes(_STOP)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout
        for process in self._processes:
            process.join(max(deadline - time.monotonic(), 0.0))
        self._kill()

    def _kill(self) -> None:
        for process in self._processes:
            if process.is_alive():
                process.kill()
        for process in self._processes:
            process.join(5.0)
        for conn in self._conns:
            conn.close()
        self._processes, self._conns, self._pids = [], [], []
        self._store = None

    def __enter__(self) -> DistributedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DistributedPool(world_size={self.world_size}, backend={self.backend!r}, started={self.started})"


# --------------------------------------------------------------------------- shared pools

_POOLS: dict[tuple[int, str], DistributedPool] = {}


def get_pool(world_size: int, backend: str = "gloo") -> DistributedPool:
    """The process-wide pool for ``(world_size, backend)``, created on first use and closed at exit."""
    key = (world_size, backend)
    if key not in _POOLS:
        _POOLS[key] = DistributedPool(world_size, backend=backend)
    return _POOLS[key]


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks of a shared pool; results in rank order."""
    return get_pool(world_size).run(fn, *args, **kwargs)


def close_all_pools() -> None:
    """Close every pool made by :func:`get_pool`."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.close()


atexit.register(close_all_pools)
