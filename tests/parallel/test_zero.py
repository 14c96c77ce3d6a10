"""ZeRO-1/2 against single-process training of the tiny Llama on CPU/gloo (workers reuse the session pool)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_llmopt.models.config import LlamaConfig
from lightning_llmopt.models.llama import Llama
from lightning_llmopt.parallel.zero import ZeroOptimizer
from lightning_llmopt.parallel.zero_state import master_weights, to_torch_optimizer_state

# LR 3e-4 (CausalLMModule's default peak rate), as tests/strategies/_nd_jobs.py: at 3e-3 AdamW's normalised step
# amplifies fp32 rounding in weights whose gradient is ~Adam's eps, and whether that crosses 1e-6 in 4 clipped steps
# depends on which random weights are drawn (1.18e-6 on tok_embeddings with the per-name init, 2.7e-7 before).
GLOBAL_BATCH, SEQ, LR, BUCKET_MB = 4, 16, 3e-4, 0.05  # 0.05 MiB buckets: ~10 buckets, several per param group


def _model(dtype: torch.dtype = torch.float32) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.from_preset("tiny")).to(dtype)


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two param groups (decay on matrices, none on norms, different lr) to check that groups are preserved."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 2 * LR}]


def _factory(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95))


def _batches(steps: int) -> Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 320, (steps, GLOBAL_BATCH, SEQ + 1), generator=g)  # (steps, B, T + 1)


def _loss(model: nn.Module, tokens: Tensor) -> Tensor:
    logits = model(tokens[:, :-1])  # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _max_rel(params: dict[str, Tensor], ref: dict[str, Tensor]) -> float:
    assert params.keys() == ref.keys()
    return max(_rel(params[k], ref[k]) for k in ref)


@functools.cache
def _reference(world_size: int, steps: int, clip: float | None = None, reverse: bool = False
               ) -> tuple[list[float], dict[str, Tensor]]:
    """Plain AdamW on the full global batch; the loss is the equal-weight mean of the ranks' half-batch losses
    (``reverse``: summed in the opposite order, to measure fp32 reduction-order noise)."""
    model = _model()
    opt = _factory(_groups(model))
    losses = []
    for tokens in _batches(steps):
        parts = tokens.chunk(world_size)
        loss = torch.stack([_loss(model, part) for part in (parts[::-1] if reverse else parts)]).mean()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _param_tolerance(world_size: int) -> float:
    """1e-6 relative per parameter tensor on 2 ranks (the sums are then bit-identical in practice). With 4 ranks the
    reduction order of the 4 partial gradients differs from autograd's, and Adam's normalised update amplifies that
    fp32 noise in elements with tiny gradients: reordering the single-process sum alone moves some tensors by
    ~3.5e-6 relative after 10 steps. There the bound is 4x that measured floor (and never below 1e-6)."""
    if world_size <= 2:
        return 1e-6
    _, a = _reference(world_size, 10)
    _, b = _reference(world_size, 10, reverse=True)
    return max(1e-6, 4 * _max_rel(a, b))


def _mean_over_ranks(x: Tensor) -> float:
    x = x.detach().clone()
    dist.all_reduce(x)
    return x.item() / dist.get_world_size()


def _zero_train(stage: int, steps: int, clip: float | None = None, dtype: torch.dtype = torch.float32,
                **kwargs: Any) -> dict[str, Any]:
    """Worker: ZeRO training on this rank's slice of each global batch."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = _model(dtype)
    params_before = list(model.parameters())
    opt = ZeroOptimizer(model, _factory, stage=stage, bucket_size_mb=BUCKET_MB, param_groups=_groups(model),
                        **kwargs)
    assert [id(p) for p in model.parameters()] == [id(p) for p in params_before]
    losses, norms = [], []
    for tokens in _batches(steps):
        loss = _loss(model, tokens.chunk(ws)[rank])
        loss.backward()
        if clip is not None:
            norms.append(opt.clip_grad_norm_(clip).item())
        opt.step()
        memory = opt.memory_bytes()  # after the step, before zero_grad: reduced gradients and optimizer state
        opt.zero_grad()
        losses.append(_mean_over_ranks(loss))
    b = opt.buckets[0]
    info = {"param_dtypes": sorted({str(p.dtype) for p in model.parameters()}), "master_dtype": str(b.master.dtype),
            "master_device": str(b.master.device), "master_aliased": b.master_aliased,
            "state_devices": sorted({str(v.device) for s in opt.optimizer.state.values() for v in s.values()}),
            "master_separate": b.master.data_ptr() != b.flat_param.data_ptr() + b.shard_start * b.flat_param.itemsize}
    params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    opt.remove_hooks()
    return {"losses": losses, "norms": norms, "params": params if rank == 0 else None, "memory": memory,
            "info": info, "num_buckets": len(opt.buckets)}


