"""The reusable gloo worker pool: collectives, per-rank results, remote errors, reuse, sub-groups, timeouts."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from lightning_llmopt.testing.distributed import DistributedPool, DistributedTaskError, DistributedTimeoutError


def _all_reduce_rank_values(scale: float) -> list[float]:
    t = torch.tensor([scale * (dist.get_rank() + 1), 1.0])
    dist.all_reduce(t)
    return t.tolist()


def _rank_info(tag: str, *, suffix: str = "") -> tuple[int, int, str, int]:
    return dist.get_rank(), dist.get_world_size(), tag + suffix, os.getpid()


def _getenv(name: str) -> str | None:
    return os.environ.get(name)


def _fail_on_rank_one(message: str) -> int:
    if dist.get_rank() == 1:
        raise ValueError(message)
    return dist.get_rank()


def _mesh_2x2() -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rank = dist.get_rank()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mesh.get_group("tp"))  # ranks {0,1} and {2,3} along tp (row-major mesh)
    u = torch.tensor([float(rank)])
    dist.all_reduce(u, group=mesh.get_group("dp"))  # ranks {0,2} and {1,3} along dp
    return {
        "coord": list(mesh.get_coordinate() or []),
        "tp_sum": t.item(),
        "dp_sum": u.item(),
        "tp_size": mesh["tp"].size(),
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_sums_over_ranks(dist_pool, world_size: int) -> None:
    results = dist_pool(world_size).run(_all_reduce_rank_values, 0.5)
    expected = [0.5 * world_size * (world_size + 1) / 2, float(world_size)]
    assert results == [expected] * world_size


def test_results_are_returned_per_rank(dist_pool) -> None:
    results = dist_pool(2).run(_rank_info, "x", suffix="!")
    assert [r[:3] for r in results] == [(0, 2, "x!"), (1, 2, "x!")]
    assert [r[3] for r in results] == dist_pool(2).pids


def test_error_on_rank_one_surfaces_and_pool_survives(dist_pool) -> None:
    pool = dist_pool(2)
    pids = pool.pids
    with pytest.raises(DistributedTaskError) as info:
        pool.run(_fail_on_rank_one, "boom from rank one")
    err = info.value
    assert err.rank == 1 and list(err.errors) == [1]
    assert "ValueError: boom from rank one" in err.remote_traceback
    assert "_fail_on_rank_one" in err.remote_traceback  # the remote frame, not just the message
    assert "rank(s) 1" in str(err)
    assert pool.run(_all_reduce_rank_values, 1.0) == [[3.0, 2.0]] * 2
    assert pool.pids == pids  # no restart


_SEEN_PIDS: list[list[int]] = []


@pytest.mark.parametrize("which", ["first", "second"])
def test_pool_is_reused_across_tests(dist_pool, which: str) -> None:
    pids = [r[3] for r in dist_pool(2).run(_rank_info, which)]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    _SEEN_PIDS.append(pids)
    assert all(seen == pids for seen in _SEEN_PIDS)
    if which == "second":
        assert len(_SEEN_PIDS) >= 2


def test_device_mesh_2x2_named_dims(dist_pool) -> None:
    results = dist_pool(4).run(_mesh_2x2)
    assert [r["coord"] for r in results] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert [r["tp_sum"] for r in results] == [1.0, 1.0, 5.0, 5.0]
    assert [r["dp_sum"] for r in results] == [2.0, 4.0, 2.0, 4.0]
    assert {r["tp_size"] for r in results} == {2}


def test_local_functions_are_rejected_before_running(dist_pool) -> None:
    def local() -> None:
        pass

    with pytest.raises(Exception, match="module level"):
        dist_pool(2).run(local)


def test_timeout_kills_workers_and_restarts() -> None:
    pool = DistributedPool(1, timeout=1.0)
    try:
        first = pool.pids
        with pytest.raises(DistributedTimeoutError, match="longer than 1 s"):
            pool.run(time.sleep, 60)
        assert not pool.started
        # the restarted worker's first task imports this module: give it time on a loaded machine (CI once took
        # over 1 s); what is tested is that the pool restarts, not how fast
        pool.timeout = 120.0
        assert pool.run(_rank_info, "again")[0][:3] == (0, 1, "again")
        assert pool.pids != first
    finally:
        pool.close()


_REMOTE_SOURCE = """
import torch.distributed as dist


class Box:
    def __init__(self, value):
        self.value = value


def scaled_rank(box):
    return Box(box.value * (dist.get_rank() + 1))
