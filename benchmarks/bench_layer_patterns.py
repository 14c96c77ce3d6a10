"""Layer patterns and cross-layer KV sharing in the engine: decode tokens/s and KV-pool use at long context.

Variants of one preset (random weights, bf16 on GPU), each served by ``LLMEngine`` with ``batch`` sequences whose
prompts fill ``context`` tokens, then ``steps`` greedy decode steps timed (median over ``repeats`` runs):

- ``all-global`` (the peer: the preset as it is);
- ``local5-global1`` (Gemma-3-like: five local layers of window ``window``, then one global, repeated);
- ``cla2`` (CLA-2: layers 1, 3, ... reuse the K/V of layers 0, 2, ...; half the cache, fewer parameters);
- ``cla2-2x-kv`` against ``all-global``: CLA-2 with twice the KV heads, so parameters and cache bytes equal the
  GQA preset's (CLA vs GQA at equal parameters).

Recorded per variant: ``decode_tok_s``, the pool's bytes and the blocks the running sequences hold after the
prefill (``pool_used_gib``: blocks in use x bytes per block of their group), and the parameter count. Ratios are
against ``all-global`` measured in the same process. Every variant runs with CUDA graphs and the fused decode path
(KV groups included); the record says whether graphs were captured.

Usage: ``python benchmarks/bench_layer_patterns.py`` (GPU; records in benchmarks/results/layer-patterns-*.json);
``--smoke`` checks the code path on CPU with the ``tiny`` preset (records in a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package
import records  # noqa: E402

from lightning_llmopt.inference import LLMEngine, SamplingParams  # noqa: E402
from lightning_llmopt.models import Llama, LlamaConfig  # noqa: E402
from lightning_llmopt.models.layer_pattern import cla_kv_sources, pattern_layers  # noqa: E402


def variants(preset: str, window: int) -> dict[str, dict[str, Any]]:
    base = LlamaConfig.from_preset(preset)
    n = base.n_layers
    return {
        "all-global": {},
        "local5-global1": dict(sliding_window=window, layer_types=pattern_layers(["local"] * 5 + ["global"], n)),
        "cla2": dict(kv_sources=cla_kv_sources(n, 2)),
        "cla2-2x-kv": dict(kv_sources=cla_kv_sources(n, 2), n_kv_heads=min(base.n_heads, 2 * (base.n_kv_heads or 1))),
    }


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _pool_used(engine: LLMEngine) -> int:
    """Bytes of the blocks handed out (running sequences and the prefix cache), over every KV group."""
    pools = getattr(engine.pool, "pools", [engine.pool])
    blocks = engine.blocks
    used = [blocks.allocator.capacity - blocks.allocator.num_free]
    used += [a.capacity - a.num_free for a in getattr(blocks, "locals", [])]
    return sum(u * p.nbytes // p.num_blocks for u, p in zip(used, pools, strict=True))


def run_variant(cfg: LlamaConfig, batch: int, context: int, steps: int, repeats: int, dev: str) -> dict[str, Any]:
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device=dev)
    model.init_weights()
    model = model.to(dtype).eval()
    bs = 16
    num_blocks = batch * (-(-(context + steps + 1) // bs)) + 8
    engine = LLMEngine(
        model,
        block_size=bs,
        num_blocks=num_blocks,
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, batch),
        enable_prefix_caching=False,
    )
    g = torch.Generator().manual_seed(1)
    times, used = [], 0
    for _ in range(repeats):
        prompts = [torch.randint(0, cfg.vocab_size, (context,), generator=g).tolist() for _ in range(batch)]
        for p in prompts:
            engine.add_request(p, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
        while any(s.num_output == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()  # prefill (and the first token)
        used = _pool_used(engine)
        _sync()
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        _sync()
        times.append(time.perf_counter() - t0)
    return {
        "decode_tok_s": batch * steps / statistics.median(times),
        "pool_gib": engine.pool.nbytes / 2**30,
        "pool_used_gib": used / 2**30,
        "params": model.num_params(),
        "cuda_graphs": engine.graphs is not None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny preset, records in a temp dir")
    parser.add_argument("--results-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset, args.context, args.window, args.batch, args.steps, args.repeats = "tiny", 48, 16, 2, 4, 1
    elif not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (use --smoke for a CPU check of the code path)")
    dev = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    out: dict[str, dict[str, Any]] = {}
    for name, overrides in variants(args.preset, args.window).items():
        cfg = LlamaConfig.from_preset(args.preset, max_seq_len=max(args.context + args.steps + 8, 256), **overrides)
        try:
            out[name] = {"variant": name, **run_variant(cfg, args.batch, args.context, args.steps, args.repeats, dev)}
        except Exception as exc:  # a variant that fails is reported with its error
            out[name] = {"variant": name, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out[name]), flush=True)
    config = {k: getattr(args, k) for k in ("preset", "context", "window", "batch", "steps", "repeats")}
    config["dtype"] = "bfloat16" if dev == "cuda" else "float32"
    rec = records.make_record(
        "layer-patterns-decode",
        config,
        [v for k, v in out.items() if k != "all-global"],
        [out["all-global"]],
        benchmark="layer-patterns",
        ratio_metric="decode_tok_s",
        notes=["pool_used_gib: blocks handed out after the prefill x bytes per block of their KV group"],
    )
    results_dir = args.results_dir or (Path(tempfile.mkdtemp(prefix="llmopt-bench-")) if args.smoke else None)
    print(f"wrote {records.write_record(rec, results_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
