"""The server's start-up: ``/health`` while the engine is built in the background, its phases, and the tuning cache.

    python examples/serve_startup.py            # a random tiny model on CPU, a short injected wait to watch

The server answers at once; ``/health`` is 503 ``{"status": "loading", "startup": {...}}`` (the phases done, the one
running) until the engine is built, then 200 ``{"status": "ok"}``. The engine keeps its phases on
``engine.startup`` and its tuning cache on ``engine.tuning_cache`` (a temporary folder here; by default
``~/.cache/lightning_llmopt/tuning``). On CPU nothing is tuned; on a GPU a second start reads the decisions back.
Needs ``pip install 'lightning_llmopt[serve]'``.
"""

from __future__ import annotations

import socket
import tempfile
import threading
import time

import httpx
import torch
import uvicorn

from lightning_llmopt.data.tokenizers import ByteTokenizer
from lightning_llmopt.inference import LLMEngine
from lightning_llmopt.inference.loading import random_model
from lightning_llmopt.inference.serving import Server, build_app
from lightning_llmopt.inference.startup import StartupLog
from lightning_llmopt.models import LlamaConfig


def main() -> None:
    cache_dir = tempfile.mkdtemp(prefix="llmopt-tuning-")
    startup = StartupLog(on_line=lambda line: print("  phase done:", line))

    def build() -> LLMEngine:
        startup.mark("random init")
        torch.manual_seed(0)
        model = random_model(LlamaConfig.from_preset("tiny"), "cpu", torch.float32)
        startup.mark("a slow step (simulated)")
        time.sleep(0.5)
        return LLMEngine(model, ByteTokenizer(), num_blocks=64, tuning_cache=cache_dir, startup=startup)

    server = Server(build, "demo", startup=startup)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(build_app(server), log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        with httpx.Client(trust_env=False, timeout=10) as h:
            deadline = time.monotonic() + 30
            while (r := h.get(f"{url}/health")).status_code != 200 and time.monotonic() < deadline:
                print("/health", r.status_code, r.json()["status"], "running:", r.json()["startup"]["current"])
                time.sleep(0.2)
            print("/health", r.status_code, r.json())
            busy = h.post(f"{url}/v1/completions", json={"model": "demo", "prompt": "hi", "max_tokens": 4})
            print("/v1/completions", busy.status_code, busy.json()["usage"])
        engine = server.core.engine
        assert engine is not None
        print("phases (s):", {k: round(v, 3) for k, v in engine.startup.seconds().items()})
        print("tuning cache:", engine.tuning_cache)
    finally:
        uv.should_exit = True
        thread.join(30)


if __name__ == "__main__":
    main()
