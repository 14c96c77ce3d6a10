"""CPU threads sized to the machine (issue 52, item 5): the main job on the CPU cores, before and after.

The main job is the README's ``llmopt fit --config examples/configs/tiny_cpu.yaml``, shortened to ``--steps`` steps
with a validation halfway (``limit_val_batches`` 5); each run is a fresh process in a scratch folder, W&B off.

- ``before``: ``LLMOPT_NUM_THREADS=0``, which turns the sizing off entirely (torch's default intra-op threads,
  OpenMP's default wait policy, the workers as configured): what ``llmopt`` did before the change;
- ``after``: the defaults (``lightning_llmopt/cli/threads.py``: ``cores // processes`` threads, OpenMP threads
  waiting passively, workers at most the cores per process).

Scenarios: ``alone``; ``busy``, beside another busy process (``python -c 'while True: pass'``, not pinned, started
before the run and killed after it); ``two-process``, ``--trainer.devices 2`` (two ranks on the same cores). Within
each scenario the variants alternate (before, after, then after, before, ...), ``--repeats`` rounds; each figure is
the median. ``tokens_per_s`` is the summary's TrainingMonitor throughput (steps after the first two, a validation
included) times the number of ranks; ``wall_s`` the process's wall time, start-up (~10 s) included.

Beside them, to document the choices: ``one-thread`` (``--num_threads 1``: what a single thread gives);
``GOMP_SPINCOUNT=3000`` (libgomp's threads spin briefly before they sleep: between OpenMP's default, ``before``, and
the passive wait of ``after``); ``workers`` (``--data.num_workers 2`` alone: the rule's 2 threads against 1 thread,
as if each worker took a core); ``generate`` (``llmopt generate`` of the same model on CPU, alone and busy: OpenMP's
default wait, what generate keeps, against ``OMP_WAIT_POLICY=PASSIVE``).

The machine's load average is recorded before and after each run: on a machine shared with other jobs the figures
move with their load.

Usage: ``python benchmarks/bench_cpu_threads.py [--repeats 2] [--steps 60]`` (record in benchmarks/results/);
``--smoke`` runs 4 steps of a small config once per variant (record in a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package

import records  # noqa: E402

CONFIG = records.REPO_ROOT / "examples" / "configs" / "tiny_cpu.yaml"
CLI = [sys.executable, "-m", "lightning_llmopt.cli"]
GENERATE = ["generate", "--preset", "debug-1m", "--tokenizer", "byte", "--prompt", "hello", "--prompt", "def",
            "--prompt", "import", "--prompt", "class", "--max-tokens", "200", "--ignore-eos", "--device", "cpu",
            "--num-blocks", "128", "--dtype", "fp32"]  # fmt: skip
SMOKE = ["--data.max_bytes=200000", "--data.batch_size=2", "--data.seq_len=32", "--model.warmup_steps=1"]
BEFORE = {"LLMOPT_NUM_THREADS": "0"}
# scenario -> [(variant, extra fit arguments, extra environment)]; the first two of each are compared
SPIN = {"GOMP_SPINCOUNT": "3000"}  # OpenMP threads spin ~30 us (libgomp's estimate), then sleep; wins over the policy
FIT: dict[str, list[tuple[str, list[str], dict[str, str]]]] = {
    "alone": [("before", [], BEFORE), ("after", [], {}), ("one-thread", ["--num_threads", "1"], {}),
              ("GOMP_SPINCOUNT=3000", [], SPIN)],
    "busy": [("before", [], BEFORE), ("after", [], {}), ("one-thread", ["--num_threads", "1"], {}),
             ("GOMP_SPINCOUNT=3000", [], SPIN)],
    "two-process": [("before", ["--trainer.devices", "2"], BEFORE), ("after", ["--trainer.devices", "2"], {})],
    "workers": [("after", ["--data.num_workers", "2"], {}),
                ("after, 1 thread", ["--data.num_workers", "2", "--num_threads", "1"], {})],
}  # fmt: skip
# generate: OpenMP's default wait (what generate keeps; the same as before the change on these cores) against passive
GEN_VARIANTS = [("after (OpenMP's default wait)", {}), ("OMP_WAIT_POLICY=PASSIVE", {"OMP_WAIT_POLICY": "PASSIVE"})]
GEN = {"generate-alone": False, "generate-busy": True}  # scenario -> beside a busy process


def _env(extra: dict[str, str]) -> dict[str, str]:
    drop = ("WANDB_", "OMP_", "GOMP_", "KMP_", "MKL_NUM_THREADS", "LLMOPT_NUM_THREADS", "LLMOPT_RUN_DIR")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(PYTHONPATH=str(records.REPO_ROOT), WANDB_MODE="disabled", **extra)
    return env


@contextmanager
def busy_neighbour(on: bool) -> Iterator[None]:
    """Another process spinning on one core for the duration (not pinned: the scheduler places it)."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if on else None
    try:
        if proc is not None:
            time.sleep(1.0)  # running before the measured process starts
        yield
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


