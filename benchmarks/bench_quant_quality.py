"""Quantization quality on CPU: perplexity of a small model trained on the default corpus, quantized many ways.

1. Train (or reuse from ``--cache-dir``) the ``debug-1m`` preset with the byte tokenizer on the Python standard
   library (:class:`~lightning_llmopt.data.TextDataModule`'s default corpus), fp32, plain AdamW loop.
2. Evaluate token-level perplexity (``exp`` of the mean next-byte cross-entropy; a token is a byte) on the first
   ``--eval-batches`` validation batches, every variant on the same tokens, in bf16: the float model cast to bf16
   is the baseline; quantized variants keep fp16 scales (as GPTQ checkpoints) and bf16 activations.
3. Variants: int8 RTN per channel; int4 RTN g128; int4 GPTQ g128; int3 GPTQ g128 (and RTN); observers at 4 bits
   (min/max, MSE, percentile; g128 and per channel); QAT int4 g128 (the ``QuantizationAwareTraining`` callback in
   a Lightning Trainer for ``--qat-steps`` steps, converted at fit end) beside a float fine-tune of the same steps
   (control); mixed precision (sensitivity on the calibration set, greedy allocation under ``--mixed-bits`` bits per
   weight over the linear layers, options bf16 / int8 / int4 g128 / int3 g128, then GPTQ with that plan).

``debug-1m`` has ``dim = 128``: a group of 128 is one group per row for every layer but ``w2`` (K = 384), so g128
here is close to per-channel, which makes 4-bit error large enough to compare methods (on larger models g128 is
much finer than per-channel and all 4-bit gaps shrink). Writes ``benchmarks/results/quant-quality-cpu.json``.

    python benchmarks/bench_quant_quality.py            # ~15 min on one busy CPU core (training is cached)
    python benchmarks/bench_quant_quality.py --smoke    # a minute: a few steps, temp results dir
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package
import records  # noqa: E402

from lightning_llmopt import CausalLMModule  # noqa: E402
from lightning_llmopt.callbacks.qat import QuantizationAwareTraining  # noqa: E402
from lightning_llmopt.data import TextDataModule  # noqa: E402
from lightning_llmopt.models import Llama, LlamaConfig  # noqa: E402
from lightning_llmopt.quantization import (  # noqa: E402
    QuantConfig,
    QuantSpec,
    allocate_bits,
    causal_lm_loss,
    layer_sensitivity,
    quantize_model,
)
from lightning_llmopt.quantization.mixed_precision import option_bytes  # noqa: E402


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="debug-1m")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--calib-samples", type=int, default=64)
    p.add_argument("--qat-steps", type=int, default=150)
    p.add_argument("--qat-lr", type=float, default=3e-4)
    p.add_argument("--mixed-bits", type=float, default=5.0, help="bits per linear weight for mixed precision")
    p.add_argument("--max-bytes", type=int, default=8_000_000)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on busy cores)")
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "lightning_llmopt" / "quant_quality")
    p.add_argument("--results-dir", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="few steps and batches, temp cache and results dirs")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.seq_len, args.batch_size = 20, 64, 8
        args.eval_batches, args.calib_samples, args.qat_steps, args.max_bytes = 2, 8, 4, 400_000
        args.cache_dir = Path(tempfile.mkdtemp(prefix="llmopt-qq-"))
        args.results_dir = args.results_dir or Path(tempfile.mkdtemp(prefix="llmopt-bench-"))
    return args


def data(args: argparse.Namespace) -> TextDataModule:
    dm = TextDataModule(seq_len=args.seq_len, batch_size=args.batch_size, max_bytes=args.max_bytes)
    dm.setup("fit")
    return dm


def train(args: argparse.Namespace, dm: TextDataModule) -> tuple[Llama, dict[str, Any]]:
    """The trained fp32 model (cached by its settings) and training facts."""
    key = f"{args.preset}-s{args.steps}-T{args.seq_len}-B{args.batch_size}-lr{args.lr}-mb{args.max_bytes}"
    path = args.cache_dir / f"{key}.pt"
    config = LlamaConfig.from_preset(args.preset, max_seq_len=max(args.seq_len, 256))
    torch.manual_seed(0)
    model = Llama(config)
    if path.exists():
        saved = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(saved["model"])
        return model, {**json.loads(saved["info"]), "cached": True}
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))) * 0.9 + 0.1
    )
    g = torch.Generator().manual_seed(0)
    train_set = dm.train_dataset
    start = time.perf_counter()
    model.train()
    loss = torch.zeros(())
    for step in range(args.steps):
        idx = torch.randint(0, len(train_set), (args.batch_size,), generator=g).tolist()
        batch = [train_set[i] for i in idx]
        ids = torch.stack([b["input_ids"] for b in batch])
        labels = torch.stack([b["labels"] for b in batch])
        loss = CausalLMModule.loss_fn(model(ids), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"train step {step}: loss {loss.item():.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
    info = {
        "cached": False,
        "train_seconds": time.perf_counter() - start,
        "final_train_loss": loss.item(),
        "tokens_seen": args.steps * args.batch_size * args.seq_len,
    }
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "info": json.dumps(info)}, path)
    return model, info


def as_bf16(model: torch.nn.Module) -> torch.nn.Module:
    """Parameters to bf16; buffers (quantized codes, fp16 scales, the RoPE table) untouched."""
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    return model.eval()


def batches(dm: TextDataModule, n: int, split: str) -> list[dict[str, torch.Tensor]]:
    ds = dm.val_dataset if split == "val" else dm.train_dataset
    g = torch.Generator().manual_seed(1 if split == "val" else 2)
    order = torch.randperm(len(ds), generator=g).tolist()
    rows = [ds[i] for i in order[: n * dm.batch_size]]
    return [
        {k: torch.stack([r[k] for r in rows[i : i + dm.batch_size]]) for k in ("input_ids", "labels")}
        for i in range(0, len(rows), dm.batch_size)
    ]


def qconfig(**kw: Any) -> QuantConfig:
    return QuantConfig(scale_dtype=torch.float16, **kw)


def quantized(base: Llama, config: QuantConfig, calib: list[torch.Tensor] | None = None) -> Llama:
    model = copy.deepcopy(base).eval()
    quantize_model(model, config, calib)
    return as_bf16(model)  # type: ignore[return-value]


def run_qat(args: argparse.Namespace, base: Llama, dm: TextDataModule, qat: bool) -> Llama:
    """Fine-tune ``base`` for ``--qat-steps`` in a Lightning Trainer, with the QAT callback (the result has real
    quantized layers, converted at fit end) or without (fp32)."""
    import lightning as L

    torch.manual_seed(0)
    module = CausalLMModule(
        base.config.to_dict(),
        learning_rate=args.qat_lr,
        warmup_steps=0,
        max_steps=args.qat_steps,
        min_lr_ratio=0.1,
        weight_decay=0.0,
    )
    module.model = copy.deepcopy(base)
    callbacks = [QuantizationAwareTraining(bits=4, group_size=128, convert_dtype=torch.float16)] if qat else []
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=args.qat_steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(module, datamodule=dm)
    assert module.model is not None
    return module.model.eval()


def mixed(args: argparse.Namespace, base: Llama, calib: list[dict[str, torch.Tensor]]) -> tuple[Llama, dict]:
    options = [None, QuantSpec(8, "channel"), QuantSpec(4, "group", 128), QuantSpec(3, "group", 128)]
    sens = layer_sensitivity(base, calib[:2], [o for o in options if o is not None])
    shapes = {n: tuple(base.get_submodule(n).weight.shape) for n in sens}
    weights = sum(n * k for n, k in shapes.values())
    alloc = allocate_bits(sens, shapes, options, int(args.mixed_bits * weights / 8))  # type: ignore[arg-type]
    model = quantized(base, qconfig(method="gptq").with_overrides(alloc.plan), [b["input_ids"] for b in calib])
    info = {
        "bits_per_weight": 8 * alloc.size_bytes / weights,
        "plan": alloc.summary(),
        "predicted_loss_increase": alloc.predicted_increase,
        "int4_g128_bits_per_weight": 8 * sum(option_bytes(options[2], s) for s in shapes.values()) / weights,
        "sensitivity": {n: {k: round(v, 5) for k, v in s.items()} for n, s in sens.items()},
    }
    return model, info


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    dm = data(args)
    base, train_info = train(args, dm)
    base.eval()
    val = batches(dm, args.eval_batches, "val")
    calib_rows = batches(dm, max(1, args.calib_samples // dm.batch_size), "train")
    calib_ids = [b["input_ids"] for b in calib_rows]

    def ppl(model: torch.nn.Module) -> tuple[float, float]:
        loss = causal_lm_loss(model, val)
        return loss, math.exp(loss)

    rows: list[dict[str, Any]] = []
    start = time.perf_counter()

    def add(variant: str, model: torch.nn.Module, **extra: Any) -> None:
        loss, p = ppl(model)
        rows.append({"variant": variant, "loss": loss, "perplexity": p, **extra})
        print(f"{variant:32s} loss {loss:.4f}  ppl {p:.4f}  ({time.perf_counter() - start:.0f} s)", flush=True)

    add("bf16", as_bf16(copy.deepcopy(base)), bits=16)
    add("int8-rtn-channel", quantized(base, qconfig(bits=8, group_size=None)), bits=8)
    add("int4-rtn-g128", quantized(base, qconfig(bits=4)), bits=4)
    add("int4-gptq-g128", quantized(base, qconfig(bits=4, method="gptq"), calib_ids), bits=4)
    add("int3-rtn-g128", quantized(base, qconfig(bits=3)), bits=3)
    add("int3-gptq-g128", quantized(base, qconfig(bits=3, method="gptq"), calib_ids), bits=3)
    for group in (128, None):
        tag = "g128" if group else "channel"
        for obs in ("minmax", "mse", "percentile"):
            add(f"observer-int4-{tag}-{obs}", quantized(base, qconfig(bits=4, group_size=group, observer=obs)), bits=4)
    add("qat-int4-g128", as_bf16(run_qat(args, base, dm, qat=True)), bits=4, qat_steps=args.qat_steps)
    control = run_qat(args, base, dm, qat=False)  # same fine-tune without fake quantization
    add("bf16-finetuned-control", as_bf16(copy.deepcopy(control)), bits=16, qat_steps=args.qat_steps)
    add("finetuned-control-int4-rtn-g128", quantized(control, qconfig(bits=4)), bits=4, qat_steps=args.qat_steps)
    mp_model, mp_info = mixed(args, base, calib_rows)
    add("mixed-precision", mp_model, bits=round(mp_info["bits_per_weight"], 3))

    by = {r["variant"]: r for r in rows}
    base_ppl = by["bf16"]["perplexity"]
    for r in rows:
        r["ppl_increase_pct"] = 100 * (r["perplexity"] / base_ppl - 1)
    inc = {k: by[k]["perplexity"] - base_ppl for k in by}
    checks = {
        "gptq4_increase_over_rtn4": inc["int4-gptq-g128"] / inc["int4-rtn-g128"],
        "gptq4_at_most_half_of_rtn4": inc["int4-rtn-g128"] > 0 and inc["int4-gptq-g128"] <= 0.5 * inc["int4-rtn-g128"],
        "mse_or_percentile_beat_minmax_4bit_g128": min(
            by["observer-int4-g128-mse"]["perplexity"], by["observer-int4-g128-percentile"]["perplexity"]
        )
        < by["observer-int4-g128-minmax"]["perplexity"],
        "mse_or_percentile_beat_minmax_4bit_channel": min(
            by["observer-int4-channel-mse"]["perplexity"], by["observer-int4-channel-percentile"]["perplexity"]
        )
        < by["observer-int4-channel-minmax"]["perplexity"],
        # literal reading: QAT vs the original bf16 model and its RTN-4 (confounded: QAT also trains the model more)
        "qat_recovery_vs_bf16": 1 - inc["qat-int4-g128"] / inc["int4-rtn-g128"],
        # same training budget on both sides: the float fine-tune, and the PTQ int4 of that fine-tuned model
        "qat_recovery_vs_finetuned_control": 1
        - (by["qat-int4-g128"]["perplexity"] - by["bf16-finetuned-control"]["perplexity"])
        / (by["finetuned-control-int4-rtn-g128"]["perplexity"] - by["bf16-finetuned-control"]["perplexity"]),
        "int8_increase_pct": by["int8-rtn-channel"]["ppl_increase_pct"],
    }
    checks["qat_recovers_70pct_vs_control"] = checks["qat_recovery_vs_finetuned_control"] >= 0.7
    checks["qat_recovers_70pct_vs_bf16"] = inc["int4-rtn-g128"] > 0 and checks["qat_recovery_vs_bf16"] >= 0.7
    checks["int8_increase_at_most_1pct"] = checks["int8_increase_pct"] <= 1.0
    eval_tokens = sum(int((b["labels"] != -100).sum()) for b in val)
    record = records.make_record(
        "quant-quality",
        config={
            "preset": args.preset,
            "train_steps": args.steps,
            "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "eval_tokens": eval_tokens,
            "calib_sequences": sum(b.shape[0] for b in calib_ids),
            "qat_steps": args.qat_steps,
            "qat_lr": args.qat_lr,
            "mixed_bits_budget": args.mixed_bits,
            "tokenizer": "byte",
            "corpus": "python stdlib (TextDataModule default)",
            "params": base.num_params(),
        },
        results=rows,
        peers=[],
        benchmark="quant",
        ratio_metric=None,
        notes=[
            "perplexity is token-level (byte tokenizer: a token is a byte), exp(mean next-token cross-entropy) over "
            "the same validation tokens for every variant; activations bf16, scales fp16, head and embeddings bf16",
            "debug-1m has dim 128: g128 is one group per row except in w2 (K=384), so 4-bit error is large enough to "
            "separate the methods; larger models with g128 show much smaller gaps",
            "QAT recovery = 1 - (ppl_QAT - ppl_ref) / (ppl_PTQ4(ref) - ppl_ref). With ref = the trained bf16 model the "
            "QAT fine-tune also keeps training the (not converged) model, so the valid comparison is ref = the same "
            "fine-tune without fake quantization (bf16-finetuned-control) and PTQ4 = RTN int4 g128 of that control",
            f"training: {json.dumps(train_info)}",
            f"mixed precision: {json.dumps({k: v for k, v in mp_info.items() if k != 'sensitivity'})}",
            f"checks: {json.dumps(checks)}",
        ],
    )
    record["checks"] = checks
    record["mixed_precision"] = mp_info
    path = records.write_record(record, args.results_dir)
    print(json.dumps(checks, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
