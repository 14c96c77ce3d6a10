"""Serve a model over the OpenAI API and query it with the official ``openai`` client, in one script.

    python examples/serve.py                         # a random tiny model with the byte tokenizer, on CPU
    python examples/serve.py --model runs/ckpts      # a checkpoint (ours, a Lightning .ckpt or an HF folder)

The server is ``llmopt serve``'s app (``lightning_llmopt.inference.serving``) under uvicorn on 127.0.0.1; a
production server is started with ``llmopt serve MODEL --port 8000`` instead (docs/serving.md). Needs
``pip install 'lightning_llmopt[serve]' openai``.
"""

from __future__ import annotations

import argparse
import socket
import threading
import time

import httpx
import openai
import torch
import uvicorn

from lightning_llmopt.data.tokenizers import ByteTokenizer
from lightning_llmopt.inference import LLMEngine
from lightning_llmopt.inference.serving import Server, build_app
from lightning_llmopt.models import Llama, LlamaConfig

CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"


def engine_for(model_path: str | None) -> LLMEngine:
    if model_path is not None:
        return LLMEngine.from_pretrained(model_path)
    torch.manual_seed(0)
    return LLMEngine(Llama(LlamaConfig.from_preset("tiny")), ByteTokenizer(), num_blocks=256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: a random tiny model)")
    args = parser.parse_args()
    server = Server(engine_for(args.model), "demo", api_key="demo-key", chat_template=CHAT_TEMPLATE)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(build_app(server), log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="demo-key", http_client=httpx.Client(trust_env=False))
    try:
        out = client.completions.create(model="demo", prompt="Once upon a time", max_tokens=24, temperature=0)
        print("completion:", repr(out.choices[0].text), out.usage)
        stream = client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=24,
            temperature=0.8,
            seed=1,
            stream=True,
        )
        print("chat, streamed:", end=" ")
        for chunk in stream:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        print()
        print(httpx.get(f"{url}/metrics", trust_env=False).text.splitlines()[:6])
    finally:
        uv.should_exit = True
        thread.join(30)


if __name__ == "__main__":
    main()
