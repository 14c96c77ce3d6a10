"""``llmopt serve``: an OpenAI-compatible HTTP server over :class:`~lightning_llmopt.inference.LLMEngine`.

Layers, bottom up: :mod:`.protocol` (request bodies -> ``SamplingParams``), :mod:`.async_engine` (the one engine
loop thread), :mod:`.metrics` (Prometheus), :mod:`.chat` (chat templates), :mod:`.responses` (OpenAI bodies and
chunks), :mod:`.app` (the FastAPI routes). FastAPI, uvicorn and prometheus-client are imported only when a server
is built (``pip install 'lightning_llmopt[serve]'``). See docs/serving.md.
"""

from lightning_llmopt.inference.serving.app import Server, build_app
from lightning_llmopt.inference.serving.async_engine import AsyncEngine, Handle, QueueFull
from lightning_llmopt.inference.serving.protocol import APIError

__all__ = ["APIError", "AsyncEngine", "Handle", "QueueFull", "Server", "build_app"]
