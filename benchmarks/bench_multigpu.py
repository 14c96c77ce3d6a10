"""The fast path on several GPUs (issue 56): every strategy with the fused kernels against one GPU and the peers.

One process drives many ``torchrun`` launches (each variant its own process group, through ``launch.launch``) and
packs them onto the host's GPUs side by side: a launch gets ``CUDA_VISIBLE_DEVICES`` of free GPUs, launches start in
list order, and none starts while an earlier one waits for GPUs. Concurrent launches share the host's CPUs and the
links of other GPUs, never a GPU; each row names its GPUs and the launches that ran beside it. Families:

- ``dp``: the 1b preset, sequence 2048, micro-batch 8 then 4 per GPU: ``single`` (our module on one GPU, the
  per-GPU baseline), ``ddp``, ``zero1``, ``zero2``, ``zero3`` on 2 and 4 GPUs, and the peer ``fsdp-hf-liger``
  (Lightning ``FSDPStrategy`` + transformers ``LlamaForCausalLM`` + Liger-Kernel), all from ``bench_zero.py``'s
  worker. Goals: per-GPU tokens/s >= 0.9x ``single`` at the same micro-batch; ours >= 1.25x the peer at <= its
  peak memory.
- ``nd``: ``NDParallelStrategy`` tp2 and pp2 (1b, sequence 2048, 8 rows per step) and cp2 (sequence 8192, 1 row)
  on 2 GPUs from ``bench_nd_parallel.py``'s worker, beside ``single`` at the same rows and length: recorded.
- ``8b``: llama3-8b, all 32 layers, sequence 8192, 1 row per GPU on 4 GPUs: our compositions (ZeRO-3 / ZeRO-2,
  with and without full activation checkpointing), the peer ``fsdp-hf-liger`` and torchtitan's own Llama-3 8B
  setup (``peer_torchtitan.py``, when ``--titan-site`` names where its wheels were installed). Goals: MFU >= 50%
  of 989 TFLOP/s (causal attention counted as half), >= 1.3x the peer.

Records: ``multigpu-1b``, ``multigpu-nd-1b`` and ``multigpu-llama3-8b-4gpu`` (``benchmarks/results/``), rewritten
after every launch so a call cut short keeps what ran.

    python benchmarks/bench_multigpu.py --family dp nd 8b      # on a 4-GPU host
    python benchmarks/bench_multigpu.py --family dp --smoke    # CPU, gloo, tiny: the code paths only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package
import launch  # noqa: E402
import records  # noqa: E402

BENCH = Path(__file__).resolve().parent
DATASHEET_BF16_TFLOPS = 989.0
GOAL_SCALING = 0.9
GOAL_VS_PEER_1B = 1.25
GOAL_VS_PEER_8B = 1.3
GOAL_MFU_8B = 0.50
PEERS = ("fsdp-hf-liger", "torchtitan", "torchtitan-compile")


@dataclass
class Job:
    """One torchrun launch: ``script``'s worker with ``args`` (``--json-out`` appended) on ``ngpu`` GPUs."""

    family: str
    name: str
    script: Path
    args: list[str]
    ngpu: int
    facts: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    row: dict[str, Any] | None = None
    gpus: list[int] = field(default_factory=list)
    beside: set[str] = field(default_factory=set)


def _zero_job(family: str, variant: str, n: int, preset: str, seq: int, mb: int, a: argparse.Namespace,
              extra: list[str] | None = None) -> Job:
    args = ["--worker", "--strategy", variant, "--preset", preset, "--seq-len", str(seq), "--micro-batch", str(mb),
            "--precision", "bf16-mixed", "--warmup-steps", str(a.warmup_steps), "--steps", str(a.steps),
            "--zero-kwargs", "{}", *(extra or []), *(["--smoke"] if a.smoke else [])]
    facts = {"strategy": variant, "world": n, "micro_batch": mb, "seq_len": seq, "preset": preset}
    return Job(family, f"{variant} x{n} mb{mb} s{seq}", BENCH / "bench_zero.py", args, n, facts)


