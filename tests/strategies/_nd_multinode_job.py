"""One rank of a 2-node x 2-rank ``NDParallelStrategy(tensor_parallel=2)`` run, launched by torchrun (gloo, CPU).

Run by tests/strategies/test_nd_multinode.py as ``torchrun --nnodes 2 --node-rank N --nproc-per-node 2 ... <this>
<init weights> <out dir>``. Lightning detects torchrun's environment (``TorchElasticEnvironment``) and creates the
process group itself; the trainer gets ``num_nodes=2, devices=2``. Rows are split over the data-parallel ranks as in
``_nd_jobs.fit``, so every layout sees the same global batches. Rank 0 saves the summary (losses averaged over the
ranks, full parameters) and every rank saves its mesh coordinates and tensor-parallel group.
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.environments import TorchElasticEnvironment

_spec = importlib.util.spec_from_file_location("_nd_jobs", Path(__file__).with_name("_nd_jobs.py"))
assert _spec is not None and _spec.loader is not None
J = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("_nd_jobs", J)
_spec.loader.exec_module(J)

from lightning_llmopt.data.sampler import ResumableDataLoader, ResumableShardedSampler  # noqa: E402
from lightning_llmopt.parallel.mesh import ParallelDims  # noqa: E402
from lightning_llmopt.strategies import NDParallelStrategy  # noqa: E402

NUM_NODES, DEVICES, TP = 2, 2, 2


def main(init_path: str, out: str) -> None:
    L.seed_everything(0, verbose=False)
    random.seed(0)
    torch.set_num_threads(1)
    recorder = J.Recorder()
    strategy = NDParallelStrategy(tensor_parallel=TP, process_group_backend="gloo")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=DEVICES,
        num_nodes=NUM_NODES,
        strategy=strategy,
        max_steps=J.STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[recorder],
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    assert isinstance(trainer.strategy.cluster_environment, TorchElasticEnvironment)
    rank = int(os.environ["RANK"])  # the trainer's rank too; known before Lightning creates the process group
    dims = ParallelDims.resolve(NUM_NODES * DEVICES, tensor_parallel=TP)
    dp, dp_rank = dims.dp, dims.coordinates(rank)["dp"]
    data = J.Tokens(J.GLOBAL_BATCH * J.STEPS)
    sampler = ResumableShardedSampler(data, num_replicas=dp, rank=dp_rank, seed=0)
    loader = ResumableDataLoader(data, batch_size=J.GLOBAL_BATCH // dp, sampler=sampler, drop_last=True)
    trainer.fit(J.Module(init_path=init_path), train_dataloaders=loader)
    result = J.summary(recorder, trainer)
    mesh = trainer.strategy.device_mesh  # type: ignore[attr-defined]
    torch.save(
        {
            "global_rank": trainer.global_rank,
            "node_rank": trainer.node_rank,
            "local_rank": trainer.local_rank,
            "world_size": trainer.world_size,
            "tp_group": sorted(dist.get_process_group_ranks(mesh["tp"].get_group())),
            "dp_group": sorted(dist.get_process_group_ranks(mesh["dp"].get_group())),
        },
        Path(out) / f"rank{trainer.global_rank}.pt",
    )
    if trainer.global_rank == 0:
        torch.save(result, Path(out) / "summary.pt")
    # Every rank's files are written before any rank tears down, and the group is destroyed explicitly: gloo's
    # worker threads otherwise meet the interpreter's exit and one rank in a few dozen aborts ("terminate called
    # without an active exception", SIGABRT), after its work is done.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip C++ static destructors, which race with threads the gloo backend leaves behind
