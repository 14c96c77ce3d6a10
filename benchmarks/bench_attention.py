"""Flash attention on one GPU, bf16: our Triton kernels beside SDPA-flash, SDPA-cuDNN and FlexAttention (compiled).

Families (run each in its own process: autotuning and compile caches distort later shapes):

- ``hd64`` / ``hd128``: B*S = 16k tokens, H*D = 2048, S in {1k, 2k, 4k, 8k, 16k}, causal and not; forward,
  backward and forward+backward TFLOP/s (FLOPs 4*B*H*S^2*D forward, x0.5 causal; backward 2.5x forward);
- ``varlen``: 16 documents packed into 16k tokens (hd128): ours (cu_seqlens) vs Flex with a document mask vs
  dense causal attention over the 16k tokens (ours and cuDNN). Two packs: 16 documents of 1024 tokens
  (``attention-varlen16-equal``; dense causal does 16x the FLOPs) and 16 documents of random lengths
  (``attention-varlen16``; seed 0, where the FLOP ratio is 8.2x, so no kernel can be 8x faster there);
- ``window``: S = 16k, sliding windows 256..4096 (hd128): ours vs Flex with a window mask;
- ``check``: bf16 correctness at larger shapes against an fp64 reference (the 2x-PyTorch rule);
- ``parity``: ours against Flex where one run's ratio is within run-to-run noise (about +-5% between runs at hd128):
  each shape is timed in interleaved rounds (which goes first alternates) and the record gives the median of the
  per-round ratios, their range and how many rounds put ours ahead, for the forward, forward+backward and the
  backward (forward+backward minus forward within a round).

Usage: ``python benchmarks/bench_attention.py --family hd128`` (records in benchmarks/results/attention-*.json).
"""

# ruff: noqa: B023 - the closures built in the loops are timed and dropped within their own iteration
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package
import records  # noqa: E402

from lightning_llmopt.kernels import flash_attention, flash_attention_ref  # noqa: E402

TOKENS, HIDDEN = 16384, 2048
SEQS = (1024, 2048, 4096, 8192, 16384)


def bench(fn) -> float:  # type: ignore[no-untyped-def]
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=60, return_mode="median"))


