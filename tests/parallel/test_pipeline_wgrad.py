"""Deferred weight gradients (parallel/pipeline_wgrad.py): the function against plain autograd through ``F.linear``
(fp64 reference where rounding differs), installation on our Llama, and the zero-bubble schedules on 2 gloo ranks
with the deferred B/W split against 5 AdamW steps of the unsplit model in one process."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.parallel.pipeline import PipelineConfig
from lightning_llmopt.parallel.pipeline_wgrad import (
    defer_weight_grads,
    deferred_linear,
    install_deferred_linear,
    pending_keys,
    run_deferred,
    uninstall_deferred_linear,
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _leaves(x_shape: tuple[int, ...], out: int, bias: bool, dtype: torch.dtype, seed: int = 0) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*x_shape, generator=g, dtype=dtype)
    w = torch.randn(out, x_shape[-1], generator=g, dtype=dtype) / x_shape[-1] ** 0.5
    b = torch.randn(out, generator=g, dtype=dtype) if bias else None
    r = torch.randn(*x_shape[:-1], out, generator=g, dtype=dtype)  # weights of the scalar loss sum(r * y)
    return [x, w, b, r]


def _grads(x: Any, w: Any, b: Any, r: Any, fn: Any, key: Any = None) -> tuple[Any, ...]:
    """Gradients of ``sum(r * fn(x, w, b))``; with ``key`` the backward defers and the queue is run afterwards."""
    x, w = x.clone().requires_grad_(), nn.Parameter(w.clone())
    b = None if b is None else nn.Parameter(b.clone())
    y = fn(x, w, b)
    if key is None:
        (y * r).sum().backward()
    else:
        with defer_weight_grads(key):
            (y * r).sum().backward()
        assert x.grad is not None and w.grad is None and (b is None or b.grad is None)  # B only so far
        assert key in pending_keys() and run_deferred(key) == 1 and key not in pending_keys()
    return x.grad, w.grad, None if b is None else b.grad


# ------------------------------------------------------------------ the function
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("x_shape", "out"), [((3, 17), 5), ((2, 7, 17), 1), ((1, 1, 113), 64), ((17,), 3)])
def test_deferred_then_run_equals_autograd(dtype: torch.dtype, bias: bool, x_shape: tuple[int, ...], out: int) -> None:
    """Bound: at most 2x plain autograd's error against an fp64 reference, plus 4 ulp of the dtype (both compute the
    same products; the transposed layouts may round differently)."""
    x, w, b, r = _leaves(x_shape, out, bias, dtype)
    ref = _grads(*(t if t is None else t.double() for t in (x, w, b, r)), F.linear)
    plain = _grads(x, w, b, r, F.linear)
    ours = _grads(x, w, b, r, deferred_linear, key=("unit", 0))
    floor = 4 * torch.finfo(dtype).eps
    for name, o, p, e in zip(("x", "weight", "bias"), ours, plain, ref, strict=True):
        if e is None:
            assert o is None and p is None
            continue
        assert o.dtype == dtype and o.shape == e.shape, name
        assert _rel(o, e) <= 2 * _rel(p, e) + floor, (name, _rel(o, e), _rel(p, e))


def test_immediate_without_defer_context_and_no_grad() -> None:
    x, w, b, r = _leaves((4, 9), 6, True, torch.float64)
    plain = _grads(x, w, b, r, F.linear)
    ours = _grads(x, w, b, r, deferred_linear)  # no defer context: gradients at once, through autograd
    for o, p in zip(ours, plain, strict=True):
        assert _rel(o, p) <= 4 * torch.finfo(torch.float64).eps
    with torch.no_grad():
        y = deferred_linear(x, nn.Parameter(w), nn.Parameter(b))
    assert y.grad_fn is None and torch.equal(y, F.linear(x, w, b))
    assert not pending_keys()


def test_accumulates_over_micro_batches_into_existing_grad() -> None:
    """Two micro-batches deferred under two keys and run in reverse order, on top of an existing ``.grad``, match
    autograd accumulating the same (fp64; the order of the three sums differs)."""
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(2, 5, 11, generator=g, dtype=torch.float64) for _ in range(2)]
    w0, b0 = torch.randn(7, 11, generator=g, dtype=torch.float64), torch.randn(7, generator=g, dtype=torch.float64)
    start = torch.randn(7, 11, generator=g, dtype=torch.float64)
    results = []
    for fn, keys in ((F.linear, [None, None]), (deferred_linear, ["mb0", "mb1"])):
        w, b = nn.Parameter(w0.clone()), nn.Parameter(b0.clone())
        w.grad = start.clone()
        for x, key in zip(xs, keys, strict=True):
            with defer_weight_grads(key) if key is not None else torch.enable_grad():
                fn(x, w, b).square().sum().backward()
        assert (b.grad is None) == (fn is deferred_linear)
        if fn is deferred_linear:
            assert run_deferred("mb1") == 1 and run_deferred("mb0") == 1
        results.append((w.grad, b.grad))
    for o, p in zip(*results, strict=True):
        assert _rel(o, p) <= 1e-14


def test_autocast_bf16_like_f_linear() -> None:
    """CPU autocast to bf16: the same output as ``F.linear`` under the same autocast (the same casts and kernel), and
    gradients in the inputs' and parameters' dtypes (fp32) within 2x of F.linear's error against fp64 (+ bf16 ulp)."""
    x, w, b, r = _leaves((2, 9, 48), 24, True, torch.float32, seed=5)
    ref = _grads(*(t.double() for t in (x, w, b, r)), F.linear)

    def run(fn: Any, key: Any) -> tuple[Any, ...]:
        xx, ww, bb = x.clone().requires_grad_(), nn.Parameter(w.clone()), nn.Parameter(b.clone())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(xx, ww, bb)
            loss = (y.float() * r).sum()
        with defer_weight_grads(key) if key is not None else torch.enable_grad():
            loss.backward()
        if key is not None:
            run_deferred(key)
        return y.detach(), xx.grad, ww.grad, bb.grad

    plain, ours = run(F.linear, None), run(deferred_linear, "bf16")
    assert ours[0].dtype == torch.bfloat16 and torch.equal(ours[0], plain[0])
    floor = 4 * torch.finfo(torch.bfloat16).eps
    for o, p, e in zip(ours[1:], plain[1:], ref, strict=True):
        assert o.dtype == torch.float32
        assert _rel(o, e) <= 2 * _rel(p, e) + floor, (_rel(o, e), _rel(p, e))


