"""Where ``llmopt serve`` loses to the offline engine under load, on CPU, without a model.

The real :class:`LLMEngine` (scheduler, block manager, sampler, outputs: the whole host path) serves a tiny model
whose forward pass is replaced by a sleep of the time an H200 takes for a llama2-7b step (``--device-ms`` for a
decode step of 64 sequences, scaled down to ``--base-ms`` at one sequence, plus ``--prefill-us`` per prompt token).
``time.sleep`` releases the GIL as a CUDA synchronisation does, so the engine thread's host work competes with the
event loop for the GIL exactly as it does on the GPU.

The same Poisson arrivals as ``bench_serve.py --family serve`` are served twice: offline (``bench_serve.run_offline``)
and over HTTP (``Server`` + ``build_app`` under uvicorn on 127.0.0.1). The streaming clients are
``bench_serve._client``, run in a separate process (``--clients inproc`` runs them in the server's process, as
``bench_serve.py`` does, to show what sharing the GIL with the load generator costs).

Reported per concurrency (JSON lines): output tokens/s HTTP/offline, added TTFT p50, TTFT p99 ratio; the engine
thread's host milliseconds per step (the step's wall time minus the simulated device time: what the GIL costs it),
its gap between steps; the event-loop thread's and the client process's CPU microseconds per token; with
``--profile`` the event loop's cProfile (top functions by own time, per token).

Usage: ``python benchmarks/profile_serve_load.py [--concurrency 1,8,64] [--requests 128] [--profile]``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import multiprocessing as mp
import pstats
import resource
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package
import bench_serve  # noqa: E402
from bench_decode import _workload  # noqa: E402

from lightning_llmopt.inference import LLMEngine  # noqa: E402
from lightning_llmopt.inference import engine as engine_module  # noqa: E402
from lightning_llmopt.inference.loading import random_model  # noqa: E402
from lightning_llmopt.inference.runner import ModelRunner  # noqa: E402
from lightning_llmopt.models import LlamaConfig  # noqa: E402


class StepClock:
    """Per step: wall time, simulated device time, the engine thread's CPU time, and the gap since the last step."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.wall: list[float] = []
        self.device: list[float] = []
        self.gap: list[float] = []
        self.cpu = 0.0
        self._end: float | None = None
        self._slept = 0.0

    def summary(self) -> dict[str, float]:
        host = [w - d for w, d in zip(self.wall, self.device, strict=True)]
        n = max(len(host), 1)
        return {
            "steps": len(host),
            "step_host_ms_median": statistics.median(host) * 1e3 if host else 0.0,
            "step_host_ms_mean": sum(host) / n * 1e3,
            "step_gap_ms_median": statistics.median(self.gap) * 1e3 if self.gap else 0.0,
            "step_gap_ms_mean": sum(self.gap) / max(len(self.gap), 1) * 1e3,
            "engine_thread_cpu_ms_per_step": self.cpu / n * 1e3,
        }


def simulate_device(engine: LLMEngine, clock: StepClock, base_ms: float, b64_ms: float, prefill_us: float) -> None:
    """Replace the model's forward pass by a sleep (the host preparation still runs); time every step."""
    vocab = engine.model.config.vocab_size
    logits = torch.randn(512, vocab)

    def step_logits(graphs: Any, runner: ModelRunner, work: list[Any], split: bool = False) -> Any:
        work = ModelRunner.order(work)
        runner.prepare(work)
        decodes = sum(1 for w in work if w.num_tokens == 1)
        prefill = sum(w.num_tokens for w in work if w.num_tokens > 1)
        seconds = (base_ms + (b64_ms - base_ms) * min(decodes, 64) / 64) * 1e-3 + prefill * prefill_us * 1e-6
        time.sleep(seconds)
        clock._slept += seconds
        rows = sum(w.num_logits for w in work if w.samples)
        return work, logits[:rows]

    engine_module.step_logits = step_logits
    real_step = engine.step

    def step() -> Any:
        start, cpu0 = time.perf_counter(), time.thread_time()
        if clock._end is not None:
            clock.gap.append(start - clock._end)
        clock._slept = 0.0
        events = real_step()
        clock._end = time.perf_counter()
        clock.wall.append(clock._end - start)
        clock.device.append(clock._slept)
        clock.cpu += time.thread_time() - cpu0
        return events

    engine.step = step  # type: ignore[method-assign]


def build(base_ms: float, b64_ms: float, prefill_us: float) -> tuple[LLMEngine, StepClock]:
    torch.manual_seed(0)
    cfg = LlamaConfig.from_preset("tiny")
    cfg.max_seq_len = 2048
    engine = LLMEngine(random_model(cfg, "cpu", torch.float32), None, num_blocks=4096, max_num_seqs=64)
    clock = StepClock()
    simulate_device(engine, clock, base_ms, b64_ms, prefill_us)
    return engine, clock


def _client_process(url: str, reqs: list, arrivals: list[float], out: Any) -> None:
    trace = bench_serve.Trace(len(reqs))
    asyncio.run(bench_serve._client(url, reqs, arrivals, trace))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out.send((trace.__dict__, usage.ru_utime + usage.ru_stime))


