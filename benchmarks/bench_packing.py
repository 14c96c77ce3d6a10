"""Useful-token training throughput of packed rows (document masks) against padded batches, on one GPU.

A synthetic long-tailed corpus (lognormal document lengths, median ~300 tokens, clamped to [8, seq_len], fixed seed,
random token ids) is trained on with the ``1b`` preset (``--preset 125m`` is faster) under bf16 autocast, fused AdamW,
seq 4096, micro-batch budget ``B * seq_len`` tokens per step. Variants, each in its own process:

- ``padded-row`` (peer): one document per row, padded to ``seq_len``; plain causal attention (SDPA).
- ``padded-dynamic`` (peer): documents in corpus order, as many per batch as fit ``B * seq_len`` once padded to the
  longest of the batch; plain causal attention (SDPA).
- ``packed-flex``: first-fit-decreasing rows of ``seq_len`` with ``positions``/``doc_ids``, ``"flex"`` backend
  (compiled FlexAttention with a document block mask, built every step).
- ``packed-sdpa``: the same rows with the ``"sdpa"`` backend (dense boolean mask).

Metric: ``useful_tokens_per_s`` = non-padding tokens trained on per second (median over timed steps of useful tokens
/ step time). Goal: packed >= 1.5x padded. One record ``benchmarks/results/packing-<preset>-<device>.json`` with the
padded variants as peers.

    python benchmarks/bench_packing.py                 # 1b, seq 4096, on one GPU (< 4 minutes on an H100)
    python benchmarks/bench_packing.py --preset 125m
    python benchmarks/bench_packing.py --smoke         # CPU, preset "tiny", seq 128, fp32: code path only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package
import records  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("padded-row", "padded-dynamic", "packed-flex", "packed-sdpa")
PEERS = ("padded-row", "padded-dynamic")




def corpus_lengths(num_docs: int, seq_len: int, median: float, seed: int = 0) -> list[int]:
    """Lognormal lengths (sigma 1) with the given median, clamped to ``[8, seq_len]``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    raw = (math.log(median) + torch.randn(num_docs, generator=g, dtype=torch.float64)).exp()
    return raw.clamp(8, seq_len).long().tolist()


