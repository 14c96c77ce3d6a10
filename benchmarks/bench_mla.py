"""Multi-head latent attention (MLA) against GQA at equal parameters: decode throughput, KV bytes per token and the
largest batch a fixed KV pool holds.

Families (each in its own process):

- ``table``: KV-cache bytes per token of published model shapes, computed from their configs
  (:func:`~lightning_llmopt.inference.mla_cache.kv_bytes_per_token`; nothing is measured); prints the markdown table
  of ``docs/mla.md``;
- ``decode``: a randomly initialised MLA model (DeepSeek-V2-Lite-like attention: ``kv_lora_rank`` 512, RoPE key 64,
  heads of 128 + 64 / 128) and a GQA model with the same dim, layers and heads whose SwiGLU width is chosen so the
  parameter counts match (within one ``multiple_of``), both bf16 in our engine: greedy decode tokens/s of a batch
  of ``--batch`` requests (``(N2 - N1) / (t2 - t1)`` over runs generating N1 and N2 tokens, so prefill cancels),
  KV bytes/token read off each engine's pool, and the most requests of ``--context`` tokens running at once in a
  pool of ``--pool-gib`` GiB. MLA is "ours", GQA the peer.

Usage: ``python benchmarks/bench_mla.py --family decode`` (records in benchmarks/results/mla-*.json);
``--smoke`` checks the code path on CPU with tiny sizes (records in a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package
import records  # noqa: E402

from lightning_llmopt.inference import LLMEngine, SamplingParams  # noqa: E402
from lightning_llmopt.inference.mla_cache import kv_bytes_per_token  # noqa: E402
from lightning_llmopt.models import Llama, LlamaConfig  # noqa: E402

# Published shapes (the models' config.json files); only the fields the cache depends on.
TABLE: dict[str, dict[str, Any]] = {
    "DeepSeek-V2-Lite (MLA)": dict(n_layers=27, n_heads=16, dim=2048, mla=dict(kv_lora_rank=512, qk_rope_head_dim=64)),
    "DeepSeek-V2 (MLA)": dict(n_layers=60, n_heads=128, dim=5120, mla=dict(kv_lora_rank=512, qk_rope_head_dim=64)),
    "DeepSeek-V3 (MLA)": dict(n_layers=61, n_heads=128, dim=7168, mla=dict(kv_lora_rank=512, qk_rope_head_dim=64)),
    "Llama-3-8B (GQA, 8 KV heads)": dict(n_layers=32, n_heads=32, n_kv_heads=8, dim=4096),
    "Llama-2-7B (MHA)": dict(n_layers=32, n_heads=32, n_kv_heads=32, dim=4096),
}


def _mha_equivalent(cfg: LlamaConfig) -> int:
    """bf16 bytes/token of caching the naive form's per-head keys (``d_n + d_r``) and values (``d_v``) instead."""
    assert cfg.mla is not None
    return cfg.n_layers * cfg.n_heads * (cfg.mla.qk_head_dim + cfg.mla.v_head_dim) * 2


def family_table() -> str:
    rows = [
        "| model | layers | cache per token and layer | bf16 KV bytes / token | vs Llama-2-7B |",
        "|---|---|---|---|---|",
    ]
    base = kv_bytes_per_token(LlamaConfig(**TABLE["Llama-2-7B (MHA)"]))
    for name, fields in TABLE.items():
        cfg = LlamaConfig(**fields)
        per = kv_bytes_per_token(cfg)
        if cfg.mla is not None:
            what = f"latent {cfg.mla.kv_lora_rank} + RoPE key {cfg.mla.qk_rope_head_dim}"
        else:
            what = f"2 x {cfg.n_kv_heads} heads x {cfg.head_dim}"
        rows.append(f"| {name} | {cfg.n_layers} | {what} | {per:,} | {per / base:.3f} |")
    lite = LlamaConfig(**TABLE["DeepSeek-V2-Lite (MLA)"])
    per = _mha_equivalent(lite)
    rows.append(
        f"| DeepSeek-V2-Lite, naive form cached | 27 | 16 heads x (192 key + 128 value) | {per:,} | {per / base:.3f} |"
    )
    return "\n".join(rows)


def _configs(smoke: bool) -> tuple[LlamaConfig, LlamaConfig]:
    """An MLA config and a GQA config with (nearly) the same number of parameters."""
    if smoke:
        base = dict(vocab_size=320, dim=64, n_layers=2, n_heads=4, ffn_hidden_dim=128, max_seq_len=256, multiple_of=8)
        mla = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
        gqa = dict(n_kv_heads=2)
    else:
        base = dict(
            vocab_size=32000, dim=2048, n_layers=16, n_heads=16, ffn_hidden_dim=5632, max_seq_len=8192, multiple_of=256
        )
        mla = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
        gqa = dict(n_kv_heads=4)
    mla_cfg = LlamaConfig(**base, mla=mla)
    with torch.device("meta"):
        target = Llama(mla_cfg).num_params()
        gqa_cfg = LlamaConfig(**{**base, **gqa})
        attn_gap = target - Llama(gqa_cfg).num_params()
    per_ffn_unit = 3 * base["dim"] * base["n_layers"]  # w1, w2, w3 per hidden unit per layer
    step = base["multiple_of"]
    ffn = base["ffn_hidden_dim"] + round(attn_gap / per_ffn_unit / step) * step
    return mla_cfg, LlamaConfig(**{**base, **gqa, "ffn_hidden_dim": ffn})