def run_http(engine: LLMEngine, reqs: list, arrivals: list[float], inproc: bool, profile: bool) -> dict[str, Any]:
    """The arrivals over HTTP; the event-loop thread's CPU time (and profile), the client's CPU time."""
    import uvicorn

    from lightning_llmopt.inference.serving import Server, build_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(Server(engine, "bench")), log_level="warning"))
    loop_info: dict[str, Any] = {}
    prof = cProfile.Profile() if profile else None

    def serve() -> None:
        if prof is not None:
            prof.enable()
        cpu0 = time.thread_time()
        server.run(sockets=[sock])
        loop_info["cpu_s"] = time.thread_time() - cpu0
        if prof is not None:
            prof.disable()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        if inproc:
            trace = bench_serve.Trace(len(reqs))
            c0 = time.thread_time()
            asyncio.run(bench_serve._client(url, reqs, arrivals, trace))
            client_cpu = time.thread_time() - c0
        else:
            ctx = mp.get_context("spawn")
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_client_process, args=(url, reqs, arrivals, send))
            proc.start()
            state, client_cpu = recv.recv()
            proc.join()
            trace = bench_serve.Trace(len(reqs))
            trace.__dict__.update(state)
    finally:
        server.should_exit = True
        thread.join(60)
    return {"trace": trace, "loop_cpu_s": loop_info.get("cpu_s", float("nan")), "client_cpu_s": client_cpu,
            "profile": prof}  # fmt: skip


def top_functions(prof: cProfile.Profile, tokens: int, limit: int) -> list[str]:
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    rows = []
    for (file, line, name), (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append((tt, ct, nc, f"{Path(file).name}:{line}({name})"))
    rows.sort(reverse=True)
    return [f"{tt / tokens * 1e6:7.2f} us/tok own  {ct / tokens * 1e6:8.2f} cum  {nc:8d} calls  {where}"
            for tt, ct, nc, where in rows[:limit]]  # fmt: skip


def one_level(args: argparse.Namespace, c: int) -> dict[str, Any]:
    engine, clock = build(args.base_ms, args.device_ms, args.prefill_us)
    n = args.requests if c > 1 else max(4, args.requests // 8)
    reqs = _workload(n, engine.model.config.vocab_size, (0, 0), f"sharegpt:{args.cap}", seed=c)
    latency = bench_serve.calibrate(engine, reqs[: min(n, 2 * c)], c)
    arrivals = bench_serve.poisson(n, c / latency, seed=100 + c)
    clock.reset()
    offline = bench_serve.run_offline(engine, reqs, arrivals).summary("offline")
    off_steps = clock.summary()
    clock.reset()
    res = run_http(engine, reqs, arrivals, args.clients == "inproc", args.profile)
    http = res["trace"].summary("http")
    http_steps = clock.summary()
    tokens = http["output_tokens"]
    rec: dict[str, Any] = {
        "concurrency": c,
        "requests": n,
        "clients": args.clients,
        "switchinterval_ms": sys.getswitchinterval() * 1e3,
        "tok_s_ratio": http["output_tok_s"] / offline["output_tok_s"],
        "added_ttft_p50_ms": http["ttft_p50_ms"] - offline["ttft_p50_ms"],
        "ttft_p99_ratio": http["ttft_p99_ms"] / offline["ttft_p99_ms"],
        "offline": {k: round(v, 3) if isinstance(v, float) else v for k, v in {**offline, **off_steps}.items()},
        "http": {k: round(v, 3) if isinstance(v, float) else v for k, v in {**http, **http_steps}.items()},
        "loop_cpu_us_per_token": res["loop_cpu_s"] / tokens * 1e6,
        "client_cpu_us_per_token": res["client_cpu_s"] / tokens * 1e6,
        "loop_cpu_share": res["loop_cpu_s"] / (tokens / http["output_tok_s"]),
    }
    if res["profile"] is not None:
        rec["loop_profile_top"] = top_functions(res["profile"], tokens, args.top)
    return rec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="CPU reproduction of the server's cost under load")
    parser.add_argument("--concurrency", default="1,8,64")
    parser.add_argument("--requests", type=int, default=128, help="per concurrency (an eighth at concurrency 1)")
    parser.add_argument("--cap", type=int, default=256, help="ShareGPT lengths capped at this many tokens")
    parser.add_argument("--device-ms", type=float, default=20.0, help="simulated decode step of 64 sequences")
    parser.add_argument("--base-ms", type=float, default=8.0, help="simulated decode step of one sequence")
    parser.add_argument("--prefill-us", type=float, default=20.0, help="simulated prefill time per prompt token")
    parser.add_argument("--clients", choices=["process", "inproc"], default="process")
    parser.add_argument("--switchinterval-ms", type=float, default=None, help="sys.setswitchinterval before serving")
    parser.add_argument("--profile", action="store_true", help="cProfile the event-loop thread (slows it down)")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.switchinterval_ms is not None:
        sys.setswitchinterval(args.switchinterval_ms * 1e-3)
    for c in (int(x) for x in args.concurrency.split(",") if x.strip()):
        print(json.dumps(one_level(args, c), indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
