"""Where a batch-32 speculative engine spends its steps (issue 9: adaptive speculation >= 0.95x plain decoding).

    python benchmarks/profile_spec_batch.py            # GPU: the bench_speculative model shapes, random weights
    python benchmarks/profile_spec_batch.py --smoke    # CPU: tiny models

Random weights: acceptance is near zero, which is what the adaptive controller's k = 0 path (and its probes) is
about. Per variant (plain, adaptive draft, fixed-k draft, adaptive prompt lookup): total time, steps, and the step
times split into steps that verified drafts and steps that did not, with the median of each; then one variant
(``--profile``) once more under torch.profiler: top operators by total CPU time, and with ``$OUT`` set its
timeline (``spec-<variant>.json``). Prints only; no record.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from lightning_llmopt.inference import LLMEngine, SamplingParams, SpeculativeConfig, spec_decode
from lightning_llmopt.models import Llama, LlamaConfig


def run(engine: LLMEngine, prompts: list[list[int]], n: int) -> tuple[float, list[tuple[float, int]]]:
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    steps, t_start = [], time.perf_counter()
    spec_rows = [0]
    orig = spec_decode.SpeculativeDecoder.extend

    def extend(self, sched):  # type: ignore[no-untyped-def]
        items = orig(self, sched)
        spec_rows[0] = len(items)
        return items

    spec_decode.SpeculativeDecoder.extend = extend  # type: ignore[method-assign]
    try:
        while engine.has_unfinished():
            spec_rows[0] = 0
            t0 = time.perf_counter()
            engine.step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            steps.append((time.perf_counter() - t0, spec_rows[0]))
    finally:
        spec_decode.SpeculativeDecoder.extend = orig  # type: ignore[method-assign]
    return time.perf_counter() - t_start, steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--profile", default="draft-fixed", help="variant to run once more under torch.profiler")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    base = dict(vocab_size=320, max_seq_len=1024, multiple_of=128, tie_embeddings=True)
    if args.smoke:
        tcfg, dcfg = (
            dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2),
            dict(dim=32, n_layers=1, n_heads=2, n_kv_heads=1),
        )
        args.batch, args.max_tokens = 4, 24
    else:
        tcfg = dict(dim=1024, n_layers=16, n_heads=16, n_kv_heads=4)
        dcfg = dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=2)
    torch.manual_seed(0)
    target = Llama(LlamaConfig(**tcfg, **base)).to(device, dtype).eval()
    draft = Llama(LlamaConfig(**dcfg, **base)).to(device, dtype).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 320, (64,), generator=g).tolist() for _ in range(args.batch)]
    variants = {
        "plain": None,
        "draft-adaptive": SpeculativeConfig("draft", draft_model=draft, num_tokens=args.k),
        "draft-fixed": SpeculativeConfig("draft", draft_model=draft, num_tokens=args.k, adaptive=False),
        "prompt_lookup-adaptive": SpeculativeConfig("prompt_lookup", num_tokens=args.k),
    }
    base_s = None
    for name, spec in variants.items():
        engine = LLMEngine(target, speculative=spec, max_num_seqs=args.batch, block_size=16)
        run(engine, prompts, args.max_tokens)  # warm-up: graphs, autotuning, the cost model
        total, steps = run(engine, prompts, args.max_tokens)
        base_s = base_s or total
        spec_t = [t for t, r in steps if r]
        plain_t = [t for t, r in steps if not r]
        med = lambda xs: statistics.median(xs) * 1e3 if xs else float("nan")  # noqa: E731
        print(
            f"{name:>24}: {total * 1e3:8.1f} ms ({base_s / total:.2f}x plain), {len(steps)} steps; "
            f"{len(plain_t)} without drafts (median {med(plain_t):.2f} ms, sum {sum(plain_t) * 1e3:.1f}), "
            f"{len(spec_t)} with (median {med(spec_t):.2f} ms, sum {sum(spec_t) * 1e3:.1f}, rows "
            f"{sorted({r for _, r in steps if r})})",
            flush=True,
        )
        if engine.spec is not None:
            print("   controller:", engine.spec.controller.summary())
        if name == args.profile:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=acts, with_stack=False, record_shapes=True) as prof:
                run(engine, prompts, args.max_tokens)
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
            out = os.environ.get("OUT")
            if out:
                prof.export_chrome_trace(os.path.join(out, f"spec-{name}.json"))


if __name__ == "__main__":
    main()
