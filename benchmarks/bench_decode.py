"""Inference benchmarks (issue 8): paged decode attention, batch-1 decode against the roofline, serving throughput.

Families (run each in its own process; ``benchmarks/run_decode_gpu.sh`` does):

- ``kernel``: our Triton paged decode attention (bf16, blocks of 16 scattered over the pool) at 256 MB to 1 GB of KV
  per call, as achieved bandwidth (KV + q + out bytes / time) against the copy bandwidth measured in the same
  process, and beside SDPA (default choice, FLASH and cuDNN backends) on the same keys in a contiguous cache;
- ``decode``: batch-1 greedy decode of a randomly initialised ``llama2-7b``-shaped model in bf16: our engine (CUDA
  graphs, and without) against the roofline ``copy bandwidth / model bytes``, beside transformers' ``generate``
  with a static cache (eager; and compiled with ``--hf-compile``). Decode tokens/s is ``(N2 - N1) / (t2 - t1)`` from
  runs generating N1 and N2 tokens after the same prompt, so the prefill cancels out;
- ``serve``: many mixed-length requests, at most 64 running at once: our engine with continuous batching against
  static batching (the same engine admitting a new batch of 64 only when the last one finished, and transformers'
  ``generate`` on padded batches of 64). Throughput counts only requested tokens.

Usage: ``python benchmarks/bench_decode.py --family kernel`` (records in benchmarks/results/decode-*.json);
``--smoke`` checks the code paths on CPU with tiny sizes (records in a temporary folder).
"""

# ruff: noqa: B023 - closures built in loops are timed and dropped within their own iteration
from __future__ import annotations

import argparse
import json
import math
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package
import records  # noqa: E402
from bench_ceilings import copy_bandwidth  # noqa: E402

from lightning_llmopt.inference import LLMEngine, SamplingParams  # noqa: E402
from lightning_llmopt.kernels.paged_attention import paged_attention  # noqa: E402
from lightning_llmopt.models import LlamaConfig  # noqa: E402
from lightning_llmopt.models.hf import config_to_hf, from_hf  # noqa: E402


def _free() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _wall(fn: Any) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def _ceilings(smoke: bool) -> dict[str, float]:
    dev = "cpu" if smoke else "cuda"
    return {"copy_tb_per_s": copy_bandwidth((16 if smoke else 4096) * 2**20, dev)["tb_per_s"]}


# --------------------------------------------------------------------------- kernel


def _paged_case(B: int, ctx: int, H: int, H_kv: int, D: int, dev: str, dtype: torch.dtype, page: int = 16):
    g = torch.Generator(device=dev).manual_seed(0)
    per = math.ceil(ctx / page)
    num_blocks = B * per + 1
    k_cache = torch.randn(num_blocks, H_kv, page, D, device=dev, dtype=dtype, generator=g)
    v_cache = torch.randn(num_blocks, H_kv, page, D, device=dev, dtype=dtype, generator=g)
    perm = torch.randperm(num_blocks - 1, device=dev, generator=g) + 1  # fragmented: every row jumps around
    tables = perm[: B * per].view(B, per).to(torch.int32)
    ctx_lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(B, H, D, device=dev, dtype=dtype, generator=g)
    return q, k_cache, v_cache, tables, ctx_lens


def _contiguous(k_cache: torch.Tensor, tables: torch.Tensor, ctx: int) -> torch.Tensor:
    B = tables.shape[0]
    pages = k_cache[tables.long()]  # (B, n, H_kv, page, D)
    return pages.permute(0, 2, 1, 3, 4).reshape(B, k_cache.shape[1], -1, k_cache.shape[3])[:, :, :ctx].contiguous()


GRAPH_CALLS = 10  # paged-attention calls per captured graph when timing replays


