"""Shared fixtures and test tiers.

- Without CUDA, ``TRITON_INTERPRET=1`` is set here, at import time, before any test module imports a kernel, so
  Triton kernels run in the interpreter on CPU tensors.
- Tests marked ``gpu`` / ``multigpu`` are skipped with a reason on machines without enough CUDA devices.
- ``dist_pool(world_size)`` hands out session-wide gloo worker pools (see ``lightning_llmopt.testing.distributed``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

import pytest

from lightning_llmopt.testing.triton import enable_interpreter_without_cuda, triton_available

enable_interpreter_without_cuda()  # must run before kernel modules are imported

from lightning_llmopt.testing.distributed import DistributedPool, close_all_pools, get_pool  # noqa: E402
from lightning_llmopt.testing.markers import register_markers, skip_unavailable  # noqa: E402

pytest_plugins = ["pytester"]  # runs small pytest sessions in-process (marker tests)


def pytest_configure(config: pytest.Config) -> None:
    register_markers(config)
    # The engine's on-disk tuning cache: the suite neither reads a user's cache (GPU tests would skip the tuning they
    # test) nor leaves one behind. Set before any pool worker or server process starts, so they inherit it.
    if "LLMOPT_CACHE_DIR" not in os.environ:
        os.environ["LLMOPT_CACHE_DIR"] = _OWN_CACHE[0] = tempfile.mkdtemp(prefix="llmopt-test-cache-")


_OWN_CACHE = [""]


def pytest_unconfigure(config: pytest.Config) -> None:
    if _OWN_CACHE[0]:
        shutil.rmtree(_OWN_CACHE[0], ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_unavailable(items)
    # ``run_last`` tests look at what the whole session left behind (the pool workers' threads): move them to the end
    items.sort(key=lambda item: item.get_closest_marker("run_last") is not None)  # stable: order kept otherwise


@pytest.fixture(scope="session")
def dist_pool() -> Iterator[Callable[..., DistributedPool]]:
    """Factory of shared worker pools: ``dist_pool(2).run(fn, *args)`` runs ``fn`` on 2 gloo ranks.

    Pools are created on first use per world size, reused by every test in the session, and closed at the end.
    """
    yield get_pool
    close_all_pools()


@pytest.fixture(autouse=True)
def _fresh_master_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts without ``MASTER_PORT``.

    Lightning's single-process strategies set ``MASTER_PORT`` in this process on first use and reuse it; a worker
    pool created afterwards can be handed that very port by the OS for its store (the earlier process group has let
    it go), and the next Trainer test then fails with EADDRINUSE. Without the variable Lightning picks a free port.
    """
    monkeypatch.delenv("MASTER_PORT", raising=False)


@pytest.fixture
def triton_interpret(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run kernels decorated during the test in the Triton interpreter; skip if Triton is not installed.

    Kernels decorated at module import time are unaffected; on CPU-only machines they already run in the
    interpreter because this conftest set ``TRITON_INTERPRET=1`` before the test modules were imported.
    """
    if not triton_available():
        pytest.skip("needs triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield
