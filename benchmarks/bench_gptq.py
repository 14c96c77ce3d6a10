"""GPTQ driver at scale: the block-by-block driver against the prefix driver it replaced, on one GPU.

The prefix driver collects each block's Hessians from full forward passes stopped after that block, so a model of
``L`` blocks costs ``L (L + 1) / 2`` block forwards per calibration batch, and the whole model sits on one device. The
block-by-block driver (``quantization/gptq_blocks.py``) captures the first block's inputs once and feeds each
block's quantized outputs to the next: ``2 L`` block forwards, and with ``device=`` the other blocks stay on the CPU.

Variants (random weights of the preset's shape, fp16, int4 g128 symmetric GPTQ, head left in fp16; random token
calibration, ``--calib-seqs`` sequences of ``--seq-len``):

- ``blockwise-gpu``: the whole model on the GPU, all ``--layers`` blocks;
- ``blockwise-offload``: the model on the CPU, each block moved to the GPU for its turn (``llmopt quantize --offload``);
- ``prefix`` and ``blockwise`` at each reduced depth of ``--reduced`` (the model cut to that many blocks, on the GPU):
  the prefix driver's time at full depth is extrapolated from two depths with
  ``t(L) = a L + b L (L + 1) / 2`` (per-block GPTQ work plus prefix forwards), the model it was built on.

Peak GPU memory is ``torch.cuda.max_memory_allocated`` over each variant. Writes
``benchmarks/results/gptq-<preset>-<device>.json``.

    python benchmarks/bench_gptq.py                       # llama2-7b shape, ~5 min on an H100
    python benchmarks/bench_gptq.py --preset debug-1m --reduced 1,2 --calib-seqs 4 --seq-len 16 --batch 2 --smoke
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package
import records  # noqa: E402

from lightning_llmopt.models import Llama, LlamaConfig  # noqa: E402
from lightning_llmopt.quantization import QuantConfig, quantize_model  # noqa: E402
from lightning_llmopt.quantization.apply import QuantizationReport, _quantize_gptq, quantizable_linears  # noqa: E402


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama2-7b")
    p.add_argument("--layers", type=int, default=None, help="blocks of the full model (default: the preset's)")
    p.add_argument("--reduced", default="2,4", help="depths at which both drivers run, comma-separated")
    p.add_argument("--calib-seqs", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8, help="calibration sequences per forward")
    p.add_argument("--full", default="gpu,offload", help="full-depth variants to run: gpu, offload, both or none")
    p.add_argument("--drivers", default="blockwise,prefix", help="drivers run at the reduced depths")
    p.add_argument("--name", default=None, help="record name (default gptq-<preset>)")
    p.add_argument("--smoke", action="store_true", help="CPU-friendly run; writes to a temporary folder")
    return p.parse_args(argv)


def build(preset: str, layers: int, device: str) -> Llama:
    config = LlamaConfig.from_preset(preset, n_layers=layers)
    with torch.device("meta"):
        model = Llama(config)
    model.to_empty(device=device)
    model.init_weights()
    return model.to(torch.float16 if device != "cpu" else torch.float32).eval()


def measure(fn: Any, device: str) -> tuple[float, float, Any]:
    """(seconds, peak GPU GiB, result) of ``fn()``."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
    return time.perf_counter() - start, peak, out


def main(argv: list[str] | None = None) -> Path:
    args = parse(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    full = args.layers or LlamaConfig.from_preset(args.preset).n_layers
    reduced = [int(x) for x in args.reduced.split(",")]
    qcfg = QuantConfig(bits=4, group_size=128, symmetric=True, method="gptq", scale_dtype=torch.float16)
    g = torch.Generator().manual_seed(0)
    vocab = LlamaConfig.from_preset(args.preset).vocab_size
    batches = list(torch.randint(0, vocab, (args.calib_seqs, args.seq_len), generator=g).split(args.batch))
    results: list[dict[str, Any]] = []
    peers: list[dict[str, Any]] = []

    def blockwise(model: Llama, offload: bool) -> QuantizationReport:
        return quantize_model(model, qcfg, batches, device=device if offload else None)

    def prefix(model: Llama) -> QuantizationReport:
        report = QuantizationReport()
        model.eval()
        _quantize_gptq(model, quantizable_linears(model, qcfg), qcfg, batches, _forward, report, lambda name: None)
        return report

    warm = build(args.preset, 1, device)  # CUDA context, kernels, cuSOLVER handles: not part of any variant's time
    quantize_model(warm, qcfg, batches[:1])
    del warm
    for depth in reduced:
        drivers = {"blockwise": lambda m: blockwise(m, False), "prefix": prefix}
        for variant, run in ((d, drivers[d]) for d in args.drivers.split(",")):
            model = build(args.preset, depth, device)
            seconds, peak, _ = measure(lambda m=model, run=run: run(m), device)
            row = {"variant": f"{variant}-L{depth}", "layers": depth, "time_s": seconds, "peak_gpu_gib": peak}
            (results if variant == "blockwise" else peers).append(row)
            print(row, flush=True)
            del model
            torch.cuda.empty_cache() if device == "cuda" else None
    if len(peers) >= 2:  # prefix driver at full depth, t(L) = a L + b L (L + 1) / 2 through the two deepest runs
        (l1, t1), (l2, t2) = [(r["layers"], r["time_s"]) for r in peers[-2:]]
        rows = torch.tensor([[l1, l1 * (l1 + 1) / 2], [l2, l2 * (l2 + 1) / 2]], dtype=torch.float64)
        a, b = torch.linalg.solve(rows, torch.tensor([t1, t2], dtype=torch.float64)).tolist()
        peers.append({"variant": "prefix-full", "layers": full, "time_s": a * full + b * full * (full + 1) / 2,
                      "extrapolated": True, "per_block_s": a, "per_block_forward_s": b})

    config = {"preset": args.preset, "layers": full, "reduced": reduced, "calib_seqs": args.calib_seqs,
              "seq_len": args.seq_len, "batch": args.batch, "bits": 4, "group_size": 128, "dtype": "float16"}
    path = _write(args, config, results, peers)  # after every full-depth variant too: a time limit loses nothing
    for variant in [v for v in args.full.split(",") if v in ("gpu", "offload")]:
        offload = variant == "offload"
        model = build(args.preset, full, device)
        if offload:
            model = model.to("cpu")
            torch.cuda.empty_cache() if device == "cuda" else None
        config["fp16_weights_gib"] = sum(p.numel() for p in model.parameters()) * 2 / 2**30
        seconds, peak, report = measure(lambda m=model, o=offload: blockwise(m, o), device)
        results.append({"variant": f"blockwise-{'offload-' if offload else ''}full", "layers": full, "time_s": seconds,
                        "peak_gpu_gib": peak, "layers_quantized": len(report.layers)})
        print(results[-1], flush=True)
        del model
        torch.cuda.empty_cache() if device == "cuda" else None
        path = _write(args, config, results, peers)
    return path


def _write(args: argparse.Namespace, config: dict[str, Any], results: list[dict], peers: list[dict]) -> Path:
    record = records.make_record(
        args.name or f"gptq-{args.preset}",
        config,
        results,
        peers,
        benchmark="gptq",
        ratio_metric="time_s",
        notes=["prefix-full is extrapolated from the two deepest prefix runs with t(L) = a L + b L (L+1)/2",
               "random weights and random calibration tokens: timing and memory only, not quality"],
    )
    path = records.write_record(record, Path(records.RESULTS_DIR) if not args.smoke else Path("/tmp/bench-smoke"))
    print(f"wrote {path}", flush=True)
    return path


def _forward(model: torch.nn.Module, batch: Any) -> Any:
    return model(batch.to(next(model.parameters()).device))


if __name__ == "__main__":
    main()