def family_kernel(smoke: bool) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    F = torch.nn.functional
    dev, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    ceil = _ceilings(smoke)
    shapes = (
        [(2, 64, 4, 2, 64)]
        if smoke
        else [
            # (B, ctx, H, H_kv, D): llama2-7b heads (MHA) and llama3-8b heads (GQA 4), 256 MB .. 1 GB of KV per call
            (1, 16384, 32, 32, 128),
            (4, 4096, 32, 32, 128),
            (16, 1024, 32, 32, 128),
            (32, 2048, 32, 32, 128),
            (4, 16384, 32, 8, 128),
            (16, 4096, 32, 8, 128),
            (64, 1024, 32, 8, 128),
        ]
    )
    results, peers, rows_cfg = [], [], []
    for B, ctx, H, H_kv, D in shapes:
        q, kc, vc, tables, ctx_lens = _paged_case(B, ctx, H, H_kv, D, dev, dtype)
        kv_bytes = 2 * B * ctx * H_kv * D * kc.element_size()
        moved = kv_bytes + 2 * q.numel() * q.element_size() + tables.numel() * 4
        tag = f"B{B}-ctx{ctx}-H{H}-Hkv{H_kv}"
        ours = paged_attention(q, kc, vc, tables, ctx_lens, max_context=ctx)
        ms = records.timeit_median(lambda: paged_attention(q, kc, vc, tables, ctx_lens, max_context=ctx), 5, 30)
        row = {
            "variant": f"ours-{tag}",
            "shape": tag,
            "kv_mb": kv_bytes / 2**20,
            "median_ms": ms,
            "tb_per_s": moved / ms / 1e9,
            "vs_copy": moved / ms / 1e9 / ceil["copy_tb_per_s"],
        }
        if not smoke:  # the engine replays the kernel inside CUDA graphs: GPU time without the host's share
            gms = records.graph_ms(
                [lambda: paged_attention(q, kc, vc, tables, ctx_lens, max_context=ctx)] * GRAPH_CALLS
            )
            row.update(
                graph_ms=gms, graph_tb_per_s=moved / gms / 1e9, graph_vs_copy=moved / gms / 1e9 / ceil["copy_tb_per_s"]
            )
        results.append(row)
        k4 = _contiguous(kc, tables, ctx)
        v4 = _contiguous(vc, tables, ctx)
        q4 = q[:, :, None]  # (B, H, 1, D)
        ref = F.scaled_dot_product_attention(q4.float(), k4.float(), v4.float(), enable_gqa=H != H_kv)[:, :, 0]
        err = (ours.float() - ref).abs().max().item()
        rows_cfg.append({"shape": tag, "max_abs_err_vs_fp32_sdpa": err})
        backends = (
            {"sdpa": None}
            if smoke
            else {
                "sdpa": None,
                "sdpa-flash": SDPBackend.FLASH_ATTENTION,
                "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
                "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
            }
        )
        for name, backend in backends.items():

            def run():
                if backend is None:
                    return F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=H != H_kv)
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=H != H_kv)

            try:
                run()
                ms_p = records.timeit_median(run, 5, 30)
                gms_p = records.graph_ms([run] * GRAPH_CALLS) if not smoke else None
            except RuntimeError as exc:  # backend refuses this shape (or its capture)
                peers.append({"variant": f"{name}-{tag}", "shape": tag, "error": str(exc).splitlines()[0][:120]})
                continue
            peer = {"variant": f"{name}-{tag}", "shape": tag, "median_ms": ms_p, "tb_per_s": moved / ms_p / 1e9}
            if gms_p is not None:
                peer.update(graph_ms=gms_p, graph_tb_per_s=moved / gms_p / 1e9)
            peers.append(peer)
        print(
            f"{tag}: ours {results[-1]['tb_per_s']:.3f} TB/s ({results[-1]['vs_copy']:.1%} of copy), "
            + ", ".join(
                f"{p['variant'].split('-B')[0]} {p.get('tb_per_s', float('nan')):.3f}"
                for p in peers
                if p["shape"] == tag
            ),
            flush=True,
        )
    ratios = []
    for r in results:  # ours vs every peer of the same shape, timed both ways
        for p in peers:
            for metric in ("median_ms", "graph_ms"):
                if p["shape"] == r["shape"] and metric in p and metric in r:
                    ratios.append(
                        {
                            "variant": r["variant"],
                            "peer": p["variant"],
                            "metric": metric,
                            "ratio": p[metric] / r[metric],
                        }
                    )
    rec = records.make_record(
        "decode-kernel",
        {
            "dtype": str(dtype),
            "block_size": 16,
            "checks": rows_cfg,
            "bytes": "KV read + q read + out write + block tables",
        },
        results,
        peers,
        benchmark="decode",
        ratio_metric=None,
        ceilings=ceil,
        notes=[
            "goal: >= 85% of copy bandwidth at >= 256 MB of KV and >= 0.9x SDPA",
            f"median_ms: eager calls (do_bench); graph_ms: {GRAPH_CALLS} calls captured in one CUDA graph and "
            "replayed, GPU time per call (the engine runs the kernel inside its decode graphs)",
        ],
    )
    rec["ratios"] = ratios
    return [rec]


