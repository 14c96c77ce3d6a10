"""Multi-GPU ZeRO throughput and per-rank peak memory against Lightning's own ``ddp`` and ``fsdp`` (issue 3).

On one host with N GPUs (``torch.cuda.device_count()``, or ``--nproc``), for one preset (default ``1b``),
``bf16-mixed``, random tokens (fixed seed), seq 4096 and micro-batch 4 per GPU, each strategy is trained in its OWN
``torchrun --standalone --nproc-per-node=N`` launch (a fresh process group per variant):

- peers: Lightning ``ddp``; Lightning ``fsdp`` (``FSDPStrategy``, FSDP1, ``auto_wrap_policy={TransformerBlock}``,
  ``FULL_SHARD``); ``fsdp2``: Lightning ``ModelParallelStrategy`` (data parallel only) with ``fully_shard`` of every
  block then the root, built on the meta device (bf16 parameters in compute, as Lightning's FSDP1 ``bf16-mixed``);
- ours: ``ZeroStrategy(stage=1|2|3)`` (``zero1``, ``zero2``, ``zero3``).

On request (``--variants``; not in the default run):

- ``single``: ``CausalLMModule`` on ONE GPU with Lightning's default strategy (``"auto"``, ``devices=1``), launched
  with ``--nproc-per-node=1`` whatever ``--nproc`` says: the per-GPU baseline (``vs 1gpu`` = tokens/s per GPU over
  its tokens/s; estimate: stage 0 on 1 rank);
- ``fsdp-hf-liger``: the peer a user would pick instead of us: a transformers ``LlamaForCausalLM`` from a random
  config equal to the preset's (``config_to_hf``; SDPA attention, no KV cache), Liger-Kernel applied before it is
  built (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy: the loss is ``model(input_ids, labels, shift_labels)``),
  trained with Lightning ``FSDPStrategy`` (FULL_SHARD, ``auto_wrap_policy={LlamaDecoderLayer}``), ``bf16-mixed``,
  AdamW as ours (lr 3e-4, weight decay 0.1 on matrices but the embedding, betas (0.9, 0.95), fused on CUDA, the
  same warm-up and cosine schedule). Without ``liger_kernel`` the variant fails with an error naming the package;
- ``fsdp-hf``: the same peer without Liger (``--no-liger`` runs it in place of ``fsdp-hf-liger``). Rows say which
  (``"liger": true|false``). ``--activation-checkpointing full`` checkpoints every ``LlamaDecoderLayer`` of these
  two (``FSDPStrategy(activation_checkpointing_policy=...)``); our variants run without it (their rows say
  ``"activation_checkpointing": "none"``).

Per variant: median step time over the timed steps (warm-up excluded; wall time between consecutive batch ends,
``torch.cuda.synchronize`` at each, max over ranks), tokens/s over all GPUs, and per-rank peak
``torch.cuda.max_memory_allocated``/``reserved`` (all-gathered; the max over ranks is reported), beside
``estimate_memory`` (DDP as stage 0, ``fsdp``/``fsdp2``/``zero3`` and the transformers peers as stage 3). One record
per world size, ``benchmarks/results/zero-<preset>-<N>gpu-<device>.json``: ``zero1``/``zero2`` against ``ddp``,
``zero3`` against ``fsdp`` (and ``fsdp2``, and the transformers peers when run), with the issue's goals evaluated in
the notes. A variant that fails (OOM, error, timeout) is recorded with its error; the others still run.

    python benchmarks/bench_zero.py                           # all visible GPUs, 1b, seq 4096, micro-batch 4
    python benchmarks/bench_zero.py --nproc 2 --variants ddp zero2 --micro-batch 2
    python benchmarks/bench_zero.py --variants single zero3 fsdp-hf-liger fsdp-hf   # ours vs transformers + Liger
    python benchmarks/bench_zero.py --smoke                   # CPU, gloo, 2 ranks, tiny, seq 64, 3 steps

``--smoke`` runs ``fsdp-hf-liger`` without Liger (its Triton kernels need CUDA; the row says ``"liger": false``) and
under a subclass of ``FSDPStrategy`` (Lightning refuses the class itself on a CPU accelerator).

Internally each variant runs ``python -m torch.distributed.run --standalone --nproc-per-node=N bench_zero.py
--worker --strategy X ...``; the worker can also be started that way by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package
import launch  # noqa: E402
import records  # noqa: E402

from lightning_llmopt.testing.data import RandomTokens  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("ddp", "fsdp", "fsdp2", "zero1", "zero2", "zero3")  # the default run
HF_PEERS = ("fsdp-hf-liger", "fsdp-hf")  # transformers LlamaForCausalLM under Lightning FSDP, with/without Liger
ALL_VARIANTS = ("single", *VARIANTS, *HF_PEERS)  # also the order of the record's rows
OURS = ("zero1", "zero2", "zero3")
STAGE_OF = {"single": 0, "ddp": 0, "fsdp": 3, "fsdp2": 3, "zero1": 1, "zero2": 2, "zero3": 3}
STAGE_OF.update({v: 3 for v in HF_PEERS})
AC_CHOICES = ("none", "full")
DATASHEET_BF16_TFLOPS = 989.0  # H100/H200 SXM dense bf16
# NVLink multicast must stay off on the shared multi-GPU hosts (device KINDS.md); also set for every child process.
GOAL_ZERO12_VS_DDP = 0.95
GOAL_ZERO3_VS_FSDP = 1.0
GOAL_ESTIMATE_TOL = 0.10
_GIB = 2**30


# --------------------------------------------------------------------------- worker (one rank of one variant)


def _fsdp2_module_class() -> type:
    """``CausalLMModule`` whose ``configure_model`` applies FSDP2 ``fully_shard`` (what ``ModelParallelStrategy``
    asks of the user): every block, then the root, on the meta device; then only the local shards are allocated."""
    import torch

    from lightning_llmopt import CausalLMModule
    from lightning_llmopt.models.llama import Llama

    class FSDP2CausalLM(CausalLMModule):
        param_dtype: Any = None

        def configure_model(self) -> None:
            if self.model is not None:
                return
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            with torch.device("meta"):
                model = Llama(self.config)
            assert self.device_mesh is not None, "needs ModelParallelStrategy"
            mesh = self.device_mesh["data_parallel"]
            mp = MixedPrecisionPolicy(param_dtype=self.param_dtype)
            for block in model.layers.values():
                fully_shard(block, mesh=mesh, mp_policy=mp)
            fully_shard(model, mesh=mesh, mp_policy=mp)
            device = self.trainer.strategy.root_device
            model.to_empty(device=device)
            model.init_weights(buffer_device=device)
            self.model = model

    return FSDP2CausalLM


def _hf_module_class() -> type:
    """A LightningModule training a transformers ``LlamaForCausalLM`` as ``CausalLMModule`` trains ours: built in
    ``configure_model`` from a ``config.json`` dict (fp32 on the CPU, as Lightning's FSDP1 builds ours; FSDP moves
    and shards it unit by unit), loss through the model's own forward so that a Liger-patched model takes its fused
    linear cross-entropy, AdamW and schedule as :meth:`CausalLMModule.configure_optimizers`."""
    import math

    import lightning as L
    import torch

    class HFLlamaModule(L.LightningModule):
        """Arguments:
        hf_config: transformers ``LlamaConfig`` keyword arguments (``config_to_hf`` of the preset).
        max_steps: steps of the cosine schedule.
        warmup_steps: linear warm-up steps (as ``CausalLMModule``'s ``warmup_steps``).
        """

        def __init__(self, hf_config: dict[str, Any], max_steps: int, warmup_steps: int = 2) -> None:
            super().__init__()
            self.hf_config, self.max_steps, self.warmup_steps = dict(hf_config), max_steps, warmup_steps
            self.model: Any = None

        def configure_model(self) -> None:
            if self.model is not None:
                return
            import transformers

            config = transformers.LlamaConfig(**self.hf_config, attn_implementation="sdpa")
            config.use_cache = False  # training: no KV cache
            self.model = transformers.LlamaForCausalLM(config)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            labels = batch["labels"].contiguous()  # (B, T), already the next tokens: shift_labels, not shifted again
            return self.model(input_ids=batch["input_ids"], labels=labels, shift_labels=labels).loss

        def lr_lambda(self, step: int) -> float:
            if step < self.warmup_steps:  # CausalLMModule.lr_lambda with min_lr_ratio 0.1
                return (step + 1) / (self.warmup_steps + 1)
            progress = min(1.0, (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        def configure_optimizers(self) -> Any:
            # By name, not by ndim: FSDP1's use_orig_params parameters are flat 1-D shards here.
            decay, no_decay = [], []
            for name, p in self.model.named_parameters():
                (no_decay if "norm" in name or "embed_tokens" in name else decay).append(p)
            groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
            fused = all(p.is_cuda for p in decay + no_decay)
            optimizer = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=fused)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_lambda)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return HFLlamaModule


def _apply_liger() -> str:
    """Patch transformers' Llama classes with Liger-Kernel (before the model is built); returns Liger's version."""
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
    except ImportError as err:
        raise ModuleNotFoundError(
            f"fsdp-hf-liger needs the liger-kernel package (pip install liger-kernel), which failed to import: {err}; "
            "--variants fsdp-hf (or --no-liger) measures the same peer without it"
        ) from err
    from importlib.metadata import version

    apply_liger_kernel_to_llama(
        rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True
    )
    return version("liger-kernel")


def _cpu_fsdp_class() -> type:
    """Lightning's ``FSDPStrategy`` for the CPU smoke run: Lightning refuses the class itself on a CPU accelerator (an
    exact type check), and FSDP1 runs on the CPU only when given ``device_id=cpu`` (Lightning passes ``None``), so
    the model is wrapped here with it; Lightning then sees it wrapped and adds activation checkpointing."""
    import torch
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel

    class CPUSmokeFSDPStrategy(FSDPStrategy):
        def _setup_model(self, model: Any) -> Any:
            model = FullyShardedDataParallel(
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=torch.device("cpu"),
                **self.kwargs,
            )
            return super()._setup_model(model)

    return CPUSmokeFSDPStrategy


def _hf_peer(args: argparse.Namespace, cuda: bool) -> tuple[Any, Any, dict[str, Any]]:
    """``(strategy, module, row fields)`` of ``fsdp-hf-liger``/``fsdp-hf``: Liger applied first (never on CPU,
    where its Triton kernels cannot run), then Lightning ``FSDPStrategy`` over ``LlamaDecoderLayer``."""
    import transformers
    from lightning.pytorch.strategies import FSDPStrategy

    from lightning_llmopt.models import LlamaConfig
    from lightning_llmopt.models.hf_config import config_to_hf

    info: dict[str, Any] = {"liger": False, "transformers_version": transformers.__version__}
    if args.strategy == "fsdp-hf-liger" and cuda:
        info["liger_kernel_version"] = _apply_liger()
        info["liger"] = True
    elif args.strategy == "fsdp-hf-liger":
        info["liger_note"] = "smoke run on CPU: Liger's Triton kernels need CUDA, so the peer ran without Liger"
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    kwargs: dict[str, Any] = {"auto_wrap_policy": {LlamaDecoderLayer}, "sharding_strategy": "FULL_SHARD"}
    if args.activation_checkpointing == "full":
        kwargs["activation_checkpointing_policy"] = {LlamaDecoderLayer}
    strategy_cls = FSDPStrategy if cuda else _cpu_fsdp_class()
    hf_config = config_to_hf(LlamaConfig.from_preset(args.preset, **_overrides(args.preset, args.seq_len)))
    module = _hf_module_class()(hf_config, max_steps=args.warmup_steps + args.steps)
    return strategy_cls(**kwargs), module, info


ZERO_KWARGS: dict[str, Any] = {}  # --zero-kwargs: extra ZeroStrategy arguments for our variants


def _build_strategy(name: str, world: int, cuda: bool, precision: str) -> tuple[Any, Any]:
    """``(strategy, module class)`` for one variant."""
    from lightning_llmopt import CausalLMModule

    if name == "single":
        return "auto", CausalLMModule  # Lightning's default: SingleDeviceStrategy with devices=1
    if name == "ddp":
        return "ddp", CausalLMModule
    if name == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        from lightning_llmopt.models.llama import TransformerBlock

        return FSDPStrategy(auto_wrap_policy={TransformerBlock}, sharding_strategy="FULL_SHARD"), CausalLMModule
    if name == "fsdp2":
        import torch
        from lightning.pytorch.strategies import ModelParallelStrategy

        cls: Any = _fsdp2_module_class()
        cls.param_dtype = torch.bfloat16 if precision == "bf16-mixed" else None
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1), cls
    if name in OURS:
        from lightning_llmopt.strategies import ZeroStrategy

        return ZeroStrategy(stage=STAGE_OF[name], **ZERO_KWARGS), CausalLMModule
    raise SystemExit(f"unknown strategy {name!r}; choose from {ALL_VARIANTS}")


def _single_process_group(cuda: bool) -> None:
    """A process group of one for ``single`` (Lightning's single-device strategy starts none): the timing callback
    gathers its figures over ranks."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if cuda:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo")


