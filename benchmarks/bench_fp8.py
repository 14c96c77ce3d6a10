"""FP8 training on one GPU (issue 54): tokens/s, MFU and peak memory of FP8 against our bf16 fast path, and the loss.

``speed``: for each shape, each variant trains in its own process (``CausalLMModule`` as shipped: fused kernels,
fused AdamW, gradient clipping 1.0; ``Trainer(precision="bf16-mixed", devices=1)``, random tokens):

- ``bf16``: our bf16 fast path (eager), the baseline every ratio divides by; ``bf16-compile``: each block compiled;
- ``tensorwise`` / ``rowwise``: ``CausalLMModule(float8=...)`` eager; ``...-compile``: each block compiled, which
  fuses torchao's absolute-maximum and cast steps into neighbouring kernels (eager FP8 pays them as separate passes).

Shapes: ``1b-2048`` (1b, sequence 2048, micro-batch 8), ``1b-4096`` (sequence 4096, micro-batch 4) and
``8b-4l-8192`` (llama3-8b layer shapes: dim 4096, FFN 14336, GQA 32:8, 4 layers, sequence 8192, micro-batch 1).
Per variant: median step time over the timed steps (``torch.cuda.synchronize`` at each step end), tokens/s, model
TFLOP/s (causal attention counted as half), MFU against 989 TFLOP/s (``mfu_bf16_peak``) and against the FP8-aware
peak the ``TrainingMonitor`` uses (``mfu``: the FP8 linears' share of the FLOPs at 1,979), peak memory. One record
per shape, ``benchmarks/results/fp8-<shape>-<device>.json``, ratios against ``bf16`` of the same run.

``loss``: the 1b preset on the default corpus (``TextDataModule``, byte tokenizer), ``--loss-steps`` steps (default
1000) of sequence ``--loss-seq`` at micro-batch ``--loss-batch``, lr 3e-4, warm-up 100: bf16 (seed 1234), bf16 (seed
4321), FP8 tensorwise and FP8 rowwise (seed 1234; their fastest variant from ``speed``: compiled). Every step's loss
is recorded (``fp8-loss-1b-<device>.json``); the notes compare 50-step means of the FP8 curves after step 200 with
the band the two bf16 seeds span. ``python benchmarks/bench_fp8.py --plot RECORD`` draws the curves beside it (PNG,
needs matplotlib).

    python benchmarks/bench_fp8.py speed                    # all shapes and variants, one GPU
    python benchmarks/bench_fp8.py speed --shapes 1b-2048 --variants bf16 rowwise-compile
    python benchmarks/bench_fp8.py loss --loss-steps 1000 --parallel 4   # the four runs side by side
    python benchmarks/bench_fp8.py speed --smoke            # CPU, emulated FP8, tiny shapes: code path only
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package
import records  # noqa: E402

BF16_PEAK = 989.4e12
# shape -> (preset, overrides, seq_len, micro-batch)
SHAPES: dict[str, tuple[str, dict[str, Any], int, int]] = {
    "1b-2048": ("1b", {}, 2048, 8),
    "1b-4096": ("1b", {}, 4096, 4),
    "8b-4l-8192": ("llama3-8b", {"n_layers": 4}, 8192, 1),
}
SMOKE_SHAPES: dict[str, tuple[str, dict[str, Any], int, int]] = {"tiny-64": ("debug-1m", {}, 64, 2)}
VARIANTS = ("bf16", "bf16-compile", "tensorwise", "tensorwise-compile", "rowwise", "rowwise-compile")
# not in the default set: ``...-compile-native`` runs RMSNorm and SwiGLU as PyTorch ops inside the compiled block
# (fused kernels "rope,fused_ce"), so that inductor can fuse FP8's absolute maximum and cast into them
EXTRA_VARIANTS = ("bf16-compile-native", "tensorwise-compile-native", "rowwise-compile-native")
LOSS_RUNS = (("bf16", 1234), ("bf16", 4321), ("tensorwise-compile", 1234), ("rowwise-compile", 1234))


def _recipe(variant: str) -> str | None:
    name = variant.split("-", 1)[0]
    return None if name == "bf16" else name


class _StepClock:
    """Lightning callback: wall time at each batch end (after a device sync) and each step's loss; with
    ``profile=(first, count)``, a ``torch.profiler`` trace of batches ``first .. first + count - 1``."""

    def __init__(self, cuda: bool, profile: tuple[int, int] | None = None) -> None:
        self.cuda, self.times, self.losses = cuda, [], []
        self.profile, self.profiler, self.summary = profile, None, None

    def callback(self) -> Any:
        import lightning as L
        import torch

        clock = self

        class Clock(L.Callback):
            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, i: int) -> None:
                if clock.profile and i == clock.profile[0]:
                    activities = [torch.profiler.ProfilerActivity.CPU]
                    if clock.cuda:
                        activities.append(torch.profiler.ProfilerActivity.CUDA)
                    clock.profiler = torch.profiler.profile(activities=activities)
                    clock.profiler.__enter__()

            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
                if clock.cuda:
                    torch.cuda.synchronize()
                clock.times.append(time.perf_counter())
                loss = outputs["loss"] if isinstance(outputs, dict) else outputs
                clock.losses.append(float(loss))
                if clock.profiler is not None and clock.profile and i == sum(clock.profile) - 1:
                    clock.profiler.__exit__(None, None, None)
                    clock.summary = profile_summary(clock.profiler, clock.profile[1], clock.cuda)
                    clock.profiler = None

        return Clock()


GEMM_OPS = {"aten::_scaled_mm": "gemm_fp8", "aten::mm": "gemm_bf16", "aten::addmm": "gemm_bf16",
            "aten::bmm": "gemm_bf16", "aten::baddbmm": "gemm_bf16"}  # fmt: skip


def profile_summary(prof: Any, steps: int, cuda: bool, top: int = 15) -> dict[str, Any]:
    """Device time per step, in ms, by category: the GEMMs by the aten op that launched them (``gemm_fp8``:
    ``_scaled_mm``; ``gemm_bf16``: ``mm``/``addmm``/``bmm``), the other kernels by name (``attention``: our flash
    attention kernels; ``inductor``: ``triton_*`` kernels torch.compile generated; ``other``), plus the ``top``
    kernels by time. On CPU (smoke), CPU time stands in for device time."""
    import torch

    def self_time(evt: Any) -> float:
        for name in ("self_device_time_total", "self_cuda_time_total") if cuda else ("self_cpu_time_total",):
            if hasattr(evt, name):
                return float(getattr(evt, name))
        return 0.0

    cats = {"gemm_fp8": 0.0, "gemm_bf16": 0.0}
    for evt in prof.key_averages():
        if evt.key in GEMM_OPS:
            cats[GEMM_OPS[evt.key]] += self_time(evt) / 1e3 / steps
    kernels: dict[str, float] = {}
    device = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    for evt in prof.events():
        # "Optimizer.step#AdamW.step" and the like are annotations spanning kernels on the GPU timeline, not kernels
        if evt.device_type == device and (not cuda or evt.name not in GEMM_OPS) and "#" not in evt.name:
            kernels[evt.name] = kernels.get(evt.name, 0.0) + evt.time_range.elapsed_us() / 1e3 / steps
    total = sum(kernels.values()) if cuda else sum(cats.values())
    rest = max(0.0, total - cats["gemm_fp8"] - cats["gemm_bf16"])
    named = {"attention": 0.0, "inductor": 0.0}
    for name, ms in kernels.items():
        if "flash" in name or "attn" in name:
            named["attention"] += ms
        elif name.startswith("triton_"):
            named["inductor"] += ms
    named = {k: min(v, rest) for k, v in named.items()}
    other = max(0.0, rest - sum(named.values()))
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
    return {"device_ms_per_step": total, **cats, **named, "other": other,
            "top_kernels": [{"name": n[:120], "ms_per_step": round(ms, 3)} for n, ms in ranked]}  # fmt: skip


def _build_module(spec: dict[str, Any]) -> Any:
    from lightning_llmopt import CausalLMModule

    recipe = _recipe(spec["variant"])
    module = CausalLMModule(
        spec["preset"],
        model_overrides=spec["overrides"] or None,
        learning_rate=3e-4,
        warmup_steps=spec.get("warmup", 5),
        float8=recipe,
        float8_emulate=bool(recipe) and spec["smoke"],
        compile="-compile" in spec["variant"],
        fused_kernels="rope,fused_ce" if spec["variant"].endswith("-native") else "auto",
    )
    module.configure_model()
    return module


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One variant in this process (see the module docstring)."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_llmopt.callbacks.monitor import fp8_flop_share, mixed_peak_flops
    from lightning_llmopt.testing.data import RandomTokens

    cuda = not spec["smoke"]
    L.seed_everything(spec["seed"], verbose=False)
    module = _build_module(spec)
    profile = (spec["steps"] - spec["profile"], spec["profile"]) if spec.get("profile") else None
    clock = _StepClock(cuda, profile)
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu", devices=1, precision="bf16-mixed" if cuda else "32-true",
        max_steps=spec["steps"], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, gradient_clip_val=1.0, callbacks=[clock.callback()], limit_val_batches=0,
    )  # fmt: skip
    if spec["mode"] == "loss":
        from lightning_llmopt.data import TextDataModule

        data: Any = TextDataModule(tokenizer="byte", seq_len=spec["seq_len"], batch_size=spec["micro_batch"])
        trainer.fit(module, datamodule=data)
    else:
        tokens = RandomTokens(module.config.vocab_size, spec["seq_len"], spec["micro_batch"] * spec["steps"])
        trainer.fit(module, DataLoader(tokens, batch_size=spec["micro_batch"]))
    # the profiled steps (the last ones) are slower: they are left out of the timing
    timed = clock.times[spec["warmup_steps"] : len(clock.times) - (spec.get("profile") or 0)]
    dt = [b - a for a, b in zip(timed, timed[1:], strict=False)]
    step_s = statistics.median(dt) if dt else float("nan")
    tokens_per_s = spec["micro_batch"] * spec["seq_len"] / step_s
    flops = module.model.flops_per_token(spec["seq_len"]) * tokens_per_s
    share = fp8_flop_share(module, spec["seq_len"])
    row: dict[str, Any] = {
        "variant": spec["variant"], "seed": spec["seed"], "median_step_ms": 1e3 * step_s,
        "tokens_per_s": tokens_per_s, "tflops": flops / 1e12, "fp8_flop_share": share, "timed_steps": len(dt),
    }  # fmt: skip
    if cuda:
        peak = mixed_peak_flops(torch.device("cuda"), torch.bfloat16, share) or BF16_PEAK / (1 - share / 2)
        row |= {"mfu_bf16_peak": flops / BF16_PEAK, "mfu": flops / peak,
                "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}  # fmt: skip
    if clock.summary is not None:
        row["profile"] = clock.summary
    if spec["mode"] == "loss":
        row["losses"] = clock.losses
    return row


def _launch(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, __file__, "--worker", json.dumps(spec), "--json-out", out.name]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"variant": spec["variant"], "seed": spec["seed"], "error": f"timeout after {timeout:.0f} s"}
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
            print("\n".join(tail), file=sys.stderr)
            return {"variant": spec["variant"], "seed": spec["seed"], "error": " | ".join(tail[-3:])}
        row = json.loads(Path(out.name).read_text())
        row["wall_s"] = wall
        return row


def _loss_notes(rows: list[dict[str, Any]], start: int = 200, window: int = 50) -> list[str]:
    """50-step means of each FP8 curve after ``start`` against the band the bf16 seeds span: the first two seeds'
    band (the issue's criterion) and, with more seeds, the band of all of them. Excursions are signed: above the band
    (higher loss) or below it."""

    def means(losses: list[float]) -> list[float]:
        return [statistics.fmean(losses[i : i + window]) for i in range(start, len(losses) - window + 1, window)]

    bf16 = [r for r in rows if r["variant"] == "bf16" and "losses" in r]
    if len(bf16) < 2:
        return ["loss: fewer than two bf16 runs finished; no band"]
    curves = [means(r["losses"]) for r in bf16]
    bands = {"2 seeds": curves[:2]} | ({f"{len(curves)} seeds": curves} if len(curves) > 2 else {})
    seeds = ", ".join(str(r["seed"]) for r in bf16)
    notes = [f"loss bands: {window}-step means from step {start} of bf16 seeds {seeds}; width of the 2-seed band at "
             f"most {max(max(c) - min(c) for c in zip(*curves[:2], strict=False)):.4f}"]  # fmt: skip
    if len(curves) > 2:
        notes[0] += f", of the {len(curves)}-seed band {max(max(c) - min(c) for c in zip(*curves, strict=False)):.4f}"
    for row in rows:
        if row["variant"] == "bf16" or "losses" not in row:
            continue
        m = means(row["losses"])
        for label, band in bands.items():
            lo = [min(c) for c in zip(*band, strict=False)]
            hi = [max(c) for c in zip(*band, strict=False)]
            above = max(max(v - h, 0.0) for v, h in zip(m, hi, strict=False))
            below = max(max(lo_ - v, 0.0) for v, lo_ in zip(m, lo, strict=False))
            inside = sum(lo_ <= v <= h for v, lo_, h in zip(m, lo, hi, strict=False))
            notes.append(
                f"loss {row['variant']} vs the {label} band: {inside}/{len(m)} windows inside, largest excursion "
                f"above {above:.4f} (higher loss), below {below:.4f}; final mean {m[-1]:.4f} vs bf16 "
                f"{min(c[-1] for c in band):.4f}..{max(c[-1] for c in band):.4f}"
            )
    return notes


def _speed_record(shape: str, rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    preset, overrides, seq, mb = (SMOKE_SHAPES if args.smoke else SHAPES)[shape]
    base = next((r for r in rows if r["variant"] == "bf16" and "error" not in r), None)
    ours = [r for r in rows if r is not base]
    notes = [f"goal (issue 54): FP8 >= {1.4 if shape.startswith('8b') else 1.3}x our bf16 fast path (eager)"]
    if base is not None:
        best = max((r for r in ours if "error" not in r and r["variant"] != "bf16-compile"),
                   key=lambda r: r["tokens_per_s"], default=None)  # fmt: skip
        if best is not None:
            notes.append(f"best FP8: {best['variant']} {best['tokens_per_s'] / base['tokens_per_s']:.3f}x bf16")
    name = f"fp8-{shape}{'-profile' if args.profile else ''}"
    return records.make_record(
        name, {"preset": preset, "overrides": overrides, "seq_len": seq, "micro_batch": mb,
                         "timed_steps": args.steps, "warmup_steps": args.warmup, "precision": "bf16-mixed"},
        ours, [base] if base else [], benchmark="fp8", ratio_metric="tokens_per_s", notes=notes,
    )  # fmt: skip


def _speed(args: argparse.Namespace, shapes: dict[str, tuple[str, dict[str, Any], int, int]]) -> int:
    """Each shape's variants in turn; the shape's record is written again after every variant, so a run cut short
    keeps what it measured."""
    failures = 0
    for shape in args.shapes or list(shapes):
        preset, overrides, seq, mb = shapes[shape]
        rows: list[dict[str, Any]] = []
        for variant in args.variants:
            spec = {"mode": "speed", "variant": variant, "preset": preset, "overrides": overrides, "seq_len": seq,
                    "micro_batch": mb, "steps": args.warmup + args.steps + args.profile, "warmup_steps": args.warmup,
                    "profile": args.profile, "seed": 1234, "smoke": args.smoke}  # fmt: skip
            row = _launch(spec, args.timeout)
            failures += "error" in row
            print(json.dumps(row), flush=True)
            rows.append(row)
            path = records.write_record(_speed_record(shape, rows, args), args.results_dir)
        print(path)
    return failures


def _loss(args: argparse.Namespace) -> int:
    seq, mb = (32, 2) if args.smoke else (args.loss_seq, args.loss_batch)
    specs = []
    runs = [(v, int(seed)) for v, seed in (r.split(":") for r in args.loss_runs)] if args.loss_runs else LOSS_RUNS
    for variant, seed in runs:
        variant = variant.removesuffix("-compile") if args.smoke else variant
        specs.append({"mode": "loss", "variant": variant, "preset": "debug-1m" if args.smoke else "1b",
                      "overrides": {}, "seq_len": seq, "micro_batch": mb, "steps": args.loss_steps,
                      "warmup_steps": 10, "warmup": 100, "seed": seed, "smoke": args.smoke})  # fmt: skip
    # side by side on one GPU (--parallel): the curves do not depend on it, only the wall time does
    with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        rows = list(pool.map(lambda spec: _launch(spec, args.timeout), specs))
    for row in rows:
        print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    if args.merge:  # runs of an earlier record of the same configuration first (more bf16 seeds for the band)
        rows = [*json.loads(args.merge.read_text())["results"], *rows]
    rows.sort(key=lambda r: r["variant"] != "bf16")  # bf16 seeds first, in their order
    record = records.make_record(
        "fp8-loss-1b", {"preset": "1b", "seq_len": seq, "micro_batch": mb, "steps": args.loss_steps,
                        "data": "TextDataModule default corpus, byte tokenizer", "lr": 3e-4, "warmup": 100},
        rows, [], benchmark="fp8", ratio_metric=None,
        notes=_loss_notes(rows, start=min(200, args.loss_steps // 2), window=min(50, max(1, args.loss_steps // 10))),
    )  # fmt: skip
    print(records.write_record(record, args.results_dir))
    return sum("error" in r for r in rows)


def linear_shapes(preset: str, overrides: dict[str, Any]) -> dict[tuple[int, int], int]:
    """(in, out) -> count of the linear layers :func:`~lightning_llmopt.parallel.float8.float8_filter` converts in
    this model (built on the meta device)."""
    import torch

    from lightning_llmopt import Llama, LlamaConfig
    from lightning_llmopt.parallel.float8 import float8_filter

    with torch.device("meta"):
        model = Llama(LlamaConfig.from_preset(preset, **overrides))
    convert = float8_filter()
    shapes: dict[tuple[int, int], int] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and convert(module, name):
            key = (module.in_features, module.out_features)
            shapes[key] = shapes.get(key, 0) + 1
    return shapes


def _time_linear(k_in: int, k_out: int, tokens: int, smoke: bool) -> list[dict[str, Any]]:
    """One linear layer's three training GEMMs, bf16 (``torch.mm``) and FP8 (``torch._scaled_mm``, tensorwise
    scales, e4m3 operands, bf16 out, the casts left out): forward (tokens x in) @ (in x out), input gradient
    (tokens x out) @ (out x in), weight gradient (out x tokens) @ (tokens x in)."""
    import torch

    dev = "cpu" if smoke else "cuda"
    one = torch.ones((), device=dev)
    rows = []
    for gemm, (m, k, n) in {"fwd": (tokens, k_in, k_out), "dgrad": (tokens, k_out, k_in),
                            "wgrad": (k_out, tokens, k_in)}.items():  # fmt: skip
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, k, device=dev, dtype=torch.bfloat16).t()  # column-major, as _scaled_mm takes it
        t_bf16 = records.timeit_median(lambda a=a, b=b: torch.mm(a, b), warmup=5, repeats=20)
        if smoke:  # CPU: no FP8 GEMM; the code path only
            t_fp8 = t_bf16
        else:
            a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()
            t_fp8 = records.timeit_median(
                lambda a8=a8, b8=b8: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16),
                warmup=5, repeats=20)  # fmt: skip
        rows.append({"in": k_in, "out": k_out, "gemm": gemm, "m": m, "k": k, "n": n, "bf16_ms": t_bf16,
                     "fp8_ms": t_fp8, "speedup": t_bf16 / t_fp8, "bf16_tflops": 2 * m * k * n / t_bf16 / 1e9,
                     "fp8_tflops": 2 * m * k * n / t_fp8 / 1e9})  # fmt: skip
    return rows


def gemm_ceiling(preset: str, overrides: dict[str, Any], tokens: int, smoke: bool) -> dict[str, Any]:
    """The converted linears' GEMMs of one training step alone (:func:`_time_linear`, summed over the layers), and
    the LM head's (kept in bf16 by :func:`~lightning_llmopt.parallel.float8.float8_filter`) the same way. Their
    ratio is the most FP8 linears can speed up those GEMMs; the step's other work does not change."""
    from lightning_llmopt import LlamaConfig

    rows, bf16_ms, fp8_ms = [], 0.0, 0.0
    for (k_in, k_out), count in linear_shapes(preset, overrides).items():
        for row in _time_linear(k_in, k_out, tokens, smoke):
            rows.append({**row, "layers": count})
            bf16_ms += count * row["bf16_ms"]
            fp8_ms += count * row["fp8_ms"]
    config = LlamaConfig.from_preset(preset, **overrides)
    head = [{**row, "layers": 1, "head": True} for row in _time_linear(config.dim, config.vocab_size, tokens, smoke)]
    return {"gemms": rows + head, "bf16_ms_per_step": bf16_ms, "fp8_ms_per_step": fp8_ms, "speedup": bf16_ms / fp8_ms,
            "head_bf16_ms_per_step": sum(r["bf16_ms"] for r in head),
            "head_fp8_ms_per_step": sum(r["fp8_ms"] for r in head)}  # fmt: skip