def _nd_job(family: str, variant: str, n: int, preset: str, seq: int, rows: int, a: argparse.Namespace,
            zero: int | None = None, ac: str = "none", label: str | None = None) -> Job:
    args = ["--worker", "--strategy", variant, "--preset", preset, "--seq-len", str(seq), "--micro-batch", str(rows),
            "--precision", "bf16-mixed", "--warmup-steps", str(a.warmup_steps), "--steps", str(a.steps),
            "--activation-checkpointing", ac, "--model-overrides", "{}", *(["--smoke"] if a.smoke else [])]
    if zero is not None:
        args += ["--zero-stage", str(zero)]
    name = label or variant
    facts = {"strategy": name, "world": n, "micro_batch": rows, "seq_len": seq, "preset": preset,
             "zero_stage": zero, "activation_checkpointing": ac}
    return Job(family, f"{name} x{n} mb{rows} s{seq}", BENCH / "bench_nd_parallel.py", args, n, facts)


def jobs_for(family: str, a: argparse.Namespace, ngpu: int) -> list[Job]:
    preset = "tiny" if a.smoke else "1b"
    seq = 64 if a.smoke else 2048
    worlds = [w for w in (4, 2) if w <= ngpu]
    out: list[Job] = []
    if family == "dp":
        for mb in a.micro_batches:
            for n in worlds:
                for v in ("zero3", "zero2", "zero1", "ddp", "fsdp-hf-liger"):
                    out.append(_zero_job(family, v, n, preset, seq, mb, a))
            out.append(_zero_job(family, "single", 1, preset, seq, mb, a))
            if ngpu == 1:  # the one-GPU check: the peer's code path beside ours
                out.append(_zero_job(family, "fsdp-hf-liger", 1, preset, seq, mb, a))
    elif family == "nd":
        long = 128 if a.smoke else 8192
        out += [_nd_job(family, "tp2", 2, preset, seq, 8, a), _nd_job(family, "pp2", 2, preset, seq, 8, a),
                _nd_job(family, "cp2", 2, preset, long, 1, a),
                _zero_job(family, "single", 1, preset, seq, 8, a), _zero_job(family, "single", 1, preset, long, 1, a)]
    elif family == "8b":
        p8, s8 = ("tiny", 128) if a.smoke else ("llama3-8b", 8192)
        n = min(4, ngpu)
        cut = ["--layers", str(a.layers_8b)] if a.layers_8b else []
        jobs = [_nd_job(family, "dp", n, p8, s8, n, a, zero=3, label="zero3"),
                _zero_job(family, "fsdp-hf-liger", n, p8, s8, 1, a, extra=cut),
                _nd_job(family, "dp", n, p8, s8, n, a, zero=2, label="zero2"),
                _nd_job(family, "dp", n, p8, s8, n, a, zero=3, ac="full", label="zero3-ac")]
        for job in jobs:
            if job.script.name == "bench_nd_parallel.py":
                job.args += cut
            job.facts["layers"] = a.layers_8b
        out += jobs
        if a.titan_site or a.smoke:
            for compiled in (False, True):  # its config as published (compile off), and with its compile on
                strategy = "torchtitan-compile" if compiled else "torchtitan"
                args = ["--seq-len", str(s8), "--micro-batch", "1", "--steps", str(a.steps),
                        "--warmup-steps", str(a.warmup_steps), *cut, *(["--smoke"] if a.smoke else []),
                        *(["--compile"] if compiled and not a.smoke else [])]
                job = Job(family, f"{strategy} x{n} mb1 s{s8}", BENCH / "peer_torchtitan.py", args, n,
                          {"strategy": strategy, "world": n, "micro_batch": 1, "seq_len": s8, "preset": p8,
                           "layers": a.layers_8b})
                if a.titan_site:
                    job.env["PYTHONPATH"] = os.pathsep.join([a.titan_site, str(launch.REPO_ROOT),
                                                             os.environ.get("PYTHONPATH", "")])
                out.append(job)
    else:
        raise SystemExit(f"unknown family {family!r}: dp, nd, 8b")
    return out


# --------------------------------------------------------------------------- packing launches onto GPUs