# ------------------------------------------------------------------ acceptance: parity with one process
@pytest.mark.parametrize(("stage", "world_size", "kwargs"), [
    (1, 2, {}),
    (2, 2, {}),
    (2, 4, {}),
    (1, 4, {}),
    (2, 2, {"reduce_scatter": "all_reduce"}),  # the fallback used where gloo lacks reduce_scatter_tensor
    (1, 2, {"offload_optimizer": True}),
    (2, 2, {"offload_optimizer": True}),
])
def test_matches_single_process(dist_pool: Any, stage: int, world_size: int, kwargs: dict[str, Any]) -> None:
    results = dist_pool(world_size).run(_zero_train, stage, 10, **kwargs)
    ref_losses, ref_params = _reference(world_size, 10)
    for r in results:
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref_losses, strict=True)) <= 1e-6
    assert _max_rel(results[0]["params"], ref_params) <= _param_tolerance(world_size)
    info = results[0]["info"]
    if kwargs.get("offload_optimizer"):  # ZeRO-Offload: master shard, state and step on the CPU, a separate copy
        assert info["master_device"] == "cpu" and info["state_devices"] == ["cpu"]
        assert not info["master_aliased"] and info["master_separate"]
    else:  # fp32 parameters: the master shard is the parameter shard itself
        assert info["master_aliased"] and not info["master_separate"]


def test_memory_is_sharded(dist_pool: Any) -> None:
    """Optimizer state is 1/N of one process's (stage >= 1); gradients are 1/N in stage 2 (up to padding)."""
    model = _model()
    opt = _factory(_groups(model))
    _loss(model, _batches(1)[0]).backward()
    opt.step()
    single_state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    single_grads = sum(p.numel() * 4 for p in model.parameters())
    n_params = len(list(model.parameters()))
    for stage, world_size in ((1, 2), (2, 2), (2, 4)):
        results = dist_pool(world_size).run(_zero_train, stage, 1)
        slack = 2 * 4 * results[0]["num_buckets"] * world_size  # padding: < world_size elements per bucket
        for r in results:
            mem = r["memory"]
            assert mem["master_weights"] == 0  # fp32 parameters need no separate master copy
            # 8 bytes/element of AdamW moments; "step" is one 4-byte scalar per bucket instead of per parameter
            expected_state = (single_state - 4 * n_params) / world_size + 4 * r["num_buckets"]
            assert abs(mem["optimizer_state"] - expected_state) <= slack
            expected_grads = single_grads / world_size if stage == 2 else single_grads
            assert abs(mem["gradients"] - expected_grads) <= slack
            assert abs(mem["parameters"] - single_grads) <= slack


def test_clip_grad_norm_matches_torch(dist_pool: Any) -> None:
    clip = 0.05  # well below the tiny model's gradient norm (~1-2), so every step clips
    ref_losses, ref_params = _reference(2, 4, clip=clip)
    for stage in (1, 2):
        results = dist_pool(2).run(_zero_train, stage, 4, clip=clip)
        assert all(n > clip for n in results[0]["norms"])
        assert results[0]["norms"] == results[1]["norms"]
        assert max(abs(a - b) / b for a, b in zip(results[0]["losses"], ref_losses, strict=True)) <= 1e-6
        assert _max_rel(results[0]["params"], ref_params) <= 1e-6
    # The returned norm is torch's total norm of the full averaged gradient at the first step.
    model = _model()
    sum(_loss(model, part) for part in _batches(1)[0].chunk(2)).div(2).backward()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()
    assert abs(results[0]["norms"][0] - expected) <= 1e-6 * expected


