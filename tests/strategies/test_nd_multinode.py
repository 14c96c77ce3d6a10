"""NDParallelStrategy over several nodes: tensor- and context-parallel groups stay inside a node.

A node holds consecutive global ranks (``node_rank * ranks_per_node + local_rank``) and the mesh is ``("pp", "dp",
"cp", "tp")``, outermost first, so a (cp, tp) group is a block of ``tp * cp`` consecutive ranks. The pure tests check
every small layout: ``ParallelDims.check_nodes`` accepts exactly the layouts whose (cp, tp) blocks lie inside one node.
The end-to-end test launches 2 "nodes" x 2 ranks on this machine with torchrun (``--nnodes 2 --node-rank {0,1}``,
gloo, 127.0.0.1 only) and trains ``CausalLMModule("tiny")`` with ``NDParallelStrategy(tensor_parallel=2)`` (dp=2
across the nodes) through ``Trainer(num_nodes=2, devices=2)``; losses and parameters after 5 AdamW steps match
Lightning's single-process run on the same global batches to 1e-6 relative, as in test_nd_parallel.py.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.plugins.environments import LightningEnvironment

from lightning_llmopt import CausalLMModule
from lightning_llmopt.parallel.mesh import ParallelDims
from lightning_llmopt.strategies import NDParallelStrategy

_spec = importlib.util.spec_from_file_location("_nd_jobs", Path(__file__).with_name("_nd_jobs.py"))
assert _spec is not None and _spec.loader is not None
J = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("_nd_jobs", J)
_spec.loader.exec_module(J)

TOL = 1e-6  # as test_nd_parallel.py: fp32, 5 AdamW steps at lr 3e-4
JOB = Path(__file__).with_name("_nd_multinode_job.py")
TIMEOUT_S = 150  # the whole 2-node run; it takes ~30 s on 2 shared cores
REFUSED = r"tensor_parallel\*context_parallel \({}\) must divide the ranks per node \({}\)"


def _node(rank: int, ranks_per_node: int) -> int:
    return rank // ranks_per_node


def _inner_blocks(dims: ParallelDims) -> list[list[int]]:
    """Ranks sharing (pp, dp): the (cp, tp) groups, computed from the coordinates, not from the layout rule."""
    blocks: dict[tuple[int, int], list[int]] = {}
    for r in range(dims.world_size):
        c = dims.coordinates(r)
        blocks.setdefault((c["pp"], c["dp"]), []).append(r)
    return list(blocks.values())


def test_two_nodes_tp2_groups_inside_a_node() -> None:
    dims = ParallelDims.resolve(4, tensor_parallel=2)
    dims.check_nodes(num_nodes=2, ranks_per_node=2)
    assert dims.group_ranks("tp") == [[0, 1], [2, 3]]
    for group in dims.group_ranks("tp"):
        assert len({_node(r, 2) for r in group}) == 1
    for group in dims.group_ranks("dp"):  # data parallelism spans the nodes
        assert {_node(r, 2) for r in group} == {0, 1}


def test_tp2_with_one_rank_per_node_is_refused() -> None:
    dims = ParallelDims.resolve(2, tensor_parallel=2)
    with pytest.raises(ValueError, match=REFUSED.format(2, 1)):
        dims.check_nodes(num_nodes=2, ranks_per_node=1)
    dims = ParallelDims.resolve(8, tensor_parallel=2, context_parallel=2)
    with pytest.raises(ValueError, match=REFUSED.format(4, 2)):
        dims.check_nodes(num_nodes=4, ranks_per_node=2)
    with pytest.raises(ValueError, match=r"num_nodes\*ranks_per_node \(2\*3\) != world_size \(4\)"):
        ParallelDims.resolve(4).check_nodes(num_nodes=2, ranks_per_node=3)


def _layouts() -> list[tuple[int, int, int, int, int]]:
    out = []
    grid = itertools.product((1, 2, 3, 4), (1, 2, 3, 4, 6, 8), (1, 2, 3, 4), (1, 2), (1, 2))
    for nodes, per_node, tp, cp, pp in grid:
        world = nodes * per_node
        if world <= 24 and world % (tp * cp * pp) == 0:
            out.append((nodes, per_node, tp, cp, pp))
    return out


def test_check_nodes_accepts_exactly_the_layouts_with_tp_cp_inside_a_node() -> None:
    layouts = _layouts()
    refused = 0
    for nodes, per_node, tp, cp, pp in layouts:
        dims = ParallelDims.resolve(nodes * per_node, tensor_parallel=tp, context_parallel=cp, pipeline_parallel=pp)
        inside = all(len({_node(r, per_node) for r in b}) == 1 for b in _inner_blocks(dims))
        try:
            dims.check_nodes(nodes, per_node)
        except ValueError:
            refused += 1
            assert not inside, (nodes, per_node, tp, cp, pp)
            continue
        assert inside, (nodes, per_node, tp, cp, pp)
        for name in ("tp", "cp"):
            for group in dims.group_ranks(name):
                assert len({_node(r, per_node) for r in group}) == 1, (name, nodes, per_node, tp, cp, pp)
    assert 0 < refused < len(layouts)  # both outcomes occur


def test_strategy_refuses_tp_across_nodes_before_any_collective() -> None:
    strategy = NDParallelStrategy(
        tensor_parallel=2,
        accelerator=CPUAccelerator(),
        parallel_devices=[torch.device("cpu")],
        cluster_environment=LightningEnvironment(),
    )
    strategy.num_nodes = 2  # what Trainer(num_nodes=2, devices=1) sets
    with pytest.raises(ValueError, match=REFUSED.format(2, 1)):
        strategy.setup_environment()
    assert not dist.is_initialized()


# ---------------------------------------------------------------------------------------------- end to end


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch_two_nodes(init_path: str, out: Path) -> list[str]:
    """Both torchrun agents, each in its own session so a timeout can kill the agent and its ranks."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    port = _free_port()
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("SLURM_NTASKS", None)  # Lightning would otherwise pick SLURMEnvironment inside a SLURM job
    env.pop("SLURM_JOB_NAME", None)
    procs: list[subprocess.Popen[str]] = []
    logs = []
    try:
        for node in (0, 1):
            log = open(out / f"node{node}.log", "w")  # noqa: SIM115 - closed below
            logs.append(log)
            cmd = [
                torchrun,
                "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(port), "--local-addr", "127.0.0.1",
                "--max-restarts", "0", "--monitor-interval", "0.5",
                str(JOB), init_path, str(out),
            ]  # fmt: skip
            procs.append(
                subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
            )
        deadline = time.monotonic() + TIMEOUT_S
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
        for log in logs:
            log.close()
    logs_text = [(out / f"node{n}.log").read_text() for n in (0, 1)]
    codes = [p.returncode for p in procs]
    assert codes == [0, 0], f"torchrun exit codes {codes}\n" + "\n".join(t[-4000:] for t in logs_text)
    return logs_text


