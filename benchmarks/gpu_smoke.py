"""The GPU smoke run: every user path that the README and docs promise, end to end, in one command on one GPU.

Usage::

    python benchmarks/gpu_smoke.py                 # everything, on the GPU (266 s on one H200, cold caches)
    python benchmarks/gpu_smoke.py --only fit:1b_gpu engine:gqa   # a subset (names as in the record)
    python benchmarks/gpu_smoke.py --list          # the paths and their commands
    python benchmarks/gpu_smoke.py --device cpu    # the harness itself on CPU, each path shrunk (slow: minutes)

Each path runs in its own process under a time limit, through the public commands (``llmopt fit``, ``quantize``,
``generate``, ``serve`` queried by the official ``openai`` client) or the public Python API
(:mod:`gpu_smoke_paths`, beside this file: the engine with GQA, MLA and layer patterns / K/V sharing, each with the
prefix cache, int8 KV, CUDA graphs and speculative decoding where supported, token-exact against a plain greedy
reference; flash attention forward and backward at odd shapes against fp64; one fused-kernel training step under
each single-process path). The single-GPU training runs go one at a time while the other paths run ``--jobs`` at a
time beside them (the run stays within 5 minutes that way; the MFU they print is therefore taken on a shared GPU,
below what the same command measures alone: ``benchmarks/run_smoke_gpu.sh fit1b`` is the figure to quote).

Writes ``benchmarks/results/gpu-smoke-<device>.json``: pass or fail, seconds, the error line and a detail line
(``llmopt fit``: the throughput and MFU that ``TrainingMonitor`` measured) for every path. Exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import records  # noqa: E402

ROOT = records.REPO_ROOT
CONFIGS = ROOT / "examples" / "configs"
PATHS = Path(__file__).resolve().parent / "gpu_smoke_paths.py"
SINGLE_GPU_CONFIGS = ("125m_gpu", "1b_gpu", "1b_gpu_fp8")
RUN_START = [time.monotonic()]  # set again when a run starts: each path records its start offset from it
MULTI_GPU_CONFIGS = ("1b_4gpu", "llama3-8b_4gpu")


@dataclass
class SmokePath:
    """One user path: ``argv`` run in a scratch folder (``{tmp}`` is replaced by it) within ``limit`` seconds."""

    name: str
    argv: list[str]
    limit: float
    serial: bool = False  # run alone (training throughput)
    needs: str | None = None  # a path whose scratch folder this one reads (``{src}``)
    detail_pattern: str | None = None  # the output line kept as the record's detail
    result: dict[str, Any] = field(default_factory=dict)


def _llmopt(*args: str) -> list[str]:
    return [sys.executable, "-m", "lightning_llmopt.cli", *args]


def _api(name: str, device: str) -> list[str]:
    return [sys.executable, str(PATHS), name, "--device", device, "--workdir", "{tmp}"]


def build_paths(device: str) -> list[SmokePath]:
    """Every path of the run. On ``device="cpu"`` the training runs are shrunk (the configs are for GPUs)."""
    cpu = device == "cpu"
    shrink = ["--trainer.accelerator", "cpu", "--trainer.precision", "32-true", "--model.model", "debug-1m",
              "--data.seq_len", "64", "--data.batch_size", "2", "--data.num_workers", "0"] if cpu else []
    paths: list[SmokePath] = []
    for name in SINGLE_GPU_CONFIGS:  # unchanged, 20 steps; TrainingMonitor logs every 20 steps in these configs
        steps = "4" if cpu else "20"
        emulate = ["--model.float8_emulate", "true"] if cpu and name.endswith("fp8") else []  # no FP8 on CPUs
        paths.append(SmokePath(f"fit:{name}", _llmopt("fit", "--config", str(CONFIGS / f"{name}.yaml"),
                                                      "--trainer.max_steps", steps, *shrink, *emulate),
                               limit=240, serial=True, detail_pattern=r"^throughput: .*"))
    for name in MULTI_GPU_CONFIGS:  # the strategy and its settings as configured, on one GPU, model cut to 2 layers
        steps = "3" if cpu else "10"
        layers = ['--model.model_overrides={"n_layers": 2}']
        paths.append(SmokePath(f"fit:{name}@1gpu", _llmopt("fit", "--config", str(CONFIGS / f"{name}.yaml"),
                                                           "--trainer.devices", "1", "--trainer.max_steps", steps,
                                                           *layers, *shrink),
                               limit=240, detail_pattern=r"^throughput: .*"))
    # quantize -> generate: a random small preset written as a Hugging Face folder (the source), then each format
    paths.append(SmokePath("quantize:source", _api("hf-source", device), limit=120))
    gen = ["--prompt", "def main(", "--prompt", "import os", "--max-tokens", "24", "--tokenizer", "byte",
           "--num-blocks", "256", "--max-num-seqs", "8", "--device", device]  # 8: fewer graph sizes to capture
    quants = {
        "int8": ["--method", "rtn", "--bits", "8", "--group-size", "0"],
        "int4": ["--method", "rtn", "--bits", "4", "--group-size", "128"],
        "gptq": ["--method", "gptq", "--bits", "4", "--group-size", "128", "--calib-samples", "16", "--seq-len", "256"],
    }
    for q, args in quants.items():
        out = f"{{src}}/{q}"
        quantize = shlex.join(_llmopt("quantize", "{src}/hf", out, *args, "--tokenizer", "byte", "--device", device))
        generate = shlex.join(_llmopt("generate", out, *gen))
        paths.append(SmokePath(f"quantize+generate:{q}", ["bash", "-c", f"{quantize} && {generate}"], limit=240,
                               needs="quantize:source", detail_pattern=r"completion 0\.0.*"))
    paths.append(SmokePath("generate:bf16", _llmopt("generate", "{src}/hf", *gen), limit=180,
                           needs="quantize:source", detail_pattern=r"completion 0\.0.*"))
    paths.append(SmokePath("serve:openai", _api("serve", device), limit=240, detail_pattern=r"^serve: .*"))
    for family in ("gqa", "mla", "patterns"):
        paths.append(SmokePath(f"engine:{family}", _api(f"engine-{family}", device), limit=300,
                               detail_pattern=r"^engine: .*"))
    paths.append(SmokePath("kernels:flash-attention", _api("flash", device), limit=240, detail_pattern=r"^flash: .*"))
    for strategy in ("single", "zero1", "zero2", "zero3", "nd"):
        paths.append(SmokePath(f"train-step:{strategy}", _api(f"step-{strategy}", device), limit=240,
                               detail_pattern=r"^step: .*"))
    return paths


def _error_line(text: str) -> str:
    """The most telling line of a failed run's output: the last exception line, else the last non-empty line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    pattern = re.compile(r"^([\w.]+(Error|Exception|Exit|Interrupt)|llmopt \w+: error|AssertionError|FAILED)")
    for ln in reversed(lines):
        if pattern.search(ln):
            return ln[:400]
    return lines[-1][:400] if lines else "(no output)"


