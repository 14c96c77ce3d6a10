"""``llmopt serve``: an OpenAI-compatible HTTP server over the inference engine.

    llmopt serve runs/ckpts --port 8000                         # our checkpoint, a Lightning .ckpt or an HF folder
    llmopt serve hf_out/ --api-key secret --max-queue 256 --served-model-name llama
    llmopt serve --preset tiny --tokenizer byte --port 8000      # a randomly initialised model (smoke tests)

Endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health`` and ``/metrics`` (see
docs/serving.md). The server binds its port at once and answers ``/health`` with ``"loading"`` (and the phases done)
while the engine is built in the background, printing a line per phase; if the build fails it exits non-zero.
Needs the ``serve`` extra: ``pip install 'lightning_llmopt[serve]'`` (FastAPI, uvicorn, prometheus-client).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["TOOL_CALL_PARSERS", "build_parser", "main"]

# the names of lightning_llmopt.inference.serving.tool_calls.TOOL_PARSERS (kept here so that --help imports no torch;
# tests/inference/conformance/test_tools.py checks that they agree)
TOOL_CALL_PARSERS = ("hermes", "llama3_json")


def build_parser() -> argparse.ArgumentParser:
    from lightning_llmopt.cli import options
    from lightning_llmopt.cli.generate import DTYPES

    p = options.parser("llmopt serve", "Serve a model over an OpenAI-compatible HTTP API.")
    p.add_argument("model", nargs="?", default=None, help="checkpoint folder, Lightning .ckpt, or Hugging Face folder")
    p.add_argument("--preset", default=None, help="serve a randomly initialised model of this preset instead")
    options.add_tokenizer(p)
    p.add_argument("--served-model-name", default=None, help="the name clients pass as model (default: folder name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to bind")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="requests that may wait beyond --max-num-seqs before a 503 (default: no limit)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja2 chat template, file or text (default: the tokenizer's or the model folder's)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default="hermes",
        help="how tool calls are read from the text with tool_choice 'auto': hermes (<tool_call>{...}</tool_call>: "
        "Hermes, Qwen 2.5/3) or llama3_json (the whole output is {\"name\", \"parameters\"}: Llama 3.x)",
    )
    p.add_argument("--shutdown-grace", type=float, default=10.0, help="seconds requests in flight may finish")
    p.add_argument("--device", default=None, help="device to run on (default: cuda when available, else cpu)")
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="weights' dtype (default: as stored; bf16 for --preset)"
    )
    p.add_argument("--num-blocks", type=int, default=None, help="KV-cache blocks (default: from free GPU memory)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together, at most")
    p.add_argument(
        "--max-model-len", type=int, default=None, help="longest prompt + completion (default: the model's context)"
    )
    p.add_argument("--no-prefix-cache", action="store_true", help="do not reuse the KV cache of shared prefixes")
    p.add_argument("--no-cuda-graphs", action="store_true", help="decode without CUDA graphs")
    p.add_argument("--trust-pickle", action="store_true", help="allow full unpickling of a Lightning .ckpt")
    options.add_num_threads(p)
    p.add_argument("--no-tuning-cache", action="store_true", help="tune kernels afresh, keep nothing on disk")
    p.add_argument(
        "--tuning-cache-dir",
        default=None,
        help="where tuned kernel choices are kept (default: $LLMOPT_CACHE_DIR/tuning, else lightning_llmopt/tuning "
        "under $XDG_CACHE_HOME or ~/.cache)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="uvicorn's log level",
    )
    return p


def build_engine(args: argparse.Namespace, startup: Any = None) -> Any:
    """The engine ``args`` describe (a checkpoint or a random ``--preset`` model, then the engine options); its
    phases are recorded in ``startup`` (a :class:`~lightning_llmopt.inference.startup.StartupLog`, or a new one)."""
    import torch

    from lightning_llmopt.cli.generate import DTYPES
    from lightning_llmopt.data.tokenizers import load_tokenizer
    from lightning_llmopt.inference import LLMEngine
    from lightning_llmopt.inference.loading import load_model, random_model
    from lightning_llmopt.inference.startup import StartupLog
    from lightning_llmopt.models import LlamaConfig

    startup = startup if startup is not None else StartupLog()
    device = _device(args)
    dtype = DTYPES[args.dtype] if args.dtype else None
    tokenizer = None
    if args.preset is not None:
        startup.mark("random init")
        torch.manual_seed(0)
        default = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = random_model(LlamaConfig.from_preset(args.preset), device, dtype or default)
    else:
        startup.mark("load weights")
        model, tokenizer = load_model(args.model, dtype=dtype, device=device, trust_pickle=args.trust_pickle)
    if args.tokenizer is not None:
        tokenizer = load_tokenizer(args.tokenizer)
    return LLMEngine(
        model,
        tokenizer,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_cache,
        cuda_graphs=not args.no_cuda_graphs,
        tuning_cache=False if args.no_tuning_cache else (args.tuning_cache_dir or True),
        startup=startup,
    )


def _device(args: argparse.Namespace) -> Any:
    import torch

    return torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``llmopt serve``: serves until interrupted (SIGINT/SIGTERM shut it down gracefully)."""
    args = build_parser().parse_args(argv)
    if (args.model is None) == (args.preset is None):
        raise SystemExit("pass exactly one of MODEL (a checkpoint path) and --preset NAME")
    try:
        import uvicorn

        from lightning_llmopt.inference.serving import Server, build_app
    except ImportError as exc:
        raise SystemExit(f"llmopt serve needs the serve extra: pip install 'lightning_llmopt[serve]' ({exc})") from None
    from lightning_llmopt.inference.startup import StartupLog

    if _device(args).type == "cpu":  # here, on the main thread, before any thread of the server starts
        from lightning_llmopt.cli import threads

        plan = threads.configure(num_threads=args.num_threads, flag="--num-threads")
        print(f"llmopt serve: {plan.describe()}", file=sys.stderr, flush=True)
    name = args.served_model_name or (Path(args.model).name if args.model else args.preset)
    startup = StartupLog(on_line=lambda line: print(f"llmopt serve: loading: {line}", file=sys.stderr, flush=True))
    uv: Any = None
    failure: list[str] = []

    def failed(message: str) -> None:  # on the engine thread: stop serving, exit non-zero with the message below
        failure.append(message)
        if uv is not None:
            uv.should_exit = True

    server = Server(
        lambda: _built(build_engine(args, startup), startup),
        name,
        api_key=args.api_key,
        max_queue=args.max_queue,
        chat_template=args.chat_template,
        model_path=args.model,
        grace_s=args.shutdown_grace,
        startup=startup,
        on_failed=failed,
        tool_call_parser=args.tool_call_parser,
    )
    config = uvicorn.Config(
        build_app(server),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=int(args.shutdown_grace) + 1,
    )
    uv = uvicorn.Server(config)
    uv.run()
    if failure:
        raise SystemExit(f"llmopt serve: building the engine failed: {failure[0]}")


def _built(engine: Any, startup: Any) -> Any:
    total = startup.total_s if startup.total_s is not None else 0.0
    print(f"llmopt serve: engine ready in {total:.1f} s", file=sys.stderr, flush=True)
    return engine