def fit_args(steps: int, smoke: bool) -> list[str]:
    half = max(1, steps // 2)
    return ["fit", "--config", str(CONFIG), f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={half}",
            "--trainer.limit_val_batches=5", "--wandb=false", *(SMOKE if smoke else [])]  # fmt: skip


def generate_args(smoke: bool) -> list[str]:
    return [*GENERATE[: GENERATE.index("--max-tokens")], "--max-tokens", "8", *GENERATE[GENERATE.index("--device"):]] \
        if smoke else GENERATE


def run_once(args: list[str], extra_env: dict[str, str], busy: bool, ranks: int) -> dict[str, Any]:
    """One fresh ``llmopt`` process in a scratch folder: its throughput, wall time, thread line and the load."""
    scratch = Path(tempfile.mkdtemp(prefix="llmopt-threads-"))
    load_before = os.getloadavg()[0]
    try:
        with busy_neighbour(busy):
            start = time.perf_counter()
            out = subprocess.run([*CLI, *args], cwd=scratch, env=_env(extra_env), capture_output=True, text=True,
                                 timeout=1800)  # fmt: skip
            wall = time.perf_counter() - start
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if out.returncode != 0:
        raise RuntimeError(f"{args} failed (exit {out.returncode}): {out.stderr[-3000:]}")
    text = out.stdout + out.stderr
    fit = re.search(r"throughput: ([0-9,.]+) tokens/s per device", text)
    gen = re.search(r"throughput=([0-9.]+) tok/s", text)
    if fit is None and gen is None:
        raise RuntimeError(f"{args}: no throughput line in the output: {text[-3000:]}")
    rate = float(fit.group(1).replace(",", "")) * ranks if fit else float(gen.group(1))  # type: ignore[union-attr]
    line = next((ln.split("CPU threads: ", 1)[1] for ln in text.splitlines() if "CPU threads: " in ln), "")
    return {"tokens_per_s": rate, "wall_s": wall, "threads_line": line,
            "load_before": load_before, "load_after": os.getloadavg()[0]}  # fmt: skip


def _row(scenario: str, variant: str, runs: list[dict[str, Any]], command: str) -> dict[str, Any]:
    return {
        "variant": f"{variant}, {scenario}",
        "scenario": scenario,
        "command": command,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "runs_tokens_per_s": [round(r["tokens_per_s"], 1) for r in runs],
        "runs_wall_s": [round(r["wall_s"], 1) for r in runs],
        "load_average": [[round(r["load_before"], 2), round(r["load_after"], 2)] for r in runs],
        "threads_line": runs[-1]["threads_line"],
    }


def _rounds(n_variants: int, repeats: int) -> Iterator[int]:
    """Variant indices in alternating order: 0 1 2, then 2 1 0, ... (ABAB across rounds)."""
    for r in range(repeats):
        yield from range(n_variants) if r % 2 == 0 else reversed(range(n_variants))


def run(steps: int, repeats: int, smoke: bool, only: list[str] | None) -> dict[str, Any]:
    load_start = os.getloadavg()
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    for scenario, variants in FIT.items():
        if only and scenario not in only:
            continue
        runs: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(variants))}
        for i in _rounds(len(variants), repeats):
            name, extra, env = variants[i]
            ranks = 2 if "--trainer.devices" in extra else 1
            runs[i].append(run_once([*fit_args(steps, smoke), *extra], env, scenario == "busy", ranks))
            print(json.dumps({"scenario": scenario, "variant": name, **runs[i][-1]}), flush=True)
        env_shown = {i: " ".join(f"{k}={v}" for k, v in variants[i][2].items()) for i in runs}
        rows[scenario] = {
            variants[i][0]: _row(scenario, variants[i][0], runs[i],
                                 f"{env_shown[i]} llmopt {' '.join(fit_args(steps, smoke) + variants[i][1])}".strip())
            for i in runs
        }  # fmt: skip
    command = " ".join(["llmopt", *generate_args(smoke)])
    for scenario, busy in GEN.items():
        if only and scenario not in only:
            continue
        gen_runs: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(GEN_VARIANTS))}
        for i in _rounds(len(GEN_VARIANTS), repeats):
            name, env = GEN_VARIANTS[i]
            gen_runs[i].append(run_once(generate_args(smoke), env, busy, 1))
            print(json.dumps({"scenario": scenario, "variant": name, **gen_runs[i][-1]}), flush=True)
        rows[scenario] = {GEN_VARIANTS[i][0]: _row(scenario, GEN_VARIANTS[i][0], runs, command)
                          for i, runs in gen_runs.items()}  # fmt: skip
    return make(rows, steps, repeats, smoke, load_start)