# --------------------------------------------------------------------------- models


def _models(preset: str, smoke: bool) -> tuple[Any, Any]:
    """A randomly initialised transformers Llama and our Llama sharing its weights (bf16 on GPU)."""
    import transformers

    dev, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    cfg = LlamaConfig.from_preset(preset)
    hf_cfg = transformers.LlamaConfig.from_dict(config_to_hf(cfg, "llama", dtype=dtype))
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(default)
    hf.generation_config.pad_token_id = 0
    hf.generation_config.eos_token_id = None
    ours = from_hf(hf, device=dev)  # shares storage: one copy of the weights
    return hf, ours


def _hf_generate(hf: Any, ids: torch.Tensor, mask: torch.Tensor | None, n: int, compile_: bool) -> torch.Tensor:
    return hf.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        cache_implementation="static",
        disable_compile=not compile_,
        pad_token_id=0,
    )


class _Timeout(Exception):
    pass


def _with_alarm(seconds: int, fn: Any) -> Any:
    def handler(signum, frame):  # type: ignore[no-untyped-def]
        raise _Timeout(f"over {seconds} s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.alarm(seconds)
    try:
        return fn()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _decode_rate(run: Any, n1: int, n2: int, reps: int) -> dict[str, float]:
    run(n1)  # warm-up (graph capture, autotuning, compilation)
    t1 = statistics.median(_wall(lambda: run(n1)) for _ in range(reps))
    t2 = statistics.median(_wall(lambda: run(n2)) for _ in range(reps))
    return {"decode_tok_s": (n2 - n1) / (t2 - t1), "t_n1_s": t1, "t_n2_s": t2}


def _breakdown(engine: Any, model: Any) -> dict[str, float]:
    """GPU time of one captured decode step (no Python) and of its matrix products alone (a graph of just them)."""
    if engine.graphs is None or 1 not in engine.graphs.graphs:
        return {}
    step_ms = records.timeit_median(engine.graphs.graphs[1].replay, 5, 50)
    x = torch.randn(1, model.config.dim, device="cuda", dtype=model.tok_embeddings.weight.dtype)
    hidden = torch.randn(1, model.config.ffn_hidden_dim, device="cuda", dtype=x.dtype)
    linears = []
    for block in model.layers.values():
        a, f = block.attention, block.feed_forward
        linears += [(a.wq, x), (a.wk, x), (a.wv, x), (a.wo, x), (f.w1, x), (f.w3, x), (f.w2, hidden)]
    linears.append((model.output, x))
    graph = torch.cuda.CUDAGraph()
    for lin, inp in linears[:3]:
        lin(inp)  # warm-up (cuBLAS handles and workspaces) before capture
    with torch.cuda.graph(graph):
        for lin, inp in linears:
            lin(inp)
    lin_ms = records.timeit_median(graph.replay, 5, 50)
    lin_bytes = sum(lin.weight.numel() * lin.weight.element_size() for lin, _ in linears)
    from lightning_llmopt.inference.gemv import gemv

    for lin, inp in linears:
        gemv(inp, lin.weight)  # autotuned outside the capture
    gemv_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gemv_graph):
        for lin, inp in linears:
            gemv(inp, lin.weight)
    gemv_ms = records.timeit_median(gemv_graph.replay, 5, 50)
    return {
        "gemv_only_ms": gemv_ms,
        "gemv_tb_per_s": lin_bytes / gemv_ms / 1e9,
        "graph_step_ms": step_ms,
        "linears_only_ms": lin_ms,
        "linears_tb_per_s": lin_bytes / lin_ms / 1e9,
        # what the step spends outside its matrix products, against the same products through our GEMVs (the step
        # runs them fused and launched as dependents, so against cuBLAS's separate products the difference is < 0)
        "step_minus_gemv_ms": step_ms - gemv_ms,
    }


def _gemv_key(key: tuple) -> str:
    """A LinearChooser key as text: ``NxK`` (one weight) or ``qkv:NxK+NxK+NxK`` / ``swiglu:NxK+NxK`` (fused)."""
    if isinstance(key[0], str):
        return key[0] + ":" + "+".join(f"{s[0]}x{s[1]}" for s in key[1:] if isinstance(s, tuple))
    return f"{key[0][0]}x{key[0][1]}"


