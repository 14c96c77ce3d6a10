"""What tensor (+ sequence) parallelism sends per block, and what sending bf16 under autocast costs in accuracy.

Counts: Korthikanti et al. (arXiv 2205.05198, section 4.2.2): per transformer layer, forward and backward together,
tensor parallelism needs 4 all-reduces, and with sequence parallelism 4 all-gathers and 4 reduce-scatters instead.
Collectives are recorded under a dispatch mode on 2 gloo ranks (forward + backward of the tiny Llama), per block as
the difference between 3 and 1 blocks over 2. Under bf16 autocast they carry bf16 (every consumer of the gathered
activations is a projection that autocast runs in bf16); in fp32 training, fp32.

Accuracy: under bf16 autocast every parameter's gradient on 2 ranks must be within twice the error of the same
single-process bf16-autocast gradient against the single-process fp32 one (measured: at most 1.34x, in the norm
weights, whose gradients collect the reduced activation gradients).
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.parallel.mesh import ParallelDims, build_mesh
from lightning_llmopt.parallel.parallelize import NDConfig, materialize, parallelize, sync_gradients
from lightning_llmopt.parallel.tensor_parallel import reduce_partial_grads
from lightning_llmopt.parallel.vocab_parallel import vocab_parallel_cross_entropy


class _Collectives(TorchDispatchMode):
    """Records ``(collective, dtype)`` of every c10d / functional collective dispatched (waits excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter[tuple[str, str]] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__.split(".")[0]
        if func.namespace in ("_c10d_functional", "c10d") and "wait" not in name and "wrap" not in name:
            t = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            self.seen[(name, str(t.dtype).removeprefix("torch."))] += 1
        return func(*args, **(kwargs or {}))


def _tp_model(sp: bool, **kw: Any) -> tuple[Llama, Any, ParallelDims, NDConfig, bool]:
    dims = ParallelDims.resolve(dist.get_world_size(), tensor_parallel=dist.get_world_size())
    mesh = build_mesh(dims, "cpu")
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_preset("tiny", **kw))
    config = NDConfig(sequence_parallel=sp, zero_stage=0)
    done = parallelize(model, mesh, dims, config)
    materialize(model, torch.device("cpu"), mesh, dims, done.fsdp)
    return model, mesh, dims, config, done.fsdp


def _step_collectives(sp: bool, bf16: bool, n_layers: int) -> tuple[dict[str, int], int, int]:
    model = _tp_model(sp, n_layers=n_layers)[0]
    tokens = torch.randint(0, 320, (2, 17), generator=torch.Generator().manual_seed(1))
    with _Collectives() as rec:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = vocab_parallel_cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
    with _Collectives() as sync:
        reduced = reduce_partial_grads(model)
    return {f"{n}:{d}": c for (n, d), c in rec.seen.items()}, sum(sync.seen.values()), reduced


def _per_block(sp: bool, bf16: bool) -> dict[str, Any]:
    one, sync_one, reduced_one = _step_collectives(sp, bf16, 1)
    three, sync_three, reduced_three = _step_collectives(sp, bf16, 3)
    per_block = {k: (three.get(k, 0) - one.get(k, 0)) / 2 for k in set(one) | set(three)}
    return {
        "per_block": {k: v for k, v in per_block.items() if v},
        "sync_collectives": (sync_one, sync_three),
        "partial_grads": (reduced_one, reduced_three),
    }


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16-autocast", "fp32"])
def test_collectives_per_block(dist_pool: Any, bf16: bool) -> None:
    dtype = "bfloat16" if bf16 else "float32"
    sp_run, tp_run = dist_pool(2).run(_per_block, True, bf16)[0], dist_pool(2).run(_per_block, False, bf16)[0]
    assert sp_run["per_block"] == {f"all_gather_into_tensor:{dtype}": 4, f"reduce_scatter_tensor:{dtype}": 4}
    assert tp_run["per_block"] == {f"all_reduce:{dtype}": 4}
    # the norm weights' Partial gradients under sequence parallelism (2 per block + the final norm): one all-reduce
    assert sp_run["partial_grads"] == (3, 7)
    assert sp_run["sync_collectives"] == (1, 1)
    assert tp_run["partial_grads"] == (0, 0) and tp_run["sync_collectives"] == (0, 0)


def _grads(model: torch.nn.Module, tokens: torch.Tensor, bf16: bool, after: Any = None) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = vocab_parallel_cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    if after is not None:
        after()
    return {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().double()
        for n, p in model.named_parameters()
    }


def _tp_bf16_grads(sp: bool, kv: int, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    model, mesh, dims, config, fsdp = _tp_model(sp, n_kv_heads=kv)
    return _grads(model, tokens, True, lambda: sync_gradients(model, mesh, dims, config, fsdp))


@pytest.mark.parametrize("kv", [2, 1], ids=["kv-sharded", "kv-replicated"])
def test_bf16_autocast_gradients_within_twice_one_process_error(dist_pool: Any, kv: int) -> None:
    tokens = torch.randint(0, 320, (4, 33), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    ref = _grads(Llama(LlamaConfig.from_preset("tiny", n_kv_heads=kv)), tokens, False)
    torch.manual_seed(0)
    one = _grads(Llama(LlamaConfig.from_preset("tiny", n_kv_heads=kv)), tokens, True)

    def err(g: dict[str, torch.Tensor], name: str) -> float:
        return float((g[name] - ref[name]).norm() / ref[name].norm())

    for sp in (True, False):
        tp = dist_pool(2).run(_tp_bf16_grads, sp, kv, tokens)[0]
        assert sorted(tp) == sorted(ref)
        for name in ref:
            assert err(tp, name) <= 2 * err(one, name), (sp, name, err(tp, name), err(one, name))