def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch

    smoke = args.smoke
    cuda = not smoke
    if cuda and not torch.cuda.is_available():
        raise SystemExit("bench_zero needs CUDA GPUs (use --smoke for a CPU check of the code path)")
    world = int(os.environ["WORLD_SIZE"])
    if args.activation_checkpointing != "none" and args.strategy not in HF_PEERS:
        raise ValueError(
            f"--activation-checkpointing {args.activation_checkpointing} applies to {', '.join(HF_PEERS)} only, "
            f"not to {args.strategy!r}"
        )
    if args.strategy == "single" and world != 1:
        raise ValueError(f"single runs on one process, got WORLD_SIZE={world}: launch it with --nproc-per-node=1")
    torch.set_float32_matmul_precision("high")
    L.seed_everything(0, verbose=False)
    for pattern in (
        ".*does not have many workers.*",
        ".*GPU available but not used.*",
        ".*predict_dataloader.*",
        ".*sync_dist=True.*",
        ".*FSDP.*",
        ".*barebones.*",
    ):
        warnings.filterwarnings("ignore", message=pattern)

    if args.strategy == "single":
        _single_process_group(cuda)
    total_steps = args.warmup_steps + args.steps
    info: dict[str, Any] = {}
    if args.strategy in HF_PEERS:
        strategy, module, info = _hf_peer(args, cuda)
        vocab_size = module.hf_config["vocab_size"]
    else:
        strategy, module_cls = _build_strategy(args.strategy, world, cuda, args.precision)
        module = module_cls(
            args.preset, model_overrides=_overrides(args.preset, args.seq_len), warmup_steps=2, max_steps=total_steps
        )
        vocab_size = module.config.vocab_size
    batch = args.micro_batch
    dataset = RandomTokens(vocab_size, args.seq_len, total_steps * batch * world, seed=1234)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=batch, shuffle=False, num_workers=2 if cuda else 0, pin_memory=cuda, persistent_workers=cuda
    )
    measure = launch.measure_callback(args.warmup_steps, cuda)
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=world,
        num_nodes=1,
        strategy=strategy,
        precision=args.precision,
        max_steps=total_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[measure] + ([launch.profile_callback(args.warmup_steps, 2, cuda)] if args.profile else []),
    )
    trainer.fit(module, train_dataloaders=loader)
    s = measure.summary
    if not s.get("step_s"):
        raise RuntimeError("no timed steps (increase --steps)")
    step_s = statistics.median(s["step_s"])
    tokens_per_s = world * batch * args.seq_len / step_s
    row: dict[str, Any] = {
        "variant": args.strategy,
        "median_step_ms": step_s * 1e3,
        "median_compute_ms": statistics.median(s["compute_s"]) * 1e3 if s["compute_s"] else None,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_gpu": tokens_per_s / world,
        "timed_steps": len(s["step_s"]),
        "final_loss": s["losses"][-1] if s["losses"] else None,
        "world_size": world,
        "activation_checkpointing": args.activation_checkpointing,
        **info,
    }
    if cuda:
        row["peak_allocated_gib"] = max(s["allocated"]) / _GIB
        row["peak_reserved_gib"] = max(s["reserved"]) / _GIB
        row["peak_allocated_gib_per_rank"] = [round(v / _GIB, 3) for v in s["allocated"]]
    return row