def _quantized_decode(
    model: Any, prompt: torch.Tensor, prompt_len: int, n1: int, n2: int, ceil: dict, bf16_tok_s: float,
    batch: int = 1, kinds: tuple[str, ...] = ("int8", "int4"),
) -> list[dict]:
    """Decode of int8 (per channel) and int4-g128 weight-only copies of ``model`` in the engine (CUDA graphs) at
    ``batch`` rows, issue 10's "decode tokens/s of the quantized llama2-7b shape in the engine"; roofline = copy
    bandwidth / the quantized model's bytes (codes, scales and the bf16 embedding and head), per row."""
    import copy

    from lightning_llmopt.quantization import QuantConfig, quantize_model

    rows = []
    group = 128 if model.config.dim % 128 == 0 else 32  # the tiny smoke model's FFN width is not a multiple of 128
    configs = {"int8": ("int8", QuantConfig(bits=8, group_size=None)),
               "int4": (f"int4-g{group}", QuantConfig(4, group))}  # fmt: skip
    for name, cfg in (configs[k] for k in kinds):
        q = copy.deepcopy(model)
        quantize_model(q, cfg)
        nbytes = sum(t.numel() * t.element_size() for t in [*q.parameters(), *q.buffers()])
        engine = LLMEngine(
            q,
            num_blocks=batch * (2 * math.ceil((prompt_len + n2) / 16) + 2),
            max_num_seqs=batch,
            enable_prefix_caching=False,
            graph_batch_sizes=(batch,),
        )
        prompts = [prompt.tolist()] * batch
        r = _decode_rate(
            lambda n, e=engine: e.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True)), n1, n2, 2
        )
        r["decode_tok_s"] *= batch
        roof = ceil["copy_tb_per_s"] * 1e12 / nbytes * batch
        r.update(
            variant=f"ours-{name}-cuda-graphs" + (f"-batch{batch}" if batch > 1 else ""),
            batch=batch,
            model_bytes=nbytes,
            roofline_tok_s=roof,
            vs_roofline=r["decode_tok_s"] / roof,
            vs_bf16=r["decode_tok_s"] / bf16_tok_s,
        )
        rows.append(r)
        print(
            f"{r['variant']}: {r['decode_tok_s']:.1f} tok/s = {r['vs_bf16']:.2f}x bf16, {r['vs_roofline']:.1%} of its "
            f"roofline {roof:.1f}",
            flush=True,
        )
        engine = q = None
        _free()
    return rows