def _decode_tok_s(engine: LLMEngine, batch: int, prompt_len: int, n1: int, n2: int) -> float | None:
    prompts = [[(7 * i + j) % 300 + 1 for j in range(prompt_len)] for i in range(batch)]

    def run(n: int) -> float:
        sp = SamplingParams(max_tokens=n, ignore_eos=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate(prompts, sp)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if engine.prefix_cache is not None:
            engine.prefix_cache.clear()
        return time.perf_counter() - start

    run(n1)  # warm-up (graph capture, autotuning)
    t1, t2 = run(n1), run(n2)
    if t2 <= t1:  # timing noise larger than the extra tokens' cost (tiny smoke shapes): no figure
        return None
    return batch * (n2 - n1) / (t2 - t1)


def _max_running(cfg: LlamaConfig, device: str, pool_bytes: int, context: int, block_size: int) -> int:
    """Most requests of ``context`` tokens (prompt + output) running at once in a pool of ``pool_bytes``."""
    num_blocks = pool_bytes // (kv_bytes_per_token(cfg, torch.bfloat16) * block_size)
    with torch.device(device):
        model = Llama(cfg).to(torch.bfloat16)
    engine = LLMEngine(
        model,
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=4096,
        max_num_batched_tokens=max(8192, context),
        enable_prefix_caching=False,
        cuda_graphs=False,
    )
    for i in range(num_blocks * block_size // context + 8):  # context - 2 prompt tokens + 2 outputs: context each
        engine.add_request([(i + j) % 300 + 1 for j in range(context - 2)], SamplingParams(max_tokens=2))
    most = 0
    while engine.has_unfinished() and engine.stats.steps < 4 * context:
        engine.step()
        most = max(most, len(engine.scheduler.running))
    return most


def family_decode(smoke: bool, batch: int, context: int, pool_gib: float) -> list[dict[str, Any]]:
    device = "cpu" if smoke else "cuda"
    mla_cfg, gqa_cfg = _configs(smoke)
    n1, n2, prompt_len = (2, 16, 8) if smoke else (32, 160, 128)
    pool_bytes = int(pool_gib * 2**30)
    out: dict[str, dict[str, Any]] = {}
    for variant, cfg in (("mla", mla_cfg), ("gqa", gqa_cfg)):
        torch.manual_seed(0)
        with torch.device(device):
            model = Llama(cfg).to(torch.float32 if smoke else torch.bfloat16)
        engine = LLMEngine(model, block_size=16, max_num_seqs=max(batch, 1), num_blocks=None if not smoke else 256)
        pool = engine.pool
        out[variant] = dict(
            variant=variant,
            params=model.num_params(),
            kv_bytes_per_token=pool.nbytes // (pool.num_blocks * pool.block_size),
            decode_tok_s=_decode_tok_s(engine, batch, prompt_len, n1, n2),
            max_running_requests=_max_running(cfg, device, pool_bytes, context, 16),
        )
        del engine, model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    config = dict(
        mla=mla_cfg.to_dict(),
        gqa=gqa_cfg.to_dict(),
        batch=batch,
        context=context,
        pool_gib=pool_gib,
        dtype="float32" if smoke else "bfloat16",
        n1=n1,
        n2=n2,
        prompt_len=prompt_len,
    )
    rec = records.make_record(
        f"mla-decode{'-smoke' if smoke else ''}",
        config,
        [out["mla"]],
        [out["gqa"]],
        benchmark="mla",
        ratio_metric="decode_tok_s",
        notes=[
            "GQA peer: same dim/layers/heads, SwiGLU width matched to the MLA parameter count",
            "engine defaults for both: the MLA runner has no fused elementwise decode path",
        ],
    )
    return [rec]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="MLA vs GQA benchmarks.")
    parser.add_argument("--family", choices=["table", "decode"], required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, records in a temp dir")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048, help="tokens per request in the fixed-pool test")
    parser.add_argument("--pool-gib", type=float, default=4.0, help="KV pool size of the fixed-pool test")
    parser.add_argument("--results-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.family == "table":
        print(family_table())
        return 0
    if not args.smoke and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (use --smoke for a CPU check of the code path)")
    if args.smoke:
        args.batch, args.context, args.pool_gib = min(args.batch, 4), min(args.context, 32), 64 * 2**10 / 2**30
    results_dir = args.results_dir or (Path(tempfile.mkdtemp(prefix="llmopt-bench-")) if args.smoke else None)
    for rec in family_decode(args.smoke, args.batch, args.context, args.pool_gib):
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
