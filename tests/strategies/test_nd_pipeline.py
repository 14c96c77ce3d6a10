"""NDParallelStrategy(pipeline_parallel=P) on CPU/gloo: parity with one process through Lightning's own loop for
every schedule, PP=4, PP x DP, PP x ZeRO-2/3, PP x TP, clipping across stages, validation, checkpoints across
pipeline layouts, and early errors.

As in test_nd_parallel.py: ``CausalLMModule("tiny")`` (here with 4 or 8 blocks, so every stage holds one) trains 5
AdamW steps in fp32 on the same global batches (4 rows of 16 tokens) from the same initial weights as Lightning's
default single-process strategy; per-step losses and all parameters (the union over the stages, under the full
model's names) must agree to 1e-6 relative. The user's ``training_step`` is CausalLMModule's, unchanged.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed.pipelining as pipelining

from lightning_llmopt import CausalLMModule
from lightning_llmopt.strategies import NDParallelStrategy

_spec = importlib.util.spec_from_file_location("_nd_jobs", Path(__file__).with_name("_nd_jobs.py"))
assert _spec is not None and _spec.loader is not None
J = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("_nd_jobs", J)
_spec.loader.exec_module(J)

TOL = 1e-6
HAS_DUALPIPEV = hasattr(pipelining, "ScheduleDualPipeV")


def _layers(n: int) -> dict[str, Any]:
    return {"model_overrides": {"n_layers": n}}


@pytest.fixture(scope="module")
def init_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    root = tmp_path_factory.mktemp("pp")
    paths = {}
    for n in (2, 4, 8):
        L.seed_everything(0, verbose=False)
        module = CausalLMModule("tiny", **_layers(n))
        module.configure_model()
        paths[n] = str(root / f"llmopt{n}.pt")
        torch.save({k: v.clone() for k, v in module.state_dict().items()}, paths[n])
    return paths


_REFS: dict[tuple[int, float | None], dict[str, Any]] = {}


def _reference(init_paths: dict[int, str], n_layers: int, clip: float | None = None) -> dict[str, Any]:
    key = (n_layers, clip)
    if key not in _REFS:
        _REFS[key] = J.summary(*J.fit(None, clip=clip, init_path=init_paths[n_layers], module_kwargs=_layers(n_layers)))
        _REFS[key]["init"] = init_paths[n_layers]
    return _REFS[key]


def _flat(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([params[k].reshape(-1).double() for k in sorted(params)])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _assert_parity(result: dict[str, Any], ref: dict[str, Any], what: Any) -> dict[str, float]:
    losses, ref_losses = torch.tensor(result["losses"]), torch.tensor(ref["losses"])
    assert len(losses) == len(ref_losses) == J.STEPS
    loss_err = float(((losses - ref_losses).abs() / ref_losses.abs()).max())
    assert sorted(result["params"]) == sorted(ref["params"]), what  # every parameter, on some stage, full names
    param_err = _rel(_flat(result["params"]), _flat(ref["params"]))
    assert loss_err <= TOL and param_err <= TOL, (what, loss_err, param_err)
    init = torch.load(ref["init"], weights_only=True)
    assert _rel(_flat(ref["params"]), _flat({k: init[k] for k in ref["params"]})) > 1e-3  # the weights moved
    return {"loss": loss_err, "params": param_err}


def _config(nd: dict[str, Any], n_layers: int = 4, clip: float | None = None) -> dict[str, Any]:
    return {"nd": nd, "module_kwargs": _layers(n_layers), "clip": clip}


def _run(pool: Any, init_paths: dict[int, str], configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Parity of every config (asserted); returns rank 0's result of each, in ``configs`` order."""
    results = []
    for n in sorted({c["module_kwargs"]["model_overrides"]["n_layers"] for c in configs}):
        group = [c for c in configs if c["module_kwargs"]["model_overrides"]["n_layers"] == n]
        out = pool.run(J.parity_job, {"llmopt": init_paths[n]}, group)[0]
        results += list(zip(group, out, strict=True))
    errors = []
    for config, result in results:
        n = config["module_kwargs"]["model_overrides"]["n_layers"]
        errors.append(_assert_parity(result, _reference(init_paths, n, config["clip"]), config["nd"]))
        print(f"parity {config['nd']} clip={config['clip']} n_layers={n}: {errors[-1]}")  # shown with -s
    return [next(r for c, r in results if c is config) for config in configs]


# ------------------------------------------------------------------ acceptance: parity with one process
PP2 = [
    {"schedule": "gpipe", "microbatches": 4, "zero_stage": 0},
    {"schedule": "1f1b", "microbatches": 2, "zero_stage": 0},
    {"schedule": "interleaved_1f1b", "microbatches": 2, "zero_stage": 0},  # V=2: 4 stages of 1 block
    {"schedule": "zero_bubble", "microbatches": 4, "zero_stage": 0},
    {"schedule": "zbv", "microbatches": 4, "zero_stage": 0},
    *([{"schedule": "dualpipev", "microbatches": 4, "zero_stage": 0}] if HAS_DUALPIPEV else []),
]


