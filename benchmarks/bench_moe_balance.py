"""MoE load balancing on a synthetic skewed-token task (CPU): load coefficient of variation per balancing method.

A small MoE Llama (``tiny`` preset, 8 experts, top-2, MoE in every block) trains on random rows whose token ids
follow a Zipf law (a few ids dominate), which pushes the router towards a few experts. For each method the same
seed, data and steps are used:

- ``none``: no balancing (dropless);
- ``aux_loss``: Switch balance loss (coefficient 0.01);
- ``aux_free``: DeepSeek-V3 selection bias (rate ``--bias-rate``, 1e-2: this run has 200 steps, not thousands);
- ``capacity``: capacity factor 1.0 with priority dropping (no loss term; the load it serves is capped);
- ``aux_loss+z``: the balance loss plus the router z-loss (1e-3).

Metric: the coefficient of variation (std/mean) of kept tokens per expert, averaged over MoE layers and over the
last half of the steps (``moe/load_cv``); lower is more balanced. Record: ``benchmarks/results/moe-balance-cpu.json``.

    python benchmarks/bench_moe_balance.py              # ~1-2 minutes on 2 cores
    python benchmarks/bench_moe_balance.py --smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package
import records  # noqa: E402

METHODS: dict[str, dict[str, Any]] = {
    "none": {"balance": "none"},
    "aux_loss": {"balance": "aux_loss", "aux_loss_coef": 0.01},
    "aux_free": {"balance": "aux_free"},
    "capacity": {"balance": "none", "capacity_factor": 1.0},
    "aux_loss+z": {"balance": "aux_loss", "aux_loss_coef": 0.01, "z_loss_coef": 1e-3},
}


def _zipf_rows(vocab: int, seq: int, rows: int, alpha: float, seed: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    probs = ranks.pow(-alpha)
    ids = torch.multinomial(probs / probs.sum(), rows * (seq + 1), replacement=True, generator=g)
    return ids.view(rows, seq + 1)


def run(method: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from lightning_llmopt.models import Llama, LlamaConfig
    from lightning_llmopt.models.moe import moe_aux_loss, update_balance_bias

    torch.manual_seed(0)
    moe = {"num_experts": 8, "top_k": 2, "bias_update_rate": args.bias_rate, **METHODS[method]}
    config = LlamaConfig.from_preset("tiny", moe=moe, n_layers=2 if args.smoke else 4)
    model = Llama(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = _zipf_rows(config.vocab_size, args.seq_len, args.steps * args.batch, args.alpha, seed=1)
    cvs, dropped, losses = [], [], []
    start = time.perf_counter()
    for step in range(args.steps):
        rows = data[step * args.batch : (step + 1) * args.batch]
        logits = model(rows[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
        aux = moe_aux_loss(model)
        (loss + aux).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        stats = update_balance_bias(model)
        cvs.append(float(stats["load_cv"].mean()))
        dropped.append(float(stats["dropped_fraction"].mean()))
        losses.append(float(loss.detach()))
    half = args.steps // 2
    return {
        "variant": method,
        "moe": moe,
        "load_cv": statistics.mean(cvs[half:]),
        "load_cv_first_step": cvs[0],
        "dropped_fraction": statistics.mean(dropped[half:]),
        "final_loss": statistics.mean(losses[-5:]),
        "wall_s": round(time.perf_counter() - start, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--alpha", type=float, default=1.2, help="Zipf exponent of token frequencies")
    parser.add_argument("--bias-rate", type=float, default=1e-2, help="DeepSeek-V3 used 1e-3 over far more steps")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--results-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    args.steps = args.steps or (6 if args.smoke else 200)
    rows = {m: run(m, args) for m in METHODS}
    for r in rows.values():
        print(
            f"{r['variant']:>12}: load CV {r['load_cv']:.3f} (step 1: {r['load_cv_first_step']:.3f}), "
            f"dropped {r['dropped_fraction']:.3f}, loss {r['final_loss']:.3f}, {r['wall_s']} s"
        )
    base = rows["none"]["load_cv"]
    verdicts = [
        f"{m}: load CV {r['load_cv']:.3f} vs none {base:.3f} -> {'LOWER' if r['load_cv'] < base else 'NOT LOWER'}"
        for m, r in rows.items()
        if m != "none"
    ]
    for v in verdicts:
        print(v)
    record = records.make_record(
        "moe-balance" if not args.smoke else "moe-balance-smoke",
        config={
            "preset": "tiny",
            "n_layers": 2 if args.smoke else 4,
            "num_experts": 8,
            "top_k": 2,
            "steps": args.steps,
            "batch": args.batch,
            "seq_len": args.seq_len,
            "zipf_alpha": args.alpha,
            "optimizer": "AdamW lr 3e-3",
            "data": "Zipf-distributed token ids, seed 1",
        },
        results=[r for m, r in rows.items() if m != "none"],
        peers=[rows["none"]],
        benchmark="moe",
        ratio_metric="load_cv",
        notes=[
            "load_cv: std/mean of kept tokens per expert, mean over MoE layers and over the last half of the "
            "steps (lower is more balanced); ratio = none / method",
            *verdicts,
        ],
    )
    path = records.write_record(record, args.results_dir or (Path("/tmp") if args.smoke else records.RESULTS_DIR))
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
