"""N-D parallel training throughput on one multi-GPU host (issue 4): tensor and context parallelism.

For one preset (``1b``, or ``llama3-8b`` with its layer count reduced to fit: ``--layers``), ``bf16-mixed``, random
tokens, each variant trains in its OWN ``torchrun --standalone --nproc-per-node=N`` launch (a fresh process group):

- ours, :class:`~lightning_llmopt.strategies.NDParallelStrategy` (ZeRO-3 over the remaining ``dp*cp`` ranks):
  ``tp{d}`` (tensor + sequence parallel, vocab-parallel loss), ``cp{d}`` (ring attention with causal load balancing,
  flash-attention blocks), ``cp{d}-ulysses`` (all-to-all), and ``dp`` (data parallel only, for context);
  ``ep{d}`` (issue 6: experts of a MoE model, given by ``--model-overrides '{"moe": {...}}'``, sharded over ``d``
  ranks with all-to-all dispatch; its peer is ``dp`` on the same MoE model, experts sharded by ZeRO-3 alone);
- peers, measured in the same run: ``lightning-tp{d}``: Lightning's ``ModelParallelStrategy`` with the DTensor TP
  plan a user writes in ``configure_model`` (torch's Colwise/Rowwise/SequenceParallel styles, ``loss_parallel``,
  FSDP2 over the data-parallel dimension); ``torch-cp{d}``: torch's ``context_parallel`` (ring attention over CUDA
  SDPA, load balanced) with FSDP2 over the whole mesh, through ``ModelParallelStrategy`` as well.

Per variant: median step time (warm-up excluded; batch end to batch end, ``torch.cuda.synchronize`` at each, max
over ranks), tokens/s over all GPUs (``dp * micro_batch * seq_len`` per step) and per GPU, model TFLOP/s per GPU, and
peak allocated/reserved memory (max over ranks). One record per preset and world size:
``benchmarks/results/nd-<preset>-<N>gpu-<device>.json``, ratios ``tp{d}`` vs ``lightning-tp{d}`` and ``cp{d}``(-ulysses)
vs ``torch-cp{d}`` in tokens/s.

``--longest``: the longest sequence (one row per data-parallel group, activation checkpointing ``full``) that trains
with ``cp{C}`` against ``cp1`` (data parallel over the same GPUs, the row on one GPU): lengths double from
``--longest-start`` until a run fails (out of memory), then ``--bisect`` halvings between the last success and the
first failure. Record ``nd-longest-<preset>-<N>gpu-<device>.json``.

    python benchmarks/bench_nd_parallel.py                              # all visible GPUs, 1b, seq 8192
    python benchmarks/bench_nd_parallel.py --preset llama3-8b --layers 8
    python benchmarks/bench_nd_parallel.py --longest --longest-cp 4
    python benchmarks/bench_nd_parallel.py --smoke                      # CPU, gloo, 2 ranks, tiny, seq 64

``--smoke`` checks every code path on the CPU except ``torch-cp`` (torch's ``context_parallel`` needs CUDA SDPA
kernels; recorded as skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import re
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

REPO_ROOT = Path(__file__).resolve().parent.parent
DATASHEET_BF16_TFLOPS = 989.0
_VARIANT = re.compile(
    r"^(?:(?P<ours>tp|cp|ep|pp)(?P<d>\d+)(?P<ulysses>-ulysses)?|(?P<peer>lightning-tp|torch-cp)"
    r"(?P<pd>\d+)|(?P<dp>dp))$"
)
_GIB = 2**30


def parse_variant(name: str) -> dict[str, Any]:
    """``{"kind": "ours"|"lightning-tp"|"torch-cp", "tp": int, "cp": int, "ep": int, "pp": int,
    "mode": "ring"|"ulysses"}``."""
    m = _VARIANT.match(name)
    if m is None or (m["ulysses"] and m["ours"] != "cp"):
        raise SystemExit(
            f"unknown variant {name!r}: tp<d>, cp<d>, cp<d>-ulysses, ep<d>, pp<d>, dp, lightning-tp<d>, torch-cp<d>"
        )
    if m["dp"]:
        return {"kind": "ours", "tp": 1, "cp": 1, "ep": 1, "pp": 1, "mode": "ring"}
    if m["ours"]:
        d = int(m["d"])
        return {
            "kind": "ours",
            "tp": d if m["ours"] == "tp" else 1,
            "cp": d if m["ours"] == "cp" else 1,
            "ep": d if m["ours"] == "ep" else 1,
            "pp": d if m["ours"] == "pp" else 1,
            "mode": "ulysses" if m["ulysses"] else "ring",
        }
    d = int(m["pd"])
    return {
        "kind": m["peer"],
        "tp": d if m["peer"] == "lightning-tp" else 1,
        "cp": d if m["peer"] == "torch-cp" else 1,
        "ep": 1,
        "pp": 1,
        "mode": "ring",
    }


def default_variants(nproc: int) -> list[str]:
    out = ["dp"]
    for d in (2, 4, 8):
        if d <= nproc and nproc % d == 0:
            out += [f"tp{d}", f"lightning-tp{d}", f"cp{d}", f"cp{d}-ulysses", f"torch-cp{d}"]
    return out


# --------------------------------------------------------------------------- worker: modules and strategies


def _lightning_tp_class() -> type:
    """``CausalLMModule`` parallelised in ``configure_model`` as Lightning's ModelParallelStrategy asks: torch's
    DTensor styles (the usual Megatron/sequence-parallel plan), ``loss_parallel``, FSDP2 over data parallelism."""
    import torch
    import torch.nn.functional as F

    from lightning_llmopt import CausalLMModule
    from lightning_llmopt.models.llama import Llama

    class LightningTPCausalLM(CausalLMModule):
        param_dtype: Any = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.automatic_optimization = False  # loss_parallel must wrap the backward too

        def configure_model(self) -> None:
            if self.model is not None:
                return
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            from torch.distributed.tensor import Replicate, Shard
            from torch.distributed.tensor.parallel import (
                ColwiseParallel,
                PrepareModuleInput,
                RowwiseParallel,
                SequenceParallel,
                parallelize_module,
            )

            with torch.device("meta"):
                model = Llama(self.config)
            tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
            for block in model.layers.values():
                parallelize_module(
                    block,
                    tp,
                    {
                        "attention_norm": SequenceParallel(),
                        "attention": PrepareModuleInput(
                            input_layouts=(Shard(1), None, None, None, None),
                            desired_input_layouts=(Replicate(), None, None, None, None),
                        ),
                        "attention.wq": ColwiseParallel(),
                        "attention.wk": ColwiseParallel(),
                        "attention.wv": ColwiseParallel(),
                        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                        "ffn_norm": SequenceParallel(),
                        "feed_forward": PrepareModuleInput(
                            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                        ),
                        "feed_forward.w1": ColwiseParallel(),
                        "feed_forward.w3": ColwiseParallel(),
                        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                    },
                )
            parallelize_module(
                model,
                tp,
                {
                    "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                    "norm": SequenceParallel(),
                    "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
                },
            )
            if dp.size() > 1:
                mp = MixedPrecisionPolicy(param_dtype=self.param_dtype)
                for block in model.layers.values():
                    fully_shard(block, mesh=dp, mp_policy=mp)
                fully_shard(model, mesh=dp, mp_policy=mp)
            device = self.trainer.strategy.root_device
            model.to_empty(device=device)
            model.init_weights(buffer_device=device)
            self.model = model

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            from torch.distributed.tensor.parallel import loss_parallel

            opt, sched = self.optimizers(), self.lr_schedulers()
            with loss_parallel():
                logits = self.model(batch["input_ids"])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
                self.manual_backward(loss)
            opt.step()
            opt.zero_grad()
            sched.step()
            return loss.detach().full_tensor()

    return LightningTPCausalLM


def _torch_cp_class() -> type:
    """``CausalLMModule`` trained under torch's ``context_parallel`` (which replaces causal SDPA calls by ring
    attention and shards the listed buffers on the sequence), FSDP2 over the whole mesh."""
    import torch
    import torch.nn.functional as F

    from lightning_llmopt import CausalLMModule
    from lightning_llmopt.models.attention import register_backend
    from lightning_llmopt.models.llama import Llama

    def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, scale: float) -> torch.Tensor:
        rep = q.shape[1] // k.shape[1]  # torch's CP ring handlers take equal head counts
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    register_backend("torch_cp_causal", causal_sdpa, overwrite=True)

    class TorchCPCausalLM(CausalLMModule):
        param_dtype: Any = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.automatic_optimization = False  # context_parallel must wrap the backward too
            self.config.attn_backend = "torch_cp_causal"

        def configure_model(self) -> None:
            if self.model is not None:
                return
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            with torch.device("meta"):
                model = Llama(self.config)
            mp = MixedPrecisionPolicy(param_dtype=self.param_dtype)
            mesh = self.device_mesh  # (data_parallel, tensor_parallel = the context-parallel ranks): HSDP
            for block in model.layers.values():
                fully_shard(block, mesh=mesh, mp_policy=mp)
            fully_shard(model, mesh=mesh, mp_policy=mp)
            device = self.trainer.strategy.root_device
            model.to_empty(device=device)
            model.init_weights(buffer_device=device)
            self.model = model

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            from torch.distributed.tensor.experimental import context_parallel

            opt, sched = self.optimizers(), self.lr_schedulers()
            ids, labels = batch["input_ids"], batch["labels"]
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids).contiguous()
            cp_mesh = self.device_mesh["tensor_parallel"]
            with context_parallel(cp_mesh, buffers=[ids, labels, positions], buffer_seq_dims=[1, 1, 1]):
                logits = self.model(ids, positions=positions)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
                self.manual_backward(loss)
            opt.step()
            opt.zero_grad()
            sched.step()
            return loss.detach()

    return TorchCPCausalLM


def _build(args: argparse.Namespace, world: int, spec: dict[str, Any]) -> tuple[Any, Any, int]:
    """``(strategy, module, data-parallel size)`` for one variant."""
    import torch

    from lightning_llmopt import CausalLMModule

    overrides = _overrides(args)
    kwargs = {"model_overrides": overrides, "warmup_steps": 2, "max_steps": args.warmup_steps + args.steps}
    bf16 = args.precision == "bf16-mixed"
    if spec["kind"] == "ours":
        from lightning_llmopt.strategies import NDParallelStrategy

        strategy = NDParallelStrategy(
            tensor_parallel=spec["tp"],
            context_parallel=spec["cp"],
            context_parallel_mode=spec["mode"],
            expert_parallel=spec["ep"],
            pipeline_parallel=spec["pp"],
            zero_stage=_zero_stage(args, spec),
            activation_checkpointing=args.activation_checkpointing,
            compile=args.compile,
        )
        return strategy, CausalLMModule(args.preset, **kwargs), world // (spec["tp"] * spec["cp"] * spec["pp"])
    from lightning.pytorch.strategies import ModelParallelStrategy

    d = spec["tp"] * spec["cp"]
    cls: Any = _lightning_tp_class() if spec["kind"] == "lightning-tp" else _torch_cp_class()
    cls.param_dtype = torch.bfloat16 if bf16 else None
    strategy = ModelParallelStrategy(data_parallel_size=world // d, tensor_parallel_size=d)
    if args.activation_checkpointing != "none":
        raise SystemExit("peers run without activation checkpointing (--activation-checkpointing none)")
    return strategy, cls(args.preset, **kwargs), world // d


def _zero_stage(args: argparse.Namespace, spec: dict[str, Any]) -> int | None:
    """``--zero-stage``, else 3 (the records so far), else for pipelines the strategy's own default (``None``)."""
    if args.zero_stage is not None:
        return int(args.zero_stage)
    return None if spec["pp"] > 1 else 3


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    from lightning_llmopt.models import LlamaConfig

    out: dict[str, Any] = dict(json.loads(args.model_overrides))
    if LlamaConfig.from_preset(args.preset).max_seq_len < args.seq_len:
        out["max_seq_len"] = args.seq_len
    if args.layers:
        out["n_layers"] = args.layers
    return out


