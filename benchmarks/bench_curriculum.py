"""Validation loss against training tokens, with and without a curriculum, on the default corpus (CPU is fine).

Both runs train ``CausalLMModule("debug-1m")`` on ``TextDataModule`` (byte tokenizer, Python standard library, seq
256) from the same seed, and validate on the same held-out split every ``--val-every`` steps. The curriculum run adds
``Curriculum(scorer, pacing)``; by default lexical diversity (byte type-token ratio: repetitive, indented code first)
with root-2 pacing (Platanios et al. 2019) from ``c0 = 0.1`` to full competence at half the run, so the second half
trains on the same distribution as the baseline. Writes ``benchmarks/results/curriculum-<device>.json`` (via
``records.py``) and prints a (tokens, val loss) table.

    python benchmarks/bench_curriculum.py                   # 300 steps per run, ~5-8 min on 2 CPU cores
    python benchmarks/bench_curriculum.py --scorer length --pacing linear
    python benchmarks/bench_curriculum.py --smoke           # seconds: code path only, record in a temp folder
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package
import records  # noqa: E402


def _val_recorder(tokens_per_step: int) -> Any:
    from lightning.pytorch.callbacks import Callback

    class ValRecorder(Callback):
        """(step, training tokens, val loss) after every validation run outside the sanity check."""

        def __init__(self) -> None:
            self.rows: list[dict[str, float]] = []

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            if trainer.sanity_checking or "val/loss" not in trainer.callback_metrics:
                return
            step = trainer.global_step
            loss = float(trainer.callback_metrics["val/loss"])
            self.rows.append({"step": step, "tokens": step * tokens_per_step, "val_loss": loss})

    return ValRecorder()


def run_variant(args: argparse.Namespace, curriculum: bool) -> dict[str, Any]:
    """Train one run in this process and return its curve."""
    import lightning as L

    from lightning_llmopt import CausalLMModule
    from lightning_llmopt.callbacks.curriculum import Curriculum
    from lightning_llmopt.data import TextDataModule

    L.seed_everything(args.seed, verbose=False)
    data = TextDataModule(seq_len=args.seq_len, batch_size=args.batch_size, val_fraction=args.val_fraction,
                          max_bytes=args.max_bytes, seed=args.seed)
    module = CausalLMModule("debug-1m", learning_rate=args.lr, warmup_steps=args.warmup_steps, max_steps=args.steps)
    recorder = _val_recorder(args.batch_size * args.seq_len)
    callbacks: list[Any] = [recorder]
    if curriculum:
        callbacks.append(Curriculum(scorer=args.scorer, pacing=args.pacing, c0=args.c0,
                                    total_steps=args.curriculum_steps))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, val_check_interval=args.val_every,
                        check_val_every_n_epoch=None, limit_val_batches=args.val_batches, num_sanity_val_steps=0,
                        gradient_clip_val=1.0, callbacks=callbacks, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    start = time.perf_counter()
    trainer.fit(module, data)
    elapsed = time.perf_counter() - start
    curve = recorder.rows
    return {
        "variant": "curriculum" if curriculum else "baseline",
        "final_val_loss": curve[-1]["val_loss"],
        "mean_val_loss": sum(r["val_loss"] for r in curve) / len(curve),
        "train_tokens": args.steps * args.batch_size * args.seq_len,
        "wall_s": elapsed,
        "curve": curve,
        "unigram_entropy": data.unigram_entropy(),
    }


def _table(ours: dict[str, Any], peer: dict[str, Any]) -> str:
    lines = ["| step | tokens | baseline val loss | curriculum val loss |", "|---:|---:|---:|---:|"]
    for a, b in zip(peer["curve"], ours["curve"], strict=True):
        lines.append(f"| {a['step']} | {a['tokens']:,} | {a['val_loss']:.4f} | {b['val_loss']:.4f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--val-every", type=int, default=50)
    parser.add_argument("--val-batches", type=int, default=20, help="validation batches (the same ones every time)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--max-bytes", type=int, default=8_000_000)
    parser.add_argument("--val-fraction", type=float, default=0.02)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--scorer", default="lexical_diversity")
    parser.add_argument("--pacing", default="root")
    parser.add_argument("--c0", type=float, default=0.1)
    parser.add_argument("--curriculum-steps", type=int, default=None, help="full competence at (default steps // 2)")
    parser.add_argument("--results-dir", type=Path, default=None, help="default benchmarks/results (temp w/ smoke)")
    parser.add_argument("--smoke", action="store_true", help="a few steps on 200 kB: checks the code path only")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.val_every, args.val_batches, args.max_bytes, args.seq_len = 6, 3, 2, 200_000, 64
        args.warmup_steps = 2
        args.results_dir = args.results_dir or Path(tempfile.mkdtemp(prefix="llmopt-bench-"))
    args.curriculum_steps = args.curriculum_steps or max(1, args.steps // 2)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    baseline = run_variant(args, curriculum=False)
    ours = run_variant(args, curriculum=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config.update(model="debug-1m", tokenizer="byte", corpus="python stdlib (default corpus)")
    record = records.make_record(
        "curriculum",
        config,
        [ours],
        [baseline],
        ratio_metric="final_val_loss",
        reference={"unigram_entropy_nats": baseline["unigram_entropy"]},
        notes=[
            "val loss in nats/token on the same held-out chunks; tokens = training tokens seen (no seq-len warm-up)",
            "ratio > 1: the curriculum run ends with the lower validation loss",
            "smoke run: not a measurement" if args.smoke else "",
        ],
    )
    path = records.write_record(record, args.results_dir)
    print(_table(ours, baseline))
    print(f"final val loss: baseline {baseline['final_val_loss']:.4f}, curriculum {ours['final_val_loss']:.4f} "
          f"(unigram {baseline['unigram_entropy']:.4f}); wall {baseline['wall_s']:.0f} s + {ours['wall_s']:.0f} s")
    print(f"record: {path}")


if __name__ == "__main__":
    main()
