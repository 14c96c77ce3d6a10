"""Shared fixtures and test tiers.

- Without CUDA, ``TRITON_INTERPRET=1`` is set here, at import time, before any test module imports a kernel, so
  Triton kernels run in the interpreter on CPU tensors.
- Tests marked ``gpu`` / ``multigpu`` are skipped with a reason on machines without enough CUDA devices.
- Tests that run Triton kernels in the interpreter get the ``interpreter`` marker (see ``_uses_interpreter``), so
  ``-m "not interpreter"`` runs the rest (the toolchain CI job: Triton 3.6's interpreter cannot run with numpy >= 2.4).
  An unmarked test that launches an interpreted kernel fails and names the marker, so the marks stay complete.
- ``dist_pool(world_size)`` hands out session-wide gloo worker pools (see ``lightning_llmopt.testing.distributed``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

import pytest

from lightning_llmopt.testing.triton import (
    enable_interpreter_without_cuda,
    triton_available,
    triton_interpreter_available,
    triton_interpreter_enabled,
)

enable_interpreter_without_cuda()  # must run before kernel modules are imported

from lightning_llmopt.testing.distributed import DistributedPool, close_all_pools, get_pool  # noqa: E402
from lightning_llmopt.testing.markers import register_markers, skip_unavailable  # noqa: E402

pytest_plugins = ["pytester"]  # runs small pytest sessions in-process (marker tests)


def pytest_configure(config: pytest.Config) -> None:
    register_markers(config)
    _guard_interpreter_launches()
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
    for item in items:
        if item.get_closest_marker("interpreter") is None and _uses_interpreter(item):
            item.add_marker(pytest.mark.interpreter)
    # ``run_last`` tests look at what the whole session left behind (the pool workers' threads): move them to the end
    items.sort(key=lambda item: item.get_closest_marker("run_last") is not None)  # stable: order kept otherwise


_KERNEL_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels") + os.sep


def _uses_interpreter(item: pytest.Item) -> bool:
    """Whether a test runs Triton kernels (in the interpreter on CPU), judged before it runs.

    Those are the tests under ``tests/kernels/``, the users of the ``triton_interpret`` fixture, and the tests whose
    ``skipif`` (on the test, its class or module) names Triton or ``TRITON_INTERPRET`` in its reason: that is how the
    suite states "needs the kernels to run here". Any other test that needs the interpreter carries
    ``@pytest.mark.interpreter`` itself; ``_guard_interpreter_launches`` catches one that does not.
    """
    if str(item.path).startswith(_KERNEL_TESTS) or "triton_interpret" in getattr(item, "fixturenames", ()):
        return True
    return any("triton" in str(mark.kwargs.get("reason", "")).lower() for mark in item.iter_markers("skipif"))


_RUNNING: list[pytest.Item | None] = [None]  # the test now in its call phase


def _guard_interpreter_launches() -> None:
    """Make a kernel launch in the interpreter fail a test that lacks the ``interpreter`` marker.

    Wraps ``GridExecutor.__call__`` of ``triton.runtime.interpreter`` (every ``kernel[grid](...)`` launch goes through
    it in Triton 3.6 to 3.9); only with the interpreter on, and only when that class exists. Launches in
    other processes (pool workers, subprocesses) are not seen: such tests need the marker by one of the rules above.
    """
    if not triton_interpreter_available() or not triton_interpreter_enabled():
        return
    import triton.runtime.interpreter as interpreter

    executor = getattr(interpreter, "GridExecutor", None)
    if executor is None or getattr(executor.__call__, "_llmopt_guard", False):
        return
    launch = executor.__call__

    def guarded(self: object, *args: object, **kwargs: object) -> object:
        item = _RUNNING[0]
        if item is not None and item.get_closest_marker("interpreter") is None:
            pytest.fail(
                f"{item.nodeid} launched a Triton kernel in the interpreter but is not marked: add "
                "@pytest.mark.interpreter (the toolchain CI job deselects those tests with -m 'not interpreter')",
                pytrace=False,
            )
        return launch(self, *args, **kwargs)

    guarded._llmopt_guard = True  # type: ignore[attr-defined]
    executor.__call__ = guarded


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    _RUNNING[0] = item
    try:
        yield
    finally:
        _RUNNING[0] = None


@pytest.fixture(scope="session")
def dist_pool() -> Iterator[Callable[..., DistributedPool]]:
    """Factory of shared worker pools: ``dist_pool(2).run(fn, *args)`` runs ``fn`` on 2 gloo ranks.

    Pools are created on first use per world size, reused by every test in the session, and closed at the end.
    """
    yield get_pool
    close_all_pools()


# what launchers export; Lightning sets several of them in this process when a test runs a Trainer in it
_LAUNCH_VARS = ("MASTER_PORT", "MASTER_ADDR", "NODE_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                "GROUP_RANK", "LLMOPT_RUN_DIR")


@pytest.fixture(autouse=True)
def _fresh_launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts without launcher variables (``MASTER_PORT``, ``LOCAL_RANK``, ...).

    Lightning's single-process strategies set ``MASTER_PORT`` in this process on first use and reuse it; a worker
    pool created afterwards can be handed that very port by the OS for its store (the earlier process group has let
    it go), and the next Trainer test then fails with EADDRINUSE. Without the variable Lightning picks a free port.
    A ``LOCAL_RANK`` left behind makes a child ``llmopt fit`` on 2 devices believe a launcher started it: it waits
    for a rank 1 that nobody starts.
    """
    for name in _LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)


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
