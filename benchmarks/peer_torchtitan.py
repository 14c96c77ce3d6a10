r"""Peer benchmark: torchtitan's own Llama 3 8B training step (its model, its ``parallelize_llama``), one JSON row.

torchtitan 0.2.2 (2026-02-20) is the release this targets, the newest whose code runs on torch 2.11: 0.3.0 (the
only later one) is built for torch 2.14 and on torch 2.11 stops at ``ImportError: cannot import name
'DataParallelMeshDims' from 'torch.distributed.fsdp'``. The 0.2.2 wheel and the pure-Python wheels that its model,
parallelize and config imports need and the GPU machine lacks (``tyro``, ``docstring_parser``,
``torchdata``) live in the git-ignored ``.whl_titan/``. On the GPU machine (no internet), from the repository root::

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/titan .whl_titan/*.whl
    PYTHONPATH=/tmp/titan:$PWD python3 -m torch.distributed.run --standalone --nproc-per-node=4 \
        benchmarks/peer_torchtitan.py --seq-len 8192 --micro-batch 1 --steps 10 --warmup-steps 3 --json-out row.json

``--layers N`` cuts the model to N layers; ``--compile`` turns on torchtitan's per-block ``torch.compile`` and its
compiled loss (the 8B config has compile off); ``--ac none|full|selective`` overrides the config's selective
op-level checkpointing. With one process torchtitan applies no FSDP and runs the step under bf16 autocast.

What runs is the training step of torchtitan 0.2.2's ``Trainer`` without its data, tokenizer and TOML machinery:
``JobConfig`` set to the values of torchtitan's ``llama3_8b.toml`` (FSDP over all GPUs with
``data_parallel_shard_degree=-1``, selective op activation checkpointing, compile off, bf16 params / fp32
reduce, no float8, AdamW lr 3e-4 eps 1e-8 with torchtitan's defaults weight decay 0.1 and ``implementation=fused``,
grad-norm clipping at 1.0); the model is ``llama3_args["8B"]`` built on the meta device in fp32,
``parallelize_llama`` applied, ``to_empty`` + ``init_weights``; each step: the all-reduced token count, forward,
torchtitan's cross-entropy (sum) / global tokens, backward, ``clip_grad_norm_``, optimizer step, its GC schedule.
Tokens are random (vocab 128256, seed 1234 + rank); the learning rate is a constant 3e-4 (the config's 200-step
warm-up does not change a step's cost). torchtitan's text-dataset module imports ``datasets`` (and through it
pyarrow) at import time although no data is loaded here; when ``datasets`` is not installed a placeholder whose
functions raise stands in for it while torchtitan is imported (``settings.datasets_placeholder`` says so).

Timing (as ``bench_zero.py``): wall time of each step after warm-up, ``torch.cuda.synchronize`` at its end, the
slowest rank per step, median over the timed steps; tokens/s = global batch tokens / median step. Peak
``torch.cuda.max_memory_allocated``/``reserved`` over the whole run, max over ranks. MFU against 989 TFLOP/s per GPU
(H100/H200 SXM dense bf16) with FLOPs per token = ``6*N + 6*n_layers*dim*seq_len``, N the parameters without the
token embedding (the output head counted): the ``12*L*d*s`` attention term halved for causal attention. The row also
carries torchtitan's own count (``6*N + 12*L*d*s``, no causal halving) as ``torchtitan_flops_per_token``.

Rank 0 writes the row to ``--json-out``. On any failure (a missing module, an API mismatch, OOM, a compile error)
the failing rank writes ``{"variant": "torchtitan", "error": "<type>: <message>"}`` to ``<json-out>.err<rank>``
(rank 0: ``<json-out>`` itself; another rank also creates ``<json-out>`` when it does not exist yet) and exits 1.

``--smoke`` checks the code path on CPU: gloo, a tiny model (dim 64, 2 layers, 4 heads, vocab 256, seq 32), no
compile, 2 timed steps after 1 warm-up, the same torchtitan calls. CPU-only adjustments: torchtitan falls back to
the device type "cuda" without an accelerator, so smoke tells its mesh builder "cpu"; gloo has no PREMUL_SUM
(torchtitan sets FSDP's gradient divide factor to 1.0), so FSDP reduces with plain sums; AdamW is ``foreach``::

    python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/peer_torchtitan.py --smoke \
        --json-out /tmp/x.json
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package
import launch  # noqa: E402

VARIANT = "torchtitan"
DATASHEET_BF16_TFLOPS = 989.0  # H100/H200 SXM dense bf16, per GPU
FLOPS_FORMULA = "6*N + 6*n_layers*dim*seq_len (N: parameters without the token embedding; causal attention halved)"
# torchtitan v0.2.2 torchtitan/models/llama3/train_configs/llama3_8b.toml, the sections that shape a training step.
TITAN_8B_TOML: dict[str, dict[str, Any]] = {
    "model": {"name": "llama3", "flavor": "8B"},
    "optimizer": {"name": "AdamW", "lr": 3e-4, "eps": 1e-8},
    "training": {"local_batch_size": 1, "seq_len": 8192, "max_norm": 1.0},
    "parallelism": {
        "data_parallel_replicate_degree": 1,
        "data_parallel_shard_degree": -1,
        "tensor_parallel_degree": 1,
        "pipeline_parallel_degree": 1,
        "context_parallel_degree": 1,
    },
    "compile": {"enable": False, "components": ["model", "loss"]},
    "activation_checkpoint": {"mode": "selective", "selective_ac_option": "op"},
}
SMOKE_MODEL = {"dim": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 256, "multiple_of": 32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=None, help="default: the config's 8192 (smoke: 32)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per GPU per step; default: the config's 1")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; smoke 2)")
    p.add_argument("--warmup-steps", type=int, default=None, help="untimed steps first (default 3; smoke 1)")
    p.add_argument("--layers", type=int, default=None, help="cut the model to this many layers (default: all)")
    p.add_argument("--ac", choices=("selective", "full", "none"), default=None, help="default: the config's selective")
    p.add_argument("--compile", action="store_true", help="torchtitan's per-block torch.compile (config: off)")
    p.add_argument("--json-out", type=Path, required=True)
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny model: checks the code path")
    args = p.parse_args(argv)
    args.seq_len = args.seq_len or (32 if args.smoke else TITAN_8B_TOML["training"]["seq_len"])
    args.micro_batch = args.micro_batch or TITAN_8B_TOML["training"]["local_batch_size"]
    args.steps = args.steps if args.steps is not None else (2 if args.smoke else 10)
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (1 if args.smoke else 3)
    for name in ("seq_len", "micro_batch", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be at least 1")
    if args.warmup_steps < 0 or (args.layers is not None and args.layers < 1):
        p.error(f"--warmup-steps ({args.warmup_steps}) must be >= 0 and --layers ({args.layers}) >= 1")
    if args.smoke and args.compile:
        p.error("--smoke runs without compile; drop --compile")
    return args


# --------------------------------------------------------------------------- torchtitan imports


def _datasets_placeholder() -> dict[str, types.ModuleType]:
    """Modules standing in for ``datasets`` (not installed) while torchtitan's text-dataset module is imported."""

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise ImportError("datasets is not installed: peer_torchtitan feeds random tokens and loads no dataset")

    root = types.ModuleType("datasets")
    dist = types.ModuleType("datasets.distributed")
    root.Dataset = type("Dataset", (), {})  # type: ignore[attr-defined]
    root.load_dataset = unavailable  # type: ignore[attr-defined]
    dist.split_dataset_by_node = unavailable  # type: ignore[attr-defined]
    root.distributed = dist  # type: ignore[attr-defined]
    return {"datasets": root, "datasets.distributed": dist}