def run_packed(jobs: list[Job], ngpu: int, log_dir: Path, timeout: float, on_done: Any, smoke: bool,
               deadline: float = float("inf")) -> None:
    """Start ``jobs`` in order on free GPUs (none jumps an earlier one that waits); ``on_done(job)`` after each. No
    launch starts after ``deadline`` (``time.monotonic()``), and none may run past it: those left are recorded as
    not run."""
    free = list(range(ngpu))
    running: dict[str, Job] = {}
    lock = threading.Condition()
    threads = []

    def work(job: Job) -> None:
        env = dict(job.env)
        if not smoke:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, job.gpus))
        slug = job.name.replace(" ", "_")
        limit = min(timeout, deadline - time.monotonic())
        try:
            job.row = launch.launch(str(job.script), lambda out: [*job.args, "--json-out", str(out)], slug,
                                    job.ngpu, log_dir / f"{job.family}-{slug}.log", limit, env=env)
        except Exception as err:  # noqa: BLE001 - recorded as the job's error
            job.row = {"error": f"{type(err).__name__}: {err}"}
        with lock:
            running.pop(job.name, None)
            free.extend(job.gpus)
            free.sort()
            on_done(job)
            lock.notify_all()

    for job in jobs:
        with lock:
            while len(free) < job.ngpu:
                lock.wait()
            if deadline - time.monotonic() < 30:
                job.row = {"error": "not run: the call's deadline came first (--deadline)"}
                on_done(job)
                continue
            job.gpus, free[:] = free[: job.ngpu], free[job.ngpu :]
            job.beside = set(running)
            for other in running.values():
                other.beside.add(job.name)
            running[job.name] = job
        t = threading.Thread(target=work, args=(job,), daemon=True)
        t.start()
        threads.append(t)
        if smoke:  # one CPU machine: no packing
            t.join()
    for t in threads:
        t.join()


# --------------------------------------------------------------------------- records


def _flops_per_token(preset: str, seq: int, layers: int | None = None) -> float:
    import torch

    from lightning_llmopt.models import LlamaConfig
    from lightning_llmopt.models.llama import Llama

    base = LlamaConfig.from_preset(preset)
    over: dict[str, Any] = {"max_seq_len": seq} if base.max_seq_len < seq else {}
    config = LlamaConfig.from_preset(preset, **over, **({"n_layers": layers} if layers else {}))
    with torch.device("meta"):
        return float(Llama(config).flops_per_token(seq))


