"""Diagnostic sweep of the flash-attention launch configurations on one GPU (bf16), pass by pass.

Every candidate ``({BLOCK_M, BLOCK_N}, num_warps, num_stages)`` of the forward kernel, the dK/dV pass and the dQ
pass is launched directly (bypassing autotuning, through the launchers' ``config``/``configs`` arguments) on the
attention benchmark's shapes (B*S = 16k tokens, H*D = 2048), and timed with ``triton.testing.do_bench`` (median).
A backward candidate is timed as the whole backward (delta + dK/dV + dQ) with the other pass held at a fixed
configuration, so differences between candidates are that pass's. The summary ranks candidates by the geometric
mean over shapes of their time over the best time at that shape; the autotuning lists in
``flash_attention_common`` are chosen from it. Not a record: it prints a table and writes JSON lines to ``--out``.

Usage: ``python benchmarks/sweep_attention.py --head-dims 128 --seqs 1024,2048,4096,8192``; the ``1b`` training
shape: ``--head-dims 64 --seqs 4096 --causal 1 --gqa 8 --batch 4 --narrow``
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from lightning_llmopt.kernels.flash_attention_common import as_launch_config as as_config
from lightning_llmopt.kernels.flash_attention_common import geometry

TOKENS, HIDDEN = 16384, 2048

FWD = [
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 128, 8, 3),
    (64, 64, 4, 4),
    (128, 64, 4, 4),
    (128, 64, 8, 4),
    (128, 128, 8, 2),
    (64, 128, 4, 3),
    (128, 32, 4, 4),
    (256, 64, 8, 3),
    (64, 64, 4, 3),
    (128, 64, 8, 2),
]
DKDV = [
    (32, 128, 4, 3),
    (64, 128, 8, 3),
    (64, 64, 4, 3),
    (32, 128, 4, 4),
    (32, 128, 4, 5),
    (64, 128, 8, 2),
    (32, 64, 4, 3),
    (64, 128, 4, 3),
    (32, 128, 8, 3),
    (16, 128, 4, 4),
    (64, 64, 4, 5),
    (32, 64, 4, 5),
]
DQ = [
    (128, 32, 4, 3),
    (128, 64, 8, 3),
    (64, 64, 4, 3),
    (128, 32, 4, 4),
    (128, 32, 4, 5),
    (64, 32, 4, 4),
    (128, 64, 4, 3),
    (64, 64, 4, 4),
    (128, 32, 8, 3),
    (64, 32, 4, 3),
    (128, 64, 8, 2),
]
# more candidates for head dims up to 64 (``--narrow``), where larger tiles fit in registers and shared memory
NARROW = {
    "fwd": [(128, 128, 4, 3), (128, 64, 4, 2), (128, 128, 8, 4), (256, 64, 8, 4), (256, 128, 8, 3), (64, 128, 4, 4)],
    "dkdv": [(64, 128, 4, 4), (128, 128, 8, 3), (64, 64, 4, 4), (128, 64, 8, 3), (64, 128, 8, 4), (32, 128, 4, 2),
             (64, 256, 8, 3)],
    "dq": [(128, 64, 4, 4), (128, 128, 8, 3), (64, 128, 4, 3), (128, 64, 8, 4), (256, 64, 8, 3), (128, 32, 4, 2)],
}


def _bench(fn) -> float:  # type: ignore[no-untyped-def]
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=40, return_mode="median"))


def sweep_shape(D: int, S: int, causal: bool, passes: tuple[str, ...], window: int | None = None,
                pack: str | None = None, gqa: int = 1, batch: int | None = None, narrow: bool = False,
                splits: tuple[int, ...] = (1,), only: dict[str, list] | None = None) -> list[dict]:
    """``pack``: ``"equal"`` or ``"random"`` times the packed 16-document layouts of bench_attention's varlen family
    (16k tokens, ``S`` is then ignored and reported as 0) instead of ``B = 16k / S`` dense sequences. ``gqa``: query
    heads per key/value head; ``batch``: sequences (default 16k / S); ``narrow``: add the ``NARROW`` candidates;
    ``splits``: dK/dV programs per key/value head to time each dK/dV candidate with (``flash_bwd``'s ``split``);
    ``only``: pass name -> the candidates to time instead of its list."""
    from lightning_llmopt.kernels.flash_attention_bwd import flash_bwd
    from lightning_llmopt.kernels.flash_attention_fwd import flash_fwd

    B, H = batch or TOKENS // S, HIDDEN // D
    g = torch.Generator(device="cuda").manual_seed(S + D)
    scale = 1.0 / math.sqrt(D)
    if pack is None:
        q, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        k, v = (torch.randn(B, S, H // gqa, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        geo = geometry(q, k, None, None)
        lengths = [S] * B
    else:
        from bench_attention import varlen_lengths

        lengths = varlen_lengths(pack)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
        q, do = (torch.randn(TOKENS, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        k, v = (torch.randn(TOKENS, H // gqa, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        geo = geometry(q, k, cu, max(lengths))
        S = 0
    out, lse = flash_fwd(q, k, v, geo, causal, scale, window, as_config(FWD[0]))
    flops = sum(4 * H * L * L * D * (0.5 if causal else 1.0) for L in lengths)
    if window is not None:
        flops = sum(4 * H * L * min(window, L) * D for L in lengths)
    rows = []
    table = {"fwd": FWD, "dkdv": DKDV, "dq": DQ}
    if narrow:
        table = {name: cands + [c for c in NARROW[name] if c not in cands] for name, cands in table.items()}
    table.update(only or {})
    runs = [(n, c, sp) for n in passes for c in table[n] for sp in (splits if n == "dkdv" else (1,))]
    for name, cand, split in runs:
        if name == "fwd":
            fn = lambda c=cand: flash_fwd(q, k, v, geo, causal, scale, window, as_config(c))  # noqa: E731
            work = flops
        else:
            cfgs = {"dkdv": as_config(DKDV[0]), "dq": as_config(DQ[0]), name: as_config(cand)}
            fn = lambda c=cfgs, sp=split: flash_bwd(do, q, k, v, out, lse, geo, causal, scale, window, c,  # noqa: E731
                                                    split=sp)
            work = 2.5 * flops
        row = {"pass": name, "D": D, "S": S, "causal": causal, "window": window, "config": list(cand)}
        if gqa != 1 or batch:
            row.update(gqa=gqa, batch=B)
        if len(splits) > 1 and name == "dkdv":
            row["config"] = [*cand, split]
        if pack is not None:
            row["pack"] = pack
        try:
            ms = _bench(fn)
            row.update(ms=ms, tflops=work / ms / 1e9)
        except Exception as e:  # out of shared memory or registers: a candidate, not a failure
            row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _shape(r: dict) -> tuple:
    return r["D"], r["S"], r["causal"], r.get("window") or 0, r.get("pack") or "", r.get("gqa", 1), r.get("batch", 0)


def summarize(rows: list[dict]) -> str:
    lines = []
    for name in ("fwd", "dkdv", "dq"):
        mine = [r for r in rows if r["pass"] == name and "ms" in r]
        if not mine:
            continue
        shapes = sorted({_shape(r) for r in mine})
        best = {s: min(r["ms"] for r in mine if _shape(r) == s) for s in shapes}
        lines.append(f"== {name}: per shape best (config, TF/s)")
        for s in shapes:
            r = min((r for r in mine if _shape(r) == s), key=lambda r: r["ms"])
            lines.append(f"  D={s[0]} S={s[1]} causal={s[2]} window={s[3]} pack={s[4] or '-'} gqa={s[5]} "
                         f"B={s[6] or '-'}: {tuple(r['config'])} "
                         f"{r['tflops']:.0f}")
        lines.append(f"== {name}: candidates by geometric mean of time/best over {len(shapes)} shapes")
        ranked = []
        for cand in sorted({tuple(r["config"]) for r in mine}):
            rel = [r["ms"] / best[_shape(r)] for r in mine if tuple(r["config"]) == cand]
            if len(rel) == len(shapes):
                ranked.append((math.exp(sum(map(math.log, rel)) / len(rel)), max(rel), cand))
        for gm, worst, cand in sorted(ranked):
            lines.append(f"  {cand}: geomean {gm:.3f}, worst {worst:.3f}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--head-dims", default="128")
    p.add_argument("--seqs", default="1024,2048,4096,8192")
    p.add_argument("--causal", default="0,1", help="comma-separated 0/1")
    p.add_argument("--passes", default="fwd,dkdv,dq")
    p.add_argument("--windows", default=None, help="comma-separated sliding windows (causal shapes only)")
    p.add_argument("--packs", default=None, help="comma-separated packed layouts (equal, random) instead of --seqs")
    p.add_argument("--out", default=None, help="JSON-lines file for every timing")
    p.add_argument("--gqa", type=int, default=1, help="query heads per key/value head (dense shapes)")
    p.add_argument("--batch", type=int, default=None, help="sequences per shape (default 16k / S)")
    p.add_argument("--narrow", action="store_true", help="add the NARROW candidates (head dims up to 64)")
    p.add_argument("--splits", default="1", help="comma-separated dK/dV programs per key/value head (GQA)")
    p.add_argument("--only", default=None,
                   help='candidates instead of the lists, e.g. "dkdv=32,128,4,3;64,64,4,3" (several passes: "|")')
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    splits = tuple(int(x) for x in args.splits.split(","))
    only = {}
    for spec in args.only.split("|") if args.only else []:
        name, cands = spec.split("=")
        only[name] = [tuple(int(x) for x in c.split(",")) for c in cands.split(";")]
    if args.packs:
        for D in (int(x) for x in args.head_dims.split(",")):
            for pack in args.packs.split(","):
                rows += sweep_shape(D, TOKENS, True, tuple(args.passes.split(",")), pack=pack, gqa=args.gqa,
                                    narrow=args.narrow, splits=splits, only=only)
        args.seqs = ""
    for D in (int(x) for x in args.head_dims.split(",")):
        for S in (int(x) for x in args.seqs.split(",") if x):
            for causal in (bool(int(x)) for x in args.causal.split(",")):
                for window in [int(w) for w in args.windows.split(",")] if args.windows else [None]:
                    if window is None or causal:
                        rows += sweep_shape(D, S, causal, tuple(args.passes.split(",")), window, gqa=args.gqa,
                                            batch=args.batch, narrow=args.narrow, splits=splits, only=only)
    if args.out:
        Path(args.out).write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    print(summarize(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