def test_every_schedule_two_ranks(dist_pool: Any, init_paths: dict[int, str]) -> None:
    configs = [_config({"pipeline_parallel": 2, **nd}) for nd in PP2]
    configs.append(
        _config({"pipeline_parallel": 2, "schedule": "1f1b", "microbatches": 4, "zero_stage": 0}, clip=0.05)
    )  # clipped by the global norm over both stages
    results = _run(dist_pool(2), init_paths, configs)
    for config, result in zip(configs, results, strict=True):  # every stage counts the tokens, not only the last
        assert result["tokens_seen"] == [J.STEPS * J.GLOBAL_BATCH * J.SEQ] * 2, config["nd"]


def test_pipeline_with_zero_two_ranks(dist_pool: Any, init_paths: dict[int, str]) -> None:
    """PP x ZeRO on 2 ranks is a degenerate ZeRO group of one rank per stage; the 4-rank test shards for real."""
    configs = [
        _config({"pipeline_parallel": 2, "schedule": "1f1b", "microbatches": 2, "zero_stage": z}) for z in (2, 3)
    ]
    _run(dist_pool(2), init_paths, configs)


def test_four_ranks(dist_pool: Any, init_paths: dict[int, str]) -> None:
    configs = [
        _config({"pipeline_parallel": 4, "schedule": "1f1b", "microbatches": 4, "zero_stage": 0}),
        _config({"pipeline_parallel": 4, "schedule": "interleaved_1f1b", "microbatches": 4, "zero_stage": 0}, 8),
        _config(
            {"pipeline_parallel": 2, "data_parallel": 2, "schedule": "1f1b", "microbatches": 2, "zero_stage": 0}
        ),  # PP x DP = 2 x 2
        _config(
            {"pipeline_parallel": 2, "data_parallel": 2, "schedule": "1f1b", "microbatches": 2, "zero_stage": 2}
        ),  # PP x ZeRO-2 over 2 data-parallel ranks per stage
        _config(
            {"pipeline_parallel": 2, "data_parallel": 2, "schedule": "gpipe", "microbatches": 2, "zero_stage": 3}
        ),  # PP x ZeRO-3 (FSDP2 over the 2 data-parallel ranks of each stage)
    ]
    _run(dist_pool(4), init_paths, configs)


PP_TP = [
    {"schedule": "1f1b", "microbatches": 2},
    {"schedule": "gpipe", "microbatches": 4},
    {"schedule": "interleaved_1f1b", "microbatches": 2},  # V=2: 4 stages of 1 block
    {"schedule": "zero_bubble", "microbatches": 4},  # backward split into input- and weight-gradient passes
    {"schedule": "zbv", "microbatches": 4},  # V shape: rank 0 holds the first and the last stage
    {"schedule": "1f1b", "microbatches": 2, "sequence_parallel": False, "loss_parallel": False},
]


def test_pipeline_with_tensor_parallel(dist_pool: Any, init_paths: dict[int, str]) -> None:
    """PP x TP = 2 x 2 on 4 ranks: Megatron TP with sequence parallelism and the vocab-parallel loss on the last
    stage (and without both); sequence-sharded activations cross the stages; clipping by the norm over both
    dimensions (with the norm off by 1.5x this config fails at 2.6e-5)."""
    base = {"pipeline_parallel": 2, "tensor_parallel": 2, "zero_stage": 0}
    configs = [_config({**base, **nd}) for nd in PP_TP]
    configs.append(_config({**base, "schedule": "1f1b", "microbatches": 4}, clip=0.05))
    results = _run(dist_pool(4), init_paths, configs)
    total = sum(p.numel() * p.element_size() for p in _reference(init_paths, 4)["params"].values())
    for config, result in zip(configs, results, strict=True):
        # rank 0 (stage 0, tp rank 0) holds the embedding and 2 of 4 blocks, halved by TP: ~1/4 (PP alone: ~1/2)
        assert result["memory"]["parameters"] < 0.3 * total, (config["nd"], result["memory"], total)
        # tokens counted once per data-parallel group, on every stage and tensor-parallel rank
        assert result["tokens_seen"] == [J.STEPS * J.GLOBAL_BATCH * J.SEQ] * 4, config["nd"]