def _row(job: Job) -> dict[str, Any]:
    row = {**(job.row or {}), **job.facts, "variant": job.name, "gpus": job.gpus, "ran_beside": sorted(job.beside)}
    if isinstance(row.get("tokens_per_s"), (int, float)):
        per_gpu = row["tokens_per_s"] / job.facts["world"]
        row["tokens_per_s_per_gpu"] = per_gpu
        fpt = _flops_per_token(job.facts["preset"], job.facts["seq_len"], job.facts.get("layers"))
        row["model_tflops_per_gpu"] = per_gpu * fpt / 1e12
        row["mfu_vs_989"] = per_gpu * fpt / (DATASHEET_BF16_TFLOPS * 1e12)
    return row


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None, key: str) -> float | None:
    if not a or not b or not isinstance(a.get(key), (int, float)) or not isinstance(b.get(key), (int, float)):
        return None
    return a[key] / b[key] if b[key] else None


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def build_record(family: str, rows: list[dict[str, Any]], a: argparse.Namespace, ngpu: int) -> dict[str, Any]:
    """The family's record from its rows (``_row`` of each launch that ended): ratios, goals and notes."""
    ours = [r for r in rows if r["strategy"] not in PEERS]
    peers = [r for r in rows if r["strategy"] in PEERS]
    notes: list[str] = [
        "launches packed side by side on disjoint GPUs of one host (ran_beside names the launches that overlapped); "
        "MFU counts causal attention as half (Llama.flops_per_token) against 989 TFLOP/s per GPU",
    ]
    ratios: list[dict[str, Any]] = []

    def find(rs: list[dict[str, Any]], **kw: Any) -> dict[str, Any] | None:
        return next((r for r in rs if all(r.get(k) == v for k, v in kw.items()) and "error" not in r), None)

    for r in ours:
        if r["strategy"] == "single" and ngpu > 1 or "error" in r:
            continue
        # per-GPU tokens/s against one GPU with the same rows per step (nd: rows per data-parallel group)
        single = find(ours, strategy="single", micro_batch=r["micro_batch"], seq_len=r["seq_len"])
        if single is not None and r is not single:
            r["per_gpu_vs_single"] = _ratio(r, single, "tokens_per_s_per_gpu")
        peer = find(peers, strategy="fsdp-hf-liger", world=r["world"], micro_batch=r["micro_batch"]) or (
            find(peers, strategy="fsdp-hf-liger", world=r["world"]) if family == "8b" else None)
        if peer is not None:
            r["vs_fsdp_hf_liger"] = _ratio(r, peer, "tokens_per_s")
            r["memory_vs_fsdp_hf_liger"] = _ratio(r, peer, "peak_allocated_gib")
            ratios.append({"variant": r["variant"], "peer": "fsdp-hf-liger", "metric": "tokens_per_s",
                           "ratio": r["vs_fsdp_hf_liger"], "world": r["world"], "micro_batch": r["micro_batch"]})
        for name in ("torchtitan", "torchtitan-compile"):
            titan = find(peers, strategy=name, world=r["world"])
            if titan is not None:
                r[f"vs_{name.replace('-', '_')}"] = _ratio(r, titan, "tokens_per_s")
                ratios.append({"variant": r["variant"], "peer": name, "metric": "tokens_per_s",
                               "ratio": r[f"vs_{name.replace('-', '_')}"], "world": r["world"]})
    if family == "dp":
        for r in ours:
            if (r["world"] > 1 or ngpu == 1) and "error" not in r:
                s, p, m = r.get("per_gpu_vs_single"), r.get("vs_fsdp_hf_liger"), r.get("memory_vs_fsdp_hf_liger")
                ok_s = None if s is None else s >= GOAL_SCALING
                ok_p = None if p is None or m is None else (p >= GOAL_VS_PEER_1B and m <= 1.0)
                notes.append(f"{r['variant']}: per-GPU {_fmt(s)}x single "
                             f"(goal >= {GOAL_SCALING}: {_verdict(ok_s)}); {_fmt(p)}x fsdp-hf-liger at {_fmt(m)}x "
                             f"its peak memory (goal >= {GOAL_VS_PEER_1B} at <= 1: {_verdict(ok_p)})")
    if family == "8b":
        for r in ours:
            if "error" in r:
                continue
            mfu, p = r.get("mfu_vs_989"), r.get("vs_fsdp_hf_liger")
            notes.append(f"{r['variant']}: MFU {_fmt(mfu)} (goal >= {GOAL_MFU_8B}: "
                         f"{_verdict(None if mfu is None else mfu >= GOAL_MFU_8B)}); {_fmt(p)}x fsdp-hf-liger "
                         f"(goal >= {GOAL_VS_PEER_8B}: {_verdict(None if p is None else p >= GOAL_VS_PEER_8B)}); "
                         f"{_fmt(r.get('vs_torchtitan'))}x torchtitan, "
                         f"{_fmt(r.get('vs_torchtitan_compile'))}x torchtitan with its compile on")
    for r in rows:
        if "error" in r:
            notes.append(f"{r['variant']} failed: {r['error']}")
    cut = f"-{a.layers_8b}l" if a.layers_8b else ""
    name = {"dp": f"multigpu-1b{'-1gpu' if ngpu == 1 else ''}", "nd": "multigpu-nd-1b",
            "8b": f"multigpu-llama3-8b{cut}-{min(4, ngpu)}gpu"}[family]
    config = {"family": family, "gpus": ngpu, "layers_8b": a.layers_8b, "precision": "bf16-mixed",
              "warmup_steps": a.warmup_steps, "steps": a.steps, "data": "random tokens (fixed seed)",
              "fused_kernels": "module default (on CUDA)", "command": getattr(a, "command", None)}
    record = records.make_record(name, config, ours, peers, benchmark="multigpu", ratio_metric=None,
                                 reference={"datasheet_bf16_tflops": DATASHEET_BF16_TFLOPS}, notes=notes)
    record["ratios"] = ratios
    return record