LAYERS: list[int] = []  # --layers: the preset's layer count cut (or raised) to this, for every variant


def _overrides(preset: str, seq_len: int) -> dict[str, Any]:
    from lightning_llmopt.models import LlamaConfig

    out: dict[str, Any] = {"max_seq_len": seq_len} if LlamaConfig.from_preset(preset).max_seq_len < seq_len else {}
    if LAYERS:
        out["n_layers"] = LAYERS[0]
    return out


# --------------------------------------------------------------------------- driver (one launch per variant)


def run_variant(args: argparse.Namespace, variant: str, nproc: int, log_dir: Path) -> dict[str, Any]:
    """Launch one variant with torchrun; return its row (or ``{"variant", "error"}``)."""

    def worker_args(out: Path) -> list[str]:
        return (
            [
                "--worker",
                "--strategy",
                variant,
                "--preset",
                args.preset,
                *(["--layers", str(args.layers)] if args.layers else []),
                "--seq-len",
                str(args.seq_len),
                "--micro-batch",
                str(args.micro_batch),
                "--precision",
                args.precision,
                "--warmup-steps",
                str(args.warmup_steps),
                "--steps",
                str(args.steps),
                "--json-out",
                str(out),
                "--zero-kwargs",
                args.zero_kwargs,
                "--activation-checkpointing",
                args.activation_checkpointing if variant in HF_PEERS else "none",
            ]
            + (["--smoke"] if args.smoke else [])
            + (["--profile"] if args.profile else [])
        )

    return launch.launch(__file__, worker_args, variant, nproc, log_dir / f"zero-{variant}-{nproc}.log", args.timeout)


