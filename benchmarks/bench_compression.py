"""Compression on CPU (distillation, pruning) and the 2:4 sparse matmul on GPU.

CPU part (``benchmarks/results/compression-cpu.json``):

1. Teacher: the trained ``debug-1m`` model of ``bench_quant_quality.py`` (same settings, same cache: 600 AdamW
   steps, batch 16 x 256 bytes of the Python standard library, ~8 min on one core when not cached).
2. Distillation: a student with half the teacher's blocks (``debug-1m`` with 2 layers, same width), trained
   ``--student-steps`` from the same initialisation on the same batches twice: with the plain cross-entropy, and
   with ``alpha * T^2 KL(teacher || student) + (1 - alpha) * CE``. Validation loss (nats per byte) on the same
   ``--eval-batches`` batches as the teacher's.
3. Pruning of the teacher at 50%: magnitude (per layer) vs SparseGPT (``--calib-samples`` training sequences),
   unstructured and 2:4; perplexity on the same validation batches, fp32. The output head (tied to the embedding)
   stays dense.

GPU part (``--gpu``; ``benchmarks/results/compression-2to4-<device>.json``): ``F.linear`` with a 2:4-sparse fp16
weight converted by ``torch.sparse.to_sparse_semi_structured`` vs the dense weight, for Llama-7B-like layer shapes
and several token counts; median ms and speedup.

    python benchmarks/bench_compression.py                # ~5 min on one busy core (teacher cached)
    python benchmarks/bench_compression.py --smoke        # a minute, temp cache and results dirs
    python benchmarks/bench_compression.py --gpu [--smoke]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package
import bench_quant_quality as bq  # noqa: E402
import records  # noqa: E402

from lightning_llmopt import CausalLMModule  # noqa: E402
from lightning_llmopt.compression import distillation_loss, prune_model  # noqa: E402
from lightning_llmopt.models import Llama, LlamaConfig  # noqa: E402
from lightning_llmopt.quantization import causal_lm_loss  # noqa: E402


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--student-steps", type=int, default=200)
    p.add_argument("--student-lr", type=float, default=3e-3)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--gpu", action="store_true", help="run the 2:4 matmul benchmark (CUDA) instead")
    p.add_argument("--smoke", action="store_true")
    p.add_argument(
        "--distill-seeds",
        type=int,
        nargs="+",
        default=None,
        help="only the distillation comparison, repeated for these seeds (student init and batch order); "
        "record compression-distill-seeds",
    )
    args, rest = p.parse_known_args(argv)
    qq = bq.parse(rest + (["--smoke"] if args.smoke else []))  # teacher/data settings shared with bench_quant_quality
    if args.smoke:
        args.student_steps = 10
    return argparse.Namespace(**{**vars(qq), **vars(args)})


def _sched(opt: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = max(1, steps // 20)
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))) * 0.9 + 0.1
    )


def train_student(
    args: argparse.Namespace, dm: Any, init: Llama, teacher: Llama | None, seed: int = 0
) -> tuple[Llama, dict]:
    """Train a copy of ``init`` on the seeded batch sequence; with the KL term against ``teacher`` if given."""
    model = copy.deepcopy(init).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.student_lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = _sched(opt, args.student_steps)
    g = torch.Generator().manual_seed(seed)
    start, ds = time.perf_counter(), dm.train_dataset
    for step in range(args.student_steps):
        idx = torch.randint(0, len(ds), (args.batch_size,), generator=g).tolist()
        ids = torch.stack([ds[i]["input_ids"] for i in idx])
        labels = torch.stack([ds[i]["labels"] for i in idx])
        logits = model(ids)
        if teacher is None:
            loss = CausalLMModule.loss_fn(logits, labels)
        else:
            with torch.no_grad():
                t_logits = teacher(ids)
            loss, _, _ = distillation_loss(logits, t_logits, labels, args.temperature, args.alpha)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == args.student_steps - 1:
            tag = "distilled" if teacher is not None else "baseline"
            print(f"{tag} step {step}: loss {loss.item():.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
    return model.eval(), {"seconds": time.perf_counter() - start}


def cpu_main(args: argparse.Namespace) -> int:
    dm = bq.data(args)
    teacher, train_info = bq.train(args, dm)
    teacher.eval().requires_grad_(False)
    val = bq.batches(dm, args.eval_batches, "val")
    calib = [b["input_ids"] for b in bq.batches(dm, max(1, args.calib_samples // dm.batch_size), "train")]
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()

    def add(variant: str, model: torch.nn.Module, **extra: Any) -> float:
        loss = causal_lm_loss(model, val)
        rows.append({"variant": variant, "loss": loss, "perplexity": math.exp(loss), **extra})
        print(
            f"{variant:28s} loss {loss:.4f}  ppl {math.exp(loss):.4f}  ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
        return loss

    dense = add("teacher-dense", teacher, layers=teacher.config.n_layers)
    # ---- pruning
    for method in ("magnitude", "sparsegpt"):
        for pattern in ("unstructured", "2:4"):
            m = copy.deepcopy(teacher)
            rep = prune_model(m, args.sparsity, method, pattern, calibration=calib if method == "sparsegpt" else None)
            add(
                f"prune-{method}-{'50pct' if pattern == 'unstructured' else '2of4'}",
                m,
                sparsity=rep.sparsity,
                prune_seconds=rep.seconds,
            )
    # ---- distillation
    cfg = LlamaConfig.from_dict(
        {**teacher.config.to_dict(), "n_layers": teacher.config.n_layers // 2, "name": "debug-1m-half"}
    )
    torch.manual_seed(1)
    init = Llama(cfg)
    base, base_info = train_student(args, dm, init, None)
    base_loss = add("student-baseline", base, layers=cfg.n_layers, train_seconds=base_info["seconds"])
    dist, dist_info = train_student(args, dm, init, teacher)
    dist_loss = add("student-distilled", dist, layers=cfg.n_layers, train_seconds=dist_info["seconds"])

    by = {r["variant"]: r for r in rows}
    inc = {k: by[k]["perplexity"] - by["teacher-dense"]["perplexity"] for k in by if k.startswith("prune")}
    checks = {
        "distilled_val_loss": dist_loss,
        "baseline_val_loss": base_loss,
        "distilled_lower_than_baseline": dist_loss < base_loss,
        "sparsegpt50_ppl_increase": inc["prune-sparsegpt-50pct"],
        "magnitude50_ppl_increase": inc["prune-magnitude-50pct"],
        "sparsegpt50_raises_ppl_less_than_magnitude50": inc["prune-sparsegpt-50pct"] < inc["prune-magnitude-50pct"],
        "sparsegpt_2of4_raises_ppl_less_than_magnitude_2of4": inc["prune-sparsegpt-2of4"] < inc["prune-magnitude-2of4"],
    }
    record = records.make_record(
        "compression",
        config={
            "teacher": args.preset,
            "teacher_steps": args.steps,
            "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            "student_layers": cfg.n_layers,
            "student_steps": args.student_steps,
            "student_lr": args.student_lr,
            "temperature": args.temperature,
            "alpha": args.alpha,
            "sparsity": args.sparsity,
            "calib_sequences": sum(c.shape[0] for c in calib),
            "eval_tokens": sum(b["labels"].numel() for b in val),
            "tokenizer": "byte",
            "corpus": "python stdlib (TextDataModule default)",
            "threads": args.threads,
        },
        results=rows,
        peers=[],
        benchmark="compression",
        ratio_metric=None,
        notes=[
            "fp32 throughout; loss = mean next-byte cross-entropy (nats) on the same validation batches for all rows; "
            "perplexity = exp(loss)",
            "students: same init, same batch sequence, same optimizer and schedule; distilled adds the teacher's "
            f"KL at T={args.temperature}, alpha={args.alpha} (no feature or attention terms)",
            "pruning: all block linears at 50% (2:4 is 50% by construction), output head/embedding (tied) dense, "
            "no fine-tuning after pruning",
            f"teacher training: {json.dumps(train_info)}; dense teacher loss {dense:.4f}",
            f"checks: {json.dumps(checks)}",
        ],
    )
    record["checks"] = checks
    path = records.write_record(record, args.results_dir)
    print(json.dumps(checks, indent=2))
    print(f"wrote {path}")
    return 0


def gpu_main(args: argparse.Namespace) -> int:
    from lightning_llmopt.compression import nm_mask, semi_structured_available

    if not semi_structured_available():
        print("no CUDA device of compute capability >= 8.0: nothing to measure")
        return 1
    shapes = [(512, 512)] if args.smoke else [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096)]
    tokens_list = [256] if args.smoke else [1, 16, 256, 2048, 8192]
    rows = []
    for n, k in shapes:
        w = torch.randn(n, k, device="cuda", dtype=torch.float16)
        w = w * nm_mask(w.abs())
        ws = torch.sparse.to_sparse_semi_structured(w)
        for t in tokens_list:
            x = torch.randn(max(t, 1), k, device="cuda", dtype=torch.float16)
            row: dict[str, Any] = {"variant": f"2of4-{n}x{k}-t{t}", "n": n, "k": k, "tokens": t}
            try:
                row["sparse_ms"] = records.timeit_median(lambda x=x, ws=ws: torch.nn.functional.linear(x, ws))
            except RuntimeError as e:  # some token counts are below the kernels' minimum
                row["error"] = str(e).splitlines()[0]
            row["dense_ms"] = records.timeit_median(lambda x=x, w=w: torch.nn.functional.linear(x, w))
            if "sparse_ms" in row:
                row["speedup"] = row["dense_ms"] / row["sparse_ms"]
            rows.append(row)
            print(row, flush=True)
    record = records.make_record(
        "compression-2to4",
        config={"dtype": "float16", "shapes": shapes, "tokens": tokens_list},
        results=rows,
        peers=[],
        benchmark="compression",
        ratio_metric=None,
        notes=["speedup = dense cuBLAS F.linear median / semi-structured F.linear median, same weight values"],
    )
    print(f"wrote {records.write_record(record, args.results_dir)}")
    return 0


def distill_seeds_main(args: argparse.Namespace) -> int:
    """The distillation comparison alone, once per seed: is the distilled student's lower loss more than one draw?"""
    dm = bq.data(args)
    teacher, _ = bq.train(args, dm)
    teacher.eval().requires_grad_(False)
    val = bq.batches(dm, args.eval_batches, "val")
    cfg = LlamaConfig.from_dict(
        {**teacher.config.to_dict(), "n_layers": teacher.config.n_layers // 2, "name": "debug-1m-half"}
    )
    rows = []
    for seed in args.distill_seeds:
        torch.manual_seed(1000 + seed)
        init = Llama(cfg)
        base, _ = train_student(args, dm, init, None, seed=seed)
        dist, _ = train_student(args, dm, init, teacher, seed=seed)
        b, d = causal_lm_loss(base, val), causal_lm_loss(dist, val)
        rows.append({"variant": f"seed{seed}", "baseline_loss": b, "distilled_loss": d, "distilled_lower": d < b})
        print(rows[-1], flush=True)
    record = records.make_record(
        "compression-distill-seeds",
        config={
            "student_steps": args.student_steps,
            "temperature": args.temperature,
            "alpha": args.alpha,
            "student_layers": cfg.n_layers,
            "teacher": args.preset,
            "seeds": args.distill_seeds,
        },
        results=rows,
        peers=[],
        benchmark="compression",
        ratio_metric=None,
        notes=[
            "each seed: a fresh student init and batch order, shared by the baseline and the distilled student; "
            "validation batches as in the compression record"
        ],
    )
    print(f"wrote {records.write_record(record, args.results_dir)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    if args.distill_seeds:
        return distill_seeds_main(args)
    return gpu_main(args) if args.gpu else cpu_main(args)


if __name__ == "__main__":
    sys.exit(main())