def _batch_decode(model: Any, hf: Any, prompt: torch.Tensor, n1: int, n2: int, ceil: dict, batch: int,
                  notes: list[str]) -> tuple[list[dict], list[dict]]:  # fmt: skip
    """Decode at ``batch`` rows (the same prompt in each): our engine in bf16 and int4-g128 (CUDA graphs) beside
    transformers' ``generate`` with a static cache (eager). Roofline: ``batch`` tokens per read of the weights."""
    prompt_len = prompt.numel()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    engine = LLMEngine(model, num_blocks=batch * (2 * math.ceil((prompt_len + n2) / 16) + 2), max_num_seqs=batch,
                       enable_prefix_caching=False, graph_batch_sizes=(batch,))  # fmt: skip
    prompts = [prompt.tolist()] * batch
    r = _decode_rate(lambda n: engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True)), n1, n2, 2)
    roof = ceil["copy_tb_per_s"] * 1e12 / model_bytes * batch
    r.update(decode_tok_s=r["decode_tok_s"] * batch, variant=f"ours-cuda-graphs-batch{batch}", batch=batch,
             roofline_tok_s=roof)  # fmt: skip
    r["vs_roofline"] = r["decode_tok_s"] / roof
    print(f"{r['variant']}: {r['decode_tok_s']:.1f} tok/s = {r['vs_roofline']:.1%} of roofline {roof:.1f}", flush=True)
    engine = None
    _free()
    results = [r, *_quantized_decode(model, prompt, prompt_len, n1, n2, ceil, r["decode_tok_s"], batch, ("int4",))]
    peers = []
    ids = prompt[None].repeat(batch, 1).to(model.tok_embeddings.weight.device)
    try:
        p = _with_alarm(150, lambda: _decode_rate(lambda n: _hf_generate(hf, ids, None, n, False), n1 // 2, n1 * 2, 2))
        p.update(decode_tok_s=p["decode_tok_s"] * batch, variant=f"hf-static-eager-batch{batch}", batch=batch)
        peers.append(p)
        print(f"{p['variant']}: {p['decode_tok_s']:.1f} tok/s", flush=True)
    except (_Timeout, Exception) as exc:  # noqa: BLE001 - a peer that fails is recorded, not fatal
        notes.append(f"hf-static-eager-batch{batch} failed: {type(exc).__name__}: {str(exc)[:200]}")
    return results, peers


def family_decode(smoke: bool, hf_compile: bool, compile_budget: int) -> list[dict]:
    preset = "tiny" if smoke else "llama2-7b"
    hf, model = _models(preset, smoke)
    ceil = _ceilings(smoke)
    prompt_len, n1, n2 = (8, 4, 12) if smoke else (128, 32, 160)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.tok_embeddings.weight
    kv_per_token = 2 * model.config.n_layers * model.config.n_kv_heads * model.config.head_dim * emb.element_size()
    step_bytes = model_bytes - emb.numel() * emb.element_size() + kv_per_token * (prompt_len + (n1 + n2) // 2)
    roofline = ceil["copy_tb_per_s"] * 1e12 / model_bytes
    results, peers, notes = [], [], []
    # decode_steps=8: eight greedy steps per host round trip (inference/multi_step.py)
    for graphs, steps, name in ((True, 1, "ours-cuda-graphs"), (True, 8, "ours-cuda-graphs-8steps"),
                                (False, 1, "ours-eager")):
        engine = LLMEngine(
            model,
            num_blocks=2 * math.ceil((prompt_len + n2) / 16) + 2,
            max_num_seqs=1,
            enable_prefix_caching=False,
            cuda_graphs=graphs,
            graph_batch_sizes=(1,),
            decode_steps=steps,
        )
        m1, m2 = (n1, n2) if graphs else (n1 // 2, n1 + n1 // 2)  # the slow variant: fewer tokens
        r = _decode_rate(
            lambda n: engine.generate([prompt.tolist()], SamplingParams(max_tokens=n, ignore_eos=True)), m1, m2, 2
        )
        r.update(
            variant=name,
            vs_roofline=r["decode_tok_s"] / roofline,
            vs_step_bytes_roofline=r["decode_tok_s"] * step_bytes / (ceil["copy_tb_per_s"] * 1e12),
        )
        if graphs and steps == 1 and not smoke:
            r.update(_breakdown(engine, model))
            if "graph_step_ms" in r:  # what a token costs beyond the captured step: scheduling, sampling, read-back
                r["host_ms_per_token"] = 1e3 / r["decode_tok_s"] - r["graph_step_ms"]
        if engine.runner.linear is not None:
            r["gemv_shapes"] = sorted({_gemv_key(k) for k, v in engine.runner.linear.use_gemv.items() if v})
            r["cublas_shapes"] = sorted({_gemv_key(k) for k, v in engine.runner.linear.use_gemv.items() if not v})
        results.append(r)
        print(
            f"{r['variant']}: {r['decode_tok_s']:.1f} tok/s = {r['vs_roofline']:.1%} of roofline {roofline:.1f}",
            flush=True,
        )
        engine = None
        _free()
    results += _quantized_decode(model, prompt, prompt_len, n1, n2, ceil, results[0]["decode_tok_s"])
    batch_results, batch_peers = _batch_decode(model, hf, prompt, n1, n2, ceil, 4 if smoke else 32, notes)
    ids = prompt[None].to(emb.device)
    variants = [("hf-static-eager", False)] + ([("hf-static-compiled", True)] if hf_compile else [])
    for name, comp in variants:
        try:
            r = _with_alarm(
                compile_budget,
                lambda: _decode_rate(lambda n: _hf_generate(hf, ids, None, n, comp), n1 // 2, n1 * 2, 2),
            )
        except (_Timeout, Exception) as exc:  # noqa: BLE001 - a peer that fails is recorded, not fatal
            notes.append(f"{name} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
            print(notes[-1], flush=True)
            continue
        r.update(variant=name, vs_roofline=r["decode_tok_s"] / roofline)
        peers.append(r)
        print(f"{name}: {r['decode_tok_s']:.1f} tok/s", flush=True)
    results, peers = results + batch_results, peers + batch_peers
    cfg = {
        "preset": preset,
        "dtype": str(emb.dtype),
        "batch": "1 (and 32: the variants named -batch32)",
        "prompt_len": prompt_len,
        "n1": n1,
        "n2": n2,
        "model_bytes": model_bytes,
        "step_bytes_at_mean_context": step_bytes,
        "roofline_tok_s": roofline,
        "roofline": "copy_tb_per_s / model_bytes (all parameters)",
    }
    rec = records.make_record(
        "decode-batch1",
        cfg,
        results,
        peers,
        benchmark="decode",
        ratio_metric="decode_tok_s",
        ceilings=ceil,
        notes=notes + ["goal: ours >= 80% of the roofline"],
    )
    rows = {r["variant"]: r.get("batch", 1) for r in results + peers}
    rec["ratios"] = [x for x in rec["ratios"] if rows[x["variant"]] == rows[x["peer"]]]  # same batch only
    return [rec]


# --------------------------------------------------------------------------- serve


# ShareGPT's conversation statistics as reported for vLLM (arXiv 2309.06180): mean prompt 161 tokens, mean output
# 338; both drawn here from lognormals of sigma 1 (medians 161 / e^0.5 and 338 / e^0.5), 4 to `cap` tokens
SHAREGPT_MEANS = (161.31, 337.99)


def _lognormal_len(rng: random.Random, mean: float, cap: int, sigma: float = 1.0) -> int:
    return int(min(cap, max(4, rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma))))


def _workload(n: int, vocab: int, prompt_range: tuple[int, int], out: str, seed: int) -> list[tuple[list[int], int]]:
    """``n`` requests ``(prompt, max_tokens)``. ``out``: ``uniform:lo-hi`` or ``lognormal:median-max`` outputs (prompt
    lengths uniform over ``prompt_range``), or ``sharegpt:cap`` (prompt and output lengths both lognormal with
    ShareGPT's means, :data:`SHAREGPT_MEANS`, each capped at ``cap``; ``prompt_range`` unused)."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        if out.startswith("sharegpt"):
            cap = int(out.split(":")[1])
            p_len, m = _lognormal_len(rng, SHAREGPT_MEANS[0], cap), _lognormal_len(rng, SHAREGPT_MEANS[1], cap)
            reqs.append(([rng.randrange(1, vocab) for _ in range(p_len)], m))
            continue
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(*prompt_range))]
        if out.startswith("uniform"):
            lo, hi = (int(x) for x in out.split(":")[1].split("-"))
            m = rng.randint(lo, hi)
        else:  # "lognormal:median-max": long-tailed, like chat outputs
            median, hi = (int(x) for x in out.split(":")[1].split("-"))
            m = int(min(hi, max(4, rng.lognormvariate(math.log(median), 0.8))))
        reqs.append((prompt, m))
    return reqs


WARM_REQUESTS = 128  # untimed pass before each timed serving run: the whole workload up to this many requests


def _step_cost(engine: Any, vocab: int, rows: int, n1: int = 8, n2: int = 40) -> float:
    """Seconds a decode step of ``rows`` sequences costs beyond its attention: ``rows`` prompts of 16 tokens,
    generating ``n2`` against ``n1`` tokens (the prefill cancels out; contexts stay under 56 tokens, so the KV read
    is negligible)."""
    rng = random.Random(2)
    prompts = [[rng.randrange(1, vocab) for _ in range(16)] for _ in range(rows)]

    def run(n: int) -> None:
        engine.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for _ in prompts])

    rate = _decode_rate(run, n1, n2, reps=3)
    return (rate["t_n2_s"] - rate["t_n1_s"]) / (n2 - n1)


def _serve_ours(model: Any, reqs: list, policy: str, num_blocks: int,
                admission_batch: int | None = None, mixed_steps: str | None = None,
                step_cost: bool = False) -> dict[str, Any]:
    extra = {"mixed_steps": mixed_steps} if mixed_steps is not None else {}
    engine = LLMEngine(
        model,
        num_blocks=num_blocks,
        max_num_seqs=64,
        max_num_batched_tokens=4096,
        policy=policy,
        enable_prefix_caching=False,
        admission_batch=admission_batch,
        **extra,
    )
    # warm-up: decode batches shrinking from 64 to 1 (every graph size), then the whole workload once, so that
    # compilation, autotuning and first allocations of every step shape stay out of the timed run (with only the
    # shorter warm-up, the first continuous run of a process averaged 30 ms a step against 13 ms for the next)
    warm = [(p, i + 1) for i, (p, _) in enumerate(reqs[:64])]
    engine.generate([p for p, _ in warm], [SamplingParams(max_tokens=m, ignore_eos=True) for _, m in warm])
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for _, m in reqs]
    head = min(len(reqs), WARM_REQUESTS)  # a long queue repeats the step shapes of its head
    engine.generate([p for p, _ in reqs[:head]], params[:head])
    engine.stats.reset()
    wall = _wall(lambda: engine.generate([p for p, _ in reqs], params))
    s = engine.stats.summary()
    useful = sum(m for _, m in reqs)
    row = {
        "variant": f"ours-{policy}" + (f"-admit{admission_batch}" if admission_batch is not None else "")
        + (f"-{mixed_steps}" if mixed_steps is not None else ""),
        "wall_s": wall,
        "throughput_tok_s": useful / wall,
        "ttft_mean_s": s["ttft_mean_s"],
        "steps": s["steps"],
        "preemptions": s["preemptions"],
    }
    if step_cost:  # decode steps of 8 and of 64 rows: a fixed cost per step and a cost per row
        row["step_cost_ms"] = {r: 1e3 * _step_cost(engine, model.config.vocab_size, r) for r in (8, 64)}
    engine = None
    _free()
    return row


def _step_model(static: dict[str, Any], results: list[dict[str, Any]], useful: int) -> dict[str, Any]:
    """What the step counts allow. A decode step of ``r`` rows costs ``W + c * r`` (``W``, ``c`` from the static
    engine's measured steps of 8 and 64 rows); every policy computes the same rows (one a generated token), the same
    prefill and the same attention KV reads, so ``wall = S + W * steps``, with the shared work ``S = static wall -
    W * static steps``. Continuous batching's ratio is then bounded by ``static wall / (S + W * its steps)``, and
    by ``static wall / (S + W * useful / 64)`` for any scheduler of 64 slots."""
    t8, t64 = static["step_cost_ms"][8] / 1e3, static["step_cost_ms"][64] / 1e3
    per_row = (t64 - t8) / 56
    w = t8 - 8 * per_row
    shared = static["wall_s"] - w * static["steps"]
    out = {"fixed_step_ms": 1e3 * w, "per_row_us": 1e6 * per_row, "shared_s": shared, "min_steps": useful / 64,
           "ratio_bound_any_scheduler": static["wall_s"] / (shared + w * useful / 64)}
    for r in results:
        predicted = shared + w * r["steps"]
        out[r["variant"]] = {"predicted_wall_s": predicted, "ratio_bound": static["wall_s"] / predicted,
                             "wall_over_predicted": r["wall_s"] / predicted}
    return out


def _serve_hf(hf: Any, reqs: list, batch: int) -> dict[str, Any]:
    dev = next(hf.parameters()).device

    def run() -> None:
        for i in range(0, len(reqs), batch):
            chunk = reqs[i : i + batch]
            width = max(len(p) for p, _ in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, (p, _) in enumerate(chunk):  # left padding
                ids[r, width - len(p) :] = torch.tensor(p)
                mask[r, width - len(p) :] = 1
            _hf_generate(hf, ids.to(dev), mask.to(dev), max(m for _, m in chunk), False)

    _hf_generate(hf, torch.ones(2, 8, dtype=torch.long, device=dev), None, 4, False)  # warm-up
    wall = _wall(run)
    return {"variant": "hf-static-batching", "wall_s": wall, "throughput_tok_s": sum(m for _, m in reqs) / wall}


SERVE_OUTPUTS = ("uniform:16-256", "lognormal:64-256")


def family_serve(smoke: bool, requests: int, with_hf: bool, admits: tuple[int, ...] = (16,),
                 preset: str = "llama2-7b", outs: tuple[str, ...] = SERVE_OUTPUTS, variants: bool = True) -> list[dict]:
    """Records ``decode-serve-<outputs>`` (128 requests) or ``decode-serve-<outputs>-q<N>`` (a queue of N), with
    ``-<preset>`` appended for presets other than ``llama2-7b``. ``variants=False`` runs only the default continuous
    engine against static batching."""
    preset = "tiny" if smoke else preset
    hf, model = _models(preset, smoke)
    vocab = model.config.vocab_size
    prompt_range = (4, 24) if smoke else (32, 256)
    outs = ("uniform:2-16", "lognormal:4-16", "sharegpt:24") if smoke else outs
    records_out = []
    for out in outs:
        reqs = _workload(8 if smoke else requests, vocab, prompt_range, out, seed=1)
        num_blocks = 64 * math.ceil(max(len(p) + m for p, m in reqs) / 16) + 1
        # the default admission batch is min(8, max_num_seqs) = 8; `admits` adds explicit ones (--admit)
        results = [_serve_ours(model, reqs, "continuous", num_blocks)]
        for a in ((2,) if smoke else admits) if variants else ():
            results.append(_serve_ours(model, reqs, "continuous", num_blocks, admission_batch=a))
        if variants:  # mixed steps as two passes (decodes from the graph, prefill eagerly), default until 2026-11-25
            results.append(_serve_ours(model, reqs, "continuous", num_blocks, mixed_steps="split"))
        peers = [_serve_ours(model, reqs, "static", num_blocks, step_cost=True)]
        if with_hf and out == outs[0]:
            peers.append(_serve_hf(hf, reqs, 64))
        for row in results + peers:
            print(f"{out} {row['variant']}: {row['throughput_tok_s']:.0f} tok/s ({row['wall_s']:.1f} s)", flush=True)
        useful = sum(m for _, m in reqs)
        cfg = {
            "preset": preset,
            "requests": len(reqs),
            "max_running": 64,
            "prompt_len": "lognormal, mean 161, 4 to cap" if out.startswith("sharegpt") else list(prompt_range),
            "prompt_tokens": sum(len(p) for p, _ in reqs),
            "output_len": out,
            "useful_tokens": useful,
            "throughput": "requested output tokens / wall time; static batching pads every batch to its longest",
            "step_model": _step_model(peers[0], results, useful),
        }
        print(f"{out} step model: {json.dumps(cfg['step_model'])}", flush=True)
        name = f"decode-serve-{out.split(':')[0]}" + ("" if smoke or requests == 128 else f"-q{requests}")
        name += "" if preset in ("llama2-7b", "tiny") else f"-{preset}"
        records_out.append(
            records.make_record(
                name,
                cfg,
                results,
                peers,
                benchmark="decode",
                ratio_metric="throughput_tok_s",
                notes=[
                    "goal: continuous >= 2x static batching",
                    f"each engine serves the workload (its first {WARM_REQUESTS} requests) once untimed (after 64 "
                    "shrinking decode batches), then the whole workload timed",
                ],
            )
        )
    return records_out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Inference benchmarks (issue 8).")
    parser.add_argument("--family", choices=["kernel", "decode", "serve"], required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, records in a temp dir")
    parser.add_argument("--hf-compile", action="store_true", help="also time transformers with torch.compile")
    parser.add_argument("--compile-budget", type=int, default=150, help="seconds allowed per transformers peer")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--no-hf", action="store_true", help="serve: skip the transformers static-batching peer")
    parser.add_argument("--admit", default="16", help="serve: explicit admission batches beside the default (8), "
                        "comma-separated; '' for none")
    parser.add_argument("--preset", default="llama2-7b", help="serve: model shape (random weights)")
    parser.add_argument("--outputs", default=",".join(SERVE_OUTPUTS),
                        help="serve: workloads, comma-separated: uniform:LO-HI, lognormal:MEDIAN-MAX, sharegpt:CAP")
    parser.add_argument("--no-variants", action="store_true",
                        help="serve: only the default continuous engine against static batching")
    parser.add_argument("--results-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (use --smoke for a CPU check of the code path)")
    results_dir = args.results_dir or (Path(tempfile.mkdtemp(prefix="llmopt-bench-")) if args.smoke else None)
    if args.family == "kernel":
        recs = family_kernel(args.smoke)
    elif args.family == "decode":
        recs = family_decode(args.smoke, args.hf_compile, args.compile_budget)
    else:
        admits = tuple(int(a) for a in args.admit.split(",") if a.strip())
        outs = tuple(o.strip() for o in args.outputs.split(",") if o.strip())
        recs = family_serve(args.smoke, args.requests, not args.no_hf, admits, args.preset, outs, not args.no_variants)
    for rec in recs:
        path = records.write_record(rec, results_dir)
        print(
            json.dumps(
                {"name": rec["name"], "results": rec["results"], "peers": rec["peers"], "ratios": rec["ratios"]},
                default=str,
            )
        )
        print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