def _slug(name: str) -> str:
    return re.sub(r"[^\w.-]+", "_", name)


def run_path(path: SmokePath, scratch: Path, log_dir: Path, deadline: float = float("inf")) -> dict[str, Any]:
    """Run one path in its own process group, killed after its limit or at ``deadline`` (``time.monotonic``);
    never raises."""
    limit = min(path.limit, deadline - time.monotonic())
    if limit <= 0:
        return {"path": path.name, "ok": False, "seconds": 0.0, "detail": "", "command": shlex.join(path.argv),
                "error": "not run: the run's --deadline had passed"}
    tmp = scratch / _slug(path.name)
    tmp.mkdir(parents=True, exist_ok=True)
    src = scratch / _slug(path.needs) if path.needs else tmp
    argv = [a.replace("{tmp}", str(tmp)).replace("{src}", str(src)) for a in path.argv]
    log = log_dir / f"{_slug(path.name)}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    start = time.perf_counter()
    started = time.monotonic() - RUN_START[0]
    with open(log, "w") as fh:
        fh.write(f"$ {shlex.join(argv)}\n")
        fh.flush()
        proc = subprocess.Popen(argv, cwd=tmp, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    seconds = time.perf_counter() - start
    text = log.read_text(errors="replace")
    detail = ""
    if path.detail_pattern:
        found = re.findall(path.detail_pattern, text, flags=re.MULTILINE)
        detail = found[-1].strip()[:400] if found else ""
    ok = code == 0
    error = "" if ok else (f"timed out after {limit:.0f} s; last line: {_error_line(text)}" if code is None
                           else f"exit {code}: {_error_line(text)}")
    return {"path": path.name, "ok": ok, "seconds": round(seconds, 1), "started_s": round(started, 1),
            "load_at_end": round(os.getloadavg()[0], 1), "error": error, "detail": detail,
            "command": shlex.join(argv).replace(str(scratch), "$SCRATCH").replace(str(ROOT) + "/", "")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--only", nargs="*", default=None, help="path names (or prefixes, e.g. 'engine:') to run")
    parser.add_argument("--jobs", type=int, default=6,
                        help="paths run at once beside the single-GPU training runs (which run one at a time)")
    parser.add_argument("--list", action="store_true", help="print the paths and exit")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds for the whole run: paths still running then are stopped, later ones not run "
                             "(each is recorded as failed), and the record is written")
    parser.add_argument("--out", default=None, help="record folder (default benchmarks/results; CPU: a temp folder)")
    parser.add_argument("--logs", default=None, help="folder for each path's full output (default: a temp folder)")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA device: run on a GPU, or pass --device cpu to check the harness")
    paths = build_paths(args.device)
    if args.only:
        def hit(name: str, w: str) -> bool:
            return name == w or (w.endswith(":") and name.startswith(w))

        keep = {p.name for p in paths if any(hit(p.name, w) for w in args.only)}
        unknown = [w for w in args.only if not any(hit(p.name, w) for p in paths)]
        if unknown:
            parser.error(f"unknown path(s) {unknown}; --list shows them")
        keep |= {p.needs for p in paths if p.name in keep and p.needs}
        paths = [p for p in paths if p.name in keep]
    if args.list:
        for p in paths:
            print(f"{p.name:32s} {p.limit:4.0f} s  {shlex.join(p.argv)}")
        return 0
    scratch = Path(tempfile.mkdtemp(prefix="gpu-smoke-"))
    log_dir = Path(args.logs) if args.logs else scratch / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"[smoke] {len(paths)} paths; scratch {scratch}; logs {log_dir}", flush=True)
    start = time.perf_counter()
    RUN_START[0] = time.monotonic()
    deadline = time.monotonic() + args.deadline if args.deadline else float("inf")
    results: dict[str, dict[str, Any]] = {}

    def report(r: dict[str, Any]) -> None:
        results[r["path"]] = r
        status = "ok  " if r["ok"] else "FAIL"
        extra = r["error"] if not r["ok"] else r["detail"]
        print(f"[smoke] {status} {r['path']:30s} {r['seconds']:6.1f} s  {extra}", flush=True)

    def lane(serial: list[SmokePath]) -> None:  # the training runs, one after another beside the pool
        for p in serial:
            report(run_path(p, scratch, log_dir, deadline))

    rest = [p for p in paths if not p.serial]
    done: set[str] = set()
    with futures.ThreadPoolExecutor(max(1, args.jobs) + 1) as pool:
        serial_lane = pool.submit(lane, [p for p in paths if p.serial])
        pending: dict[futures.Future, SmokePath] = {}
        queue = list(rest)
        while queue or pending:
            for p in list(queue):  # start what is ready (a path that reads another's folder waits for it)
                if len(pending) >= max(1, args.jobs):
                    break
                if p.needs and p.needs not in done:
                    if p.needs not in {q.name for q in queue} | {q.name for q in pending.values()}:
                        queue.remove(p)  # its source is not part of this run
                    continue
                if p.needs and not results[p.needs]["ok"]:
                    queue.remove(p)
                    report({"path": p.name, "ok": False, "seconds": 0.0, "detail": "", "command": shlex.join(p.argv),
                            "error": f"not run: {p.needs} failed"})
                    done.add(p.name)
                    continue
                queue.remove(p)
                pending[pool.submit(run_path, p, scratch, log_dir, deadline)] = p
            if not pending:
                continue
            finished, _ = futures.wait(pending, return_when=futures.FIRST_COMPLETED)
            for f in finished:
                p = pending.pop(f)
                report(f.result())
                done.add(p.name)
        serial_lane.result()
    total = time.perf_counter() - start
    rows = [{"variant": results[p.name]["path"], **results[p.name]} for p in paths]
    failed = [r["path"] for r in rows if not r["ok"]]
    # a subset (--only) must not replace the whole run's record
    name = "gpu-smoke-subset" if args.only else "gpu-smoke"
    record = records.make_record(
        name, {"device": args.device, "jobs": args.jobs, "paths": [p.name for p in paths]},
        rows, benchmark="gpu-smoke", ratio_metric=None,
        notes=[f"{len(rows) - len(failed)} of {len(rows)} paths passed in {total:.0f} s"
               + (f"; failed: {', '.join(failed)}" if failed else "")],
    )
    record["total_s"] = round(total, 1)
    out = args.out or (str(scratch) if args.device == "cpu" else None)
    path = records.write_record(record, out)
    print(f"[smoke] {len(rows) - len(failed)}/{len(rows)} passed in {total:.0f} s; record {path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