def import_torchtitan() -> types.SimpleNamespace:
    """torchtitan's model, parallelize, config and training utilities; raises whatever their import raises."""
    placeholder = _datasets_placeholder() if importlib.util.find_spec("datasets") is None else {}
    sys.modules.update(placeholder)
    try:
        import torchtitan
        from torchtitan.components.loss import build_cross_entropy_loss
        from torchtitan.components.optimizer import build_optimizers
        from torchtitan.config import TORCH_DTYPE_MAP, JobConfig
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed import parallel_dims as parallel_dims_module
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.models.llama3 import Transformer, llama3_args, parallelize_llama
        from torchtitan.tools import utils as titan_utils
        from torchtitan.tools.logging import init_logger
    finally:
        for name in placeholder:  # torchtitan keeps its references; nobody else should find the placeholder
            sys.modules.pop(name, None)
    return types.SimpleNamespace(
        torchtitan=torchtitan,
        build_cross_entropy_loss=build_cross_entropy_loss,
        build_optimizers=build_optimizers,
        TORCH_DTYPE_MAP=TORCH_DTYPE_MAP,
        JobConfig=JobConfig,
        ParallelDims=ParallelDims,
        parallel_dims_module=parallel_dims_module,
        dist_utils=dist_utils,
        Transformer=Transformer,
        llama3_args=llama3_args,
        parallelize_llama=parallelize_llama,
        titan_utils=titan_utils,
        init_logger=init_logger,
        datasets_placeholder=bool(placeholder),
    )