def test_autocast_weight_copy_follows_updates() -> None:
    """The bf16 weight copy shared by micro-batches in flight is rebuilt after an in-place update or a ``.data``
    swap while an earlier graph still holds the old copy (reference: the casts done by hand; autocast's own cache
    would still hand F.linear the old copy inside the region)."""
    x, w = torch.randn(3, 16, requires_grad=True), nn.Parameter(torch.randn(8, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        alive = deferred_linear(x, w)  # its graph keeps the first copy
        for update in (lambda: w.mul_(2.0), lambda: setattr(w, "data", w.data * -3.0)):
            with torch.no_grad():
                update()
            got = deferred_linear(x, w)
            with torch.autocast("cpu", enabled=False):
                assert torch.equal(got, F.linear(x.bfloat16(), w.detach().bfloat16()))
    assert alive.grad_fn is not None


def test_activation_checkpointing_and_grad_hooks() -> None:
    """Non-reentrant checkpointing recomputes the forward inside B: the queued work still reaches the parameters;
    a post-accumulate hook (as the ZeRO-1/2 engine registers) sees the gradient when W accumulates it (in B autograd
    runs it too, with ``.grad`` still ``None``) (fp64)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(13, 21), nn.GELU(), nn.Linear(21, 4)).double()
    ref = copy.deepcopy(net)
    install_deferred_linear(net)
    seen: list[Any] = []
    net[2].weight.register_post_accumulate_grad_hook(lambda p: seen.append(None if p.grad is None else p.grad + 0))
    x = torch.randn(5, 13, dtype=torch.float64)
    ref(x).pow(2).sum().backward()
    with defer_weight_grads("ckpt"):
        torch.utils.checkpoint.checkpoint(net, x, use_reentrant=False).pow(2).sum().backward()
    assert all(p.grad is None for p in net.parameters()) and all(g is None for g in seen)
    assert run_deferred("ckpt") == 2 and seen[-1] is not None and torch.equal(seen[-1], net[2].weight.grad)
    for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
        assert _rel(p.grad, q.grad) <= 1e-14, name


def test_in_place_change_between_b_and_w_is_an_error() -> None:
    w = nn.Parameter(torch.randn(3, 4))
    h = torch.randn(2, 4, requires_grad=True) * 1.0  # the linear saves this tensor itself (fp32, no autocast)
    with defer_weight_grads("inplace"):
        deferred_linear(h, w).sum().backward()
    with torch.no_grad():
        h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place between the B and W passes"):
        run_deferred("inplace")


def test_install_on_llama_keeps_modules_and_matches_autograd() -> None:
    """Class, state_dict keys, parameter objects unchanged; B leaves the linear weights without gradient but gives
    norms and the embedding theirs; after W all gradients match the untouched model (fp32, 1e-6: summation order)."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_preset("tiny", n_layers=2))
    ref = copy.deepcopy(model)
    keys, params = list(model.state_dict()), [id(p) for p in model.parameters()]
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    names = install_deferred_linear(model)
    assert set(names) == linears and "output" in names
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    assert all(type(m) is nn.Linear for n, m in model.named_modules() if n in linears)
    twin = copy.deepcopy(model)  # deep copies keep a forward bound to their own module
    assert twin.output.forward.module is twin.output  # type: ignore[union-attr]
    tokens = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(1))
    ref(tokens).float().logsumexp(-1).mean().backward()
    with defer_weight_grads("llama"):
        model(tokens).float().logsumexp(-1).mean().backward()
    assert model.output.weight.grad is None and model.norm.weight.grad is not None  # type: ignore[union-attr]
    assert model.tok_embeddings.weight.grad is not None  # type: ignore[union-attr]
    assert run_deferred("llama") == len(linears)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert _rel(p.grad, q.grad) <= 1e-6, name
    uninstall_deferred_linear(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_tied_and_subclassed_linears_stay_on_autograd() -> None:
    class Custom(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    tied = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4), "c": Custom(4, 4), "d": nn.Linear(4, 4)})
    tied["b"].weight = tied["a"].weight
    assert install_deferred_linear(tied) == ["d"]