def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch

    from lightning_llmopt.testing.data import RandomTokens

    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        raise SystemExit("bench_nd_parallel needs CUDA GPUs (use --smoke for a CPU check of the code paths)")
    world = int(os.environ["WORLD_SIZE"])
    torch.set_float32_matmul_precision("high")
    L.seed_everything(0, verbose=False)
    for pattern in (
        ".*does not have many workers.*",
        ".*predict_dataloader.*",
        ".*FSDP.*",
        ".*barebones.*",
        ".*DTensor random.*",
        ".*Slicing a flattened dim.*",
        ".*LeafSpec.*",
    ):
        warnings.filterwarnings("ignore", message=pattern)
    spec = parse_variant(args.strategy)
    strategy, module, dp = _build(args, world, spec)
    total = args.warmup_steps + args.steps
    data = RandomTokens(module.config.vocab_size, args.seq_len, total * args.micro_batch * dp, seed=1234)
    loader = torch.utils.data.DataLoader(
        data, batch_size=args.micro_batch, num_workers=2 if cuda else 0, pin_memory=cuda, persistent_workers=cuda
    )
    measure = launch.measure_callback(args.warmup_steps, cuda)
    callbacks: list[Any] = [measure]
    if args.profile:  # two steps after warm-up (the timed figures then include the profiler's overhead)
        callbacks.append(launch.profile_callback(args.warmup_steps, 2, cuda))
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=world,
        strategy=strategy,
        precision=args.precision,
        max_steps=total,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    trainer.fit(module, train_dataloaders=loader)
    s = measure.summary
    if not s.get("step_s"):
        raise RuntimeError("no timed steps (increase --steps)")
    step = statistics.median(s["step_s"])
    tokens = dp * args.micro_batch * args.seq_len / step
    row: dict[str, Any] = {
        "variant": args.strategy,
        "tp": spec["tp"],
        "cp": spec["cp"],
        "pp": spec["pp"],
        "zero_stage": strategy.nd_config.zero_stage if spec["kind"] == "ours" else None,
        "activation_checkpointing": args.activation_checkpointing,
        "dp": dp,
        "seq_len": args.seq_len,
        "median_step_ms": step * 1e3,
        "tokens_per_s": tokens,
        "tokens_per_s_per_gpu": tokens / world,
        "timed_steps": len(s["step_s"]),
        "final_loss": s["losses"][-1] if s["losses"] else None,
    }
    if cuda:
        row["peak_allocated_gib"] = max(s["allocated"]) / _GIB
        row["peak_reserved_gib"] = max(s["reserved"]) / _GIB
    return row