# --------------------------------------------------------------------------- setup


def job_config(tt: types.SimpleNamespace, args: argparse.Namespace, dump_folder: str) -> Any:
    """torchtitan's ``JobConfig`` with the 8B TOML's values, then this run's overrides."""
    job = tt.JobConfig()
    for section, values in TITAN_8B_TOML.items():
        for key, value in values.items():
            setattr(getattr(job, section), key, copy.deepcopy(value))
    job.job.dump_folder = dump_folder
    job.training.seq_len = args.seq_len
    job.training.local_batch_size = args.micro_batch
    job.compile.enable = bool(args.compile)
    if args.ac is not None:
        job.activation_checkpoint.mode = args.ac
    if args.smoke:
        job.optimizer.implementation = "foreach"  # fused AdamW is for accelerators
    job.debug.seed = 0
    return job


def model_args(tt: types.SimpleNamespace, args: argparse.Namespace, job: Any) -> Any:
    """``llama3_args["8B"]`` (smoke: the debug model shrunk to ``SMOKE_MODEL``) fitted to the job."""
    margs = copy.deepcopy(tt.llama3_args["debugmodel" if args.smoke else "8B"])
    for key, value in (SMOKE_MODEL if args.smoke else {}).items():
        setattr(margs, key, value)
    if args.layers is not None:
        margs.n_layers = args.layers
    margs.update_from_config(job)
    return margs


def init_distributed(tt: types.SimpleNamespace, args: argparse.Namespace, job: Any) -> tuple[Any, Any]:
    """Process group and torchtitan's ``ParallelDims`` (FSDP over every rank); returns ``(device, parallel_dims)``."""
    import torch
    import torch.distributed as dist

    for key, value in launch.NVLS_OFF.items():  # NVLink multicast stays off on the shared hosts
        os.environ.setdefault(key, value)
    if args.smoke:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        tt.parallel_dims_module.device_type = "cpu"  # torchtitan assumes "cuda" when no accelerator is present
    else:
        if not torch.cuda.is_available():
            raise RuntimeError("peer_torchtitan needs CUDA GPUs (use --smoke for the CPU code path)")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        tt.dist_utils.init_distributed(job.comm, base_folder=job.job.dump_folder)
    par = job.parallelism
    parallel_dims = tt.ParallelDims(
        dp_shard=par.data_parallel_shard_degree,
        dp_replicate=par.data_parallel_replicate_degree,
        cp=par.context_parallel_degree,
        tp=par.tensor_parallel_degree,
        pp=par.pipeline_parallel_degree,
        ep=par.expert_parallel_degree,
        etp=par.expert_tensor_parallel_degree,
        world_size=dist.get_world_size(),
    )
    return device, parallel_dims