def make(rows: dict[str, dict[str, dict[str, Any]]], steps: int, repeats: int, smoke: bool,
         load_start: tuple[float, float, float]) -> dict[str, Any]:  # fmt: skip
    load_end = os.getloadavg()
    results = [r for s in rows.values() for name, r in s.items() if name != "before"]
    peers = [s["before"] for s in rows.values() if "before" in s]
    ratios = []
    for scenario in rows.values():  # within a scenario only: every variant against the one before the change
        for name, row in scenario.items():
            if name != "before" and "before" in scenario:
                for metric in ("tokens_per_s", "wall_s"):
                    ratios += records.compute_ratios([row], [scenario["before"]], metric)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    config = {
        "job": f"llmopt fit --config examples/configs/tiny_cpu.yaml, {steps} steps, validation at step "
        f"{max(1, steps // 2)} (5 batches){' (smoke: small data)' if smoke else ''}",
        "repeats": repeats,
        "machine": f"{cores} CPU cores shared with other jobs (load average {load_start[0]:.1f} at the start, "
        f"{load_end[0]:.1f} at the end; per run in each row's load_average: [before, after])",
        "busy_neighbour": "python -c 'while True: pass', not pinned, started 1 s before the run, killed after",
        "before": "LLMOPT_NUM_THREADS=0: no sizing (torch's default threads, OpenMP's default wait policy)",
    }
    notes = [
        "tokens_per_s: TrainingMonitor's summary (all ranks), a validation included; generate: the engine's "
        "throughput line; wall_s: the whole process, start-up included; medians over the rounds (runs_*: each run)",
        "the variants of a scenario alternate within the rounds (before, after, then after, before), so that a "
        "change in the machine's load falls on both; ratios compare variants within one scenario only",
    ]
    return records.make_record("cpu-threads", config, results, peers, benchmark="threads", ratio_metric=None,
                               notes=notes) | {"ratios": ratios}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The CPU training job before and after sizing its threads.")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--only", nargs="*", default=None, help=f"scenarios: {', '.join([*FIT, *GEN])}")
    parser.add_argument("--smoke", action="store_true", help="4 steps of a small config, once, temporary record")
    parser.add_argument("--results-dir", type=Path, default=None)
    parser.add_argument("--note", action="append", default=[], help="a note added to the record (repeatable)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.repeats = 4, 1
    results_dir = args.results_dir or (Path(tempfile.mkdtemp(prefix="llmopt-bench-")) if args.smoke else None)
    record = run(args.steps, args.repeats, args.smoke, args.only)
    record["notes"] += args.note
    path = records.write_record(record, results_dir)
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
