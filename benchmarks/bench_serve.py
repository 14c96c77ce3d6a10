"""``llmopt serve`` under load, beside the offline engine on the same requests, and the sampler's cost.

Families:

- ``serve``: a ShareGPT-shaped workload (prompt and output lengths drawn as in ``bench_decode --family serve``:
  lognormal around ShareGPT's means, capped) arrives as a Poisson process at the rate that keeps ``C`` requests in
  flight (C = 1, 8, 64). The rate is ``C / L``, with ``L`` the mean latency of a closed-loop calibration run of
  ``C`` clients. The same arrivals are served twice by one engine: offline (requests added in-process at their
  arrival times, :meth:`LLMEngine.step` in a loop) and over HTTP (``llmopt serve``'s app under uvicorn on
  127.0.0.1, streaming clients with ``httpx``). Reported for both: output tokens/s (all output tokens over the
  span from the first arrival to the last token), TTFT p50/p99 (arrival to first token) and inter-token latency
  p50/p99 (an event carrying ``k`` tokens ``dt`` after the previous one counts ``k`` gaps of ``dt / k``; chunks
  carry their token count through ``stream_options.continuous_usage_stats``). Greedy decoding with
  ``ignore_eos``, so every request produces exactly its drawn output length.
- ``sampler``: the device sampler's time at batch 64 with temperature, top-p and the three penalties (histories of
  ShareGPT's mean lengths), against a decode step of the same batch.

Usage: ``python benchmarks/bench_serve.py --family serve --preset llama2-7b`` (records in benchmarks/results/);
``--smoke`` runs on CPU with the tiny preset and a few requests (records in a temporary folder).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package
import records  # noqa: E402
from bench_decode import SHAREGPT_MEANS, _workload  # noqa: E402

from lightning_llmopt.inference import LLMEngine, SamplingParams  # noqa: E402
from lightning_llmopt.inference.loading import random_model  # noqa: E402
from lightning_llmopt.models import LlamaConfig  # noqa: E402

Request = tuple[list[int], int]


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


class Trace:
    """Per-request arrival, token times and token counts of one run."""

    def __init__(self, n: int) -> None:
        self.arrival = [0.0] * n
        self.first = [None] * n
        self.gaps: list[float] = []
        self.last = [0.0] * n
        self.tokens = [0] * n

    def tokens_at(self, i: int, k: int, t: float) -> None:
        if k <= 0:
            return
        if self.first[i] is None:
            self.first[i] = t
        else:
            self.gaps += [(t - self.last[i]) / k] * k
        self.last[i] = t
        self.tokens[i] += k

    def summary(self, variant: str) -> dict[str, Any]:
        ttft = [f - a for f, a in zip(self.first, self.arrival, strict=True) if f is not None]
        span = max(self.last) - min(self.arrival)
        busy = sum(end - a for end, a in zip(self.last, self.arrival, strict=True))
        ms = 1e3
        return {
            "variant": variant,
            "output_tok_s": sum(self.tokens) / span,
            "ttft_p50_ms": _pct(ttft, 50) * ms,
            "ttft_p99_ms": _pct(ttft, 99) * ms,
            "itl_p50_ms": (_pct(self.gaps, 50) or 0.0) * ms,
            "itl_p99_ms": (_pct(self.gaps, 99) or 0.0) * ms,
            "mean_concurrency": busy / span,
            "requests": len(self.tokens),
            "output_tokens": sum(self.tokens),
        }


def _params(m: int) -> SamplingParams:
    return SamplingParams(max_tokens=m, ignore_eos=True)


def run_offline(engine: LLMEngine, reqs: list[Request], arrivals: list[float]) -> Trace:
    """The engine alone: each request added at its arrival time, steps in a loop."""
    trace, order = Trace(len(reqs)), sorted(range(len(reqs)), key=lambda i: arrivals[i])
    ids: dict[str, int] = {}
    t0, nxt = time.perf_counter(), 0
    while nxt < len(order) or engine.has_unfinished():
        now = time.perf_counter() - t0
        while nxt < len(order) and arrivals[order[nxt]] <= now:
            i = order[nxt]
            ids[engine.add_request(reqs[i][0], _params(reqs[i][1]))] = i
            trace.arrival[i] = t0 + arrivals[i]
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[order[nxt]] - (time.perf_counter() - t0)))
            continue
        events = engine.step()
        t = time.perf_counter()
        for ev in events:
            trace.tokens_at(ids[ev.request_id], len(ev.token_ids), t)
            if ev.finished:
                engine.result(ev.request_id)
    return trace


async def _client(url: str, reqs: list[Request], arrivals: list[float], trace: Trace) -> None:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=None, trust_env=False, limits=limits) as http:
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - t0)))
            trace.arrival[i] = time.perf_counter()
            body = {"model": "bench", "prompt": reqs[i][0], "max_tokens": reqs[i][1], "temperature": 0,
                    "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
            seen = 0
            async with http.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    usage = json.loads(line[6:]).get("usage") or {}
                    done = usage.get("completion_tokens", seen)
                    trace.tokens_at(i, done - seen, time.perf_counter())
                    seen = done

        await asyncio.gather(*(one(i) for i in range(len(reqs))))


def _client_process(url: str, reqs: list[Request], arrivals: list[float], out: Any) -> None:
    trace = Trace(len(reqs))
    asyncio.run(_client(url, reqs, arrivals, trace))
    out.send(trace.__dict__)


def run_http(engine: LLMEngine, reqs: list[Request], arrivals: list[float], delivery_delay: float = 0.0) -> Trace:
    """The same arrivals through ``llmopt serve``'s app under uvicorn on 127.0.0.1. The clients run in a process of
    their own: in the server's process they would take the GIL from it (about 300 us of CPU per token on CPU,
    benchmarks/profile_serve_load.py), which no deployment's clients do. ``delivery_delay``: the
    :class:`AsyncEngine` option of that name."""
    import multiprocessing as mp

    import uvicorn

    from lightning_llmopt.inference.serving import Server, build_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app_server = Server(engine, "bench")
    app_server.core.delivery_delay = delivery_delay
    server = uvicorn.Server(uvicorn.Config(build_app(app_server), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        ctx = mp.get_context("spawn")
        recv, send = ctx.Pipe(duplex=False)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        proc = ctx.Process(target=_client_process, args=(url, reqs, arrivals, send), daemon=True)
        proc.start()
        trace = Trace(len(reqs))
        trace.__dict__.update(recv.recv())
        proc.join(60)
        return trace
    finally:
        server.should_exit = True
        thread.join(60)


def poisson(n: int, rate: float, seed: int) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def calibrate(engine: LLMEngine, reqs: list[Request], concurrency: int) -> float:
    """Mean request latency (s) with ``concurrency`` requests kept in flight (closed loop, offline)."""
    queue, latencies, started = list(range(len(reqs))), [], {}
    while queue or engine.has_unfinished():
        while queue and len(started) < concurrency:
            i = queue.pop(0)
            started[engine.add_request(reqs[i][0], _params(reqs[i][1]))] = time.perf_counter()
        for ev in engine.step():
            if ev.finished:
                latencies.append(time.perf_counter() - started.pop(ev.request_id))
                engine.result(ev.request_id)
    return statistics.fmean(latencies)


def build(preset: str, smoke: bool, num_blocks: int | None) -> LLMEngine:
    device = "cpu" if smoke else "cuda"
    torch.manual_seed(0)  # initialised on the device in its dtype (no fp32 copy on the host)
    model = random_model(LlamaConfig.from_preset(preset), device, torch.float32 if smoke else torch.bfloat16)
    return LLMEngine(model, None, num_blocks=num_blocks or (512 if smoke else None), max_num_seqs=64)


def family_serve(preset: str, smoke: bool, requests: int, concurrencies: list[int], cap: int) -> list[dict]:
    engine = build(preset, smoke, None)
    vocab = engine.model.config.vocab_size
    recs = []
    for c in concurrencies:
        n = requests if c > 1 else max(4, requests // 8)
        reqs = _workload(n, vocab, (0, 0), f"sharegpt:{cap}", seed=c)
        calibrate(engine, reqs[: min(n, 2 * c)], c)  # warm-up (graphs, allocator)
        latency = calibrate(engine, reqs[: min(n, 2 * c)], c)
        arrivals = poisson(n, c / latency, seed=100 + c)
        run_offline(engine, reqs, arrivals)  # untimed: the first pass compiles and tunes the workload's new shapes
        offline = run_offline(engine, reqs, arrivals).summary("offline-engine")
        http = run_http(engine, reqs, arrivals).summary("http")
        held = [run_http(engine, reqs, arrivals, 0.003).summary("http-delivery-delay-3ms")] \
            if c == max(concurrencies) else []  # fmt: skip
        config = {"preset": preset, "concurrency_target": c, "rate_per_s": c / latency, "requests": n,
                  "workload": f"sharegpt:{cap} (means {SHAREGPT_MEANS})", "max_num_seqs": 64}  # fmt: skip
        notes = [
            f"added TTFT p50: {http['ttft_p50_ms'] - offline['ttft_p50_ms']:.2f} ms; HTTP/offline throughput "
            f"{http['output_tok_s'] / offline['output_tok_s']:.3f}",
            "ITL counts an event of k tokens as k gaps of dt/k (multi-step decoding delivers several tokens at once)",
        ]
        notes += [f"{h['variant']}: HTTP/offline {h['output_tok_s'] / offline['output_tok_s']:.3f}, added TTFT p50 "
                  f"{h['ttft_p50_ms'] - offline['ttft_p50_ms']:.2f} ms" for h in held]
        notes.append("clients in a process of their own (spawned), as in a deployment; the offline pass is timed the "
                     "second time (the first compiles and tunes the workload's new prompt shapes)")
        recs.append(records.make_record(f"serve-{preset}-c{c}", config, [http, *held], [offline], benchmark="serve",
                                        ratio_metric="output_tok_s", notes=notes))  # fmt: skip
    return recs


def family_sampler(preset: str, smoke: bool, batch: int) -> list[dict]:
    from lightning_llmopt.inference.sampling import sample_batch

    engine = build(preset, smoke, None)
    vocab, dev = engine.model.config.vocab_size, engine.device
    rng = random.Random(0)
    hist = [([rng.randrange(vocab) for _ in range(161 + 338)], 161) for _ in range(batch)]
    logits = torch.randn(batch, vocab, device=dev, dtype=engine.dtype)
    options = SamplingParams(temperature=0.8, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5,
                             repetition_penalty=1.1, max_tokens=64)  # fmt: skip
    gens = [torch.Generator(device=dev).manual_seed(i) for i in range(batch)]
    sampled = records.timeit_median(lambda: sample_batch(logits, [options] * batch, gens, hist), 5, 30)
    greedy = records.timeit_median(lambda: sample_batch(logits, [SamplingParams()] * batch, [None] * batch), 5, 30)
    prompts = [h[0][:16] for h in hist]

    def step_ms(params: SamplingParams, n1: int = 8, n2: int = 24) -> float:
        def run(n: int) -> float:
            t = time.perf_counter()
            engine.generate(prompts, [dataclasses.replace(params, max_tokens=n)] * batch)
            return time.perf_counter() - t

        run(n1)
        return (
            1e3
            * (statistics.median(run(n2) for _ in range(3)) - statistics.median(run(n1) for _ in range(3)))
            / (n2 - n1)
        )

    plain = SamplingParams(temperature=0.8, ignore_eos=True)
    results = [
        {"variant": "sampler-top_p-penalties", "median_ms": sampled},
        {"variant": "sampler-greedy", "median_ms": greedy},
        {"variant": "decode-step-sampled", "median_ms": step_ms(plain)},
        {"variant": "decode-step-top_p-penalties", "median_ms": step_ms(dataclasses.replace(options, ignore_eos=True))},
    ]
    ratio = sampled / results[3]["median_ms"]
    config = {"preset": preset, "batch": batch, "vocab": vocab, "history": [161, 338]}
    notes = [f"sampler share of a decode step with top-p and penalties: {ratio:.3%}"]
    return [records.make_record(f"serve-sampler-{preset}-b{batch}", config, results, [], benchmark="serve",
                                ratio_metric=None, notes=notes)]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serving benchmarks (issue 46).")
    parser.add_argument("--family", choices=["serve", "sampler"], required=True)
    parser.add_argument("--preset", default="llama2-7b")
    parser.add_argument("--requests", type=int, default=128, help="per concurrency (an eighth at concurrency 1)")
    parser.add_argument("--concurrency", default="1,8,64")
    parser.add_argument("--cap", type=int, default=1024, help="ShareGPT lengths capped at this many tokens")
    parser.add_argument("--batch", type=int, default=64, help="sampler: rows")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny preset, few requests, temporary records")
    parser.add_argument("--results-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (use --smoke for a CPU check of the code path)")
    if args.smoke:
        torch.set_num_threads(1)  # a tiny model only loses to intra-op threads (and the engine thread has its own)
        args.preset, args.requests, args.cap, args.concurrency = "tiny", min(args.requests, 16), 24, "1,4"
    results_dir = args.results_dir or (Path(tempfile.mkdtemp(prefix="llmopt-bench-")) if args.smoke else None)
    if args.family == "serve":
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
        recs = family_serve(args.preset, args.smoke, args.requests, levels, args.cap)
    else:
        recs = family_sampler(args.preset, args.smoke, args.batch if not args.smoke else 8)
    for rec in recs:
        path = records.write_record(rec, results_dir)
        print(json.dumps({"name": rec["name"], "results": rec["results"], "peers": rec["peers"],
                          "notes": rec["notes"]}, default=str))  # fmt: skip
        print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