# --------------------------------------------------------------------------- driver (one launch per variant)


def _worker_args(args: argparse.Namespace, variant: str, seq_len: int, json_out: Path) -> list[str]:
    out = [
        "--worker",
        "--strategy",
        variant,
        "--preset",
        args.preset,
        "--seq-len",
        str(seq_len),
        "--micro-batch",
        str(args.micro_batch),
        "--precision",
        args.precision,
        "--warmup-steps",
        str(args.warmup_steps),
        "--steps",
        str(args.steps),
        "--json-out",
        str(json_out),
        "--activation-checkpointing",
        args.activation_checkpointing,
        "--model-overrides",
        args.model_overrides,
    ]
    if args.zero_stage is not None:
        out += ["--zero-stage", str(args.zero_stage)]
    if args.layers:
        out += ["--layers", str(args.layers)]
    if args.compile:
        out.append("--compile")
    if args.profile:
        out.append("--profile")
    if args.smoke:
        out.append("--smoke")
    return out


def run_variant(
    args: argparse.Namespace, variant: str, nproc: int, log_dir: Path, seq_len: int | None = None
) -> dict[str, Any]:
    """Launch one variant with torchrun; return its row (or ``{"variant", "error", "oom"}``)."""
    seq_len = seq_len or args.seq_len
    log_path = log_dir / f"nd-{variant}-{nproc}-{seq_len}.log"
    return launch.launch(
        __file__,
        lambda out: _worker_args(args, variant, seq_len, out),
        variant,
        nproc,
        log_path,
        args.timeout,
        extra={"seq_len": seq_len},
    )


