"""Diagnostic sweep of the paged-attention decode launch: number of KV splits x launch configuration, on one GPU.

Every ``(BLOCK_N, num_warps, num_stages)`` candidate is launched directly (the autotuner bypassed) at every split
count that leaves each split at least 128 keys, on the decode benchmark's shapes (``bench_decode.py --family
kernel``: 256 MB to 1 GB of bf16 KV), and timed as ``bench_decode`` times its ``graph_ms`` (10 calls captured in one
CUDA graph, GPU time per call). Prints a table per shape (fraction of copy bandwidth) beside the default launch
(:func:`~lightning_llmopt.kernels.paged_attention.choose_splits` and the autotuner); not a record: JSON lines go to
``--out``.

Usage: ``python benchmarks/sweep_paged.py [--out sweep-paged.jsonl]``
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import records  # noqa: E402
from bench_ceilings import copy_bandwidth  # noqa: E402
from bench_decode import GRAPH_CALLS, _paged_case  # noqa: E402

from lightning_llmopt.kernels import paged_attention_kernel as pk  # noqa: E402
from lightning_llmopt.kernels.paged_attention import choose_splits, paged_attention  # noqa: E402

SHAPES = [(1, 16384, 32, 32, 128), (4, 4096, 32, 32, 128), (16, 1024, 32, 32, 128), (32, 2048, 32, 32, 128),
          (4, 16384, 32, 8, 128), (16, 4096, 32, 8, 128), (64, 1024, 32, 8, 128)]
CONFIGS = [(64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3), (128, 8, 3), (32, 2, 4), (32, 4, 4),
           (64, 8, 4)]
SPLITS = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32]


class _Fixed:
    """Stands in for the autotuned kernel: ``_Fixed(cfg)[grid](*args, **consts)`` launches one configuration."""

    def __init__(self, cfg: tuple[int, int, int]) -> None:
        self.cfg = cfg

    def __getitem__(self, grid):  # type: ignore[no-untyped-def]
        block_n, warps, stages = self.cfg

        def launch(*args, **consts):  # type: ignore[no-untyped-def]
            return pk._paged_decode_kernel[grid](*args, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
                                                 **consts)

        return launch


def _time(case, ctx: int, splits: int | None) -> float:
    q, kc, vc, tables, lens = case
    return records.graph_ms([lambda: paged_attention(q, kc, vc, tables, lens, max_context=ctx, num_splits=splits)]
                            * GRAPH_CALLS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="sweep-paged.jsonl")
    args = ap.parse_args(argv)
    copy = copy_bandwidth(4096 * 2**20, "cuda")["tb_per_s"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tuned = pk._tuned_kernel
    rows = []
    for B, ctx, H, H_kv, D in SHAPES:
        case = _paged_case(B, ctx, H, H_kv, D, "cuda", torch.bfloat16)
        moved = 2 * B * ctx * H_kv * D * 2 + 2 * case[0].numel() * 2 + case[3].numel() * 4
        tag = f"B{B}-ctx{ctx}-H{H}-Hkv{H_kv}"
        auto_splits = choose_splits(B, H_kv, ctx, case[0].device)
        pk._tuned_kernel = tuned
        auto_ms = _time(case, ctx, None)
        best = (float("inf"), None, None)
        for splits in SPLITS:
            if ctx / splits < 128 or B * H_kv * splits > 16 * sms:
                continue
            line = []
            for cfg in CONFIGS:
                pk._tuned_kernel = lambda cfg=cfg: _Fixed(cfg)
                try:
                    ms = _time(case, ctx, splits)
                except Exception as exc:  # noqa: BLE001 - out of resources etc.: the candidate is skipped
                    print(f"{tag} splits={splits} {cfg}: {type(exc).__name__}", flush=True)
                    continue
                frac = moved / ms / 1e9 / copy
                rows.append({"shape": tag, "splits": splits, "programs": B * H_kv * splits, "config": cfg,
                             "ms": ms, "vs_copy": frac})
                line.append(f"{frac:.3f}")
                best = min(best, (ms, splits, cfg))
            print(f"{tag} splits={splits:3d} programs={B * H_kv * splits:5d}: " + " ".join(line), flush=True)
        ms, splits, cfg = best
        print(f"== {tag}: default (splits {auto_splits}, tuned) {moved / auto_ms / 1e9 / copy:.3f} of copy; best "
              f"{moved / ms / 1e9 / copy:.3f} at splits={splits} {cfg}", flush=True)
        rows.append({"shape": tag, "splits": auto_splits, "config": "default",
                     "ms": auto_ms, "vs_copy": moved / auto_ms / 1e9 / copy})
        del case
        torch.cuda.empty_cache()
    pk._tuned_kernel = tuned
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"copy bandwidth {copy:.3f} TB/s; {len(rows)} rows -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
