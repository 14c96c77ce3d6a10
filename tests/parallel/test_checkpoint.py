"""Atomic sharded checkpoints: round trip, resharding 2 -> 1 and 2 -> 4 ranks, truncation, a rank killed mid-save."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_llmopt.parallel.checkpoint import (
    IncompleteCheckpointError,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    step_dir,
    verify_checkpoint,
)
from lightning_llmopt.testing.distributed import DistributedTimeoutError


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g)}, "step": seed}


def _blank() -> dict:
    return {"model": {"w": torch.zeros(6, 5), "b": torch.zeros(5)}, "step": -1}


def test_round_trip_and_latest(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(_state(step), tmp_path, step, keep_last=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-00000002", "step-00000003"]
    state = _blank()
    marker = load_checkpoint(state, tmp_path)  # the root: newest complete checkpoint
    assert marker["step"] == 3 and marker["world_size"] == 1
    torch.testing.assert_close(state["model"]["w"], _state(3)["model"]["w"], rtol=0, atol=0)
    assert state["step"] == 3


def test_truncated_checkpoint_is_refused_and_skipped(tmp_path):
    save_checkpoint(_state(1), tmp_path, 1)
    bad = save_checkpoint(_state(2), tmp_path, 2)
    shard = next(p for p in bad.iterdir() if p.suffix == ".distcp")
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size // 2)
    with pytest.raises(IncompleteCheckpointError, match=r"damaged: .*\.distcp has \d+ bytes, \d+ were written; "
                                                        r"the newest complete checkpoint is .*step-00000001"):
        load_checkpoint(_blank(), bad)
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 1)
    state = _blank()
    assert load_checkpoint(state, tmp_path)["step"] == 1  # falls back to the previous complete one


def test_folder_without_marker_is_refused(tmp_path):
    save_checkpoint(_state(1), tmp_path, 1)
    folder = save_checkpoint(_state(2), tmp_path, 2)
    (folder / "COMPLETE").unlink()
    with pytest.raises(IncompleteCheckpointError, match="no COMPLETE marker .* newest complete checkpoint is"):
        verify_checkpoint(folder)
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 1)
    with pytest.raises(IncompleteCheckpointError, match="no complete checkpoint under"):
        load_checkpoint(_blank(), tmp_path / "empty-root")


# ---------------------------------------------------------------- distributed (module-level worker functions)


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (torch.distributed.get_world_size(),))


def _sharded_state(full: dict) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh()
    return {"model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full["model"].items()},
            "step": full["step"]}


def _save_sharded(root: str, step: int) -> str:
    return str(save_checkpoint(_sharded_state(_state(step)), root, step))


def _load_sharded(root: str) -> tuple[dict, int]:
    state = _sharded_state(_blank())
    marker = load_checkpoint(state, root)
    return {k: v.full_tensor() for k, v in state["model"].items()}, marker["world_size"]


def _save_then_die(root: str) -> None:
    import torch.distributed.checkpoint as dcp

    rank = torch.distributed.get_rank()
    real_save = dcp.save

    def dying_save(*args, **kwargs):
        if rank == 1:
            os._exit(17)  # killed while the checkpoint is being written
        return real_save(*args, **kwargs)

    dcp.save = dying_save
    save_checkpoint(_sharded_state(_state(2)), root, 2)


def test_sharded_save_reshards_on_load(dist_pool, tmp_path):
    root = str(tmp_path)
    dist_pool(2).run(_save_sharded, root, 5)
    expected = _state(5)["model"]
    for full, world in dist_pool(4).run(_load_sharded, root):  # 2 ranks -> 4 ranks
        assert world == 2
        for k, v in expected.items():
            torch.testing.assert_close(full[k], v, rtol=0, atol=0)
    state = _blank()  # 2 ranks -> 1 process, plain tensors
    load_checkpoint(state, root)
    torch.testing.assert_close(state["model"]["w"], expected["w"], rtol=0, atol=0)


def test_rank_killed_during_save_leaves_previous_checkpoint(dist_pool, tmp_path):
    root = str(tmp_path)
    dist_pool(2).run(_save_sharded, root, 1)
    with pytest.raises(DistributedTimeoutError, match="rank 1 died"):
        dist_pool(2).run(_save_then_die, root)
    assert latest_checkpoint(root) == step_dir(root, 1)
    assert not step_dir(root, 2).exists()
    for full, _ in dist_pool(2).run(_load_sharded, root):  # the restarted pool loads the survivor
        torch.testing.assert_close(full["w"], _state(1)["model"]["w"], rtol=0, atol=0)