def _batches(variant: str, args: argparse.Namespace, vocab: int, steps: int) -> list[dict[str, Any]]:
    """``steps`` batches of the variant (CPU tensors) with their ``useful_tokens`` (document tokens, not padding).

    Padded variants take documents in corpus order; packed variants pack the whole corpus with the streaming FFD
    packer (buffer 1024, as ``TextDataModule`` does) and draw ``steps * B`` rows by a seeded permutation.
    """
    import torch

    from lightning_llmopt.data.packing import StreamingPacker, build_row

    T, B = args.seq_len, args.micro_batch
    lengths = corpus_lengths(args.num_docs, T, args.median)
    g = torch.Generator().manual_seed(1)
    stream = torch.randint(0, vocab, (sum(lengths),), generator=g)
    offsets = [0]
    for n in lengths[:-1]:
        offsets.append(offsets[-1] + n)
    out: list[dict[str, Any]] = []
    if variant.startswith("packed"):
        rows = list(StreamingPacker(T, 1024, "ffd").pack_lengths(lengths))
        order = torch.randperm(len(rows), generator=g).tolist()
        for s in range(steps):
            chosen = [rows[order[(s * B + r) % len(rows)]] for r in range(B)]
            built = [build_row(stream, offsets, pieces, T) for pieces in chosen]
            batch: dict[str, Any] = {k: torch.stack([b[k] for b in built]) for k in built[0]}
            batch["useful_tokens"] = sum(p.length for pieces in chosen for p in pieces)
            out.append(batch)
        return out
    cursor = 0
    for _ in range(steps):
        take, longest = 0, 0
        if variant == "padded-row":
            take = B
        while variant == "padded-dynamic" and take < len(lengths):
            widest = max(longest, lengths[(cursor + take) % len(lengths)])
            if (take + 1) * widest > B * T:
                break
            take, longest = take + 1, widest
        docs = [(cursor + i) % len(lengths) for i in range(take)]
        width = T if variant == "padded-row" else longest
        ids = torch.zeros(take, width, dtype=torch.int64)
        labels = torch.full((take, width), -100, dtype=torch.int64)
        for r, d in enumerate(docs):
            tokens = stream[offsets[d] : offsets[d] + lengths[d]]
            ids[r, : lengths[d]] = tokens
            labels[r, : lengths[d] - 1] = tokens[1:]
        out.append({"input_ids": ids, "labels": labels, "useful_tokens": sum(lengths[d] for d in docs)})
        cursor += take
    return out


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    import lightning_llmopt.models.attention_flex  # noqa: F401  (registers "flex")
    from lightning_llmopt.models import Llama, LlamaConfig

    variant = args.worker
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        raise SystemExit("bench_packing needs a CUDA GPU (use --smoke for a CPU check of the code path)")
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    backend = "flex" if variant == "packed-flex" else "sdpa"
    config = LlamaConfig.from_preset(args.preset, attn_backend=backend, max_seq_len=max(args.seq_len, 256))
    with torch.device(device):
        model = Llama(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    batches = _batches(variant, args, config.vocab_size, args.warmup_steps + args.steps)
    times: list[float] = []
    rates: list[float] = []
    for step, batch in enumerate(batches):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        inputs = {k: v.to(device, non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = model(inputs["input_ids"], positions=inputs.get("positions"), doc_ids=inputs.get("doc_ids"))
        loss = F.cross_entropy(logits.float().flatten(0, 1), inputs["labels"].flatten(), ignore_index=-100)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if step >= args.warmup_steps:
            times.append(elapsed)
            rates.append(batch["useful_tokens"] / elapsed)
    slots = [b["input_ids"].numel() for b in batches[args.warmup_steps :]]
    useful = [b["useful_tokens"] for b in batches[args.warmup_steps :]]
    row: dict[str, Any] = {
        "variant": variant,
        "attn_backend": backend,
        "useful_tokens_per_s": statistics.median(rates),
        "median_step_ms": statistics.median(times) * 1e3,
        "useful_fraction": sum(useful) / sum(slots),
        "mean_tokens_per_step": sum(slots) / len(slots),
        "final_loss": loss.item(),
        "timed_steps": len(times),
    }
    if cuda:
        row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def _run_one(args: argparse.Namespace, variant: str) -> dict[str, Any] | None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            variant,
            "--json-out",
            str(out),
            "--preset",
            args.preset,
            "--seq-len",
            str(args.seq_len),
            "--micro-batch",
            str(args.micro_batch),
            "--warmup-steps",
            str(args.warmup_steps),
            "--steps",
            str(args.steps),
            "--num-docs",
            str(args.num_docs),
            "--median",
            str(args.median),
        ] + (["--smoke"] if args.smoke else [])
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        try:
            proc = subprocess.run(cmd, env=env, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"[{variant}] timed out after {args.timeout} s", file=sys.stderr)
            return None
        return json.loads(out.read_text()) if proc.returncode == 0 and out.exists() else None


def _print_table(rows: list[dict[str, Any]], peer: dict[str, Any] | None) -> None:
    head = f"{'variant':>15} {'backend':>7} {'useful tok/s':>13} {'step ms':>9} {'useful %':>9} {'vs padded-row':>13}"
    print(head)
    print("-" * len(head))
    for r in rows:
        ratio = r["useful_tokens_per_s"] / peer["useful_tokens_per_s"] if peer else float("nan")
        print(
            f"{r['variant']:>15} {r['attn_backend']:>7} {r['useful_tokens_per_s']:>13,.0f} "
            f"{r['median_step_ms']:>9.1f} {r['useful_fraction']:>9.1%} {ratio:>12.2f}x"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Packed vs padded useful-token training throughput.")
    parser.add_argument("--preset", default=None, help="model preset (default 1b; tiny with --smoke)")
    parser.add_argument("--seq-len", type=int, default=None, help="row length (default 4096; 128 with --smoke)")
    parser.add_argument("--micro-batch", type=int, default=None, help="rows per step B (default 4; 2 with --smoke)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="untimed steps (default 4; 1 with --smoke)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 12; 2 with --smoke)")
    parser.add_argument("--num-docs", type=int, default=20000, help="documents in the synthetic corpus")
    parser.add_argument("--median", type=float, default=None, help="median document length (300; 24 w/ --smoke)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per variant process")
    parser.add_argument("--results-dir", type=Path, default=None, help="default benchmarks/results (temp w/ smoke)")
    parser.add_argument("--smoke", action="store_true", help="CPU, fp32, tiny preset: checks the code path only")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    smoke = args.smoke
    args.preset = args.preset or ("tiny" if smoke else "1b")
    args.seq_len = args.seq_len or (128 if smoke else 4096)
    args.micro_batch = args.micro_batch or (2 if smoke else 4)
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (1 if smoke else 4)
    args.steps = args.steps if args.steps is not None else (2 if smoke else 12)
    args.median = args.median or (24.0 if smoke else 300.0)
    if smoke:
        args.num_docs = min(args.num_docs, 300)
    if args.worker is not None:
        Path(args.json_out).write_text(json.dumps(run_variant(args)))
        return 0

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; choose from {VARIANTS}")
    rows, failed = [], []
    for variant in variants:
        print(f"[{variant}] {args.preset}, seq {args.seq_len}, micro-batch {args.micro_batch}", flush=True)
        row = _run_one(args, variant)
        (rows.append(row) if row is not None else failed.append(variant))
    if rows:
        results = [r for r in rows if r["variant"] not in PEERS]
        peers = [r for r in rows if r["variant"] in PEERS]
        config = {
            k: getattr(args, k)
            for k in ("preset", "seq_len", "micro_batch", "warmup_steps", "steps", "num_docs", "median")
        }
        config.update(
            precision="fp32" if smoke else "bf16-autocast",
            packing="ffd",
            lengths="lognormal(sigma=1), clamped to [8, seq_len], seed 0",
        )
        notes = [
            "useful tokens: inputs that are document tokens (padding excluded); median over timed steps",
            "packed rows: streaming FFD (buffer 1024) over the whole corpus, rows drawn by a seeded permutation",
            "step time includes the host-to-device copy and, for flex, building the block mask",
        ]
        if smoke:
            notes.append("smoke: CPU; flex has no CPU backward, so packed-flex trains through the SDPA fallback")
        record = records.make_record(
            f"packing-{args.preset}",
            config=config,
            results=results,
            peers=peers,
            benchmark="packing",
            ratio_metric="useful_tokens_per_s",
            notes=notes,
        )
        results_dir = args.results_dir or (Path(tempfile.mkdtemp(prefix="llmopt-bench-")) if smoke else None)
        path = records.write_record(record, results_dir)
        _print_table(rows, next((r for r in rows if r["variant"] == "padded-row"), None))
        print(f"record: {path}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