def _gemm(args: argparse.Namespace, shapes: dict[str, tuple[str, dict[str, Any], int, int]]) -> int:
    """``gemm`` mode: :func:`gemm_ceiling` per shape, and the bound it puts on FP8's speed-up of the whole step: the
    bf16 step (the shape's ``speed`` record in the results folder, when there) with the converted GEMMs' bf16 time
    replaced by their FP8 time."""
    for shape in args.shapes or list(shapes):
        preset, overrides, seq, mb = shapes[shape]
        ceiling = gemm_ceiling(preset, overrides, seq * mb, args.smoke)
        notes = [
            f"converted linears' GEMMs alone: bf16 {ceiling['bf16_ms_per_step']:.1f} ms, FP8 "
            f"{ceiling['fp8_ms_per_step']:.1f} ms per step ({ceiling['speedup']:.2f}x), casts left out"
        ]
        slug = records.environment()["device_slug"]
        folders = dict.fromkeys([Path(args.results_dir or records.RESULTS_DIR), records.RESULTS_DIR])
        found = [d / f"fp8-{shape}{kind}-{slug}.json" for kind in ("-profile", "") for d in folders]
        speed = next((f for f in found if f.exists()), Path("/nonexistent"))
        if speed.exists():
            base = next((r for r in json.loads(speed.read_text())["peers"] if r["variant"] == "bf16"), None)
            if base is not None:
                step = base["median_step_ms"]
                bound = step / (step - ceiling["bf16_ms_per_step"] + ceiling["fp8_ms_per_step"])
                head = ceiling["head_bf16_ms_per_step"] - ceiling["head_fp8_ms_per_step"]
                bound_head = step / (step - ceiling["bf16_ms_per_step"] + ceiling["fp8_ms_per_step"] - head)
                notes.append(f"bound: the bf16 step ({step:.1f} ms, {speed.name}) with those GEMMs in FP8 and "
                             f"nothing else changed runs {bound:.3f}x faster; the issue's goal is "
                             f"{1.4 if shape.startswith('8b') else 1.3}x; with the LM head's GEMMs in FP8 too "
                             f"({ceiling['head_bf16_ms_per_step']:.1f} -> {ceiling['head_fp8_ms_per_step']:.1f} ms), "
                             f"{bound_head:.3f}x")  # fmt: skip
        rows = []
        for r in ceiling["gemms"]:
            name = f"{'head-' if r.get('head') else ''}{r['in']}x{r['out']}-{r['gemm']}"
            rows.append({"variant": name, **{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}})
        total = {"variant": "all-converted", **{k: v for k, v in ceiling.items() if k != "gemms"}}
        record = records.make_record(
            f"fp8-gemm-{shape}", {"preset": preset, "overrides": overrides, "tokens": seq * mb, "scales": "tensorwise"},
            [total, *rows], [], benchmark="fp8", ratio_metric=None, notes=notes,
        )  # fmt: skip
        print("\n".join(notes))
        print(records.write_record(record, args.results_dir))
    return 0