def build_model(tt: types.SimpleNamespace, margs: Any, job: Any, parallel_dims: Any, device: Any) -> tuple[Any, int]:
    """Meta-device model in the job's dtype, ``parallelize_llama``, then materialised and initialised on ``device``.

    Returns ``(model, N)``, N the parameter count without the token embedding."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    with torch.device("meta"), tt.titan_utils.set_default_dtype(tt.TORCH_DTYPE_MAP[job.training.dtype]):
        model = tt.Transformer(margs)
    n_params = sum(p.numel() for p in model.parameters())
    n_nonembedding = n_params - model.tok_embeddings.weight.numel()
    model = tt.parallelize_llama(model, parallel_dims, job)
    if device.type == "cpu":  # gloo has no PREMUL_SUM, which torchtitan's divide factor 1.0 asks of FSDP: plain sums
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model, n_nonembedding


# --------------------------------------------------------------------------- measurement


def train(tt: types.SimpleNamespace, args: argparse.Namespace) -> dict[str, Any]:
    """Build, train ``warmup + steps`` steps, and return rank 0's row (every rank returns it)."""
    import torch
    import torch.distributed as dist

    tt.init_logger()
    job = job_config(tt, args, tempfile.mkdtemp(prefix="peer-torchtitan-"))
    device, parallel_dims = init_distributed(tt, args, job)
    rank, world = dist.get_rank(), dist.get_world_size()
    tt.dist_utils.set_determinism(parallel_dims, device, job.debug, distinct_seed_mesh_dims=["pp"])
    margs = model_args(tt, args, job)
    model, n_nonembedding = build_model(tt, margs, job, parallel_dims, device)
    run = types.SimpleNamespace(
        model=model,
        params=list(model.parameters()),
        optimizers=tt.build_optimizers([model], job.optimizer, parallel_dims),
        loss_fn=tt.build_cross_entropy_loss(job),
        amp=tt.dist_utils.maybe_enable_amp(parallel_dims, job.training.mixed_precision_param, device.type),
        gc=tt.titan_utils.GarbageCollection(gc_freq=job.training.gc_freq),
        batch_mesh=parallel_dims.get_optional_mesh("batch"),  # None on one rank: no all-reduce
        max_norm=job.training.max_norm,
        device=device,
    )
    gen = torch.Generator().manual_seed(1234 + rank)
    shape = (args.micro_batch, args.seq_len + 1)
    batches = [torch.randint(margs.vocab_size, shape, generator=gen) for _ in range(args.warmup_steps + args.steps)]
    step_s: list[float] = []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    for step, batch in enumerate(batches, start=1):
        start = time.perf_counter()
        loss = train_step(tt, run, step, batch)
        sync()
        elapsed = time.perf_counter() - start
        if step > args.warmup_steps:
            step_s.append(elapsed)
        if rank == 0:
            print(f"[torchtitan] step {step}: {1e3 * elapsed:.1f} ms", flush=True)
    slowest = torch.tensor(step_s, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the slowest rank sets each step's time
    final_loss = tt.dist_utils.dist_sum(loss, run.batch_mesh)  # sum over ranks of local sum / global tokens
    facts = {"n_nonembedding": n_nonembedding, "world": world, "device": device, "margs": margs, "job": job}
    return make_row(tt, args, facts, slowest.tolist(), float(final_loss), parallel_dims)


def train_step(tt: types.SimpleNamespace, run: types.SimpleNamespace, step: int, batch: Any) -> Any:
    """One step as torchtitan's ``Trainer.train_step`` (one micro-batch, no PP); returns the detached loss.

    ``batch``: (B, T + 1) int64 tokens on the CPU, moved to the device here as the Trainer does."""
    import torch

    run.optimizers.zero_grad()
    local_tokens = torch.tensor(batch[:, 1:].numel(), dtype=torch.int64, device=run.device)
    global_tokens = tt.dist_utils.dist_sum(local_tokens, run.batch_mesh)
    inputs, labels = batch[:, :-1].to(run.device), batch[:, 1:].to(run.device)  # (B, T) each
    with run.amp:
        pred = run.model(inputs)  # (B, T, vocab)
        loss = run.loss_fn(pred, labels) / global_tokens  # torchtitan's loss is a sum over tokens
    del pred  # freed before backward, as the Trainer does
    loss.backward()
    tt.dist_utils.clip_grad_norm_(run.params, run.max_norm, foreach=True, pp_mesh=None, ep_enabled=False)
    run.optimizers.step()
    run.gc.run(step)
    return loss.detach()


def peak_memory_gib(device: Any) -> tuple[float | None, float | None]:
    """``max_memory_allocated``/``reserved`` of this rank's GPU, max over ranks (``None`` on CPU)."""
    import torch
    import torch.distributed as dist

    if device.type != "cuda":
        return None, None
    peaks = torch.tensor(
        [torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    return peaks[0].item() / 2**30, peaks[1].item() / 2**30


def make_row(
    tt: types.SimpleNamespace,
    args: argparse.Namespace,
    facts: dict[str, Any],
    step_s: list[float],
    final_loss: float,
    parallel_dims: Any,
) -> dict[str, Any]:
    import torch

    margs, job, world, device = facts["margs"], facts["job"], facts["world"], facts["device"]
    median_s = statistics.median(step_s)
    tokens_per_s = args.micro_batch * args.seq_len * world / median_s
    flops_per_token = 6 * facts["n_nonembedding"] + 6 * margs.n_layers * margs.dim * args.seq_len
    titan_flops = 6 * facts["n_nonembedding"] + 12 * margs.n_layers * margs.dim * args.seq_len
    allocated, reserved = peak_memory_gib(device)
    ac = job.activation_checkpoint
    return {
        "variant": VARIANT,
        "torchtitan_version": tt.torchtitan.__version__,
        "settings": {
            "config": "torchtitan v0.2.2 llama3_8b.toml" + (" (smoke: tiny model)" if args.smoke else ""),
            "fsdp": {
                "applied": parallel_dims.fsdp_enabled,  # one process: no FSDP, bf16 autocast
                "dp_shard": parallel_dims.dp_shard,
                "reshard_after_forward": job.parallelism.fsdp_reshard_after_forward,
            },
            "ac": ac.mode + (f" ({ac.selective_ac_option})" if ac.mode == "selective" else ""),
            "compile": job.compile.enable,
            "compile_components": job.compile.components if job.compile.enable else [],
            "mixed_precision": {
                "param": job.training.mixed_precision_param,
                "reduce": job.training.mixed_precision_reduce,
            },
            "float8": False,
            "attention": margs.attn_type,
            "optimizer": {
                k: getattr(job.optimizer, k) for k in ("name", "lr", "eps", "weight_decay", "implementation")
            },
            "max_norm": job.training.max_norm,
            "model": {k: getattr(margs, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size")},
            "seq_len": args.seq_len,
            "micro_batch": args.micro_batch,
            "world_size": world,
            "datasets_placeholder": tt.datasets_placeholder,
        },
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "median_step_ms": median_s * 1e3,
        "step_ms": [s * 1e3 for s in step_s],
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_gpu": tokens_per_s / world,
        "flops_formula": FLOPS_FORMULA,
        "flops_per_token": flops_per_token,
        "torchtitan_flops_per_token": titan_flops,
        "mfu": flops_per_token * tokens_per_s / world / (DATASHEET_BF16_TFLOPS * 1e12),
        "peak_allocated_gib": allocated,
        "peak_reserved_gib": reserved,
        "final_loss": final_loss,
        "timed_steps": len(step_s),
        "warmup_steps": args.warmup_steps,
    }


# --------------------------------------------------------------------------- entry point


def _installed_versions() -> dict[str, str | None]:
    """torch's and torchtitan's installed versions (``None`` where missing), for an error row."""
    import importlib.metadata

    found: dict[str, str | None] = {}
    for dist in ("torch", "torchtitan"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = None
    return found


def write_error(json_out: Path, rank: int, err: BaseException) -> None:
    """``{"variant", "error"}`` to ``json_out`` (rank 0) or ``json_out.err<rank>`` (+ ``json_out`` if absent)."""
    message = " ".join(str(err).split())[:2000]
    versions = _installed_versions()
    row = {
        "variant": VARIANT,
        "error": f"{type(err).__name__}: {message}",
        "rank": rank,
        "torchtitan_version": versions["torchtitan"],
        "torch": versions["torch"],
    }
    text = json.dumps(row)
    if rank == 0:
        json_out.write_text(text)
        return
    Path(f"{json_out}.err{rank}").write_text(text)
    try:
        with open(json_out, "x") as f:  # rank 0 may be blocked in a collective (or already ended) and never write
            f.write(text)
    except FileExistsError:
        pass


def main(argv: list[str] | None = None) -> int:
    import traceback

    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        row = train(import_torchtitan(), args)
    except BaseException as err:  # noqa: BLE001 - recorded, then this rank exits so torchrun ends the others
        traceback.print_exc()
        write_error(args.json_out, rank, err)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # no teardown: other ranks may be blocked in a collective
    if rank == 0:
        args.json_out.write_text(json.dumps(row, indent=1))
        print(json.dumps({k: v for k, v in row.items() if k != "step_ms"}), flush=True)
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