def test_split_backward_is_validated() -> None:
    with pytest.raises(ValueError, match=r"split_backward \('lazy'\) must be 'deferred' or 'torch'"):
        PipelineConfig(pp=2, schedule="zbv", split_backward="lazy")


# ------------------------------------------------------------------ 2 ranks vs one process
# 3e-4 as in tests/strategies/_nd_jobs.py: at larger rates AdamW's normalised step amplifies the fp32 rounding of
# gradients near Adam's eps (measured 5e-6 after 5 steps at 1e-2 for every schedule and split, 1F1B included).
STEPS, LR = 5, 3e-4


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def _batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        data = torch.randint(0, 320, (4, 17), generator=g)
        out.append({"input_ids": data[:, :-1], "labels": data[:, 1:]})
    return out


def _train_pipelined(state: dict[str, torch.Tensor], schedule: str, split_backward: str, zero: int) -> dict[str, Any]:
    """``zero=2``: the ZeRO-2 engine over a one-rank group per stage, driven as NDParallelStrategy drives it (no_sync
    around the schedule, one reduction in step()); its gradient hooks must see the W pass's accumulation."""
    import contextlib

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_llmopt.parallel.pipeline import PipelineRunner, prune_to_stages, stage_modules, validate_pipeline
    from lightning_llmopt.parallel.pipeline_wgrad import DeferredWeightGradStage
    from lightning_llmopt.parallel.zero import apply_zero

    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("pp", "dp"))
    model = Llama(LlamaConfig.from_preset("tiny", n_layers=4))
    model.load_state_dict(state)
    config = PipelineConfig(pp=2, schedule=schedule, microbatches=4, split_backward=split_backward)
    split = validate_pipeline(model, config)
    prune_to_stages(model, split, dist.get_rank())
    runner = PipelineRunner(
        stage_modules(model, split, dist.get_rank()), split, config, mesh["pp"].get_group(), torch.device("cpu")
    )
    opt: Any = torch.optim.AdamW(model.parameters(), lr=LR)
    if zero:
        opt = apply_zero(model, opt, stage=zero, process_group=mesh["dp"].get_group())
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in _batches():
            opt.zero_grad(set_to_none=True)
            with opt.no_sync() if zero else contextlib.nullcontext():
                loss = runner.train_step(
                    {"input_ids": batch["input_ids"]},
                    lambda out, rows, labels=batch["labels"]: _loss(out, labels[rows]),
                )
            if zero:
                opt._sync_started = True  # as NDParallelStrategy: step() reduces every bucket
            opt.step()
            losses.append(float(loss))
    stages = runner._stages
    return {
        "losses": losses,
        "params": {k: p.detach().clone() for k, p in model.named_parameters()},
        "deferred": [isinstance(s, DeferredWeightGradStage) for s in stages],
        "items": sum(getattr(s, "deferred_items", 0) for s in stages),
        "warnings": [str(w.message) for w in caught if "pipeline_wgrad" in w.filename or "weight" in str(w.message)],
    }