def _model_facts(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from lightning_llmopt.models import LlamaConfig
    from lightning_llmopt.models.llama import Llama

    config = LlamaConfig.from_preset(args.preset, **_overrides(args))
    with torch.device("meta"):
        model = Llama(config)
    return {
        "params": model.num_params(),
        "flops_per_token": float(model.flops_per_token(args.seq_len)),
        "model": {
            k: getattr(config, k)
            for k in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim", "max_seq_len")
        },
    }


def _preset_name(args: argparse.Namespace) -> str:
    name = f"{args.preset}-{args.layers}l" if args.layers else args.preset
    return name + ("-moe" if json.loads(args.model_overrides).get("moe") else "")


def run_throughput(args: argparse.Namespace, nproc: int, results_dir: Path, log_dir: Path, cuda: bool) -> Path:
    facts = _model_facts(args)
    variants = args.variants or default_variants(nproc)
    rows: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    for variant in variants:
        spec = parse_variant(variant)
        if nproc % (spec["tp"] * spec["cp"] * spec["ep"]):
            notes.append(f"{variant} skipped: {spec['tp'] * spec['cp'] * spec['ep']} does not divide {nproc} GPUs")
            continue
        if spec["kind"] == "torch-cp" and not cuda:
            notes.append(f"{variant} skipped in --smoke: torch's context_parallel needs CUDA SDPA kernels")
            print(f"[{variant}] {notes[-1]}", flush=True)
            continue
        row = run_variant(args, variant, nproc, log_dir)
        if isinstance(row.get("tokens_per_s_per_gpu"), (int, float)):
            row["model_tflops_per_gpu"] = facts["flops_per_token"] * row["tokens_per_s_per_gpu"] / 1e12
            if cuda:
                row["mfu_vs_datasheet"] = row["model_tflops_per_gpu"] / DATASHEET_BF16_TFLOPS
        rows[variant] = row
    run_date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for row in rows.values():
        row["run_date"] = run_date
    name = f"nd-{_preset_name(args)}-{nproc}{'gpu' if cuda else 'cpu'}"
    if args.merge:
        notes += _merge_previous(rows, records.record_path({"name": name, "env": records.environment()}, results_dir))
    rows = {v: rows[v] for v in sorted(rows, key=_variant_order)}
    ours = [r for v, r in rows.items() if parse_variant(v)["kind"] == "ours"]
    peers = [r for v, r in rows.items() if parse_variant(v)["kind"] != "ours"]
    ratios = []
    for variant, row in rows.items():
        spec = parse_variant(variant)
        if spec["kind"] != "ours" or (spec["tp"] == 1 and spec["cp"] == 1 and spec["ep"] == 1):
            continue
        if spec["ep"] > 1:  # expert parallelism against the same MoE model with experts sharded by ZeRO-3 only
            peer = "dp"
        else:
            peer = f"lightning-tp{spec['tp']}" if spec["tp"] > 1 else f"torch-cp{spec['cp']}"
        if peer in rows and rows[peer].get("run_date") == row.get("run_date"):  # same run only
            ratios += records.compute_ratios([row], [rows[peer]], "tokens_per_s")
    config = {
        "preset": args.preset,
        "layers": args.layers,
        "nproc": nproc,
        "seq_len": args.seq_len,
        "micro_batch_per_dp_rank": args.micro_batch,
        "precision": args.precision,
        "warmup_steps": args.warmup_steps,
        "timed_steps": args.steps,
        "activation_checkpointing": args.activation_checkpointing,
        "compile": args.compile,
        "model_overrides": json.loads(args.model_overrides),
        **facts,
    }
    notes.append(
        "tokens/s = dp * micro_batch * seq_len / median step time; ours use ZeRO-3 over the remaining "
        "dp*cp ranks, peers FSDP2 over theirs; ratios above 1 mean ours is faster"
    )
    record = records.make_record(
        name,
        config,
        ours,
        peers,
        benchmark="nd",
        ratio_metric=None,
        notes=notes,
        reference={"datasheet_bf16_tflops": DATASHEET_BF16_TFLOPS},
    )
    record["ratios"] = ratios
    path = records.write_record(record, results_dir)
    _print_table([*ours, *peers])
    return path


def _variant_order(variant: str) -> tuple[int, int, str]:
    spec = parse_variant(variant)
    return (spec["tp"] * spec["cp"] * spec["ep"], 0 if spec["kind"] == "ours" else 1, variant)


def _merge_previous(rows: dict[str, dict[str, Any]], path: Path) -> list[str]:
    """Add the rows of ``path``'s record for variants not run now (each keeps its ``run_date``)."""
    if not path.exists():
        return [f"--merge: no earlier record at {path.name}"]
    old = json.loads(path.read_text())
    kept = []
    for row in [*old.get("results", []), *old.get("peers", [])]:
        if row.get("variant") in rows or "error" in row:
            continue
        rows[row["variant"]] = dict(row)
        kept.append(f"{row['variant']} ({row.get('run_date')})")
    if not kept:
        return []
    return [f"merged from the earlier record (not rerun): {', '.join(kept)}; ratios pair rows of one run only"]


def _longest_for(args: argparse.Namespace, cp: int, nproc: int, log_dir: Path) -> dict[str, Any]:
    """Double the sequence until a run fails, then bisect; return the attempts and the longest success."""
    variant = f"cp{cp}" if cp > 1 else "dp"
    attempts: list[dict[str, Any]] = []
    ok, bad = 0, 0
    seq = args.longest_start
    while seq <= args.longest_max:
        row = run_variant(args, variant, nproc, log_dir, seq_len=seq)
        attempts.append(row)
        if "error" in row:
            bad = seq
            break
        ok, seq = seq, seq * 2
    quantum = 2 * cp * 64  # keep lengths divisible by 2*cp and by 64
    for _ in range(args.bisect if ok and bad else 0):
        mid = (ok + bad) // 2 // quantum * quantum
        if mid <= ok:
            break
        row = run_variant(args, variant, nproc, log_dir, seq_len=mid)
        attempts.append(row)
        ok, bad = (mid, bad) if "error" not in row else (ok, mid)
    best = next((a for a in attempts if a.get("seq_len") == ok and "error" not in a), None)
    return {
        "variant": variant,
        "cp": cp,
        "longest_seq": ok,
        "first_failure_seq": bad or None,
        "tokens_per_s_at_longest": best.get("tokens_per_s") if best else None,
        "peak_allocated_gib_at_longest": best.get("peak_allocated_gib") if best else None,
        "attempts": [
            {k: a.get(k) for k in ("seq_len", "tokens_per_s", "peak_allocated_gib", "error", "oom")} for a in attempts
        ],
    }


def run_longest(args: argparse.Namespace, nproc: int, results_dir: Path, log_dir: Path, cuda: bool) -> Path:
    cp = args.longest_cp or nproc
    args.micro_batch = 1
    ours = _longest_for(args, cp, nproc, log_dir)
    base = _longest_for(args, 1, nproc, log_dir)
    ratio = ours["longest_seq"] / base["longest_seq"] if base["longest_seq"] else None
    config = {
        "preset": args.preset,
        "layers": args.layers,
        "nproc": nproc,
        "micro_batch_per_dp_rank": 1,
        "precision": args.precision,
        "activation_checkpointing": args.activation_checkpointing,
        "start": args.longest_start,
        "max": args.longest_max,
        "bisect": args.bisect,
        "warmup_steps": args.warmup_steps,
        "timed_steps": args.steps,
        "model_overrides": json.loads(args.model_overrides),
    }
    notes = [
        f"longest trainable row: cp{cp} {ours['longest_seq']} tokens vs cp1 (data parallel, the row on one GPU) "
        f"{base['longest_seq']} tokens: {ratio if ratio is None else round(ratio, 3)}x",
        "a length counts as trainable when warm-up + timed steps finish; the first failure is usually OOM",
    ]
    name = f"nd-longest-{_preset_name(args)}-{nproc}{'gpu' if cuda else 'cpu'}"
    record = records.make_record(name, config, [ours], [base], benchmark="nd", ratio_metric="longest_seq", notes=notes)
    path = records.write_record(record, results_dir)
    print(notes[0], flush=True)
    return path


def _print_table(rows: list[dict[str, Any]]) -> None:
    head = f"{'variant':>15} {'dp':>3} {'step ms':>9} {'tok/s':>11} {'tok/s/gpu':>10} {'peak GiB':>9}  error"
    print(head)
    print("-" * len(head))

    def num(value: Any, spec: str, width: int) -> str:
        return f"{value:{width}{spec}}" if isinstance(value, (int, float)) else f"{'-':>{width}}"

    for r in rows:
        print(
            f"{r['variant']:>15} {num(r.get('dp'), 'd', 3)} {num(r.get('median_step_ms'), '.1f', 9)} "
            f"{num(r.get('tokens_per_s'), ',.0f', 11)} {num(r.get('tokens_per_s_per_gpu'), ',.0f', 10)} "
            f"{num(r.get('peak_allocated_gib'), '.2f', 9)}  {r.get('error', '')[:100]}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="NDParallelStrategy TP/CP vs Lightning DTensor TP and torch CP.")
    parser.add_argument("--nproc", type=int, default=None, help="processes/GPUs (default: all visible; 2 w/ smoke)")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help="default: dp, tp<d>, lightning-tp<d>, cp<d>, cp<d>-ulysses, torch-cp<d> for d in 2, 4, 8 dividing --nproc",
    )
    parser.add_argument("--preset", default=None, help="model preset (default 1b; tiny with --smoke)")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    parser.add_argument("--model-overrides", default="{}", help="JSON of LlamaConfig fields")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 8192; 64 with --smoke)")
    parser.add_argument("--micro-batch", type=int, default=None, help="rows per data-parallel group (default 1)")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--activation-checkpointing", default=None, help="ours: default none (full with --longest)")
    parser.add_argument("--compile", action="store_true", help="ours: torch.compile each block")
    parser.add_argument(
        "--zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
        help="ours: NDParallelStrategy zero_stage over the data-parallel group (default: the strategy's own choice "
        "for pp variants, 3 otherwise)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="print rank 0's top operators over 2 steps into each launch's log"
    )
    parser.add_argument("--warmup-steps", type=int, default=None, help="untimed steps (default 3; 1 with --smoke)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10; 2 with --smoke)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per launch (default 300)")
    parser.add_argument("--results-dir", type=Path, default=None, help="default benchmarks/results (temp w/ smoke)")
    parser.add_argument("--log-dir", type=Path, default=None, help="per-launch logs (default: a temp folder)")
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, 2 ranks, tiny preset: code paths only")
    parser.add_argument("--longest", action="store_true", help="longest trainable sequence, cp<C> vs cp1")
    parser.add_argument("--longest-cp", type=int, default=None, help="C (default: --nproc)")
    parser.add_argument("--longest-start", type=int, default=None, help="first length (default 16384; 64 smoke)")
    parser.add_argument("--longest-max", type=int, default=None, help="stop doubling here (default 1048576)")
    parser.add_argument("--bisect", type=int, default=2, help="halvings after the first failure")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep rows of variants not run now from the existing record (variants split over several launches); "
        "ratios only pair rows of one run",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    smoke = args.smoke
    args.preset = args.preset or ("tiny" if smoke else "1b")
    args.seq_len = args.seq_len or (64 if smoke else 8192)
    args.micro_batch = args.micro_batch or 1
    args.activation_checkpointing = args.activation_checkpointing or ("full" if args.longest else "none")
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (1 if smoke else 3)
    args.steps = args.steps if args.steps is not None else (2 if smoke else 10)
    args.timeout = args.timeout or 300.0
    args.longest_start = args.longest_start or (64 if smoke else 16384)
    args.longest_max = args.longest_max or (256 if smoke else 1 << 20)
    if args.worker:
        return launch.worker_main(run_worker, args)
    os.environ.update(launch.NVLS_OFF)
    import torch

    cuda = torch.cuda.is_available() and not smoke
    if not smoke and not cuda:
        raise SystemExit("bench_nd_parallel needs CUDA GPUs (use --smoke for a CPU check of the code paths)")
    nproc = args.nproc or (2 if smoke else torch.cuda.device_count())
    if nproc < 2:
        raise SystemExit(f"bench_nd_parallel needs at least 2 processes, got {nproc}")
    results_dir = args.results_dir or (
        Path(tempfile.mkdtemp(prefix="llmopt-bench-")) if smoke else REPO_ROOT / "benchmarks" / "results"
    )
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="llmopt-nd-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    run = run_longest if args.longest else run_throughput
    path = run(args, nproc, results_dir, log_dir, cuda)
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