"""


def test_functions_from_non_importable_files_travel_by_path(dist_pool, tmp_path) -> None:
    """Like a test file collected with --import-mode=importlib: the module name cannot be imported by workers."""
    import importlib.util
    import sys

    path = tmp_path / "remote_helpers.py"
    path.write_text(_REMOTE_SOURCE)
    name = "llmopt_not_importable_helpers"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        results = dist_pool(2).run(module.scaled_rank, module.Box(3))
    finally:
        del sys.modules[name]
    # The workers' Box instances come back as this process's class, loaded from the same file.
    assert [type(r) for r in results] == [module.Box, module.Box]
    assert [r.value for r in results] == [3, 6]


def test_spawn_start_method_and_environment(monkeypatch) -> None:
    monkeypatch.setenv("LLMOPT_TEST_MARKER", "from-parent")
    with DistributedPool(1, start_method="spawn") as pool:
        assert pool.run(_getenv, "LLMOPT_TEST_MARKER") == ["from-parent"]
        assert pool.run(_all_reduce_rank_values, 2.0) == [[2.0, 1.0]]
    assert not pool.started


def test_environment_is_forwarded_through_the_forkserver(monkeypatch) -> None:
    monkeypatch.setenv("LLMOPT_TEST_MARKER", "fresh")
    with DistributedPool(1) as pool:
        assert pool.run(_getenv, "LLMOPT_TEST_MARKER") == ["fresh"]


def _fail_before_collective() -> float:
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 gives up before the all_reduce")
    t = torch.ones(1)
    dist.all_reduce(t)  # never matched by rank 1
    return t.item()


def test_error_while_others_wait_in_a_collective_fails_fast() -> None:
    with DistributedPool(2, error_grace=1.0) as pool:
        start = time.monotonic()
        with pytest.raises(DistributedTaskError) as info:
            pool.run(_fail_before_collective)
        assert time.monotonic() - start < 60  # not the 300 s task timeout
        assert info.value.rank == 1 and "gives up" in info.value.remote_traceback
        assert 0 in info.value.stuck or 0 in info.value.errors  # rank 0 hung, or gloo reported the mismatch
        assert pool.run(_all_reduce_rank_values, 1.0) == [[3.0, 2.0]] * 2  # fresh workers after the kill


def test_second_copy_of_a_helper_file_travels_by_path(dist_pool, tmp_path, monkeypatch) -> None:
    """A helper loaded by path from two test files gives two module objects under one name; when its folder is also
    importable (someone put it on sys.path), pickling by name would find the other copy. It must travel by path."""
    import importlib.util
    import sys

    (tmp_path / "_helper_twice.py").write_text("def value(x):\n    return x + 1\n")
    copies = []
    for _ in range(2):
        spec = importlib.util.spec_from_file_location("_helper_twice", tmp_path / "_helper_twice.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        copies.append(module)
    monkeypatch.setitem(sys.modules, "_helper_twice", copies[0])
    monkeypatch.syspath_prepend(str(tmp_path))  # the name is importable in a fresh process too
    assert copies[1].value is not copies[0].value
    assert dist_pool(2).run(copies[1].value, 1) == [2, 2]


def _thread_names() -> dict[str, int]:
    names: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            name = f.read().strip()
        names[name] = names.get(name, 0) + 1
    return names


def _make_groups_and_meshes() -> float:
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    group = dist.new_group(list(range(world)))
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    dist.all_reduce(t, group=mesh.get_group("tp"))
    return t.item()  # world_size, then times the tp size (2)


# A worker's own threads: the main thread and the default gloo group's two ``pt_gloo_runloop`` + one
# ``gloo_tcp_loop``; every other process group a task makes adds three for the worker's life. One task of the
# suite makes at most a handful of groups, so 48 threads above the restart bound is room for the task that crossed it.
_ONE_TASK_OF_GROUPS = 48


@pytest.mark.run_last
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc (Linux)")
def test_pool_workers_keep_a_bounded_thread_count(dist_pool) -> None:
    """At the end of the session every started pool's workers are within the restart bound (plus one task)."""
    from lightning_llmopt.testing import distributed

    pools = [pool for pool in distributed._POOLS.values() if pool.started] or [dist_pool(2)]
    for pool in pools:
        counts = [sum(names.values()) for names in pool.run(_thread_names)]
        assert max(counts) <= pool.max_worker_threads + _ONE_TASK_OF_GROUPS, (pool, counts)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc (Linux)")
def test_pool_restarts_workers_past_the_thread_bound() -> None:
    """Tasks that make process groups and meshes add threads; past ``max_worker_threads`` the next task runs on
    fresh workers, so the count stays bounded however many such tasks run."""
    with DistributedPool(2, max_worker_threads=20) as pool:
        pids, counts = [], []
        for _ in range(5):
            assert pool.run(_make_groups_and_meshes) == [4.0, 4.0]
            pids.append(tuple(pool.pids))
            counts.append(max(pool.thread_counts()))
        assert len(set(pids)) >= 2, (pids, counts)  # restarted at least once
        assert max(counts) <= 20 + 3 * 3, counts  # one task adds three groups of three threads
        assert counts[0] > 4, counts  # the groups of a task do keep threads (what the bound is for)
