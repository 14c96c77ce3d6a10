"""Helpers of the OpenAI conformance suite: a real uvicorn server in a thread on 127.0.0.1, over an
:class:`LLMEngine` with a tiny random model and the byte tokenizer.

Loaded by path (``tests/`` is not a package; pytest runs with ``--import-mode=importlib``): the folder's conftest.py
registers it as ``sys.modules["_conformance_server"]``, so a test module of the folder can
``import _conformance_server``.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from lightning_llmopt.data.tokenizers import ByteTokenizer
from lightning_llmopt.inference import LLMEngine
from lightning_llmopt.inference.serving import Server, build_app
from lightning_llmopt.models import Llama, LlamaConfig

MODEL = "tiny"  # the served model name
# renders each message as "<role>content\n", then the generation prompt "<assistant>"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


def render(messages: list[dict[str, str]]) -> str:
    """What :data:`TEMPLATE` renders for ``messages`` (the chat prompt the engine sees)."""
    return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"


def tiny_model(seed: int = 0, **overrides: Any) -> Llama:
    """The ``tiny`` preset (256-token context, byte vocabulary), seeded: the same weights in every run."""
    torch.manual_seed(seed)
    return Llama(LlamaConfig.from_preset("tiny", init_std=0.1, **overrides)).eval()


def tiny_server(model: Llama | None = None, **server_kwargs: Any) -> Server:
    """A :class:`Server` named :data:`MODEL` over an engine with ``model`` (default :func:`tiny_model`), the byte
    tokenizer and :data:`TEMPLATE`; ``server_kwargs`` go to :class:`Server`."""
    engine = LLMEngine(model or tiny_model(), ByteTokenizer(), num_blocks=256, block_size=8, max_num_seqs=32)
    server_kwargs.setdefault("chat_template", TEMPLATE)
    return Server(engine, MODEL, **server_kwargs)


@contextlib.contextmanager
def running(server: Server, grace: float | None = None) -> Iterator[str]:
    """Serve ``server`` with uvicorn in a thread on a free port of 127.0.0.1; yields the base URL. The engine thread
    and the server share one intra-op thread (tiny models only lose to more). Every wait is bounded."""
    import uvicorn

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(build_app(server), log_level="warning", timeout_graceful_shutdown=grace)
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not uv.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert uv.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(30)
        sock.close()
        torch.set_num_threads(threads)
        assert not thread.is_alive(), "the server did not shut down"