# ------------------------------------------------------------------ validation, checkpoints, errors
def test_validation_matches_one_process(dist_pool: Any, init_paths: dict[int, str]) -> None:
    """``Trainer.validate`` on packed rows (doc_ids reach every stage): the forward-only pass, the logits broadcast
    over the stages, CausalLMModule's metrics and their cross-rank sync; on 4 ranks also with data parallelism."""
    ref = J.validate(None, init_paths[2])
    layouts = [{"pipeline_parallel": 2, "zero_stage": 0}, {"pipeline_parallel": 2, "zero_stage": 3}]
    for layout, metrics in zip(layouts, dist_pool(2).run(J.validate_job, init_paths[2], layouts)[0], strict=True):
        for key in ("val/loss", "val/ppl"):
            assert abs(metrics[key] - ref[key]) <= TOL * ref[key], (layout, key, metrics[key], ref[key])


def test_validate_after_fit_on_the_same_trainer(dist_pool: Any, init_paths: dict[int, str]) -> None:
    """``fit`` then ``validate`` on one Trainer: the second setup reuses the stages the first split and parallelised
    (it used to refuse the already-parallelised model), and the validation loss is the single process's (fit and
    validate in one process; the 2 training steps agree to 1e-6 relative, as in the parity tests, so the losses of
    the weights they leave do too)."""
    ref = J.fit_then_validate(None, init_paths[2])
    layouts = [  # parameters that are DTensors after the first setup: TP shards, FSDP2 shards
        {"pipeline_parallel": 2, "tensor_parallel": 2, "zero_stage": 0},
        {"pipeline_parallel": 2, "data_parallel": 2, "zero_stage": 3},
        {"pipeline_parallel": 2, "data_parallel": 2, "schedule": "1f1b", "microbatches": 2, "zero_stage": 0},
    ]
    plain = [{"pipeline_parallel": 2, "schedule": "1f1b", "microbatches": 2, "zero_stage": 0}]  # plain tensors
    results = dist_pool(4).run(J.fit_then_validate_job, init_paths[2], layouts)[0]
    results += dist_pool(2).run(J.fit_then_validate_job, init_paths[2], plain)[0]
    for layout, metrics in zip(layouts + plain, results, strict=True):
        for key in ("val/loss", "val/ppl"):
            assert abs(metrics[key] - ref[key]) <= TOL * ref[key], (layout, key, metrics[key], ref[key])


def test_validate_after_fit_matches_one_process_on_the_same_weights(
    dist_pool: Any, init_paths: dict[int, str], tmp_path: Path
) -> None:
    """PP=2 (1f1b), 4 blocks: ``validate`` after ``fit`` equals a single process's ``validate`` of the final weights
    exactly (the same blocks in the same order on the same rows; the metric sync over the two stages sums identical
    states, which is exact). The single-process reference must build the 4-block model: the default 2-block module
    used to take only the weights it had names for (a different model, 5.7009 against 5.6678), and now refuses."""
    final = str(tmp_path / "final.pt")
    nd = {"pipeline_parallel": 2, "schedule": "1f1b", "microbatches": 2, "zero_stage": 0}
    losses = dist_pool(2).run(J.fit_validate_and_save, nd, init_paths[4], final, _layers(4))
    ref = J.validate(None, final, module_kwargs=_layers(4))
    assert losses[0] == losses[1] == ref["val/loss"], (losses, ref)
    with pytest.raises(ValueError, match="entries the module lacks"):
        J.validate(None, final)


def test_validation_with_tensor_parallel(dist_pool: Any, init_paths: dict[int, str]) -> None:
    """PP x TP = 2 x 2: the last stage's vocabulary-sharded logits are broadcast over the stages as local shards
    and rebuilt on every rank's own tensor-parallel mesh, so the vocab-parallel loss runs on every rank."""
    ref = J.validate(None, init_paths[2])
    layouts = [{"pipeline_parallel": 2, "tensor_parallel": 2, "zero_stage": 0}]
    for layout, metrics in zip(layouts, dist_pool(4).run(J.validate_job, init_paths[2], layouts)[0], strict=True):
        for key in ("val/loss", "val/ppl"):
            assert abs(metrics[key] - ref[key]) <= TOL * ref[key], (layout, key, metrics[key], ref[key])


def _assert_resumed(out: dict[str, Any], split: int) -> None:
    assert out["folders"] == [f"step-{split:08d}"]
    assert _rel(_flat(out["resumed"]["start_params"]), _flat(out["saved"])) == 0.0  # bitwise after the load
    straight, resumed = out["straight"]["losses"][split:], out["resumed"]["losses"]
    assert len(resumed) == len(straight) > 0
    assert max(abs(a - b) / b for a, b in zip(resumed, straight, strict=True)) <= TOL
    assert _rel(_flat(out["resumed"]["params"]), _flat(out["straight"]["params"])) <= TOL