def bench_graph(fn, grad: bool = False) -> float | None:  # type: ignore[no-untyped-def]
    """Median time of one CUDA-graph replay of ``fn()`` (autograd off unless ``grad``): the GPU time of a call,
    without the host time an eager call spends before its launches (which is what a forward of ~0.2 ms measures on
    a slow host); ``None`` where the call cannot be captured."""
    from triton.testing import do_bench

    try:
        with torch.set_grad_enabled(grad):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # compile, autotune and allocate outside the capture
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
        torch.cuda.synchronize()
        return float(do_bench(graph.replay, warmup=10, rep=60, return_mode="median"))
    except Exception as e:  # noqa: BLE001 - recorded as a missing value with the reason printed
        print(f"graph capture failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None


def host_us(fn, calls: int = 50) -> float:  # type: ignore[no-untyped-def]
    """Host time of one call in microseconds: ``calls`` calls issued back to back without a sync (few enough that
    the launch queue never fills, so the GPU does not hold the host back)."""
    import time

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def _fwd_bwd(fn, q, k, v, do):  # type: ignore[no-untyped-def]
    def run():  # type: ignore[no-untyped-def]
        out = fn(q, k, v)
        return torch.autograd.grad(out, (q, k, v), do)

    return run


def _variants(causal: bool, S: int, D: int):  # type: ignore[no-untyped-def]
    """name -> fn(q, k, v) on (B, H, S, D) tensors (ours gets (B, S, H, D) views of (B, S, H, D) storage)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    F = torch.nn.functional

    def ours(q, k, v):  # type: ignore[no-untyped-def]
        return flash_attention(q, k, v, causal=causal, backend="triton")

    def ours_triton(q, k, v):  # type: ignore[no-untyped-def]
        # the Triton forward everywhere (on Hopper "ours" takes the warp-specialized Gluon forward where it measured
        # faster: kernels/flash_attention_fwd_ws.py), to show what that choice gains in the same run
        previous = os.environ.get("LLMOPT_FLASH_FWD")
        os.environ["LLMOPT_FLASH_FWD"] = "triton"
        try:
            return flash_attention(q, k, v, causal=causal, backend="triton")
        finally:
            if previous is None:
                del os.environ["LLMOPT_FLASH_FWD"]
            else:
                os.environ["LLMOPT_FLASH_FWD"] = previous

    def sdpa(backend):  # type: ignore[no-untyped-def]
        def fn(q, k, v):  # type: ignore[no-untyped-def]
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return fn

    flex_c = torch.compile(flex_attention, dynamic=False)
    bm = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, S, S, device="cuda") if causal else None

    def flex(q, k, v):  # type: ignore[no-untyped-def]
        return flex_c(q, k, v, block_mask=bm)

    return {
        "ours": (ours, "bshd"),
        "ours-triton": (ours_triton, "bshd"),
        "sdpa-flash": (sdpa(SDPBackend.FLASH_ATTENTION), "bhsd"),
        "sdpa-cudnn": (sdpa(SDPBackend.CUDNN_ATTENTION), "bhsd"),
        "flex": (flex, "bhsd"),
    }


def family_dense(D: int, seqs: tuple[int, ...] = SEQS, only: tuple[str, ...] | None = None) -> dict:
    H = HIDDEN // D
    rows, notes = [], []
    # one compiled flex per shape: keep dynamo from giving up after its default recompile limit (8) and running
    # flex unfused (which materializes the score matrix and runs out of memory at S = 16k)
    torch._dynamo.config.cache_size_limit = 64
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 64
    for S in seqs:
        B = TOKENS // S
        for causal in (False, True):
            flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
            g = torch.Generator(device="cuda").manual_seed(S)
            base = [torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)]
            for name, (fn, layout) in _variants(causal, S, D).items():
                if only is not None and name not in only:
                    continue
                ts = base if layout == "bshd" else [t.transpose(1, 2) for t in base]
                q, k, v = (t.detach().requires_grad_() for t in ts[:3])
                try:
                    fwd_ms = bench(lambda: fn(q, k, v))
                    all_ms = bench(_fwd_bwd(fn, q, k, v, ts[3]))
                except Exception as e:  # a peer missing on this build must not stop the others
                    notes.append(f"{name} S={S} causal={causal}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                bwd_ms = max(all_ms - fwd_ms, 1e-6)
                rows.append(
                    {
                        "variant": name,
                        "S": S,
                        "B": B,
                        "H": H,
                        "D": D,
                        "causal": causal,
                        "fwd_ms": fwd_ms,
                        "fwd_bwd_ms": all_ms,
                        "fwd_tflops": flops / fwd_ms / 1e9,
                        "bwd_tflops": 2.5 * flops / bwd_ms / 1e9,
                        "fwd_bwd_tflops": 3.5 * flops / all_ms / 1e9,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
        write(_partial(_name(D, only), rows, notes, D), _OUT_DIR)  # keep what finished if time runs out
    return _partial(_name(D, only), rows, notes, D)


def _name(D: int, only: tuple[str, ...] | None) -> str:
    return f"attention-hd{D}" + ("-" + "-".join(only) if only else "")


def _partial(name: str, rows: list, notes: list, D: int) -> dict:
    return {
        "name": name,
        "rows": rows,
        "notes": notes,
        "config": {"tokens": TOKENS, "hidden": HIDDEN, "head_dim": D, "seqs": SEQS, "dtype": "bfloat16"},
    }


def varlen_lengths(layout: str, n_docs: int = 16, tokens: int = TOKENS) -> list[int]:
    """Document lengths of the packed family: ``"equal"`` (``tokens / n_docs`` each) or ``"random"`` (cut points
    drawn with seed 0, the pack of the first records)."""
    if layout == "equal":
        return [tokens // n_docs] * n_docs
    g = torch.Generator().manual_seed(0)
    cuts = torch.sort(torch.randperm(tokens - 1, generator=g)[: n_docs - 1] + 1).values
    bounds = [0, *cuts.tolist(), tokens]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def family_varlen() -> list[dict]:
    return [_varlen_pack(layout) for layout in ("equal", "random")]


def _varlen_pack(layout: str) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    D, H, n_docs = 128, 16, 16
    lens = varlen_lengths(layout, n_docs)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    flops = sum(4 * H * L * L * D * 0.5 for L in lens)
    doc = torch.repeat_interleave(torch.arange(n_docs, device="cuda"), torch.tensor(lens, device="cuda"))
    q, k, v, do = (torch.randn(TOKENS, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qb, kb, vb, dob = (t.transpose(0, 1)[None] for t in (q, k, v, do))  # (1, H, T, D) views
    bm = create_block_mask(
        lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (ki <= qi), None, None, TOKENS, TOKENS, device="cuda"
    )
    flex_c = torch.compile(flex_attention, dynamic=False)
    F = torch.nn.functional
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn_dense(a, b, c):  # type: ignore[no-untyped-def]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(a, b, c, is_causal=True)

    cases = {
        "ours-varlen": (
            lambda a, b, c: flash_attention(
                a, b, c, causal=True, cu_seqlens=cu, max_seqlen=max(lens), backend="triton"
            ),
            (q, k, v, do),
        ),
        "flex-document": (lambda a, b, c: flex_c(a, b, c, block_mask=bm), (qb, kb, vb, dob)),
        "ours-dense-causal": (
            lambda a, b, c: flash_attention(a[None], b[None], c[None], causal=True, backend="triton")[0],
            (q, k, v, do),
        ),
        "sdpa-cudnn-dense-causal": (cudnn_dense, (qb, kb, vb, dob)),
    }
    rows, notes = [], []
    for name, (fn, ts) in cases.items():
        a, b, c = (t.detach().requires_grad_() for t in ts[:3])
        try:
            fwd_ms = bench(lambda: fn(a, b, c))
            all_ms = bench(_fwd_bwd(fn, a, b, c, ts[3]))
            fwd_host = host_us(lambda: fn(a, b, c))
            fwd_bwd_host = host_us(_fwd_bwd(fn, a, b, c, ts[3]), calls=20)
        except Exception as e:
            notes.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
            continue
        rows.append(
            {
                "variant": name,
                "fwd_ms": fwd_ms,
                "fwd_host_us": fwd_host,
                "fwd_bwd_host_us": fwd_bwd_host,
                "fwd_bwd_ms": all_ms,
                "effective_fwd_tflops": flops / fwd_ms / 1e9,
                "effective_fwd_bwd_tflops": 3.5 * flops / all_ms / 1e9,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    for row in rows:  # after every eager timing: a failed capture cannot disturb them
        fn, ts = cases[row["variant"]]
        row["fwd_graph_ms"] = bench_graph(lambda fn=fn, ts=ts: fn(*ts[:3]))
        a, b, c = (t.detach().requires_grad_() for t in ts[:3])
        row["fwd_bwd_graph_ms"] = bench_graph(_fwd_bwd(fn, a, b, c, ts[3]), grad=True)
        print(json.dumps({k: row[k] for k in ("variant", "fwd_graph_ms", "fwd_bwd_graph_ms")}), flush=True)
    notes.append(
        "fwd_graph_ms / fwd_bwd_graph_ms: one CUDA-graph replay of the forward without autograd / of forward + "
        "autograd.grad (GPU time; the eager fwd_ms and fwd_bwd_ms also hold the host time of a call where the host "
        "is slower than the GPU); fwd_host_us / fwd_bwd_host_us: host time of one eager forward (inputs requiring "
        "grad) / forward + backward, 50 / 20 calls issued without a sync"
    )
    return {
        "name": "attention-varlen16" + ("-equal" if layout == "equal" else ""),
        "rows": rows,
        "notes": notes,
        "config": {
            "tokens": TOKENS,
            "docs": n_docs,
            "layout": layout,
            "dense_over_packed_flops": TOKENS * TOKENS / sum(L * L for L in lens),
            "lengths": lens,
            "H": H,
            "D": D,
            "dtype": "bfloat16",
            "flops_note": "effective FLOPs: sum over documents of 2*H*L^2*D (causal, fwd)",
        },
    }


def family_window() -> dict:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    D, H, S = 128, 16, TOKENS
    q, k, v, do = (torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    flex_c = torch.compile(flex_attention, dynamic=False)
    rows, notes = [], []
    for w in (256, 1024, 4096):
        bm = create_block_mask(lambda b, h, qi, ki, w=w: (ki <= qi) & (qi - ki < w), None, None, S, S, device="cuda")
        cases = {
            "ours": (
                lambda a, b, c, w=w: flash_attention(a, b, c, causal=True, window=w, backend="triton"),
                (q, k, v, do),
            ),
            "flex-window": (
                lambda a, b, c, bm=bm: flex_c(a, b, c, block_mask=bm),
                tuple(t.transpose(1, 2) for t in (q, k, v, do)),
            ),
        }
        for name, (fn, ts) in cases.items():
            a, b, c = (t.detach().requires_grad_() for t in ts[:3])
            try:
                fwd_ms = bench(lambda: fn(a, b, c))
                all_ms = bench(_fwd_bwd(fn, a, b, c, ts[3]))
            except Exception as e:
                notes.append(f"{name} w={w}: {type(e).__name__}: {str(e)[:200]}")
                continue
            rows.append({"variant": name, "window": w, "fwd_ms": fwd_ms, "fwd_bwd_ms": all_ms})
            print(json.dumps(rows[-1]), flush=True)
    return {
        "name": "attention-window",
        "rows": rows,
        "notes": notes,
        "config": {"S": S, "H": H, "D": D, "windows": [256, 1024, 4096], "dtype": "bfloat16"},
    }


def family_check() -> dict:
    """bf16 at larger shapes: kernel error <= 2x PyTorch bf16 error (+ 4 ulps of max(|ref|, 1)) vs fp64."""
    rows = []
    cases = [  # (B, S, H, H_kv, D, causal, window, packed)
        (2, 1024, 16, 4, 128, True, None, False),
        (2, 1023, 8, 8, 64, False, None, False),
        (1, 2048, 8, 1, 96, True, 300, False),
        (1, 1500, 16, 2, 80, True, None, True),
    ]
    for B, S, H, H_kv, D, causal, window, packed in cases:
        g = torch.Generator(device="cuda").manual_seed(S + D)
        mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        kw: dict = dict(causal=causal, window=window)
        if packed:
            q, k, v, do = mk(S, H, D), mk(S, H_kv, D), mk(S, H_kv, D), mk(S, H, D)
            kw["cu_seqlens"] = torch.tensor([0, 1, 200, 777, 1200, S], device="cuda")
        else:
            q, k, v, do = mk(B, S, H, D), mk(B, S, H_kv, D), mk(B, S, H_kv, D), mk(B, S, H, D)
        res = {}
        for label, fn, cast in (
            ("ours", lambda a, b, c: flash_attention(a, b, c, backend="triton", **kw), None),
            ("ref64", lambda a, b, c: flash_attention_ref(a, b, c, **kw), torch.float64),
            ("torch_bf16", lambda a, b, c: flash_attention_ref(a, b, c, upcast=False, **kw), None),
        ):
            leaves = [(t if cast is None else t.to(cast)).detach().requires_grad_() for t in (q, k, v)]
            out = fn(*leaves)
            res[label] = [out.detach(), *torch.autograd.grad(out, leaves, do if cast is None else do.to(cast))]
        row = {"variant": "ours", "case": [B, S, H, H_kv, D, causal, window, packed], "ok": True}
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            ref = res["ref64"][i]
            err = (res["ours"][i].double() - ref).abs().max().item()
            pt = (res["torch_bf16"][i].double() - ref).abs().max().item()
            floor = 4 * torch.finfo(torch.bfloat16).eps * max(ref.abs().max().item(), 1.0)
            nan = bool(torch.isnan(res["ours"][i]).any())
            row[name] = {"err": err, "torch_err": pt, "ratio": err / max(pt, 1e-30)}
            row["ok"] &= (err <= 2 * pt + floor) and not nan
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"name": "attention-check", "rows": rows, "notes": [], "config": {"cases": cases}}


PARITY_SHAPES = (
    (128, 1024, True),
    (128, 4096, False),
    (128, 4096, True),
    (128, 8192, False),
    (128, 16384, False),
    (128, 16384, True),
    (64, 4096, False),
    (64, 8192, True),
)


def family_parity(rounds: int = 9, shapes: tuple[tuple[int, int, bool], ...] = PARITY_SHAPES) -> dict:
    """``shapes``: ``(D, S, causal)``; the record is rewritten after each shape, so a run cut short keeps what it
    measured."""
    import statistics

    torch._dynamo.config.cache_size_limit = 64
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 64
    rows, peers = [], []
    for D, S, causal in shapes:
        B, H = TOKENS // S, HIDDEN // D
        g = torch.Generator(device="cuda").manual_seed(S + D)
        base = [torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)]
        fns = {}
        for name, (fn, layout) in _variants(causal, S, D).items():
            if name not in ("ours", "flex"):
                continue
            ts = base if layout == "bshd" else [t.transpose(1, 2) for t in base]
            q, k, v = (t.detach().requires_grad_() for t in ts[:3])
            fns[name] = (lambda fn=fn, q=q, k=k, v=v: fn(q, k, v), _fwd_bwd(fn, q, k, v, ts[3]))
        times: dict[str, dict[str, list[float]]] = {n: {"fwd": [], "fwd_bwd": []} for n in fns}
        for name in fns:  # compile / autotune outside the rounds
            bench(fns[name][0]), bench(fns[name][1])
        for i in range(rounds):
            for name in ("ours", "flex") if i % 2 == 0 else ("flex", "ours"):
                times[name]["fwd"].append(bench(fns[name][0]))
                times[name]["fwd_bwd"].append(bench(fns[name][1]))
        for t in times.values():
            t["bwd"] = [b - f for f, b in zip(t["fwd"], t["fwd_bwd"], strict=True)]
        shape = {"D": D, "S": S, "B": B, "H": H, "causal": causal}
        for name, out in (("ours", rows), ("flex", peers)):
            out.append(
                {"variant": name, **shape, **{f"{m}_ms": statistics.median(times[name][m]) for m in times[name]}}
            )
        for metric in ("fwd", "fwd_bwd", "bwd"):
            per_round = [f / o for o, f in zip(times["ours"][metric], times["flex"][metric], strict=True)]
            rows[-1][f"{metric}_ratio_median"] = statistics.median(per_round)
            rows[-1][f"{metric}_ratio_range"] = [min(per_round), max(per_round)]
            rows[-1][f"{metric}_rounds_ours_ahead"] = sum(r >= 1.0 for r in per_round)
        print(json.dumps(rows[-1]), flush=True)
        result = {
            "name": "attention-parity",
            "rows": rows + peers,
            "notes": [
                f"{rounds} interleaved rounds per shape; ratios are Flex time / our time per round (above 1: ours "
                "faster); *_ms are medians over the rounds"
            ],
            "config": {
                "tokens": TOKENS,
                "hidden": HIDDEN,
                "rounds": rounds,
                "dtype": "bfloat16",
                "shapes": [list(s) for s in shapes[: len(rows)]],
            },
        }
        write(result, _OUT_DIR)
    return result


def _all_shapes() -> tuple[tuple[int, int, bool], ...]:
    return tuple((D, S, causal) for D in (128, 64) for S in SEQS for causal in (False, True))


_SHAPE_KEYS = ("D", "S", "causal", "window")
_OUT_DIR: str | None = None


def _ratios(ours: list[dict], peers: list[dict]) -> list[dict]:
    """Per shape: peer time / our time (above 1: ours faster), forward and forward+backward."""
    out = []
    for o in ours:
        for p in peers:
            if any(o.get(key) != p.get(key) for key in _SHAPE_KEYS):
                continue
            for metric in ("fwd_ms", "fwd_bwd_ms"):
                if o.get(metric) and p.get(metric):
                    out.append(
                        {
                            "variant": o["variant"],
                            "peer": p["variant"],
                            "metric": metric,
                            "shape": {key: o.get(key) for key in _SHAPE_KEYS if key in o},
                            "ratio": p[metric] / o[metric],
                        }
                    )
    return out


def write(result: dict, out_dir: str | None) -> None:
    rows = result["rows"]
    ours = [r for r in rows if str(r.get("variant", "ours")).startswith("ours")]
    peers = [r for r in rows if r not in ours]
    rec = records.make_record(
        result["name"], result["config"], ours, peers, benchmark="attention", ratio_metric=None, notes=result["notes"]
    )
    rec["ratios"] = _ratios(ours, peers)
    path = records.write_record(rec, out_dir)
    print(f"wrote {path}", flush=True)


def render(directory: str | None = None) -> str:
    """Markdown tables (docs/flash_attention.md) from the attention-*.json records: the dense families and the
    GPU correctness check and the packed family per GPU (each GPU's newest record), the window family's newest
    record, and the parity record of every GPU."""
    every = [r for r in records.load_records(directory) if r.get("benchmark") == "attention"]
    recs: dict[str, dict] = {}
    per_gpu: dict[tuple[str, str], dict] = {}
    for r in sorted(every, key=lambda r: r["date"]):
        recs[r["name"]] = r
        per_gpu[(r["name"], r["env"]["device"])] = r
    gpus = sorted({gpu for _, gpu in per_gpu})
    lines = []
    for D, gpu in ((D, gpu) for D in (128, 64) for gpu in gpus):
        main_rec, flex_rec = per_gpu.get((f"attention-hd{D}", gpu)), per_gpu.get((f"attention-hd{D}-flex", gpu))
        if main_rec is None:
            continue
        peers = list(main_rec["peers"])
        same_run = flex_rec is not None and flex_rec["env"]["device"] == main_rec["env"]["device"]
        if same_run and flex_rec["date"] >= main_rec["date"]:  # the flex re-run replaces flex rows of the same shape
            redo = {(p["S"], p["causal"]) for p in flex_rec["peers"]}
            peers = [p for p in peers if not (p["variant"] == "flex" and (p["S"], p["causal"]) in redo)]
            peers += flex_rec["peers"]
        lines += [
            f"### head dim {D}, H = {2048 // D}, B*S = 16k, bf16, {gpu} ({main_rec['date'][:10]})",
            "",
            "| S | causal | ours fwd / bwd TF/s | ours, Triton forward: fwd TF/s | SDPA-flash | FlexAttention | "
            "SDPA-cuDNN |",
            "|---|---|---|---|---|---|---|",
        ]
        for o in (r for r in main_rec["results"] if r["variant"] == "ours"):
            tri = next((r for r in main_rec["results"] if r["variant"] == "ours-triton" and r["S"] == o["S"]
                        and r["causal"] == o["causal"]), None)  # fmt: skip
            gain = "-" if tri is None else f"{tri['fwd_tflops']:.0f} (ours {tri['fwd_ms'] / o['fwd_ms']:.2f}x)"
            tflops = f"{o['fwd_tflops']:.0f} / {o['bwd_tflops']:.0f}"
            cells = [str(o["S"]), "yes" if o["causal"] else "no", tflops, gain]
            for v in ("sdpa-flash", "flex", "sdpa-cudnn"):
                p = next(
                    (p for p in peers if p["variant"] == v and p["S"] == o["S"] and p["causal"] == o["causal"]), None
                )
                cells.append(
                    "-"
                    if p is None
                    else f"{p['fwd_tflops']:.0f} / {p['bwd_tflops']:.0f} "
                    f"(ours {o['fwd_tflops'] / p['fwd_tflops']:.2f}x / {o['bwd_tflops'] / p['bwd_tflops']:.2f}x)"
                )
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    packs = [per_gpu.get((name, gpu)) for name in ("attention-varlen16-equal", "attention-varlen16") for gpu in gpus]
    for var in packs:
        if var is None:
            continue
        rows = var["results"] + var["peers"]
        base = next(r for r in rows if r["variant"] == "ours-varlen")
        lens = var["config"]["lengths"]
        ideal = sum(lens) ** 2 / sum(L * L for L in lens)
        what = "of 1024 tokens each" if len(set(lens)) == 1 else f"of random lengths {min(lens)}..{max(lens)}"
        lines += [
            f"### 16 documents {what} packed into 16k tokens (hd128, H = 16, {var['env']['device']}); "
            f"FLOP ratio dense/packed = {ideal:.1f}",
            "",
            "| variant | fwd ms: eager / GPU (graph) | fwd+bwd ms: eager / GPU (graph) | effective fwd TF/s (eager) | "
            "ours-varlen speedup fwd: eager / GPU | fwd+bwd: eager / GPU |",
            "|---|---|---|---|---|---|",
        ]

        def pair(r: dict, base: dict, eager: str, graph: str) -> tuple[str, str]:
            g, bg = r.get(graph), base.get(graph)
            times = f"{r[eager]:.3f} / " + ("-" if g is None else f"{g:.3f}")
            ratio = f"{r[eager] / base[eager]:.2f}x / " + ("-" if g is None or bg is None else f"{g / bg:.2f}x")
            return times, ratio

        for r in rows:
            fwd, fwd_ratio = pair(r, base, "fwd_ms", "fwd_graph_ms")
            both, both_ratio = pair(r, base, "fwd_bwd_ms", "fwd_bwd_graph_ms")
            lines.append(
                f"| {r['variant']} | {fwd} | {both} | {r['effective_fwd_tflops']:.0f} | {fwd_ratio} | {both_ratio} |"
            )
        lines.append("")
    for par in sorted((r for r in every if r["name"] == "attention-parity"), key=lambda r: r["env"]["device"]):
        lines += [
            f"### Ours against FlexAttention in {par['config']['rounds']} interleaved rounds, {par['env']['device']}",
            "",
            "Median over rounds of Flex time / our time (range; rounds with ours ahead).",
            "",
            "| head dim | S | causal | forward | forward+backward | backward |",
            "|---|---|---|---|---|---|",
        ]
        for o in par["results"]:
            cells = [str(o["D"]), str(o["S"]), "yes" if o["causal"] else "no"]
            for m in ("fwd", "fwd_bwd", "bwd"):
                lo, hi = o[f"{m}_ratio_range"]
                n = par["config"]["rounds"]
                cells.append(f"{o[f'{m}_ratio_median']:.3f}x ({lo:.2f}-{hi:.2f}; {o[f'{m}_rounds_ours_ahead']}/{n})")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    win = recs.get("attention-window")
    if win is not None:
        rows = win["results"] + win["peers"]
        lines += [
            f"### Sliding window, S = 16k, B = 1, hd128, H = 16, {win['env']['device']}",
            "",
            "| window | ours fwd / fwd+bwd ms | Flex fwd / fwd+bwd ms |",
            "|---|---|---|",
        ]
        for w in win["config"]["windows"]:
            o = next((r for r in rows if r["variant"] == "ours" and r["window"] == w), None)
            f = next((r for r in rows if r["variant"] == "flex-window" and r["window"] == w), None)
            cell = lambda r: "-" if r is None else f"{r['fwd_ms']:.3f} / {r['fwd_bwd_ms']:.3f}"  # noqa: E731
            lines.append(f"| {w} | {cell(o)} | {cell(f)} |")
        lines.append("")
    for chk in (per_gpu[("attention-check", gpu)] for gpu in gpus if ("attention-check", gpu) in per_gpu):
        lines += [
            f"### bf16 correctness on the GPU ({chk['env']['device']}): max error vs fp64 (in brackets: its ratio to"
            " plain PyTorch bf16 error; the rule allows 2x)",
            "",
            "| B, S, H, H_kv, D, causal, window, packed | out | dq | dk | dv | pass |",
            "|---|---|---|---|---|---|",
        ]
        for r in chk["results"]:
            lines.append(
                "| "
                + ", ".join(str(c) for c in r["case"])
                + " | "
                + " | ".join(f"{r[k]['err']:.2g} ({r[k]['ratio']:.2f}x)" for k in ("out", "dq", "dk", "dv"))
                + f" | {r['ok']} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--family", required=True, choices=["hd64", "hd128", "varlen", "window", "check", "parity"])
    p.add_argument("--out", default=None, help="records directory (default benchmarks/results)")
    p.add_argument("--seqs", default=None, help="comma-separated sequence lengths (hd64/hd128; default all)")
    p.add_argument("--variants", default=None, help="comma-separated variants (hd64/hd128; default all)")
    p.add_argument("--render", action="store_true", help="print the markdown tables from the records and exit")
    p.add_argument(
        "--parity-all", action="store_true", help="parity: every hd128 and hd64 shape of the dense families"
    )
    args = p.parse_args() if "--render" not in sys.argv else p.parse_args(["--family", "check", "--render"])
    if args.render:
        print(render(args.out))
        return 0
    global _OUT_DIR
    _OUT_DIR = args.out
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    seqs = tuple(int(x) for x in args.seqs.split(",")) if args.seqs else SEQS
    only = tuple(args.variants.split(",")) if args.variants else None
    fn = {
        "hd64": lambda: family_dense(64, seqs, only),
        "hd128": lambda: family_dense(128, seqs, only),
        "varlen": family_varlen,
        "window": family_window,
        "check": family_check,
        "parity": lambda: family_parity(shapes=_all_shapes() if args.parity_all else PARITY_SHAPES),
    }[args.family]
    try:
        results = fn()
    except Exception:
        traceback.print_exc()
        return 1
    if args.family == "parity":
        return 0  # written after each shape
    for result in results if isinstance(results, list) else [results]:
        write(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