def test_bf16_params_with_fp32_master(dist_pool: Any) -> None:
    """bf16 parameters and gradients, fp32 masters and fp32 reduction, against fp32 training. The forward/backward
    runs in bf16 (8 mantissa bits: ~4e-3 relative rounding per op), so losses agree to ~1e-2; Adam moves elements
    with small, noisy gradients by ~lr per step whatever their size, so bf16 gradient noise changes such elements
    by up to ~lr * steps = 3e-2, i.e. a few percent of weights of size ~0.02."""
    results = dist_pool(2).run(_zero_train, 2, 10, dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ref_losses, ref_params = _reference(2, 10)
    info = results[0]["info"]
    assert info["param_dtypes"] == ["torch.bfloat16"] and info["master_dtype"] == "torch.float32"
    assert info["master_separate"] and not info["master_aliased"]
    assert max(abs(a - b) / b for a, b in zip(results[0]["losses"], ref_losses, strict=True)) <= 2e-2
    assert _max_rel(results[0]["params"], ref_params) <= 1e-1
    assert ref_losses[-1] < ref_losses[0] and results[0]["losses"][-1] < results[0]["losses"][0]
    mem = results[0]["memory"]
    # fp32 master shard; the stage-2 gradient shard is kept in the master dtype (fp32) too, see docs/zero.md
    assert mem["master_weights"] > 0 and mem["master_weights"] == mem["gradients"]


# ------------------------------------------------------------------ gradient accumulation
class _CountCollectives:
    """Counts calls of the collectives ZeRO may use, by patching ``torch.distributed`` in the worker."""

    NAMES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_into_tensor",
             "all_gather_single", "broadcast")

    def __init__(self) -> None:
        self.count = 0
        self.saved = {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}

    def __enter__(self) -> _CountCollectives:
        for name, fn in self.saved.items():
            setattr(dist, name, self._wrap(fn))
        return self

    def _wrap(self, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return fn(*args, **kwargs)

        return counted

    def __exit__(self, *exc: object) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def _sgd(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=0.05, momentum=0.9)


def _accumulation_worker(stage: int) -> dict[str, Any]:
    """Two micro-batches (no_sync on the first) vs the concatenated batch. SGD with momentum: its update is linear in
    the gradient, so the fp32 reordering of the micro-batch sum stays ~1e-7 instead of being amplified by Adam's
    normalisation of near-zero gradients (which moves some elements by ~1e-5 for the same reordering)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    counts: list[int] = []
    params = []
    for accumulate in (True, False):
        model = _model()
        opt = ZeroOptimizer(model, _sgd, stage=stage, bucket_size_mb=BUCKET_MB, param_groups=_groups(model))
        for tokens in _batches(3):
            local = tokens.chunk(ws)[rank]  # (2, T + 1) on 2 ranks
            if accumulate:
                with _CountCollectives() as c, opt.no_sync():
                    (_loss(model, local[:1]) / 2).backward()
                counts.append(c.count)
                with _CountCollectives() as c:
                    (_loss(model, local[1:]) / 2).backward()
                counts.append(c.count)
            else:
                _loss(model, local).backward()
            opt.step()
            opt.zero_grad()
        opt.remove_hooks()
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"counts": counts, "rel": _max_rel(params[0], params[1]), "num_buckets": len(opt.buckets)}


@pytest.mark.parametrize("stage", [1, 2])
def test_gradient_accumulation_no_sync(dist_pool: Any, stage: int) -> None:
    for r in dist_pool(2).run(_accumulation_worker, stage):
        # first micro-batch: no communication; last: one reduction per bucket, launched from the backward hooks
        assert r["counts"] == [0, r["num_buckets"]] * 3
        assert r["rel"] <= 1e-6


# ------------------------------------------------------------------ reshardable checkpoints
def _checkpoint_worker(stage: int, steps: int, load: Any = None, load_params: Any = None) -> dict[str, Any]:
    """Train ``steps`` steps (after loading ``load``/``load_params`` if given) and return state + params."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = _model()
    if load_params is not None:
        model.load_state_dict(load_params)
    opt = ZeroOptimizer(model, _factory, stage=stage, bucket_size_mb=BUCKET_MB, param_groups=_groups(model))
    if load is not None:
        opt.load_state_dict(load)
    losses = []
    start = 3 if load is not None else 0
    for tokens in _batches(start + steps)[start:]:
        loss = _loss(model, tokens.chunk(ws)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_mean_over_ranks(loss))
    sharded, full = opt.state_dict(), opt.full_state_dict()
    opt.remove_hooks()
    return {"sharded": sharded, "full": full, "losses": losses,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _single_continue(stage: int, state: Any, params: dict[str, Tensor], world_size: int) -> tuple[list[float], Any]:
    """One process (no process group): a ZeroOptimizer over the whole model, equal-weight loss over halves."""
    model = _model()
    model.load_state_dict(params)
    opt = ZeroOptimizer(model, _factory, stage=stage, bucket_size_mb=BUCKET_MB, param_groups=_groups(model))
    opt.load_state_dict(state)
    losses = []
    for tokens in _batches(6)[3:]:
        loss = torch.stack([_loss(model, p) for p in tokens.chunk(world_size)]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    opt.remove_hooks()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [1, 2])
def test_reshard_two_ranks_to_one_and_back(dist_pool: Any, stage: int) -> None:
    first = dist_pool(2).run(_checkpoint_worker, stage, 3)
    cont = dist_pool(2).run(_checkpoint_worker, stage, 3, [r["sharded"] for r in first], first[0]["params"])
    # 2 ranks -> 1 process, from the list of both ranks' sharded dicts and from rank 0's gathered full dict
    for state in ([r["sharded"] for r in first], first[0]["full"]):
        losses, params = _single_continue(stage, state, first[0]["params"], 2)
        assert max(abs(a - b) / b for a, b in zip(losses, cont[0]["losses"], strict=True)) <= 1e-6
        assert _max_rel(params, cont[0]["params"]) <= 1e-6
    assert first[1]["full"] == {}
    # 2 ranks -> plain torch.optim.AdamW over the unsharded model
    model = _model()
    model.load_state_dict(master_weights(first[0]["full"]))
    opt = _factory(_groups(model))
    opt.load_state_dict(to_torch_optimizer_state([r["sharded"] for r in first], model, opt))
    assert opt.param_groups[1]["lr"] == 2 * LR
    for tokens in _batches(6)[3:]:
        torch.stack([_loss(model, p) for p in tokens.chunk(2)]).mean().backward()
        opt.step()
        opt.zero_grad()
    assert _max_rel({n: p.detach() for n, p in model.named_parameters()}, cont[0]["params"]) <= 1e-6
    # 1 process -> 2 ranks: continue the single-process run's checkpoint on 2 ranks
    single = _single_continue(stage, first[0]["full"], first[0]["params"], 2)
    model = _model()
    model.load_state_dict(first[0]["params"])
    solo = ZeroOptimizer(model, _factory, stage=stage, bucket_size_mb=BUCKET_MB, param_groups=_groups(model))
    solo.load_state_dict(first[0]["full"])
    again = dist_pool(2).run(_checkpoint_worker, stage, 3, solo.state_dict(), first[0]["params"])
    assert max(abs(a - b) / b for a, b in zip(again[0]["losses"], single[0], strict=True)) <= 1e-6
    assert _max_rel(again[0]["params"], single[1]) <= 1e-6


# ------------------------------------------------------------------ errors before any collective
def test_bad_arguments_are_named() -> None:
    model = _model()
    with pytest.raises(ValueError, match=r"stage \(3\) must be 1 or 2"):
        ZeroOptimizer(model, _factory, stage=3)
    with pytest.raises(ValueError, match=r"bucket_size_mb \(0\) must be > 0"):
        ZeroOptimizer(model, _factory, bucket_size_mb=0)
    with pytest.raises(ValueError, match="LBFGS needs whole parameter tensors"):
        ZeroOptimizer(model, torch.optim.LBFGS(model.parameters()))
    if hasattr(torch.optim, "Adafactor"):
        with pytest.raises(ValueError, match="Adafactor needs whole parameter tensors"):
            ZeroOptimizer(model, torch.optim.Adafactor(model.parameters()))
    model.norm.to("meta")  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"several devices \(\['cpu', 'meta'\]\)"):
        ZeroOptimizer(model, _factory)


def test_synced_backward_twice_without_step_is_refused() -> None:
    model = _model()
    ZeroOptimizer(model, _factory, stage=2, bucket_size_mb=BUCKET_MB)  # hooks keep it alive
    tokens = _batches(1)[0]
    _loss(model, tokens).backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        _loss(model, tokens).backward()