@pytest.mark.parametrize(
    ("save", "load"),
    [
        ({"pipeline_parallel": 2, "zero_stage": 0}, {"data_parallel": 2, "zero_stage": 0}),  # PP=2 -> PP=1
        ({"data_parallel": 2, "zero_stage": 0}, {"pipeline_parallel": 2, "zero_stage": 0}),  # PP=1 -> PP=2
    ],
)
def test_checkpoint_across_pipeline_layouts(
    dist_pool: Any, init_paths: dict[int, str], tmp_path: Path, save: dict[str, Any], load: dict[str, Any]
) -> None:
    """DCP keys are the full model's names on every stage: a checkpoint saved under one pipeline layout resumes
    under the other with the saved weights exactly, and the continued run (AdamW state included) follows the
    straight one."""
    out = dist_pool(2).run(J.reshard_job, init_paths[4], str(tmp_path / "ckpt"), save, load, 3, 6, _layers(4))[0]
    _assert_resumed(out, 3)


@pytest.mark.parametrize(
    "layout",
    [
        {"pipeline_parallel": 2, "schedule": "1f1b", "microbatches": 2, "zero_stage": 0},
        {"pipeline_parallel": 2, "schedule": "zero_bubble", "microbatches": 4},  # V=2, ZeRO-2 by default
    ],
)
def test_checkpoint_resumes_into_the_same_pipeline_layout(
    dist_pool: Any, init_paths: dict[int, str], tmp_path: Path, layout: dict[str, Any]
) -> None:
    """PP=2 -> PP=2: every stage's optimizer state and its param groups' options (lr, betas, ...) come back, so the
    resumed run repeats the uninterrupted one's arithmetic: losses and final parameters agree exactly."""
    out = dist_pool(2).run(J.reshard_job, init_paths[4], str(tmp_path / "ckpt"), layout, layout, 3, 6, _layers(4))[0]
    assert out["folders"] == ["step-00000003"]
    assert _rel(_flat(out["resumed"]["start_params"]), _flat(out["saved"])) == 0.0
    assert out["resumed"]["losses"] == out["straight"]["losses"][3:] and len(out["resumed"]["losses"]) == 3
    assert sorted(out["resumed"]["params"]) == sorted(out["straight"]["params"])
    for name, value in out["straight"]["params"].items():
        assert torch.equal(out["resumed"]["params"][name], value), (layout, name)


def test_checkpoint_from_pipeline_tensor_parallel(dist_pool: Any, init_paths: dict[int, str], tmp_path: Path) -> None:
    """PP x TP = 2 x 2 -> TP x DP = 2 x 2 (no pipeline): the DTensor shards of every stage are saved under the full
    model's names and resharded on load."""
    save = {"pipeline_parallel": 2, "tensor_parallel": 2, "zero_stage": 0}
    load = {"tensor_parallel": 2, "data_parallel": 2, "zero_stage": 0}
    out = dist_pool(4).run(J.reshard_job, init_paths[4], str(tmp_path / "ckpt"), save, load, 3, 6, _layers(4))[0]
    _assert_resumed(out, 3)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"pipeline_parallel": 2, "schedule": "gpipe", "virtual_stages": 2}, ValueError, r"virtual_stages \(2\)"),
        (
            {"pipeline_parallel": 4, "schedule": "1f1b", "microbatches": 2},
            ValueError,
            r"microbatches \(2\) must be >= pipeline_parallel \(4\) for 1F1B",
        ),
        ({"pipeline_parallel": 2, "context_parallel": 2}, NotImplementedError, r"context_parallel \(2\)"),
        ({"pipeline_parallel": 2, "expert_parallel": 2}, NotImplementedError, r"expert_parallel \(2\)"),
    ],
)
def test_bad_pipeline_arguments_are_named(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        NDParallelStrategy(**kwargs)


def _fit_expecting_error(nd: dict[str, Any], n_layers: int) -> str:
    try:
        J.fit(nd, steps=1, module_kwargs=_layers(n_layers))
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_model_and_batch_errors_before_any_collective(dist_pool: Any) -> None:
    """Too few blocks for the stages (in setup) and rows not divisible by the micro-batches (per step) fail on
    every rank alike, naming the values, before the schedule's first send."""
    cases = [
        (
            {"pipeline_parallel": 2, "schedule": "interleaved_1f1b", "zero_stage": 0},
            2,
            r"n_layers \(2\) must be >= pipeline_parallel\*virtual_stages \(2\*2 = 4\)",
        ),
        (
            {"pipeline_parallel": 2, "schedule": "gpipe", "microbatches": 3, "zero_stage": 0},
            2,
            r"batch size \(4 rows per data-parallel rank\) must be divisible by microbatches \(3\)",
        ),
    ]
    pool = dist_pool(2)
    for nd, n_layers, message in cases:
        for text in pool.run(_fit_expecting_error, nd, n_layers):
            assert re.search(message, text), (message, text)