def plot(path: Path) -> Path:
    """The loss curves of a ``fp8-loss`` record as a PNG beside it (50-step running means)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    record = json.loads(path.read_text())
    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(12, 4.5))
    for row in record["results"]:
        losses = row.get("losses") or []
        w = 50
        smooth = [statistics.fmean(losses[max(0, i - w + 1) : i + 1]) for i in range(len(losses))]
        label = f"{row['variant']} (seed {row['seed']})"
        style = {"lw": 1.2, "ls": "-" if row["variant"] == "bf16" else "--"}
        ax.plot(range(1, len(smooth) + 1), smooth, label=label, **style)
        start = min(200, len(smooth) // 2)  # the part the bands compare, zoomed
        zoom.plot(range(start + 1, len(smooth) + 1), smooth[start:], label=label, **style)
    ax.set(xlabel="step", ylabel="train loss (50-step mean)", title=f"{record['name']}: FP8 vs bf16")
    zoom.set(xlabel="step", ylabel="train loss (50-step mean)", title="from step 200")
    zoom.legend()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=120, bbox_inches="tight")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", choices=("speed", "loss", "gemm"), default="speed")
    parser.add_argument("--shapes", nargs="*", default=None, help=f"default: all of {', '.join(SHAPES)}")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=8, help="untimed steps (compile included)")
    parser.add_argument("--profile", type=int, default=0, help="speed: profile this many steps after the timed ones")
    parser.add_argument("--loss-steps", type=int, default=1000)
    parser.add_argument("--loss-seq", type=int, default=1024)
    parser.add_argument("--loss-batch", type=int, default=4)
    parser.add_argument("--loss-runs", nargs="*", default=None, help="loss: VARIANT:SEED runs instead of the four")
    parser.add_argument("--merge", type=Path, default=None, help="loss: an earlier loss record whose runs join these")
    parser.add_argument("--parallel", type=int, default=1, help="loss runs side by side on the one GPU")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per variant process")
    parser.add_argument("--results-dir", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="CPU, emulated FP8, tiny model: the code path only")
    parser.add_argument("--plot", type=Path, default=None, help="draw a loss record's curves (PNG) and exit")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        Path(args.json_out).write_text(json.dumps(run_worker(json.loads(args.worker))))
        return 0
    if args.plot:
        print(plot(args.plot))
        return 0
    if args.smoke:
        args.results_dir = args.results_dir or Path(tempfile.mkdtemp(prefix="bench_fp8_"))
        args.steps, args.warmup, args.loss_steps = min(args.steps, 3), min(args.warmup, 1), min(args.loss_steps, 6)
        args.variants = [v for v in args.variants if "-compile" not in v]
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.mode == "gemm":
        return _gemm(args, shapes)
    return _speed(args, shapes) if args.mode == "speed" else _loss(args)


if __name__ == "__main__":
    raise SystemExit(main())