def _estimate_key(args: argparse.Namespace, variant: str, nproc: int) -> tuple[int, int, str]:
    """``(stage, world size, activation checkpointing)`` that ``estimate_memory`` models ``variant`` with."""
    ac = args.activation_checkpointing if variant in HF_PEERS else "none"
    return STAGE_OF[variant], 1 if variant == "single" else nproc, ac


def _estimates(args: argparse.Namespace, keys: list[tuple[int, int, str]]) -> dict[tuple[int, int, str], Any]:
    from lightning_llmopt.models import LlamaConfig
    from lightning_llmopt.parallel.memory import estimate_memory

    config = LlamaConfig.from_preset(args.preset, **_overrides(args.preset, args.seq_len))
    out: dict[tuple[int, int, str], Any] = {}
    for stage, world, ac in dict.fromkeys(keys):
        try:
            out[stage, world, ac] = estimate_memory(
                config,
                stage=stage,
                world_size=world,
                precision=args.precision,
                micro_batch=args.micro_batch,
                seq_len=args.seq_len,
                activation_checkpointing=ac,
            )
        except ValueError as err:  # e.g. a precision the estimate does not model: measure anyway
            print(f"estimate_memory(stage={stage}, world_size={world}, activation_checkpointing={ac}) failed: {err}")
    return out