def _flat(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([params[k].reshape(-1).double() for k in sorted(params)])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_two_nodes_tp2_matches_one_process(tmp_path: Path) -> None:
    L.seed_everything(0, verbose=False)
    module = CausalLMModule("tiny")
    module.configure_model()
    init_path = str(tmp_path / "init.pt")
    torch.save({k: v.clone() for k, v in module.state_dict().items()}, init_path)
    out = tmp_path / "out"
    out.mkdir()

    _launch_two_nodes(init_path, out)
    ranks: list[dict[str, Any]] = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(4)]
    for r, info in enumerate(ranks):
        assert (info["node_rank"], info["local_rank"]) == divmod(r, 2) and info["global_rank"] == r
        assert info["world_size"] == 4
    assert {tuple(i["tp_group"]) for i in ranks} == {(0, 1), (2, 3)}  # each inside a node
    assert {tuple(i["dp_group"]) for i in ranks} == {(0, 2), (1, 3)}  # across the nodes
    result = torch.load(out / "summary.pt", weights_only=True)

    ref = J.summary(*J.fit(None, init_path=init_path))
    losses, ref_losses = torch.tensor(result["losses"]), torch.tensor(ref["losses"])
    assert len(losses) == len(ref_losses) == J.STEPS
    loss_err = float(((losses - ref_losses).abs() / ref_losses.abs()).max())
    assert sorted(result["params"]) == sorted(ref["params"])
    param_err = _rel(_flat(result["params"]), _flat(ref["params"]))
    init = torch.load(init_path, weights_only=True)
    assert _rel(_flat(ref["params"]), _flat({k: init[k] for k in ref["params"]})) > 1e-3  # the weights moved
    print(f"2 nodes x 2 ranks, tp=2 dp=2: loss rel err {loss_err:.2e}, param rel err {param_err:.2e}")
    assert loss_err <= TOL and param_err <= TOL