def _one_process(microbatches: int) -> dict[str, Any]:
    """One process; each step's rows in ``microbatches`` micro-batches with gradient accumulation, the loss of each
    divided by their number before its backward (1: the full batch in one pass)."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_preset("tiny", n_layers=4))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for batch in _batches():
        opt.zero_grad(set_to_none=True)
        total = 0.0
        parts = zip(batch["input_ids"].chunk(microbatches), batch["labels"].chunk(microbatches), strict=True)
        for ids, labels in parts:
            loss = _loss(model(ids), labels) / microbatches
            loss.backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total)
    return {"state": state, "losses": losses, "params": {k: p.detach().clone() for k, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def one_process_microbatched() -> dict[str, Any]:
    """The sums a pipeline with M = 4 computes, in one process. The full batch in one pass differs from it by
    summation order alone (one weight of this model: 3.7e-7 relative after 5 steps on one 2-core CI machine, 6.4e-6
    on another and on the GPU image's CPU, for every schedule and for torch's own split alike)."""
    return _one_process(4)


@pytest.mark.parametrize(
    ("schedule", "split_backward", "zero"),
    [
        ("zero_bubble", "deferred", 0),
        ("zbv", "deferred", 0),
        ("dualpipev", "deferred", 0),
        ("zbv", "deferred", 2),
        ("zero_bubble", "torch", 0),
    ],
)
def test_zero_bubble_schedules_match_one_process(
    dist_pool: Any, one_process_microbatched: dict[str, Any], schedule: str, split_backward: str, zero: int
) -> None:
    """5 AdamW steps, fp32, M = 4 on PP = 2 (V = 2): per-step losses and every parameter (the union over the ranks)
    within 1e-6 relative of one process accumulating the same micro-batches (the bound of the other parity tests)."""
    one_process = one_process_microbatched
    import torch.distributed.pipelining as pipelining

    if schedule == "dualpipev" and not hasattr(pipelining, "ScheduleDualPipeV"):
        pytest.skip(f"torch {torch.__version__} has no ScheduleDualPipeV")
    per_rank = dist_pool(2).run(_train_pipelined, one_process["state"], schedule, split_backward, zero)
    params: dict[str, torch.Tensor] = {}
    for r in per_rank:
        assert r["deferred"] == [split_backward == "deferred"] * 2, r["deferred"]
        assert (r["items"] > 0) == (split_backward == "deferred") and not r["warnings"], r
        for got, want in zip(r["losses"], one_process["losses"], strict=True):
            assert abs(got - want) <= 1e-6 * abs(want), (r["losses"], one_process["losses"])
        assert not set(params) & set(r["params"])
        params.update(r["params"])
    assert sorted(params) == sorted(one_process["params"])
    for name, p in params.items():
        assert _rel(p, one_process["params"][name]) <= 1e-6, name


def _dtensor_and_missing_w() -> dict[str, Any]:
    """A tensor-parallel linear stays on autograd; work that a schedule never ran is run by settle_deferred."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from lightning_llmopt.parallel.pipeline_wgrad import DeferredWeightGradStage, settle_deferred

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    tp = parallelize_module(nn.Linear(8, 4), mesh, ColwiseParallel())
    net = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2)).double()
    ref = copy.deepcopy(net)
    stage = DeferredWeightGradStage(net, dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    installed = install_deferred_linear(net)
    x = torch.randn(3, 8, dtype=torch.float64)
    ref(x).sum().backward()
    with defer_weight_grads(stage._key(0)):
        net(x).sum().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ran = settle_deferred([stage])
    errors = [_rel(p.grad, q.grad) for p, q in zip(net.parameters(), ref.parameters(), strict=True)]
    return {
        "tp": install_deferred_linear(tp),
        "installed": installed,
        "ran": ran,
        "errors": errors,
        "warned": [str(w.message) for w in caught],
    }


def test_dtensor_weights_and_missing_w_actions(dist_pool: Any) -> None:
    for r in dist_pool(2).run(_dtensor_and_missing_w):
        assert r["tp"] == [] and r["installed"] == ["0", "1"]
        assert r["ran"] == 2 and any("had no W action" in w for w in r["warned"])
        assert max(r["errors"]) <= 1e-14


FUSED = ["rmsnorm", "rope", "swiglu"]


def _fused_stage_grads(state: dict[str, torch.Tensor], schedule: str) -> dict[str, Any]:
    """One PP=2 step of the tiny model built with our fused RMSNorm / RoPE / SwiGLU kernels (Triton interpreter)."""
    import torch.distributed as dist

    from lightning_llmopt.parallel.pipeline import PipelineRunner, prune_to_stages, stage_modules, validate_pipeline

    model = Llama(LlamaConfig.from_preset("tiny", n_layers=4, fused_kernels=FUSED))
    model.load_state_dict(state)
    config = PipelineConfig(pp=2, schedule=schedule, microbatches=4)
    split = validate_pipeline(model, config)
    prune_to_stages(model, split, dist.get_rank())
    runner = PipelineRunner(
        stage_modules(model, split, dist.get_rank()), split, config, dist.group.WORLD, torch.device("cpu")
    )
    batch = _batches()[0]
    loss = runner.train_step({"input_ids": batch["input_ids"]}, lambda out, rows: _loss(out, batch["labels"][rows]))
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return {"loss": float(loss), "grads": grads}


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_fused_kernels_in_stages_match_one_process(dist_pool: Any, schedule: str) -> None:
    """Stages built with the fused kernels (the benchmark's ``--fused-kernels``; RoPE rotates in place) give one
    process's loss and gradients of the same fused model, with and without the deferred weight-gradient split
    (fp32, 1e-6 relative: micro-batch summation order)."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_preset("tiny", n_layers=4, fused_kernels=FUSED))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    batch = _batches()[0]
    loss = _loss(model(batch["input_ids"]), batch["labels"])
    loss.backward()
    want = float(loss.detach())
    grads: dict[str, torch.Tensor] = {}
    for r in dist_pool(2).run(_fused_stage_grads, state, schedule):
        assert abs(r["loss"] - want) <= 1e-6 * want, (r["loss"], want)
        grads.update(r["grads"])
    assert sorted(grads) == sorted(k for k, p in model.named_parameters())
    for k, p in model.named_parameters():
        assert _rel(grads[k], p.grad) <= 1e-6, k