def _model_facts(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from lightning_llmopt.models import LlamaConfig
    from lightning_llmopt.models.llama import Llama

    config = LlamaConfig.from_preset(args.preset, **_overrides(args.preset, args.seq_len))
    with torch.device("meta"):
        model = Llama(config)
    return {
        "params": model.num_params(),
        "flops_per_token": float(model.flops_per_token(args.seq_len)),
        "model": {k: getattr(config, k) for k in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads")},
        "attn_backend": getattr(config, "attn_backend", None),
    }


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None, metric: str) -> float | None:
    if not a or not b or not isinstance(a.get(metric), (int, float)) or not isinstance(b.get(metric), (int, float)):
        return None
    return a[metric] / b[metric] if b[metric] else None


def _merge_previous(rows: dict[str, dict[str, Any]], path: Path) -> list[str]:
    """Add the rows of ``path``'s record for variants not run now; return notes saying which and from when."""
    if not path.exists():
        return [f"--merge: no earlier record at {path.name}"]
    old = json.loads(path.read_text())
    kept = []
    for row in [*old.get("results", []), *old.get("peers", [])]:
        if row.get("variant") in rows or "error" in row:
            continue
        row = dict(row)
        row.setdefault("run_date", old.get("date"))
        rows[row["variant"]] = row
        kept.append(f"{row['variant']} ({row['run_date']})")
    if not kept:
        return []
    return [f"merged from the earlier record (not rerun): {', '.join(kept)}; ratios only pair rows of one run"]


def _goal_notes(rows: dict[str, dict[str, Any]], cuda: bool) -> list[str]:
    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    def verdict(ok: bool | None) -> str:
        return "not measured" if ok is None else ("MET" if ok else "NOT MET")

    notes = []
    ddp = rows.get("ddp")
    for v in ("zero1", "zero2"):
        same = ddp is not None and v in rows and rows[v].get("run_date") == ddp.get("run_date")
        r = _ratio(rows.get(v), ddp, "tokens_per_s") if same else None
        notes.append(
            f"goal: {v} tokens/s >= {GOAL_ZERO12_VS_DDP}x ddp: {fmt(r)}x -> "
            f"{verdict(None if r is None else r >= GOAL_ZERO12_VS_DDP)}"
        )
    for peer in ("fsdp", "fsdp2"):
        if peer in rows and "zero3" in rows and rows[peer].get("run_date") != rows["zero3"].get("run_date"):
            continue  # measured in different runs: no same-run ratio
        r = _ratio(rows.get("zero3"), rows.get(peer), "tokens_per_s")
        m = _ratio(rows.get("zero3"), rows.get(peer), "peak_allocated_gib") if cuda else None
        ok = None if r is None or (cuda and m is None) else (r >= GOAL_ZERO3_VS_FSDP and (m is None or m <= 1.0))
        notes.append(
            f"goal: zero3 tokens/s >= {GOAL_ZERO3_VS_FSDP}x {peer} at <= its peak allocated memory: "
            f"{fmt(r)}x throughput, {fmt(m)}x memory -> {verdict(ok)}"
        )
    for v in OURS:
        e = rows.get(v, {}).get("peak_vs_estimate")
        notes.append(
            f"goal: {v} measured peak allocated within {GOAL_ESTIMATE_TOL:.0%} of estimate_memory peak: "
            f"{fmt(e)} -> {verdict(None if e is None else abs(e - 1) <= GOAL_ESTIMATE_TOL)}"
        )
    return notes + _peer_notes(rows, cuda, fmt)


def _same_run(rows: dict[str, dict[str, Any]], a: str, b: str) -> bool:
    return a in rows and b in rows and rows[a].get("run_date") == rows[b].get("run_date")


def _peer_notes(rows: dict[str, dict[str, Any]], cuda: bool, fmt: Any) -> list[str]:
    """zero3 against the transformers peers, and every variant's tokens/s per GPU against ``single``."""
    notes = []
    for peer in HF_PEERS:
        if not _same_run(rows, "zero3", peer):
            continue
        r = _ratio(rows["zero3"], rows[peer], "tokens_per_s")
        m = _ratio(rows["zero3"], rows[peer], "peak_allocated_gib") if cuda else None
        liger = {True: "with Liger", False: "without Liger"}.get(rows[peer].get("liger"), "Liger n/a")
        how = f"{liger}, activation checkpointing {rows[peer].get('activation_checkpointing')}"
        notes.append(
            f"peer: zero3 vs {peer} (transformers LlamaForCausalLM, Lightning FSDP1; {how}; zero3 without "
            f"checkpointing): {fmt(r)}x tokens/s, {fmt(m)}x peak allocated memory (zero3 / peer)"
        )
    if "single" in rows:
        scaling = [
            f"{v} {fmt(_ratio(rows[v], rows['single'], 'tokens_per_s_per_gpu'))}x"
            for v in ALL_VARIANTS
            if v != "single" and _same_run(rows, v, "single")
        ]
        if scaling:
            notes.append(f"scaling: tokens/s per GPU over single's (1 GPU, Lightning 'auto'): {', '.join(scaling)}")
    return notes


def _print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'variant':>13} {'step ms':>9} {'tok/s':>11} {'tok/s/gpu':>10} {'vs peer':>8} {'vs 1gpu':>8} "
        f"{'peak alloc':>10} {'reserved':>9} {'estimate':>9} {'meas/est':>8} {'wall s':>7}  error"
    )
    print(head)
    print("-" * len(head))

    def num(value: Any, spec: str, width: int) -> str:
        return f"{value:{width}{spec}}" if isinstance(value, (int, float)) else f"{'-':>{width}}"

    by = {r["variant"]: r for r in rows}
    for r in rows:
        peer = {"zero1": "ddp", "zero2": "ddp", "zero3": "fsdp"}.get(r["variant"])
        vs = _ratio(r, by.get(peer), "tokens_per_s") if peer else None
        vs_single = _ratio(r, by.get("single"), "tokens_per_s_per_gpu") if r["variant"] != "single" else None
        print(
            f"{r['variant']:>13} {num(r.get('median_step_ms'), '.1f', 9)} {num(r.get('tokens_per_s'), ',.0f', 11)} "
            f"{num(r.get('tokens_per_s_per_gpu'), ',.0f', 10)} {num(vs, '.3f', 8)} {num(vs_single, '.3f', 8)} "
            f"{num(r.get('peak_allocated_gib'), '.2f', 10)} {num(r.get('peak_reserved_gib'), '.2f', 9)} "
            f"{num(r.get('estimate_peak_gib'), '.2f', 9)} {num(r.get('peak_vs_estimate'), '.3f', 8)} "
            f"{num(r.get('launch_wall_s'), '.0f', 7)}  {r.get('error', '')[:100]}"
        )
    print(
        "(vs peer: tokens/s ratio, zero1/zero2 vs ddp, zero3 vs fsdp; vs 1gpu: tokens/s per GPU over single's; "
        "memory in GiB, max over ranks)"
    )