def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("MET" if ok else "NOT MET")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", nargs="+", default=["dp", "nd", "8b"], choices=("dp", "nd", "8b"))
    parser.add_argument("--micro-batches", nargs="+", type=int, default=None, help="dp family (default 8 4)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="untimed steps (default 3; 1 with --smoke)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 8; 2 with --smoke)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per launch (default 240)")
    parser.add_argument("--only", nargs="+", default=None, help="run only jobs whose name starts with one of these")
    parser.add_argument("--deadline", type=float, default=None, help="seconds from start after which no launch runs")
    parser.add_argument("--layers-8b", type=int, default=None, help="8b family: cut llama3-8b to this many layers")
    parser.add_argument("--titan-site", default=None, help="folder holding torchtitan and its wheels' packages")
    parser.add_argument("--rebuild", type=Path, nargs="+", default=None,
                        help="recompute ratios, goals and notes of existing records from their rows (no launch)")
    parser.add_argument("--results-dir", type=Path, default=None)
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny presets, one launch at a time")
    a = parser.parse_args(argv)
    a.command = "python benchmarks/bench_multigpu.py " + " ".join(sys.argv[1:] if argv is None else argv)
    a.micro_batches = a.micro_batches or ([2] if a.smoke else [8, 4])
    a.warmup_steps = a.warmup_steps if a.warmup_steps is not None else (1 if a.smoke else 3)
    a.steps = a.steps if a.steps is not None else (2 if a.smoke else 8)
    if a.rebuild:
        for path in a.rebuild:
            old = json.loads(path.read_text())
            cfg = old["config"]
            a.warmup_steps, a.steps = cfg["warmup_steps"], cfg["steps"]
            a.layers_8b, a.command = cfg.get("layers_8b"), cfg.get("command")
            record = build_record(cfg["family"], old["results"] + old["peers"], a, cfg["gpus"])
            record["env"], record["date"] = old["env"], old["date"]
            path.write_text(json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
            print(f"rebuilt {path}")
        return 0
    os.environ.update(launch.NVLS_OFF)
    import torch

    ngpu = 2 if a.smoke else torch.cuda.device_count()
    if not a.smoke and ngpu < 1:
        raise SystemExit("bench_multigpu needs CUDA GPUs (found none); --smoke checks it on CPU")
    if ngpu == 1:
        print("one GPU: a check of the code paths (dp: single and the peer; 8b: one GPU, cut with --layers-8b)")
    results_dir = a.results_dir or (Path(tempfile.mkdtemp(prefix="llmopt-mg-")) if a.smoke
                                    else launch.REPO_ROOT / "benchmarks" / "results")
    log_dir = a.log_dir or Path(tempfile.mkdtemp(prefix="llmopt-mg-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + (a.deadline or float("inf"))
    for family in a.family:
        jobs = jobs_for(family, a, ngpu)
        if a.only:
            jobs = [j for j in jobs if any(j.name.startswith(p) for p in a.only)]
        started = time.perf_counter()

        def done(job: Job, family: str = family, jobs: list[Job] = jobs) -> None:
            row = job.row or {}
            tps = row.get("tokens_per_s")
            what = f"{tps:.0f} tok/s" if isinstance(tps, (int, float)) else row.get("error")
            print(f"[{family}] {job.name} on GPUs {job.gpus}: {what}", flush=True)
            rows = [_row(j) for j in jobs if j.row is not None]
            path = records.write_record(build_record(family, rows, a, ngpu), results_dir)
            print(f"[{family}] record {path}", flush=True)

        run_packed(jobs, ngpu, log_dir, a.timeout or 240.0, done, a.smoke, deadline)
        walls = [j.row.get("launch_wall_s", 0) for j in jobs if j.row]
        print(f"[{family}] {len(jobs)} launches in {time.perf_counter() - started:.0f} s "
              f"(median launch {statistics.median(walls) if walls else 0:.0f} s)", flush=True)
    print(json.dumps({"results_dir": str(results_dir), "log_dir": str(log_dir)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