def _select_variants(args: argparse.Namespace, nproc: int) -> list[str]:
    """The variants to run, in the order asked (``--no-liger`` swapping ``fsdp-hf`` in); refuses flags that would
    change nothing and a world size below 2 for any variant other than ``single``."""
    variants = list(dict.fromkeys(args.variants or VARIANTS))
    if args.no_liger:
        if "fsdp-hf-liger" not in variants:
            raise SystemExit(
                f"--no-liger replaces fsdp-hf-liger, which is not among the variants ({' '.join(variants)})"
            )
        variants = list(dict.fromkeys("fsdp-hf" if v == "fsdp-hf-liger" else v for v in variants))
    if args.activation_checkpointing != "none" and not set(variants) & set(HF_PEERS):
        raise SystemExit(
            f"--activation-checkpointing {args.activation_checkpointing} applies to {' '.join(HF_PEERS)} only, and "
            f"neither is among the variants ({' '.join(variants)})"
        )
    multi = [v for v in variants if v != "single"]
    if multi and nproc < 2:
        raise SystemExit(
            f"bench_zero needs at least 2 processes for {' '.join(multi)}, got {nproc} (only single runs on one)"
        )
    return variants


def _variant_notes(args: argparse.Namespace, rows: dict[str, dict[str, Any]]) -> list[str]:
    """How ``single`` and the transformers peers were run, when they were."""
    notes = []
    if "single" in rows:
        notes.append(
            "single = CausalLMModule on 1 GPU with Lightning's default strategy ('auto': SingleDeviceStrategy), in "
            "its own `torchrun --nproc-per-node=1` launch; estimate as stage 0 on 1 rank"
        )
    if set(rows) & set(HF_PEERS):
        notes.append(
            "fsdp-hf-liger / fsdp-hf = transformers LlamaForCausalLM from config_to_hf(preset) (random init, sdpa "
            "attention, no KV cache) with / without Liger-Kernel (rope, rms_norm, swiglu, fused linear cross-entropy "
            "via model(input_ids, labels, shift_labels); applied before the model is built), Lightning FSDPStrategy "
            "(FSDP1, FULL_SHARD, auto_wrap_policy={LlamaDecoderLayer}), the same precision, AdamW and schedule as "
            f"ours; activation checkpointing {args.activation_checkpointing} (our variants: none); estimate: our "
            "model's stage-3 estimate"
        )
    notes += sorted({f"{v}: {r['liger_note']}" for v, r in rows.items() if r.get("liger_note")})
    return notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="ZeRO stages vs Lightning ddp/fsdp on one multi-GPU host.")
    parser.add_argument("--nproc", type=int, default=None, help="processes/GPUs (default: all visible; 2 w/ smoke)")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=None,
        choices=ALL_VARIANTS,
        help=f"default: {' '.join(VARIANTS)}; on request: single (1 GPU, launched alone), {' '.join(HF_PEERS)}",
    )
    parser.add_argument("--preset", default=None, help="model preset (default 1b; tiny with --smoke)")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 4096; 64 with --smoke)")
    parser.add_argument("--micro-batch", type=int, default=None, help="rows per GPU per step (default 4; 2 w/ smoke)")
    parser.add_argument("--precision", default=None, help="default bf16-mixed (also with --smoke)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="untimed steps (default 5; 1 with --smoke)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 15; 2 with --smoke)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per variant launch (default 150)")
    parser.add_argument("--results-dir", type=Path, default=None, help="default benchmarks/results (temp w/ smoke)")
    parser.add_argument("--log-dir", type=Path, default=None, help="per-variant logs (default: a temp folder)")
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, 2 ranks, tiny preset: code path only")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="print rank 0's top operators and device idle time over 2 steps after warm-up into each launch's log "
        "(the timed figures then include the profiler's overhead: write them elsewhere with --results-dir)",
    )
    parser.add_argument(
        "--zero-kwargs",
        default="{}",
        help="JSON of extra ZeroStrategy arguments, e.g. '{\"split_edges\": false}' (recorded in the config)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep rows of variants not run now from the existing "
        "record (each row keeps its own date; a ratio is only formed within one run)",
    )
    parser.add_argument(
        "--activation-checkpointing",
        default="none",
        choices=AC_CHOICES,
        help="full: checkpoint every LlamaDecoderLayer of the transformers peers (FSDPStrategy's "
        "activation_checkpointing_policy); our variants run without it (default none)",
    )
    parser.add_argument(
        "--no-liger", action="store_true", help="run fsdp-hf (the transformers peer without Liger) for fsdp-hf-liger"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    ZERO_KWARGS.update(json.loads(args.zero_kwargs))
    if args.layers:
        LAYERS[:] = [args.layers]
    smoke = args.smoke
    args.preset = args.preset or ("tiny" if smoke else "1b")
    args.seq_len = args.seq_len or (64 if smoke else 4096)
    args.micro_batch = args.micro_batch or (2 if smoke else 4)
    args.precision = args.precision or "bf16-mixed"
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (1 if smoke else 5)
    args.steps = args.steps if args.steps is not None else (2 if smoke else 15)
    args.timeout = args.timeout or 150.0
    if args.worker:
        return launch.worker_main(run_worker, args)

    os.environ.update(launch.NVLS_OFF)
    import torch

    cuda = torch.cuda.is_available() and not smoke
    if not smoke and not cuda:
        raise SystemExit("bench_zero needs CUDA GPUs (use --smoke for a CPU check of the code path)")
    nproc = args.nproc or (2 if smoke else torch.cuda.device_count())
    variants = _select_variants(args, nproc)
    results_dir = args.results_dir or (
        Path(tempfile.mkdtemp(prefix="llmopt-bench-")) if smoke else REPO_ROOT / "benchmarks" / "results"
    )
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="llmopt-zero-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    facts = _model_facts(args)
    stage_keys = [(stage, nproc, "none") for stage in (0, 1, 2, 3)]
    estimates = _estimates(args, stage_keys + [_estimate_key(args, v, nproc) for v in variants])
    print(
        f"{args.preset}: {facts['params'] / 1e6:.1f}M params, {nproc} ranks, seq {args.seq_len}, micro-batch "
        f"{args.micro_batch}/rank, {args.precision}, {args.warmup_steps} warm-up + {args.steps} timed steps",
        flush=True,
    )

    rows: dict[str, dict[str, Any]] = {}
    run_date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    skipped: list[str] = []
    for variant in variants:
        if smoke and variant == "fsdp":
            # Lightning's FSDPStrategy refuses accelerator="cpu" ("requires a GPU accelerator"); fsdp2 runs instead.
            skipped.append("fsdp skipped in --smoke: Lightning's FSDPStrategy requires a GPU accelerator")
            print(f"[fsdp] {skipped[-1]}", flush=True)
            continue
        row = run_variant(args, variant, 1 if variant == "single" else nproc, log_dir)
        key = _estimate_key(args, variant, nproc)
        row.setdefault("activation_checkpointing", key[2])  # what was asked, also on a failed row
        est = estimates.get(key)
        row["estimate_stage"] = STAGE_OF[variant]
        row["estimate_peak_gib"] = est.peak / _GIB if est is not None else None
        if isinstance(row.get("peak_allocated_gib"), (int, float)) and est is not None:
            row["peak_vs_estimate"] = row["peak_allocated_gib"] / row["estimate_peak_gib"]
            row["reserved_vs_estimate"] = row["peak_reserved_gib"] / row["estimate_peak_gib"]
        if isinstance(row.get("tokens_per_s_per_gpu"), (int, float)):
            row["model_tflops_per_gpu"] = facts["flops_per_token"] * row["tokens_per_s_per_gpu"] / 1e12
            if cuda:
                row["mfu_vs_datasheet"] = row["model_tflops_per_gpu"] / DATASHEET_BF16_TFLOPS
        row["run_date"] = run_date
        if ZERO_KWARGS and variant in OURS:
            row["zero_kwargs"] = dict(ZERO_KWARGS)
        rows[variant] = row

    name = f"zero-{args.preset}{f'-{args.layers}l' if args.layers else ''}-{nproc}{'gpu' if cuda else 'cpu'}"
    previous = records.record_path({"name": name, "env": records.environment()}, results_dir)
    merged = _merge_previous(rows, previous) if args.merge else []
    variants = [v for v in ALL_VARIANTS if v in rows]
    ours = [rows[v] for v in variants if v in OURS]
    peers = [rows[v] for v in variants if v not in OURS]
    ratios: list[dict[str, Any]] = []
    pairs = [("zero1", "ddp"), ("zero2", "ddp"), ("zero3", "fsdp"), ("zero3", "fsdp2")]
    pairs += [("zero3", peer) for peer in HF_PEERS]
    for metric in ("tokens_per_s", "peak_allocated_gib"):
        for a, b in pairs:
            if a in rows and b in rows and rows[a].get("run_date") == rows[b].get("run_date"):  # same run only
                ratios += records.compute_ratios([rows[a]], [rows[b]], metric)
    notes = [
        f"each variant in its own `torchrun --standalone --nproc-per-node={nproc}` launch (fresh process group)",
        "step time: wall time between consecutive batch ends after warm-up, torch.cuda.synchronize at each, "
        "slowest rank per step, median over steps; tokens/s counts all GPUs",
        "peak memory: torch.cuda.max_memory_allocated/reserved over the whole run per rank, max over ranks",
        "estimate: lightning_llmopt.parallel.memory.estimate_memory(..., activation_checkpointing='none').peak; "
        "ddp as stage 0, fsdp/fsdp2/zero3 as stage 3 (single: stage 0 on 1 rank; the transformers peers: stage 3 "
        "with their activation checkpointing); peak_vs_estimate = measured allocated / estimate",
        "ratios above 1 mean ours is better (memory ratio = peer peak / our peak)",
        "fsdp = Lightning FSDPStrategy (FSDP1, FULL_SHARD, auto_wrap_policy={TransformerBlock}; bf16-mixed gathers "
        "and reduces in bf16); fsdp2 = Lightning ModelParallelStrategy(data_parallel_size=N) + fully_shard per "
        "block and root from the meta device (bf16 param_dtype, reduce in bf16, implicit prefetch)",
        *_variant_notes(args, rows),
        *_goal_notes(rows, cuda),
    ]
    notes += skipped + merged
    failed = [v for v in variants if "error" in rows[v]]
    for v in failed:
        notes.append(f"{v} failed: {rows[v]['error']}")
    if smoke:
        notes.append("smoke run on CPU (gloo, fp32 master weights, autocast bf16): code path only, figures meaningless")
    config = {
        "preset": args.preset,
        **facts,
        "world_size": nproc,
        "seq_len": args.seq_len,
        "micro_batch_per_rank": args.micro_batch,
        "global_batch_tokens": nproc * args.micro_batch * args.seq_len,
        "precision": args.precision,
        "warmup_steps": args.warmup_steps,
        "timed_steps": args.steps,
        "optimizer": "AdamW (CausalLMModule.configure_optimizers, fused on CUDA)",
        "activation_checkpointing": args.activation_checkpointing,
        "activation_checkpointing_applies_to": list(HF_PEERS),
        "data": "random tokens, seed 1234",
        "variants": variants,
        "estimate_peak_gib_by_stage": {
            str(k[0]): round(estimates[k].peak / _GIB, 4) for k in stage_keys if k in estimates
        },
    }
    record = records.make_record(
        name,
        config=config,
        results=ours,
        peers=peers,
        benchmark="zero",
        ratio_metric=None,
        reference={"datasheet_bf16_dense_tflops": DATASHEET_BF16_TFLOPS},
        notes=notes,
    )
    record["ratios"] = ratios
    path = records.write_record(record, results_dir)
    print()
    _print_table([rows[v] for v in variants])
    for note in notes:
        if note.startswith(("goal:", "peer:", "scaling:")) or " failed: " in note:
            print(f"  {note}")
    for note in skipped:
        print(f"  {note}")
    print(f"record: {path}\nlogs: {log_dir}")
    if smoke:
        bad = [v for v in failed if v != "fsdp2"]  # the optional FSDP2 peer need not run on CPU
    else:
        bad = failed
    if bad:
        print(f"failed: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
